"""``SparseSelfAttention``: DeepSpeed's drop-in block-sparse attention on current torch / Triton.

Two engines compute the same function (checked against a dense fp64 reference in the tests):

* ``"triton"``: fused flash-style kernels (forward + backward), used for CUDA tensors;
* ``"torch"``: block-gather with a hand-written, chunked, recomputing backward, used on the CPU
  (and for fp64 anywhere).

Everything that depends only on (layout, L, device) — the sliced layout, the kernels' index lists,
the CPU gather plan — is built once and cached on the module.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_scale.config import ConfigError
from lightning_scale.kernels.block_sparse_attention.index import BlockIndex, build_block_index, index_to
from lightning_scale.nn._workers import worker_count
from lightning_scale.nn.block_gather import GatherPlan, block_gather_attention, build_gather_plan
from lightning_scale.nn.sparsity_config import SparsityConfig

MASK_MODES = ("add", "mul")
BACKENDS = ("auto", "triton", "torch")


def mask_to_additive(mask: torch.Tensor, mode: str, name: str) -> torch.Tensor:
    """DeepSpeed's mask modes -> an additive fp32 mask. ``mul``: 0 drops, non-zero keeps; ``add``: the
    values are added to the scores (0 keeps, -inf or a large negative drops). Boolean masks always
    mean True = keep."""
    if mode not in MASK_MODES:
        raise ValueError(f"{name}={mode!r}: must be one of {', '.join(MASK_MODES)}")
    if mask.dtype == torch.bool or mode == "mul":
        keep = mask if mask.dtype == torch.bool else mask != 0
        return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill_(~keep, float("-inf"))
    return mask.to(torch.float32)


def choose_backend(q: torch.Tensor, block: int, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if q.is_cuda and q.dtype in (torch.float32, torch.float16, torch.bfloat16) and 16 <= q.shape[-1] <= 128 \
            and block <= 128:
        from lightning_scale.kernels.block_sparse_attention.launch import triton_available

        if triton_available(q.device):
            return "triton"
    return "torch"


def _run_torch(q, k, v, plan_fn, kpm, bias, scale):
    """The block-gather engine; half precision runs in fp32 on the CPU (no fast half matmul there)."""
    dtype = q.dtype
    if q.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    work = q.dtype
    kpm = kpm.to(work) if kpm is not None else None
    bias = bias.to(work) if bias is not None else None
    out = block_gather_attention(q, k, v, plan_fn(q), key_padding_mask=kpm, bias=bias, scale=scale)
    return out.to(dtype)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: torch.Tensor, block: int, *,
                           causal: bool = False, key_padding_mask: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                           backend: str = "auto") -> torch.Tensor:
    """Functional form (builds its index each call; modules cache it). q, k, v: (B, H, L, D);
    ``layout`` (H, L // block, L // block); masks additive: key_padding_mask (B, L), bias
    broadcastable to (B, H, L, L)."""
    B, H, L, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if choose_backend(q, block, backend) == "triton":
        from lightning_scale.kernels.block_sparse_attention.launch import default_tile, triton_block_sparse_attention

        index = index_to(build_block_index(layout.cpu(), block, L, default_tile(block, q.device), causal), q.device)
        return triton_block_sparse_attention(q, k, v, index, key_padding_mask=key_padding_mask, bias=bias, scale=scale)
    plan = lambda x: build_gather_plan(layout, block, B, D, causal, element_size=x.element_size(),  # noqa: E731
                                       workers=worker_count(x.device, B * H), device=x.device)
    return _run_torch(q, k, v, plan, key_padding_mask, bias, scale)


class SparseSelfAttention(nn.Module):
    """Block-sparse scaled dot-product attention over (B, H, L, D) inputs (DeepSpeed's signature).

    Args:
        sparsity_config: one of the configs of :mod:`lightning_scale.nn.sparsity_config`.
        key_padding_mask_mode / attn_mask_mode: ``"add"`` or ``"mul"`` (DeepSpeed's defaults).
        max_seq_length: the layout is built once for this length; shorter inputs use its top-left slice.
        causal: mask the future inside diagonal blocks and drop blocks above the diagonal. ``None``
            (default) follows the config: ``attention="unidirectional"`` means causal.
        auto_pad: accept lengths that are not a multiple of ``block`` by padding to the next multiple
            (padded keys are masked out, padded rows dropped). Off by default, as in DeepSpeed.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` or ``"torch"``.
        chunk_bytes: working-set bound of one chunk of the torch engine (speed vs memory); default:
            scaled with the sequence (see ``block_gather.auto_chunk_bytes``).
        tile: kernel tile of the Triton engine (default: max(64, block) on GPU).
    """

    def __init__(self, sparsity_config: SparsityConfig, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, *, causal: Optional[bool] = None,
                 auto_pad: bool = False, backend: str = "auto", chunk_bytes: Optional[int] = None,
                 tile: Optional[int] = None) -> None:
        super().__init__()
        if not isinstance(sparsity_config, SparsityConfig):
            raise ConfigError(f"sparsity_config must be a SparsityConfig, got {type(sparsity_config).__name__}")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ConfigError(f"{name}={mode!r}: must be one of {', '.join(MASK_MODES)}")
        if backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r}: must be one of {', '.join(BACKENDS)}")
        if max_seq_length < sparsity_config.block or max_seq_length % sparsity_config.block:
            raise ConfigError(f"max_seq_length={max_seq_length} must be a positive multiple of "
                              f"sparsity_config.block={sparsity_config.block}")
        self.sparsity_config = sparsity_config
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.causal = sparsity_config.causal if causal is None else bool(causal)
        self.auto_pad = auto_pad
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.tile = tile
        self._master_layout: Optional[torch.Tensor] = None
        self._plans: Dict[Tuple, GatherPlan] = {}
        self._indices: Dict[Tuple, BlockIndex] = {}

    def extra_repr(self) -> str:
        return f"{self.sparsity_config}, causal={self.causal}, max_seq_length={self.max_seq_length}"

    def get_layout(self, seq_len: int) -> torch.Tensor:
        """(H, seq_len // block, seq_len // block) slice of the layout built for ``max_seq_length``."""
        block = self.sparsity_config.block
        if seq_len % block:
            raise ValueError(f"sequence length {seq_len} is not a multiple of sparsity_config.block={block}; "
                             "pad it (lightning_scale.nn.pad_to_block_size) or use auto_pad=True")
        if seq_len > self.max_seq_length:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_length={self.max_seq_length}")
        if self._master_layout is None:
            self._master_layout = self.sparsity_config.make_layout(self.max_seq_length).bool()
        nb = seq_len // block
        return self._master_layout[:, :nb, :nb]

    def _plan(self, q: torch.Tensor) -> GatherPlan:
        B, H, L, D = q.shape
        workers = worker_count(q.device, B * H)
        key = (L, B, D, q.element_size(), workers, str(q.device))
        if key not in self._plans:
            self._plans[key] = build_gather_plan(self.get_layout(L), self.sparsity_config.block, B, D, self.causal,
                                                 self.chunk_bytes, q.element_size(), workers, q.device)
        return self._plans[key]

    def _index(self, q: torch.Tensor) -> BlockIndex:
        from lightning_scale.kernels.block_sparse_attention.launch import default_tile

        L, block = q.shape[2], self.sparsity_config.block
        tile = self.tile or default_tile(block, q.device)
        key = (L, str(q.device), tile)
        if key not in self._indices:
            self._indices[key] = index_to(build_block_index(self.get_layout(L), block, L, tile, self.causal), q.device)
        return self._indices[key]

    def _check(self, query, key, value) -> None:
        if query.dim() != 4 or query.shape != key.shape or query.shape != value.shape:
            raise ValueError("query, key, value must share one (batch, heads, seq_len, head_dim) shape; got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if query.shape[1] != self.sparsity_config.num_heads:
            raise ValueError(f"inputs have {query.shape[1]} heads but sparsity_config.num_heads="
                             f"{self.sparsity_config.num_heads}")

    def _masks(self, query, rpe, key_padding_mask, attn_mask):
        """Everything additive: (B, L) key padding and one bias broadcastable to (B, H, L, L)."""
        B, H, L, _ = query.shape
        kpm = None
        if key_padding_mask is not None:
            kpm = mask_to_additive(key_padding_mask.reshape(key_padding_mask.shape[0], -1), self.key_padding_mask_mode,
                                   "key_padding_mask_mode")
            if kpm.shape[-1] != L:
                raise ValueError(f"key_padding_mask covers {kpm.shape[-1]} keys, inputs have seq_len={L}")
            kpm = kpm.to(query.device)
        bias = None
        if attn_mask is not None:
            bias = mask_to_additive(attn_mask, self.attn_mask_mode, "attn_mask_mode").to(query.device)
        if rpe is not None:
            rpe = rpe.detach().to(device=query.device, dtype=torch.float32)
            bias = rpe if bias is None else bias + rpe
        return kpm, bias

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rpe: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, H, L, D) x3 -> (B, H, L, D). ``rpe``: additive scores broadcastable to (B, H, L, L);
        ``key_padding_mask``: (B, L); ``attn_mask``: (L, L) (or broadcastable to (B, H, L, L))."""
        self._check(query, key, value)
        kpm, bias = self._masks(query, rpe, key_padding_mask, attn_mask)
        L, block = query.shape[2], self.sparsity_config.block
        pad = (-L) % block if self.auto_pad else 0
        if pad:  # padded keys are masked out (causal rows never reach them), padded rows dropped
            query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
            if not self.causal or kpm is not None:
                kpm = torch.zeros(query.shape[0], L, device=query.device) if kpm is None else kpm
                kpm = F.pad(kpm, (0, pad), value=float("-inf"))
            if bias is not None:
                bias = F.pad(bias.expand(*bias.shape[:-2], L, L), (0, pad, 0, pad))
        out = self._attend(query, key, value, kpm, bias)
        return out[:, :, :L] if pad else out

    def _attend(self, query, key, value, kpm, bias) -> torch.Tensor:
        """Engine dispatch with additive masks; L is a multiple of the block here."""
        scale = query.shape[-1] ** -0.5
        self.get_layout(query.shape[2])  # validates the length before any engine runs
        if choose_backend(query, self.sparsity_config.block, self.backend) == "triton":
            from lightning_scale.kernels.block_sparse_attention.launch import triton_block_sparse_attention

            return triton_block_sparse_attention(query, key, value, self._index(query), key_padding_mask=kpm,
                                                 bias=bias, scale=scale)
        return _run_torch(query, key, value, self._plan, kpm, bias, scale)
