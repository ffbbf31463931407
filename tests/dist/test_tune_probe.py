"""The autotuner's probe on 2 ranks: the winner of a budget only stage 3 + offload fits, measured once; the memory
plan's prediction for it is within 15% of the measured step (live tensor bytes: on a CPU host and device are one
memory, so the prediction compared is :func:`lightning_scale.tune.one_memory_bytes`: every state once, offload's fp32
host copies being aliases of the device shard there, the step's phases not summed); compiled probes; a Hugging Face
Llama through ``--module``."""

from __future__ import annotations

import json

import pytest

from lightning_scale.estimate import _model_from_spec
from lightning_scale.tune import measure, plan


SPACE = dict(tps=(1,), pps=(1,), acs=(None, "full"), relief=())  # the constructions below: no relief ladder


def _offloaded3(c) -> bool:
    return c.stage == 3 and c.offload != "none"


@pytest.mark.timeout(240)
def test_winner_predicted_memory_within_15_percent_of_measured():
    model = _model_from_spec("gpt_small")
    everything = plan(model, model.cfg, 2, 4, 1e15, **SPACE)
    z3 = min(r.predicted for r in everything if _offloaded3(r.candidate))
    rest = min(r.predicted for r in everything if not _offloaded3(r.candidate))
    rows = plan(model, model.cfg, 2, 4, (z3 + rest) / 2, **SPACE)  # only ZeRO-3 + offload fits
    winner = next(r for r in rows if not r.reason)
    assert winner.candidate.stage == 3 and winner.candidate.offload != "none"
    res = measure(model.cfg, winner.candidate, steps=2, warmup=1, timeout=180)
    assert res["tokens_per_s"] > 0
    rel = abs(winner.predicted_all - res["measured_bytes"]) / res["measured_bytes"]
    assert rel < 0.15, (winner.candidate.key, winner.predicted_all, res["measured_bytes"])


@pytest.mark.timeout(240)
def test_probe_honours_the_precision():
    """bf16-mixed probes run (the CLI no longer refuses them) and hold other bytes than 32-true: bf16 parameters next
    to the fp32 master shards; the memory plan for bf16-mixed predicts that layout."""
    from lightning_scale.tune import Candidate, predict_bytes

    model = _model_from_spec("gpt_small")
    c = Candidate(stage=2, offload="none", dp=2, micro_batch=2)
    fp32 = measure(model.cfg, c, steps=1, warmup=1, timeout=180)
    bf16 = measure(model.cfg, c, steps=1, warmup=1, timeout=180, precision="bf16-mixed")
    assert bf16["tokens_per_s"] > 0
    assert abs(bf16["measured_bytes"] - fp32["measured_bytes"]) / fp32["measured_bytes"] > 0.05, (bf16, fp32)
    pred32, pred16 = (predict_bytes(model, model.cfg, c, p)[1] for p in ("32-true", "bf16-mixed"))
    assert (bf16["measured_bytes"] - fp32["measured_bytes"]) * (pred16 - pred32) > 0  # the same direction


@pytest.mark.slow  # two probes, one compiling (aot_eager: inductor's C++ build did not finish in 500 s at load 35)
@pytest.mark.timeout(600)
def test_compile_probe_compiles_and_reports_compile_time_apart():
    """``--compile`` rows are real compiled probes: the units compiled (Dynamo graphs > 0; none for the eager twin),
    the warm-up's compile seconds reported apart from the steady steps' tokens/s. The backend is aot_eager (Dynamo +
    AOTAutograd, the same capture as inductor without its C++ build, as tests/dist/test_compile.py does)."""
    from lightning_scale.tune import Candidate

    model = _model_from_spec("gpt_tiny")
    eager = Candidate(stage=2, offload="none", dp=2, micro_batch=1)
    compiled = Candidate(stage=2, offload="none", dp=2, micro_batch=1, compile=True)
    a = measure(model.cfg, eager, steps=2, warmup=2, timeout=300)
    b = measure(model.cfg, compiled, steps=2, warmup=2, timeout=500, compile_setting={"backend": "aot_eager"})
    assert a["graphs"] == 0 and a["compiled_units"] == 0, a
    assert b["graphs"] >= 1 and b["compiled_units"] >= 1, b
    # The first step's capture + compile, not in tokens/s: above the eager twin's warm-up extra. Dynamo + AOTAutograd
    # tracing took 0.88-1.2 s on the quiet box (the former fixed 1.0 s threshold failed at 0.88 s in CI), the eager
    # warm-up's extra 0.0 s.
    assert b["tokens_per_s"] > 0 and b["compile_s"] > max(0.25, a["compile_s"]), (a, b)
    print(f"eager {a['tokens_per_s']:,.0f} tokens/s (warm-up extra {a['compile_s']:.1f} s); compiled "
          f"{b['tokens_per_s']:,.0f} tokens/s, compile {b['compile_s']:.1f} s, probe {b['probe_s']:.0f} s")


@pytest.mark.slow  # three 2-rank probes of the Llama: 169 s at load ~35
@pytest.mark.timeout(400)
def test_module_hf_llama_is_probed_through_the_cli(tmp_path, capsys):
    """``--module`` with a LightningModule holding a Hugging Face LlamaForCausalLM: the ranks build it, its own
    configure_optimizers / training_step run; a ZeRO-3 + offload-all layout and a tp=2 layout are measured."""
    from lightning_scale.tune import main

    results = tmp_path / "r.jsonl"
    rc = main(["--module", "tune_llama_module:TinyLlama", "--devices", "2", "--global-batch", "2", "--seq-len", "32",
               "--memory-budget", "1GiB", "--stages", "3", "--offloads", "all", "--ac", "none", "--pp", "1",
               "--max-probes", "3", "--confirm", "0", "--steps", "1", "--results", str(results)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert all("tokens_per_s" in r for r in rows), rows
    keys = {r["key"].split("/mb")[0] for r in rows}
    assert keys == {"z3/all/dp2tp1pp1", "z3/all/dp1tp2pp1"}, keys
    assert "winner: Zero3DStrategy(stage=" in out
    for r in rows:
        print(f"{r['key']}: predicted one memory {r['predicted_all_bytes'] / 2**20:.1f} MiB, measured "
              f"{r['measured_bytes'] / 2**20:.1f} MiB")


@pytest.mark.timeout(300)
def test_long_sequence_relief_winner_memory_within_15_percent_of_measured():
    """At 2048 positions and a budget below every layout as it is, the survivors climbed the relief ladder; the
    first one's probe and the first checkpointed one's (tiled MLP / head tiling / activation offload set through
    parallelize()) run, their live bytes within 15% of the plan (checkpointing's backward phase counted)."""
    model = _model_from_spec("gpt_small:seq_len=2048")
    space = dict(tps=(1,), pps=(1,), acs=(None, "full"), stages=(2, 3))
    smallest = min(r.predicted for r in plan(model, model.cfg, 2, 2, 1e15, relief=(), **space))
    relieved = min(r.predicted for r in plan(model, model.cfg, 2, 2, 0.0, **space))  # every ladder climbed
    # 0.96 since ZeRO-3's root unit is counted (2026-12-07): a floor the relief ladder does not lower
    assert relieved < smallest * 0.97, (relieved, smallest)
    rows = plan(model, model.cfg, 2, 2, (relieved + smallest) / 2, **space)
    survivors = [r for r in rows if not r.reason]
    assert survivors and all(r.candidate.relief for r in survivors)
    for winner in (survivors[0], next(r for r in survivors if r.candidate.ac)):
        res = measure(model.cfg, winner.candidate, steps=1, warmup=1, timeout=240)
        assert res["tokens_per_s"] > 0
        rel = abs(winner.predicted_all - res["measured_bytes"]) / res["measured_bytes"]
        assert rel < 0.15, (winner.candidate.key, winner.predicted_all, res["measured_bytes"])


@pytest.mark.timeout(300)
def test_split_root_winner_memory_within_15_percent_of_measured_and_below_the_whole_root():
    """ZeRO-3 on the bench GPT (mb1, no recompute) with a budget between it as it is and with its root unit split
    (tune_plan's split_root rung): the winner takes the split (``zero.unit_modules`` through parallelize()); its probe
    within 15% of the plan, and below the same layout with the whole root by at least half the predicted saving."""
    import dataclasses

    model = _model_from_spec("gpt_small")
    space = dict(stages=(3,), offloads=("none",), tps=(1,), pps=(1,), acs=(None,), micro_batches=(1,))
    whole = next(r for r in plan(model, model.cfg, 2, 4, 1e15, relief=(), **space) if not r.reason)
    rows = plan(model, model.cfg, 2, 4, whole.predicted - 1, **space)
    winner = next(r for r in rows if not r.reason)
    assert winner.candidate == dataclasses.replace(whole.candidate, unit_modules=("Block", "lm_head", "wte"))
    measured = {}
    for row in (winner, whole):
        res = measure(model.cfg, row.candidate, steps=1, warmup=1, timeout=180)
        assert res["tokens_per_s"] > 0
        measured[row.candidate.relief] = res["measured_bytes"]
    rel = abs(winner.predicted_all - measured["/splitroot"]) / measured["/splitroot"]
    assert rel < 0.15, (winner.predicted_all, measured)
    saved = whole.predicted_all - winner.predicted_all  # 6.0 MiB predicted
    assert measured[""] - measured["/splitroot"] > 0.5 * saved, (saved, measured)


@pytest.mark.timeout(200)
def test_python_dash_m_probes_a_module(tmp_path):
    """``python -m lightning_scale.tune --module ...`` runs the file as __main__; its probes must still see a
    ``--module`` Shape as one (once a __main__.Shape made measure() start the GPT worker: every probe failed with
    ``GPTConfig.__init__() got an unexpected keyword argument 'n_kv_head'``). One probe of the tiny HF Llama, at a
    budget only a relieved layout fits."""
    import os
    import sys

    from lightning_scale.testing import run_script

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "strategies")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = run_script([sys.executable, "-m", "lightning_scale.tune", "--module", "tune_llama_module:TinyLlama",
                       "--devices", "2", "--global-batch", "2", "--seq-len", "1024", "--memory-budget", "40MiB",
                       "--stages", "2", "--tp", "1", "--pp", "1", "--max-probes", "1", "--confirm", "0", "--steps",
                       "1", "--results", str(tmp_path / "r.jsonl")], timeout=180, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "winner: Zero3DStrategy(stage=2" in proc.stdout and "tiled_mlp=256" in proc.stdout, proc.stdout


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_probe_measures_the_gpu_bytes():
    """On a GPU machine the CLI's probes run there (nccl, one GPU per rank): ZeRO-2 and ZeRO-3 + optimizer offload of
    the bench GPT on one GPU; the measured bytes are the GPU's (the offloaded states are host memory, not counted)
    and within 30% of the device prediction (not run on the CPU machines: skipped without CUDA)."""
    import torch

    from lightning_scale.tune import Candidate, predict_bytes

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model_from_spec("gpt_small")
    for c in (Candidate(stage=2, offload="none", dp=1, micro_batch=4), Candidate(stage=3, offload="optimizer", dp=1,
                                                                                 micro_batch=4, ac="full")):
        res = measure(model.cfg, c, steps=2, warmup=1, timeout=240, device="cuda")
        device, _ = predict_bytes(model, model.cfg, c)
        print(f"{c.key}: {res['tokens_per_s']:,.0f} tokens/s, measured {res['measured_bytes'] / 2**20:.1f} MiB, "
              f"predicted device {device / 2**20:.1f} MiB")
        assert res["space"] == "device" and res["tokens_per_s"] > 0
        assert abs(device - res["measured_bytes"]) / res["measured_bytes"] < 0.30, (c.key, device, res)
