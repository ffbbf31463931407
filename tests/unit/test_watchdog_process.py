"""The watchdog and its process: under Lightning's script launcher rank 0's watchdog watches the ranks it launched,
and Lightning's ``_ChildProcessObserver`` (which SIGKILLs rank 0 within 5 s of any child's non-zero exit) is paused
while it does; the signal wakeup fd is the process's again after a run.

The observer cut off rank 0's own first error in CI (test_secondary_errors_in_teardown_never_replace_the_first:
rank 1, ended on rank 0's published error with EXIT_PEER_FAILED, was seen by the observer while rank 0 was still in
its teardown; rank 0 died with 137 instead of exiting 1 on its traceback). These tests run the real observer class of
the installed Lightning (an upgrade that changes it fails here, not as a flaky launch) on a stand-in main process."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lightning_scale.diagnostics import EXIT_PEER_FAILED, DiagnosticsConfig, Watchdog
from lightning_scale.strategies import diagnostics_glue

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
DIE = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]


def _wait(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_lightning_child_observer_is_paused_while_the_watchdog_runs():
    main = subprocess.Popen(SLEEP)  # stands in for rank 0: the observer SIGKILLs its "main pid"
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(71)"])
    child.wait()
    procs = [child]
    observer = _ChildProcessObserver(main_pid=main.pid, child_processes=procs, sleep_period=0.05)
    strategy = SimpleNamespace(launcher=SimpleNamespace(procs=procs))
    try:
        diagnostics_glue._pause_child_observer(strategy)  # not started yet: not found, nothing paused
        assert getattr(strategy, "_ls_observer", None) is None
        paused = _ChildProcessObserver(main_pid=main.pid, child_processes=procs, sleep_period=3600)
        paused.start()  # sleeps first: paused below before its first look
        diagnostics_glue._pause_child_observer(strategy)
        assert strategy._ls_observer is paused
        assert paused._run() is False  # looks at nothing while paused
        diagnostics_glue._resume_child_observer(strategy)
        assert strategy._ls_observer is None
        # resumed: the class's own check again; it would end the stand-in main process on the child's code 71
        observer.start()
        assert _wait(lambda: main.poll() is not None, 10), "the real observer never acted: the test proves nothing"
        assert main.returncode == -9
    finally:
        main.kill()
        main.wait()


def test_watchdog_names_a_launched_rank_that_died_without_reporting(capsys):
    """A child that ended with a failure and published nothing (SIGKILL, the OOM killer) is published in its name
    after two heartbeats, and rank 0 stops naming it (EXIT_PEER_FAILED, without waiting for its goodbye); a child
    that ended 0, or one gone after an agreed stop or while this rank is failing itself, is left alone."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    config = DiagnosticsConfig(heartbeat_interval=0.1, stop_timeout=5.0)
    ok = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = subprocess.Popen(DIE)
    ok.wait(), dead.wait()

    quiet = Watchdog(dist.PrefixStore("a/", store), 0, 3, config, children={1: ok}, exit_fn=lambda c: None)
    assert not quiet._check_children()
    stopping = Watchdog(dist.PrefixStore("b/", store), 0, 3, config, children={2: dead}, exit_fn=lambda c: None)
    stopping._own_failure = True
    assert not stopping._check_children()

    codes = []
    wd = Watchdog(dist.PrefixStore("c/", store), 0, 3, config, children={1: ok, 2: dead}, exit_fn=codes.append)
    start = time.monotonic()
    wd.start()
    try:
        assert _wait(lambda: codes, 10), "rank 0 never stopped on the dead child"
    finally:
        wd.close()
    assert codes == [EXIT_PEER_FAILED]
    assert 0.2 <= time.monotonic() - start < 5.0  # after the grace; not the 5 s wait for rank 2's goodbye
    err = capsys.readouterr().err
    assert f"rank 0: stopping because rank 2 (pid {dead.pid}) was killed by signal 9 (SIGKILL)" in err, err


def test_signal_wakeup_pipe_is_given_back_and_a_foreign_one_kept():
    """The monitor thread waits in select() on the signal wakeup pipe: close() wakes it at once (a 5 s heartbeat is
    not slept out) and gives the process its wakeup fd back; a wakeup fd someone else set (asyncio, a library) stays
    theirs (it was replaced by a closed pipe of ours before: a later signal wrote into whatever reused the number)."""
    import os
    import signal

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    config = DiagnosticsConfig(heartbeat_interval=5.0, hang_timeout=60.0)
    assert signal.set_wakeup_fd(-1) == -1  # pytest's main thread sets none
    wd = Watchdog(dist.PrefixStore("w/", store), 0, 1, config, exit_fn=lambda c: None).start()
    wd.install_signal_handlers(signums=())
    assert wd._wakeup_r is not None
    time.sleep(0.3)  # the thread is in its 5 s select now
    start = time.monotonic()
    wd.close()
    assert time.monotonic() - start < 1.0
    assert signal.set_wakeup_fd(-1) == -1 and wd._wakeup_r is None  # given back, pipe closed

    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w)
        other = Watchdog(dist.PrefixStore("x/", store), 0, 1, config, exit_fn=lambda c: None)
        other.install_signal_handlers(signums=())
        assert other._wakeup_r is None  # it waits on its event instead
        assert signal.set_wakeup_fd(-1) == w  # still theirs
    finally:
        os.close(r), os.close(w)
