"""No process outlives its test (issue 18): a timed-out, interrupted or killed run leaves no orphan.

Each case launches a job whose processes write their pids to a file, forces the failure, and checks with
psutil that every one of those pids is gone. Inner pytest runs use a bare folder (no conftest: no torch).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from lightning_scale.testing import run_script

# A "script with ranks": the launched process starts a grandchild (as Lightning starts ranks 1..N), both
# record their pids, then both hang (a rank blocked in a collective).
JOB = textwrap.dedent("""
    import os, subprocess, sys, time
    pids = sys.argv[1]
    if len(sys.argv) == 2:
        subprocess.Popen([sys.executable, __file__, pids, "rank1"])
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(600)
""")

# pytest-timeout (a few s) fires while a run_script / run_distributed call still waits (600 s)
INNER = textwrap.dedent("""
    import os, sys
    from lightning_scale.testing import run_distributed, run_script

    def hang(rank, world_size, pids):
        import time
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(600)

    def test_script():
        run_script([sys.executable, os.environ["JOB"], os.environ["PIDS"]], timeout=600)

    def test_ranks():
        run_distributed(hang, world_size=2, args=(os.environ["PIDS"],), timeout=600)

    def test_forked():  # two ranks forked from the zygote, as torchrun would start them; each starts a grandchild
        run_script([sys.executable, os.environ["JOB"], os.environ["PIDS"]], timeout=600, ranks=2, preload=("json",))
""")


def _pids(path, n, within=60.0):
    deadline = time.monotonic() + within
    while True:  # look at least once
        pids = [int(x) for x in open(path).read().split()] if os.path.exists(path) else []
        if len(pids) >= n:
            return pids
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    raise AssertionError(f"the job did not start {n} processes within {within}s")


def _assert_all_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    for p in alive:  # do not leave them to the next test either
        os.kill(p, signal.SIGKILL)
    raise AssertionError(f"orphans still running after {within}s: {alive}")


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    (tmp_path / "test_inner.py").write_text(INNER)
    return path


def test_run_script_timeout_kills_grandchildren(tmp_path, job):
    pids = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):  # plain subprocess.run leaves the grandchild running
        run_script([sys.executable, str(job), str(pids)], timeout=3)
    started = _pids(pids, 2, within=0)
    _assert_all_gone(started)


def test_run_script_returns_like_subprocess_run(tmp_path):
    proc = run_script([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                      timeout=60, cwd=str(tmp_path))
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")
    killed = run_script([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], timeout=60)
    assert killed.returncode == -signal.SIGKILL


def _inner_pytest(tmp_path, job, test, *extra, timeout=3):
    env = dict(os.environ, JOB=str(job), PIDS=str(tmp_path / f"pids_{test}"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"test_inner.py::{test}",
           f"--timeout={timeout}", *extra]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# thread x ranks is left out: the ranks' own parent-death SIGKILL is the same mechanism as thread x script
@pytest.mark.parametrize("test,method", [("test_script", "signal"), ("test_ranks", "signal"),
                                         ("test_script", "thread"), ("test_forked", "signal"),
                                         ("test_forked", "thread")])
def test_pytest_timeout_leaves_no_orphan(tmp_path, job, test, method):
    """"signal": pytest-timeout raises inside the wait (the helpers kill their groups); "thread": it ends
    pytest with os._exit, and the parent-death signal of each script / rank does the cleaning."""
    # ranks import torch before they write their pid: give them longer to start on a loaded machine
    seconds = {"test_ranks": 8, "test_forked": 5}.get(test, 3)
    inner = _inner_pytest(tmp_path, job, test, f"--timeout-method={method}", timeout=seconds)
    out, _ = inner.communicate(timeout=120)
    assert "Timeout" in out, out[-2000:]
    n = 4 if test == "test_forked" else 2  # script + grandchild, or two ranks, or two ranks + their grandchildren
    _assert_all_gone(_pids(tmp_path / f"pids_{test}", n, within=0))


def test_ctrl_c_leaves_no_orphan(tmp_path, job):
    inner = _inner_pytest(tmp_path, job, "test_script", timeout=120)
    started = _pids(tmp_path / "pids_test_script", 2)
    inner.send_signal(signal.SIGINT)  # what Ctrl-C delivers to pytest (the job runs in its own session)
    try:
        out, _ = inner.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say what was still running and what pytest printed
        alive = [(p, psutil.Process(p).cmdline()) for p in started if psutil.pid_exists(p)]
        inner.kill()
        out, _ = inner.communicate()
        raise AssertionError(f"pytest did not end within 120 s of SIGINT; job processes alive: {alive}\n{out[-3000:]}")
    assert "KeyboardInterrupt" in out, out[-2000:]
    _assert_all_gone(started)


RANKS = textwrap.dedent("""
    import os, sys
    rank = int(os.environ["RANK"])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} "
          f"port {os.environ['MASTER_PORT']} argv {sys.argv[1:]} here {sys.path[0] == os.path.dirname(__file__)} "
          f"extra {os.environ['EXTRA'] in sys.path} cwd {os.getcwd()}")
    print(f"err {rank}", file=sys.stderr)
    if __name__ == "__main__" and rank == 1:
        sys.exit(3)
""")


def test_run_script_ranks_start_like_torchrun(tmp_path):
    """ranks=2: each rank runs the script with torchrun's variables, one MASTER_PORT, the script's folder first on
    sys.path and the request's PYTHONPATH; output in rank order; the return code is the first non-zero one."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    extra = str(tmp_path / "extra")
    env = dict(os.environ, EXTRA=extra, PYTHONPATH=os.pathsep.join([extra, os.environ.get("PYTHONPATH", "")]))
    proc = run_script([sys.executable, str(script), "a", "b"], timeout=120, cwd=str(tmp_path), env=env, ranks=2,
                      preload=("json",))
    lines = proc.stdout.splitlines()
    assert [ln.split(" port ")[0] for ln in lines] == ["rank 0 of 2 local 0", "rank 1 of 2 local 1"], proc.stdout
    assert len({ln.split(" port ")[1].split()[0] for ln in lines}) == 1  # one MASTER_PORT for both
    assert all(f"argv ['a', 'b'] here True extra True cwd {tmp_path}" in ln for ln in lines), proc.stdout
    assert (proc.returncode, proc.stderr) == (3, "err 0\nerr 1\n")


def test_forked_script_with_an_idle_thread_pool_exits_as_the_interpreter_does(tmp_path):
    """A script that leaves a ThreadPoolExecutor running (not shut down) ends under ``python`` (concurrent.futures
    wakes its workers from threading's exit hook); forked from the zygote it hung at exit, joining the idle worker
    (a Trainer run with a cold inductor cache, whose compile leaves such a pool, timed out after its work was done)."""
    script = tmp_path / "pool.py"
    script.write_text("import concurrent.futures, threading\n"
                      "pool = concurrent.futures.ThreadPoolExecutor(1)\n"
                      "concurrent.futures.kept = pool  # held past the script, as inductor's compile pool is\n"
                      "print(pool.submit(lambda: 6 * 7).result())\n"
                      "threading.Thread(target=lambda: None).start()\n")
    for ranks in (None, 1):  # a fresh interpreter, then forked from the zygote
        proc = run_script([sys.executable, str(script)], timeout=60, cwd=str(tmp_path), ranks=ranks,
                          preload=("json",))
        assert (proc.returncode, proc.stdout) == (0, "42\n"), (ranks, proc.stderr)
