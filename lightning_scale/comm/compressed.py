"""1-bit compression with error feedback: 1-bit Adam's compressed all-reduce, and a compressed
reduce-scatter onto ZeRO shards.

Paper: Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", ICML 2021, https://arxiv.org/abs/2102.02888 (two-sided error feedback as in DoubleSqueeze).

N ranks; ``x_i`` is rank i's flat tensor of n elements, cut into segments (one per parameter, so a
LayerNorm bias and an embedding each get their own scale), zero-padded to ``L = N * S``; chunk r is
elements ``[r*S, (r+1)*S)`` and rank r is its "server"::

    worker i   c_i = x_i + e_i                            e_i: worker error (n elements)
               s_ip = scale(c_i[segment p]);  q_i = s_i * sign(c_i);  e_i <- c_i - q_i
               bits of chunk r (8 signs per byte) + the scales s_i  -> rank r      (one all_to_all)
    server r   a_r = mean_i q_i[chunk r]                  decoded from what rank r received
               d_r = a_r + E_r                            E_r: server error (S elements)
               t_rk = scale(d_r[piece k]);  o_r = t_r * sign(d_r);  E_r <- d_r - o_r
                                                          (piece = segment ∩ chunk)
               bits of o_r + the scales t_r  -> every rank                          (one all_gather)
    result     [o_0 ... o_{N-1}][:n], identical on every rank

``scale="l2"`` (default) is ``||c||_2 / sqrt(len)``: the compressed segment keeps the input's L2 norm
(the paper's and DeepSpeed's choice). ``scale="mean_abs"`` is ``mean |c|``, the least-squares optimal
scale for fixed signs (smaller error buffers). ``sign(0) = +1``: a 1-bit code has no zero.

Bytes per rank: about ``2 (N-1)/N * n/8`` plus the scales, i.e. 1/32 of an fp32 all-reduce
(``2 (N-1)/N * 4n``), recorded by the accounting layer under ``tag``.

``compressed_reduce_scatter`` stops after the server average: rank r keeps chunk r. With a server
error buffer the chunk is recompressed exactly as above (all-reduce = this + a 1-bit all-gather);
without one the chunk stays in full precision, since nothing is sent after it. The single-process
``simulate_*`` functions run the same algorithm for N virtual ranks (tests compare them exactly).
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch

from lightning_scale.comm.collectives import all_gather, all_to_all, group_rank, group_size
from lightning_scale.kernels.onebit_pack import pack_signs, packed_length, unpack_signs

SCALE_MODES = ("l2", "mean_abs")


class CompressionLayout:
    """Where the segments of a flat buffer meet the N chunks. Pure; cached per (numel, N, segments)."""

    def __init__(self, numel: int, world: int, segments: Tuple[int, ...]) -> None:
        self.numel, self.world, self.segments = numel, world, segments
        self.chunk = -(-numel // world)  # S
        self.padded = self.chunk * world  # L
        self.num_segments = len(segments)  # P
        starts = [0]
        for length in segments:
            starts.append(starts[-1] + length)
        self.segment_bounds = [(a, b) for a, b in zip(starts[:-1], starts[1:])]
        # Pieces of each chunk: (segment, start, end) in chunk coordinates, real elements only.
        self.pieces: List[List[Tuple[int, int, int]]] = []
        for r in range(world):
            lo, hi = r * self.chunk, min((r + 1) * self.chunk, numel)
            self.pieces.append([(p, max(a, lo) - lo, min(b, hi) - lo)
                                for p, (a, b) in enumerate(self.segment_bounds) if max(a, lo) < min(b, hi)])
        self.max_pieces = max(len(p) for p in self.pieces)  # M (>= 1: chunk 0 always holds data)
        self.chunk_real = [sum(e - s for _, s, e in pcs) for pcs in self.pieces]  # real elements per chunk


@functools.lru_cache(maxsize=128)
def _cached_layout(numel: int, world: int, segments: Tuple[int, ...]) -> CompressionLayout:
    return CompressionLayout(numel, world, segments)


def compression_layout(numel: int, world: int, segments: Optional[Sequence[int]] = None) -> CompressionLayout:
    """The layout of a flat buffer of ``numel`` elements cut into ``segments`` (lengths summing to numel)."""
    if int(numel) < 1:
        raise ValueError(f"compressed collectives need at least one element, got numel={numel}")
    if int(world) < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    segs = (int(numel),) if segments is None else tuple(int(s) for s in segments)
    if any(s < 0 for s in segs) or sum(segs) != numel:
        raise ValueError(f"segments must be non-negative lengths summing to numel={numel}; got sum {sum(segs)}")
    return _cached_layout(int(numel), int(world), segs)


def error_buffer_numels(numel: int, world: int) -> Tuple[int, int]:
    """(worker error numel, server error numel) for a tensor of ``numel`` elements over ``world`` ranks."""
    return int(numel), -(-int(numel) // int(world))


def new_error_buffers(tensor: torch.Tensor, group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (worker_error, server_error) for ``tensor`` over ``group``."""
    n_worker, n_server = error_buffer_numels(tensor.numel(), group_size(group))
    return (torch.zeros(n_worker, dtype=tensor.dtype, device=tensor.device),
            torch.zeros(n_server, dtype=tensor.dtype, device=tensor.device))


# ----------------------------------------------------------------------------- the math, per rank
def _scales(x: torch.Tensor, bounds: Sequence[Tuple[int, int]], mode: str) -> torch.Tensor:
    """One scale per ``[a, b)`` range of ``x``: L2 norm / sqrt(len) or mean |x|."""
    if not bounds:
        return x.new_zeros(0)
    ord_ = 2 if mode == "l2" else 1
    norms = torch._foreach_norm([x[a:b] for a, b in bounds], ord_)
    denom = [math.sqrt(max(b - a, 1)) if mode == "l2" else float(max(b - a, 1)) for a, b in bounds]
    return torch.stack(norms) / torch.tensor(denom, dtype=x.dtype, device=x.device)


def _signs(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bits -> +1 / -1 of ``dtype``."""
    one = torch.ones((), dtype=dtype, device=bits.device)
    return torch.where(bits, one, -one)


def worker_compress(x: torch.Tensor, worker_error: torch.Tensor, layout: CompressionLayout,
                    mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Worker side: returns sign bits (N, S) bool and segment scales (P,); updates ``worker_error``."""
    n = layout.numel
    corrected = x.new_empty(layout.padded)  # (L,)
    torch.add(x.reshape(-1), worker_error.view(-1), out=corrected[:n])
    corrected[n:].zero_()
    scales = _scales(corrected, layout.segment_bounds, mode)  # (P,)
    bits = corrected >= 0
    signs = _signs(bits[:n], x.dtype)  # (n,)
    error = worker_error.view(-1)
    # Segment by segment (a few dozen ops): e <- c - s_p * sign(c), without an (L,) scale vector.
    for (a, b), scale in zip(layout.segment_bounds, scales.unbind()):
        torch.addcmul(corrected[a:b], signs[a:b], scale, value=-1, out=error[a:b])
    return bits.view(layout.world, layout.chunk), scales


def server_average(bits: torch.Tensor, scales: torch.Tensor, layout: CompressionLayout, r: int) -> torch.Tensor:
    """Mean over workers of their decoded chunk r: bits (N, S) bool, scales (N, P) -> (S,)."""
    signs = _signs(bits, scales.dtype)  # (N, S)
    avg = signs.new_zeros(layout.chunk)
    for p, s, e in layout.pieces[r]:
        torch.mv(signs[:, s:e].t(), scales[:, p], out=avg[s:e])  # (len, N) @ (N,): sum_i s_ip sign_i
    return avg.div_(layout.world)


def server_compress(avg: torch.Tensor, server_error: torch.Tensor, layout: CompressionLayout, r: int,
                    mode: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Server side: returns bits (S,), piece scales (M,) zero-padded, decoded chunk (S,); updates ``server_error``."""
    corrected = avg + server_error.view(-1)  # (S,); 0 past the real elements
    pieces = _scales(corrected, [(s, e) for _, s, e in layout.pieces[r]], mode)  # (P_r,)
    bits = corrected >= 0
    signs = _signs(bits, avg.dtype)
    decoded = torch.zeros_like(corrected)
    for (_, s, e), scale in zip(layout.pieces[r], pieces.unbind()):
        torch.mul(signs[s:e], scale, out=decoded[s:e])
    torch.sub(corrected, decoded, out=server_error.view(-1))
    padded = torch.cat([pieces, pieces.new_zeros(layout.max_pieces - pieces.numel())])
    return bits, padded, decoded


def decode_gathered(bits: torch.Tensor, piece_scales: torch.Tensor, layout: CompressionLayout) -> torch.Tensor:
    """Every server's output: bits (N, S) bool, piece scales (N, M) -> (n,)."""
    signs = _signs(bits, piece_scales.dtype)  # (N, S)
    out = signs.new_empty(layout.numel)
    for r, pieces in enumerate(layout.pieces):
        base = r * layout.chunk
        for (_, s, e), scale in zip(pieces, piece_scales[r].unbind()):
            torch.mul(signs[r, s:e], scale, out=out[base + s:base + e])
    return out


# ----------------------------------------------------------------------------- wire format
def _message(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of [packed bits | scales as raw bytes]: bits (R, S) bool, scales (K,) -> (R, ceil(S/8) + K*b) uint8."""
    packed = pack_signs(bits)  # (R, Sb)
    raw = scales.contiguous().view(torch.uint8)  # (K * b,)
    return torch.cat([packed, raw.unsqueeze(0).expand(bits.shape[0], -1)], dim=1)


def _read(msg: torch.Tensor, length: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    nbytes = packed_length(length)
    bits = unpack_signs(msg[:, :nbytes], length)  # (R, S)
    scales = msg[:, nbytes:].contiguous().view(dtype)  # (R, K)
    return bits, scales


# ----------------------------------------------------------------------------- collectives
def _validate(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: Optional[torch.Tensor],
              layout: CompressionLayout, mode: str) -> None:
    if mode not in SCALE_MODES:
        raise ValueError(f"scale={mode!r}; choose one of {SCALE_MODES}")
    if tensor.is_sparse or not tensor.is_floating_point():
        raise ValueError("compressed collectives take a dense floating-point tensor, "
                         f"got {tensor.layout}/{tensor.dtype}")
    named = [("worker_error", worker_error, layout.numel)]
    if server_error is not None:
        named.append(("server_error", server_error, layout.chunk))
    for name, buf, numel in named:
        if buf.numel() != numel or buf.dtype != tensor.dtype or buf.device != tensor.device:
            raise ValueError(f"{name} must hold {numel} {tensor.dtype} elements on {tensor.device} "
                             f"(see error_buffer_numels); got {buf.numel()} {buf.dtype} on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is updated in place)")


def _scatter_to_servers(x: torch.Tensor, worker_error: torch.Tensor, layout: CompressionLayout, group,
                        mode: str, tag: str) -> torch.Tensor:
    """Worker compression, one all_to_all, and the server average of this rank's chunk -> (S,)."""
    bits, scales = worker_compress(x, worker_error, layout, mode)  # (N, S), (P,)
    send = _message(bits, scales)  # (N, Sb + P*b): row r goes to rank r
    recv = torch.empty_like(send)
    all_to_all(recv, send, group, tag=tag)
    recv_bits, recv_scales = _read(recv, layout.chunk, x.dtype)  # (N, S), (N, P): row i came from rank i
    return server_average(recv_bits, recv_scales, layout, group_rank(group))


def compressed_reduce_scatter(flat: torch.Tensor, worker_error: torch.Tensor,
                              server_error: Optional[torch.Tensor] = None, group=None, *,
                              segments: Optional[Sequence[int]] = None, scale: str = "l2",
                              tag: str = "onebit") -> torch.Tensor:
    """Average ``flat`` over ``group`` through 1-bit compression; rank r gets chunk r, shape (S,).

    ``S = ceil(numel / N)``; the last chunk is zero past ``numel``. ``worker_error`` (numel elements)
    is updated in place. With ``server_error`` (S elements) the chunk is recompressed with server
    error feedback, giving exactly chunk r of :func:`compressed_all_reduce`; without it the chunk is
    the full-precision mean of the workers' 1-bit messages (what a ZeRO shard owner keeps).
    """
    layout = compression_layout(flat.numel(), group_size(group), segments)
    _validate(flat, worker_error, server_error, layout, scale)
    avg = _scatter_to_servers(flat, worker_error, layout, group, scale, tag)
    if server_error is None:
        return avg
    return server_compress(avg, server_error, layout, group_rank(group), scale)[2]


def compressed_all_reduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          group=None, *, segments: Optional[Sequence[int]] = None, scale: str = "l2",
                          tag: str = "onebit") -> torch.Tensor:
    """Mean of ``tensor`` over ``group`` through 1-bit compression with two-sided error feedback.

    Returns a new tensor shaped like ``tensor``, identical on all ranks. ``worker_error`` (numel
    elements) and ``server_error`` (ceil(numel / N) elements) are updated in place; make them with
    :func:`new_error_buffers`. ``segments`` (lengths summing to numel) each get their own scale.
    """
    layout = compression_layout(tensor.numel(), group_size(group), segments)
    _validate(tensor, worker_error, server_error, layout, scale)
    avg = _scatter_to_servers(tensor, worker_error, layout, group, scale, tag)
    bits, pieces, _ = server_compress(avg, server_error, layout, group_rank(group), scale)
    send = _message(bits.unsqueeze(0), pieces).view(-1)  # (Sb + M*b,)
    recv = torch.empty(layout.world * send.numel(), dtype=torch.uint8, device=send.device)
    all_gather(recv, send, group, tag=tag)
    all_bits, all_pieces = _read(recv.view(layout.world, -1), layout.chunk, tensor.dtype)
    return decode_gathered(all_bits, all_pieces, layout).view_as(tensor)


# ----------------------------------------------------------------------------- single-process simulation
def _simulate_servers(tensors: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                      segments: Optional[Sequence[int]], scale: str):
    if not tensors or len(tensors) != len(worker_errors):
        raise ValueError("give one tensor and one worker error buffer per simulated rank")
    layout = compression_layout(tensors[0].numel(), len(tensors), segments)
    for t, e in zip(tensors, worker_errors):
        _validate(t, e, None, layout, scale)
    sent = [worker_compress(t, e, layout, scale) for t, e in zip(tensors, worker_errors)]
    scales = torch.stack([s for _, s in sent])  # (N, P)
    avgs = [server_average(torch.stack([b[r] for b, _ in sent]), scales, layout, r)
            for r in range(layout.world)]
    return layout, avgs


def _check_server_errors(tensors, server_errors, layout: CompressionLayout, scale: str) -> None:
    if len(server_errors) != len(tensors):
        raise ValueError("give one server error buffer per simulated rank")
    for t, e in zip(tensors, server_errors):
        _validate(t, e.new_zeros(layout.numel), e, layout, scale)


def simulate_compressed_reduce_scatter(tensors: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                                       server_errors: Optional[Sequence[torch.Tensor]] = None, *,
                                       segments: Optional[Sequence[int]] = None,
                                       scale: str = "l2") -> List[torch.Tensor]:
    """:func:`compressed_reduce_scatter` for ``len(tensors)`` virtual ranks in one process."""
    layout, avgs = _simulate_servers(tensors, worker_errors, segments, scale)
    if server_errors is None:
        return avgs
    _check_server_errors(tensors, server_errors, layout, scale)
    return [server_compress(a, e, layout, r, scale)[2] for r, (a, e) in enumerate(zip(avgs, server_errors))]


def simulate_compressed_all_reduce(tensors: Sequence[torch.Tensor], worker_errors: Sequence[torch.Tensor],
                                   server_errors: Sequence[torch.Tensor], *,
                                   segments: Optional[Sequence[int]] = None, scale: str = "l2") -> List[torch.Tensor]:
    """:func:`compressed_all_reduce` for ``len(tensors)`` virtual ranks in one process (one result per rank)."""
    layout, avgs = _simulate_servers(tensors, worker_errors, segments, scale)
    _check_server_errors(tensors, server_errors, layout, scale)
    outs = [server_compress(a, e, layout, r, scale) for r, (a, e) in enumerate(zip(avgs, server_errors))]
    result = decode_gathered(torch.stack([b for b, _, _ in outs]), torch.stack([p for _, p, _ in outs]), layout)
    return [result.view_as(t).clone() for t in tensors]
