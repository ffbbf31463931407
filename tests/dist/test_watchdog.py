"""The watchdog on plain torch.distributed ranks (2 gloo ranks, file store): a hang is detected and explained,
every rank exits by itself with EXIT_HANG; the debug fingerprints report a skipped collective with both
ranks' sequence numbers. Exit codes other than the watchdog's (e.g. -9 from run_distributed's kill at its
timeout) mean a rank did not end by itself within hang_timeout + 30 s."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from lightning_scale.diagnostics import EXIT_HANG, DiagnosticsConfig
from lightning_scale.testing import DistributedTestError, run_distributed

HANG_S = 3.0
CFG = dict(hang_timeout=HANG_S, first_step_grace=0.0, heartbeat_interval=0.5)


def _hang_worker(rank: int, world_size: int) -> None:
    from lightning_scale.comm import collectives as C
    from lightning_scale.diagnostics import start_watchdog, trace

    torch.distributed.barrier()  # both ranks up (untraced): a peer slow to start is not the hang under test
    start_watchdog(DiagnosticsConfig(**CFG))
    buf = torch.ones(16)
    for step in range(3):
        C.all_reduce(buf, tag="grad")
        trace.step_done(step + 1)
    if rank == 1:
        time.sleep(120)  # the stuck rank: a long compute, a deadlock in user code...
    C.all_gather(torch.empty(2048), torch.ones(1024), tag="param")  # rank 0 waits here for rank 1


def _exit_codes(err: DistributedTestError):
    m = re.search(r"exit codes \[([^\]]*)\]", str(err))
    assert m, str(err)
    return [int(c) for c in m.group(1).split(",")]


def test_hang_is_diagnosed_and_every_rank_exits(capfd):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_worker, 2, timeout=HANG_S + 30)
    assert _exit_codes(info.value) == [EXIT_HANG, EXIT_HANG]  # both ended by the watchdog, none killed
    err = capfd.readouterr().err
    assert "HANG: rank 0 has waited" in err
    assert "ranks behind (the others wait for them): [1]" in err
    # the collective the others wait in: op, axis, sequence number, bytes
    assert re.search(r"rank 0 \(pid \d+ .*step 3, 4 collectives entered\): blocked [\d.]+ s in all_gather #4 "
                     r"\(axis world \[0, 1\], tag param, 8192 B\)", err), err
    assert "last entered all_reduce #3 (axis world [0, 1], tag grad, 64 B) (completed)" in err
    # the stuck rank's Python stack, printed by every rank (2 ranks x the stuck rank's stack)
    stack = err.split("Python stack of rank 1 (faulthandler):", 1)[1]
    assert "_hang_worker" in stack and "test_watchdog.py" in stack
    assert err.count("HANG: every rank exits now (stuck rank(s): [1])") == 2


def _mismatch_worker(rank: int, world_size: int) -> None:
    from lightning_scale.comm import collectives as C
    from lightning_scale.diagnostics import start_watchdog

    torch.distributed.barrier()  # both ranks up before the watchdog's clock starts
    wd = start_watchdog(DiagnosticsConfig(**CFG))
    with wd.guard():
        C.all_reduce(torch.ones(4), tag="grad")
        if rank == 0:
            C.all_reduce(torch.ones(8), tag="grad_norm")  # rank 1 skips this one
        C.broadcast(torch.ones(32), src=0, tag="param")


def test_debug_fingerprints_report_a_skipped_collective(capfd):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatch_worker, 2, timeout=HANG_S + 30, env={"LIGHTNING_SCALE_DEBUG_COLLECTIVES": "1"})
    text = str(info.value)
    assert "rank 1 of 2 failed" in text and "CollectiveMismatchError" in text
    assert ("collective mismatch on world [0, 1] at call 2 of the group: rank 1 entered broadcast (128 B, tag param) "
            "as its collective #2, rank 0 entered all_reduce (32 B, tag grad_norm) as its collective #2") in text
    err = capfd.readouterr().err  # rank 0 names rank 1's error, not the transport's
    assert "rank 1 failed: CollectiveMismatchError: collective mismatch" in err


def _fail_worker(rank: int, world_size: int, how: str) -> None:
    from lightning_scale.comm import collectives as C
    from lightning_scale.diagnostics import start_watchdog

    torch.distributed.barrier()  # both ranks up before the watchdog's clock starts
    wd = start_watchdog(DiagnosticsConfig(**CFG))
    with wd.guard():
        for step in range(4):
            if rank == 1 and step == 2:
                if how == "raise":
                    raise ValueError("boom: injected at step 2")
                os.kill(os.getpid(), 9)
            C.all_reduce(torch.ones(64), tag="grad")


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_survivor_names_the_failed_rank(capfd, how):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_worker, 2, args=(how,), timeout=HANG_S + 30)
    err = capfd.readouterr().err
    last = [ln for ln in err.splitlines() if ln.startswith("[lightning_scale]")][-1]
    if how == "raise":
        assert "rank 1 of 2 failed" in str(info.value) and "boom: injected" in str(info.value)
        assert "rank 1 failed: ValueError: boom: injected at step 2" in last, err
    else:
        assert re.search(r"rank 1 \(pid \d+\) was killed by a signal", last), err
    assert "Connection" not in last
