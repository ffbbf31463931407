"""lightning_scale.diagnostics.elastic.attempt_store: one key namespace per torchrun restart attempt, on the agent's
store (the store torchrun keeps across restarts), and nothing changed outside a single-host torchrun."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from lightning_scale.diagnostics.elastic import attempt_store


def _torchrun_env(monkeypatch, port, attempt, world=2, local_world=2):
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
                 "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)


def test_each_attempt_reads_only_its_own_keys(monkeypatch):
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what torchrun's agent hosts
    timeout = datetime.timedelta(seconds=5)
    _torchrun_env(monkeypatch, agent.port, 0)
    first = attempt_store(timeout)
    first.set("rank_1", "address of the killed rank")
    _torchrun_env(monkeypatch, agent.port, 1)
    second = attempt_store(timeout)
    assert not second.check(["rank_1"])  # the restarted ranks cannot read the dead attempt's address
    second.set("rank_1", "new address")
    assert first.get("rank_1") == b"address of the killed rank" and second.get("rank_1") == b"new address"
    assert agent.check(["lightning_scale/attempt_1/rank_1"])  # on the agent's store itself


def test_nothing_changes_outside_a_single_host_torchrun(monkeypatch):
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert attempt_store() is None  # plain env:// (Lightning's own launcher, SLURM)
    _torchrun_env(monkeypatch, 1, 0, world=4, local_world=2)
    assert attempt_store() is None  # several agents: their restart counts need not agree
    _torchrun_env(monkeypatch, 1, 0)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    assert attempt_store() is None


def test_watchdogs_of_two_hosts_share_keys_though_their_restart_counts_differ(monkeypatch, capsys):
    """Two torchrun agents (two hosts of one rank, a fresh store per round: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    after rank 1's restart: its agent counts attempt 1, rank 0's (restarted by the re-rendezvous) attempt 0. The
    watchdogs must still meet: rank 0 sees rank 1's heartbeat and is released at the end by rank 1's "done"
    (with the keys prefixed by each agent's count, rank 0 waited its whole stop_timeout at the end of the
    two-node restart test and said "not every rank reached the end")."""
    import time

    from lightning_scale.diagnostics import DiagnosticsConfig, Watchdog

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # rank 0 hosts the round's store
    peer = dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    config = DiagnosticsConfig(heartbeat_interval=0.2, stop_timeout=3.0)
    dogs = []
    for count, store, rank in ((0, host, 0), (1, peer, 1)):
        _torchrun_env(monkeypatch, host.port, count, world=2, local_world=1)
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
        dogs.append(Watchdog(store, rank, 2, config, exit_fn=lambda c: None).start())
    try:
        time.sleep(0.5)
        assert dogs[0].store.check(["hb/1"]) and dogs[1].store.check(["hb/0"])
        dogs[1].close()
        dogs[1].finish()
        start = time.monotonic()
        dogs[0].close()
        dogs[0].finish()
        assert time.monotonic() - start < 1.5
        assert "not every rank reached the end" not in capsys.readouterr().err
    finally:
        for d in dogs:
            d.close()


def test_one_host_with_the_agent_store_keeps_a_namespace_per_attempt(monkeypatch):
    from lightning_scale.diagnostics.elastic import shared_attempt

    _torchrun_env(monkeypatch, 1, 3)
    assert shared_attempt() == "3"  # every rank under one agent: one count; the store outlives the attempt
    _torchrun_env(monkeypatch, 1, 3, world=4, local_world=2)
    assert shared_attempt() is None  # several agents sharing the store: the counts need not agree
    _torchrun_env(monkeypatch, 1, 3, world=2, local_world=1)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert shared_attempt() is None  # a fresh store each round: nothing stale
