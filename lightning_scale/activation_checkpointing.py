"""Activation checkpointing per unit: ``checkpoint_units(module, "full" | "selective", units)``. Torch only.

Each unit (every repeated block by default: the modules ZeRO-3 makes its units, found by the same
:func:`~lightning_scale.zero.param_shard.resolve_units`) runs its forward under
:func:`torch.utils.checkpoint.checkpoint` (non-reentrant), so the backward recomputes what the forward did not keep:

* ``"full"``: a unit keeps only its inputs; its whole forward runs again in the backward (about one extra forward
  of the blocks, activations ~ one block's instead of every block's).
* ``"selective"``: torch's per-op selective checkpointing (``create_selective_checkpoint_contexts``, the policy
  torchtitan's per-op SAC uses): the outputs of matrix multiplies and attention kernels (:data:`SAVED_OPS`: the
  expensive ones to recompute) are kept; the cheap elementwise ops, norms, softmax and activations are recomputed.
  Ops inside a custom ``autograd.Function`` (grad mode off: tensor parallelism's fused linear + in-place all-reduce,
  the block-sparse kernel) are always recomputed, since such a Function may overwrite their outputs in place.

The module tree is unchanged: the unit's ``forward`` is replaced on the instance, so parameter names, state-dict
keys, tensor-parallel plans, pipeline cuts and the hooks ZeRO-3 registers on the unit all see the same module.
That is what makes ZeRO-3 gather a checkpointed unit once per backward: the unit's hooks run around its (now
checkpointed) forward; the backward's output hook gathers it; the recompute calls the original forward directly
(no hooks, the parameters are the gathered ones) and the gradients reach the accumulation hooks once.

Tensor parallelism: a recomputed unit repeats its tp collectives (every tp rank recomputes in the same order).
In ``parallelize()`` this is the step after the tp split and the pipeline cut, before ZeRO-3 sharding.
"""

from __future__ import annotations

import functools
import types
from typing import Any, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_scale.config import ACTIVATION_CHECKPOINTING, ConfigError

_aten = torch.ops.aten
# "selective" keeps the outputs of these ops (matmuls, attention kernels); everything else is recomputed.
SAVED_OPS = frozenset(getattr(_aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
) if hasattr(_aten, name))


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # Grad mode is off inside a custom autograd.Function's forward (tensor parallelism's fused linear + all-reduce,
    # the vocab-parallel loss): such a Function may reuse an op's output buffer in place (the all-reduce is), so a
    # kept output would be stale; those ops are recomputed.
    if op in SAVED_OPS and torch.is_grad_enabled():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The unit's forward under torch.utils.checkpoint (bound to the unit: a deep copy rebinds to the copy)."""
    inner = self.__dict__.get("_ac_inner_forward") or functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():  # evaluation: nothing is saved anyway
        return inner(*args, **kwargs)
    extra = {"context_fn": _selective_contexts} if self._activation_checkpointing == "selective" else {}
    offloader = self.__dict__.get("_ac_offloader")
    moved = [i for i, a in enumerate(args) if offloader is not None and offloader.movable(a)]
    if not moved:
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)
    # offload_activations: the region gets stubs; its inputs wait on the host (lightning_scale.activation_offload)
    slot, stubs = offloader.stash([args[i] for i in moved])
    first = [[args[i] for i in moved]]  # the forward itself uses the device inputs; dropped right after

    def run(*region_args: Any) -> Any:
        values = first.pop() if first else offloader.fetch(slot)
        region_args = list(region_args)
        for i, v in zip(moved, offloader.attach(slot, [region_args[i] for i in moved], values)):
            region_args[i] = v
        return inner(*region_args, **kwargs)

    outer = list(args)
    for i, stub in zip(moved, stubs):
        outer[i] = stub
    del args
    return checkpoint(run, *outer, use_reentrant=False, **extra)


def kv_cache_off(module: nn.Module) -> None:
    """``config.use_cache = False`` on every Hugging Face model inside ``module`` (recomputed or tiled attention
    cannot fill a KV cache; training does not read one)."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "use_cache", False) is True and hasattr(m, "base_model_prefix"):
            cfg.use_cache = False


def checkpoint_units(module: nn.Module, mode: Optional[str], units: Optional[Sequence[str]] = None,
                     setting: str = "activation_checkpointing_units", offload: Any = False) -> List[str]:
    """Checkpoint every unit of ``module`` (``mode``: "full" | "selective"; None does nothing); returns their names.

    ``units``: module class names or fnmatch patterns on qualified names (as ``zero.unit_modules``); None: every
    repeated block (the model's ``layer_modules()``, else the children of a ``ModuleList`` of one class). An entry
    that matches nothing, or a model with no repeated block, is a ``ConfigError`` naming ``setting``. ``offload``:
    True (or an :class:`~lightning_scale.activation_offload.ActivationOffloader`): the units' inputs wait on the host
    between forward and backward (``offload_activations``).
    """
    if mode is None:
        return []
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"activation_checkpointing={mode!r}: must be 'full', 'selective' or None (off)")
    from lightning_scale.zero.units import resolve_units

    found = resolve_units(module, list(units) if units else None, setting=setting)
    if not found:
        raise ConfigError(f"activation_checkpointing={mode!r}: the model has no repeated block to checkpoint (no "
                          f"layer_modules(), no ModuleList of one class); name the units in {setting}",
                          settings=(setting,))
    kv_cache_off(module)  # a Hugging Face model: its KV cache grows again in the recompute (transformers turns it
    # off for its own gradient checkpointing too)
    offloader = None
    if offload:
        from lightning_scale.activation_offload import ActivationOffloader

        offloader = offload if isinstance(offload, ActivationOffloader) else ActivationOffloader()
    for _, unit in found:
        if getattr(unit, "_activation_checkpointing", None) is not None:
            raise ConfigError(f"activation_checkpointing={mode!r}: {type(unit).__name__} is checkpointed already")
        unit._activation_checkpointing = mode
        unit._ac_inner_forward = unit.__dict__.get("forward")  # None: the class' forward
        unit._ac_offloader = offloader  # one for all units: it fetches the unit before ahead of its backward
        unit.forward = types.MethodType(_checkpointed_forward, unit)  # an instance attribute: the class is untouched
    return [name for name, _ in found]


def checkpointed_units(module: nn.Module) -> List[str]:
    """Names of the submodules :func:`checkpoint_units` wrapped (for reports and tests)."""
    return [n for n, m in module.named_modules() if getattr(m, "_activation_checkpointing", None) is not None]


__all__ = ["SAVED_OPS", "checkpoint_units", "checkpointed_units", "kv_cache_off"]
