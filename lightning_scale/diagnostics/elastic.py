"""A process-group store of its own for each torchrun restart attempt (issue 15, survive a lost rank).

torchrun's c10d rendezvous shares the elastic agent's TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``,
the default since torch 2.4) and keeps that store, on the same ``MASTER_PORT``, across ``--max-restarts``. The keys the
killed attempt wrote stay in it. ``init_process_group`` puts no attempt prefix on them (torch's ``env://`` handler
assumes a fresh store per retry), so the restarted ranks can read the dead ranks' addresses: measured with torch
2.13 on 2 CPU ranks, gloo's ``connectFullMesh`` failed with "Connection refused" on the old ports and the restart
died (pytorch/pytorch#135712 reports the same for NCCL's unique id). The same happens to every ``new_group``.

Fix: on one host (every rank under one agent, so every rank sees the same ``TORCHELASTIC_RESTART_COUNT``) the
default process group is built on ``PrefixStore("lightning_scale/attempt_<n>", <the agent's store>)``; groups made
later use the same prefixed store. Across hosts the counts can differ (an agent whose workers were healthy restarts
them without counting), which would split the ranks into two namespaces and hang: there nothing is changed, and the
launch recipe is ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...`` (a fresh store each round;
docs/failures.md).
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Optional

PREFIX = "lightning_scale/attempt_"


def shared_attempt() -> Optional[str]:
    """The restart attempt every rank agrees on, for keys on a store that outlives torchrun restarts: the restart
    count under a single-host torchrun with the shared agent store; ``None`` where each attempt gets a fresh store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, Lightning's launcher, SLURM: nothing stale to hide) and across hosts
    (the agents' counts differ: an agent restarted by the re-rendezvous does not count it, so a per-count namespace
    would split the ranks; the process group needs a fresh store there anyway, docs/failures.md)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    if env.get("WORLD_SIZE") != env.get("LOCAL_WORLD_SIZE"):
        return None
    return env["TORCHELASTIC_RESTART_COUNT"]


def attempt_store(timeout: Optional[datetime.timedelta] = None) -> Optional[Any]:
    """The store for ``init_process_group(store=...)`` under a single-host torchrun with the shared agent store,
    prefixed by the restart attempt; ``None`` everywhere else (``env://`` as usual)."""
    env = os.environ
    attempt = shared_attempt()  # None: several agents (their counts need not agree) or a fresh store per attempt
    try:
        world, addr, port = int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    if attempt is None:
        return None
    import torch.distributed as dist

    kwargs = {} if timeout is None else {"timeout": timeout}
    store = dist.TCPStore(addr, port, world_size=world, is_master=False, **kwargs)  # the agent hosts it
    return dist.PrefixStore(f"{PREFIX}{attempt}", store)  # keys: <prefix>/<key>
