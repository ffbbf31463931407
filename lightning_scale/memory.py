"""Live tensor bytes on any device, CPU included: ``with LiveTensorBytes() as mem: step(); mem.peak``.

An accelerator's allocator reports its peak (``torch.cuda.max_memory_allocated``); the CPU allocator keeps no such
count, and the peak RSS mixes in the allocator's cache and everything else the process holds. This counter is a
:class:`~torch.utils._python_dispatch.TorchDispatchMode`: every aten op run inside the block (forward, autograd's
backward, optimizer) is seen with its outputs; each new storage is counted from the op that created it until it
is freed (a weak reference expires), so ``peak`` is the most bytes of tensors created inside the block that were
alive at the same time, at op granularity: the storages of the outputs of one op plus everything still alive.

Not counted: tensors that existed before the block (parameters, inputs: ``baseline`` is there to add them),
scratch space an op allocates and frees inside its own kernel, and a storage resized in place after it was made
(ZeRO-3's gathered buffers are counted at the size they were created with: zero). ``extra`` adds bytes the ops do
not show, sampled at every op: the memory plan and the tuner's probes pass ZeRO-3's ``unit_buffer_bytes`` (its
units' buffers grow by ``untyped_storage().resize_``, which is no aten op; before, a CPU count of a ZeRO-3 step
missed them).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Current and peak bytes of tensor storages created inside the block (optionally on one ``device`` type)."""

    def __init__(self, device: str = None, extra: Optional[Callable[[], int]] = None) -> None:
        super().__init__()
        self.device = device
        self.extra = extra
        self._live: Dict[int, Tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.current -= self._live.pop(k)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        # an output on an input's storage (a view, an in-place op) is no new memory
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if self.device is not None and t.device.type != self.device:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._live or key in inputs:
                continue
            nbytes = storage.nbytes()
            self._live[key] = (StorageWeakRef(storage), nbytes)
            self.current += nbytes
        self.peak = max(self.peak, self.current + (self.extra() if self.extra is not None else 0))
        return out

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        self._sweep()
        return result


__all__ = ["LiveTensorBytes"]
