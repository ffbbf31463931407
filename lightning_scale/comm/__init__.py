from lightning_scale.comm.accounting import CommCounter, algorithmic_bytes
from lightning_scale.comm.p2p import P2P, PendingRecv
from lightning_scale.comm.collectives import (
    Handle,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    group_rank,
    group_size,
    reduce_scatter,
)

__all__ = [
    "CommCounter",
    "P2P",
    "PendingRecv",
    "Handle",
    "algorithmic_bytes",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "group_rank",
    "group_size",
    "reduce_scatter",
]
