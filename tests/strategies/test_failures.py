"""Trainer runs (2 CPU ranks) with an injected fault: every process ends by itself, names the rank and the cause.
One case of each fault is launched as a user types it (Lightning starts rank 1), the others with every rank started
from outside, as srun / torchrun do (each rank must then end with the same code).

Each run is launched in its own session with a timeout; when the script (rank 0) has exited, the test checks
the pids every rank recorded (psutil) before it kills the process group, so "no process left" is observed,
not enforced. Exit codes: 70 = hang detected, 128 + N = stopped on signal N.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from lightning_scale import testing, testing_zygote
from lightning_scale.diagnostics import EXIT_HANG

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_failures.py")
HANG_S = 3.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start(cmd, tmp_path, env):
    """Rank 0 (the script) in a session of its own; Lightning's launcher starts rank 1 as its child, in that session.
    Forked from the test zygote when it is on (rank 0 skips the ~10 s import of Lightning that rank 1 still pays;
    the script's Python signal handlers, exit status and output are those of ``python SCRIPT``), else under
    run_script's supervisor (PR_SET_PDEATHSIG: if pytest itself is killed, the job's group goes with it).
    Returns (processes, output reader, return codes as a shell reports them)."""
    if testing._use_zygote():
        out_path = str(tmp_path / "output.txt")
        proc = testing_zygote.zygote(testing.SCRIPT_PRELOAD).fork(
            "script", cmd[1:], env, str(tmp_path), out_path, out_path, str(tmp_path / "exit_status"))

        def output():
            with open(out_path, errors="replace") as f:
                return f.read()

        return [proc], output, lambda: [proc.returncode if proc.returncode >= 0 else 128 - proc.returncode]
    supervise = [sys.executable, "-c", "from lightning_scale.testing import _supervise; _supervise()"]
    proc = subprocess.Popen([*supervise, *cmd], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()

    def output():
        reader.join(timeout=10)
        return "".join(chunks)

    return [proc], output, lambda: [proc.returncode]


def _start_external(cmd, tmp_path, env, ranks=2):
    """Every rank started from outside, as srun or torchrun do (RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* set: Lightning
    starts no process of its own), each in a session of its own, forked from the test zygote when it is on (else a
    fresh interpreter under run_script's supervisor). A signal to one rank reaches that rank only, as ``scancel
    --signal`` to one task or a node's own SIGTERM does. Returns what ``_start`` does; the output is rank 0's,
    then rank 1's."""
    port = str(testing._free_port())
    outs, procs = [str(tmp_path / f"output{r}.txt") for r in range(ranks)], []
    for r in range(ranks):
        rank_env = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                        NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if testing._use_zygote():
            procs.append(testing_zygote.zygote(testing.SCRIPT_PRELOAD).fork(
                "script", cmd[1:], rank_env, str(tmp_path), outs[r], outs[r], str(tmp_path / f"exit_status{r}")))
        else:
            supervise = [sys.executable, "-c", "from lightning_scale.testing import _supervise; _supervise()"]
            with open(outs[r], "w") as f:
                procs.append(subprocess.Popen([*supervise, *cmd], cwd=tmp_path, env=rank_env, stdout=f,
                                              stderr=subprocess.STDOUT, text=True, start_new_session=True))

    def output():
        text = []
        for path in outs:
            with open(path, errors="replace") as f:
                text.append(f.read())
        return "".join(text)

    def codes():
        return [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]

    return procs, output, codes


def launch(tmp_path, *args, timeout: float, signal_after_step=None, signal_ranks=(), signum=signal.SIGTERM,
           launcher="lightning"):
    """Run fit_failures.py; optionally send ``signum`` to ``signal_ranks`` once rank 0 finished that batch.
    ``launcher="lightning"``: the script as a user types it (Lightning starts rank 1); ``"external"``: every rank
    started from outside, as srun / torchrun do. Returns (return code, stdout + stderr, pids that were still alive
    when the job had exited); with external ranks every rank must end with the same code (asserted)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = {"lightning": _start, "external": _start_external}[launcher]
    procs, output, returncodes = start([sys.executable, SCRIPT, "--pid-dir", str(pid_dir), *map(str, args)],
                                       tmp_path, env)
    try:
        deadline = time.monotonic() + timeout
        if signal_after_step is not None:
            steps = pid_dir / "rank0.steps"
            while time.monotonic() < deadline and all(p.poll() is None for p in procs) and not (
                    steps.exists() and len(steps.read_text().split()) > signal_after_step):
                time.sleep(0.05)
            for r in signal_ranks:
                os.kill(int((pid_dir / f"rank{r}.pid").read_text()), signum)
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        pids = [int(p.read_text()) for p in pid_dir.glob("rank*.pid")]
        end = time.monotonic() + 5.0  # a child may be a moment behind its parent
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.05)
        codes, out = returncodes(), output()
        assert len(set(codes)) == 1, f"the ranks ended with different codes {codes}: {out[-4000:]}"
        return codes[0], out, [p for p in pids if _alive(p)]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _ours(out: str):
    return [ln for ln in out.splitlines() if ln.startswith("[lightning_scale]")]


# Lightning's launcher (rank 1 a child of rank 0, a fresh interpreter: ~10 s of imports) for one case of each fault;
# the others with every rank started from outside, as srun / torchrun do.
@pytest.mark.parametrize("mode, waits_in, launcher", [
    ("zero2", r"reduce_scatter #\d+ \(axis dp \[0, 1\], tag grad, \d+ B\)", "lightning"),
    ("pp2", r"recv<-1 #\d+ \(axis pp \[0, 1\], tag pp_\w+, \d+ B\)", "external"),
    pytest.param("zero3", r"(reduce_scatter|all_gather) #\d+ \(axis dp \[0, 1\], tag \w+, \d+ B\)", "external",
                 marks=pytest.mark.slow),
    pytest.param("tp2", r"all_reduce #\d+ \(axis tp \[0, 1\], tag tp/[\w.]+, \d+ B\)", "external",
                 marks=pytest.mark.slow),
])
def test_hang_in_training_step(tmp_path, mode, waits_in, launcher):
    # timeout: first_step_grace 20 s + start-up under load
    rc, out, left = launch(tmp_path, "--mode", mode, "--fault", "hang", "--fault-step", "2",
                           "--hang-timeout", HANG_S, timeout=HANG_S + 140, launcher=launcher)
    assert rc == EXIT_HANG, out[-4000:]
    assert left == [], f"processes left: {left}"
    assert out.count("HANG: every rank exits now (stuck rank(s): [1])") == 2, out[-4000:]  # both ranks reported
    assert re.search(r"rank 0 \(pid \d+ .*\): blocked [\d.]+ s in " + waits_in, out), out[-4000:]
    assert re.search(r"rank 1 \(pid \d+ .*\): not in a collective", out)
    stack = out.split("Python stack of rank 1 (faulthandler):", 1)[1]
    assert "fit_failures.py" in stack and "in inject" in stack  # the stuck rank's own frames


# The plain-torch twins in tests/dist/test_watchdog.py run by default (a Trainer launch costs ~30 s here).
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raise", "sigkill"])
def test_survivor_names_the_rank_that_failed(tmp_path, fault):
    rc, out, left = launch(tmp_path, "--mode", "zero2", "--fault", fault, timeout=240)
    assert rc != 0 and left == [], (rc, left, out[-3000:])
    last = _ours(out)[-1]
    if fault == "raise":
        assert "rank 1 failed: RuntimeError: boom: injected failure in training_step" in last, out[-3000:]
    else:
        assert re.search(r"rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\)", last), out[-3000:]
    assert "Connection" not in last


@pytest.mark.slow  # a 2-rank Trainer launch, 12-35 s; the in-process twin (test_teardown_errors.py) is fast
def test_secondary_errors_in_teardown_never_replace_the_first(tmp_path):
    """Rank 0 raises in training_step; then a callback's on_exception enters a barrier whose peer is blocked in
    another collective (and is ended by its watchdog on the published error) and raises ValueError, and the
    strategy's own teardown fails (remove_hooks raises OSError). fit still raises the first error, the process ends
    on it (its traceback is the last thing printed), and each secondary error is printed as such, naming the first.
    Rank 0's teardown takes 1 s after rank 1 has exited (EXIT_PEER_FAILED): Lightning's child-process observer (every
    0.2 s in fit_failures.py, 5 s in Lightning) SIGKILLed rank 0 there (exit 137, its traceback lost; a CI failure)
    before the watchdog paused it (tests/unit/test_watchdog_process.py)."""
    rc, out, left = launch(tmp_path, "--mode", "zero2", "--fault", "raise", "--fault-rank", 0, "--teardown-faults",
                           "--teardown-delay", 1, timeout=240)
    assert rc == 1 and left == [], (rc, left, out[-4000:])
    pids = tmp_path / "pids"
    assert (pids / "final0.txt").read_text() == "RuntimeError: boom: injected failure in training_step"
    last = out.rstrip().splitlines()[-1]  # the end of rank 0's traceback ("[rank0]: " prefixed by Lightning)
    assert last.endswith("RuntimeError: boom: injected failure in training_step"), out[-4000:]
    first = "(the first error RuntimeError: boom: injected failure in training_step is the one raised)"
    assert f"rank 0: secondary error in FailingTeardown.on_exception, ignored {first}: ValueError: injected " \
           "secondary: on_exception failed after the barrier" in out, out[-4000:]
    assert f"rank 0: secondary error in Zero3DStrategy.teardown, ignored {first}: OSError: injected secondary: " \
           "remove_hooks failed in teardown" in out, out[-4000:]
    # the peer learnt of the first error before the barrier could hang: it names it, no HANG report
    assert "HANG" not in out and "rank 1: stopping because rank 0 failed: RuntimeError: boom" in out, out[-4000:]
    print("barrier on rank 0 during teardown:", (pids / "barrier0.txt").read_text())


_slow = pytest.mark.slow


@pytest.mark.parametrize("mode, ranks, save, launcher", [
    ("zero3", (0, 1), True, "lightning"),
    pytest.param("zero3", (1,), False, "external", marks=_slow),  # Lightning's launcher: the case above
    pytest.param("zero2", (1,), False, "external", marks=_slow),
    pytest.param("zero2", (0, 1), True, "external", marks=_slow),
    pytest.param("pp2", (1,), False, "external", marks=_slow),
    pytest.param("pp2", (0, 1), True, "external", marks=_slow),
    pytest.param("tp2", (1,), False, "external", marks=_slow),
    pytest.param("tp2", (0, 1), True, "external", marks=_slow),
], ids=lambda v: {(0, 1): "all", (1,): "rank1", True: "save", False: "nosave"}.get(v, v))
def test_sigterm_stops_every_rank(tmp_path, mode, ranks, save, launcher):
    """SIGTERM to all ranks (as SLURM does) and to rank 1 only, in each mode; with save_on_preempt the checkpoint
    written on the signal loads. At ZeRO-3 the run also logs weight norms between steps (the gathered() pattern; a
    bare read raises a clear error)."""
    ckpt = tmp_path / "ckpt"
    extra = ["--save-on-preempt", "--ckpt-dir", ckpt] if save else []
    norms = save and mode == "zero3"
    if norms:
        extra.append("--norms")
    rc, out, left = launch(tmp_path, "--mode", mode, "--steps", 200, "--step-sleep", 0.1, *extra,
                           timeout=240, signal_after_step=3, signal_ranks=ranks, launcher=launcher)
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert left == [], f"processes left: {left}"
    m = re.search(r"every rank stopped after batch (\d+) \(global step (\d+)\) on SIGTERM", out)
    assert m, out[-3000:]
    for r in range(2):  # both ranks stopped after the same batch
        assert len((tmp_path / "pids" / f"rank{r}.steps").read_text().split()) == int(m.group(1))
    if save:
        import torch

        from lightning_scale.zero.state_dict import consolidate_checkpoint

        path = ckpt / "last-preempt.ckpt"
        assert f"checkpoint saved to {path}" in out
        state = consolidate_checkpoint(str(path))
        assert state and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    if norms:
        import json

        pids = tmp_path / "pids"
        for r in range(2):
            err = (pids / f"norm_error{r}.txt").read_text()
            assert err.startswith("ShardedParameterAccessError: zero.stage=3: parameter 'model.blocks.0."), err
        rows = [[json.loads(ln) for ln in (pids / f"norms{r}.jsonl").read_text().splitlines()] for r in range(2)]
        assert rows[0] == rows[1] and len(rows[0]) == int(m.group(1))  # every rank, every batch, the same
        assert all(v > 0 for row in rows[0] for v in row.values())

