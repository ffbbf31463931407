"""The data contract: tensor- and pipeline-parallel peers compute on the same batch (only dp splits data).

A sampler that splits over every rank (``DistributedSampler(num_replicas=world_size, rank=global_rank)``)
gives tp / pp peers different rows: tp then trains silently wrong when the shapes agree, and aborts in a
gloo size mismatch or hangs when they do not. :func:`check_same_batch` compares a checksum of the batch
over every tp, sp and pp group with one all-gather of 4 int64 per rank over the world, so every
rank reaches the same verdict and raises the same :class:`BatchMismatchError` (none waits for a peer that
has already failed). The strategies call it on the first batch of each fit / validate / test / predict run
and, in debug mode (``diagnostics.debug_collectives`` or ``LIGHTNING_SCALE_DEBUG_COLLECTIVES=1``), on every
batch.

The checksum is exact: every tensor's bits are read as integers (a float32 as its int32 pattern), summed
plainly and weighted by position (so a permutation differs), with wrap-around int64 arithmetic, which does
not depend on the reduction order; the shapes and dtypes enter through a polynomial code.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Mapping

import torch
import torch.distributed as dist

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MOD = (1 << 61) - 1  # shape code: a polynomial in the dims, dtype sizes and tensor order, mod a Mersenne prime
_AXES = ("tp", "sp", "pp")  # the axes whose peers read the same batch (sp peers slice it after the check)


class BatchMismatchError(RuntimeError):
    """tp, sp or pp peers received different batches. Every rank raises it at the same batch (the checksums
    are gathered over the world), so it is not a "first error" of one rank."""

    raised_on_every_rank = True


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The batch's tensors in a fixed order: dicts by sorted key, sequences in order; other leaves ignored."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """(N,) int64: each element's bit pattern as an integer (exact for every dtype)."""
    t = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if not t.is_floating_point():
        return t.to(torch.int64)
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()]).to(torch.int64)


def batch_checksum(batch: Any, device: torch.device) -> torch.Tensor:
    """(4,) int64 on ``device``: tensor count, shape/dtype code, sum of bits, position-weighted sum of bits."""
    out = torch.zeros(4, dtype=torch.int64, device=device)
    code = 0
    for i, t in enumerate(_tensors(batch)):
        for d in (i + 1, t.element_size(), int(t.is_floating_point()), t.dim(), *t.shape):
            code = (code * 1_000_003 + d) % _MOD
        bits = _bits(t).to(device)
        weights = torch.arange(bits.numel(), device=device, dtype=torch.int64) % 65521 + 1
        out[0] += 1
        out[2] += bits.sum()
        out[3] += (bits * weights).sum() * (i + 1)  # the tensor's place counts too
    out[1] = code
    return out


def _hex(row: List[int]) -> str:
    h = 0
    for v in row:
        h = (h * 0x100000001B3 ^ (v & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def check_same_batch(batch: Any, topology: Any, *, where: str, device: torch.device) -> None:
    """Raise :class:`BatchMismatchError` on every rank when the peers of a tp, sp or pp group hold different
    batches. A collective over the world: every rank calls it for the same batch. No-op without tp / sp / pp."""
    axes = [a for a in _AXES if getattr(topology, a, 1) > 1 and not (a == "tp" and getattr(topology, "ep", 1) > 1)]
    if not axes or not (dist.is_available() and dist.is_initialized()):
        return
    from lightning_scale.comm import collectives as C  # comm imports diagnostics.trace: not at import time

    mine = batch_checksum(batch, device)
    world = dist.get_world_size()
    every = torch.empty(world * 4, dtype=torch.int64, device=device)
    C.all_gather(every, mine, None, tag="batch_check")
    rows = every.view(world, 4).tolist()
    for axis in axes:
        for ranks in topology.all_axis_ranks(axis):
            first = ranks[0]
            for r in ranks[1:]:
                if rows[r] != rows[first]:
                    raise BatchMismatchError(
                        f"{axis} peers received different batches at {where}: rank {first} checksum "
                        f"{_hex(rows[first])}, rank {r} checksum {_hex(rows[r])}; the sampler must split over dp "
                        f"only: use strategy.dp_rank/dp_size (DistributedSampler(num_replicas=strategy.dp_size, "
                        f"rank=strategy.dp_rank)), or leave use_distributed_sampler on")


__all__ = ["BatchMismatchError", "batch_checksum", "check_same_batch"]
