"""ZeroOptimizer: ZeRO stages 0, 1 and 2 around any element-wise torch optimizer.

One step reads as four parts (the fairscale OSS shape):

1. reduce gradients (bucketed, mostly already done during backward by :class:`GradientReducer`);
2. unscale, check overflow (agreed by all ranks), clip by the global norm across shards;
3. step the local shard: an optimizer of the user's class runs over this rank's master shards
   (fp32 under mixed precision), so its state is 1/N of the model;
4. write the updated shard back into the low-precision parameters and all-gather them (stages 1-2: in the
   background, bucket by bucket; a parameter's first read waits for its bucket, :mod:`.param_gather`).

The user's optimizer object stays the one Lightning and lr schedulers see: its ``param_groups``
still hold the model's parameters and their hyperparameters (lr, weight decay...), which are copied
to the inner optimizer before each step. Its ``step`` and ``zero_grad`` are routed here.
Optimizers that are not element-wise over a flat shard (LAMB, Adafactor, Shampoo) need stage 0.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.comm import pairwise
from lightning_scale.config import ConfigError
from lightning_scale.zero.flat_buffer import build_buckets
from lightning_scale.zero.precision import NoLossScaler, PrecisionPolicy
from lightning_scale.zero.model_parallel import NO_CROSS_AXIS, CrossAxis
from lightning_scale.zero.param_gather import ParamGathers
from lightning_scale.zero.reducer import GradientReducer


# Group keys that choose a kernel rather than a hyperparameter: the inner optimizer keeps its own
# (offload picks the fastest CPU implementation).
_IMPLEMENTATION_KEYS = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})
# The first bucket in backward order is capped at DDP's 1 MiB (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES):
# its reduction starts with the first gradients instead of after a whole bucket's worth of backward.
_FIRST_BUCKET_MB = 1.0


def route_user_calls_fn(optimizer: torch.optim.Optimizer, engine: Any) -> None:
    """``optimizer.step()`` / ``zero_grad()`` now act on the engine's shards (lr schedulers keep working)."""

    def step(closure: Optional[Callable[[], Any]] = None) -> Any:
        optimizer._opt_called = True  # what torch's lr-scheduler step wrapper records
        return engine.step(closure)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  (no "step overridden" warning)
    optimizer.step = step  # type: ignore[method-assign]
    optimizer.zero_grad = engine.zero_grad  # type: ignore[method-assign]
    # Wrappers that imitate the optimizer's *class* (Fabric's _FabricOptimizer, Lightning's LightningOptimizer)
    # find zero_grad on the class, not on the instance: route it there too, or ZeRO-3's gradient shards would
    # never be zeroed and every step would add the previous steps' gradients.
    optimizer._zero_engine = engine
    if not getattr(type(optimizer), "_routes_zero_grad", False):
        optimizer.__class__ = _routed_class(type(optimizer))


_ROUTED: Dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """A subclass of the user's optimizer class whose ``zero_grad`` is its engine's (isinstance checks hold)."""
    if cls not in _ROUTED:
        def zero_grad(self, set_to_none: bool = True) -> None:
            self._zero_engine.zero_grad(set_to_none)

        _ROUTED[cls] = type(cls.__name__, (cls,), {"zero_grad": zero_grad, "_routes_zero_grad": True,
                                                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _ROUTED[cls]


class ShardEngine:
    """The step every element-wise ZeRO engine shares (stages 0-3, offload), over bucket states it is given.

    Subclasses lay the parameters out (``ZeroOptimizer``: flat buckets + :class:`GradientReducer`;
    ``Stage3Optimizer``: the unit shards of a ``ShardedParameters``), then call this ``__init__`` with the
    reducer, the fp32 masters and the inner optimizer. ``cross_axis`` (:class:`~.model_parallel.CrossAxis`)
    is what the tp and pp axes agree on: the norm mask, the overflow vote, partial gradients.
    """

    _reducer_sums_partials = False  # True: the reducer sums partial gradients itself (no before_reduce at the step)

    def __init__(self, optimizer: torch.optim.Optimizer, *, stage: int, group, reducer, masters: List[torch.Tensor],
                 aliased: List[bool], inner: torch.optim.Optimizer, precision: Optional[PrecisionPolicy] = None,
                 loss_scaler=None, offload_optimizer: bool = False, cross_axis: Optional[CrossAxis] = None,
                 route_user_calls: bool = True) -> None:
        self.optimizer = optimizer
        self.stage = stage
        self.group = group
        self.world = C.group_size(group)
        self.rank = C.group_rank(group)
        self.precision = precision or PrecisionPolicy()
        self.loss_scaler = loss_scaler or NoLossScaler()
        self.offload_optimizer = offload_optimizer
        self.reducer = reducer
        self.masters, self._aliased = masters, aliased
        self.inner = inner
        self.cross = cross_axis or NO_CROSS_AXIS
        self._norm_masks, self._partial = self.cross.masks(self.reducer.states, self.masters, stage)
        self._found_inf = False
        self._prepared = False
        self._keep_grads_once = False
        if route_user_calls:
            route_user_calls_fn(optimizer, self)

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _trainable_groups(optimizer: torch.optim.Optimizer) -> List[List[torch.nn.Parameter]]:
        seen: Dict[int, int] = {}
        groups = []
        for gi, g in enumerate(optimizer.param_groups):
            kept = []
            for p in g["params"]:
                if id(p) in seen:
                    raise ValueError(f"a parameter appears in param groups {seen[id(p)]} and {gi} of the optimizer")
                seen[id(p)] = gi
                if p.requires_grad:
                    if p.is_sparse:
                        raise ValueError("ZeRO does not support sparse parameters")
                    kept.append(p)
            groups.append(kept)
        return groups

    @staticmethod
    def _make_inner(optimizer: torch.optim.Optimizer, groups: List[Dict[str, Any]],
                    offload: bool = False) -> torch.optim.Optimizer:
        groups = [g for g in groups if g["params"]] or groups
        on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
        # The step runs on the CPU (offload, or masters on a CPU device): the fastest measured CPU implementation
        # of the user's class (torch's fused AdamW: ~10x the for-loop; tp=2 HF Llama step 1.42x, helper B 96bf139)
        if offload or on_cpu:
            from lightning_scale.optim.cpu_adam import make_offload_optimizer

            return make_offload_optimizer(type(optimizer), groups, optimizer.defaults)
        # Some defaults are derived, not constructor arguments (AdamW's decoupled_weight_decay): pass only
        # what __init__ accepts; each group dict carries every hyperparameter anyway.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            inner = type(optimizer)(groups, **kwargs)
        except TypeError as err:
            raise TypeError(
                f"ZeRO re-creates {type(optimizer).__name__} over the parameter shards with "
                f"{type(optimizer).__name__}(param_groups, **defaults), which failed: {err}"
            ) from err
        return inner

    def reduce_gradients(self) -> bool:
        """Finish gradient reduction and prepare unscaled master gradients; returns found_inf."""
        if self._prepared:
            return self._found_inf
        if self.stage < 3 and self.cross.before_reduce is not None and not self._reducer_sums_partials:
            self.cross.before_reduce()  # sequence parallel / ep: partial sums over tp, before the buckets read them
        self.reducer.reduce()
        inv_scale = self.cross.grad_scale / self.loss_scaler.scale  # 1 / ep: each ep rank's own batch's mean
        local_inf = torch.zeros((), dtype=torch.float32, device=self.masters[0].device)
        for st, master, aliased in zip(self.reducer.states, self.masters, self._aliased):
            grad = st.reduced_grad()
            master.grad = grad if aliased else grad.to(device=master.device, dtype=master.dtype)
            if inv_scale != 1.0:
                master.grad.mul_(inv_scale)
            if isinstance(self.loss_scaler, NoLossScaler):
                continue
            local_inf = torch.maximum(local_inf, (~torch.isfinite(master.grad)).any().float())
        if self.stage == 3:
            self.cross.sum_partial(self.masters, self._partial)  # after the dp reduce-scatter (both are sums)
        if not isinstance(self.loss_scaler, NoLossScaler):
            C.all_reduce(local_inf, self.group, op=torch.distributed.ReduceOp.MAX, tag="overflow")
            self._found_inf = self.cross.agree_overflow(bool(local_inf.item() > 0), local_inf.device)
        self._prepared = True
        return self._found_inf

    def mark_overflow(self) -> None:
        """Another axis (tp / pp peers) saw an overflow: skip this step and back off the loss scale."""
        self.reduce_gradients()
        self._found_inf = True

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's reduced master gradients (float64), before any all-reduce."""
        self.reduce_gradients()
        return self._local_sq_norm()

    def _local_sq_norm(self) -> torch.Tensor:
        return self.cross.local_sq_norm(self.masters, self._norm_masks)

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's reduced, unscaled gradient: over the shards (dp), tp and pp (float64)."""
        self.reduce_gradients()
        return self.cross.all_reduce_sq(self._local_sq_norm(), self.group, self.stage).sqrt()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm, exactly like ``torch.nn.utils.clip_grad_norm_`` on the full gradient."""
        if float(norm_type) != 2.0:
            raise ValueError(f"gradient_clip norm_type={norm_type}: ZeRO clips by the L2 norm only")
        total = self.global_grad_norm()
        if self._found_inf:
            return total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for m in self.masters:
            m.grad.mul_(coef.to(m.grad.dtype))
        return total

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clip each reduced gradient element (element-wise, so exact on shards)."""
        self.reduce_gradients()
        for m in self.masters:
            m.grad.clamp_(-clip_value, clip_value)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The user's optimizer (the one its LR scheduler holds) did step, also when the Trainer calls the engine
        # directly: what torch's scheduler check reads (no "lr_scheduler.step() before optimizer.step()").
        self.optimizer._opt_called = True
        found_inf = self.reduce_gradients()
        if not found_inf:
            self._sync_hyperparameters()
            self.wait_params()  # the last step's gathers write the buffers the (aliased) masters view
            self.inner.step()
            self._gather_after_step()
        self.loss_scaler.update(found_inf)
        self._end_cycle()
        return loss

    def _gather_after_step(self) -> None:
        self._write_back_and_gather()

    def wait_params(self) -> None:
        """Block until every parameter holds the last step's values (stages 1-2 gather them in the background;
        any torch op on a parameter waits for its own bucket by itself, see :mod:`.param_gather`)."""

    def _sync_hyperparameters(self) -> None:
        """Copy lr, weight decay... from the user-visible groups (lr schedulers change those)."""
        inner_groups = iter(self.inner.param_groups)
        for user_group in self.optimizer.param_groups:
            if not any(p.requires_grad for p in user_group["params"]):
                continue
            ig = next(inner_groups)
            for key, value in user_group.items():
                if key not in _IMPLEMENTATION_KEYS:
                    ig[key] = value

    def _end_cycle(self) -> None:
        for m, aliased in zip(self.masters, self._aliased):
            m.grad = None  # a converted copy is freed; an alias is only unlinked
        self._prepared = False
        self._found_inf = False
        self.reducer.new_cycle()

    def keep_gradients_once(self) -> None:
        """Ignore the next ``zero_grad()``. Lightning's closure zeroes gradients *after* ``training_step`` and
        before ``backward``; a pipeline schedule computes them inside ``training_step``, so the strategy zeroes
        them before the schedule and has that one call skipped."""
        self._keep_grads_once = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._keep_grads_once:
            self._keep_grads_once = False
            return
        self.reducer.zero_grad()
        for m in self.masters:
            m.grad = None
        self._prepared = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        self.wait_params()
        return {
            "inner": self.inner.state_dict(),
            "masters": [None if a else m.detach().clone() for m, a in zip(self.masters, self._aliased)],
            "loss_scaler": self.loss_scaler.state_dict(),
            "layout": self.layout(),
            "user_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.wait_params()  # an in-flight gather would overwrite the loaded weights
        mine, theirs = self.layout(), state["layout"]
        if {k: v for k, v in mine.items() if k != "rank"} != {k: v for k, v in theirs.items() if k != "rank"}:
            raise ValueError(f"optimizer checkpoint layout does not match this run: {_layout_difference(theirs, mine)}")
        self.inner.load_state_dict(state["inner"])
        for master, saved, st, aliased in zip(self.masters, state["masters"], self.reducer.states, self._aliased):
            if saved is not None and not aliased:
                master.copy_(saved)
                st.write_master(master)
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        for user_group, saved in zip(self.optimizer.param_groups, state.get("user_param_groups", [])):
            user_group.update(saved)

    # ------------------------------------------------------------------ layout-free checkpoint (docs/checkpoints.md)
    def named_pieces(self, names: Mapping[int, str], weights_from: Optional[str] = None) -> Iterator[Any]:
        """This rank's shards as layout-free pieces (``model/``, ``master/``, ``optim/`` keys; views into the live
        storage), keyed by ``names`` (id(param) -> fqn). ``weights_from`` ("master" | "model"): the load set, the
        weights read into the masters from that key (:mod:`lightning_scale.checkpoint.engine_pieces`)."""
        from lightning_scale.checkpoint.engine_pieces import engine_pieces

        self.wait_params()  # the pieces are views of the parameter buffers
        return engine_pieces(self, names, weights_from)

    def allocate_state_(self, states: Mapping[str, Any]) -> None:
        """Before a load: create the lazily allocated optimizer state the checkpoint holds (name -> (dtype, 0-d))."""
        from lightning_scale.checkpoint.engine_pieces import allocate_state_

        self.wait_params()
        allocate_state_(self, states)

    def after_load_(self, missing: Sequence[str], names: Mapping[int, str]) -> None:
        """After a load into ``named_pieces(weights_from=...)``: masters -> parameters (as a step writes them)."""
        from lightning_scale.checkpoint.engine_pieces import after_load_

        self.wait_params()
        after_load_(self, missing, names)

    # ------------------------------------------------------------------ accounting
    def remove_hooks(self) -> None:
        self.wait_params()
        self.reducer.remove_hooks()

    def _optimizer_state_bytes(self) -> int:
        """Bytes of the inner optimizer's per-parameter state tensors (scalars such as ``step`` excluded)."""
        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)

    @property
    def param_groups(self):
        return self.optimizer.param_groups



class ZeroOptimizer(ShardEngine):
    """ZeRO stages 0, 1 and 2: the parameters in flat buckets, gradients reduced by a GradientReducer."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, stage: int = 2, group=None,
                 precision: Optional[PrecisionPolicy] = None, loss_scaler=None, bucket_mb: float = 25.0,
                 overlap_comm: bool = True, route_user_calls: bool = True, offload_optimizer: bool = False,
                 pin_memory: bool = True, cross_axis: Optional[CrossAxis] = None,
                 overlap_param_gather: bool = True) -> None:
        """``overlap_param_gather`` (stages 1-2): leave the post-step all-gathers in flight, each parameter's first
        read waiting for its bucket (:mod:`.param_gather`); False waits for all of them inside ``step()``."""
        if stage not in (0, 1, 2):
            raise ValueError(f"zero.stage={stage}: ZeroOptimizer handles stages 0, 1 and 2")
        precision = precision or PrecisionPolicy()
        groups = self._trainable_groups(optimizer)
        params = [p for g in groups for p in g]
        if not params:
            raise ValueError("the optimizer holds no trainable parameter")
        device = params[0].device
        param_dtype = precision.param_dtype or params[0].dtype
        master_dtype = precision.master_dtype_for(param_dtype)
        element = torch.empty((), dtype=param_dtype).element_size()
        bucket_numel = max(1, int(bucket_mb * 2**20 / element))
        shard_world = C.group_size(group) if stage >= 1 else 1
        self.buckets = build_buckets(groups, bucket_numel, shard_world,
                                     first_bucket_numel=min(bucket_numel, int(_FIRST_BUCKET_MB * 2**20 / element)))
        if offload_optimizer and stage == 0:
            raise ValueError("offload.optimizer='cpu' needs zero.stage >= 1")
        master_device = torch.device("cpu") if offload_optimizer else device
        # partial gradients (sequence parallel's norms, every whole parameter under ep): summed over the tp axis by the
        # reducer, bucket by bucket, on the tp group's twin (overlapped with the backward); without a twin (a group
        # set built by hand) the engine sums them at the step (cross_axis.before_reduce) and cannot overlap
        twin = cross_axis.grad_group if cross_axis is not None else None
        reducer = GradientReducer(self.buckets, stage, group, device, overlap_comm=overlap_comm,
                                       param_dtype=param_dtype, master_dtype=master_dtype,
                                       master_device=master_device, pin_memory=pin_memory,
                                       stream_grads=offload_optimizer,
                                       partial=cross_axis.partial if twin is not None else None, partial_group=twin)
        self._reducer_sums_partials = reducer.partial_group is not None
        partial = [p for b in self.buckets for p in (slot.param for slot in b.slots)
                   if cross_axis is not None and cross_axis.before_reduce is not None and cross_axis.partial(p)]
        if overlap_comm and partial and not self._reducer_sums_partials:
            reducer.remove_hooks()
            raise ConfigError(
                "zero.overlap_comm=True with tensor.sequence_parallel=True or ep > 1: the engine would reduce "
                f"{len(partial)} partial gradients (of whole parameters) before they are summed over the tp axis; "
                "build the engine with overlap_comm=False")
        inner_groups = [dict(g, params=[]) for g in optimizer.param_groups]
        for st in reducer.states:
            inner_groups[st.bucket.group_index]["params"].append(st.master)
        super().__init__(
            optimizer, stage=stage, group=group, reducer=reducer, masters=[st.master for st in reducer.states],
            aliased=[st.master_aliased for st in reducer.states],
            inner=self._make_inner(optimizer, inner_groups, offload=offload_optimizer), precision=precision,
            loss_scaler=loss_scaler, offload_optimizer=offload_optimizer, cross_axis=cross_axis,
            route_user_calls=route_user_calls)
        self.overlap_param_gather = overlap_param_gather
        self.gathers = ParamGathers([b.params for b in self.buckets])

    # ------------------------------------------------------------------ gradient phase
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication (non-final micro-batches)."""
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    def wait_params(self) -> None:
        self.gathers.wait_all()

    def _gather_after_step(self) -> None:
        self._write_back_and_gather(wait=not self.overlap_param_gather)

    def _write_back_and_gather(self, wait: bool = True) -> None:
        """Updated master shards -> the parameter buffers, then (stages 1-2) one in-place all-gather per bucket,
        in forward order (the buckets are in backward order). ``wait=False``: leave them in flight."""
        self.wait_params()
        for bi in reversed(range(len(self.reducer.states))):
            st, master, aliased = self.reducer.states[bi], self.masters[bi], self._aliased[bi]
            shard = st.param_buffer[st.shard]
            if not aliased:
                shard.copy_(master, non_blocking=master.is_pinned())
            if self.stage >= 1 and self.world > 1:  # one rank: the shard is the buffer, nothing to gather
                handle = pairwise.all_gather(st.param_buffer, shard, self.group, async_op=True, tag="param")
                self.gathers.launch(bi, handle, background=not wait)
        self.gathers.settle(background=not wait)

    def layout(self) -> Dict[str, Any]:
        return {"stage": self.stage, "world_size": self.world, "rank": self.rank,
                "buckets": [(b.numel, b.padded_numel, str(b.dtype)) for b in self.buckets]}

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds now: params, grads, fp32 master copies and optimizer state."""
        params = sum(st.param_buffer.numel() * st.param_buffer.element_size() for st in self.reducer.states)
        grads = 0
        for st in self.reducer.states:
            for t in (st.grad_buffer, st.shard_grad, st.staging):
                if t is not None:
                    grads += t.numel() * t.element_size()
        masters = sum(m.numel() * m.element_size() for m, a in zip(self.masters, self._aliased) if not a)
        state = self._optimizer_state_bytes()
        host_grads = sum(st.host_grad.numel() * st.host_grad.element_size() for st in self.reducer.states
                         if getattr(st, "host_grad", None) is not None)
        grads += host_grads
        host = masters + state + host_grads if self.offload_optimizer else 0
        total = params + grads + masters + state
        return {"params": params, "grads": grads, "master": masters, "optimizer_state": state,
                "total": total, "device": total - host, "host": host}


def warn_if_not_elementwise(optimizer: torch.optim.Optimizer, stage: int) -> None:
    name = type(optimizer).__name__
    if stage >= 1 and name.lower() in {"lamb", "lars", "adafactor", "shampoo", "lbfgs"}:
        warnings.warn(f"{name} is not element-wise over flat shards; use zero.stage=0 for exact results")


def _layout_difference(saved: Dict[str, Any], mine: Dict[str, Any]) -> str:
    """A ZeRO 1 / 2 optimizer checkpoint's layout against this run's, in words, with the setting to change."""
    if saved.get("stage") != mine["stage"] or saved.get("world_size") != mine["world_size"]:
        return (f"written at stage={saved.get('stage')} over {saved.get('world_size')} data-parallel ranks, this run "
                f"is stage={mine['stage']} over {mine['world_size']}; resume with the same stage and data-parallel size")

    def show(buckets):
        sizes = [b[0] for b in buckets]
        dtypes = sorted({b[2] for b in buckets})
        return (f"{len(sizes)} bucket{'s' if len(sizes) != 1 else ''} of {sizes[:6]}"
                f"{' ...' if len(sizes) > 6 else ''} elements ({', '.join(dtypes)})")

    return (f"its flat buffers are {show(saved.get('buckets', []))}, this run's {show(mine['buckets'])}: resume with "
            "the same zero.bucket_mb, model and parameter groups (or save with checkpoint_format='universal', which "
            "resumes on any layout)")
