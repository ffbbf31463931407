"""Slow-network harness, pure parts: rate parsing, the command plan, input validation, skip reasons."""

from __future__ import annotations

import pytest

from lightning_scale import testing_netns as N


@pytest.mark.parametrize("text,bits", [("100mbit", 1e8), ("1gbit", 1e9), ("2.5gbit", 2.5e9), ("64kbit", 64e3),
                                       (" 10 MBit ", 1e7), ("9600bit", 9600)])
def test_parse_rate(text, bits):
    assert N.parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["100", "fast", "0mbit", "-1gbit", "100mbps", ""])
def test_parse_rate_rejects(bad):
    with pytest.raises(ValueError, match="rate="):
        N.parse_rate(bad)


def test_plan_caps_both_directions_of_every_link_inside_the_namespaces():
    net = N.SlowNetwork(hosts=3, rate="100mbit", subnet="10.9.8")
    cmds = N.plan_commands(net.names, net.hosts, net.rate, net.subnet)
    ours = set(net.namespaces())
    for cmd in cmds:
        # every command names one of our namespaces: nothing is created in the machine's own
        if cmd[:3] != ["ip", "netns", "add"]:
            assert cmd[1] == "-n" and cmd[2] in ours, cmd
        else:
            assert cmd[3] in ours
    tbf = [c for c in cmds if c[0] == "tc"]
    assert len(tbf) == 2 * 3  # host egress + switch-port egress per host
    for c in tbf:
        k = c.index("rate")
        assert c[c.index("root") + 1] == "tbf" and c[k + 1] == "100000000bit"
        assert int(c[c.index("burst") + 1]) >= 64 * 1024
    hosts_with_cap = {c[2] for c in tbf if c[2] != net.names["switch"]}
    assert hosts_with_cap == set(net.names["hosts"])
    addrs = [c[c.index("add") + 1] for c in cmds if "addr" in c]
    assert addrs == ["10.9.8.1/24", "10.9.8.2/24", "10.9.8.3/24"]
    assert [net.address(i) for i in range(3)] == ["10.9.8.1", "10.9.8.2", "10.9.8.3"]
    assert not any("default" in c or "route" in c for c in cmds)  # no way out of the namespaces


def test_names_are_unique_and_carry_the_owner_pid():
    a, b = N.SlowNetwork(), N.SlowNetwork()
    assert not set(a.namespaces()) & set(b.namespaces())
    import os

    assert all(name.startswith(f"{N.PREFIX}{os.getpid()}-") for name in a.namespaces())


@pytest.mark.parametrize("kw,match", [(dict(hosts=1), "hosts=1"), (dict(hosts=2.0), "hosts=2.0"),
                                      (dict(rate="lots"), "rate="), (dict(subnet="10.0.0.0/24"), "subnet="),
                                      (dict(subnet="10.300.0"), "subnet=")])
def test_bad_network_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        N.SlowNetwork(**kw)


def test_run_on_hosts_needs_a_created_network():
    with pytest.raises(RuntimeError, match="created SlowNetwork"):
        N.run_on_hosts(print, N.SlowNetwork())


def test_unavailable_reason_names_the_missing_tool(monkeypatch):
    N.unavailable_reason.cache_clear()
    monkeypatch.setattr(N.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    try:
        reason = N.unavailable_reason()
    finally:
        N.unavailable_reason.cache_clear()
    assert reason is not None and "tc not found" in reason and "iproute2" in reason


def test_unavailable_reason_without_net_admin(monkeypatch):
    N.unavailable_reason.cache_clear()
    monkeypatch.setattr(N.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(N, "_has_net_admin", lambda: False)
    try:
        reason = N.unavailable_reason()
    finally:
        N.unavailable_reason.cache_clear()
    assert reason is not None and "CAP_NET_ADMIN" in reason
