"""Pipeline layers for an unchanged Hugging Face causal LM, derived from the model's own structure.

A Hugging Face decoder computes a few things once per forward, in the base model, that its decoder layers
then read: position ids, rotary ``position_embeddings`` (per layer type for Gemma3), and the causal /
sliding-window / padding mask for the chosen attention implementation. Cutting ``model.model.layers``
into pipeline stages loses them (``cannot unpack non-iterable NoneType``), and an ``eager`` layer called
without a mask attends to the future without any error. Here every pipeline layer recomputes them from
what travels between stages, with the model's own modules and transformers' own mask functions
(``create_causal_mask`` / ``create_sliding_window_causal_mask`` in ``transformers.masking_utils``), so
they are the ones the unsplit model uses:

* the structure comes from transformers itself: ``config.base_model_pp_plan`` names the embedding
  module(s), the layer list and the final norm of the base model; the CausalLM's ``_pp_plan`` names the
  head (``lm_head`` / ``embed_out``); ``base.rotary_emb`` gives cos/sin;
* the mask type of layer ``i`` is ``config.layer_types[i]`` when the config has it (full, sliding-window or Llama 4's
  chunked attention; another type is refused by name), else sliding-window
  when ``config.sliding_window`` is set (Mistral, Phi3), else full causal; the head applies
  ``config.final_logit_softcapping`` (Gemma2/3) like the CausalLM's forward;
* a padding ``attention_mask`` travels with the micro-batch: the inputs may be ``(B, 2, T)`` =
  ``stack([input_ids, attention_mask], 1)``; the mask then rides as one extra channel of the hidden
  state ``(B, T, C + 1)`` (0/1 values, exact in any float dtype) and the head drops it. By default
  (``attention_mask=None``) each batch decides: ``(B, T)`` ids carry no mask, ``(B, 2, T)`` carry one
  (the layers tell by the width, ``hidden_size + 1``), so one set of layers serves both; the Trainer
  glue builds ``(B, 2, T)`` from a dict batch's ``attention_mask``.

Tied embeddings need nothing: the head's ``lm_head`` *is* the embedding's Parameter, which the pipeline
stage finds and keeps in sync. GPT-2 has no ``base_model_pp_plan``: its learned position embedding
(``wte(ids) + wpe(positions)``) and ``transformer.h`` blocks are taken from its fixed structure
(:func:`_gpt2_layers`). Other families without a ``base_model_pp_plan`` (OPT, Falcon...) or whose
forward does more than this (e.g. ``embedding_multiplier``, ``logit_scale`` outside the families whose scaling the
adapter applies: Granite, Cohere, ``_SCALES``) get a ``ConfigError`` that
names them and says to define ``pipeline_layers()``; a few families whose config lacks the plan although their base
model is the Llama pattern (``_LLAMA_PATTERN``: OLMoE, PhiMoE, HunYuan dense and MoE, Nemotron, StableLM, BitNet,
GraniteMoE, Llama 4's text model; each checked by the test matrix) use that pattern. Nothing here imports
``transformers`` at import time (duck typing on ``config.model_type`` / ``base_model_prefix``); the mask functions
are imported when a layer first runs.
"""

from __future__ import annotations

import inspect
import re
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.pipeline.layers import register_layer_provider

# Config attributes whose math sits in a forward this adapter does not run: refuse rather than be wrong.
_UNSUPPORTED_CONFIG = ("embedding_multiplier", "logit_scale", "logits_scaling", "use_bidirectional_attention",
                       "altup_num_inputs", "hidden_size_per_layer_input", "num_kv_shared_layers",
                       "hc_mult",  # hyper-connection streams: carried for the families of _STREAMS only
                       "alibi")  # Falcon's ALiBi: a per-head bias its base model adds onto the mask
# ... whose neutral value is not 1: Gemma 3n / 4's per-layer input embeddings (made by the base model from the ids, one
# slice per layer) and Gemma 4's key / value states shared from earlier layers (across stages under pp) are off at 0
_NEUTRAL_AT_0 = ("hidden_size_per_layer_input", "num_kv_shared_layers")


def is_hf_causal_lm(model: nn.Module) -> bool:
    return hasattr(model, "base_model_prefix") and hasattr(getattr(model, "config", None), "model_type")


def _hook_hint(model: nn.Module) -> str:
    return (f"define pipeline_layers() on your LightningModule returning [embedding, *{type(model).__name__} "
            "decoder layers, head] as modules whose single tensor output feeds the next (see "
            "lightning_scale.models.hf_pipeline for the pattern)")


def _split_mask(x: torch.Tensor, has_mask: Optional[bool], width: int
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, T, C [+1]) -> hidden (B, T, C), padding mask (B, T) int64 or None. ``has_mask=None``: by the width."""
    if has_mask is None:
        has_mask = x.shape[-1] == width + 1
    if not has_mask:
        return x, None
    return x[..., :-1], x[..., -1].round().to(torch.long)


def _join_mask(h: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    if mask is None:
        return h
    return torch.cat([h, mask.to(h.dtype).unsqueeze(-1)], dim=-1)  # (B, T, C + 1)


_ID_DIGITS = 3  # token ids as base-256 digits: each exact in bfloat16 / float16 (integers to 256 / 2048), ids < 2**24


def _to_digits(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative integers (< 2**24) ``(..., n)`` -> ``(..., 3 n)`` base-256 digits in ``dtype`` (exact in bfloat16)."""
    values = values.to(torch.long)
    return torch.stack([(values >> shift) & 255 for shift in (0, 8, 16)], dim=-1).flatten(-2).to(dtype)


def _from_digits(digits: torch.Tensor) -> torch.Tensor:
    d = digits.round().to(torch.long).unflatten(-1, (-1, _ID_DIGITS))
    return d[..., 0] | d[..., 1] << 8 | d[..., 2] << 16


class _Carry:
    """What travels between the stages of a family whose residual is several streams or whose layers read more than
    the hidden states (DeepSeek-V4: ``hc_mult`` hyper-connection streams ``(B, T, hc, C)`` between layers, hash-routed
    experts that pick by token id; Hunyuan 4: the streams, and each layer's sparse-attention top-k picks, which the next
    layer may reuse): the streams flattened ``(B, T, hc * C)``, then the ids as three base-256 digit channels, then the
    ``picks`` top-k positions of each token as three digits each (exact in any float dtype, so a bfloat16 / float16
    activation carries them unchanged), then the padding mask channel (:func:`_join_mask`). One stream, no ids, no
    picks: the plain ``(B, T, C [+1])``."""

    def __init__(self, width: int, streams: int = 1, ids: bool = False, picks: int = 0) -> None:
        self.width, self.streams, self.ids, self.picks = width, streams, ids, picks

    @property
    def plain(self) -> bool:
        return self.streams == 1 and not self.ids and not self.picks

    @property
    def channels(self) -> int:
        return self.width * self.streams + (_ID_DIGITS if self.ids else 0) + _ID_DIGITS * self.picks

    def split(self, x: torch.Tensor, has_mask: Optional[bool]):
        """(B, T, channels [+1]) -> hidden (B, T, C) or streams (B, T, hc, C), ids (B, T) or None, mask or None, the
        top-k picks (B, T, picks) int32 or None."""
        x, mask = _split_mask(x, has_mask, self.channels)
        picks = None
        if self.picks:
            picks = _from_digits(x[..., -_ID_DIGITS * self.picks:]).to(torch.int32)
            x = x[..., :-_ID_DIGITS * self.picks]
        ids = None
        if self.ids:
            ids = _from_digits(x[..., -_ID_DIGITS:])[..., 0]
            x = x[..., :-_ID_DIGITS]
        if self.streams > 1:
            x = x.unflatten(-1, (self.streams, self.width))
        return x, ids, mask, picks

    def join(self, h: torch.Tensor, ids: Optional[torch.Tensor], mask: Optional[torch.Tensor],
             picks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.streams > 1:
            h = h.flatten(-2)
        if self.ids:
            h = torch.cat([h, _to_digits(ids.unsqueeze(-1), h.dtype)], dim=-1)
        if self.picks:
            if picks is None:  # before the first layer, which runs its own indexer
                picks = torch.zeros(*h.shape[:-1], self.picks, dtype=torch.int32, device=h.device)
            if picks.shape[-1] < self.picks:  # fewer positions than index_topk: a set, padded with its first pick
                picks = torch.cat([picks, picks[..., :1].expand(*picks.shape[:-1], self.picks - picks.shape[-1])], -1)
            h = torch.cat([h, _to_digits(picks, h.dtype)], dim=-1)
        return _join_mask(h, mask)


def _carry(config) -> _Carry:
    """The stages' carry layout of ``config``'s family (:data:`_STREAMS`, :data:`_PICKS`)."""
    model_type = getattr(config, "model_type", None)
    streams, ids = _STREAMS.get(model_type, (None, False))
    picks = int(getattr(config, _PICKS[model_type])) if model_type in _PICKS else 0
    return _Carry(config.hidden_size, int(getattr(config, streams)) if streams else 1, ids, picks)


class HFEmbedding(nn.Module):
    """input_ids (B, T) or stack([ids, attention_mask], 1) (B, 2, T) -> hidden (B, T, C [+1])."""

    def __init__(self, modules: List[nn.Module], has_mask: Optional[bool], multiplier: Optional[float] = None,
                 carry: Optional[_Carry] = None) -> None:
        super().__init__()
        self.embed = nn.ModuleList(modules)  # e.g. [embed_tokens] or [embed_in, emb_dropout]
        self.has_mask = has_mask  # None: per batch, from the inputs' shape
        self.multiplier = multiplier  # Granite: inputs_embeds * embedding_multiplier
        self.carry = carry  # DeepSeek-V4: the embedding copied into every stream, the ids carried (_Carry)

    def split_inputs(self, inputs: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """ids (B, T) and the padding mask (B, T) or None."""
        if inputs.dim() == 3:  # (B, 2, T): ids and padding mask
            if self.has_mask is False:
                raise ValueError("inputs of shape (B, 2, T) carry an attention_mask: build the layers with "
                                 "hf_pipeline_layers(model, attention_mask=True)")
            return inputs[:, 0], inputs[:, 1]
        if self.has_mask:
            raise ValueError("hf_pipeline_layers(..., attention_mask=True) expects inputs stack([ids, mask], 1)")
        return inputs, None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        ids, mask = self.split_inputs(inputs)
        h = ids
        for m in self.embed:
            h = m(h)
        if self.multiplier is not None:
            h = h * self.multiplier
        if self.carry is None:
            return _join_mask(h, mask)
        if self.carry.streams > 1:  # as DeepseekV4Model.forward: every stream starts as the embedding
            h = h.unsqueeze(2).expand(-1, -1, self.carry.streams, -1)
        return self.carry.join(h, ids, mask)


class HFLearnedPositionEmbedding(HFEmbedding):
    """GPT-2's embedding: ``wte(ids) + wpe(arange(T))``, then dropout (as ``GPT2Model.forward``; no cache, so the
    positions start at 0), the padding mask joined like :class:`HFEmbedding`."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module, has_mask: Optional[bool]) -> None:
        super().__init__([], has_mask)
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        ids, mask = self.split_inputs(inputs)
        position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # (1, T)
        h = self.drop(self.wte(ids) + self.wpe(position_ids))
        return _join_mask(h, mask)


class HFDecoderLayer(nn.Module):
    """One decoder layer of the model plus what the base model computes for it once per forward."""

    def __init__(self, layer: nn.Module, index: int, config, rotary: Optional[nn.Module],
                 has_mask: Optional[bool], materialize_mask: bool = False) -> None:
        super().__init__()
        self.layer, self.index, self.has_mask = layer, index, has_mask
        self.materialize_mask = materialize_mask  # the base model asks for the mask tensor even where sdpa skips it
        self.width = config.hidden_size
        self.carry = _carry(config)  # several residual streams, the token ids (DeepSeek-V4)
        self.rotary = rotary  # shared module (non-persistent inv_freq buffers only)
        self.config = config  # plain attribute: not a module
        types = getattr(config, "layer_types", None)
        fixed = dict(_LAYER_MASKS.get(getattr(config, "model_type", None), {}))
        if fixed:
            self.layer_type = fixed.pop("attention_mask")
        elif types:
            self.layer_type = types[index]
        else:
            self.layer_type = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        if self.layer_type not in _MASKS:
            raise ConfigError(f"pipeline: decoder layer {index} is of type {self.layer_type!r} "
                              f"(config.layer_types), whose mask the built-in adapter does not build (it knows "
                              f"{', '.join(_MASKS)}); define pipeline_layers() on your LightningModule")
        self._rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self.extra_masks = fixed  # keyword -> layer type, besides attention_mask
        # Gemma 4's layers record their key / value states for later layers to share (none do: num_kv_shared_layers
        # is 0, or the adapter refuses the model): a fresh record per call
        self._records_kv = "shared_kv_states" in inspect.signature(layer.forward).parameters

    def _mask(self, h: torch.Tensor, padding: Optional[torch.Tensor], position_ids: torch.Tensor,
              layer_type: Optional[str] = None):
        fn = mask_function(layer_type or self.layer_type)
        extra = {"allow_is_causal_skip": False} if self.materialize_mask else {}
        return fn(config=self.config, inputs_embeds=h, attention_mask=padding, cache=None, position_ids=position_ids,
                  **extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C [+1]) -> same
        h, ids, padding, picks = self.carry.split(x, self.has_mask)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T), as the base model
        kwargs = dict(attention_mask=self._mask(h, padding, position_ids), position_ids=position_ids)
        for keyword, layer_type in self.extra_masks.items():
            kwargs[keyword] = self._mask(h, padding, position_ids, layer_type)
        if self.rotary is not None:
            kinds = _ROTARY_KINDS.get(self.config.model_type)
            if kinds:  # DeepSeek-V4: a table per rotary kind, each layer picks its own
                pe = {kind: self.rotary(h, position_ids, kind) for kind in kinds}
            elif self._rotary_by_type and self.layer_type not in getattr(self.rotary, "layer_types",
                                                                        (self.layer_type,)):
                pe = None  # LFM3's convolution layers: no table of their kind (its base model passes None)
            else:
                pe = (self.rotary(h, position_ids, self.layer_type) if self._rotary_by_type
                      else self.rotary(h, position_ids))
            kwargs["position_embeddings"] = pe
        if self._records_kv:
            kwargs["shared_kv_states"] = {}
        if self.carry.ids:
            kwargs["input_ids"] = ids
        if self.carry.picks:  # Hunyuan 4: a "shared" layer reuses the previous layer's top-k picks
            kwargs["prev_topk_indices"] = picks
        out = self.layer(h, **kwargs)
        if self.carry.picks:
            out, new = out[0], out[1]
            return self.carry.join(out, ids, padding, picks if new is None else new)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return self.carry.join(out, ids, padding)


class HFHead(nn.Module):
    """Final norm(s) + LM head (+ Gemma's final logit soft-capping): (B, T, C [+1]) -> logits (B, T, V)."""

    def __init__(self, post: List[nn.Module], head: nn.Module, softcap: Optional[float], has_mask: Optional[bool],
                 width: int, logit_scale: Optional[float] = None, logits_scaling: Optional[float] = None,
                 hidden_scaling: Optional[float] = None) -> None:
        super().__init__()
        self.post, self.head = nn.ModuleList(post), head
        self.softcap, self.has_mask, self.width = softcap, has_mask, width
        self.logit_scale, self.logits_scaling = logit_scale, logits_scaling  # Cohere: *; Granite: /
        self.hidden_scaling = hidden_scaling  # MiniCPM3: the hidden states / logits_scaling before the head
        self.float_logits = False  # Nemotron-H: the logits upcast to float32
        self.carry: Optional[_Carry] = None  # DeepSeek-V4's streams and ids (_Carry)
        self.cast_to_head = False  # the hidden states cast to the head's dtype first (_CAST_TO_HEAD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.carry is not None:
            h = self.carry.split(x, self.has_mask)[0]  # the post modules collapse the streams (hc_head)
        else:
            h, _ = _split_mask(x, self.has_mask, self.width)
        for m in self.post:
            h = m(h)
        if self.hidden_scaling is not None:  # as MiniCPM3ForCausalLM.forward
            h = h / self.hidden_scaling
        weight = getattr(self.head, "weight", None)
        if self.cast_to_head and isinstance(weight, torch.Tensor) and weight.dtype != h.dtype:
            h = h.to(weight.dtype)  # as HYV4ForCausalLM / MambaForCausalLM.forward (Hunyuan 4's head stays float32)
        logits = self.head(h)
        if self.logit_scale is not None:  # as CohereForCausalLM.forward (Falcon-H1's lm_head_multiplier alike)
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:  # as GraniteForCausalLM.forward
            logits = logits / self.logits_scaling
        if self.softcap is not None:  # as GemmaXForCausalLM.forward
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.float_logits:  # as NemotronHForCausalLM.forward
            logits = logits.float()
        return logits


# Families whose config declares no base_model_pp_plan although their base model runs the Llama pattern (embed_tokens,
# the rotary table, every decoder layer, norm; the head lm_head): each is a family of hf_families, so the layer chain
# is checked equal to the model (tests/unit/test_hf_pipeline.py) and pp=2 to one process (tests/dist/test_hf_matrix.py).
_LLAMA_PATTERN = ("olmoe", "phimoe", "hunyuan_v1_dense", "hunyuan_v1_moe", "nemotron", "stablelm", "bitnet",
                  "granitemoe", "llama4_text", "jetmoe")
# the mask function (transformers.masking_utils) of each layer type; another type is refused by name
_MASKS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask",
          "chunked_attention": "create_chunked_causal_mask",
          # Qwen3-Next's gated DeltaNet layers: the 2-D padding mask (None without padding), zeroing padded states
          "linear_attention": "create_recurrent_attention_mask",
          # DeepSeek-V3.2's layers with the sparse-attention indexer: the causal mask, always materialized
          "indexed_attention": "create_causal_mask",
          # LFM2's short gated convolutions: the 2-D padding mask, as its base model builds it
          "conv": "create_recurrent_attention_mask",
          # DeepSeek-V4's compressed (CSA) / heavily compressed (HCA) attention layers: the sliding-window mask its
          # base model builds for every layer (the compressor appends its own block bias for the compressed entries)
          "compressed_sparse_attention": "create_sliding_window_causal_mask",
          "heavily_compressed_attention": "create_sliding_window_causal_mask"}
# Families whose forward adds to that pattern only a scaling by a config value, which the adapter applies (model type
# -> those attributes): Granite's embeddings * embedding_multiplier and logits / logits_scaling, Cohere's logits *
# logit_scale. Another family with such an attribute is refused (its forward may use it otherwise).
_SCALES = {"cohere": ("logit_scale",), "cohere2": ("logit_scale",), "cohere2_moe": ("logit_scale",),
           # Falcon-H1 (muP): embeddings * embedding_multiplier, logits * lm_head_multiplier (base model attributes)
           "falcon_h1": ("embedding_multiplier", "lm_head_multiplier"),
           "minicpm3": ("logits_scaling",),  # applied to the hidden states before the head (_HIDDEN_SCALED)
           "granite": ("embedding_multiplier", "logits_scaling"),
           "granitemoe": ("embedding_multiplier", "logits_scaling"),
           "granitemoehybrid": ("embedding_multiplier", "logits_scaling")}


# families whose config declares no pipeline plan although their base model is the Llama pattern under other names
# (model type -> (embedding modules, layer list, final modules); the head lm_head): the hybrid (Mamba + attention)
# families, whose Mamba layers ('linear_attention') get the recurrent padding mask per stage, and Falcon. Each is
# checked equal to the model (tests/unit/test_hf_pipeline.py) and to one process at pp=2 (tests/dist/test_hf_matrix.py)
_NAMED_STRUCTURE = {"jamba": (("embed_tokens",), "layers", ("final_layernorm",)),
                     "bamba": (("embed_tokens",), "layers", ("final_layernorm",)),
                     "nemotron_h": (("embeddings",), "layers", ("norm_f",)),
                     "granitemoehybrid": (("embed_tokens",), "layers", ("norm",)),
                     # LFM2: convolution and attention layers (layer_types "conv" / "full_attention"), its final norm
                     # named embedding_norm; Falcon-H1: attention and Mamba-2 side by side in every layer
                     "lfm2": (("embed_tokens",), "layers", ("embedding_norm",)),
                     "falcon_h1": (("embed_tokens",), "layers", ("final_layernorm",)),
                     # Falcon (rotary; its ALiBi variant is refused: config.alibi, _UNSUPPORTED_CONFIG)
                     "falcon": (("word_embeddings",), "h", ("ln_f",)),
                     # DBRX: its blocks under transformer.blocks, the final LayerNorm norm_f
                     "dbrx": (("wte",), "blocks", ("norm_f",)),
                     # Mamba (Mamba-1 blocks only, no attention); LFM3 as LFM2 (convolution, full and sliding-window
                     # attention layers)
                     "mamba": (("embeddings",), "layers", ("norm_f",)),
                     "lfm3": (("embed_tokens",), "layers", ("embedding_norm",))}
# families whose declared base_model_pp_plan leaves out a module their forward runs, so their _NAMED_STRUCTURE entry
# is used instead (DeepSeek-V4: hc_head, which collapses the hyper-connection streams before the final norm)
_PLAN_INCOMPLETE = ("deepseek_v4", "hy_v4")
_NAMED_STRUCTURE["deepseek_v4"] = _NAMED_STRUCTURE["hy_v4"] = (("embed_tokens",), "layers", ("hc_head", "norm"))
# families whose residual between layers is several streams (the config attribute that counts them) and whether their
# layers read the token ids (input_ids): DeepSeek-V4's hyper-connections (hc_mult) and hash-routed experts (_Carry)
_STREAMS = {"deepseek_v4": ("hc_mult", True), "hy_v4": ("hc_mult", False)}
# families whose layers hand the next one their sparse-attention top-k picks (the config attribute that counts them):
# Hunyuan 4's "shared" indexer layers reuse the previous layer's (prev_topk_indices), across a stage boundary too
_PICKS = {"hy_v4": "index_topk"}
# families whose base model hands every layer a dict of rotary tables, one per kind (the rotary module's layer_type)
_ROTARY_KINDS = {"deepseek_v4": ("main", "compress")}
# families whose every layer takes fixed masks by keyword, whatever config.layer_types says (Falcon-H1's layers are
# all "hybrid": the attention half takes the causal mask, the Mamba half the recurrent padding mask, as its base model
# passes them): keyword -> the layer type whose mask function builds it
_LAYER_MASKS = {"falcon_h1": {"attention_mask": "full_attention", "mamba_attention_mask": "linear_attention"},
                # Mamba's blocks: the 2-D padding mask its base model passes (its config has no layer_types)
                "mamba": {"attention_mask": "linear_attention"}}
# families whose forward upcasts the logits to float32 (the head does too)
# families whose CausalLM casts the hidden states to the head's dtype (Hunyuan 4 keeps its head in float32)
_CAST_TO_HEAD = ("hy_v4", "mamba")
_FLOAT_LOGITS = ("nemotron_h", "mamba")  # their CausalLM forward upcasts the logits to float32
# families whose base model norms the embeddings with its final norm before the first layer (NanoChat: a norm without
# weights, so the first and the last stage each run it: nothing to tie)
_NORM_BEFORE_LAYERS = ("nanochat",)
# families that divide the hidden states by config.logits_scaling before the head (not the logits after it)
_HIDDEN_SCALED = ("minicpm3",)


def hf_base_model(model: nn.Module) -> Optional[nn.Module]:
    """The decoder stack of a Hugging Face causal LM: ``model.base_model``, except where that names the model itself
    although it holds one at ``model.model`` (Llama 4's ``Llama4ForCausalLM``: its ``base_model_prefix`` is the
    multimodal checkpoint's ``language_model``)."""
    base = getattr(model, "base_model", None)
    if base is model and isinstance(getattr(model, "model", None), nn.Module):
        return model.model
    return base


def mask_function(layer_type: str):
    """transformers' mask function (``transformers.masking_utils``) of a decoder layer type; ConfigError for a type
    this package does not know (its mask would be built wrong, silently)."""
    if layer_type not in _MASKS:
        raise ConfigError(f"attention layer type {layer_type!r} (config.layer_types): no mask function known for it "
                          f"here (known: {', '.join(_MASKS)})")
    import transformers.masking_utils as masks

    return getattr(masks, _MASKS[layer_type])


def _structure(model: nn.Module):
    """(base model, embedding names, layers name, post names, head name) from transformers' own pp plans."""
    config = model.config
    base = hf_base_model(model)
    plan = getattr(config, "base_model_pp_plan", None) or getattr(base, "_pp_plan", None)
    head_plan = getattr(type(model), "_pp_plan", None) or {}  # the class' own: the instance's adds the base's
    if not plan and config.model_type in _LLAMA_PATTERN:
        plan, head_plan = {"embed_tokens": None, "layers": None, "norm": None}, {"lm_head": None}
    family = f"{type(model).__name__} (model_type {config.model_type!r})"
    if (not plan or config.model_type in _PLAN_INCOMPLETE) and config.model_type in _NAMED_STRUCTURE \
            and base is not None:
        pre, layers_name, post = _NAMED_STRUCTURE[config.model_type]
        found = (list(pre), layers_name, list(post), "lm_head")
    elif not plan and config.model_type in _NORM_BEFORE_LAYERS and base is not None:
        norm = getattr(base, "norm", None)
        if norm is None or any(True for _ in norm.parameters()):  # one module in two stages: only without weights
            raise ConfigError(f"pipeline: {family} norms its embeddings with the module that norms the last layer's "
                              f"output, and that module holds weights (they would live in two stages); "
                              f"{_hook_hint(model)}")
        found = (["embed_tokens", "norm"], "layers", ["norm"], "lm_head")
    else:
        if base is None or base is model or not plan or len(head_plan) != 1:
            raise ConfigError(f"pipeline: {family} declares no pipeline structure (config.base_model_pp_plan and a "
                              f"one-module _pp_plan head); {_hook_hint(model)}")
        names = list(plan)
        lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
        if len(lists) != 1:
            raise ConfigError(f"pipeline: {family}: base_model_pp_plan {names} has {len(lists)} layer lists; "
                              f"{_hook_hint(model)}")
        k = names.index(lists[0])
        found = (names[:k], lists[0], names[k + 1:], next(iter(head_plan)))
    applied = _SCALES.get(config.model_type, ()) + tuple(v[0] for k, v in _STREAMS.items() if k == config.model_type)
    # `True in (1, 1.0)` holds in Python: a flag set to True (use_bidirectional_attention, Falcon's alibi) passed as
    # the neutral scale 1 and ran the adapter's causal math, silently; a flag is compared by identity
    bad = [a for a in _UNSUPPORTED_CONFIG if a not in applied and (
        (v := getattr(config, a, None)) is True or (v is not False and v not in (
            (None, 0) if a in _NEUTRAL_AT_0 else (None, 1, 1.0))))]
    if bad:
        raise ConfigError(f"pipeline: {family} uses config.{bad[0]}={getattr(config, bad[0])!r}, math in the "
                          f"model's forward that the built-in adapter does not run; {_hook_hint(model)}")
    if getattr(config, "output_router_logits", False) is True:  # a mixture of experts' load-balancing loss
        raise ConfigError(f"pipeline: {family} has config.output_router_logits=True: its forward adds the router's "
                          "auxiliary (load-balancing) loss to the loss, which the built-in adapter does not compute "
                          "(the pipeline's loss would lack it, silently); set output_router_logits=False, or "
                          f"{_hook_hint(model)}")
    return (base, *found, family)


def hf_pipeline_layers(model: nn.Module, attention_mask: Optional[bool] = None) -> nn.Sequential:
    """[embedding, decoder layer 0..L-1, head] sharing ``model``'s modules; same math as ``model(ids).logits``.

    ``attention_mask=True``: the inputs are ``stack([input_ids, attention_mask], 1)`` of shape (B, 2, T);
    ``False``: ids (B, T) only; ``None`` (default): either, per batch.
    """
    if not is_hf_causal_lm(model):
        raise ConfigError(f"pipeline: {type(model).__name__} is not a Hugging Face model")
    if _is_gpt2(model):
        return _gpt2_layers(model, attention_mask)
    base, pre, layers_name, post, head_name, family = _structure(model)
    config = getattr(base, "config", model.config)
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"):
        raise ConfigError(f"pipeline: {family}: attn_implementation={impl!r} is not supported by the adapter")
    rotary = getattr(base, "rotary_emb", None)
    layers = getattr(base, layers_name)[: getattr(config, "num_hidden_layers", None) or None]
    applied = _SCALES.get(model.config.model_type, ())
    multiplier = base.embedding_multiplier if "embedding_multiplier" in applied else None
    carry = _carry(config)
    if carry.ids and config.vocab_size > 1 << 8 * _ID_DIGITS:
        raise ConfigError(f"pipeline: {family}: vocab_size={config.vocab_size} exceeds the {1 << 8 * _ID_DIGITS} "
                          f"token ids its stages carry to the layers that read them; {_hook_hint(model)}")
    plain = carry.plain
    out: List[nn.Module] = [HFEmbedding([getattr(base, n) for n in pre], attention_mask, multiplier,
                                        None if plain else carry)]
    materialize = _materializes_mask(base)
    out += [HFDecoderLayer(layer, i, config, rotary, attention_mask, materialize) for i, layer in enumerate(layers)]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    out.append(HFHead([getattr(base, n) for n in post], getattr(model, head_name), softcap, attention_mask,
                      config.hidden_size, logit_scale=(model.logit_scale if "logit_scale" in applied else
                                                       base.lm_head_multiplier if "lm_head_multiplier" in applied
                                                       else None),
                      logits_scaling=(model.config.logits_scaling if "logits_scaling" in applied
                                      and model.config.model_type not in _HIDDEN_SCALED else None),
                      hidden_scaling=(model.config.logits_scaling if model.config.model_type in _HIDDEN_SCALED
                                      else None)))
    out[-1].float_logits = model.config.model_type in _FLOAT_LOGITS
    out[-1].carry = None if plain else carry
    out[-1].cast_to_head = model.config.model_type in _CAST_TO_HEAD
    return nn.Sequential(*out)


def _materializes_mask(base: nn.Module) -> bool:
    """Whether the base model's forward builds its causal mask with ``allow_is_causal_skip=False`` (Doge: its layers
    add a dynamic mask onto the materialized one; DeepSeek-V3.2: its indexer reads it). The stages must too: under
    sdpa the mask function otherwise returns None (sdpa's own causal flag), and Doge's layers then attended to later
    positions (pp=2 losses 9.5e-3 off one process, silently)."""
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return False
    return re.search(r"""allow_is_causal_skip["']?\s*[=:]\s*False""", source) is not None


def _is_gpt2(model: nn.Module) -> bool:
    """GPT-2 declares no ``base_model_pp_plan``; its structure (``transformer.wte / wpe / drop / h / ln_f``,
    ``lm_head``) is the one transformers' ``GPT2LMHeadModel`` has had since its first release."""
    base = getattr(model, "transformer", None)
    return (model.config.model_type == "gpt2" and all(hasattr(base, n) for n in ("wte", "wpe", "drop", "h", "ln_f"))
            and isinstance(getattr(model, "lm_head", None), nn.Module))


def _gpt2_layers(model: nn.Module, attention_mask: Optional[bool]) -> nn.Sequential:
    base, config = model.transformer, model.transformer.config
    if getattr(config, "add_cross_attention", False):
        raise ConfigError(f"pipeline: GPT-2 with add_cross_attention=True is not supported; {_hook_hint(model)}")
    out: List[nn.Module] = [HFLearnedPositionEmbedding(base.wte, base.wpe, base.drop, attention_mask)]
    out += [HFDecoderLayer(block, i, config, None, attention_mask) for i, block in enumerate(base.h)]
    out.append(HFHead([base.ln_f], model.lm_head, None, attention_mask, config.hidden_size))
    return nn.Sequential(*out)


register_layer_provider("huggingface", is_hf_causal_lm, hf_pipeline_layers)
