"""Fork test processes from a pre-imported interpreter (a "zygote"), so each rank skips the import of torch and
Lightning (2-3 s and 6-9 s of CPU on a 2-core box, paid again by every rank of every test).

A zygote is a child process that imports a list of modules once and then forks one process per request. The
forked process behaves like ``python SCRIPT ARGS`` (or like ``run_distributed``'s rank entry): its own session
(so its whole process group can be killed), the request's environment, working directory and ``sys.argv``,
stdout / stderr written to files, and at exit non-daemon threads joined and ``atexit`` handlers run, as the
interpreter would. The zygote gets SIGTERM when its parent dies (PR_SET_PDEATHSIG, even when the parent is
SIGKILLed or calls ``os._exit``) and then SIGKILLs each forked process's whole session; a forked process also
gets SIGKILL if the zygote dies. Nothing outlives a killed test run.

Why not ``multiprocessing``'s forkserver: it has one global server with one preload list, and its children run
inside multiprocessing's bootstrap (a ``current_process()`` that is not the main process, stdin closed, its own
exit handling); the ranks here must look like processes started by a launcher. This module is test
infrastructure only; nothing in the library uses it.

Modules read at import time by what is preloaded see the zygote's environment (the test session's at its start),
not the request's: preload only libraries whose import does not depend on per-test settings.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence

_ZYGOTES: Dict[tuple, "Zygote"] = {}


def _pdeathsig(sig: int) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ForkedProcess:
    """The part of ``subprocess.Popen`` that the launchers use: ``pid``, ``poll()``, ``wait()``, ``returncode``.
    The process is the zygote's child; the zygote writes its exit status to ``status_path`` when it ends."""

    def __init__(self, pid: int, status_path: str, zygote: "Zygote") -> None:
        self.pid, self.status_path, self.zygote, self.returncode = pid, status_path, zygote, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            if os.path.exists(self.status_path):
                with open(self.status_path) as f:
                    self.returncode = int(f.read())
            elif not self.zygote.alive():  # the zygote died: its children were killed with it
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode


class Zygote:
    def __init__(self, preload: Sequence[str]) -> None:
        code = "from lightning_scale.testing_zygote import _serve; _serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code, *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._lock = threading.Lock()
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the test zygote did not start (preload {list(preload)}): {line!r}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, kind: str, argv: List[str], env: Dict[str, str], cwd: str, out: str, err: str,
             status: str) -> ForkedProcess:
        req = dict(kind=kind, argv=argv, env=env, cwd=cwd, out=out, err=err, status=status)
        with self._lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            pid = int(self.proc.stdout.readline())
        return ForkedProcess(pid, status, self)

    def close(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()


def zygote(preload: Sequence[str]) -> Zygote:
    """The running zygote with this preload list (started on first use, restarted if it died)."""
    key = tuple(preload)
    z = _ZYGOTES.get(key)
    if z is None or not z.alive():
        z = _ZYGOTES[key] = Zygote(key)
    return z


def close_all() -> None:
    for z in list(_ZYGOTES.values()):
        z.close()
    _ZYGOTES.clear()


# ---------------------------------------------------------------------------------------------- the zygote itself
def _demote_checkout_roots() -> None:
    """``python -c`` puts the working directory ("") first on sys.path. In a lightning_scale checkout that is the
    repository root, whose ``kernels/`` folder (shipped as ``lightning_scale.kernels``) would shadow the PyPI package
    ``kernels`` that transformers imports: preloading transformers would fail. Drop "" (a script run as ``python
    SCRIPT`` has its own folder there, which ``_run`` inserts) and move any other checkout root (PYTHONPATH) after
    site-packages, where it still provides lightning_scale."""
    if sys.path and sys.path[0] == "":
        del sys.path[0]
    roots = [p for p in sys.path if os.path.isdir(os.path.join(p or ".", "kernels"))
             and os.path.isdir(os.path.join(p or ".", "lightning_scale"))]
    if roots:
        sys.path[:] = [p for p in sys.path if p not in roots] + roots


def _serve() -> None:
    status_of: Dict[int, str] = {}

    def end(signum=None, frame=None) -> None:  # noqa: ARG001 - each child leads a session: kill it whole
        for pid in list(status_of):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, end)
    _pdeathsig(signal.SIGTERM)  # the parent died (even by SIGKILL / os._exit): take every child's group down
    _demote_checkout_roots()
    for name in sys.argv[1:]:
        __import__(name)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if ready:
            line = sys.stdin.readline()
            if not line:  # the parent closed the pipe: end, and the children with us
                end()
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _child(req)  # never returns
            status_of[pid] = req["status"]
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()
        while status_of:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            path = status_of.pop(pid, None)
            if path is not None:
                code = os.waitstatus_to_exitcode(st)
                with open(path + ".tmp", "w") as f:
                    f.write(str(code))
                os.replace(path + ".tmp", path)


def _child(req: Dict) -> None:
    code = 1
    try:
        os.setsid()
        _pdeathsig(signal.SIGKILL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = out if req["err"] == req["out"] else os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(os.devnull)
        os.environ.clear()
        os.environ.update(req["env"])
        if os.environ.get("PYTHONUNBUFFERED"):  # `python -u`: the request's setting, not the zygote's
            for name, fd in (("stdout", 1), ("stderr", 2)):
                stream = getattr(sys, name)
                setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=stream.encoding,
                                                    errors=stream.errors, write_through=True))
        os.chdir(req["cwd"])
        sys.argv = list(req["argv"])
        code = _run(req["kind"], sys.argv)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - what the interpreter would print for an uncaught error
        import traceback

        traceback.print_exc()
        code = 1
    _finish(code)


def _run(kind: str, argv: List[str]) -> int:
    if kind == "script":
        import runpy

        script = os.path.abspath(argv[0])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[0:0] = extra  # as the interpreter would put the request's PYTHONPATH
        _demote_checkout_roots()
        sys.path.insert(0, os.path.dirname(script))  # `python SCRIPT` has its folder first
        runpy.run_path(script, run_name="__main__")
        return 0
    if kind == "entry":  # run_distributed's rank: argv = [job, rank]
        from lightning_scale.testing import _entry

        sys.argv = ["-c", *argv]
        _entry()
        return 0
    raise ValueError(kind)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _join_threads() -> None:
    """The interpreter's first exit step (``threading._shutdown``): the callbacks registered with
    ``threading._register_atexit`` (``concurrent.futures`` wakes its idle pool workers there), then every non-daemon
    thread joined. Joining without the callbacks waits forever on an executor that was never shut down (inductor's
    cold compile leaves one: a forked rank that had finished its work hung at exit)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    for callback in reversed(getattr(threading, "_threading_atexits", [])):  # pragma: no cover - other Pythons
        callback()
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()


def _finish(code: int) -> None:
    """What the interpreter does at exit, minus the module teardown (gloo's threads can abort it)."""
    try:
        _join_threads()
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
