"""litgpt's ``GPT`` unchanged under pipeline and tensor parallelism: a pipeline adapter and a built-in tp plan.

**Pipeline.** litgpt's ``GPT.forward`` computes the rotary ``cos`` / ``sin`` once (sliced from buffers of the
root module) and hands them, with ``mask=None`` (= causal), to every ``Block``; cutting ``transformer.h`` into
stages loses them (``Block.forward() missing 'cos' and 'sin'``). :func:`litgpt_pipeline_layers` returns
``[embedding, block 0..L-1, head]`` over the model's own modules, where each block layer gets cos/sin from one
:class:`_RopeCache` per model: computed with the model's own helper ``GPT.rope_cache(device)`` once per
(device, dtype) on the stage that needs them (the root's buffers are not part of any stage), sliced to the
sequence length, cast to the hidden state's dtype (as the unsplit model's buffers are cast with the module),
and indexed by ``config.rope_indices`` per block like ``GPT.forward`` does. Only the hidden state ``(B, T, C)``
travels between stages: litgpt's training forward has no padding mask, and the sliding-window mask is built
inside the attention. The head applies ``ln_f``, ``lm_head`` and ``final_logit_softcapping``; the embedding
applies ``scale_embeddings``.

**Tensor parallel.** litgpt's attention reads ``n_head`` / ``n_query_groups`` from the ``config`` object that
every block shares, so splitting the fused ``attn.qkv`` alone crashes deep in litgpt (``split_with_sizes ...
got [64, 64, 64]``). :func:`litgpt_tp_plan` gives each ``CausalSelfAttention`` its own view of the config
(:class:`_AttentionConfig`) whose head counts are the attention's attributes ``n_head`` / ``n_query_groups``, which
the plan machinery (``tensor_parallel.plan._parent_fixes``) divides by tp when it splits heads. The plan:

* attention: ``attn.qkv`` ``qkv_colwise``, ``attn.proj`` ``rowwise``. litgpt 0.5.13's fused layout is
  ``[q | k | v]`` (``CausalSelfAttention.forward`` splits it by ``(n_head, n_query_groups, n_query_groups) *
  head_size``; not interleaved per group), so for grouped-query attention the three parts differ in size and
  each is split over tp by whole heads (``ShardSpec.parts``): rank r holds q heads ``r*H/tp ...`` and kv groups
  ``r*G/tp ...``, and litgpt's ``repeat_interleave`` pairs every local q head with its own group. With fewer
  groups than ranks (tp a multiple of ``n_query_groups``, e.g. multi-query attention at tp=2) each rank keeps
  the one group its q heads use (``ShardSpec.splits``; its gradient rows summed over the ranks sharing it); tp
  neither dividing nor a multiple of ``n_query_groups`` is refused by name (a user plan with ``attn.qkv``
  ``colwise_gather`` and ``attn.proj`` ``rowwise_split_input`` runs every head on every rank instead).
  Per-head q/k norms (``norm_qk``, default type) ``replicated_with_grad_allreduce`` (they see only this rank's
  heads);
* MLP ``fc`` / ``fc_1`` / ``fc_2`` ``colwise``, ``proj`` ``rowwise``; ``transformer.wte`` ``vocab``; ``lm_head``
  ``colwise_gather`` (litgpt returns full logits and its users compute the loss from them);
* a mixture-of-experts MLP (``LLaMAMoE``, ``n_expert > 0``) ``experts``: every expert's and the shared expert's
  width split, the gate whole, one all-reduce of the block's output (:mod:`lightning_scale.tensor_parallel.experts`);
  experts whose down projection has a bias are refused by name.

Refused with a ``ConfigError`` naming the setting: sequence parallelism, latent attention (``latent_attention``),
q/k norms over all heads (``norm_qk_type='olmo2'``).

The plan is found like any built-in one (``tensor_parallel_plan()`` on the model): litgpt's ``GPT`` class gets
that one method when ``litgpt.model`` is (or gets) imported -- nothing here imports litgpt itself.
"""

from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

from lightning_scale._import_hook import run_after_import
from lightning_scale.config import ConfigError
from lightning_scale.pipeline.layers import register_layer_provider


def is_litgpt_gpt(model: nn.Module) -> bool:
    """True for litgpt's ``GPT`` (and subclasses); False whenever litgpt was never imported."""
    mod = sys.modules.get("litgpt.model")
    return mod is not None and isinstance(model, getattr(mod, "GPT", ()))


# ------------------------------------------------------------------------------------------------ pipeline
class _RopeCache:
    """cos / sin of one litgpt GPT, from its own ``rope_cache`` helper, once per (device, dtype).

    A plain object (not a module): it holds no state a checkpoint or an optimizer should see."""

    def __init__(self, gpt: nn.Module) -> None:
        self.gpt = gpt
        self.cache: Dict[Tuple[torch.device, torch.dtype], Tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, T: int, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if T > self.gpt.max_seq_length:  # as GPT.forward
            raise ValueError(f"Cannot forward sequence of length {T}, max seq length is only "
                             f"{self.gpt.max_seq_length}.")
        key = (like.device, like.dtype)
        if key not in self.cache:
            cos, sin = self.gpt.rope_cache(device=like.device)  # (max_seq_length, rope_n_elem[, 2]) float32
            self.cache[key] = (cos.to(like.dtype), sin.to(like.dtype))
        cos, sin = self.cache[key]
        return cos[:T].unsqueeze(0), sin[:T].unsqueeze(0)  # (1, T, rope_n_elem[, 2])


class LitGPTEmbedding(nn.Module):
    """idx (B, T) -> x (B, T, C): ``transformer.wte`` (times sqrt(n_embd) with ``scale_embeddings``)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte = gpt.transformer.wte
        self.scale = gpt.config.n_embd ** 0.5 if gpt.config.scale_embeddings else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.scale is not None:  # exactly GPT.forward's expression
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        return x


class LitGPTBlock(nn.Module):
    """One litgpt ``Block`` with the cos / sin (and causal ``mask=None``) that ``GPT.forward`` gives it."""

    def __init__(self, block: nn.Module, index: int, rope: _RopeCache, rope_index: Optional[int]) -> None:
        super().__init__()
        self.block, self.index, self.rope_index = block, index, rope_index
        self.rope = rope  # shared plain object, one per model

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        cos, sin = self.rope(x.shape[1], x)
        if self.rope_index is not None:  # per-block local/global rotary (Gemma-3-style configs)
            cos, sin = cos[..., self.rope_index], sin[..., self.rope_index]
        return self.block(x, cos, sin, None)


class LitGPTHead(nn.Module):
    """x (B, T, C) -> logits (B, T, padded_vocab_size): ``ln_f``, ``lm_head``, final logit soft-capping."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.transformer.ln_f, gpt.lm_head
        self.softcap = gpt.config.final_logit_softcapping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        if self.softcap is not None:  # litgpt.model.do_softcapping
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def litgpt_pipeline_layers(gpt: nn.Module) -> nn.Sequential:
    """[embedding, block 0..L-1, head] sharing ``gpt``'s modules; the same math as ``gpt(idx)`` (no kv cache)."""
    if not is_litgpt_gpt(gpt):
        raise ConfigError(f"pipeline: {type(gpt).__name__} is not litgpt's GPT")
    rope, indices = _RopeCache(gpt), gpt.config.rope_indices
    blocks = [LitGPTBlock(b, i, rope, None if indices is None else indices[i]) for i, b in enumerate(gpt.transformer.h)]
    return nn.Sequential(LitGPTEmbedding(gpt), *blocks, LitGPTHead(gpt))


register_layer_provider("litgpt", is_litgpt_gpt, litgpt_pipeline_layers)


# ------------------------------------------------------------------------------------------------ tensor parallel
class _AttentionConfig:
    """One attention's view of the shared litgpt ``Config``: ``n_head`` / ``n_query_groups`` are the attention's
    own attributes of the same names (which the tp plan divides by tp), everything else is the shared
    config's. Read-only: litgpt never writes its config after construction."""

    def __init__(self, base, attn: nn.Module) -> None:
        self.__dict__.update(_base=base, _attn=attn)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_base", "_attn"):  # copy / pickle probes on a half-built object
            raise AttributeError(name)
        if name == "n_head":
            return self._attn.n_head
        if name == "n_query_groups":
            return self._attn.n_query_groups
        return getattr(self._base, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"litgpt attention config view is read-only ({name})")

    def __repr__(self) -> str:
        return f"_AttentionConfig(n_head={self.n_head}, n_query_groups={self.n_query_groups}, base={self._base!r})"


def _local_head_counts(gpt: nn.Module) -> None:
    """Give every attention its own head counts (idempotent), read by litgpt through its config view."""
    for block in gpt.transformer.h:
        attn = block.attn
        if isinstance(attn.__dict__.get("config"), _AttentionConfig):
            continue
        base = attn.config
        # found by tensor_parallel.plan._heads; a refusal names them as litgpt's config does
        attn.n_head, attn.n_query_groups = base.n_head, base.n_query_groups
        attn.config = _AttentionConfig(base, attn)


def _refuse_unsupported(config, sequence_parallel: bool) -> None:
    if sequence_parallel:
        raise ConfigError("tensor.sequence_parallel=True is not supported for litgpt's GPT (its blocks read the "
                          "sequence length from the hidden states); use sequence_parallel=False")
    if config.latent_attention:
        raise ConfigError("tensor parallel: litgpt config latent_attention (multi-head latent attention) has no "
                          "built-in plan; pass tensor.plan={pattern: style}")
    if config.norm_qk and config.norm_qk_type != "default":
        raise ConfigError(f"tensor parallel: litgpt config norm_qk_type={config.norm_qk_type!r} normalizes q/k over "
                          "all heads, which the built-in plan does not split; use norm_qk_type='default' or pass "
                          "tensor.plan={pattern: style}")


def litgpt_tp_plan(gpt: nn.Module, sequence_parallel: bool = False) -> Dict[str, str]:
    """The built-in plan of litgpt's ``GPT`` (module docstring); prepares the per-attention head counts."""
    config = gpt.config
    _refuse_unsupported(config, sequence_parallel)
    _local_head_counts(gpt)
    h = "transformer.h.*."
    # [q | k | v], each part (of unequal sizes under grouped-query attention) split by whole heads
    plan = {h + "attn.qkv": "qkv_colwise", h + "attn.proj": "rowwise"}
    if config.norm_qk:  # per-head norms on this rank's heads: gradients summed over tp in the backward
        plan.update({h + "attn.norm_q": "replicated_with_grad_allreduce",
                     h + "attn.norm_k": "replicated_with_grad_allreduce"})
    mlp = type(gpt.transformer.h[0].mlp).__name__
    if mlp == "GptNeoxMLP":
        plan.update({h + "mlp.fc": "colwise", h + "mlp.proj": "rowwise"})
    elif mlp in ("LLaMAMLP", "GemmaMLP"):
        plan.update({h + "mlp.fc_1": "colwise", h + "mlp.fc_2": "colwise", h + "mlp.proj": "rowwise"})
    elif mlp in ("LLaMAMoE", "RoutedLLaMAMoE"):  # every expert's (and the shared expert's) width split, the gate whole
        plan[h + "mlp"] = "experts"
    else:
        raise ConfigError(f"tensor parallel: litgpt config mlp_class_name={config.mlp_class_name!r} has no built-in "
                          "plan; pass tensor.plan={pattern: style}")
    plan.update({"transformer.wte": "vocab", "lm_head": "colwise_gather"})
    return plan


def _tensor_parallel_plan(self, sequence_parallel: bool = False) -> Dict[str, str]:
    return litgpt_tp_plan(self, sequence_parallel)


_tensor_parallel_plan.__doc__ = "lightning_scale's built-in tensor-parallel plan (lightning_scale.models.litgpt_adapter)."


def _install(module) -> None:
    """litgpt's GPT gets ``tensor_parallel_plan`` (the duck-typed hook the tp plan lookup reads), unless it or a
    subclass already defines one."""
    gpt = getattr(module, "GPT", None)
    if gpt is not None and not hasattr(gpt, "tensor_parallel_plan"):
        gpt.tensor_parallel_plan = _tensor_parallel_plan


# One shot, right after ``litgpt.model`` executes, so importing this module costs no litgpt.
run_after_import("litgpt.model", _install)

__all__ = ["LitGPTBlock", "LitGPTEmbedding", "LitGPTHead", "is_litgpt_gpt", "litgpt_pipeline_layers",
           "litgpt_tp_plan"]
