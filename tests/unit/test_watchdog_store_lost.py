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
