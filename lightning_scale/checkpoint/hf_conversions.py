"""transformers' checkpoint conversions, for region reads: model tensors the files keep under other names and shapes.

transformers 5 loads some checkpoints through weight conversions (``transformers.conversion_mapping``). Mixtral's
files keep each expert's ``block_sparse_moe.experts.{e}.w1 / w3 / w2.weight`` while the model holds
``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` (the experts' ``w1`` stacked, then their ``w3`` stacked, concatenated
along dim 1) and ``mlp.experts.down_proj`` (the ``w2`` stacked); Qwen2-MoE, DeepSeek, OLMoE and the other
Qwen2-MoE-style families fuse ``gate_proj`` / ``up_proj`` / ``down_proj`` the same way. The mapping is taken from
transformers itself (``get_model_conversion_mapping(model)``), so a family it converts is read as it would load it.

:func:`conversions_for` keeps the parts a region read can follow: renamings with literal patterns
(``.block_sparse_moe.`` -> ``.mlp.``) and converters made of ``MergeModulelist(dim=0)`` optionally followed by
``Concatenate(dim=d)``, or of a ``Concatenate(dim=d)`` of several file tensors alone (Kimi Linear's ``q_conv1d`` /
``k_conv1d`` / ``v_conv1d`` into its ``conv1d``); patterns written as escaped literals (``\\.experts.*.w1.weight``) are
followed as the literals they are. :class:`FusedTensor` is such a model tensor seen through its sources: a region of
it (a tp slice of every expert, a ZeRO-3 flat shard's rows) reads only the matching rows of the matching tensors.
Other conversions (permutations, splits, dequantization) are not followed: those keys stay unresolved and the
usual ``no tensor for ...`` error names them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

_REGEX = re.compile(r"[\^$()\[\]+?{}|\\]")  # a pattern holding one of these is a regex, not a literal


def _literal(pattern: str) -> Optional[Tuple[str, bool]]:
    """A renaming pattern as (literal, anchored at the key's start), or None for a real regular expression. transformers
    writes most renamings as escaped literals (``^embed_out\\.`` for GPT-NeoX's head, ``block_sparse_moe\\.router\\.
    layer\\.weight`` for GraniteMoE's router); those were skipped as regexes, and a pretrained GPT-NeoX / GraniteMoE
    read under ZeRO-3 / tp / pp failed with "no tensor for ['lm_head.weight']"."""
    anchored = pattern.startswith("^")
    body = (pattern[1:] if anchored else pattern).replace("\\.", ".")
    return None if _REGEX.search(body) else (body, anchored)


@dataclass(frozen=True)
class Conversions:
    renames: Tuple[Tuple[str, str, bool], ...] = ()  # (file literal, model literal, anchored at the key's start)
    # (model key suffix, file key suffixes with '*' = the expert index, concatenation dim of the stacked tensors,
    # stacked over experts: False for a plain concatenation of single file tensors)
    fused: Tuple[Tuple[str, Tuple[str, ...], Optional[int], bool], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.renames or self.fused)


def conversions_for(model: Any) -> Optional[Conversions]:
    """The conversions transformers applies when it loads ``model``'s checkpoints that a region read can follow;
    None for a model that is not a transformers model (or a transformers without conversion mappings)."""
    if not hasattr(getattr(model, "config", None), "model_type"):
        return None
    try:
        from transformers import conversion_mapping as cm
    except ImportError:
        return None
    try:
        mapping = cm.get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 -- a model transformers has no mapping for: names are read as they are
        return None
    renames, fused = [], []
    for t in mapping:
        src, dst = list(getattr(t, "source_patterns", ()) or ()), list(getattr(t, "target_patterns", ()) or ())
        ops = list(getattr(t, "operations", None) or [])
        if not ops and len(src) == 1 and len(dst) == 1 and "*" not in src[0] + dst[0]:
            file_lit, model_lit = _literal(src[0]), _literal(dst[0])
            if file_lit is not None and model_lit is not None:
                renames.append((file_lit[0], model_lit[0], file_lit[1]))
            continue
        literal = [_literal(p) for p in src + dst]  # escaped literals (Kimi Linear's "\\.experts.*.w1.weight")
        if any(lit is None or lit[1] for lit in literal):
            continue
        src, dst = [lit[0] for lit in literal[:len(src)]], [lit[0] for lit in literal[len(src):]]
        if (len(dst) == 1 and len(src) > 1 and len(ops) == 1 and isinstance(ops[0], cm.Concatenate)
                and not any("*" in p for p in src + dst)):  # single file tensors concatenated
            fused.append((dst[0], tuple(src), int(ops[0].dim), False))
            continue
        if (len(dst) != 1 or not ops or not isinstance(ops[0], cm.MergeModulelist) or ops[0].dim != 0
                or not all("*" in s for s in src)):
            continue
        if len(ops) == 1 and len(src) == 1:
            fused.append((dst[0], tuple(src), None, True))
        elif len(ops) == 2 and isinstance(ops[1], cm.Concatenate):
            fused.append((dst[0], tuple(src), int(ops[1].dim), True))
    return Conversions(tuple(renames), tuple(fused)) or None


def renamed(key: str, conversions: Optional[Conversions]) -> List[str]:
    """File names ``key`` may have under the renamings (the key itself first). transformers applies its renamings to a
    file key one after another, each to the previous one's result (``apply_renamings``), so a model key is undone in
    the reverse order: DeepSeek-V4's ``attn.wq_b`` becomes ``self_attn.wq_b`` (``.attn.`` -> ``.self_attn.``), then
    ``self_attn.q_b_proj`` (``.self_attn.wq_b.`` -> ``.self_attn.q_b_proj.``); undone in the forward order,
    ``self_attn.q_b_proj`` never reached ``attn.wq_b`` and its pretrained read failed with "no tensor for". A renaming
    replaces its first match only, so each occurrence of the model's literal is undone alone too (Hunyuan 4's
    ``.hc_pre.hc_`` -> ``.hc_`` made ``hc_pre.hc_attn_layer.hc_fn`` ``hc_attn_layer.hc_fn``: undoing every ``.hc_``
    of the latter gave ``hc_pre.hc_attn_layer.hc_pre.hc_fn``)."""
    out = [key]
    for file_lit, model_lit, anchored in reversed(conversions.renames if conversions else ()):
        if anchored:
            out += [file_lit + k[len(model_lit):] for k in out if k.startswith(model_lit)]
            continue
        found = []
        for k in out:
            starts = [m.start() for m in re.finditer(re.escape(model_lit), k)]
            found += [k[:i] + file_lit + k[i + len(model_lit):] for i in starts]
            if len(starts) > 1:
                found.append(k.replace(model_lit, file_lit))
        out += [k for k in dict.fromkeys(found) if k not in out]
    return out


@dataclass
class FusedTensor:
    """A model tensor made of the file tensors ``parts[p][e]`` (source pattern p, expert e): stacked over the experts
    (dim 0), the parts concatenated along ``cat_dim`` (None: one part). ``stacked=False``: one file tensor per part,
    concatenated along ``cat_dim`` of their own dims (no expert dim)."""

    parts: List[List[str]]
    part_shapes: List[Tuple[int, ...]]  # one file tensor's shape per part
    cat_dim: Optional[int]
    stacked: bool = True

    @property
    def shape(self) -> Tuple[int, ...]:
        if not self.stacked:
            first = self.part_shapes[0]
            return tuple(sum(s[self.cat_dim] for s in self.part_shapes) if d == self.cat_dim else n
                         for d, n in enumerate(first))
        first = (len(self.parts[0]),) + self.part_shapes[0]
        if self.cat_dim is None:
            return first
        return tuple(sum(s[self.cat_dim - 1] for s in self.part_shapes) if d == self.cat_dim else n
                     for d, n in enumerate(first))

    def sources(self) -> List[str]:
        return [n for part in self.parts for n in part]

    def read_chunk(self, offsets: Sequence[int], sizes: Sequence[int], read: Callable, dtype) -> torch.Tensor:
        """The region ``offsets`` / ``sizes`` of the fused tensor; ``read(name, offsets, sizes)`` reads a region of
        one file tensor."""
        out = torch.empty(tuple(sizes), dtype=dtype)
        cat = self.cat_dim
        if not self.stacked:  # one tensor per part along cat: each part's overlap with the region
            start = 0
            for names, shape in zip(self.parts, self.part_shapes):
                lo, hi = max(offsets[cat], start), min(offsets[cat] + sizes[cat], start + shape[cat])
                if lo < hi:
                    off, size = list(offsets), list(sizes)
                    off[cat], size[cat] = lo - start, hi - lo
                    dst = [slice(None)] * len(sizes)
                    dst[cat] = slice(lo - offsets[cat], hi - offsets[cat])
                    out[tuple(dst)] = read(names[0], off, size).to(dtype)
                start += shape[cat]
            return out
        for e in range(offsets[0], offsets[0] + sizes[0]):
            start = 0  # where the current part begins along the concatenation dim
            for p, names in enumerate(self.parts):
                length = self.part_shapes[p][cat - 1] if cat is not None else None
                off, size = list(offsets[1:]), list(sizes[1:])
                dst = [e - offsets[0]] + [slice(None)] * (len(sizes) - 1)
                if cat is not None:
                    lo, hi = max(offsets[cat], start), min(offsets[cat] + sizes[cat], start + length)
                    start += length
                    if lo >= hi:
                        continue
                    off[cat - 1], size[cat - 1] = lo - (start - length), hi - lo
                    dst[cat] = slice(lo - offsets[cat], hi - offsets[cat])
                out[tuple(dst)] = read(names[e], off, size).to(dtype)
        return out


def fuse(key: str, conversions: Optional[Conversions], find: Callable[[str], Optional[str]],
         shape_of: Callable[[str], Tuple[int, ...]]) -> Optional[FusedTensor]:
    """``key`` as a fused tensor of the files (``find``: a file name for a candidate name, or None), or None."""
    for suffix, patterns, cat, stacked in (conversions.fused if conversions else ()):
        if not key.endswith(suffix):
            continue
        base = key[: len(key) - len(suffix)]
        if not stacked:  # single file tensors concatenated along cat
            names = [find(base + pattern) for pattern in patterns]
            if any(n is None for n in names):
                continue
            shapes = [shape_of(n) for n in names]
            if any(len(s) != len(shapes[0]) or s[:cat] + s[cat + 1:] != shapes[0][:cat] + shapes[0][cat + 1:]
                   for s in shapes):
                continue
            return FusedTensor([[n] for n in names], shapes, cat, stacked=False)
        parts = []
        for pattern in patterns:
            names, e = [], 0
            while (name := find(base + pattern.replace("*", str(e)))) is not None:
                names.append(name)
                e += 1
            parts.append(names)
        if not parts[0] or any(len(p) != len(parts[0]) for p in parts):
            continue
        shapes = [shape_of(p[0]) for p in parts]
        if any(shape_of(n) != shapes[i] for i, p in enumerate(parts) for n in p):
            continue  # experts of different shapes: not a stack
        if cat is not None and any(len(s) != len(shapes[0]) or s[:cat - 1] + s[cat:] != shapes[0][:cat - 1]
                                   + shapes[0][cat:] for s in shapes):
            continue
        return FusedTensor(parts, shapes, cat)
    return None
