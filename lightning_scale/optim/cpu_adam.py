"""The offload optimizer step: re-create the user's optimizer over CPU master shards, fastest kernel first.

Under ``offload="optimizer"`` (and whenever the masters live on a CPU device, as in CPU training) the fp32
master shards and the optimizer state live on the host and the step runs there. The step is memory-bound: Adam reads param, grad, m, v and writes param, m, v, 28
bytes per fp32 element, so the kernel that makes one pass over memory wins. ``bench/optimizer_step.py``
on 50M fp32 elements, 2-core CPU machine (2026-11-30, bench/RESULTS.md): torch's ``fused=True`` CPU
AdamW 64 ms/step (~22 GB/s, at the measured memory bandwidth), DeepSpeed's C++ ``DeepSpeedCPUAdam``
122-132 ms, ``foreach=True`` 610-880 ms (several passes over multi-tensor lists, temporaries), the
for-loop version 720-745 ms. Fused needs no JIT build. So for ``torch.optim.Adam`` / ``AdamW`` (exact
classes) whose implementation the user left to torch (``foreach=None, fused=None``) we construct with
``fused=True``. Any other class - or an explicit ``foreach`` / ``fused`` choice, or
``differentiable=True`` - is constructed as the user asked: unlike DeepSpeed, offload works with every
torch optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Mapping, Sequence, Type

import torch

_FAST_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _params_of(param_groups: Sequence[Mapping[str, Any]]) -> List[torch.Tensor]:
    return [p for g in param_groups for p in g["params"]]


def offload_step_impl(optimizer_cls: Type[torch.optim.Optimizer], defaults: Mapping[str, Any],
                      params: Sequence[torch.Tensor] = ()) -> str:
    """Which implementation :func:`make_offload_optimizer` uses: ``"fused"`` or ``"as-given"``."""
    if optimizer_cls not in _FAST_CLASSES:
        return "as-given"
    if defaults.get("fused") is not None or defaults.get("foreach") is not None:
        return "as-given"  # the user chose; respect it
    if defaults.get("differentiable", False):
        return "as-given"  # fused kernels do not support differentiable=True
    if any(p.device.type != "cpu" or p.dtype not in _FUSED_DTYPES for p in params):
        return "as-given"
    return "fused"


def make_offload_optimizer(optimizer_cls: Type[torch.optim.Optimizer], param_groups: Sequence[Mapping[str, Any]],
                           defaults: Mapping[str, Any]) -> torch.optim.Optimizer:
    """``optimizer_cls(param_groups, **defaults)`` over CPU shards, with the fastest CPU kernel for Adam/AdamW.

    ``param_groups``: dicts with ``"params"`` (the CPU master shards) and the group's hyperparameters
    (they may carry every key of the user's groups, e.g. ``lr``, ``weight_decay``, ``foreach``).
    ``defaults``: the user's ``optimizer.defaults``. Only the keys the constructor accepts are passed
    (AdamW's derived ``decoupled_weight_decay`` is not a constructor argument in every torch).
    """
    groups: List[Dict[str, Any]] = [dict(g) for g in param_groups]
    for i, g in enumerate(groups):
        if "params" not in g:
            raise ValueError(f"param_groups[{i}] has no 'params'")
        g["params"] = list(g["params"])
    accepted = inspect.signature(optimizer_cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    impl = offload_step_impl(optimizer_cls, defaults, _params_of(groups))
    if impl == "fused":
        # Group dicts copied from the user's groups carry foreach/fused too, and step() reads those.
        kwargs.update(fused=True, foreach=False)
        for g in groups:
            g["fused"], g["foreach"] = True, False
    try:
        optimizer = optimizer_cls(groups, **kwargs)
    except TypeError as err:
        raise TypeError(f"offload re-creates {optimizer_cls.__name__} over the CPU shards with "
                        f"{optimizer_cls.__name__}(param_groups, **defaults), which failed: {err}") from err
    optimizer.offload_step_impl = impl  # type: ignore[attr-defined]  (shown in logs and tests)
    return optimizer
