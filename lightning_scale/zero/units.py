"""ZeRO-3's unit discovery, shared by everything that works per unit (ZeRO-3's sharding, activation checkpointing,
compile, the tiled MLP / attention, the memory estimate): which modules are the repeated blocks."""

from __future__ import annotations

import fnmatch
from typing import List, Optional, Sequence, Tuple

import torch.nn as nn

from lightning_scale.config import ConfigError


def resolve_units(root: nn.Module, spec: Optional[Sequence[str]] = None, setting: str = "zero.unit_modules"
                  ) -> List[Tuple[str, nn.Module]]:
    """The modules that become ZeRO-3 units, outermost matches only, in registration order.

    ``spec`` entries are module class names (``"Block"``) or fnmatch patterns on qualified module
    names (``"model.blocks.*"``). ``None``: the model's ``layer_modules()`` when some submodule defines
    it, else the children of every ``nn.ModuleList`` whose children share one class (or are each of a class the
    Hugging Face model names in ``_no_split_modules``: a hybrid's Mamba and attention layers). ``setting``: the
    option an unknown entry is reported under (activation checkpointing uses the same discovery).
    """
    named = list(root.named_modules())
    if spec:
        picked = []
        for entry in spec:
            hits = [(n, m) for n, m in named if n and (type(m).__name__ == entry or fnmatch.fnmatchcase(n, entry))]
            if not hits:
                classes = sorted({type(m).__name__ for _, m in named})
                names = [n for n, _ in named if n][:30]
                raise ConfigError(
                    f"{setting} entry {entry!r} matches no module class or name; classes: "
                    f"{', '.join(classes)}; names (first 30): {', '.join(names)}", settings=(setting,)
                )
            picked.extend(hits)
    else:
        picked = []
        for n, m in named:
            layers = getattr(m, "layer_modules", None)
            if callable(layers) and not isinstance(m, nn.ModuleList):
                ids = {id(x) for x in layers()}
                picked.extend((cn, cm) for cn, cm in named if id(cm) in ids)
        if not picked:
            # a hybrid's decoder layers (Jamba: Mamba and attention layers in one list) are of several classes, each
            # named in the Hugging Face model's _no_split_modules (the blocks transformers itself never splits)
            no_split = {c for _, x in named for c in (getattr(x, "_no_split_modules", None) or ())}
            for n, m in named:
                if isinstance(m, nn.ModuleList) and len(m) > 1 and (
                        len({type(c) for c in m}) == 1 or all(type(c).__name__ in no_split for c in m)):
                    prefix = f"{n}." if n else ""
                    picked.extend((f"{prefix}{i}", c) for i, c in enumerate(m))
    chosen = {id(m): n for n, m in picked}
    # Outermost only: drop a match nested inside another match.
    result = []
    for n, m in named:
        if id(m) not in chosen:
            continue
        if any(n.startswith(f"{o}.") for o, _ in result):
            continue
        result.append((n, m))
    return result


def split_root(root: nn.Module, root_params: Sequence, units: Sequence[nn.Module]
               ) -> Optional[Tuple[List[str], List[str]]]:
    """ZeRO-3's root unit (``root_params``: what no unit owns -- embeddings, final norm, head) is gathered from its
    first use in the forward to the end of the backward. Where it outweighs two of ``units``: (its large modules,
    the ``zero.unit_modules`` that gather each of them only around its use: the units' classes + those modules'
    names in ``root``). None otherwise, or where they could not: a parameter two modules share (a tied embedding and
    head) stays in the root whatever the units."""
    mine = {id(p): p for p in root_params}
    total = sum(p.numel() for p in mine.values())
    sizes = [sum(p.numel() for p in {id(q): q for q in u.parameters()}.values()) for u in units]
    if not mine or not sizes or total <= 2 * max(sizes):
        return None
    owners: dict = {}
    for name, m in root.named_modules():
        for p in m.parameters(recurse=False):
            if id(p) in mine and name not in owners.setdefault(id(p), []):
                owners[id(p)].append(name)
    share: dict = {}
    for pid, names in owners.items():
        if len(names) == 1 and names[0]:  # a module's own parameter (a shared one stays in the root)
            share[names[0]] = share.get(names[0], 0) + mine[pid].numel()
    large = sorted(n for n, k in share.items() if k >= 0.1 * total)
    if sum(share[n] for n in large) < 0.5 * total:
        return None
    return large, sorted({type(u).__name__ for u in units}) + large


def model_root_split(model: nn.Module, spec: Optional[Sequence[str]] = None) -> Optional[Tuple[List[str], List[str]]]:
    """:func:`split_root` of ``model`` before any engine is built (the autotuner's relief rung ``split_root``): its
    units as ZeRO-3 would find them (``spec``: ``zero.unit_modules``) and the trainable parameters none of them owns
    alone, except those ``model`` holds directly (persistent there)."""
    units = [m for _, m in resolve_units(model, spec)]
    return split_root(model, root_parameters(model, units), units)


def root_parameters(model: nn.Module, units: Sequence[nn.Module], params: Optional[Sequence] = None) -> List:
    """The trainable parameters (of ``params``, default every one of ``model``) that ZeRO-3 puts in its root unit:
    owned by no unit or shared by several, and not held by ``model`` directly (persistent there)."""
    owners: dict = {}
    for u in units:
        for p in {id(p): p for p in u.parameters()}.values():
            owners[id(p)] = owners.get(id(p), 0) + 1
    direct = {id(p) for p in model.parameters(recurse=False)}
    return [p for p in (model.parameters() if params is None else params)
            if p.requires_grad and owners.get(id(p), 0) != 1 and id(p) not in direct]
