"""The memory plan (issue 16 item 6): the activation estimate and the step-1 check of Zero3DStrategy.

One Trainer process fits the project GPT for one step at 4 shapes (short / long sequence x activation checkpointing
off / full; and long + full + the chunked loss, long + selective + the chunked loss), CPU, float32, ZeRO-0, one
rank: the strategy's measured step-1 peak (the engines' bytes at the step's start + ``LiveTensorBytes``' peak over
the step) is within 15% of the plan's prediction, and the plan's activation
term is a real share of it (so the check cannot pass on model states alone). A prediction made wrong on purpose
(the activation term dropped) makes the strategy warn. With ``tiled_mlp=256`` (2 shapes) the plan profiles the unit
tiled and stays within 15%, where the untiled profile is > 15% above the measurement; with ``tiled_mlp_modules`` tiling
2 of the 4 blocks both kinds of unit are profiled and counted; with ``tiled_attention=1`` the unit is profiled with its
attention head-tiled too. Run as a script, this file is that Trainer process.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest

SHAPES = {  # name: (seq_len, micro_batch, activation_checkpointing, loss chunk, tiled_mlp)
    "short": (128, 2, None, 0, 0),
    "short_ac": (128, 2, "full", 0, 0),
    "long": (2048, 2, None, 0, 0),
    "long_ac": (2048, 2, "full", 0, 0),
    "long_ac_chunked": (2048, 2, "full", 256, 0),  # + the chunked loss: one chunk's logits at a time
    "long_selective": (2048, 2, "selective", 256, 0),  # selective AC: the matmul / attention outputs kept
}
TILED = {  # the tiled MLP (and norms), 256 positions per tile: the plan profiles the unit tiled
    "long_tiled": (2048, 2, None, 0, 256),
    "long_ac_chunked_tiled": (2048, 2, "full", 256, 256),
}
SOME = {  # tiled_mlp_modules tiling only blocks 0 and 1 of 4: the plan profiles both kinds of unit
    "long_tiled_some": (2048, 2, None, 0, 256),
}
MODULES = {"long_tiled_some": ["*blocks.0.mlp", "*blocks.1.mlp"]}
HEADS = {  # + the head-tiled attention, one head per group: the plan profiles the unit with both tiled
    "long_ac_chunked_tiled_heads": (2048, 2, "full", 256, 256),
}
SHAPES.update(TILED)
SHAPES.update(SOME)
SHAPES.update(HEADS)


def _fit(name: str, drop_activations: bool = False, untiled_too: bool = False) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_scale  # noqa: F401
    from lightning_scale import Zero3DStrategy
    from lightning_scale.lit import GPTLightningModule
    from lightning_scale.models.gpt import GPTConfig
    from lightning_scale.strategies import memory_plan as report

    seq, batch, ac, chunk, tiled = SHAPES[name]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, seq_len=seq, n_layer=4, n_head=4, d_model=128, loss_chunk=chunk)
    data = torch.randint(0, cfg.vocab_size, (batch * 2, seq + 1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch)
    if drop_activations:  # the mutation: a plan that leaves the activations out
        original = report.plan_for_batch

        def states_only(strategy, micro_batch, seq_len):
            import dataclasses

            e = original(strategy, micro_batch, seq_len)
            return dataclasses.replace(e, activations=dataclasses.replace(e.activations, kept=0, recompute=0,
                                                                          head=0, loss=0))
        report.plan_for_batch = states_only
    strategy = Zero3DStrategy(stage=0, activation_checkpointing=ac, tiled_mlp=tiled,
                              tiled_mlp_modules=MODULES.get(name), tiled_attention=1 if name in HEADS else 0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true")
    module = GPTLightningModule(cfg, lr=1e-3, warmup_steps=1, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=loader)
    plan = strategy.memory_plan
    a = plan["estimate"].activations
    out = {"measured": plan["measured"], "predicted": plan["predicted"], "ratio": plan["ratio"],
           "activations": a.peak, "loss": a.loss, "policy": a.policy, "tokens": a.tokens, "kept": a.kept,
           "warned": [str(w.message) for w in caught if "[lightning_scale memory]" in str(w.message)]}
    if untiled_too:  # the same plan with the tiles left out of the profile
        import dataclasses

        config = strategy.config
        # the head-tiled shapes: only the attention's tiling left out (the MLP stays tiled)
        strategy.config = (dataclasses.replace(config, tiled_attention=0) if name in HEADS
                           else dataclasses.replace(config, tiled_mlp=0))
        try:
            e = report.plan_for_batch(strategy, batch, seq)
        finally:
            strategy.config = config
        out["untiled_predicted"] = e.first_step_peak
        if name in SOME:  # the plan that profiles every unit tiled (what it did before it saw the mixture)
            from lightning_scale.estimate import activations_for_model, with_activations
            from lightning_scale.models.gpt import GPT

            with torch.device("meta"):
                meta = GPT(cfg)
            acts = activations_for_model(meta, seq_len=seq, micro_batch=batch, precision="32-true", tiled_mlp=tiled,
                                         activation_checkpointing=ac)
            e = plan["estimate"]
            out["all_tiled_predicted"] = with_activations(e, acts, step_tensor_numel=None).first_step_peak
    return out


def _run(tmp_path, *args) -> dict:
    from lightning_scale.testing import run_script

    out = tmp_path / "plan.json"
    proc = run_script([sys.executable, __file__, str(out), *args], timeout=400, cwd=tmp_path, ranks=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stdout


def test_step1_peak_within_15_percent_of_the_plan(tmp_path):
    shapes = [n for n in SHAPES if n not in TILED and n not in SOME and n not in HEADS]
    results, stdout = _run(tmp_path, *shapes)
    for name, r in results.items():
        assert abs(r["ratio"] - 1) <= 0.15, (name, results)
        assert not r["warned"], (name, r)
        assert r["activations"] > 0.25 * r["predicted"] or name.startswith("short"), (name, r)
    # long sequences: activations dominate and checkpointing cuts them
    assert results["long"]["activations"] > 0.5 * results["long"]["predicted"], results
    assert results["long_ac"]["activations"] < 0.5 * results["long"]["activations"], results
    assert results["long_ac"]["policy"] == "full" and results["long"]["tokens"] == 4096
    assert results["long_ac_chunked"]["loss"] * 4 <= results["long_ac"]["loss"], results  # 256 of 2048 positions
    # selective keeps the matmul / attention outputs: between full checkpointing and none, and checked above
    sel, full, none = (results[n]["kept"] for n in ("long_selective", "long_ac_chunked", "long"))
    assert 2 * full < sel < 0.8 * none, results
    # every output of a kept op is cached, also those autograd does not save (the attention / MLP output
    # projections): counting only the saved ones measured 1.13 here, counting all 1.02 (live bytes: deterministic)
    assert abs(results["long_selective"]["ratio"] - 1) <= 0.06, results["long_selective"]
    lines = [line for line in stdout.splitlines() if line.startswith("[lightning_scale memory] step 1 peak")]
    assert len(lines) == len(shapes), stdout[-3000:]
    startup = [line for line in stdout.splitlines() if line.strip().startswith("predicted peak / device")]
    assert len(startup) == len(shapes) and "MiB from step 2" in startup[0], stdout[-3000:]  # the startup table row


def test_tiled_mlp_step1_peak_within_15_percent_of_the_plan(tmp_path):
    """tiled_mlp=256 (without / with full AC and the chunked loss): the plan profiles the unit tiled, so the step-1
    peak stays within 15% of it; the untiled profile would over-predict (checked in the same process: the plan
    without the tiles is > 15% above the measurement)."""
    results, stdout = _run(tmp_path, *TILED, "--untiled-too")
    for name, r in results.items():
        assert abs(r["ratio"] - 1) <= 0.15, (name, results)
        assert not r["warned"], (name, r)
        assert r["untiled_predicted"] > 1.15 * r["measured"], (name, r)  # the tiles' share is real
    lines = [line for line in stdout.splitlines() if line.startswith("[lightning_scale memory] step 1 peak")]
    assert len(lines) == len(TILED), stdout[-3000:]


def test_tiled_attention_step1_peak_within_15_percent_of_the_plan(tmp_path):
    """tiled_attention=1 on top of full AC, the chunked loss and the tiled MLP: the plan profiles the unit with its
    attention head-tiled (0.94 when written), and the plan without the head tiling is > 15% above the measurement."""
    results, stdout = _run(tmp_path, *HEADS, "--untiled-too")
    for name, r in results.items():
        assert abs(r["ratio"] - 1) <= 0.15, (name, results)
        assert not r["warned"], (name, r)
        assert r["untiled_predicted"] > 1.15 * r["measured"], (name, r)
    assert "tiled attention           1 heads per group (4 attentions)" in stdout, stdout[-3000:]


def test_tiled_mlp_modules_on_some_units_within_15_percent_of_the_plan(tmp_path):
    """tiled_mlp_modules tiling 2 of the 4 blocks' MLPs: the plan profiles a tiled and an untiled unit and counts
    each kind; profiling every unit tiled (the plan before it saw the mixture) is > 15% under the measurement, every
    unit untiled > 15% over it."""
    results, _ = _run(tmp_path, *SOME, "--untiled-too")
    r = results["long_tiled_some"]
    assert abs(r["ratio"] - 1) <= 0.15 and not r["warned"], r
    assert r["untiled_predicted"] > 1.15 * r["measured"], r
    assert r["all_tiled_predicted"] < 0.85 * r["measured"], r


def test_a_wrong_plan_warns(tmp_path):
    results, stdout = _run(tmp_path, "long", "--drop-activations")
    r = results["long"]
    assert r["ratio"] > 1.15, r
    assert len(r["warned"]) == 1 and "differs from the memory plan" in r["warned"][0], r


if __name__ == "__main__":
    out, names = sys.argv[1], [a for a in sys.argv[2:] if not a.startswith("--")]
    drop = "--drop-activations" in sys.argv
    with open(out, "w") as f:
        json.dump({n: _fit(n, drop, "--untiled-too" in sys.argv) for n in names}, f)

