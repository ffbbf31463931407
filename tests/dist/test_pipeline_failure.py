"""A stage that raises mid-schedule makes every pipeline rank fail fast: nobody stays blocked in a recv.

Two cases: the failing process exits (its connections close), and the failing process stays alive
(e.g. an exception handler that sleeps or waits on something else): then only the runtime's abort
of its pipeline connections can wake the peers. Each surviving rank reports how long it took to
fail, which must be far below the 45 s wait timeout given to the runtime.
"""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch
import torch.nn as nn

from lightning_scale.testing import DistributedTestError, run_distributed

PP, FAIL_RANK, TIMEOUT_S = 3, 1, 45


class Boom(nn.Module):
    """Identity that raises on its ``at``-th call."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom: injected failure in a pipeline stage")
        return x


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _failing_worker(rank: int, world_size: int, linger: bool, marker: str) -> str:
    from lightning_scale.pipeline import PipelineRuntime, build_stage
    from lightning_scale.topology import Topology

    topo = Topology(pp=world_size, rank=rank).build_groups()
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(world_size)]
    layers[FAIL_RANK] = nn.Sequential(nn.Linear(8, 8), Boom(at=3))  # the third micro-batch's forward raises
    stage = build_stage(layers, pp=world_size, pp_rank=rank, partition="uniform")
    runtime = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=_mse,
                              microbatches=4, schedule="1f1b", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    t0 = time.monotonic()
    try:
        runtime.train_step(x, y)
    except Exception as err:
        elapsed = time.monotonic() - t0
        if linger and rank == FAIL_RANK:
            with open(marker, "w") as f:
                f.write(str(err))
            time.sleep(60)  # stays alive: the peers must not rely on this process exiting
        raise RuntimeError(f"rank {rank} failed after {elapsed:.2f}s: {err}") from err
    return "finished"


@pytest.mark.parametrize("linger", [False, True], ids=["failing-rank-exits", "failing-rank-lingers"])
def test_stage_error_makes_all_ranks_exit(tmp_path, linger):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    marker = str(tmp_path / "failed_rank_alive")
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError):
        run_distributed(_failing_worker, PP, (linger, marker), timeout=90, tmp_dir=str(run_dir))
    assert time.monotonic() - t0 < 60
    for rank in range(PP):
        path = run_dir / f"error_{rank}.txt"
        if linger and rank == FAIL_RANK:
            assert "boom" in open(marker).read()  # it raised, then stayed alive until the harness killed it
            continue
        assert path.exists(), f"rank {rank} raised nothing: it was killed while blocked"
        text = path.read_text()
        found = re.search(r"rank (\d) failed after ([0-9.]+)s", text)
        assert found and int(found.group(1)) == rank, text[-2000:]
        assert float(found.group(2)) < TIMEOUT_S / 3, f"rank {rank} woke by timeout, not by the abort:\n{text[-1500:]}"
        if rank == FAIL_RANK:
            assert "boom" in text
    assert not os.path.exists(marker) or linger
