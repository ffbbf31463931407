"""Autograd wrapper around the fused Triton kernels of :mod:`.kernel`.

``triton_block_sparse_attention(q, k, v, index, ...)`` runs the fused forward and, under autograd,
the two-kernel backward. ``index`` comes from :func:`.index.build_block_index` (build it once per
layout / length / device and reuse it: the modules in ``lightning_scale.nn`` cache it).

On a machine without CUDA the kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` was
set before ``triton`` was imported (tests do this); bf16 matmuls are wrong there, so inputs are
upcast to fp32 inside the kernel in that mode.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .index import BlockIndex

_IMPORT_ERROR: Optional[BaseException] = None
try:  # Triton is optional: the torch paths of lightning_scale.nn work without it.
    import triton

    from . import kernel as _k
except ImportError as err:  # pragma: no cover - platform without triton
    _IMPORT_ERROR = err

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: torch.device) -> bool:
    """True when the fused kernels can run on ``device`` (CUDA, or any device in the interpreter)."""
    return _IMPORT_ERROR is None and (device.type == "cuda" or interpreting())


def default_tile(block: int, device: torch.device) -> int:
    """GPU tiles are >= 64 tokens (tensor-core efficiency); the interpreter uses the layout block so
    tests visit as few tiles as possible."""
    return block if device.type != "cuda" else max(64, block)


def _check_inputs(q, k, v, index: BlockIndex) -> None:
    if q.shape != k.shape or q.shape != v.shape or q.dim() != 4:
        raise ValueError(f"q, k, v must share one (B, H, L, D) shape; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, H, L, D = q.shape
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"the Triton kernels take fp32, fp16 or bf16 q/k/v of one dtype; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if not 16 <= D <= 128:
        raise ValueError(f"head_dim={D}: the Triton kernels support 16 to 128")
    if index.block > 128 or index.tile > 128:
        raise ValueError(f"sparsity_config.block={index.block} (tile {index.tile}): the Triton kernels support <= 128")
    if L != index.seq_len or H != index.num_heads:
        raise ValueError(f"index was built for H={index.num_heads}, L={index.seq_len}; inputs have H={H}, L={L}")


def _sub_blocks(tile: int, D: int, cuda: bool, options: dict) -> dict:
    """Register tiles (BLOCK_M, BLOCK_N) per kernel; each divides the index tile. The interpreter uses
    whole tiles (fewest steps). On GPU: FlashAttention-2-like shapes, smaller for D = 128 so the fp32
    accumulators fit in registers."""
    if not cuda:
        defaults = {"fwd": (tile, tile), "dkdv": (tile, tile), "dq": (tile, tile)}
    elif D <= 64:
        defaults = {"fwd": (128, 64), "dkdv": (32, 128), "dq": (128, 32)}
    else:
        defaults = {"fwd": (128, 64), "dkdv": (32, 64), "dq": (64, 32)}
    blocks = {}
    for name, (bm, bn) in defaults.items():
        bm, bn = options.get(name, (min(bm, tile), min(bn, tile)))
        if tile % bm or tile % bn or min(bm, bn) < 16:
            raise ValueError(f"kernel_options[{name!r}]=({bm}, {bn}): sub-blocks must be >= 16 and divide "
                             f"the tile {tile}")
        blocks[name] = dict(BLOCK_M=bm, BLOCK_N=bn)
    return blocks


def _launch_args(q, index: BlockIndex, kpm, bias, kernel_options: Optional[dict] = None):
    B, H, L, D = q.shape
    options = dict(kernel_options or {})
    dummy = index.col_full  # any tensor: pointers of disabled features are never read
    if bias is not None:
        bias = bias.expand(B, H, L, L)
        strides = tuple(bias.stride())
    else:
        strides = (0, 0, 0, 0)
    meta = dict(
        TILE=index.tile, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK=index.block,
        FACTOR=index.tile // index.block, CAUSAL=index.causal, HAS_KPM=kpm is not None, HAS_BIAS=bias is not None,
        UPCAST=interpreting() and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32,
    )
    if q.is_cuda:
        meta.update(num_warps=options.pop("num_warps", 4 if D <= 64 else 8),
                    num_stages=options.pop("num_stages", 2))
    blocks = _sub_blocks(index.tile, D, q.is_cuda, options)
    pointers = (index.fine_layout, kpm if kpm is not None else dummy, bias if bias is not None else dummy)
    sizes = (H, L, D, index.fine_layout.shape[1], index.num_tiles)

    def grid(kernel: str):
        sub = blocks[kernel]["BLOCK_N" if kernel == "dkdv" else "BLOCK_M"]
        return (index.num_tiles * (index.tile // sub), B * H)

    return pointers, strides, sizes, meta, blocks, grid


class BlockSparseAttentionFunction(torch.autograd.Function):
    """Fused block-sparse attention. Masks (additive key padding (B, L) fp32, bias broadcastable to
    (B, H, L, L)) are constants: no gradient flows to them."""

    @staticmethod
    def forward(ctx, q, k, v, index: BlockIndex, kpm, bias, scale: float, kernel_options: Optional[dict]):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, L, D = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(B * H, L, dtype=torch.float32, device=q.device)  # log2 units
        pointers, strides, sizes, meta, blocks, grid = _launch_args(q, index, kpm, bias, kernel_options)
        _k._fwd_kernel[grid("fwd")](q, k, v, out, lse, index.row_ptr, index.col_idx, index.col_full, *pointers,
                                    *strides, *sizes, scale * _k.LOG2E, **meta, **blocks["fwd"])
        ctx.save_for_backward(q, k, v, out, lse, kpm, bias)
        ctx.index, ctx.scale, ctx.kernel_options = index, scale, kernel_options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, kpm, bias = ctx.saved_tensors
        index, scale = ctx.index, ctx.scale
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, L): rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pointers, strides, sizes, meta, blocks, grid = _launch_args(q, index, kpm, bias, ctx.kernel_options)
        _k._bwd_dkdv_kernel[grid("dkdv")](q, k, v, grad_out, lse, delta, dk, dv, index.col_ptr, index.row_idx,
                                          index.row_full, *pointers, *strides, *sizes, scale * _k.LOG2E, scale,
                                          **meta, **blocks["dkdv"])
        _k._bwd_dq_kernel[grid("dq")](q, k, v, grad_out, lse, delta, dq, index.row_ptr, index.col_idx,
                                      index.col_full, *pointers, *strides, *sizes, scale * _k.LOG2E, scale,
                                      **meta, **blocks["dq"])
        return dq, dk, dv, None, None, None, None, None


def triton_block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: BlockIndex, *,
                                  key_padding_mask: Optional[torch.Tensor] = None,
                                  bias: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                  kernel_options: Optional[dict] = None) -> torch.Tensor:
    """q, k, v (B, H, L, D) -> (B, H, L, D) through the fused kernels.

    ``key_padding_mask``: additive (B, L) (0 keeps, -inf drops). ``bias``: additive, broadcastable to
    (B, H, L, L) (e.g. relative-position scores). ``index`` must live on q's device.
    ``kernel_options``: GPU tuning — ``num_warps``, ``num_stages`` and per-kernel sub-blocks
    ``{"fwd": (BLOCK_M, BLOCK_N), "dkdv": (...), "dq": (...)}`` (each dividing the tile).
    """
    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"triton is not importable: {_IMPORT_ERROR}")
    if not triton_available(q.device):
        raise RuntimeError("the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before triton is imported")
    _check_inputs(q, k, v, index)
    B, H, L, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.float32).expand(B, L).contiguous()
    if bias is not None:
        bias = bias.to(q.device).detach()
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
    return BlockSparseAttentionFunction.apply(q, k, v, index, key_padding_mask, bias, scale, kernel_options)
