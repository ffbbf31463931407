"""ZeRO-3 parameters outside their unit's gather: reading one raises a clear error instead of reading freed memory.

A freed unit's parameters keep their shapes but their flat buffer holds no storage, so ``p.norm()`` in a
callback between steps used to read unallocated memory (segfault). While its unit is freed, each parameter's
class is swapped to a subclass whose ``__torch_function__`` allows metadata only (shape, dtype, device, grad,
requires_grad, hooks...) and raises :class:`ShardedParameterAccessError` naming the parameter for anything that
reads values. Gathering swaps the class back, so forward / backward run on plain ``nn.Parameter`` s: the
hot path pays one ``__class__`` assignment per parameter per gather / free, nothing per op.

Full values between steps: ``with sharded.gathered(module): ...`` (:meth:`ShardedParameters.gathered`), a
collective every rank enters.
"""

from __future__ import annotations

from typing import Dict, Iterable, Type

import torch

# Tensor methods / properties that read no values: allowed on a freed parameter.
_META = frozenset({
    "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "dtype", "device", "layout", "is_leaf",
    "requires_grad", "requires_grad_", "grad", "_grad", "grad_fn", "_grad_fn", "is_meta", "is_cuda", "is_cpu",
    "is_sparse", "is_quantized", "is_floating_point", "is_complex", "is_nested", "is_mkldnn", "element_size",
    "itemsize", "nbytes", "stride", "storage_offset", "is_contiguous", "untyped_storage", "_version", "names",
    "register_hook", "register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks", "_backward_hooks",
    "retain_grad", "retains_grad", "data_ptr", "_is_view", "_base", "is_shared", "is_pinned", "output_nr",
    "__hash__", "__len__", "get_device", "_cdata", "__class__", "__dict__", "__setstate__", "_is_param",
})


class ShardedParameterAccessError(RuntimeError):
    """A ZeRO-3 parameter's values were read outside its unit's gather."""


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: the descriptor knows its name
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _first_freed(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if isinstance(t, _FreedMixin):
                return t
    return None


class _FreedMixin:
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _name(func) in _META or getattr(func, "__name__", "") == "__set__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        p = _first_freed(args, kwargs)
        name = p.__dict__.get("_ls_zero3_name", "?") if p is not None else "?"
        raise ShardedParameterAccessError(
            f"zero.stage=3: parameter {name!r} is sharded and not gathered here (its unit's full buffer is freed "
            f"between forward/backward), so {_name(func) or func}() cannot read it. Read full values inside "
            "`with strategy.sharded.gathered(module):` (lightning_scale.strategies.diagnostics_glue.gathered("
            "strategy, module) at any stage), which every rank must enter (it all-gathers), or use "
            "strategy.full_state_dict()")


_CLASSES: Dict[type, Type] = {}


def _guarded(cls: type) -> type:
    out = _CLASSES.get(cls)
    if out is None:
        out = _CLASSES[cls] = type(f"Sharded{cls.__name__}", (_FreedMixin, cls), {})
    return out


def name_params(named: Dict[int, str], params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        p.__dict__["_ls_zero3_name"] = named.get(id(p), "?")


def freeze(params: Iterable[torch.nn.Parameter]) -> None:
    """The unit was freed: its parameters' values may not be read."""
    for p in params:
        cls = type(p)
        if cls not in _CLASSES.values():
            p.__dict__["_ls_cls"] = cls
            p.__class__ = _guarded(cls)


def thaw(params: Iterable[torch.nn.Parameter]) -> None:
    """The unit is (being) gathered: plain parameters again."""
    for p in params:
        cls = p.__dict__.get("_ls_cls")
        if cls is not None and type(p) is not cls:
            p.__class__ = cls


def is_frozen(p: torch.Tensor) -> bool:
    return isinstance(p, _FreedMixin)
