"""Deferred initialization: turn ``meta`` modules into real ones, one module at a time, by the init contract.

The contract (also ZeRO-3's, see docs/zero3.md): a module's parameters are initialized by the nearest ancestor
that defines ``init_module(name, module)`` (``name`` relative to that ancestor; the project's GPT does, and its
values depend only on a seed and the name, so they equal a plain single-process init) or, for Hugging Face
models, ``_init_weights(module)`` (another model's ``_init_weights``, litgpt's: the module's own
``reset_parameters()`` first, as its construction ran it, then ``_init_weights``, as ``model.apply`` runs it); else
by the module's own ``reset_parameters()``. Tensor-parallel layers are
initialized as full-size dense twins under the same name, then sliced. Parameters keep their identity (``torch.utils.swap_tensors``), so optimizers and
partitions built from them stay valid.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Tuple

import torch
from torch import nn

Owners = List[Tuple[str, nn.Module]]
_ACTIVE = [0]  # depth of parameters_on_meta()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their **parameters** on ``meta`` and everything else real (the pattern of accelerate's
    ``init_empty_weights(include_buffers=False)``): each parameter moves to meta as it is registered, so a constructor's
    ``torch.empty`` is never touched and the model's parameters are never held; buffers are computed as in a plain
    build.

    Why not ``with torch.device("meta")``: a buffer computed in a constructor has no other source. Rotary tables
    are recomputed by their ``_init_weights``, but Falcon-H1's ``mup_vector`` (non-persistent: in no checkpoint,
    written by ``FalconH1Model``'s branch of ``_init_weights``, not by its own module's) and Apertus' xIELU ``beta`` /
    ``eps`` (no branch at all) came out of materialization as uninitialized memory: the model's math was wrong,
    silently, under every meta-built layout (ZeRO-3, tp, pp). Parameters created with data in a constructor
    (``nn.Parameter(torch.ones(d))``) are computed, then dropped to meta; their values come from materialization.
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        param = module._parameters.get(name)
        if param is not None and not param.is_meta:
            attrs = dict(param.__dict__)
            try:
                meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            except TypeError:  # a Parameter subclass with other constructor arguments
                meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(attrs)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        _ACTIVE[0] -= 1


def parameters_on_meta_active() -> bool:
    """Inside :func:`parameters_on_meta` (the strategies' ``configure_model`` context)."""
    return _ACTIVE[0] > 0


def init_owners(root: nn.Module) -> Owners:
    """Modules under ``root`` that define ``init_module`` (or Hugging Face's ``_init_weights``), deepest first
    (the nearest ancestor wins)."""
    owners = [(n, m) for n, m in root.named_modules()
              if callable(getattr(m, "init_module", None)) or callable(getattr(m, "_init_weights", None))]
    owners.sort(key=lambda x: -len(x[0]))
    return owners


def _dense_stand_in(module: nn.Module):
    """A tensor-parallel layer (``weight_spec`` + ``load_full_``): an empty full-size dense twin (``nn.Linear`` /
    ``nn.Embedding``) and the call that keeps this rank's slices of it; None for any other module."""
    if getattr(module, "weight_spec", None) is None or not callable(getattr(module, "load_full_", None)):
        return None
    w = module.weight
    dtype = w.dtype
    if hasattr(module, "num_embeddings"):
        with torch.device("meta"):
            dense = nn.Embedding(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx,
                                 dtype=dtype)
        dense.to_empty(device="cpu")
        return dense, lambda: module.load_full_(dense.weight.detach())
    with torch.device("meta"):
        dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype)
    dense.to_empty(device="cpu")

    def load() -> None:
        weight = dense.weight.detach()
        module.load_full_(weight.t() if getattr(module, "transposed", False) else weight,
                          None if dense.bias is None else dense.bias.detach())
    return dense, load


def init_one(name: str, module: nn.Module, owners: Owners) -> None:
    """Initialize the tensors ``module`` (called ``name`` under the root) owns directly, by the contract.

    A tensor-parallel layer is initialized as the dense layer it replaced (a full-size twin initialized under
    the same name, then sliced), so a model split on ``meta`` gets the values of the unsplit model's init."""
    stand_in = _dense_stand_in(module)
    if stand_in is not None:
        dense, load = stand_in
        init_one(name, dense, owners)
        load()
        return
    for oname, owner in owners:
        if oname == "" or name == oname or name.startswith(f"{oname}."):
            if callable(getattr(owner, "init_module", None)):
                rel = name[len(oname) + 1:] if oname and name != oname else ("" if name == oname else name)
                owner.init_module(rel, module)
            else:
                if not _is_transformers(owner):  # litgpt's GPT: its _init_weights covers Linear / Embedding only
                    _reset(module)  # (norms, the rotary cache: their own reset_parameters, as construction ran it)
                owner._init_weights(module)  # Hugging Face PreTrainedModel: by module type; litgpt: model.apply's
            return
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def _is_transformers(owner: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(owner).__mro__)


def _reset(module: nn.Module) -> None:
    """``module.reset_parameters()`` where it has one (the init its construction ran), its buffers kept at the dtype
    and device the model was built with (litgpt's ``GPT.reset_parameters`` recomputes its rotary ``cos`` / ``sin`` in
    float32 as new tensors)."""
    if not callable(getattr(module, "reset_parameters", None)):
        return
    kept = {k: b for k, b in module._buffers.items() if b is not None}
    module.reset_parameters()
    for k, b in kept.items():
        new = module._buffers.get(k)
        if new is not None and new is not b and (new.dtype, new.device) != (b.dtype, b.device):
            module._buffers[k] = new.to(dtype=b.dtype, device=b.device)


def swap_in(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``param`` (the same Python object: optimizers, partitions and hooks keep it) the contents of a new
    Parameter holding ``value``. ``torch.utils.swap_tensors`` also swaps ``__dict__``: attributes set on the
    parameter (e.g. tensor-parallel ``tp_spec`` marks) are put back."""
    attrs = dict(param.__dict__)
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    param.__dict__.update(attrs)


def has_meta(module: nn.Module, recurse: bool = False) -> bool:
    return any(t.is_meta for t in module.parameters(recurse=recurse)) or any(
        t.is_meta for t in module.buffers(recurse=recurse))


@torch.no_grad()
def materialize_(root: nn.Module, device: torch.device, keep: Callable[[str, nn.Module], bool]) -> int:
    """Allocate on ``device`` and initialize every module under ``root`` that still holds meta tensors and for
    which ``keep(name, module)`` is true; returns the number of elements materialized. Others stay on meta.

    A module under a recorded pretrained source (:mod:`lightning_scale.pretrained`) is read from its directory
    instead of initialized: only the tensors it holds here (a tp layer: its slice)."""
    from lightning_scale.pretrained import weight_reader

    owners = init_owners(root)
    reader = weight_reader(root)
    total = 0
    try:
        for name, m in root.named_modules():
            if not keep(name, m):
                continue
            if not has_meta(m):
                buffers_to_(m, device)  # computed at construction (parameters_on_meta): they follow the parameters
                continue
            # its buffers computed at construction (parameters_on_meta), as the model holds them now: a value set after
            # construction (DeepSeek-V4's hash-routing table tid2eid, filled by the caller) is the model's, and the
            # module's init below would write its construction value again (zeros: every token to expert 0)
            built = {k: b.clone() for k, b in m._buffers.items() if b is not None and not b.is_meta}
            total += allocate_(m, device)
            if reader is not None and reader.covers(f"{name}." if name else ""):
                reader.fill_module_(name, m, owners)
                reader.release()  # the file pages mapped for this module are let go
            else:
                init_one(name, m, owners)
                for k, b in built.items():
                    if m._buffers.get(k) is not None:
                        m._buffers[k].copy_(b)
    finally:
        if reader is not None:
            reader.release()
    return total


def buffers_to_(module: nn.Module, device: torch.device) -> None:
    """Move the real buffers ``module`` owns directly to ``device`` (a model built under :func:`parameters_on_meta`
    computed them on the CPU)."""
    for key, buf in list(module._buffers.items()):
        if buf is not None and not buf.is_meta and buf.device != device:
            module._buffers[key] = buf.to(device)


def allocate_(module: nn.Module, device: torch.device) -> int:
    """Give the meta tensors ``module`` owns directly empty storage on ``device`` (parameters keep their identity,
    see :func:`swap_in`) and move its real buffers there; returns the number of elements allocated. Values are
    uninitialized."""
    buffers_to_(module, device)
    total = 0
    for p in module.parameters(recurse=False):
        if p.is_meta:
            swap_in(p, torch.empty_like(p, device=device))
            total += p.numel()
    for key, buf in list(module._buffers.items()):
        if buf is not None and buf.is_meta:
            module._buffers[key] = torch.empty_like(buf, device=device)
            total += buf.numel()
    return total
