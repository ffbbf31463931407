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
