"""Deferred initialization: turn ``meta`` modules into real ones, one module at a time, by the init contract.

The contract (also ZeRO-3's, see docs/zero3.md): a module's parameters are initialized by the nearest ancestor
that defines ``init_module(name, module)`` (``name`` relative to that ancestor; the project's GPT does, and its
values depend only on a seed and the name, so they equal a plain single-process init), else by the module's own
``reset_parameters()``. Parameters keep their identity (``torch.utils.swap_tensors``), so optimizers and
partitions built from them stay valid.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch
from torch import nn

Owners = List[Tuple[str, nn.Module]]


def init_owners(root: nn.Module) -> Owners:
    """Modules under ``root`` that define ``init_module``, deepest first (the nearest ancestor wins)."""
    owners = [(n, m) for n, m in root.named_modules() if callable(getattr(m, "init_module", None))]
    owners.sort(key=lambda x: -len(x[0]))
    return owners


def init_one(name: str, module: nn.Module, owners: Owners) -> None:
    """Initialize the tensors ``module`` (called ``name`` under the root) owns directly, by the contract."""
    for oname, owner in owners:
        if oname == "" or name == oname or name.startswith(f"{oname}."):
            rel = name[len(oname) + 1:] if oname and name != oname else ("" if name == oname else name)
            owner.init_module(rel, module)
            return
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def has_meta(module: nn.Module, recurse: bool = False) -> bool:
    return any(t.is_meta for t in module.parameters(recurse=recurse)) or any(
        t.is_meta for t in module.buffers(recurse=recurse))


@torch.no_grad()
def materialize_(root: nn.Module, device: torch.device, keep: Callable[[str, nn.Module], bool]) -> int:
    """Allocate on ``device`` and initialize every module under ``root`` that still holds meta tensors and for
    which ``keep(name, module)`` is true; returns the number of elements materialized. Others stay on meta."""
    owners = init_owners(root)
    total = 0
    for name, m in root.named_modules():
        if not has_meta(m) or not keep(name, m):
            continue
        for p in m.parameters(recurse=False):
            if p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device),
                                                         requires_grad=p.requires_grad))
                total += p.numel()
        for key, buf in list(m._buffers.items()):
            if buf is not None and buf.is_meta:
                m._buffers[key] = torch.empty_like(buf, device=device)
                total += buf.numel()
        init_one(name, m, owners)
    return total
