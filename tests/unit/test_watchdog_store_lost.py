"""The watchdog when the c10d store's host (rank 0's process) goes away: a rank that is running normally reports
the lost host and exits EXIT_PEER_FAILED; a rank that is already stopping (an agreed NumericsError, a signal)
only keeps the bound on its own exit — rank 0 may simply have finished first — and exits EXIT_STOP_TIMEOUT if it
is still alive at its stop deadline, not EXIT_PEER_FAILED at once (fit_numerics.py's second rank did, at a
normal end, after an earlier run in the same process had stopped on a NumericsError)."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from lightning_scale.diagnostics import EXIT_PEER_FAILED, EXIT_STOP_TIMEOUT, DiagnosticsConfig, Watchdog

HOST = ("import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
        "wait_for_workers=False); print(s.port, flush=True); time.sleep(600)")


@pytest.mark.parametrize("stopping", [False, True])
def test_lost_store_host(stopping):
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(host.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        codes = []
        wd = Watchdog(store, 1, 2, DiagnosticsConfig(heartbeat_interval=0.2, stop_timeout=2.0), exit_fn=codes.append)
        wd.start()
        if stopping:
            wd._stop_deadline = time.monotonic() + 2.0  # what handle_exception sets for an agreed error
        time.sleep(0.5)
        host.kill()
        host.wait()
        lost = time.monotonic()
        deadline = lost + 20
        while not codes and time.monotonic() < deadline:
            time.sleep(0.05)
        wd.close()
        assert codes == [EXIT_STOP_TIMEOUT if stopping else EXIT_PEER_FAILED], codes
        if stopping:  # not at once: at the stop deadline
            assert time.monotonic() - lost >= 1.0
    finally:
        host.kill()


def test_the_store_host_leaves_only_after_every_rank_finished(capsys):
    """A normal end: rank 0 (whose process hosts the store) waits in ``finish`` until every rank has made its last
    use of the store, so its exit cannot fail a peer that is still checking the store at the end of its last step
    (a 1-step Trainer fit of a Mistral at tp=2 failed rank 1 that way: "Failed to recv, got 0 bytes"); a peer that
    never comes bounds the wait at ``stop_timeout`` and rank 0 says so."""
    import threading

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    peer = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    config = DiagnosticsConfig(heartbeat_interval=0.2, stop_timeout=3.0)
    rank0, rank1 = Watchdog(host, 0, 2, config, exit_fn=lambda c: None), Watchdog(peer, 1, 2, config,
                                                                                   exit_fn=lambda c: None)
    done = []
    t = threading.Thread(target=lambda: (rank0.finish(), done.append(time.monotonic())))
    t.start()
    time.sleep(0.5)
    assert not done  # rank 0 is waiting for rank 1
    late = time.monotonic()
    rank1.finish()
    t.join(timeout=10)
    assert done and 0 <= done[0] - late < 2.0  # released by rank 1, well before the 3 s bound
    start = time.monotonic()
    rank0.finish()  # the next end: rank 1 never arrives
    assert 2.5 <= time.monotonic() - start < 10
    assert "not every rank reached the end of the run within 3 s" in capsys.readouterr().err
