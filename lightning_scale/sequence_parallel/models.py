"""Ulysses on unchanged models: the project GPT and Hugging Face models through transformers' attention interface.

:func:`apply_sequence_parallel` finds what it knows in a module tree and changes instances only (no class, no module
tree and no parameter name changes, as activation checkpointing does):

* **the project GPT** (``lightning_scale.models.gpt.GPT``): every ``attn.core`` runs on the head-split side of the
  all-to-all (the dense SDPA core as it is; a block-sparse ``SparseSelfAttention`` core over this rank's heads of
  its layout, which covers the full sequence per head); ``wpe`` reads the global positions of this rank's slice;
  ``GPT.loss`` is the mean over the whole sequence (chunked above ``loss_chunk`` as before).
* **a Hugging Face PreTrainedModel**: an attention function registered with ``transformers.AttentionInterface``
  wraps the model's own implementation (``eager`` or ``sdpa``) between the all-to-alls; the base model gets the
  global ``position_ids`` of this rank's slice (rotary or learned positions); ``loss_function`` (what
  ``model(input_ids, labels=...)`` uses) shifts the labels across slice boundaries and takes the whole-sequence
  mean; ``use_cache`` is turned off (a training layout). A padding ``attention_mask``, ``position_ids`` restarting
  at packed sequences, and sliding windows (Mistral, Qwen2's layer types) are gathered over sp before the first
  layer and turned into the whole sequence's mask by transformers' own mask functions, which the attention then
  applies on the head-split side.

A model with neither is a ConfigError naming ``sp``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_scale.comm import collectives as C
from lightning_scale.config import ConfigError
from lightning_scale.nn.sparse_attention import SparseSelfAttention
from lightning_scale.nn.sparsity_config import SparsityConfig
from lightning_scale.sequence_parallel.ulysses import (heads_to_sequence, next_token_labels, sequence_mean,
                                                        sequence_to_heads)

HF_PREFIX = "lightning_scale_ulysses"


def wrapped_attention(name: str) -> str:
    """The attention implementation a Ulysses-wrapped one (``{HF_PREFIX}_{inner}_{id}``, :func:`_sp_hf`) wraps;
    ``name`` itself when it is not one."""
    if not name.startswith(HF_PREFIX + "_"):
        return name
    return name[len(HF_PREFIX) + 1:].rsplit("_", 1)[0]


def apply_sequence_parallel(module: nn.Module, group, tp_group=None, stage: Optional[nn.Module] = None) -> nn.Module:
    """Make ``module`` (or the GPT / Hugging Face model inside it) run on this rank's ``1/sp`` of each sequence.

    ``tp_group``: the tensor-parallel group of a model split by tp already (``apply_tp`` runs first): its attention
    holds ``heads / tp`` heads, which the all-to-all splits further over sp (``heads / (tp * sp)`` per rank).
    ``stage``: this rank's pipeline stage (pp > 1): the GPT's stages use its own modules; a Hugging Face model's
    pipeline layers (``lightning_scale.models.hf_pipeline``) get global positions through its rotary / position
    embedding (the base model, which the pipeline never calls, is left alone)."""
    sp = C.group_size(group)
    if sp == 1:
        return module
    from lightning_scale.models.gpt import GPT

    gpts = [m for m in module.modules() if isinstance(m, GPT)]
    hfs = [m for m in module.modules() if _is_hf_causal_model(m)]
    hfs = [m for m in hfs if not any(o is not m and m in set(o.modules()) for o in hfs)]  # outermost only
    if not gpts and not hfs:
        raise ConfigError(f"sp={sp}: {type(module).__name__} holds no attention that sequence parallelism can swap "
                          "(the project GPT's attn.core, or a Hugging Face PreTrainedModel's attention interface)",
                          settings=("sp",))
    tp = C.group_size(tp_group) if tp_group is not None else 1
    for gpt in gpts:
        _sp_gpt(gpt, group, tp, C.group_rank(tp_group) if tp > 1 else 0)
    for hf in hfs:
        _sp_hf(hf, group, tp, stage)
    return module


def _sp_hf_pipeline(model: nn.Module, stage: nn.Module, group, inner_name: str) -> None:
    """The Hugging Face pipeline layers of this rank's stage: positions offset to this rank's slice (the rotary
    embedding the decoder layers share, or GPT-2's ``wpe``), and each decoder layer's mask built over the whole
    sequence (:func:`_whole_sequence_mask`: the padding that rides with the micro-batch gathered over sp; sliding
    windows across the slice boundary) instead of over its slice."""
    from lightning_scale.models.hf_pipeline import HFDecoderLayer, HFLearnedPositionEmbedding

    rank = C.group_rank(group)
    masks = _FullMasks(model, inner_name)  # the config with the wrapped implementation's mask functions
    for m in stage.modules():
        if isinstance(m, HFDecoderLayer):
            m._mask = functools.partial(_whole_sequence_mask, group, masks.config, m.layer_type)
    shift = lambda pos: pos + rank * pos.shape[-1]  # noqa: E731  (the layers ask for arange(L / sp))
    patched = set()
    for m in stage.modules():
        if isinstance(m, HFDecoderLayer) and m.rotary is not None and id(m.rotary) not in patched:
            patched.add(id(m.rotary))  # one rotary module shared by every layer
            rotary = m.rotary.forward
            m.rotary.forward = lambda x, position_ids, *a, _f=rotary, **k: _f(x, shift(position_ids), *a, **k)
        elif isinstance(m, HFLearnedPositionEmbedding) and id(m.wpe) not in patched:
            patched.add(id(m.wpe))
            wpe = m.wpe.forward
            m.wpe.forward = lambda position_ids, _f=wpe: _f(shift(position_ids))


@torch.no_grad()
def _whole_sequence_mask(group, config, layer_type: str, h: torch.Tensor, padding: Optional[torch.Tensor],
                         position_ids: torch.Tensor, extra_type: Optional[str] = None):
    """An :class:`~lightning_scale.models.hf_pipeline.HFDecoderLayer`'s mask under sp: what one process builds for
    the whole sequence of ``sp x`` this slice's length (None for a plain causal one: sdpa's ``is_causal``, or the
    causal mask :func:`_hf_attention` builds for eager). ``extra_type``: the type of a second mask the layer takes
    (Falcon-H1's Mamba mask beside its attention's). Every sp rank of a stage runs the same layers in the same
    order, so the padding gather lines up."""
    from lightning_scale.models.hf_pipeline import mask_function

    layer_type = extra_type or layer_type

    if padding is None and layer_type == "full_attention":
        return None
    batch, length = h.shape[0], h.shape[1] * C.group_size(group)
    full_padding = _gather_sequence(padding, group) if padding is not None else None
    positions = torch.arange(length, device=h.device).unsqueeze(0)
    embeds = torch.empty((batch, length, 1), dtype=h.dtype, device=h.device)  # only its shape and dtype are read
    return mask_function(layer_type)(config=config, inputs_embeds=embeds, attention_mask=full_padding, cache=None,
                                     position_ids=positions)


def _check_heads(sp: int, tp: int, heads: int, name: str) -> int:
    """The query heads of one sp rank: ``heads / (tp * sp)``; a ConfigError naming sp (and tp) otherwise."""
    if tp > 1 and sp * tp > heads:
        raise ConfigError(f"sp={sp} x tp={tp} = {sp * tp} exceeds {name}={heads}: every sp x tp rank attends over "
                          f"at least one head", settings=("sp", "tp"))
    if heads % (sp * tp):
        if tp > 1:
            raise ConfigError(f"sp={sp} does not divide the {heads // tp} heads per tp rank ({name}={heads} / tp={tp}"
                              "; tp splits the heads first, then sp splits each tp rank's heads)",
                              settings=("sp", "tp"))
        raise ConfigError(f"sp={sp} does not divide {name}={heads} (each sp rank attends over {name.split('.')[-1]} "
                          f"/ sp heads)", settings=("sp",))
    return heads // (sp * tp)


def sequence_parallel_loss(loss_fn, group, ignore_index: int = -100):
    """A pipeline's last-stage ``loss_fn(output, target)`` (a mean over this rank's non-ignored targets) -> the mean
    over the whole sequence of each micro-batch: ``loss_fn(..., reduction="sum")`` where it takes ``reduction``
    (``lm_loss``, ``F.cross_entropy``), else its mean times the local count, combined over sp."""
    import inspect

    try:
        takes_reduction = "reduction" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        takes_reduction = False

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        count = (target != ignore_index).sum()
        if takes_reduction:
            total = loss_fn(output, target, reduction="sum")
        else:
            total = loss_fn(output, target) * count
        return sequence_mean(total, count, group)

    loss.sequence_parallel = True
    return loss


@torch.no_grad()
def whole_sequence_targets(labels: torch.Tensor, group, ignore_index: int = -100) -> torch.Tensor:
    """The non-ignored next-token targets of the whole sequences whose (B, L/sp) slice of unshifted ``labels`` this
    rank holds (float64, equal on every sp rank): what one process counts as ``(labels[..., 1:] != -100).sum()``."""
    count = (next_token_labels(labels, group, ignore_index) != ignore_index).sum().to(torch.float64).reshape(1)
    C.all_reduce(count, group, tag="sp/targets")
    return count[0]


def _mark(model: nn.Module, sp: int) -> None:
    if getattr(model, "_lightning_scale_sp", 1) > 1:
        raise ConfigError(f"sp={sp}: {type(model).__name__} is sequence-parallel already (apply it once)",
                          settings=("sp",))
    model._lightning_scale_sp = sp


# --------------------------------------------------------------------------------------------- the project GPT
def _sp_gpt(gpt: nn.Module, group, tp: int = 1, tp_rank: int = 0) -> None:
    from lightning_scale.models.gpt import CausalSelfAttention

    sp, rank = C.group_size(group), C.group_rank(group)
    cfg = gpt.cfg
    _check_heads(sp, tp, cfg.n_head, "model.n_head")
    if cfg.seq_len % sp:
        raise ConfigError(f"sp={sp} does not divide model.seq_len={cfg.seq_len} (each sp rank holds seq_len / sp "
                          "positions)", settings=("sp",))
    _mark(gpt, sp)
    for attn in (m for m in gpt.modules() if isinstance(m, CausalSelfAttention)):
        _wrap_core(attn.core, attn.n_head, group, first_head=tp_rank * attn.n_head)
    if gpt.wpe is not None:
        wpe_forward = gpt.wpe.forward

        def global_positions(pos: torch.Tensor) -> torch.Tensor:  # hidden() asks for arange(L / sp)
            return wpe_forward(pos + rank * pos.shape[-1])

        gpt.wpe.forward = global_positions
    for attn in (m for m in gpt.modules() if isinstance(m, CausalSelfAttention) and m.rotary is not None):
        def rotary_global(pos: torch.Tensor, dtype, _f=attn.rotary.forward):  # rotary: q, k of this rank's slice
            return _f(pos + rank * pos.shape[-1], dtype)

        attn.rotary.forward = rotary_global
    gpt.loss = functools.partial(_gpt_loss, gpt, group, cross_entropy=_tp_cross_entropy(gpt))


def _tp_cross_entropy(gpt: nn.Module):
    """The vocabulary-parallel cross-entropy of a GPT whose head tp split over the vocabulary (None: no tp)."""
    state = getattr(gpt, "_tp_state", None)
    if state is None or state.vocab_size is None or not getattr(gpt, "vocab_parallel_loss", False):
        return None
    from lightning_scale.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    def cross_entropy(logits, targets, reduction="mean"):
        return vocab_parallel_cross_entropy(logits, targets, state.group, vocab_size=state.vocab_size, inplace=True,
                                            reduction=reduction)

    return cross_entropy


def _wrap_core(core: nn.Module, heads: int, group, first_head: int = 0) -> None:
    """``core(q, k, v)`` on (B, H, L/sp, D) -> the same core on (B, H/sp, L, D) between the all-to-alls. ``heads``:
    the attention's (tp-local) head count; ``first_head``: the model's index of the first of them (tp rank x heads)."""
    inner = _local_heads(core, heads, group, first_head).forward

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        q, k, v = heads_to_sequence((q, k, v), group)  # 3x (B, H/sp, L, D)
        return sequence_to_heads(inner(q, k, v, *args, **kwargs), group)  # (B, H, L/sp, D)

    core.forward = forward


def _local_heads(core: nn.Module, heads: int, group, first_head: int = 0) -> nn.Module:
    """The module that runs on this rank's heads: ``core`` itself, or for a block-sparse core one over this rank's
    heads of the same layout (kept off the module tree: it has no parameters). A layout over every head of the
    model (the core under tp) is indexed from ``first_head``; one over the attention's heads from 0."""
    if not isinstance(core, SparseSelfAttention):
        return core
    sp, rank = C.group_size(group), C.group_rank(group)
    local = heads // sp
    offset = first_head if core.sparsity_config.num_heads > heads else 0
    return sparse_core_for_heads(core, offset + rank * local, local)


def sparse_core_for_heads(core: SparseSelfAttention, start: int, num_heads: int) -> SparseSelfAttention:
    """A block-sparse core like ``core`` over heads ``[start, start + num_heads)`` of its layout (no parameters: kept
    off the module tree by the callers). Sequence parallelism's local heads and head-tiled attention's groups."""
    cfg = HeadRange(num_heads=num_heads, block=core.sparsity_config.block, parent=core.sparsity_config, start=start)
    return SparseSelfAttention(cfg, key_padding_mask_mode=core.key_padding_mask_mode,
                               attn_mask_mode=core.attn_mask_mode, max_seq_length=core.max_seq_length,
                               causal=core.causal, auto_pad=core.auto_pad, backend=core.backend,
                               chunk_bytes=core.chunk_bytes, tile=core.tile)


@dataclasses.dataclass(frozen=True)
class HeadRange(SparsityConfig):
    """Heads ``[start, start + num_heads)`` of ``parent``'s layout: a sequence-parallel rank's heads."""

    parent: Optional[SparsityConfig] = None
    start: int = 0

    def make_layout(self, seq_len: int) -> torch.Tensor:
        return self.parent.make_layout(seq_len)[self.start:self.start + self.num_heads]

    @property
    def causal(self) -> bool:
        return self.parent.causal


def _gpt_loss(gpt: nn.Module, group, idx: torch.Tensor, targets: torch.Tensor, *, cross_entropy=None,
              chunk: Optional[int] = None, ignore_index: int = -100) -> torch.Tensor:
    """``GPT.loss`` on this rank's slice: the summed cross-entropy of its positions (chunked as ``GPT.loss``
    chunks), combined over sp into the mean over the whole sequence."""
    from lightning_scale.models.gpt import lm_loss

    cross_entropy = cross_entropy or lm_loss
    chunk = gpt.cfg.loss_chunk if chunk is None else chunk
    h = gpt.hidden(idx)  # (B, L/sp, C)
    loss_sum = lambda z, t: cross_entropy(z, t, reduction="sum")  # noqa: E731
    if chunk and targets.shape[-1] > chunk:
        from torch.utils.checkpoint import checkpoint

        from lightning_scale.nn.chunked_loss import _chunk_loss

        run = functools.partial(_chunk_loss, gpt.lm_head, loss_sum)
        parts = [checkpoint(run, a, b, use_reentrant=False, preserve_rng_state=False) if torch.is_grad_enabled()
                 else run(a, b) for a, b in zip(h.split(chunk, dim=1), targets.split(chunk, dim=1))]
        total = torch.stack(parts).sum()
    else:
        total = loss_sum(gpt.lm_head(h), targets)
    return sequence_mean(total, (targets != ignore_index).sum(), group)


# --------------------------------------------------------------------------------------------- Hugging Face
def _is_hf_causal_model(m: nn.Module) -> bool:
    return hasattr(m, "set_attn_implementation") and hasattr(m, "config") and hasattr(m, "base_model") and \
        getattr(m.config, "num_attention_heads", None) is not None


def _hf_kv_repeat(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each key/value head is repeated so that sp divides them (1: it does already). With sp and
    kv_heads dividing heads, lcm(kv_heads, sp) divides heads: every rank's query heads keep their own k/v heads."""
    return 1 if kv_heads % sp == 0 else sp // math.gcd(kv_heads, sp)


class _LocalHeads:
    """The attention module as the wrapped implementation sees it when key/value heads were repeated, or with its
    attention sinks cut to this rank's heads (``sinks``: GPT-OSS's eager attention reads ``module.sinks``)."""

    def __init__(self, module: nn.Module, groups: int, sinks: Optional[torch.Tensor] = None) -> None:
        self._module, self.num_key_value_groups = module, groups
        if sinks is not None:
            self.sinks = sinks

    def __getattr__(self, name: str):
        return getattr(self._module, name)


# decoder layer types (config.layer_types) that are recurrent, not attention: Ulysses cannot split them
RECURRENT_LAYERS = frozenset({"linear_attention", "mamba", "conv", "hybrid"})  # hybrid: Falcon-H1 (Mamba in each)
# model types whose attention Ulysses cannot run on a sequence chunk -> why (refused by name before training)
SP_REFUSED = {"doge": "its attention adds a mask computed from the value states of every position (dynamic mask "
                      "attention) onto the causal one, which each rank would compute for its chunk of the sequence "
                      "only",
              "deepseek_v4": "its compressed attention layers (config.layer_types compressed_sparse_attention / "
                             "heavily_compressed_attention) pool the keys / values of every block of earlier positions "
                             "(and the sparse ones' indexer scores those blocks) from the hidden states, which each "
                             "rank would pool over its chunk of the sequence only"}


# model types with no attention at all (Mamba: Mamba-1 blocks only): sp runs only their mixers, cut by channels on the
# whole sequence (mamba.py); no attention to wrap, no positions
ATTENTION_FREE = frozenset({"mamba"})


def _sp_attention_free(model: nn.Module, group, stage: Optional[nn.Module]) -> None:
    """Sequence parallelism on a model of :data:`ATTENTION_FREE`: its mixers cut over sp (each on the whole sequence,
    gathered on the way in), the padding mask its base model hands them gathered over sp (under pp: each stage's
    layers build it from the whole sequence), the loss over every rank's positions."""
    from lightning_scale.models.hf_pipeline import hf_base_model
    from lightning_scale.sequence_parallel import mamba as sp_mamba

    sp = C.group_size(group)
    sp_mamba.split_mixers(model if stage is None else stage, group)
    _mark(model, sp)
    model.config.use_cache = False
    if stage is not None:
        _sp_hf_pipeline(model, stage, group, model.config._attn_implementation)
    else:
        hf_base_model(model).register_forward_pre_hook(functools.partial(_whole_padding, group), with_kwargs=True)
    model.loss_function = functools.partial(_hf_causal_lm_loss, group)


@torch.no_grad()
def _whole_padding(group, module, args, kwargs):
    """Forward pre-hook of an attention-free base model under sp: its (B, L/sp) padding mask -> the whole sequence's
    (B, L), as the mixers run on the whole sequence."""
    padding = kwargs.get("attention_mask")
    if padding is not None:
        if not isinstance(padding, torch.Tensor) or padding.dim() != 2:
            raise ConfigError(f"sp={C.group_size(group)}: a prepared attention mask cannot be cut over the sequence; "
                              "pass the (batch, seq) padding attention_mask", settings=("sp",))
        kwargs["attention_mask"] = _gather_sequence(padding, group)
    return args, kwargs


def _sp_hf(model: nn.Module, group, tp: int = 1, stage: Optional[nn.Module] = None) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sp = C.group_size(group)
    cfg = model.config
    if getattr(cfg, "model_type", None) in ATTENTION_FREE:
        return _sp_attention_free(model, group, stage)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    _check_heads(sp, tp, heads, f"{type(model).__name__}.config.num_attention_heads")
    if getattr(cfg, "model_type", None) in SP_REFUSED:
        raise ConfigError(f"sp={sp}: {type(model).__name__}: {SP_REFUSED[cfg.model_type]}; use tp, pp or ZeRO-3 for "
                          f"it", settings=("sp",))
    if getattr(cfg, "alibi", None) is True:  # Falcon's ALiBi variant
        raise ConfigError(f"sp={sp}: {type(model).__name__} with config.alibi=True: its base model adds every head's "
                          f"ALiBi bias onto a mask it builds from this rank's chunk of the sequence; use ZeRO-3 for it",
                          settings=("sp",))
    types = set(getattr(cfg, "layer_types", None) or ())
    if "indexed_attention" in types:  # DeepSeek-V3.2's sparse attention: the indexer picks keys from hidden states
        raise ConfigError(f"sp={sp}: {type(model).__name__} has 'indexed_attention' layers (config.layer_types): "
                          f"their indexer scores every earlier position from the hidden states and keeps the top ones "
                          f"before attention, which sequence parallelism (each rank one chunk of every sequence) "
                          f"would score on its chunk only; use tp, pp or ZeRO-3 for it", settings=("sp",))
    from lightning_scale.sequence_parallel import mamba as sp_mamba

    layer_types = list(getattr(cfg, "layer_types", None) or ())
    left = sp_mamba.recurrent_left(model, layer_types, RECURRENT_LAYERS)
    if left:  # LFM2's short convolutions: a state carried along the whole sequence
        raise ConfigError(f"sp={sp}: {type(model).__name__} has {left!r} layers (config.layer_types): a recurrent "
                          f"layer carries its state along the whole sequence, which sequence parallelism (each rank "
                          f"one chunk of every sequence) would cut (Mamba mixers and gated DeltaNet layers run cut by "
                          f"heads over sp; this layer is neither); use tp, pp or ZeRO-3 for it", settings=("sp",))
    inner_name = cfg._attn_implementation
    if inner_name not in ("eager", "sdpa"):
        raise ConfigError(f"sp={sp} with attn_implementation={inner_name!r}: sequence parallelism wraps 'eager' or "
                          "'sdpa' attention (block-sparse Hugging Face attention under sp is not supported yet; the "
                          "project GPT's block-sparse core is)", settings=("sp",))
    # Mamba mixers: their heads split over sp on the whole sequence (mamba.py); under pp those of this rank's stage
    sp_mamba.split_mixers(model if stage is None else stage, group)
    _mark(model, sp)
    # eager attention is each modeling file's own function (the interface's default), sdpa a registered one
    inner = getattr(sys.modules[type(model).__module__], "eager_attention_forward", None) \
        if inner_name == "eager" else ALL_ATTENTION_FUNCTIONS[inner_name]
    if inner is None:
        raise ConfigError(f"sp={sp}: {type(model).__name__}'s modeling module has no eager_attention_forward to wrap; "
                          "use attn_implementation='sdpa'", settings=("sp",))
    name = f"{HF_PREFIX}_{inner_name}_{id(model)}"  # the interface is global: one entry per model and group
    attention = functools.partial(_hf_attention, inner=inner, eager=inner_name == "eager", group=group)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)  # None for a plain causal mask: the full one is built here
    model.set_attn_implementation(name)
    cfg.use_cache = False
    if stage is not None:
        _sp_hf_pipeline(model, stage, group, inner_name)
    else:
        from lightning_scale.models.hf_pipeline import hf_base_model

        try:
            masks = _FullMasks(model, inner_name)
        except ConfigError as err:  # a layer type with no known mask: named with the setting that needs it
            raise ConfigError(f"sp={sp}: {err}", settings=("sp",)) from None
        hf_base_model(model).register_forward_pre_hook(functools.partial(_global_positions_and_mask, group, masks),
                                                   with_kwargs=True)
    model.loss_function = functools.partial(_hf_causal_lm_loss, group)


def _hf_attention(module, query, key, value, attention_mask, *, inner, eager: bool, group, **kwargs):
    """transformers attention function: (B, H, L/sp, D) q and (B, Hkv, L/sp, D) k, v -> ((B, L/sp, H, D), None).
    The key/value repeat follows the heads this call gets (all of the rank's, or a head-tiled group's)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    repeat = _hf_kv_repeat(query.shape[1], key.shape[1], C.group_size(group))
    seen = module
    if repeat > 1:
        key, value = repeat_kv(key, repeat), repeat_kv(value, repeat)
        seen = _LocalHeads(module, module.num_key_value_groups // repeat)
    # attention sinks (GPT-OSS, MiMo-V2-Flash: one logit per query head, read from the module or passed as s_aux): this
    # rank's heads' after the exchange (their gradients summed over sp by the data-parallel reduction, as every
    # parameter's under sp)
    n, r = C.group_size(group), C.group_rank(group)
    sinks = kwargs.get("s_aux")
    if isinstance(sinks, torch.Tensor) and sinks.dim() >= 1 and sinks.shape[0] == query.shape[1]:
        kwargs = dict(kwargs, s_aux=sinks.chunk(n)[r])
    own = getattr(module, "sinks", None)
    if isinstance(own, torch.Tensor) and own.dim() >= 1 and own.shape[0] == query.shape[1]:
        seen = _LocalHeads(module, getattr(seen, "num_key_value_groups", None), sinks=own.chunk(n)[r])
    query, = heads_to_sequence((query,), group)  # (B, H/sp, L, D)
    key, value = heads_to_sequence((key, value), group)
    mask = attention_mask  # None, or the whole sequence's (B, 1, L, L) mask built before the first layer
    if mask is not None and mask.shape[-1] != query.shape[2]:
        raise ConfigError(f"sp={C.group_size(group)}: {type(module).__name__} got an attention mask over "
                          f"{mask.shape[-1]} keys, not the whole sequence's {query.shape[2]} (a mask built per "
                          "slice); pass the padding attention_mask / position_ids to the model itself",
                          settings=("sp",))
    if mask is None and eager:  # eager attention applies only the mask it is given: the full causal one
        L = query.shape[2]
        mask = torch.full((L, L), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device).triu(1)
        mask = mask.view(1, 1, L, L)
    out, _ = inner(seen, query, key, value, mask, **kwargs)  # (B, L, H/sp, D)
    return sequence_to_heads(out, group, head_dim=2, seq_dim=1), None  # (B, L/sp, H, D)


class _FullMasks:
    """The whole sequence's attention mask(s), built with transformers' own mask functions for the wrapped
    implementation (what one process on the full sequence builds): causal, padding (``attention_mask``), packed
    sequences (``position_ids`` restarting), sliding windows. ``build`` returns what the base model takes as its
    ``attention_mask``: one prepared 4D mask (returned as-is by its mask functions), a ``{layer type: mask}`` dict
    for models whose layers mix types, or None for a plain causal mask (sdpa's ``is_causal``)."""

    def __init__(self, model: nn.Module, inner_name: str) -> None:
        import copy
        import inspect

        from lightning_scale.models.hf_pipeline import hf_base_model

        self.config = copy.deepcopy(model.config)  # its sub-configs too: the setter below reaches them
        self.config._attn_implementation = inner_name
        try:
            source = inspect.getsource(type(hf_base_model(model)).forward)
        except (OSError, TypeError):
            source = ""
        self.by_type = "causal_mask_mapping" in source  # Qwen2, Gemma2/3...: a dict per layer type
        window = getattr(model.config, "sliding_window", None)
        types = set(getattr(model.config, "layer_types", None) or ())
        keys = set(re.findall(r'"(\w+)": create_\w+', source))  # the mask mapping's own keys (Falcon-H1: 'hybrid'
        types = keys if self.by_type and keys else types  # layers read two of them)
        self.types = types if self.by_type and types else \
            {"sliding_attention" if window is not None and "create_sliding_window_causal_mask" in source
             else "full_attention"}
        from lightning_scale.models.hf_pipeline import mask_function

        for t in self.types:  # a layer type with no known mask: refused now, not built as a causal mask
            mask_function(t)
        self.windowed = bool(self.types - {"full_attention"})  # sliding or chunked layers: never a plain causal mask
        # a base model that materializes its causal mask itself (allow_is_causal_skip=False: Falcon) builds it from
        # this rank's slice (L/sp keys): it is given the whole sequence's instead, also where it is plain causal
        from lightning_scale.models.hf_pipeline import _materializes_mask

        self.materialized = _materializes_mask(hf_base_model(model))
        self.embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None

    def build(self, batch: int, length: int, padding: Optional[torch.Tensor], position_ids: torch.Tensor,
              device) -> object:
        from lightning_scale.models.hf_pipeline import mask_function

        weight = getattr(self.embedding, "weight", None)
        dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.get_default_dtype()
        embeds = torch.empty((batch, length, 1), dtype=dtype, device=device)  # only its shape and dtype are read
        kwargs = dict(config=self.config, inputs_embeds=embeds, attention_mask=padding, cache=None,
                      position_ids=position_ids)
        if self.materialized:  # as the base model builds it: a tensor, never None (sdpa's is_causal)
            kwargs["allow_is_causal_skip"] = False
        made = {t: mask_function(t)(**kwargs) for t in sorted(self.types)}  # Llama 4: chunked too
        if self.by_type:
            return made
        return next(iter(made.values()))


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, L/sp) pieces of every sp rank -> (B, L) in rank order (no gradient)."""
    x = x.contiguous()
    every = torch.empty((C.group_size(group),) + tuple(x.shape), dtype=x.dtype, device=x.device)
    C.all_gather(every, x, group, tag="sp/mask")
    return torch.cat(every.unbind(0), dim=1)


@torch.no_grad()
def _global_positions_and_mask(group, masks: _FullMasks, module, args, kwargs):
    """Forward pre-hook of the base model: this rank's slice keeps its global positions (given ``position_ids``, a
    slice of the whole sequence's, or ``rank * L/sp + arange``), and the attention sees the whole sequence's mask
    (padding, packed sequences, sliding windows: gathered over sp and built once per forward)."""
    sp = C.group_size(group)
    x = kwargs.get("input_ids")
    if x is None:
        x = args[0] if args else kwargs.get("inputs_embeds")
    if x is None:
        return None
    batch, length = x.shape[0], x.shape[1]
    padding, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if padding is not None and (isinstance(padding, dict) or padding.dim() != 2):
        what = "a dict" if isinstance(padding, dict) else f"{padding.dim()}-D"
        raise ConfigError(f"sp={sp}: a prepared attention mask ({what}) cannot be cut over the sequence; pass the "
                          "(batch, seq) padding attention_mask and/or position_ids restarting at each packed sequence",
                          settings=("sp",))
    given = positions is not None
    if not given:
        start = C.group_rank(group) * length
        positions = torch.arange(start, start + length, device=x.device).unsqueeze(0)
        kwargs["position_ids"] = positions
    if padding is None and not given and not masks.windowed and not masks.materialized:
        return args, kwargs  # a plain causal mask: the attention builds it (or sdpa's is_causal)
    full_positions = _gather_sequence(positions.expand(batch, -1), group) if given else \
        torch.arange(length * sp, device=x.device).unsqueeze(0).expand(batch, -1)
    full_padding = _gather_sequence(padding, group) if padding is not None else None
    kwargs["attention_mask"] = masks.build(batch, length * sp, full_padding, full_positions, x.device)
    return args, kwargs


def _hf_causal_lm_loss(group, logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                       shift_labels=None, **kwargs):
    """``ForCausalLMLoss`` for this rank's slice: labels shifted across the slice boundary, the mean over the whole
    sequence (or the sum over it / ``num_items_in_batch``). Logits stay in their dtype when wider than fp32."""
    if shift_labels is None:
        shift_labels = next_token_labels(labels, group, ignore_index)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shift_labels = shift_labels.to(logits.device)
    total = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index,
                            reduction="sum")
    if num_items_in_batch is not None:
        count = torch.as_tensor(num_items_in_batch, device=logits.device) / C.group_size(group)
        return sequence_mean(total, count, group)
    return sequence_mean(total, (shift_labels != ignore_index).sum(), group)


__all__ = ["apply_sequence_parallel", "HeadRange", "sequence_parallel_loss", "whole_sequence_targets"]
