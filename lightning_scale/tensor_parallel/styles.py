"""Plan styles: what a plan entry ``"pattern": "style"`` does to the modules it matches.

==============================  ======================================================================
style                           effect
==============================  ======================================================================
``colwise``                     ``ColumnParallelLinear``, output stays split (feeds a ``rowwise``). A
                                fused ``[q|k|v]`` projection of an attention (out = 3 x heads x head
                                dim) is detected and split per head.
``qkv_colwise``                 the same, fused sections forced to 3
``packed_colwise``              the same, 2 fused sections (``[gate | up]``)
``colwise_gather``              ``ColumnParallelLinear`` that all-gathers its output (padded if needed)
``rowwise``                     ``RowParallelLinear``: input split, output all-reduced, bias added once
``rowwise_split_input``         the same, but its input arrives whole (after a ``colwise_gather``): each
                                rank takes its slice of the input features first (transformers' style of
                                that name, used after attentions whose q/k norms span all heads)
``packed_rowwise``              the same, input made of 2 fused sections
``vocab``                       ``VocabParallelEmbedding`` (vocabulary split, padded to a multiple of tp)
``vocab_colwise``               output head split over the (padded) vocabulary; logits stay split and
                                go to ``vocab_parallel_cross_entropy``
``sequence_split``              (sequence parallel only) a replicated module whose output is cut to
                                this rank's sequence chunk, e.g. position embeddings
``sequence_gather``             (sequence parallel only) a module (attention, MLP) whose first input is
                                all-gathered along the sequence on entry, so it sees the full sequence;
                                the ``colwise`` layers inside it then skip their own input gather
``experts``                     a mixture-of-experts layer's experts module (transformers' 3-D expert weights):
                                every expert's intermediate width split, gate / up column-wise, down
                                row-wise, one all-reduce of the layer's output
                                (:mod:`~lightning_scale.tensor_parallel.experts`)
``mamba2`` / ``mamba1``         a transformers Mamba-2 mixer (Bamba, Nemotron-H, Falcon-H1, Granite 4 hybrid): its
                                heads split, whole groups per rank or, with fewer groups than ranks, each rank's
                                group's B / C replicated; a Mamba-1 mixer (Jamba): its channels split, x_proj's
                                output all-reduced (:mod:`~lightning_scale.tensor_parallel.mamba`)
``gated_deltanet``              a gated DeltaNet layer (Qwen3-Next, Qwen 3.5) cut by key-head groups, one region
                                (:mod:`~lightning_scale.tensor_parallel.deltanet`)
``short_conv``                  a short gated convolution (LFM2) cut by channels, one region
                                (:mod:`~lightning_scale.tensor_parallel.short_conv`)
``kimi_delta``                  a Kimi delta attention layer (Kimi Linear) cut by heads, one region
                                (:mod:`~lightning_scale.tensor_parallel.kda`)
``grouped_rows``                a grouped linear layer's rows by whole groups, no communication (DeepSeek-V4's
                                ``o_a_proj``; :mod:`~lightning_scale.tensor_parallel.grouped_attention`)
``shared_output``               a whole module whose output feeds this rank's heads only: its gradient summed over tp
``expert_data_parallel``        (``ep=N``; the plan :mod:`~lightning_scale.tensor_parallel.expert_alltoall` builds) a
                                transformers experts module's experts placed whole on the group's ranks, which hold
                                different tokens: routes exchanged by all-to-all; every other parameter's gradient
                                is then a partial sum over the group
``mla_kv_a_proj``               (multi-head latent attention, DeepSeek-V2/V3) the shared key / value down-projection
                                stays whole; the rotary part of its output ``[latent | k_rot]`` (the last
                                ``qk_rope_head_dim`` features) goes to this rank's heads only, so its gradient is
                                all-reduced over tp in the backward (the latent part's comes back whole through
                                the column-parallel ``kv_b_proj``)
``rmsnorm_split``               an RMSNorm between a column- and a row-parallel layer (BitNet's sub-layer norms):
                                its weight cut along the features, the mean square summed over tp
                                (:mod:`~lightning_scale.tensor_parallel.norms`)
``head_params``                 an attention module's own per-head parameters (MiMo-V2-Flash's attention sinks) cut by
                                heads over tp, beside its split projections (transformers' ``local_params`` on the
                                module with its parameter ``colwise``; :mod:`~lightning_scale.tensor_parallel.head_params`)
``replicate``                   nothing (documents that the module stays whole)
``replicated_with_grad_allreduce``  stays whole, but sits on split activations (per-head q/k norms after a
                                ``colwise`` q/k projection see only this rank's heads): its gradient is
                                all-reduced over tp inside the backward (the parameter enters the module
                                through ``copy_to_region``), so it is complete before any accumulation,
                                ZeRO bucket or clipping reads it, and a global norm counts it once
``sequence_parallel``           (transformers: a norm on sequence-sharded activations) stays whole; with
                                ``sequence_parallel=True`` its gradient is a partial sum like every
                                replicated parameter's
==============================  ======================================================================

Hugging Face names are accepted: ``colwise_gather_output`` / ``colwise_rep`` (= ``colwise_gather``),
``rowwise_rep`` (= ``rowwise_split_input``), ``embedding_rowwise`` (= ``vocab``) and the ones above.
transformers' ``colwise`` is a contiguous split of the output features (no per-section detection): the
built-in Hugging Face plans use :func:`hf_style` for that. Anything else is a ConfigError listing these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from lightning_scale.config import ConfigError


@dataclass(frozen=True)
class Style:
    # colwise | rowwise | vocab | experts | expert_parallel | mla_kv_a | norm_split | sequence_split | sequence_gather |
    # replicate | grad_allreduce
    kind: str
    sections: int = 0  # 0: detect (colwise on an attention's fused qkv), else fixed
    gather_output: bool = False
    pad: bool = False  # pad out_features to a multiple of tp (vocabulary heads)
    name: str = ""  # the style as written in the plan
    split_input: bool = False  # rowwise only: the input is whole, take this rank's slice first

    @property
    def shards_linear(self) -> bool:
        return self.kind in ("colwise", "rowwise")


_STYLES = {
    "colwise": Style("colwise"),
    "qkv_colwise": Style("colwise", sections=3),
    "packed_colwise": Style("colwise", sections=2),
    "colwise_gather": Style("colwise", sections=1, gather_output=True, pad=True),
    "rowwise": Style("rowwise", sections=1),
    "rowwise_split_input": Style("rowwise", sections=1, split_input=True),
    "packed_rowwise": Style("rowwise", sections=2),
    "vocab": Style("vocab"),
    "experts": Style("experts"),
    "mamba2": Style("mamba"),
    "mamba1": Style("mamba"),
    "gated_deltanet": Style("mamba"),
    "short_conv": Style("mamba"),
    "kimi_delta": Style("mamba"),
    "expert_parallel": Style("expert_parallel"),
    "expert_data_parallel": Style("expert_data_parallel"),
    "vocab_colwise": Style("colwise", sections=1, pad=True),
    "sequence_split": Style("sequence_split"),
    "sequence_gather": Style("sequence_gather"),
    "mla_kv_a_proj": Style("mla_kv_a"),
    "rmsnorm_split": Style("norm_split"),
    "head_params": Style("head_params"),
    "grouped_rows": Style("grouped_rows"),
    "shared_output": Style("shared_output"),
    "replicate": Style("replicate"),
    "replicated_with_grad_allreduce": Style("grad_allreduce"),
    "sequence_parallel": Style("replicate"),
}
_ALIASES = {
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "rowwise_rep": "rowwise_split_input",
    "embedding_rowwise": "vocab",
    "vocab_parallel": "vocab",
    # transformers' per-head colwise for k / v projections (MiniCPM 5 MoE): each rank keeps whole heads, and where
    # the key / value heads are fewer than the tp ranks, the head its query heads use (replicated): what colwise does
    # here for a k / v projection (plan._kv_splits)
    "unit_colwise": "colwise",
}

STYLE_NAMES = tuple(sorted(_STYLES)) + tuple(sorted(_ALIASES))
# transformers styles with no equivalent here (mixture-of-experts and expert-parallel plans, MLA, hidden-split
# embeddings, local params, per-unit splits); tests/unit/test_tp_plan.py checks every style of the installed
# transformers is either implemented above or named here, so a new release's styles are refused by name
_NOT_IMPLEMENTED = ("moe_tp_experts", "moe_identity_expert", "embedding_colwise", "local_params",
                    "all_reduce", "grouped_gemm", "ep_dispatch_experts", "unit_rowwise")


def _with_name(style: Style, name: str) -> Style:
    return Style(style.kind, style.sections, style.gather_output, style.pad, name, style.split_input)


def hf_style(value: Union[str, Style], pattern: str = "") -> Style:
    """A style of a transformers ``tp_plan`` with transformers' semantics: ``colwise`` splits the output
    features contiguously (e.g. GPT-NeoX's per-head interleaved ``query_key_value``), never per section."""
    style = parse_style(value, pattern)
    if isinstance(value, str) and value == "colwise":
        return Style("colwise", 1, False, False, value)
    return style


def parse_style(value: Union[str, Style], pattern: str = "") -> Style:
    """A plan value (a style name or a :class:`Style`) as a :class:`Style`; ConfigError when unknown."""
    if isinstance(value, Style):
        return value
    if isinstance(value, str):
        key = _ALIASES.get(value, value)
        if key in _STYLES:
            return _with_name(_STYLES[key], value)
    where = f" for {pattern!r}" if pattern else ""
    if value in _NOT_IMPLEMENTED:
        raise ConfigError(f"tensor.plan: transformers' style {value!r}{where} (mixture-of-experts / expert "
                          f"parallel / MLA / local parameters / per-unit splits) is not implemented here; pass a "
                          f"plan without it, e.g. leaving those modules replicated ('replicate'), split a "
                          f"transformers experts module's every expert with 'experts', or place its experts whole "
                          f"on the tp ranks with 'expert_parallel'")
    raise ConfigError(f"tensor.plan: unknown style {value!r}{where}; known styles: {', '.join(STYLE_NAMES)}")
