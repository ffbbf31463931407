"""Asynchronous checkpoint saves: snapshot at the step boundary, write in the background, one save in flight.

``AsyncSaver.save(path, pieces, extras)`` copies every piece's local tensors into host buffers (allocated on the
first save, pinned when CUDA is there, reused by the next saves while the shapes stay the same) and deep-copies
the small python extras, then returns: training goes on while a background thread writes the snapshot through
:func:`lightning_scale.checkpoint.dcp_format.save`. At most one save is in flight: a second ``save`` first waits
for the first. A failed write is raised by the next ``save`` or by ``wait()``. The format's staging + swap keeps
the previous good checkpoint loadable until the new one is complete (a crash mid-write leaves it untouched).

Overlapped snapshot (``later=`` / ``fence_on=``, what ``Zero3DStrategy(checkpoint_async="overlap")`` uses): the
tensors that only an optimizer step writes (the engines' parameter shards, masters and optimizer state) are copied
by the writing thread instead, while the next forward / backward runs; the next ``step()`` of each optimizer in
``fence_on`` waits for that copy first (a step pre-hook), so the snapshot is still the state at the step boundary.
Whatever else may change before that step (module buffers a forward updates, the extras) is copied in ``save`` as
before. Code that writes the saved tensors between steps outside an optimizer step (a callback that edits weights)
must call ``fence()`` first, or use the blocking snapshot.

The write is collective when ``group`` spans several ranks, and it runs in a thread beside training's own
collectives: give it a process group of its own (``torch.distributed.new_group(backend="gloo")``, created on
every rank), never the group training communicates on - two threads issuing collectives on one group can pair
the wrong operations.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from lightning_scale.checkpoint.layout import Piece


class AsyncSaver:
    """``save_fn(path, pieces, extras, group=..., meta=...)`` defaults to the layout-free format's save."""

    def __init__(self, save_fn: Optional[Callable[..., None]] = None, *, group=None) -> None:
        if save_fn is None:
            from lightning_scale.checkpoint.dcp_format import save as save_fn
        self.save_fn = save_fn
        self.group = group
        self._buffers: Dict[Tuple[str, int], torch.Tensor] = {}
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._copied: Optional[threading.Event] = None  # set once the overlapped part of the snapshot is copied
        self._hooks: List[Any] = []
        self.last_snapshot_s = 0.0  # how long the last save blocked the caller
        self.fence_wait_s = 0.0  # how long optimizer steps waited for overlapped snapshots, in all

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the host snapshot buffers kept for the next save (the rank's own pieces, once)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def unconfirmed(self) -> bool:
        """A save was started and not waited for yet: it may still be writing, or may have failed."""
        return self._thread is not None or self._error is not None

    def fence(self) -> None:
        """Block until the overlapped part of the snapshot in flight is copied (a no-op when there is none): after
        it the saved tensors may change. The optimizers' step pre-hooks of ``fence_on`` call it."""
        copied = self._copied
        if copied is not None and not copied.is_set():
            start = time.perf_counter()
            copied.wait()
            self.fence_wait_s += time.perf_counter() - start

    def _remove_hooks(self) -> None:
        for handle in self._hooks:  # never from inside a hook: torch iterates the hooks while calling them
            handle.remove()
        self._hooks = []

    def wait(self) -> None:
        """Block until the save in flight is written; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._remove_hooks()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(self, path: str, pieces: Iterable[Piece], extras: Optional[Dict[str, Any]] = None, *,
             meta: Optional[Dict[str, Any]] = None, on_written: Optional[Callable[[], None]] = None,
             later: Iterable[int] = (), fence_on: Iterable[torch.optim.Optimizer] = ()) -> None:
        """Snapshot, then write in the background. ``on_written()`` runs in the writing thread once the folder is in
        place on every rank (not when the write fails); its error is raised like a failed write's. ``later``: the
        indices of the pieces the writing thread copies itself, overlapped with training, before the next ``step()``
        of any optimizer of ``fence_on`` may run (module docstring); the pieces keep their order."""
        self.wait()  # one in flight; an earlier failure surfaces here
        start = time.perf_counter()
        pieces, skip = list(pieces), set(later)
        snap: List[Optional[Piece]] = [None] * len(pieces)
        rest = [i for i in range(len(pieces)) if i not in skip]
        for i, piece in zip(rest, self._snapshot([pieces[i] for i in rest])):
            snap[i] = piece
        extras = copy.deepcopy(extras) if extras else None
        meta = copy.deepcopy(meta) if meta else None
        deferred = [(i, pieces[i]) for i in sorted(skip)]
        ready = None  # CUDA: where the step boundary is on this thread's stream; the copy's side stream waits for it
        if any(t.is_cuda for _, p in deferred for t in p.tensors):
            ready = torch.cuda.Event()
            ready.record()
        copied = self._copied = threading.Event()
        if deferred:
            self._hooks = [opt.register_step_pre_hook(lambda *_: self.fence()) for opt in fence_on]
        else:
            copied.set()
        self.last_snapshot_s = time.perf_counter() - start
        self._thread = threading.Thread(target=self._run, args=(path, snap, deferred, copied, ready, extras, meta,
                                                                on_written),
                                        daemon=True, name="lightning_scale-async-save")
        self._thread.start()

    def _run(self, path: str, pieces: List[Optional[Piece]], later: List[Tuple[int, Piece]], copied: threading.Event,
             ready, extras, meta, on_written) -> None:
        try:
            try:
                stream = contextlib.nullcontext()
                if ready is not None:  # a side stream: the device-to-host copies overlap the next forward's kernels
                    side = torch.cuda.Stream()
                    side.wait_event(ready)
                    stream = torch.cuda.stream(side)
                with stream:
                    for (i, _), piece in zip(later, self._snapshot([p for _, p in later])):
                        pieces[i] = piece
            finally:
                copied.set()  # also on a failed copy: the step goes on, the save's error is raised at the next wait
            self.save_fn(path, pieces, extras, group=self.group, meta=meta)
            if on_written is not None:
                on_written()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def _buffer(self, key: str, i: int, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get((key, i))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
            self._buffers[(key, i)] = buf  # its own storage: DCP writes it without a clone
        return buf

    @torch.no_grad()
    def _snapshot(self, pieces: List[Piece]) -> List[Piece]:
        out = []
        for p in pieces:
            bufs = []
            for i, t in enumerate(p.tensors):
                buf = self._buffer(p.key, i, t)
                buf.copy_(t, non_blocking=t.is_cuda)
                bufs.append(buf)
            out.append(Piece(p.key, p.global_shape, p.dtype, list(p.chunks), bufs))
        if torch.cuda.is_available() and any(t.is_cuda for p in pieces for t in p.tensors):
            # this stream's device-to-host copies are done before the writer reads them
            torch.cuda.current_stream().synchronize()
        return out
