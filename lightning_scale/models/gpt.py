"""The project's GPT: a GPT-2 style decoder used by the example, the tests and the benchmarks.

Module names are stable, because tensor-parallel plans, pipeline partitioners and sparse-attention
swaps address them: ``wte``, ``wpe`` (learned positions; ``position="rotary"``: none, ``attn.rotary`` instead),
``blocks.{i}.{ln1,attn.qkv,attn.proj,attn.core,ln2,mlp.fc,mlp.proj}``,
``ln_f``, ``lm_head``. ``attn.core`` maps ``q, k, v`` of shape (B, H, T, D) to (B, H, T, D) and is the
one place an attention implementation is swapped (dense SDPA by default; block-sparse from
``lightning_scale.nn``).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_scale.models.gpt_config import GPTConfig, gpt_small, gpt_tiny  # noqa: F401  (torch-free; re-exported)


class DenseCausalAttention(nn.Module):
    """softmax(q k^T / sqrt(D) + causal mask) v with torch's fused SDPA."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (B, H, T, D)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class RotaryPositions(nn.Module):
    """Rotary position angles (RoPE, Su et al. 2021) in the half-split layout of HF Llama's ``rotate_half``, base
    ``theta``. No parameters and no buffers: ``forward(pos, dtype)`` computes ``(cos, sin)``, each (T, D), for the
    positions ``pos`` (float32 math, float64 for float64 models). Sequence parallelism shifts ``pos`` to the global
    positions of this rank's slice, as it does the learned table's."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, float(theta)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        inv = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=work, device=pos.device) / self.head_dim)
        angles = pos.to(work)[:, None] * inv[None, :]  # (T, D / 2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) rotated by the angles of its positions: ``x cos + rotate_half(x) sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.rotary = RotaryPositions(self.head_dim, cfg.rope_theta) if cfg.position == "rotary" else None
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)  # output: [q | k | v], head-major
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.core: nn.Module = DenseCausalAttention()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.heads(x)))

    def heads(self, x: torch.Tensor, first: int = 0, last: Optional[int] = None) -> torch.Tensor:
        """(B, T, C) -> the attention of heads ``[first, last)`` (default: all), (B, T, heads x D), before the output
        projection. A subset computes only its own rows of the fused projection (``tiled_attention`` runs the heads a
        group at a time: lightning_scale.tiled_attention)."""
        B, T, _ = x.shape
        # n_head is read at run time so tensor parallelism can shrink it to the local head count.
        H, D = self.n_head, self.head_dim
        last = H if last is None else last
        if first == 0 and last == H:
            q, k, v = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)  # 3x (B, H, T, D)
            core = self.core
        else:
            n = last - first
            w = self.qkv.weight.view(3, H, D, -1)[:, first:last].reshape(3 * n * D, -1)
            b = self.qkv.bias.view(3, H, D)[:, first:last].reshape(-1) if self.qkv.bias is not None else None
            q, k, v = F.linear(x, w, b).view(B, T, 3, n, D).permute(2, 0, 3, 1, 4)  # 3x (B, n, T, D)
            core = self._head_core(first, last)
        if self.rotary is not None:  # positions 0..T-1 (this rank's global ones under sequence parallelism)
            cos, sin = self.rotary(torch.arange(T, device=x.device), q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = core(q, k, v)  # (B, heads, T, D)
        return y.transpose(1, 2).reshape(B, T, -1)

    def _head_core(self, first: int, last: int) -> nn.Module:
        """The core for heads ``[first, last)``: the core itself when it treats every head alike (dense SDPA, or
        that inside the sequence-parallel all-to-alls), else a block-sparse core over those heads of its layout."""
        from lightning_scale.nn.sparse_attention import SparseSelfAttention

        core = self.core
        if not isinstance(core, SparseSelfAttention):
            return core
        cache = self.__dict__.setdefault("_head_cores", {})  # not submodules: no parameters, not in state_dict
        if (first, last) not in cache:
            from lightning_scale.sequence_parallel.models import sparse_core_for_heads

            cache[(first, last)] = sparse_core_for_heads(core, first, last - first)
        return cache[(first, last)]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg.validate()
        # One seed drawn from the global RNG before any submodule exists. Every parameter's initial value is a
        # function of (seed, module name) only, so a model built on `meta` and materialized one ZeRO-3 unit at a
        # time gets exactly the weights a plain single-process build gets.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # learned positions (GPT-2); "rotary": none here, each attention rotates q and k (RotaryPositions)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init; residual projections scaled by 1/sqrt(2 * n_layer). Deterministic given the seed."""
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialize the parameters ``module`` (called ``name`` inside this GPT) owns directly.

        The ZeRO-3 materializer calls this one module at a time; the values depend only on the seed and the name.
        """
        gen = torch.Generator(device="cpu").manual_seed((self.init_seed + zlib.crc32(name.encode())) % 2**62)

        def normal_(t: torch.Tensor, std: float) -> None:  # drawn in fp32 on the CPU whatever t's dtype/device
            if t.device.type == "cpu" and t.dtype == torch.float32:
                t.normal_(0.0, std, generator=gen)  # in place: no temporary as large as the weight
            else:
                t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

        std = 0.02
        if isinstance(module, nn.Linear):
            if self.cfg.tie_weights and module is self.lm_head:
                return  # the tied head is the embedding, initialized as wte
            scale = 1.0 / math.sqrt(2 * self.cfg.n_layer) if name.endswith(".proj") else 1.0
            normal_(module.weight, std * scale)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            normal_(module.weight, std)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
        elif any(True for _ in module.parameters(recurse=False)) and hasattr(module, "reset_parameters"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(torch.randint(0, 2**62, (), generator=gen)))
                module.reset_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab)."""
        return self.lm_head(self.hidden(idx))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> the final norm's output (B, T, C), the head's input."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len={self.cfg.seq_len}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, *, cross_entropy: Optional[Callable] = None,
             chunk: Optional[int] = None) -> torch.Tensor:
        """Mean next-token cross-entropy. Sequences longer than ``chunk`` (default ``cfg.loss_chunk``; 0: never)
        take the chunked loss: the (B, T, vocab) logits never exist at once (lightning_scale.nn.chunked_loss).
        ``cross_entropy(logits, targets, reduction)``: the loss of (a chunk of) logits, ``lm_loss`` by default
        (tensor parallelism passes the vocabulary-parallel one)."""
        cross_entropy = cross_entropy or lm_loss
        chunk = self.cfg.loss_chunk if chunk is None else chunk
        h = self.hidden(idx)  # (B, T, C)
        if chunk and targets.shape[-1] > chunk:
            from lightning_scale.nn.chunked_loss import chunked_cross_entropy

            return chunked_cross_entropy(h, self.lm_head, targets, chunk_size=chunk,
                                         loss_sum=lambda z, t: cross_entropy(z, t, reduction="sum"))
        return cross_entropy(self.lm_head(h), targets)

    def layer_modules(self) -> List[nn.Module]:
        """The repeated units (transformer blocks): ZeRO-3 units and pipeline partitions start here."""
        return list(self.blocks)

    # ---- what the parallel packages read through their provider interfaces (they import no model)
    vocab_parallel_loss = True  # tensor parallel: ``loss`` may use the vocabulary-split logits directly

    def pipeline_layers(self) -> nn.Sequential:
        """[embedding, block_0, ..., block_{L-1}, head] sharing this GPT's modules (same math as ``self(idx)``)."""
        from lightning_scale.pipeline.layers import gpt_pipeline_layers

        return gpt_pipeline_layers(self)

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict:
        """The built-in tensor-parallel plan (``tensor_parallel.hf.GPT_PLAN``), with sequence-parallel marks."""
        from lightning_scale.tensor_parallel.hf import GPT_PLAN

        plan = dict(GPT_PLAN)
        if sequence_parallel:
            if self.wpe is not None:
                plan["wpe"] = "sequence_split"  # position rows for this rank's sequence chunk only
            plan["blocks.*.attn"] = "sequence_gather"  # the attention reads T from its input
            plan["blocks.*.mlp"] = "sequence_gather"
        return plan

    def check_tensor_parallel_plan(self, kinds: dict, sequence_parallel: bool) -> None:
        """Sequence parallelism needs the embeddings and every attention planned for it (ValueError)."""
        if not sequence_parallel:
            return
        wpe = self.wpe is None or kinds.get("wpe") == "sequence_split"
        ok = kinds.get("wte") == "vocab" and wpe and all(
            kinds.get(f"blocks.{i}.attn") == "sequence_gather" for i in range(len(self.blocks)))
        if not ok:
            raise ValueError("tensor.sequence_parallel=True on the GPT needs 'wte': 'vocab', 'wpe': "
                             "'sequence_split' and 'blocks.*.attn': 'sequence_gather' (the built-in plan has them)")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
            ) -> torch.Tensor:
    """Mean (or ``reduction="sum"``) next-token cross-entropy, computed in at least fp32 (fp64 logits stay fp64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction=reduction)


def make_batch(cfg: GPTConfig, batch_size: int, seed: int, device: Optional[torch.device] = None):
    """A deterministic random (tokens, targets) batch for tests and benchmarks: two tensors of their own (not views
    of one buffer: masking targets with -100 must not write into the inputs)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    data = data.to(device) if device is not None else data
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()
