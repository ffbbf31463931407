"""Tensor parallelism of attention with a grouped low-rank output projection and one shared key / value head
(DeepSeek-V4's), cut by heads.

DeepSeek-V4's attention projects the hidden states to a low-rank query (``q_a_proj`` + ``q_a_norm``, whole), then to
``num_heads`` query heads (``q_b_proj``); one key / value head shared by every query head (``kv_proj`` + ``kv_norm``,
keys and values the same tensor), to which its compressor (``compressor``: pooled blocks of earlier positions, with its
indexer on the sparse layers) appends entries; per-head attention sinks (``sinks``); then the heads' outputs in
``o_groups`` groups of consecutive heads, each projected on its own (``o_a_proj``, a block-diagonal
``GroupedLinear`` whose rows are the groups in order) and mixed to the hidden size (``o_b_proj``). Its declared tp plan
leaves all of it whole on every rank. Cut by heads (tp dividing the heads and the groups):

* ``q_b_proj`` column-parallel (this rank's heads; its input's gradient summed over tp, as every column layer's);
* ``sinks`` by heads (style ``head_params``), ``o_a_proj``'s rows by whole groups with no communication (style
  ``grouped_rows``: its input is this rank's heads' output, already local; ``n_groups`` and the attention's view of
  ``config.o_groups`` become the local count), ``o_b_proj`` row-parallel (its output summed over tp);
* the shared key / value path stays whole on every rank and feeds this rank's heads only, so its gradient is partial:
  ``kv_norm``'s output and the compressor's pooled entries go through ``copy_to_region`` (style ``shared_output``:
  identity forward, gradient summed over tp in the backward), which makes everything before them (``kv_proj``,
  ``kv_norm``, the compressor's weights, their share of the input's gradient) whole and equal on every rank.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel.mappings import copy_to_region
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec


def is_grouped_output_attention(module: nn.Module) -> bool:
    """An attention module with DeepSeek-V4's layout (the modules and counts its forward reads)."""
    out_a = getattr(module, "o_a_proj", None)
    config = getattr(module, "config", None)
    return (isinstance(out_a, nn.Linear) and isinstance(getattr(out_a, "n_groups", None), int)
            and all(type(getattr(module, n, None)) is nn.Linear for n in ("q_b_proj", "kv_proj", "o_b_proj"))
            and isinstance(module.__dict__.get("num_heads"), int)
            and getattr(config, "o_groups", None) == out_a.n_groups)


def unsupported(module: nn.Module, tp: int) -> Optional[str]:
    """Why ``module`` cannot be cut by heads over ``tp`` ranks (None when it can)."""
    kind = type(module).__name__
    if module.num_heads % tp:
        return f"{kind}: tp={tp} does not divide its {module.num_heads} heads"
    if module.o_a_proj.n_groups % tp:
        return f"{kind}: tp={tp} does not divide its {module.o_a_proj.n_groups} output groups (o_groups)"
    if module.o_a_proj.bias is not None:
        return f"{kind}: o_a_proj with a bias (not a layout known here)"
    return None


def attention_entries(model: nn.Module, covered, tp: int) -> Dict[str, str]:
    """Plan entries cutting every such attention of ``model`` by heads (none where ``covered(name)`` says the plan
    names its projections already, or tp cannot cut it)."""
    add: Dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or not is_grouped_output_attention(module) or unsupported(module, tp) is not None:
            continue
        if any(covered(f"{name}.{p}") for p in ("q_b_proj", "o_a_proj", "o_b_proj")):
            continue
        add.update({f"{name}.q_b_proj": "colwise", f"{name}.o_a_proj": "grouped_rows",
                    f"{name}.o_b_proj": "rowwise"})
        if isinstance(getattr(module, "kv_norm", None), nn.Module):
            add[f"{name}.kv_norm"] = "shared_output"
        else:
            add[f"{name}.kv_proj"] = "shared_output"
        if isinstance(getattr(module, "compressor", None), nn.Module):
            add[f"{name}.compressor"] = "shared_output"
        if isinstance(getattr(module, "sinks", None), nn.Parameter):
            add[name] = "head_params"
    return add


def row_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """``o_a_proj``'s rows (the groups in order) cut by whole groups over ``tp``."""
    groups = getattr(module, "n_groups", None)
    if not isinstance(groups, int) or module.weight.dim() != 2 or module.weight.shape[0] % groups:
        raise ValueError(f"style 'grouped_rows' on {name!r}: {type(module).__name__} is not a grouped linear layer "
                         f"(n_groups dividing its weight's rows)")
    if groups % tp:
        raise ValueError(f"style 'grouped_rows' on {name!r}: tp={tp} does not divide its {groups} groups")
    return {"weight": make_spec(0, module.weight.shape[0], tp, what=f"the groups of {name}")}


def split_rows(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group, parent: Optional[nn.Module]
               ) -> List[object]:
    """Keep this rank's groups of ``module`` (in place), its ``n_groups`` and its attention's ``config.o_groups`` the
    local count. No hook: its input is this rank's heads' output already."""
    from lightning_scale.tensor_parallel import head_params
    from lightning_scale.tensor_parallel.hf import LocalHeadsConfig

    tp = torch.distributed.get_world_size(group)
    local = module.n_groups // tp
    hooks = head_params.split_head_params(name, module, specs, group)
    module.n_groups = local
    config = getattr(parent, "config", None)
    if parent is not None and getattr(config, "o_groups", None) == local * tp:
        if isinstance(config, LocalHeadsConfig):
            parent.config = LocalHeadsConfig(config._base, {**config._local, "o_groups": local})
        else:
            parent.config = LocalHeadsConfig(config, {"o_groups": local})
    return hooks


def install_shared_output(module: nn.Module, group, tag: str):
    """The forward hook on ``module`` (kept whole) that sends its output (or its first output) through
    ``copy_to_region``: it feeds this rank's heads only, its gradient is summed over tp. Its handle."""
    def hook(mod, args, output):
        if isinstance(output, tuple):
            return (copy_to_region(output[0], group, tag=tag),) + tuple(output[1:])
        return copy_to_region(output, group, tag=tag)

    return module.register_forward_hook(hook)
