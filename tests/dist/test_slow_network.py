"""The slow-network harness: ranks land in their hosts' namespaces, the link is capped, everything is removed.

2 hosts x 2 ranks over a 100 Mbit/s link. Each rank checks it runs in its host's namespace and that
gloo bound to that host's address; an all_reduce between the two hosts must run near the cap and
never above it (tbf cannot send faster than its rate; the margin covers the bucket's initial
burst), while the same all_reduce between the two ranks of one host, which never touches the link,
runs faster than the cap. Skipped with the reason where the machine forbids namespaces.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from lightning_scale import testing_netns as N
from lightning_scale.testing import DistributedTestError

RATE, NUMEL, REPS = "100mbit", 2 * 2**20, 3  # 8 MiB float32 per all_reduce: ~0.7 s at 100 Mbit/s

pytestmark = pytest.mark.skipif(N.unavailable_reason() is not None,
                                reason=f"slow-network harness unavailable: {N.unavailable_reason()}")


def _timed_all_reduce(group, numel: int, reps: int) -> float:
    """Bits per second one rank sends in ``reps`` all_reduces (ring: 2 (N-1)/N x payload per rank)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(numel)
    dist.all_reduce(buf, group=group)  # connect first: the timing is payload only
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(buf, group=group)
    seconds = time.perf_counter() - start
    n = dist.get_world_size(group)
    return reps * 2 * (n - 1) / n * numel * 4 * 8 / seconds


def _worker(rank: int, world_size: int, expected_ns_inodes: list) -> dict:
    import psutil
    import torch.distributed as dist

    host = int(os.environ["LIGHTNING_SCALE_HOST"])
    ns_inode = int(os.readlink("/proc/self/ns/net").split("[")[1].rstrip("]"))
    cross = dist.new_group([0, 2])  # host 0 <-> host 1
    local = [dist.new_group([0, 1]), dist.new_group([2, 3])][host]
    out = {"host": host, "in_host_ns": ns_inode == expected_ns_inodes[host]}
    if rank in (0, 2):
        out["cross_bps"] = _timed_all_reduce(cross, NUMEL, REPS)
    for h in range(2):  # each intra-host measurement runs alone
        dist.barrier()
        if host == h:
            out["local_bps"] = _timed_all_reduce(local, NUMEL, REPS)
    # gloo bound to the host's address: every TCP connection of this rank starts there
    conns = psutil.Process().net_connections(kind="tcp")
    out["local_ips"] = sorted({c.laddr.ip.removeprefix("::ffff:") for c in conns if c.raddr})
    return out


@pytest.mark.timeout(180)
def test_two_hosts_over_a_capped_link_then_removed():
    with N.SlowNetwork(hosts=2, rate=RATE) as net:
        names = net.namespaces()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(name in listed for name in names)
        inodes = [os.stat(f"/run/netns/{net.host_ns(h)}").st_ino for h in range(2)]
        results = N.run_on_hosts(_worker, net, ranks_per_host=2, args=(inodes,), timeout=150)
    limit = N.parse_rate(RATE)
    for rank, res in enumerate(results):
        assert res["host"] == rank // 2 and res["in_host_ns"], (rank, res)
        assert res["local_ips"] == [f"10.213.0.{res['host'] + 1}"], (rank, res["local_ips"])
    cross = [r["cross_bps"] for r in results if "cross_bps" in r]
    local = [round(r["local_bps"] / 1e6) for r in results]
    print(f"cross-host all_reduce: {[round(b / 1e6, 1) for b in cross]} Mbit/s at a {limit / 1e6:.0f} Mbit/s cap; "
          f"intra-host: {local} Mbit/s")
    for bps in cross:
        assert bps <= 1.05 * limit, f"{bps / 1e6:.1f} Mbit/s crossed a {RATE} link: the cap is not applied"
        assert bps >= 0.3 * limit, f"{bps / 1e6:.1f} Mbit/s on a {RATE} link: far below the cap"
    for res in results:  # same host: loopback, not the capped link
        assert res["local_bps"] > 1.05 * limit, res
    # removed: namespaces (and with them the veths and the bridge) are gone
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed
    assert not net.created


def test_failure_inside_a_host_is_reported_and_cleaned_up():
    with pytest.raises(DistributedTestError, match="boom"):
        with N.SlowNetwork(hosts=2, rate="1gbit") as net:
            names = net.namespaces()
            N.run_on_hosts(_boom, net, ranks_per_host=1, timeout=60)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed


def _boom(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on host 1")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for rank 1, which is gone: the harness must not hang
