"""Putting block-sparse attention into models: a multi-head module and swap helpers.

* :class:`SparseMultiheadAttention` — projections + :class:`SparseSelfAttention`, a drop-in for a
  standard (B, L, C) -> (B, L, C) self-attention block.
* :func:`swap_gpt_attention` — the project GPT: replaces ``blocks[i].attn.core`` (causal).
* :func:`swap_hf_attention` — a Hugging Face model, through ``transformers``' ``AttentionInterface``.
* :func:`apply_sparse_attention` — either of the two, chosen from the model.

``sparsity_config=None`` leaves the model dense (the Hydra option ``attention=dense``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.nn.sparse_attention import SparseSelfAttention
from lightning_scale.nn.sparsity_config import SparsityConfig

HF_ATTENTION_NAME = "lightning_scale_block_sparse"


class SparseMultiheadAttention(nn.Module):
    """x (B, L, C) -> (B, L, C): fused qkv projection, block-sparse attention, output projection.

    ``causal=None`` follows the config (unidirectional = causal). ``key_padding_mask`` (B, L) uses
    ``key_padding_mask_mode`` (``"add"`` by default, as DeepSpeed).
    """

    def __init__(self, d_model: int, sparsity_config: SparsityConfig, *, bias: bool = True, dropout: float = 0.0,
                 max_seq_length: int = 2048, causal: Optional[bool] = None, key_padding_mask_mode: str = "add",
                 auto_pad: bool = False) -> None:
        super().__init__()
        heads = sparsity_config.num_heads
        if d_model % heads:
            raise ConfigError(f"sparsity_config.num_heads={heads} does not divide d_model={d_model}")
        self.num_heads, self.head_dim = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.attention = SparseSelfAttention(sparsity_config, key_padding_mask_mode=key_padding_mask_mode,
                                             max_seq_length=max_seq_length, causal=causal, auto_pad=auto_pad)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3x (B, H, L, D)
        y = self.attention(q, k, v, key_padding_mask=key_padding_mask)  # (B, H, L, D)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(B, L, C)))


def _gpt_attention_modules(model: nn.Module):
    """Modules with a swappable ``core`` (the project GPT's ``CausalSelfAttention``)."""
    return [m for m in model.modules() if hasattr(m, "core") and hasattr(m, "n_head") and hasattr(m, "qkv")]


def swap_gpt_attention(model: nn.Module, sparsity_config: Optional[SparsityConfig], *,
                       max_seq_length: Optional[int] = None, **attention_kwargs) -> nn.Module:
    """Make every ``blocks[i].attn.core`` of the project GPT a causal :class:`SparseSelfAttention`
    (in place; returns ``model``). ``auto_pad=True``: causal rows never see the padding, so any length
    up to ``max_seq_length`` (default ``model.cfg.seq_len``) works. ``None`` keeps dense attention."""
    if sparsity_config is None:
        return model
    _check_config(sparsity_config)
    attention_modules = _gpt_attention_modules(model)
    if not attention_modules:
        raise ConfigError(f"swap_gpt_attention: {type(model).__name__} has no attention module with a `core`")
    seq_len = max_seq_length or getattr(getattr(model, "cfg", None), "seq_len", 2048)
    block = sparsity_config.block
    max_len = -(-seq_len // block) * block  # the layout must cover the padded length
    for module in attention_modules:
        if module.n_head != sparsity_config.num_heads:
            raise ConfigError(f"sparsity_config.num_heads={sparsity_config.num_heads} but the model's attention "
                              f"has n_head={module.n_head}")
        module.core = SparseSelfAttention(sparsity_config, max_seq_length=max_len, causal=True, auto_pad=True,
                                          **attention_kwargs)
    return model


def apply_sparse_attention(model: nn.Module, sparsity_config: Optional[SparsityConfig], *,
                           max_seq_length: Optional[int] = None, **attention_kwargs) -> nn.Module:
    """Replace the attention of ``model`` with block-sparse attention (in place; returns ``model``).

    * the project GPT: :func:`swap_gpt_attention`;
    * a Hugging Face ``PreTrainedModel``: :func:`swap_hf_attention`.

    ``max_seq_length`` defaults to the model's maximum length. ``sparsity_config=None`` is a no-op.
    """
    if sparsity_config is None:
        return model
    _check_config(sparsity_config)
    if _gpt_attention_modules(model):
        return swap_gpt_attention(model, sparsity_config, max_seq_length=max_seq_length, **attention_kwargs)
    if hasattr(model, "set_attn_implementation") and hasattr(model, "config"):
        return swap_hf_attention(model, sparsity_config, max_seq_length=max_seq_length, **attention_kwargs)
    raise ConfigError(f"apply_sparse_attention: {type(model).__name__} has no attention this helper knows how to swap "
                      "(expected the project GPT's attn.core or a Hugging Face PreTrainedModel)")


def _check_config(sparsity_config) -> None:
    if not isinstance(sparsity_config, SparsityConfig):
        raise ConfigError(f"sparsity_config must be a SparsityConfig or None, got {type(sparsity_config).__name__}")


def swap_hf_attention(model: nn.Module, sparsity_config: SparsityConfig, *, max_seq_length: Optional[int] = None,
                      **attention_kwargs) -> nn.Module:
    """Route a Hugging Face model's self-attention through block-sparse attention: registers an
    attention function with ``transformers.AttentionInterface`` and selects it on the model."""
    _check_config(sparsity_config)
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if heads is not None and heads != sparsity_config.num_heads:
        raise ConfigError(f"sparsity_config.num_heads={sparsity_config.num_heads} but the model has {heads} heads")
    seq_len = max_seq_length or getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048)
    block = sparsity_config.block
    cores = {}

    def core_for(causal: bool) -> SparseSelfAttention:
        if causal not in cores:
            cores[causal] = SparseSelfAttention(sparsity_config, max_seq_length=-(-seq_len // block) * block,
                                                causal=causal, auto_pad=True, **attention_kwargs)
        return cores[causal]

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        return hf_sparse_attention(module, query, key, value, attention_mask, core_for, dropout=dropout,
                                   scaling=scaling, is_causal=is_causal, **kwargs)

    AttentionInterface.register(HF_ATTENTION_NAME, attention)
    AttentionMaskInterface.register(HF_ATTENTION_NAME, sdpa_mask)  # we read key padding off an SDPA-style mask
    model.set_attn_implementation(HF_ATTENTION_NAME)
    model._lightning_scale_sparse_cores = cores  # keep the cores (and their caches) alive with the model
    return model


def hf_sparse_attention(module, query, key, value, attention_mask, core_for, dropout=0.0, scaling=None,
                        is_causal=None, **kwargs):
    """``transformers`` attention function: (B, H, L, D) inputs -> ((B, L, H, D), None).

    Self-attention over the whole sequence goes through the block-sparse core; the key padding is the
    last row of the model's 4-D mask (for causal masks the last query sees every real key). Incremental
    decoding (query shorter than key), dropout and scaled-away ``scaling`` fall back to SDPA.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    head_dim = query.shape[-1]
    same_scale = scaling is None or abs(scaling - head_dim**-0.5) < 1e-12
    if query.shape[2] != key.shape[2] or (dropout and module.training) or not same_scale:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    kpm = None
    if attention_mask is not None:
        last_row = attention_mask[:, 0, -1, :]  # (B, L): bool (True keeps) or additive
        kpm = last_row if last_row.dtype == torch.bool else (last_row > torch.finfo(last_row.dtype).min / 2)
    out = core_for(bool(causal))(query, key, value, key_padding_mask=kpm)  # (B, H, L, D)
    return out.transpose(1, 2).contiguous(), None
