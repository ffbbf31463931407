"""Style ``head_params``: an attention module's own per-head parameters cut by heads, beside its split projections.

MiMo-V2-Flash's attention holds ``sinks`` (one logit per query head, added to every row's softmax as an extra
column: GPT-OSS-style attention sinks) as a parameter of the attention module itself. Its declared tp plan marks the
module ``local_params`` and the parameter ``colwise``: transformers' way of saying that each rank keeps the slice of
it that belongs to its heads. Here the attention module gets style ``head_params``: every direct parameter whose first
dimension is the attention's head count is cut contiguously over tp (the heads a rank's split ``q_proj`` computes),
and its gradient stays local (only this rank's heads read it). Nothing else changes: the attention's forward reads
the parameter by name, as the local heads' values.
"""

from __future__ import annotations

import types
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from lightning_scale.tensor_parallel.experts import keep_local
from lightning_scale.tensor_parallel.mappings import tp_rank
from lightning_scale.tensor_parallel.sharding import ShardSpec, make_spec


def heads(module: nn.Module) -> Optional[int]:
    """The query-head count of an attention module (its ``num_heads`` or its config's ``num_attention_heads``)."""
    for value in (getattr(module, "num_heads", None),
                  getattr(getattr(module, "config", None), "num_attention_heads", None)):
        if isinstance(value, int) and value > 0:
            return value
    return None


def head_parameters(module: nn.Module) -> List[str]:
    """The module's own parameters with one row per query head."""
    h = heads(module)
    return [n for n, p in module.named_parameters(recurse=False) if h and p.dim() >= 1 and p.shape[0] == h]


def unsupported(module: nn.Module) -> Optional[str]:
    """Why ``head_params`` cannot take ``module`` (None when it can; a module with no per-head parameter, such as
    MiMo-V2-Flash's full-attention layers, which have no sinks, keeps nothing to cut)."""
    if heads(module) is None:
        return f"{type(module).__name__} names no head count (num_heads / config.num_attention_heads)"
    return None


def head_specs(name: str, module: nn.Module, tp: int) -> Dict[str, ShardSpec]:
    """Each per-head parameter's spec (dim 0, the heads, contiguous over ``tp``); empty where there is none."""
    why = unsupported(module)
    if why is not None:
        raise ValueError(f"style 'head_params' on {name!r}: {why}")
    return {p: make_spec(0, heads(module), tp, what=f"the heads of {name}.{p}") for p in head_parameters(module)}


@torch.no_grad()
def split_head_params(name: str, module: nn.Module, specs: Dict[str, ShardSpec], group) -> List[object]:
    """Keep this rank's heads of every per-head parameter (in place; meta stays meta). No hook."""
    from lightning_scale.tensor_parallel import experts as split_style

    rank = tp_rank(group)
    for leaf, spec in specs.items():
        keep_local(module, leaf, spec, rank)
    module._tp_expert_specs = dict(specs)  # re-marked after .to_empty() (experts._apply)
    module._apply = types.MethodType(split_style._apply, module)
    return []
