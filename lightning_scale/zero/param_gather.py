"""Stages 1-2: the post-step parameter all-gather runs in the background, bucket by bucket.

After the optimizer step each bucket's updated shard is all-gathered (in place) into the bucket's flat
parameter buffer with an asynchronous collective. The buckets are launched in forward order (they are laid out
in backward order, so the last bucket first), and ``step()`` returns at once: the next forward overlaps the
gathers still in flight.

Nothing may read a stale parameter. While its bucket's gather is in flight, each parameter's class is swapped
to a subclass whose ``__torch_function__`` first waits for *that bucket's* gather (which gives the bucket's
parameters their class back), then runs the op. So the first read of a parameter, wherever it comes from (the
next forward's first op on it, an eval step between steps, ``module.state_dict()``, a callback's ``p.norm()``,
``torch.save``), waits for exactly the bucket it needs, and from then on the parameter is a plain
``nn.Parameter`` again: one ``__class__`` assignment per parameter per step, nothing per op. Reading metadata
(shape, dtype, ``.grad``, ``requires_grad``, hook registration) does not wait, so ``zero_grad`` and the gradient
hooks never serialize on the gathers.

The engine itself waits for every gather (:meth:`ParamGathers.wait_all`) before it reads or writes the buffers:
at the next step (fp32 masters are views of the buffers), in ``state_dict`` / ``load_state_dict`` / the
checkpoint pieces, and in ``remove_hooks``. ``ZeroOptimizer.wait_params()`` is the public, explicit wait for code
that reads parameter memory behind torch's back (``data_ptr``, ``untyped_storage``, a C extension).

Only buckets whose parameters are exactly ``torch.nn.Parameter`` are guarded this way; a bucket holding another
parameter class (a tensor subclass with its own ``__torch_function__``) is waited for inside ``step()``.
Code that runs ops with torch-function dispatch disabled for subclasses (``torch._C.DisableTorchFunctionSubclass``,
another subclass's handler) bypasses the guard: call ``wait_params()`` first.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set

import torch

from lightning_scale.zero.param_guard import _META, _name

# Metadata that reads no values: a parameter in flight answers these without waiting. (param_guard's list, less
# the two that hand out raw memory.)
_NO_WAIT = _META - {"data_ptr", "untyped_storage"}


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, _InFlightMixin):
                yield t


class _InFlightMixin:
    """A parameter whose bucket's all-gather is in flight: the first op that reads it waits for the bucket."""

    _ls_base: type
    _ls_wait: Callable[[], None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _name(func) in _NO_WAIT:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for t in list(_tensors(args, kwargs)):
            if not isinstance(t, _InFlightMixin):
                continue  # its bucket was waited for by an earlier argument
            type(t)._ls_wait()  # the bucket's gather is done; its parameters are plain again
            if isinstance(t, _InFlightMixin):  # a copy made while in flight (deepcopy): in no bucket
                t.__class__ = type(t)._ls_base
        return func(*args, **kwargs)


class ParamGathers:
    """The in-flight post-step all-gathers of one engine, one per bucket, and the guards on their parameters.

    ``on_event(kind, bucket)`` (tests, tracing): called with ``"launch"``, ``"wait_begin"`` and ``"wait_end"``.
    """

    def __init__(self, buckets_params: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        self._params: List[List[torch.nn.Parameter]] = [list(ps) for ps in buckets_params]
        self._classes = [self._in_flight_class(i) for i in range(len(self._params))]
        self._handles: Dict[int, object] = {}
        self._guarded: Set[int] = set()  # buckets in flight whose parameters wait for them
        self.on_event: Optional[Callable[[str, int], None]] = None

    def _in_flight_class(self, bucket: int) -> type:
        return type("InFlightParameter", (_InFlightMixin, torch.nn.Parameter),
                    {"_ls_base": torch.nn.Parameter, "_ls_wait": staticmethod(lambda: self.wait(bucket)),
                     "__module__": __name__})

    def _event(self, kind: str, bucket: int) -> None:
        if self.on_event is not None:
            self.on_event(kind, bucket)

    def launch(self, bucket: int, handle, background: bool) -> None:
        """Record the bucket's gather ``handle``; ``background``: guard its parameters (if the bucket allows) so
        it can stay in flight. Then :meth:`settle`."""
        self._handles[bucket] = handle
        self._event("launch", bucket)
        # Only plain nn.Parameters can be guarded (another class may have its own __torch_function__).
        params = self._params[bucket]
        if background and all(type(p) is torch.nn.Parameter for p in params) and not handle.is_completed():
            cls = self._classes[bucket]
            for p in params:
                p.__class__ = cls
            self._guarded.add(bucket)

    def settle(self, background: bool) -> None:
        """After the launches: wait for all (``background=False``) or for the unguarded buckets only."""
        for bucket in sorted(self._handles, reverse=True):
            if not (background and bucket in self._guarded):
                self.wait(bucket)

    def in_flight(self) -> List[int]:
        """Buckets whose gather has not been waited for yet."""
        return sorted(self._handles)

    def is_completed(self, bucket: int) -> bool:
        """Whether the bucket's collective has finished (a bucket not in flight counts as finished)."""
        handle = self._handles.get(bucket)
        return handle is None or handle.is_completed()

    def wait(self, bucket: int) -> None:
        handle = self._handles.pop(bucket, None)
        if handle is None:
            return
        self._guarded.discard(bucket)
        self._event("wait_begin", bucket)
        try:
            handle.wait()
        finally:
            for p in self._params[bucket]:
                if isinstance(p, _InFlightMixin):
                    p.__class__ = torch.nn.Parameter
            self._event("wait_end", bucket)

    def wait_all(self) -> None:
        for bucket in sorted(self._handles, reverse=True):  # launch order
            self.wait(bucket)
