"""The pipeline runtime under NCCL's point-to-point semantics, emulated on gloo (lightning_scale.comm.p2p_emulate):
tags ignored, one FIFO stream per (group, pair) in which a send may wait for the peer's receive, communicators created
collectively at their first transfer. No GPU here, and one GPU cannot run pp > 1: this is what stands for the NCCL runs.

* every schedule at pp=2 and pp=4 (test_pipeline_parity's runs: GPipe, 1F1B, interleaved, zero-bubble; tied embedding
  at pp=4) trains to the single-process result (float64, 1e-10) with the pipeline group's direction twin, and, for a
  process group bound to a device (one NCCL communicator for all of a group's peers), with a group per (src, dst);
* without the twin (``LIGHTNING_SCALE_P2P_DIRECTION_GROUPS=0``, what the runtime did before) the same emulation hangs
  at pp=2: the prefetched gradient receive sits in front of the activation send on the pair's one stream, and the
  tied-parameter exchange at construction starts on different communicators on the two ranks. Bounded by the P2P's
  timeout here: it fails instead of hanging.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
from lightning_scale.testing import DistributedTestError, run_distributed
from test_pipeline_parity import MODELS, RUNS, _pipeline_worker, _reference, check_every_schedule, loss64

EMULATE = {"LIGHTNING_SCALE_P2P_EMULATE": "nccl"}


@pytest.mark.parametrize("mode", ["nccl", "nccl-bound"])
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_one_process_under_nccl_semantics(pp, mode):
    """``nccl``: per-pair communicators (init_process_group without device_id): one twin per pipeline group;
    ``nccl-bound``: a group bound to a device runs all its peers on one communicator: a 2-rank group per connected
    (src, dst) (with the twin alone 1F1B and interleaved hung at pp=4: a middle stage's receive from the left and send
    to the right on one stream)."""
    results = run_distributed(_pipeline_worker, pp, (MODELS[pp], RUNS[pp], False), timeout=180,
                              env={"LIGHTNING_SCALE_P2P_EMULATE": mode})
    path = "twin" if mode == "nccl" else "pairs"
    check_every_schedule(results, pp, _reference(MODELS[pp]), f"{path}+emulated")


def _one_stream_worker(rank: int, world_size: int, tie: bool, out_dir: str, probe: bool = False) -> None:
    """3 steps of 1F1B at pp=2 with a short P2P timeout; writes the error text, or "ok", to out_dir/rank<k>.txt (a
    failed run's ranks close their gloo pairs: the harness's final barrier then fails too)."""
    from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers
    from lightning_scale.topology import Topology

    if probe:  # the autotuner's probe groups (strategies/probe_guard.py), built by hand, twin included
        from lightning_scale.config import from_flat_kwargs
        from lightning_scale.strategies.probe_guard import probe_groups

        topo, mine, _ = probe_groups(from_flat_kwargs(pp=2, microbatches=4), world_size, rank, 30.0)
        assert topo._groups["pp_twin"] in mine  # broken with the others when a probe fails
    else:
        topo = Topology(pp=world_size, rank=rank).build_groups()
    cfg = gpt_tiny(n_layer=2, tie_weights=tie)
    torch.manual_seed(0)
    gpt = GPT(cfg).double()
    try:
        stage = build_stage(gpt_pipeline_layers(gpt), pp=2, pp_rank=topo.pp_rank, partition="uniform")
        rt = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=loss64,
                             microbatches=4, timeout=datetime.timedelta(seconds=4))
        for step in range(3):  # step 1 learns the shapes; from step 2 on receives are posted ahead
            rt.train_step(*make_batch(cfg, 8, seed=step))
        result = "ok"
    except Exception as err:  # noqa: BLE001 - what the test looks at
        result = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(result)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_without_direction_groups_the_emulated_nccl_run_hangs(tie, tmp_path):
    """The emulation is strict enough to catch the runtime's old NCCL behaviour (and the twins are what fixes it)."""
    def results(name, env):
        out = tmp_path / name
        out.mkdir()
        try:
            run_distributed(_one_stream_worker, 2, (tie, str(out)), timeout=120, env=env)
        except DistributedTestError:
            pass  # judged by what the ranks wrote
        return [(out / f"rank{k}.txt").read_text() if (out / f"rank{k}.txt").exists() else "nothing" for k in (0, 1)]

    without = results("without", {**EMULATE, "LIGHTNING_SCALE_P2P_DIRECTION_GROUPS": "0"})
    assert any("within 0:00:04" in r for r in without), without
    assert results("with", EMULATE) == ["ok", "ok"]


def test_which_backends_get_direction_groups(monkeypatch):
    from lightning_scale.comm.p2p import needs_direction_groups

    monkeypatch.delenv("LIGHTNING_SCALE_P2P_EMULATE", raising=False)
    monkeypatch.delenv("LIGHTNING_SCALE_P2P_DIRECTION_GROUPS", raising=False)
    assert needs_direction_groups("nccl") and needs_direction_groups("cpu:gloo,cuda:nccl")
    assert not needs_direction_groups("gloo")  # tags keep kinds apart; sends and receives do not queue
    monkeypatch.setenv("LIGHTNING_SCALE_P2P_EMULATE", "nccl")
    assert needs_direction_groups("gloo")
    monkeypatch.setenv("LIGHTNING_SCALE_P2P_DIRECTION_GROUPS", "0")
    assert not needs_direction_groups("nccl")


def test_autotune_probe_groups_get_the_twin_too(tmp_path):
    """The autotuner builds each probe's groups by hand (strategies/probe_guard.py): a pp probe on NCCL needs the
    twin as well, or it hangs until the probe timeout and the layout is dropped as failed."""
    run_distributed(_one_stream_worker, 2, (True, str(tmp_path), True), timeout=120, env=EMULATE)
    assert [(tmp_path / f"rank{k}.txt").read_text() for k in (0, 1)] == ["ok", "ok"]

