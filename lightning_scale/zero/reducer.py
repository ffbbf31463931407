"""Gradient reduction for ZeRO stages 0-2, bucket by bucket, overlapped with backward.

Per bucket, once every parameter in it has its gradient (``register_post_accumulate_grad_hook``):

* stage 0: all-reduce the bucket's flat gradient buffer (DDP);
* stage 1: reduce-scatter the bucket's full gradient buffer (the params' ``.grad`` are views of it) into a
  persistent shard-sized gradient. The full buffers live from the bucket's first gradient of a step to the end of
  the reduction at the step boundary (:meth:`GradientReducer.reduce`), then are freed: between steps a rank
  holds only its gradient shard (ZeRO-1's footprint: params + grad shard + optimizer shard);
* stage 2: copy the gradients into a transient staging buffer, free them, reduce-scatter the staging
  buffer into a persistent shard-sized gradient, then free the staging buffer - each rank keeps only
  its gradient shard.

Buckets are launched strictly in index order on every rank (a bucket that is ready early waits for
the ones before it), so collectives always match across ranks even when ranks see different graphs.

Partial gradients (``partial_group``): the whole parameters of a tp-axis layout whose gradient on each rank is its
share only (sequence parallelism's norms and row biases; every parameter but the experts under ``ep``) are summed over
that axis when their bucket is launched: their elements gathered and all-reduced (asynchronously, on a process group
of their own, a twin of the tp group: the tp group itself carries the model's collectives inside the backward, in an
order two ranks need not share with the gradient hooks), and the bucket's own dp reduction runs once that sum is in,
when its handle is waited (the next bucket's staging window, or the step).
Inside ``no_sync()`` (gradient accumulation) nothing is communicated: gradients accumulate locally.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.comm import pairwise
from lightning_scale.zero.flat_buffer import Bucket


_MAX_INFLIGHT = 2  # stage 2: reduce-scatters (and their staging buffers) in flight during backward


class BucketState:
    """The tensors and per-cycle bookkeeping of one bucket."""

    def __init__(self, bucket: Bucket, stage: int, rank: int, device: torch.device,
                 param_dtype: Optional[torch.dtype] = None, master_dtype: Optional[torch.dtype] = None,
                 master_device: Optional[torch.device] = None, pin_memory: bool = True,
                 stream_grads: bool = False, world: int = 0) -> None:
        self.bucket = bucket
        # Stage 1 over one rank (dp=1, e.g. under tp / pp): the shard is the whole bucket, so the gradients stay
        # where autograd accumulates them (persistent views, as at stage 0): no reduce-scatter copy into a
        # shard-sized buffer, no division by 1, no post-step gather (see ZeroOptimizer._write_back_and_gather).
        self.local_only = stage == 1 and world == 1 and not stream_grads
        self.stage = stage
        self.rank = rank
        lo, hi = bucket.shard_range(rank)
        self.shard = slice(lo, hi)
        dtype = param_dtype or bucket.dtype
        master_dtype = master_dtype or dtype
        # The parameters' current (full-precision) values: the master shard is taken from them before
        # the parameters are cast, so mixed precision starts from exact fp32 weights.
        flat = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=device)
        for slot in bucket.slots:
            flat[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
        self.param_buffer = flat if flat.dtype == dtype else flat.to(dtype)
        master_device = torch.device(master_device) if master_device is not None else torch.device(device)
        # Optimizer offload puts the master shard (and so the optimizer state) on the host; pinned when the
        # parameters live on an accelerator, so the copies back can be asynchronous.
        self.master_aliased = master_dtype == dtype and master_device == torch.device(device)
        if self.master_aliased:
            self.master = self.param_buffer[self.shard]
        else:
            self.master = flat[self.shard].to(device=master_device, dtype=master_dtype).clone()
            if pin_memory and master_device.type == "cpu" and torch.device(device).type == "cuda":
                self.master = self.master.pin_memory()
        del flat
        # Stage 0: persistent full gradients, the params' .grad are views. Stage 1: the same, but only from the
        # bucket's first gradient of a step until the reduction ends (ensure_grad_buffer / release_grad_buffer).
        self.grad_buffer: Optional[torch.Tensor] = None
        self.shard_grad: Optional[torch.Tensor] = None  # stages 1-2: the reduced gradient shard
        self.staging: Optional[torch.Tensor] = None  # stage 2: transient, only while reducing
        self._grad_dtype, self._device = dtype, device
        if stage == 0 or self.local_only:
            self.grad_buffer = torch.zeros(bucket.padded_numel, dtype=dtype, device=device)
        elif not stream_grads:
            self.shard_grad = torch.zeros(hi - lo, dtype=dtype, device=device)
        # ZeRO-Offload at stage 2: each reduced gradient shard goes to the host (master dtype) as soon as its
        # reduce-scatter finishes; the device keeps no persistent gradient shard.
        self.stream_grads = stream_grads
        self.host_grad: Optional[torch.Tensor] = None
        self.master_device = master_device
        self.master_dtype = master_dtype
        for slot in bucket.slots:
            slot.param.data = self.param_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
        self.consumed = [False] * len(bucket.slots)
        self.handle: Optional[C.Handle] = None
        self.launched = False

    def write_master(self, master: torch.Tensor) -> None:
        """Put an (updated or loaded) master shard back into this rank's slice of the parameters."""
        self.param_buffer[self.shard].copy_(master)

    def ensure_grad_buffer(self) -> None:
        """Stage 1: allocate the bucket's full gradient buffer (at its first gradient of a step) and make the
        params' ``.grad`` views of it; gradients autograd already made (``no_sync`` micro-batches) are folded in."""
        if self.grad_buffer is not None:
            return
        self.grad_buffer = torch.zeros(self.bucket.padded_numel, dtype=self._grad_dtype, device=self._device)
        for i, slot in enumerate(self.bucket.slots):
            grad, view = slot.param.grad, self.grad_view(i)
            if grad is not None:
                view.copy_(grad)
            slot.param.grad = view

    def release_grad_buffer(self) -> None:
        """Stage 1, once the shard is reduced: free the full gradients (the params' ``.grad`` become None)."""
        if self.stage != 1 or self.local_only:
            return
        for slot in self.bucket.slots:
            slot.param.grad = None
        self.grad_buffer = None

    def grad_view(self, i: int) -> torch.Tensor:
        slot = self.bucket.slots[i]
        return self.grad_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def attach_grad_views(self) -> None:
        if self.grad_buffer is None:
            return
        for i, slot in enumerate(self.bucket.slots):
            slot.param.grad = self.grad_view(i)

    def reduced_grad(self) -> torch.Tensor:
        """This rank's reduced gradient (the whole bucket at stage 0, the shard otherwise)."""
        if self.stage == 0:
            return self.grad_buffer
        if self.local_only:
            return self.grad_buffer[self.shard]  # the whole bucket
        if self.stream_grads:
            if self.host_grad is None:  # nothing reduced this cycle
                self.host_grad = torch.zeros(self.shard.stop - self.shard.start, dtype=self.master_dtype,
                                             device=self.master_device)
            return self.host_grad
        return self.shard_grad

    def reset(self) -> None:
        self.consumed = [False] * len(self.bucket.slots)
        self.handle = None
        self.launched = False
        self.staging = None
        self.host_grad = None


class GradientReducer:
    def __init__(self, buckets: List[Bucket], stage: int, group, device: torch.device,
                 overlap_comm: bool = True, param_dtype: Optional[torch.dtype] = None,
                 master_dtype: Optional[torch.dtype] = None, master_device: Optional[torch.device] = None,
                 pin_memory: bool = True, stream_grads: bool = False,
                 partial: Optional[Callable[[torch.Tensor], bool]] = None, partial_group=None) -> None:
        """``partial(param)`` / ``partial_group``: parameters whose gradients are summed over ``partial_group`` before
        the dp reduction (module docstring); None: none."""
        self.stage = stage
        self.group = group
        self.world = C.group_size(group)
        self.rank = C.group_rank(group) if stage >= 1 else 0
        self.overlap_comm = overlap_comm
        self.states = [BucketState(b, stage, self.rank, device, param_dtype, master_dtype, master_device, pin_memory,
                                   stream_grads=stream_grads and stage == 2, world=self.world) for b in buckets]
        self._where: Dict[int, tuple] = {}
        for bi, st in enumerate(self.states):
            for si, slot in enumerate(st.bucket.slots):
                self._where[id(slot.param)] = (bi, si)
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(self._on_grad_ready)
            for st in self.states for slot in st.bucket.slots
        ]
        self.sync_enabled = True  # False inside no_sync()
        self.reduced = False
        self._next_launch = 0
        self._ready = [0] * len(self.states)
        self._inflight: List[BucketState] = []
        self.partial_group = partial_group if partial is not None and C.group_size(partial_group) > 1 else None
        self._partial: List[Optional[torch.Tensor]] = []  # per bucket: the flat indices of partial elements
        self._index = {id(st): i for i, st in enumerate(self.states)}
        for st in self.states:
            idx = [torch.arange(slot.offset, slot.offset + slot.numel) for slot in st.bucket.slots
                   if self.partial_group is not None and partial(slot.param)]
            self._partial.append(torch.cat(idx).to(device) if idx else None)
        for st in self.states:
            st.attach_grad_views()

    # ------------------------------------------------------------------ hooks
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not (self.sync_enabled and self.overlap_comm):
            return  # accumulate locally; reduce() folds these gradients in later
        bi, si = self._where[id(param)]
        st = self.states[bi]
        if st.consumed[si]:
            raise RuntimeError(
                "a parameter received a second gradient after its bucket was already reduced in this step; "
                "wrap all but the last backward in no_sync() or set zero.overlap_comm=False"
            )
        self._consume(st, si)
        self._ready[bi] += 1
        if self._ready[bi] == len(st.bucket.slots):
            self._launch_ready_in_order()

    def _consume(self, st: BucketState, si: int) -> None:
        """Move parameter si's accumulated gradient into the bucket's buffer."""
        slot = st.bucket.slots[si]
        if st.stage == 1:
            st.ensure_grad_buffer()
        grad = slot.param.grad
        if st.stage <= 1:  # the gradient should already be the view
            view = st.grad_view(si)
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            slot.param.grad = view
        else:  # stage 2
            if st.staging is None:
                st.staging = torch.zeros_like(st.param_buffer)
            if grad is not None:
                st.staging[slot.offset:slot.offset + slot.numel].copy_(grad.reshape(-1))
            slot.param.grad = None  # free the full gradient: only the shard survives
        st.consumed[si] = True

    def _launch_ready_in_order(self) -> None:
        while self._next_launch < len(self.states):
            bi = self._next_launch
            st = self.states[bi]
            if self._ready[bi] < len(st.bucket.slots):
                return
            self._launch(st)
            self._next_launch += 1

    def _launch(self, st: BucketState) -> None:
        for si, done in enumerate(st.consumed):
            if not done:
                self._consume(st, si)
        idx = self._partial[self._index[id(st)]] if self.partial_group is not None else None
        if idx is not None:  # the partial elements summed over the tp axis first (module docstring)
            buf = st.staging if self.stage == 2 else st.grad_buffer
            part = buf[idx]
            summing = C.all_reduce(part, self.partial_group, async_op=True, tag="tp/partial_grads")

            def then(st=st, buf=buf, part=part, idx=idx, summing=summing) -> None:
                summing.wait()
                buf[idx] = part
                handle = self._reduce_over_dp(st, window=False)
                if handle is not None:  # the bucket's dp reduction, waited here (this is its handle's wait)
                    handle.wait()

            st.handle = C.Handle(None, then)
            if self.stage == 2:  # its staging buffer counts in the window like any other in flight
                self._join_window(st)
            st.launched = True
            return
        st.handle = self._reduce_over_dp(st)
        st.launched = True

    def _reduce_over_dp(self, st: BucketState, window: bool = True) -> Optional[C.Handle]:
        """Start the bucket's reduction over dp; its handle. ``window``: a stage-2 bucket joins the staging window
        (False: the caller waits for it at once)."""
        if self.stage == 0:
            st.grad_buffer.div_(self.world)
            return C.all_reduce(st.grad_buffer, self.group, async_op=True, tag="grad")
        if st.local_only:
            return None  # one rank: the accumulated gradients are the reduced ones
        if self.stage == 1:
            st.grad_buffer.div_(self.world)
            return pairwise.reduce_scatter(st.shard_grad, st.grad_buffer, self.group, async_op=True, tag="grad")
        # stage 2
        st.staging.div_(self.world)
        out = st.shard_grad if not st.stream_grads else torch.empty(
            st.shard.stop - st.shard.start, dtype=st.staging.dtype, device=st.staging.device)
        handle = pairwise.reduce_scatter(out, st.staging, self.group, async_op=True, tag="grad")

        def finish(st=st, handle=handle, out=out) -> None:
            handle.wait()
            st.staging = None  # transient: freed as soon as the shard is reduced
            if st.stream_grads:
                st.host_grad = out.to(device=st.master_device, dtype=st.master_dtype)

        handle = C.Handle(None, finish)
        if window:
            st.handle = handle
            self._join_window(st)
        return handle

    def _join_window(self, st: BucketState) -> None:
        """Bound the full-size staging buffers alive during backward: at most _MAX_INFLIGHT buckets in flight."""
        self._inflight.append(st)
        while len(self._inflight) > _MAX_INFLIGHT:
            oldest = self._inflight.pop(0)
            if oldest.handle is not None:
                oldest.handle.wait()

    # ------------------------------------------------------------------ public
    def reduce(self) -> None:
        """Launch what is left (in order) and wait for every bucket. Idempotent within a step."""
        if self.reduced:
            return
        while self._next_launch < len(self.states):
            st = self.states[self._next_launch]
            self._launch(st)
            self._next_launch += 1
        for st in self.states:
            if st.handle is not None:
                st.handle.wait()
                st.handle = None  # drops the temporaries its completion callback held
            st.release_grad_buffer()
        self.reduced = True

    def new_cycle(self) -> None:
        self._inflight = []
        self.reduced = False
        self._next_launch = 0
        self._ready = [0] * len(self.states)
        for st in self.states:
            st.reset()

    def zero_grad(self) -> None:
        for st in self.states:
            if st.stage == 0 or st.local_only:
                st.grad_buffer.zero_()
                st.attach_grad_views()
            else:
                st.release_grad_buffer()
                for slot in st.bucket.slots:
                    slot.param.grad = None
                if st.shard_grad is not None:
                    st.shard_grad.zero_()
                st.host_grad = None
        self.new_cycle()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
