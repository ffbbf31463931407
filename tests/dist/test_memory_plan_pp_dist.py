"""The memory plan at pp=2 (issue 16 item 6): every pipeline stage's step-1 peak within 15% of its prediction.

Trainer launches of the project GPT (4 layers, d128, float32, CPU, 2 ranks = 2 pipeline stages, a batch of 4
sequences of 1024 positions in 4 micro-batches): 1F1B, GPipe and interleaved 1F1B (2 chunks per rank), activation
checkpointing off and full, and zero-bubble (ZB-H1, split backward) without checkpointing and with full checkpointing
(its stages hold checkpointed units, so their backward is not split: 1F1B's in-flight counts); and an unchanged HF
LlamaForCausalLM of the same size at 1F1B, AC off and full (its stages from the automatic adapter). Each stage's plan walks its
own schedule (lightning_scale/pipeline_plan.py): 1F1B keeps 2 micro-batches in flight on stage 0 and 1 on stage 1,
GPipe 4 on both; the sent activations / input gradients stay alive until the step's end; zero-bubble keeps each
micro-batch's graph, the recorded module outputs and (from its I) their gradients until its W. Every rank's
ratio (the engines' bytes at the step's start + ``LiveTensorBytes``' peak over the step, against its stage's plan) must
be within 15%, with the activation term a real share of the prediction and the in-flight count the schedule's. Run as
a script, this file is one rank of that launch.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

CASES = {  # name: (schedule, activation_checkpointing, virtual stages)
    "1f1b": ("1f1b", None, 1),
    "1f1b_ac": ("1f1b", "full", 1),
    "gpipe": ("gpipe", None, 1),
    "gpipe_ac": ("gpipe", "full", 1),
    "interleaved": ("interleaved_1f1b", None, 2),
    "interleaved_ac": ("interleaved_1f1b", "full", 2),
    "zero_bubble": ("zero_bubble", None, 1),
    "zero_bubble_ac": ("zero_bubble", "full", 1),  # stages of checkpointed units are not split: 1F1B's walk
    "llama_1f1b": ("1f1b", None, 1),  # an unchanged HF LlamaForCausalLM, its stages from the automatic adapter
    "llama_1f1b_ac": ("1f1b", "full", 1),
}
SEQ, BATCH, MICRO = 1024, 4, 4
# most micro-batches holding activations per pipeline rank: 1F1B min(pp - s, m), GPipe m; interleaved (v=2, 4 chunks
# of one block) counts (chunk, micro-batch) pairs; zero-bubble keeps each until its W (rank 1 defers one W)
IN_FLIGHT = {"1f1b": (2, 1), "gpipe": (4, 4), "interleaved_1f1b": (5, 3), "zero_bubble": (2, 2)}


def _fit(name: str, one_mb: bool = False) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_scale  # noqa: F401
    from lightning_scale import Zero3DStrategy
    from lightning_scale.lit import GPTLightningModule
    from lightning_scale.models.gpt import GPTConfig

    if one_mb:  # the mutation: the plan counts one micro-batch's activations, not the schedule's in flight
        import dataclasses

        import lightning_scale.pipeline_plan as plan

        original = plan.schedule_peak

        def one(schedule, rank, stages, **kw):
            k = original(schedule, rank, stages, **kw).max_in_flight
            return original(schedule, rank, {s: dataclasses.replace(st, keep=st.keep / k) for s, st in stages.items()},
                            **kw)
        plan.schedule_peak = one
    schedule, ac, virtual = CASES[name]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=1024, seq_len=SEQ, n_layer=4, n_head=4, d_model=128)
    data = torch.randint(0, cfg.vocab_size, (BATCH * 2, SEQ + 1))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)
    strategy = Zero3DStrategy(stage=0, pp=2, microbatches=MICRO, schedule=schedule, activation_checkpointing=ac,
                               virtual_stages=virtual)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true")
    module = HFLlama() if name.startswith("llama") else GPTLightningModule(cfg, lr=1e-3, warmup_steps=1, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=loader)
    plan = strategy.memory_plan
    a = plan["estimate"].activations
    w = a.pipeline
    return {"measured": plan["measured"], "predicted": plan["predicted"], "ratio": plan["ratio"],
            "activations": a.peak, "policy": a.policy, "source": a.source, "tokens": a.tokens, "pp_rank": w.pp_rank,
            "in_flight": w.in_flight, "max_in_flight": w.max_in_flight, "p2p": w.p2p, "at": w.at,
            "states": plan["estimate"].device.total, "baseline": plan["baseline"],
            "warned": [str(m.message) for m in caught if "[lightning_scale memory]" in str(m.message)]}


def HFLlama():
    """A LightningModule holding an unchanged HF ``LlamaForCausalLM`` of the GPT cases' size (d128 x 4 layers, 4
    heads, SwiGLU 512, vocabulary 1024, rotary, sdpa, fp32)."""
    import lightning.pytorch as pl
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_scale.models.gpt import lm_loss

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                              use_cache=False)
            cfg._attn_implementation = "sdpa"
            self.model = LlamaForCausalLM(cfg)

        def training_step(self, batch, batch_idx):  # not called under pp: the strategy runs the schedule
            x, y = batch
            return lm_loss(self.model(input_ids=x).logits, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Module()


def _launch(tmp_path, name, *extra):
    from lightning_scale.testing import run_script

    proc = run_script([sys.executable, __file__, str(tmp_path), name, *extra], timeout=400, cwd=tmp_path, ranks=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((tmp_path / f"plan{r}.json").read_text()) for r in range(2)], proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_stage_step1_peak_within_15_percent_at_pp2(tmp_path, name):
    results, stdout = _launch(tmp_path, name)
    results.sort(key=lambda r: r["pp_rank"])
    for r in results:
        assert abs(r["ratio"] - 1) <= 0.15, (name, results)
        # live tensor bytes are deterministic here (measured 0.96-1.06); the p2p buffers are ~10% of the AC
        # cases' peak (a walk without them measured 1.10 / 1.11 on stage 0), so a tighter bound is what sees them.
        # The HF Llama unit is profiled with fake rotary cos / sin (counted from its Linear sizes instead, the
        # plan before: 1.07 / 1.03, with AC 1.10 / 1.04)
        assert r["source"] == "profiled", r
        assert abs(r["ratio"] - 1) <= 0.06, (name, results)
        assert not r["warned"], (name, r)
        assert r["activations"] > 0.25 * r["predicted"], (name, r)
        assert r["tokens"] == BATCH // MICRO * SEQ, r
    want = (2, 1) if name == "zero_bubble_ac" else IN_FLIGHT[CASES[name][0]]  # I frees an unsplit stage's keep
    assert tuple(r["max_in_flight"] for r in results) == want, results
    head = "[lightning_scale memory] step 1 peak per device (pp rank"
    lines = [ln for ln in stdout.splitlines() if ln.startswith(head)]
    assert len(lines) == 2, stdout[-3000:]  # each stage prints its own check
    startup = [ln for ln in stdout.splitlines() if "predicted peak / device, pp rank" in ln]
    assert len(startup) == 2 and "micro-batches in flight" in startup[0], stdout[-3000:]
    print(name, [(r["pp_rank"], round(r["ratio"], 3), r["in_flight"]) for r in results])


@pytest.mark.slow
def test_a_plan_of_one_micro_batch_is_caught(tmp_path):
    """The mutation (each stage counted with one micro-batch's activations instead of the schedule's 4 in flight)
    puts both GPipe stages outside 15%, and each warns."""
    results, _ = _launch(tmp_path, "gpipe", "--one-mb")
    assert all(r["ratio"] > 1.15 and len(r["warned"]) == 1 for r in results), results


if __name__ == "__main__":
    out, name = sys.argv[1], sys.argv[2]
    result = _fit(name, "--one-mb" in sys.argv)
    with open(os.path.join(out, f"plan{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(result, f)
