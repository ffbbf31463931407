"""Run a function on N local processes joined by gloo, with a timeout that kills hung ranks.

Used by the multi-process tests and by the benchmarks::

    results = run_distributed(my_fn, world_size=4, args=(cfg,), timeout=120)

``my_fn(rank, world_size, *args)`` must be importable by name (a module-level function). Each rank
initializes ``torch.distributed`` from a ``file://`` store in a fresh temporary folder. The first
rank that raises makes the call raise with that rank's traceback; ranks still alive are killed
after a short grace period, so a failure never leaves a rank blocked in a collective.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

from lightning_scale import testing_zygote

# What the forked processes have imported before a test needs them (see lightning_scale/testing_zygote.py):
# run_distributed's ranks import torch; scripts run with ``ranks=`` import Lightning (and Hydra for examples/).
RANK_PRELOAD = ("torch", "torch.distributed")
SCRIPT_PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning.fabric", "lightning_scale.strategies",
                  "hydra", "omegaconf")
# For ranks that build Hugging Face models: torch._dynamo (2.5 s of CPU; transformers and
# lightning_scale.tensor_parallel import it), transformers and its modeling_utils (3 s): ~6 s per rank otherwise,
# 50 s of CPU for one 8-rank test. ``run_distributed(..., preload=HF_RANK_PRELOAD)``.
HF_RANK_PRELOAD = (*RANK_PRELOAD, "torch._dynamo", "transformers", "transformers.modeling_utils")


def _use_zygote() -> bool:
    """Fork ranks from a pre-imported interpreter; ``LIGHTNING_SCALE_TEST_ZYGOTE=0`` starts fresh ones instead."""
    return os.environ.get("LIGHTNING_SCALE_TEST_ZYGOTE", "1") != "0"


def _forward_output(paths: Sequence[str], fd: int) -> None:
    for path in paths:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        while data:
            data = data[os.write(fd, data):]

# Process groups (one per rank / launched script, each the leader of its own session) that are running now.
# kill_live_groups() ends them all: conftest calls it when pytest is interrupted, timed out or terminated.
_LIVE_GROUPS: Set[int] = set()


class DistributedTestError(RuntimeError):
    pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _LIVE_GROUPS.discard(pgid)


def kill_live_groups() -> int:
    """SIGKILL every process group this process launched and has not reaped yet; returns how many."""
    groups = list(_LIVE_GROUPS)
    for pgid in groups:
        _kill_group(pgid)
    return len(groups)


def _set_parent_death_signal(sig: int) -> None:
    try:  # Linux: the kernel delivers `sig` when the parent exits
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _die_with_parent() -> None:
    """A rank whose launcher died (killed test run, Ctrl-C) must not linger: exit with the parent."""
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:  # portable backstop
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    import threading

    threading.Thread(target=watch, daemon=True).start()


def _entry() -> None:
    """Child process entry: ``python -c 'from lightning_scale.testing import _entry; _entry()' JOB RANK``."""
    job, rank = sys.argv[1], int(sys.argv[2])
    _die_with_parent()
    with open(job, "rb") as f:
        spec = pickle.load(f)
    _worker(rank=rank, **spec)


def _worker(target: str, rank: int, world_size: int, tmp: str, args: Sequence[Any], sys_path: List[str],
            backend: str, timeout_s: float, threads: int) -> None:
    sys.path[:] = sys_path
    # What torchrun would set: libraries that read the environment (DeepSpeed) see a normal launch.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        module_name, qualname = target.split(":")
        fn: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        result = fn(rank, world_size, *args)
        with open(os.path.join(tmp, f"result_{rank}.pkl.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(tmp, f"result_{rank}.pkl.tmp"), os.path.join(tmp, f"result_{rank}.pkl"))
        dist.barrier()
        # Skip interpreter teardown: gloo's background threads can abort the process at exit
        # ("terminate called without an active exception") after a correct result.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException:  # noqa: BLE001 - report everything, then exit non-zero
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def wait_for_ranks(procs: List[Any], timeout: float, grace: float = 5.0) -> bool:
    """Wait for every rank; after the first failure give the others ``grace`` s, then kill what is left.
    True when the timeout ran out first."""
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return False
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()  # do not wait for the others to time out in a collective
            if failed_at is not None and time.monotonic() - failed_at > grace:
                return False
            if time.monotonic() > deadline:
                return True
            time.sleep(0.02)
    finally:
        # Each rank leads its own process group: killing the group also ends what the rank started
        # (data-loader workers, helpers). Runs on timeout, failure, Ctrl-C and pytest-timeout's exception.
        for p in procs:
            _kill_group(p.pid)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def collect_results(tmp: str, procs: List[subprocess.Popen], timeout: float,
                    describe: Optional[Callable[[int], str]] = None) -> List[Any]:
    """Each rank's pickled result, or the root-cause rank's traceback raised as DistributedTestError."""
    world = len(procs)
    describe = describe or (lambda r: f"rank {r} of {world}")
    errors = []
    for r in range(world):
        path = os.path.join(tmp, f"error_{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                errors.append((os.path.getmtime(path), r, f.read()))
    if errors:
        # The first error written is the root cause; later ones are usually peers losing the connection.
        _, rank, text = sorted(errors)[0]
        raise DistributedTestError(f"{describe(rank)} failed:\n{text}")
    codes = [p.returncode for p in procs]
    if any(c != 0 for c in codes):
        raise DistributedTestError(f"ranks failed without a Python error or did not finish within {timeout}s "
                                   f"(exit codes {codes}; negative = killed by that signal)")
    results = []
    for r in range(world):
        with open(os.path.join(tmp, f"result_{r}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), *, timeout: float = 180.0,
                    backend: str = "gloo", threads: int = 1, tmp_dir: Optional[str] = None,
                    env: Optional[dict] = None, preload: Sequence[str] = RANK_PRELOAD) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result.

    ``preload``: the modules the ranks' zygote imports once (see :mod:`lightning_scale.testing_zygote`); name the
    heavy imports of ``fn``'s module and of what it calls (``HF_RANK_PRELOAD``, litgpt ...) so that no rank pays
    them. Modules that read per-test environment variables at import time must not be preloaded."""
    if os.environ.get("LIGHTNING_SCALE_RANK_WORKER"):
        # Importing fn's module inside a rank ran module-level code that launches ranks again: a fork bomb.
        raise RuntimeError("run_distributed was called inside a rank; guard module-level launches with "
                           "`if __name__ == '__main__':`")
    target = f"{fn.__module__}:{fn.__qualname__}"
    sys_path = list(sys.path)
    if fn.__module__ == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise ValueError("run_distributed needs a function defined in an importable module")
        sys_path.insert(0, os.path.dirname(os.path.abspath(path)))
        target = f"{os.path.splitext(os.path.basename(path))[0]}:{fn.__qualname__}"
    tmp = tmp_dir or tempfile.mkdtemp(prefix="ls_dist_")
    job = os.path.join(tmp, "job.pkl")
    with open(job, "wb") as f:
        pickle.dump(dict(target=target, world_size=world_size, tmp=tmp, args=tuple(args), sys_path=sys_path,
                         backend=backend, timeout_s=timeout, threads=threads), f)
    child_env = dict(os.environ, OMP_NUM_THREADS=str(threads), LIGHTNING_SCALE_SKIP_REGISTER="1",
                     LIGHTNING_SCALE_RANK_WORKER="1")
    child_env.update(env or {})
    code = "from lightning_scale.testing import _entry; _entry()"
    procs: List[Any] = []
    fork = _use_zygote()
    try:
        for r in range(world_size):
            if fork:
                out, err = os.path.join(tmp, f"stdout_{r}"), os.path.join(tmp, f"stderr_{r}")
                procs.append(testing_zygote.zygote(tuple(preload)).fork(
                    "entry", [job, str(r)], child_env, os.getcwd(), out, err, os.path.join(tmp, f"exit_{r}")))
            else:
                procs.append(subprocess.Popen([sys.executable, "-c", code, job, str(r)], env=child_env,
                                              start_new_session=True))
            _LIVE_GROUPS.add(procs[-1].pid)
    except BaseException:
        for p in procs:
            _kill_group(p.pid)
        raise
    try:
        wait_for_ranks(procs, timeout)
    finally:
        if fork:  # what the ranks printed, where a launched rank's output goes: this process's stdout / stderr
            _forward_output([os.path.join(tmp, f"stdout_{r}") for r in range(world_size)], 1)
            _forward_output([os.path.join(tmp, f"stderr_{r}") for r in range(world_size)], 2)
    results = collect_results(tmp, procs, timeout)
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def _supervise() -> None:
    """``python -c 'from lightning_scale.testing import _supervise; _supervise()' CMD...``: run CMD in this
    process group (run_script made it a fresh session) and take the whole group down with the launcher.

    Lightning's ranks 1..N are children of the script (rank 0): when rank 0 is killed they live on until
    their collective times out (30 min). This process gets SIGTERM when its parent dies, even by SIGKILL or
    pytest-timeout's ``os._exit`` (PR_SET_PDEATHSIG), and on SIGTERM / SIGINT / SIGHUP kills its group."""
    def kill_group(signum, frame):  # noqa: ARG001
        os.killpg(os.getpgid(0), signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, kill_group)
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        kill_group(None, None)
    child = subprocess.Popen(sys.argv[1:])
    code = child.wait()
    sys.stdout.flush()
    os._exit(code if code >= 0 else 128 - code)


def run_script(cmd: Sequence[str], *, timeout: float, cwd: Optional[str] = None, env: Optional[dict] = None,
               merge_stderr: bool = False, ranks: Optional[int] = None,
               preload: Sequence[str] = SCRIPT_PRELOAD) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`` for scripts that start
    processes of their own (Lightning's ranks): the script runs in its own session, and its whole process
    group is SIGKILLed on timeout (``subprocess.TimeoutExpired`` is raised), on any exception while waiting
    (Ctrl-C, pytest-timeout), when the launcher itself dies, and after it exits (stragglers).

    ``ranks=N`` (``cmd`` = ``[sys.executable, SCRIPT, *args]``): launch the N ranks as torchrun does instead —
    every rank runs the script with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, so Lightning
    sees processes created externally and does not start its own — each forked from a process that imported
    Lightning once (see :mod:`lightning_scale.testing_zygote`). stdout / stderr are the ranks' in rank order;
    the return code is the first non-zero one in rank order. ``ranks=1`` runs the script without those
    variables (a plain single-process run). ``preload``: the modules imported once before the forks."""
    if ranks is not None and _use_zygote():
        return _run_script_forked(list(map(str, cmd)), ranks, timeout, cwd, env, merge_stderr, tuple(preload))
    stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
    code = "from lightning_scale.testing import _supervise; _supervise()"
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, cmd)], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    _LIVE_GROUPS.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _kill_group(proc.pid)
        exc.output, exc.stderr = proc.communicate()  # what it printed before it was killed
        raise
    finally:
        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.wait()
    # the supervisor reports a signal death of the script as 128 + signal, like a shell
    rc = proc.returncode if proc.returncode < 128 else -(proc.returncode - 128)
    return subprocess.CompletedProcess(list(cmd), rc, out, err)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_script_forked(cmd: List[str], ranks: int, timeout: float, cwd: Optional[str], env: Optional[dict],
                       merge_stderr: bool, preload: Sequence[str]) -> subprocess.CompletedProcess:
    if len(cmd) < 2 or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable) or not cmd[1].endswith(".py"):
        raise ValueError(f"run_script(ranks=...) runs `python SCRIPT.py ARGS`, got {cmd[:2]}")
    tmp = tempfile.mkdtemp(prefix="ls_script_")
    base: Dict[str, str] = dict(os.environ if env is None else env)
    port = str(_free_port())
    procs: List[Any] = []
    outs, errs = [], []
    try:
        z = testing_zygote.zygote(preload)
        for r in range(ranks):
            rank_env = dict(base)
            if ranks > 1:  # what torchrun sets
                rank_env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                                NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            outs.append(os.path.join(tmp, f"stdout_{r}"))
            errs.append(outs[-1] if merge_stderr else os.path.join(tmp, f"stderr_{r}"))
            procs.append(z.fork("script", cmd[1:], rank_env, os.path.abspath(cwd or os.getcwd()), outs[-1], errs[-1],
                                os.path.join(tmp, f"exit_{r}")))
            _LIVE_GROUPS.add(procs[-1].pid)
    except BaseException:
        for p in procs:
            _kill_group(p.pid)
        raise
    # after a rank fails the others get 60 s to report it (the strategy's diagnostics name the failed rank)
    timed_out = wait_for_ranks(procs, timeout, grace=60.0)

    def read(paths):
        text = []
        for path in paths:
            try:
                with open(path, errors="replace") as f:
                    text.append(f.read())
            except FileNotFoundError:
                pass
        return "".join(text)

    out, err = read(outs), (None if merge_stderr else read(errs))
    shutil.rmtree(tmp, ignore_errors=True)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    codes = [p.poll() for p in procs]
    rc = next((c for c in codes if c), 0)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def live_rss_bytes() -> int:
    """This process's resident bytes of live memory: garbage collected and freed heap pages handed back to the OS
    first (glibc keeps them otherwise), so a difference of two readings is what was allocated and kept."""
    import ctypes
    import gc

    import psutil

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the reading then includes the allocator's cache
        pass
    return psutil.Process().memory_info().rss


def dp_step(model, opt, topo, x, y, loss_fn, *, device=None, before_step=None) -> float:
    """One training step of a causal LM over the data-parallel axis of ``topo`` (tests and benches): this rank's
    ``1 / dp`` of the rows of ``(x, y)`` (``1 / (dp x ep)`` with expert parallelism; tp / pp peers: the same rows),
    ``loss_fn(model(input_ids=x).logits, y)``,
    backward, ``before_step()`` (e.g. a clip), ``opt.step()``; returns the loss averaged over dp (each rank holds
    an equal share, so it is the whole batch's mean)."""
    import torch.distributed as dist

    if device is not None:
        x, y = x.to(device), y.to(device)
    n = getattr(topo, "data_size", topo.dp)  # ep ranks (ParallelConfig.ep) read their own rows too
    if n > 1:
        i = getattr(topo, "data_rank", topo.dp_rank)
        x, y = x.chunk(n)[i], y.chunk(n)[i]
    loss = loss_fn(model(input_ids=x).logits, y)
    loss.backward()
    if before_step is not None:
        before_step()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().clone()
    if topo.dp > 1:
        dist.all_reduce(loss, group=topo.dp_group)
    if n > topo.dp:
        dist.all_reduce(loss, group=topo.tp_group)
    return float(loss / n)


def random_biases(model, seed: int = 1, scale: float = 0.5):
    """Every parameter of ``model`` named ``*bias`` drawn at random, in place (returns the model). transformers
    initializes biases to zero: a bias a split adds once per tp rank would go unseen in a one-step comparison."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model


def tp_step(model, loss_fn: Callable, targets, shapes_of: Callable[[str], bool], **inputs) -> Dict[str, Any]:
    """One forward and backward of a tensor-parallel Hugging Face ``model`` (``loss_fn(logits, targets)``): the loss,
    every gradient consolidated under the whole model's names, the local shapes of the parameters ``shapes_of`` picks
    and the share of the model tp split. What the tp parity tests compare with one process."""
    from lightning_scale.tensor_parallel import consolidate_state_dict
    from lightning_scale.tensor_parallel.state import split_summary

    loss = loss_fn(model(**inputs).logits, targets)
    loss.backward()
    grads = consolidate_state_dict(model, values={n: p.grad for n, p in model.named_parameters()})
    return dict(loss=loss.item(), grads=grads, fraction=split_summary(model, 2)["fraction"],
                local_shapes={n: tuple(p.shape) for n, p in model.named_parameters() if shapes_of(n)})


def worst_grad_errors(ref, grads: Dict[str, Any], tol: float) -> Dict[str, float]:
    """``{name: relative max error}`` of every gradient of ``grads`` against ``ref``'s ``.grad`` above ``tol``."""
    worst = {}
    for name, p in ref.named_parameters():
        g = grads[name]
        worst[name] = ((g - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-300)).item()
    return {n: w for n, w in worst.items() if not w <= tol}
