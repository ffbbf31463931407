"""The memory plan on 2 ranks (issue 16 item 6): step 1's measured peak within 15% of the prediction.

Trainer launches of the project GPT (4 layers, d128, float32, CPU, 2 sequences of 2048 positions per rank):
``sp=2`` (Ulysses, ZeRO 0: each rank holds 1024 positions), ZeRO-3 and ZeRO-2 + full activation checkpointing (dp=2;
the GPT's default chunked loss, so one unit's recomputed backward is the activation peak: before the profile let the
saved set shrink during the backward, ZeRO-3 + AC measured 0.80 of the plan); and ZeRO-3 where the model states
outweigh the activations (a large vocabulary, 128 positions).
Every rank's ratio (the engines' bytes at the step's start + ``LiveTensorBytes``' peak over the step, against the
plan for the real batch) must be within 15%, with the activation term a real share of the prediction. Run as a
script, this file is one rank of that launch.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

CASES = {  # name: Zero3DStrategy kwargs
    "sp2": {"stage": 0, "sp": 2},
    "zero3_ac": {"stage": 3, "activation_checkpointing": "full"},
    "zero2_ac": {"stage": 2, "activation_checkpointing": "full"},
    # ZeRO-3 with large model states: its root unit (a vocab of 16384: embedding + head, 4.2M of the 5M parameters)
    # is gathered through forward and backward, its units and staged gradients exist only there. Summing the table's
    # states with the activations (the plan before 2026-12-07) put this case at 0.74, a user's own MoE model at 0.66
    "zero3_states": {"stage": 3},
}
SEQ, BATCH = 2048, 2
GPT = {"zero3_states": dict(vocab_size=16384, seq_len=128)}  # overrides of the cases' GPT


def _fit(name: str) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_scale  # noqa: F401
    from lightning_scale import Zero3DStrategy
    from lightning_scale.lit import GPTLightningModule
    from lightning_scale.models.gpt import GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**{**dict(vocab_size=1024, seq_len=SEQ, n_layer=4, n_head=4, d_model=128), **GPT.get(name, {})})
    data = torch.randint(0, cfg.vocab_size, (BATCH * 4, cfg.seq_len + 1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)
    strategy = Zero3DStrategy(**CASES[name])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true")
    module = GPTLightningModule(cfg, lr=1e-3, warmup_steps=1, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=loader)
    plan = strategy.memory_plan
    a = plan["estimate"].activations
    return {"measured": plan["measured"], "predicted": plan["predicted"], "ratio": plan["ratio"],
            "activations": a.peak, "policy": a.policy, "tokens": a.tokens, "baseline": plan["baseline"],
            "states": plan["estimate"].device.as_dict(), "kept": a.kept, "loss": a.loss, "head": a.head,
            "recompute": a.recompute,
            "warned": [str(w.message) for w in caught if "[lightning_scale memory]" in str(w.message)]}


def launch_and_check(script: str, tmp_path, name: str, timeout: float = 400, activation_share: float = 0.25) -> list:
    """Run ``script`` (one rank of a 2-rank Trainer launch writing ``plan<rank>.json``) and check every rank's step-1
    ratio within 15%, no warning, activations a real share of the plan (``activation_share``); returns the ranks'
    results."""
    from lightning_scale.testing import run_script

    proc = run_script([sys.executable, script, str(tmp_path), name], timeout=timeout, cwd=tmp_path, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [json.loads((tmp_path / f"plan{r}.json").read_text()) for r in range(2)]
    return check_plan(name, results, activation_share)


def check_plan(name: str, results: list, activation_share: float = 0.25) -> list:
    """Every rank's step-1 ratio within 15%, no warning, activations a real share of the plan."""
    for r in results:
        assert abs(r["ratio"] - 1) <= 0.15, (name, results)
        assert not r["warned"], (name, r)
        assert r["activations"] > activation_share * r["predicted"], (name, r)
    print(name, [round(r["ratio"], 3) for r in results])
    return results


def launch_many(script: str, tmp_path, names, timeout: float = 600) -> dict:
    """One 2-rank launch of ``script`` fitting each of ``names`` in turn (one Trainer after the other, each measuring
    its own step 1): name -> the ranks' results, or the launch's error text for every name when it failed (each test
    then fails with it). One launch per group instead of per case: the interpreters, imports and process group are
    paid once."""
    from lightning_scale.testing import run_script

    proc = run_script([sys.executable, script, str(tmp_path), ",".join(names)], timeout=timeout, cwd=tmp_path,
                      ranks=2)
    out = {}
    for name in names:
        files = [tmp_path / f"plan{r}_{name}.json" for r in range(2)]
        if proc.returncode == 0 and all(f.exists() for f in files):
            out[name] = [json.loads(f.read_text()) for f in files]
        else:
            out[name] = proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def main(fit) -> None:
    """This file as a script: one rank of the launch, writing its plan<rank>.json (several names, comma-separated:
    fitted one after the other, each writing plan<rank>_<name>.json)."""
    import gc

    out, names = sys.argv[1], sys.argv[2].split(",")
    rank = os.environ.get("RANK", "0")
    for name in names:
        result = fit(name)
        path = f"plan{rank}.json" if len(names) == 1 else f"plan{rank}_{name}.json"
        with open(os.path.join(out, path), "w") as f:
            json.dump(result, f)
        gc.collect()  # the previous Trainer's tensors gone before the next one measures its step 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_step1_peak_within_15_percent_on_2_ranks(tmp_path, name):
    results = launch_and_check(__file__, tmp_path, name, activation_share=0.0 if name in GPT else 0.25)
    want_tokens = BATCH * GPT.get(name, {}).get("seq_len", SEQ) // CASES[name].get("sp", 1)
    if name == "zero3_states":  # the table's states summed with the activations (the plan before) are far off here
        for r in results:
            summed = r["states"]["total"] - r["states"]["optimizer_state"] + r["activations"]
            assert r["measured"] < 0.85 * summed, (r["measured"], summed)
    assert all(r["tokens"] == want_tokens for r in results), results


if __name__ == "__main__":
    main(_fit)
