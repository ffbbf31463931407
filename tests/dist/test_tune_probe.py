"""The autotuner's probe on 2 ranks: the winner of a budget only stage 3 + offload fits, measured once; the memory
plan's prediction for it is within 15% of the measured step (live tensor bytes: on a CPU host and device are one
memory, so the prediction compared is device + host)."""

from __future__ import annotations

import pytest

from lightning_scale.estimate import _model_from_spec
from lightning_scale.tune import measure, plan


SPACE = dict(tps=(1,), pps=(1,), acs=(None, "full"))


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
