"""OneBitZeroOptimizer: 1-bit Adam with ZeRO stage 1 or 2 (optimizer state, fp32 masters sharded).

1-bit Adam (Tang et al., 2021, https://arxiv.org/abs/2102.02888) exchanges a 1-bit momentum instead
of the gradients; ZeRO (Rajbhandari et al., 2020) shards the optimizer state. Combined, one step is:

1. accumulate each rank's LOCAL gradient (no reduce hooks: the exchange happens at ``step``);
2. per bucket, ``OneBitAdamShard.step(local flat gradient)``: in the warm-up a full-precision
   reduce-scatter and exact AdamW on this rank's fp32 master shard; in the compression stage a
   1-bit compressed reduce-scatter of the momentum increment, with per-rank error feedback;
3. write the master shard back into the (bf16 / fp16 / fp32) parameter buffer and all-gather it.

Layout: :func:`~lightning_scale.zero.flat_buffer.build_buckets` (one param group and dtype per
bucket, padded to a multiple of N), so a bucket's shard ``[r*S, (r+1)*S)`` with ``S = padded / N``
is exactly ``OneBitAdamShard``'s ``ceil(padded / N)``; the padding is a segment of its own (its
gradient is always 0, so it never affects a parameter's 1-bit scale).

Gradient memory (what stage 1 and stage 2 mean here): the 1-bit exchange needs the whole local
gradient of a bucket at ``step``, so no stage can free gradients during backward. Stage 1 keeps a
persistent flat gradient buffer per bucket (the params' ``.grad`` are views of it). Stage 2 keeps
none: autograd's own ``.grad`` tensors are flattened bucket by bucket at ``step`` into a transient
buffer and freed right away, so between steps no gradient memory is held. Both keep the
persistent fp32 worker error buffer the compressed reduce-scatter needs (the bucket's full size,
allocated at the first compression step).

Gradient clipping: a global gradient norm would need the reduced gradient, which never exists in
the compression stage (only 1-bit momentum increments travel), and clipping local gradients is not
clipping their mean. ``clip_grad_norm_`` and ``clip_grad_value_`` therefore raise ``ConfigError``;
clip nothing (Adam's update is bounded by lr already), or use stage 0.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.comm import pairwise
from lightning_scale.config import ConfigError
from lightning_scale.optim.onebit_adam import OneBitAdam, OneBitAdamShard, check_zero_stage
from lightning_scale.zero.flat_buffer import Bucket, build_buckets
from lightning_scale.zero.optimizer import ZeroOptimizer, route_user_calls_fn
from lightning_scale.zero.precision import NoLossScaler, PrecisionPolicy

_SYNCED_HPARAMS = ("lr", "betas", "eps", "weight_decay")  # read from the user's param group every step


class OneBitBucket:
    """One bucket: its parameter buffer, fp32 master shard, local gradients and shard optimizer."""

    def __init__(self, bucket: Bucket, optimizer: OneBitAdam, *, stage: int, rank: int, group,
                 device: torch.device, param_dtype: torch.dtype, master_dtype: torch.dtype) -> None:
        self.bucket, self.stage = bucket, stage
        lo, hi = bucket.shard_range(rank)
        self.shard = slice(lo, hi)
        self.master_dtype = master_dtype
        # Master values from the params' current (full-precision) values, before they are cast.
        flat = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=device)
        for slot in bucket.slots:
            flat[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
        self.param_buffer = flat if flat.dtype == param_dtype else flat.to(param_dtype)  # (padded,)
        self.master_aliased = master_dtype == param_dtype
        self.master = (self.param_buffer[self.shard] if self.master_aliased
                       else flat[self.shard].to(master_dtype).clone())  # (S,)
        del flat
        for slot in bucket.slots:
            slot.param.data = self.param_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)
        # Stage 1: a persistent flat gradient buffer, .grad are views. Stage 2: none (see module doc).
        self.grad_buffer = (torch.zeros(bucket.padded_numel, dtype=param_dtype, device=device)
                            if stage == 1 else None)
        self.attach_grad_views()
        padding = bucket.padded_numel - bucket.numel
        segments = [s.numel for s in bucket.slots] + ([padding] if padding else [])
        self.helper = OneBitAdamShard.from_optimizer(optimizer, self.master, bucket.padded_numel,
                                                     param_group=bucket.group_index, group=group, segments=segments)
        mask = optimizer.param_groups[bucket.group_index].get("exp_avg_mask")
        if mask is not None:  # DeepSpeed's per-group mask, shaped like each param: flattened to the shard
            full = torch.ones(bucket.padded_numel, dtype=master_dtype, device=device)
            for slot in bucket.slots:
                full[slot.offset:slot.offset + slot.numel].copy_(mask.reshape(-1))
            self.helper.exp_avg_mask = full[self.shard].clone()

    def attach_grad_views(self) -> None:
        if self.grad_buffer is None:
            return
        for slot in self.bucket.slots:
            slot.param.grad = self.grad_buffer[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def local_grads(self) -> List[torch.Tensor]:
        """This rank's accumulated gradients (None for a param without one; stage 1 never has None)."""
        return [slot.param.grad for slot in self.bucket.slots]

    def take_flat_grad(self) -> torch.Tensor:
        """The bucket's local gradient as one (padded,) tensor in the master dtype.

        Stage 2 frees the params' gradients as it copies them: only this transient buffer remains.
        """
        if self.grad_buffer is not None:  # stage 1
            for slot in self.bucket.slots:
                view = self.grad_buffer[slot.offset:slot.offset + slot.numel]
                grad = slot.param.grad
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():  # autograd replaced the view: fold it back in
                    view.copy_(grad.reshape(-1))
            self.attach_grad_views()
            return self.grad_buffer.to(self.master_dtype)  # the buffer itself when the dtypes match
        flat = torch.zeros(self.bucket.padded_numel, dtype=self.master_dtype, device=self.param_buffer.device)
        for slot in self.bucket.slots:
            if slot.param.grad is not None:
                flat[slot.offset:slot.offset + slot.numel].copy_(slot.param.grad.reshape(-1))
            slot.param.grad = None
        return flat

    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
            self.attach_grad_views()
        else:
            for slot in self.bucket.slots:
                slot.param.grad = None


class OneBitZeroOptimizer:
    """ZeRO stage 1/2 engine for a user's :class:`OneBitAdam` (same surface as :class:`ZeroOptimizer`).

    The user's optimizer stays the object Lightning and lr schedulers see; its ``step`` / ``zero_grad``
    are routed here, and ``lr``, ``betas``, ``eps`` and ``weight_decay`` are read from its param groups
    at every step. Its ``freeze_step``, ``bias_correction``, ``scale`` and ``mask_small_variance`` apply.
    """

    def __init__(self, optimizer: OneBitAdam, *, stage: int = 2, group=None,
                 precision: Optional[PrecisionPolicy] = None, loss_scaler=None, bucket_mb: float = 25.0,
                 route_user_calls: bool = True) -> None:
        if not isinstance(optimizer, OneBitAdam):
            raise TypeError(f"OneBitZeroOptimizer wraps a lightning_scale.optim.OneBitAdam, got "
                            f"{type(optimizer).__name__}; use ZeroOptimizer for other optimizers")
        check_zero_stage(stage)  # ConfigError for stage 3
        if stage not in (1, 2):
            raise ConfigError(f"zero.stage={stage}: OneBitZeroOptimizer is the stage 1/2 engine; at stage 0 "
                              "OneBitAdam communicates by itself (bind_process_group(dp_group), no engine)")
        self.optimizer, self.stage, self.group = optimizer, stage, group
        self.world, self.rank = C.group_size(group), C.group_rank(group)
        self.precision = precision or PrecisionPolicy()
        self.loss_scaler = loss_scaler or NoLossScaler()
        groups = ZeroOptimizer._trainable_groups(optimizer)
        params = [p for g in groups for p in g]
        if not params:
            raise ValueError("the optimizer holds no trainable parameter")
        param_dtype = self.precision.param_dtype or params[0].dtype
        master_dtype = self.precision.master_dtype_for(param_dtype)
        bucket_numel = max(1, int(bucket_mb * 2**20 / torch.empty((), dtype=param_dtype).element_size()))
        self.buckets = build_buckets(groups, bucket_numel, self.world)
        optimizer.bind_process_group(group)  # the user's object: hyperparameters only, no own step
        self.states = [OneBitBucket(b, optimizer, stage=stage, rank=self.rank, group=group, device=params[0].device,
                                    param_dtype=param_dtype, master_dtype=master_dtype) for b in self.buckets]
        self.masters: List[torch.Tensor] = [st.master for st in self.states]
        self._found_inf = False
        self._prepared = False
        if route_user_calls:
            route_user_calls_fn(optimizer, self)  # optimizer.step / zero_grad -> this engine

    # ------------------------------------------------------------------ gradient phase
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: nothing is communicated before ``step`` anyway."""
        yield

    def remove_hooks(self) -> None:
        """No hooks to remove: gradients are accumulated locally by autograd."""

    def reduce_gradients(self) -> bool:
        """Agree on overflow across ranks (loss scaling only); returns found_inf.

        Nothing is reduced here: the gradients travel inside ``step`` (full precision in the
        warm-up, as 1-bit momentum increments after it).
        """
        if self._prepared:
            return self._found_inf
        if not isinstance(self.loss_scaler, NoLossScaler):
            local_inf = torch.zeros((), dtype=torch.float32, device=self.masters[0].device)
            for st in self.states:
                for g in st.local_grads():
                    if g is not None:
                        local_inf = torch.maximum(local_inf, (~torch.isfinite(g)).any().float())
            C.all_reduce(local_inf, self.group, op=torch.distributed.ReduceOp.MAX, tag="overflow")
            self._found_inf = bool(local_inf.item() > 0)
        self._prepared = True
        return self._found_inf

    def mark_overflow(self) -> None:
        """Another axis (tp / pp peers) saw an overflow: skip this step and back off the loss scale."""
        self.reduce_gradients()
        self._found_inf = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise ConfigError(
            f"gradient_clip_val={max_norm} (norm): OneBitAdam with ZeRO stage {self.stage} cannot clip by the global "
            "gradient norm: after freeze_step the averaged gradient never exists (ranks exchange 1-bit momentum "
            "increments), and clipping each rank's local gradient is not clipping their mean. Set "
            "gradient_clip_val=None, or use zero.stage=0 (where clipping sees each rank's local gradient)")

    def clip_grad_value_(self, clip_value: float) -> None:
        raise ConfigError(
            f"gradient_clip_val={clip_value} (value): OneBitAdam with ZeRO stage {self.stage} cannot clip the averaged "
            "gradient (it never exists after freeze_step; only 1-bit momentum increments travel). Set "
            "gradient_clip_val=None, or use zero.stage=0")

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optimizer._opt_called = True  # what torch's lr-scheduler check reads: the optimizer did step
        found_inf = self.reduce_gradients()
        if found_inf:
            for st in self.states:
                st.zero_grad()
        else:
            self._step_buckets()
        self.loss_scaler.update(found_inf)
        self._prepared = False
        self._found_inf = False
        return loss

    def _step_buckets(self) -> None:
        inv_scale = 1.0 / self.loss_scaler.scale
        handles = []
        for st in self.states:  # bucket index order: the same collectives in the same order on every rank
            user_group = self.optimizer.param_groups[st.bucket.group_index]
            for key in _SYNCED_HPARAMS:  # lr schedulers change the user's groups
                setattr(st.helper, key, tuple(user_group[key]) if key == "betas" else user_group[key])
            flat = st.take_flat_grad()  # (padded,) local gradient, master dtype
            if inv_scale != 1.0:
                flat = flat * inv_scale
            st.helper.step(flat)
            del flat
            shard = st.param_buffer[st.shard]
            if not st.master_aliased:
                shard.copy_(st.master)
            handles.append(pairwise.all_gather(st.param_buffer, shard, self.group, async_op=True, tag="param"))
        for h in handles:
            h.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for st in self.states:
            st.zero_grad()
        self._prepared = False

    # ------------------------------------------------------------------ state
    def layout(self) -> Dict[str, Any]:
        return {"engine": "onebit", "stage": self.stage, "world_size": self.world, "rank": self.rank,
                "buckets": [(b.numel, b.padded_numel, str(b.dtype)) for b in self.buckets]}

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard states (m, v, step counters, worker error), masters and layout."""
        return {
            "shards": [st.helper.state_dict() for st in self.states],
            "masters": [None if st.master_aliased else st.master.detach().clone() for st in self.states],
            "loss_scaler": self.loss_scaler.state_dict(),
            "layout": self.layout(),
            "user_param_groups": [{k: v for k, v in g.items() if k not in ("params", "exp_avg_mask")}
                                  for g in self.optimizer.param_groups],
        }

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        mine, theirs = self.layout(), state.get("layout", {})
        strip = lambda d: {k: v for k, v in d.items() if k != "rank"}  # noqa: E731
        if strip(mine) != strip(theirs):
            raise ValueError(
                f"optimizer checkpoint layout (engine={theirs.get('engine')!r}, stage={theirs.get('stage')}, "
                f"world_size={theirs.get('world_size')}) does not match this run (OneBitAdam ZeRO stage "
                f"{self.stage}, world_size={self.world}); resume with the same stage and data-parallel size")
        for st, shard_state, saved in zip(self.states, state["shards"], state["masters"]):
            st.helper.load_state_dict(shard_state)
            if saved is not None and not st.master_aliased:
                st.master.copy_(saved)
                st.param_buffer[st.shard].copy_(st.master)
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        for user_group, saved in zip(self.optimizer.param_groups, state.get("user_param_groups", [])):
            user_group.update(saved)

    # The layout-free checkpoint: lightning_scale.checkpoint.onebit_pieces (error-feedback buffers per rank).
    def named_pieces(self, names, weights_from: Optional[str] = None):
        from lightning_scale.checkpoint.onebit_pieces import zero_pieces

        return zero_pieces(self, names, weights_from)

    def allocate_state_(self, states) -> None:
        """Nothing to allocate: the shard state (m, v, counters) exists from construction."""

    def after_load_(self, missing, names) -> None:
        from lightning_scale.checkpoint.onebit_pieces import zero_after_load

        zero_after_load(self, missing)

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds now. ``optimizer_state`` counts m, v and the worker error buffer
        (the latter from the first compression step on). Stage 2's transient buffers are not counted."""
        nbytes = lambda t: t.numel() * t.element_size() if torch.is_tensor(t) else 0  # noqa: E731
        params = sum(nbytes(st.param_buffer) for st in self.states)
        grads = sum(nbytes(st.grad_buffer) for st in self.states)
        masters = sum(nbytes(st.master) for st in self.states if not st.master_aliased)
        state = sum(nbytes(v) for st in self.states for k, v in st.helper.state.items()
                    if k in ("exp_avg", "exp_avg_sq", "worker_error"))
        return {"params": params, "grads": grads, "master": masters, "optimizer_state": state,
                "total": params + grads + masters + state}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def compressing(self) -> bool:
        """True once the next step exchanges 1-bit momentum increments (after freeze_step steps)."""
        return self.world > 1 and self.states[0].helper.state["step"] >= self.optimizer.freeze_step
