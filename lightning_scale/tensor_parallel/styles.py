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
``packed_rowwise``              the same, input made of 2 fused sections
``vocab``                       ``VocabParallelEmbedding`` (vocabulary split, padded to a multiple of tp)
``vocab_colwise``               output head split over the (padded) vocabulary; logits stay split and
                                go to ``vocab_parallel_cross_entropy``
``sequence_split``              (sequence parallel only) a replicated module whose output is cut to
                                this rank's sequence chunk, e.g. position embeddings
``sequence_gather``             (sequence parallel only) a module (attention, MLP) whose first input is
                                all-gathered along the sequence on entry, so it sees the full sequence;
                                the ``colwise`` layers inside it then skip their own input gather
``replicate``                   nothing (documents that the module stays whole)
``replicated_with_grad_allreduce``  stays whole; its gradients are summed over tp by ``sync_tp_grads``
==============================  ======================================================================

Hugging Face names are accepted: ``colwise_gather_output`` / ``colwise_rep`` (= ``colwise_gather``),
``embedding_rowwise`` (= ``vocab``) and the ones above. Anything else is a ConfigError listing these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from lightning_scale.config import ConfigError


@dataclass(frozen=True)
class Style:
    kind: str  # colwise | rowwise | vocab | sequence_split | sequence_gather | replicate | grad_allreduce
    sections: int = 0  # 0: detect (colwise on an attention's fused qkv), else fixed
    gather_output: bool = False
    pad: bool = False  # pad out_features to a multiple of tp (vocabulary heads)
    name: str = ""  # the style as written in the plan

    @property
    def shards_linear(self) -> bool:
        return self.kind in ("colwise", "rowwise")


_STYLES = {
    "colwise": Style("colwise"),
    "qkv_colwise": Style("colwise", sections=3),
    "packed_colwise": Style("colwise", sections=2),
    "colwise_gather": Style("colwise", sections=1, gather_output=True, pad=True),
    "rowwise": Style("rowwise", sections=1),
    "packed_rowwise": Style("rowwise", sections=2),
    "vocab": Style("vocab"),
    "vocab_colwise": Style("colwise", sections=1, pad=True),
    "sequence_split": Style("sequence_split"),
    "sequence_gather": Style("sequence_gather"),
    "replicate": Style("replicate"),
    "replicated_with_grad_allreduce": Style("grad_allreduce"),
}
_ALIASES = {
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "embedding_rowwise": "vocab",
    "vocab_parallel": "vocab",
}

STYLE_NAMES = tuple(sorted(_STYLES)) + tuple(sorted(_ALIASES))


def parse_style(value: Union[str, Style], pattern: str = "") -> Style:
    """A plan value (a style name or a :class:`Style`) as a :class:`Style`; ConfigError when unknown."""
    if isinstance(value, Style):
        return value
    if isinstance(value, str):
        key = _ALIASES.get(value, value)
        if key in _STYLES:
            style = _STYLES[key]
            return Style(style.kind, style.sections, style.gather_output, style.pad, name=value)
    where = f" for {pattern!r}" if pattern else ""
    raise ConfigError(f"tensor.plan: unknown style {value!r}{where}; known styles: {', '.join(STYLE_NAMES)}")
