"""Slow-network harness: ranks run as separate "hosts" in Linux network namespaces over rate-limited links.

Why: the claim that pipeline parallelism wins on clusters with limited bandwidth cannot be measured
on one machine where every rank talks over loopback. Here each host is a network namespace with one
interface, ``lsnet0``, wired to a software switch (a bridge in its own namespace) by a veth pair; a
``tc`` token-bucket filter (``tbf``) caps both directions of every host's link at ``rate``. Ranks of
the same host share its namespace, so they talk over its loopback at memory speed, like GPUs in one
server; ranks on different hosts cross the capped link, like servers on a slow network::

    host 0 (ns)            switch (ns)            host 1 (ns)
    ranks 0..k-1           bridge br0             ranks k..2k-1
    lsnet0 10.213.0.1 ==== p0    p1 ============= lsnet0 10.213.0.2
          tbf rate ->      <- tbf rate  tbf rate ->   <- tbf rate

Nothing is created in, or routed to, the machine's own network namespace: the namespaces have no
default route, so the ranks can reach only each other. ``gloo`` binds to ``lsnet0``
(``GLOO_SOCKET_IFNAME``) and ranks rendezvous over ``tcp://`` at host 0's address, as on a cluster.

Needs Linux, iproute2 (``ip``, ``tc``; Debian package ``iproute2``), the veth, bridge and tbf kernel
features, and CAP_NET_ADMIN (root). :func:`unavailable_reason` says why not, for a clean skip.

    with SlowNetwork(hosts=2, rate="100mbit") as net:
        results = run_on_hosts(fn, net, ranks_per_host=2, args=(...,), timeout=300)
"""

from __future__ import annotations

import datetime
import functools
import importlib
import itertools
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from typing import Any, Callable, List, Optional, Sequence

from lightning_scale.testing import collect_results, wait_for_ranks

IFNAME = "lsnet0"  # the host-side interface; the same name in every host namespace
PREFIX = "lsnet-"  # every namespace this module creates: lsnet-<pid>-<n>-{sw,h<i>}
_counter = itertools.count()
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_rate(rate: str) -> float:
    """``"100mbit"`` -> 1e8 bits/s (tc's decimal units: bit, kbit, mbit, gbit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?bit)\s*", str(rate).lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate={rate!r}: expected a positive link rate like '100mbit' or '1gbit'")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _tbf_args(rate: str) -> List[str]:
    bits = parse_rate(rate)
    # The bucket must hold at least one GSO super-packet (64 KiB) and ~10 ms of traffic, or tbf
    # starves fast links; ``latency`` bounds the queue (deep enough that TCP rarely sees drops).
    burst = max(64 * 1024, int(bits / 8 / 100))
    return ["tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "100ms"]


def plan_commands(names: dict, hosts: int, rate: str, subnet: str) -> List[List[str]]:
    """The ``ip`` / ``tc`` commands that build the network (pure, so a unit test can read them)."""
    sw = names["switch"]
    cmds = [["ip", "netns", "add", sw]] + [["ip", "netns", "add", names["hosts"][i]] for i in range(hosts)]
    cmds += [["ip", "-n", sw, "link", "add", "br0", "type", "bridge"], ["ip", "-n", sw, "link", "set", "br0", "up"]]
    for i, host in enumerate(names["hosts"]):
        port = f"p{i}"
        cmds += [
            # both ends are created inside their namespaces: nothing appears in the machine's own
            ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", host],
            ["ip", "-n", sw, "link", "set", port, "master", "br0"],
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", host, "link", "set", "lo", "up"],
            ["ip", "-n", host, "addr", "add", f"{subnet}.{i + 1}/24", "dev", IFNAME],
            ["ip", "-n", host, "link", "set", IFNAME, "up"],
            ["tc", "-n", host, "qdisc", "add", "dev", IFNAME, "root", *_tbf_args(rate)],  # host -> switch
            ["tc", "-n", sw, "qdisc", "add", "dev", port, "root", *_tbf_args(rate)],  # switch -> host
        ]
    return cmds


def _run(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        detail = proc.stderr.strip() or proc.stdout.strip()
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {detail}")


def _has_net_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) & (1 << 12))  # CAP_NET_ADMIN = 12
    except (OSError, StopIteration, ValueError):
        return os.geteuid() == 0


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None when namespaces, veth, bridge and tbf all work here; otherwise why not (for a skip)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (Debian: apt-get install -y iproute2)"
    if not _has_net_admin():
        return "creating network namespaces needs CAP_NET_ADMIN (run as root or grant the capability)"
    try:
        SlowNetwork(hosts=2, rate="1gbit").create().destroy()
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        return f"this machine forbids the slow-network harness: {err}"
    return None


def cleanup_stale() -> List[str]:
    """Delete namespaces left by harness processes that no longer exist (a killed test run)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for name in (line.split()[0] for line in out.splitlines() if line.strip()):
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+-(?:sw|h\d+)", name)
        if not m or _alive(int(m.group(1))):
            continue
        _kill_namespace_pids(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_pids(name: str) -> None:
    """Processes left inside one of our namespaces are ranks this harness started: end them."""
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class SlowNetwork:
    """``hosts`` network namespaces on a switch, each link capped at ``rate`` both ways.

    A context manager: created on enter, removed on exit (also when the body raises).
    """

    def __init__(self, hosts: int = 2, rate: str = "100mbit", *, subnet: str = "10.213.0") -> None:
        if not isinstance(hosts, int) or not 2 <= hosts <= 200:
            raise ValueError(f"hosts={hosts!r}: the slow-network harness needs 2 to 200 hosts")
        parse_rate(rate)
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet) or any(int(x) > 255 for x in subnet.split(".")):
            raise ValueError(f"subnet={subnet!r}: expected the first three octets of a /24, e.g. '10.213.0'")
        self.hosts, self.rate, self.subnet = hosts, rate, subnet
        tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.names = {"switch": f"{tag}-sw", "hosts": [f"{tag}-h{i}" for i in range(hosts)]}
        self.created = False

    @property
    def rate_bits(self) -> float:
        return parse_rate(self.rate)

    @property
    def ifname(self) -> str:
        return IFNAME

    def host_ns(self, i: int) -> str:
        return self.names["hosts"][i]

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def namespaces(self) -> List[str]:
        return [self.names["switch"], *self.names["hosts"]]

    def create(self) -> "SlowNetwork":
        cleanup_stale()
        self.created = True  # from the first command on, destroy() has something to remove
        try:
            for cmd in plan_commands(self.names, self.hosts, self.rate, self.subnet):
                _run(cmd)
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self) -> "SlowNetwork":
        if not self.created:
            return self
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for name in self.namespaces():
            if name in listed:
                _kill_namespace_pids(name)
                subprocess.run(["ip", "netns", "del", name], capture_output=True)  # veths and bridge go with it
        self.created = False
        return self

    def __enter__(self) -> "SlowNetwork":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"SlowNetwork(hosts={self.hosts}, rate={self.rate!r}, namespaces={self.namespaces()})"


# ---------------------------------------------------------------------- launching ranks on hosts
def run_on_hosts(fn: Callable, net: SlowNetwork, *, ranks_per_host: int = 1, args: Sequence[Any] = (),
                 timeout: float = 300.0, threads: int = 1, env: Optional[dict] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` with ranks ``h*ranks_per_host ...`` inside host ``h``'s namespace.

    Like :func:`lightning_scale.testing.run_distributed` (gloo, results by rank, the first failing
    rank's traceback re-raised, hung ranks killed at ``timeout``) but each rank runs in its host's
    namespace, gloo binds to ``lsnet0`` and the rendezvous is ``tcp://`` at host 0's address.
    """
    if not net.created:
        raise RuntimeError("run_on_hosts needs a created SlowNetwork (use it as a context manager)")
    if not isinstance(ranks_per_host, int) or ranks_per_host < 1:
        raise ValueError(f"ranks_per_host={ranks_per_host!r} must be a positive integer")
    world = net.hosts * ranks_per_host
    target, sys_path = _target(fn)
    tmp = tempfile.mkdtemp(prefix="ls_netns_")
    job = os.path.join(tmp, "job.pkl")
    with open(job, "wb") as f:
        pickle.dump(dict(target=target, world_size=world, tmp=tmp, args=tuple(args), sys_path=sys_path,
                         init=f"tcp://{net.address(0)}:{29400 + next(_counter) % 500}", timeout_s=timeout,
                         threads=threads, ranks_per_host=ranks_per_host), f)
    child_env = dict(os.environ, OMP_NUM_THREADS=str(threads), GLOO_SOCKET_IFNAME=IFNAME,
                     LIGHTNING_SCALE_SKIP_REGISTER="1", LIGHTNING_SCALE_RANK_WORKER="1")
    child_env.update(env or {})
    code = "from lightning_scale.testing_netns import _entry; _entry()"
    procs = [subprocess.Popen(["ip", "netns", "exec", net.host_ns(r // ranks_per_host), sys.executable, "-c", code,
                               job, str(r)], env=child_env, start_new_session=True) for r in range(world)]
    try:
        _wait(procs, timeout)
        return _collect(tmp, procs, ranks_per_host, timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failure's traceback travels in the exception


def _collect(tmp: str, procs: List[subprocess.Popen], ranks_per_host: int, timeout: float) -> List[Any]:
    world = len(procs)
    return collect_results(tmp, procs, timeout, lambda r: f"rank {r} of {world} (host {r // ranks_per_host})")


def _target(fn: Callable):
    sys_path = list(sys.path)
    target = f"{fn.__module__}:{fn.__qualname__}"
    if fn.__module__ == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if path is None:
            raise ValueError("run_on_hosts needs a function defined in an importable module")
        sys_path.insert(0, os.path.dirname(os.path.abspath(path)))
        target = f"{os.path.splitext(os.path.basename(path))[0]}:{fn.__qualname__}"
    return target, sys_path


_wait = wait_for_ranks  # the same policy as run_distributed


def _entry() -> None:
    """Rank entry inside a host namespace: ``python -c '...; _entry()' JOB RANK``."""
    from lightning_scale.testing import _die_with_parent

    job, rank = sys.argv[1], int(sys.argv[2])
    _die_with_parent()
    with open(job, "rb") as f:
        spec = pickle.load(f)
    tmp, world = spec["tmp"], spec["world_size"]
    sys.path[:] = spec["sys_path"]
    per_host = spec["ranks_per_host"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                      LOCAL_WORLD_SIZE=str(per_host), LIGHTNING_SCALE_HOST=str(rank // per_host))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec["threads"])
        dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec["timeout_s"]))
        module_name, qualname = spec["target"].split(":")
        fn: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        result = fn(rank, world, *spec["args"])
        with open(os.path.join(tmp, f"result_{rank}.pkl.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(tmp, f"result_{rank}.pkl.tmp"), os.path.join(tmp, f"result_{rank}.pkl"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, then exit non-zero
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
