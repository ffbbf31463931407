"""Activation offload for checkpointed units: their inputs wait on the host between forward and backward.

With activation checkpointing a unit keeps only its inputs (the tensors saved at the unit boundary). Under
``offload_activations=True`` those inputs go to host memory (pinned, copied with ``non_blocking``) as soon as the
unit's forward has used them, and the device copy is freed. In the backward, when unit ``k`` recomputes, the input
of unit ``k - 1`` (the one the backward needs next) is copied back on a side stream, so the transfer overlaps unit
``k``'s recompute and backward; unit ``k - 1`` then waits only for that copy.

The gradient never goes through the host: the checkpointed region receives an empty *stub* tied to the device
input, and the value comes from the host copy. ``_Attach`` (inside the region) passes the input's gradient to
``_Detach`` (outside it), which hands it to the device input -- the same gradient as without offload.

Tensors already on the CPU (a CPU-only run) are not moved: they are in host memory already. ``force=True`` copies
them anyway (into fresh host buffers), which is how the CPU tests exercise the mechanism.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch


class _Detach(torch.autograd.Function):
    """Outside the region: an empty stub for ``x``; its backward returns the gradient ``_Attach`` stashed."""

    @staticmethod
    def forward(ctx, x, offloader, key):
        ctx.offloader, ctx.key = offloader, key
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _empty):
        return ctx.offloader.grads.pop(ctx.key), None, None


class _Attach(torch.autograd.Function):
    """Inside the region: the value from the host copy, connected to the stub for the gradient."""

    @staticmethod
    def forward(ctx, stub, value, offloader, key):
        ctx.offloader, ctx.key = offloader, key
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        ctx.offloader.grads[ctx.key] = grad
        return grad.new_empty(0), None, None, None


class ActivationOffloader:
    """Host copies of the checkpointed units' inputs, one slot per unit call, fetched one unit ahead."""

    def __init__(self, force: bool = False) -> None:
        self.force = force
        self.host: Dict[int, List[Tuple[torch.Tensor, torch.device]]] = {}
        self.prefetched: Dict[int, List[torch.Tensor]] = {}
        self.grads: Dict[Tuple[int, int], torch.Tensor] = {}
        self.events: List[Tuple[str, int]] = []  # ("fetch" | "prefetch" | "use_prefetched", slot), for tests
        self._next = 0
        self._stream: Optional[Any] = None

    def movable(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and (self.force or t.device.type != "cpu")

    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for entry in self.host.values() for h, _ in entry)

    # ------------------------------------------------------------------ forward
    def stash(self, tensors: List[torch.Tensor]) -> Tuple[int, List[torch.Tensor]]:
        """Copy ``tensors`` to the host; returns (slot, stubs that stand for them in the region)."""
        slot, self._next = self._next, self._next + 1
        entry = []
        for t in tensors:
            pin = t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            buf.copy_(t.detach(), non_blocking=pin)  # same stream as the compute: ordered before any reuse
            entry.append((buf, t.device))
        self.host[slot] = entry
        return slot, [_Detach.apply(t, self, (slot, i)) for i, t in enumerate(tensors)]

    # ------------------------------------------------------------------ backward (the recompute)
    def _copy_in(self, slot: int) -> List[torch.Tensor]:
        return [buf.to(device, non_blocking=device.type == "cuda") for buf, device in self.host.pop(slot)]

    def fetch(self, slot: int) -> List[torch.Tensor]:
        """The slot's inputs on their device (the prefetched copy if there is one); prefetch the slot before."""
        if slot in self.prefetched:
            values = self.prefetched.pop(slot)
            self.events.append(("use_prefetched", slot))
            if self._stream is not None:
                current = torch.cuda.current_stream()
                current.wait_stream(self._stream)
                for v in values:
                    v.record_stream(current)
        else:
            values = self._copy_in(slot)
            self.events.append(("fetch", slot))
        self._prefetch(slot - 1)
        return values

    def _prefetch(self, slot: int) -> None:
        if slot not in self.host:
            return
        self.events.append(("prefetch", slot))
        if any(device.type == "cuda" for _, device in self.host[slot]):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self.prefetched[slot] = self._copy_in(slot)
        else:
            self.prefetched[slot] = self._copy_in(slot)

    def attach(self, slot: int, stubs: List[torch.Tensor], values: List[torch.Tensor]) -> List[torch.Tensor]:
        return [_Attach.apply(s, v, self, (slot, i)) for i, (s, v) in enumerate(zip(stubs, values))]


__all__ = ["ActivationOffloader"]
