"""Parameters a tensor-parallel plan keeps whole must stay equal over the tp ranks; the strategy checks it after steps
1, 10, 100, 1000 and 10000 (``lightning_scale/strategies/tp_replicas.py``) and warns naming the ones that drifted.

Apertus' MLP activation (xIELU) holds trainable scalars applied to the split intermediate features; transformers' own
tp plan leaves that module out, so each rank trains its copy on a partial gradient. Through a real Trainer
(``fit_hf.py``, float32, 4 SGD steps, tp=2): with transformers' plan as a user's plan the check names every
``act_fn.alpha_p`` / ``alpha_n`` after step 1, and with the built-in plan (which sums their gradients over tp) it
names none and the losses are one device's. A 2-rank check of the warning itself: a parameter made different on the
two ranks is named, with the plan styles that fix it; equal ones are not.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from lightning_scale.testing import run_distributed, run_script

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_hf.py")


def _fit(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), "--family", "apertus", *args], timeout=240,
                      cwd=tmp_path, ranks=1 if "single" in args else 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(400)
def test_a_plan_that_leaves_trainable_scalars_partial_is_named_after_step_1(tmp_path):
    pytest.importorskip("transformers")
    ref = _fit(tmp_path, "single", "--strategy", "single", "--devices", "1")["losses"]
    builtin = _fit(tmp_path, "builtin", "--option", "tp=2")
    own = _fit(tmp_path, "own", "--option", "tp=2", "--own-plan")
    assert builtin["tp_replicas"] == [{"step": 1, "drifted": {}}], builtin["tp_replicas"]
    assert max(abs(a - b) for a, b in zip(builtin["losses"], ref)) < 1e-5, (builtin["losses"], ref)
    (check,) = own["tp_replicas"]
    want = {f"model.model.layers.{i}.mlp.act_fn.{p}" for i in range(4) for p in ("alpha_p", "alpha_n")}
    assert check["step"] == 1 and set(check["drifted"]) == want, check


def _worker(rank: int, world: int) -> list:
    import torch.distributed as dist

    from lightning_scale.strategies.tp_replicas import ReplicaCheck

    class Topology:
        tp_group = dist.group.WORLD

    class Strategy:
        engines, topology, model = [], Topology(), None

        def gathered(self, module):
            import contextlib

            return contextlib.nullcontext()

    class Trainer:
        global_step = 1

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    with torch.no_grad():
        model[1].weight[0] += 0.1 * rank  # this one drifted on rank 1
    strategy = Strategy()
    strategy.model = model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ReplicaCheck(strategy).on_train_batch_end(Trainer(), None, None, None, 0)
    return [str(w.message) for w in caught] + [json.dumps(strategy.tp_replicas)]


@pytest.mark.timeout(200)
def test_the_warning_names_the_drifted_parameter_on_every_rank():
    for out in run_distributed(_worker, 2, timeout=150):
        *messages, record = out
        assert len(messages) == 1, out
        assert messages[0].startswith("[lightning_scale tp replicas] after step 1: ") and "1.weight (" in messages[0]
        assert "0.weight" not in messages[0] and "replicated_with_grad_allreduce" in messages[0]
        assert list(json.loads(record)[0]["drifted"]) == ["1.weight"]
