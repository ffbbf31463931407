"""The autotuner's memory relief ladder (issue 17 item 4; docs/tune.md "Long sequences"): what a layout that does not
fit its budget may take, cheapest first -- at ZeRO-3 the root unit's embeddings and head as units of their own
(``split_root``), the tiled MLP, head-tiled attention, activation offload -- and what a model supports of it.
:mod:`lightning_scale.tune_plan` climbs the ladder in ``plan()`` and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

if TYPE_CHECKING:
    from lightning_scale.tune_plan import Candidate

RELIEF = ("split_root", "tiled_mlp", "tiled_attention", "offload_activations")
# per model object, dropped with it (an id() key outlives its model: a later model at the same address would read a
# stale entry)
_RELIEF_SUPPORT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ROOT_SPLIT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def root_split_units(model, prefix: str = "") -> Tuple[str, ...]:
    """The ``zero.unit_modules`` that gather ``model``'s large root modules (embeddings, head) only around their use
    (:func:`lightning_scale.zero.units.model_root_split`: where the root outweighs two blocks); () where none.
    ``prefix``: ``model``'s qualified name in the module the engine shards, with its dot (:func:`module_prefix`)."""
    if model not in _ROOT_SPLIT:
        from lightning_scale.zero.units import model_root_split

        split = model_root_split(model)
        _ROOT_SPLIT[model] = (tuple(c for c in split[1] if c not in split[0]), tuple(split[0])) if split else ()
    if not _ROOT_SPLIT[model]:
        return ()
    classes, names = _ROOT_SPLIT[model]
    return classes + tuple(prefix + n for n in names)


def module_prefix(root, model) -> str:
    """``model``'s qualified name in ``root`` with a trailing dot ("" where ``model`` is ``root``): what a name found
    in ``model`` needs in ``zero.unit_modules`` when the engine shards ``root`` (a LightningModule around it)."""
    return next((f"{n}." for n, m in root.named_modules() if m is model and n), "")


def relief_support(model) -> Tuple[bool, bool, int]:
    """(tiled MLP, head-tiled attention, query heads per key/value head) for ``model``'s largest unit: whether
    :mod:`lightning_scale.tiled_mlp` finds an MLP in it and :mod:`lightning_scale.tiled_attention` a head-tiled path
    (the project GPT's attention, or a Hugging Face one with q/k/v/o_proj), and the GQA group a Hugging Face head
    group rounds up to (1: none)."""
    if model not in _RELIEF_SUPPORT:
        from lightning_scale.activation_plan import _units
        from lightning_scale.tiled_attention import _default_attention, _hf_layout, tiled_attention_unit, tiled_attentions
        from lightning_scale.tiled_mlp import _default_mlps

        units = [u for u in _units(model) if any(True for _ in u.parameters())]
        mlp = heads = False
        group = 1
        if units:
            unit = max(units, key=lambda u: sum(p.numel() for p in u.parameters()))
            mlp = bool(_default_mlps(unit))
            with tiled_attention_unit(unit, 1):
                heads = bool(tiled_attentions(unit))
            layouts = [_hf_layout(m) for _, m in _default_attention(unit)]
            group = max([lay[0] // lay[1] for lay in layouts if lay is not None] + [1])
        _RELIEF_SUPPORT[model] = (mlp, heads, group)
    return _RELIEF_SUPPORT[model]


def relief_steps(model, gpt, c: Candidate, relief: Sequence[str] = RELIEF, unit_prefix: str = "") -> List[Dict]:
    """The memory relief ``c`` can take, cheapest first, each as the Candidate fields it sets: at ZeRO-3 without a
    pipeline, the root unit's large modules as units of their own (:func:`root_split_units`), the tiled MLP and
    norms (512 positions per tile, or a quarter of the local sequence if that is shorter), the attention a group of
    heads at a time (sp heads per group -- one per sp rank --, with whole key/value heads under GQA; not with tp), the
    checkpointed units' inputs offloaded
    (with activation checkpointing). Only what the model supports (:func:`relief_support`), ``relief`` names and
    ``c`` does not set already."""
    mlp, heads, group = relief_support(model)
    local = gpt.seq_len // max(1, c.sp)
    out: List[Dict] = []
    if "split_root" in relief and c.stage == 3 and c.pp == 1 and not c.unit_modules and root_split_units(model):
        out.append(dict(unit_modules=root_split_units(model, unit_prefix)))
    if "tiled_mlp" in relief and mlp and local >= 8 and not c.tiled_mlp:
        out.append(dict(tiled_mlp=min(512, max(2, local // 4))))
    if "tiled_attention" in relief and c.tp == 1 and heads and not c.tiled_attention:
        out.append(dict(tiled_attention=c.sp if c.sp == 1 else math.lcm(c.sp, group)))
    if "offload_activations" in relief and c.ac and not c.act_offload:
        out.append(dict(act_offload=True))
    return out


def relief_ladder(model, gpt, c: Candidate, relief: Sequence[str] = RELIEF, unit_prefix: str = "") -> List[Candidate]:
    """``c``, then ``c`` with each of :func:`relief_steps` added in turn (every rung keeps the ones below it)."""
    out = [c]
    for step in relief_steps(model, gpt, c, relief, unit_prefix):
        out.append(dataclasses.replace(out[-1], **step))
    return out
