"""ZeroOptimizer: ZeRO stages 0, 1 and 2 around any element-wise torch optimizer.

One step reads as four parts (the fairscale OSS shape):

1. reduce gradients (bucketed, mostly already done during backward by :class:`GradientReducer`);
2. unscale, check overflow (agreed by all ranks), clip by the global norm across shards;
3. step the local shard: an optimizer of the user's class runs over this rank's master shards
   (fp32 under mixed precision), so its state is 1/N of the model;
4. write the updated shard back into the low-precision parameters and all-gather them.

The user's optimizer object stays the one Lightning and lr schedulers see: its ``param_groups``
still hold the model's parameters and their hyperparameters (lr, weight decay...), which are copied
to the inner optimizer before each step. Its ``step`` and ``zero_grad`` are routed here.
Optimizers that are not element-wise over a flat shard (LAMB, Adafactor, Shampoo) need stage 0.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.zero.flat_buffer import build_buckets
from lightning_scale.zero.precision import NoLossScaler, PrecisionPolicy
from lightning_scale.zero.reducer import GradientReducer


# Group keys that choose a kernel rather than a hyperparameter: the inner optimizer keeps its own
# (offload picks the fastest CPU implementation).
_IMPLEMENTATION_KEYS = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})


class ZeroOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer, *, stage: int = 2, group=None,
                 precision: Optional[PrecisionPolicy] = None, loss_scaler=None, bucket_mb: float = 25.0,
                 overlap_comm: bool = True, route_user_calls: bool = True, offload_optimizer: bool = False,
                 pin_memory: bool = True) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"zero.stage={stage}: ZeroOptimizer handles stages 0, 1 and 2")
        self.optimizer = optimizer
        self.stage = stage
        self.group = group
        self.world = C.group_size(group)
        self.rank = C.group_rank(group)
        self.precision = precision or PrecisionPolicy()
        self.loss_scaler = loss_scaler or NoLossScaler()
        groups = self._trainable_groups(optimizer)
        params = [p for g in groups for p in g]
        if not params:
            raise ValueError("the optimizer holds no trainable parameter")
        device = params[0].device
        param_dtype = self.precision.param_dtype or params[0].dtype
        master_dtype = self.precision.master_dtype_for(param_dtype)
        bucket_numel = max(1, int(bucket_mb * 2**20 / torch.empty((), dtype=param_dtype).element_size()))
        shard_world = self.world if stage >= 1 else 1
        self.buckets = build_buckets(groups, bucket_numel, shard_world)
        if offload_optimizer and stage == 0:
            raise ValueError("offload.optimizer='cpu' needs zero.stage >= 1")
        self.offload_optimizer = offload_optimizer
        master_device = torch.device("cpu") if offload_optimizer else device
        self.reducer = GradientReducer(self.buckets, stage, group, device, overlap_comm=overlap_comm,
                                       param_dtype=param_dtype, master_dtype=master_dtype,
                                       master_device=master_device, pin_memory=pin_memory,
                                       stream_grads=offload_optimizer)
        self.masters: List[torch.Tensor] = [st.master for st in self.reducer.states]
        self._aliased: List[bool] = [st.master_aliased for st in self.reducer.states]
        inner_groups = [dict(g, params=[]) for g in optimizer.param_groups]
        for st in self.reducer.states:
            inner_groups[st.bucket.group_index]["params"].append(st.master)
        self.inner = self._make_inner(optimizer, inner_groups, offload=offload_optimizer)
        self._found_inf = False
        self._prepared = False
        if route_user_calls:
            self._route(optimizer)

    def _route(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` / ``zero_grad()`` now act on the shards (lr schedulers keep working)."""

        def step(closure: Optional[Callable[[], Any]] = None) -> Any:
            optimizer._opt_called = True  # what torch's lr-scheduler step wrapper records
            return self.step(closure)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  (no "step overridden" warning)
        optimizer.step = step  # type: ignore[method-assign]
        optimizer.zero_grad = self.zero_grad  # type: ignore[method-assign]

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
        if offload:  # the step runs on the CPU: the fastest measured CPU implementation of the user's class
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

    def reduce_gradients(self) -> bool:
        """Finish gradient reduction and prepare unscaled master gradients; returns found_inf."""
        if self._prepared:
            return self._found_inf
        self.reducer.reduce()
        inv_scale = 1.0 / self.loss_scaler.scale
        local_inf = torch.zeros((), dtype=torch.float32, device=self.masters[0].device)
        for st, master, aliased in zip(self.reducer.states, self.masters, self._aliased):
            grad = st.reduced_grad()
            master.grad = grad if aliased else grad.to(device=master.device, dtype=master.dtype)
            if inv_scale != 1.0:
                master.grad.mul_(inv_scale)
            if isinstance(self.loss_scaler, NoLossScaler):
                continue
            local_inf = torch.maximum(local_inf, (~torch.isfinite(master.grad)).any().float())
        if not isinstance(self.loss_scaler, NoLossScaler):
            C.all_reduce(local_inf, self.group, op=torch.distributed.ReduceOp.MAX, tag="overflow")
            self._found_inf = bool(local_inf.item() > 0)
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
        total = torch.zeros((), dtype=torch.float64, device=self.masters[0].device)
        for m in self.masters:
            total += m.grad.double().pow(2).sum()
        return total

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the full (reduced, unscaled) gradient across all shards."""
        self.reduce_gradients()
        sq = self._local_sq_norm()
        if self.stage >= 1:
            C.all_reduce(sq, self.group, tag="grad_norm")
        return sq.sqrt()

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
        found_inf = self.reduce_gradients()
        if not found_inf:
            self._sync_hyperparameters()
            self.inner.step()
            self._write_back_and_gather()
        self.loss_scaler.update(found_inf)
        self._end_cycle()
        return loss

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

    def _write_back_and_gather(self) -> None:
        handles = []
        for st, master, aliased in zip(self.reducer.states, self.masters, self._aliased):
            shard = st.param_buffer[st.shard]
            if not aliased:
                shard.copy_(master, non_blocking=master.is_pinned())
            if self.stage >= 1:
                handles.append(C.all_gather(st.param_buffer, shard.clone(), self.group, async_op=True,
                                            tag="param"))
        for h in handles:
            h.wait()

    def _end_cycle(self) -> None:
        for m, aliased in zip(self.masters, self._aliased):
            m.grad = None  # a converted copy is freed; an alias is only unlinked
        self._prepared = False
        self._found_inf = False
        self.reducer.new_cycle()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.zero_grad()
        for m in self.masters:
            m.grad = None
        self._prepared = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "masters": [None if a else m.detach().clone() for m, a in zip(self.masters, self._aliased)],
            "loss_scaler": self.loss_scaler.state_dict(),
            "layout": self.layout(),
            "user_param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
        }

    def layout(self) -> Dict[str, Any]:
        return {"stage": self.stage, "world_size": self.world, "rank": self.rank,
                "buckets": [(b.numel, b.padded_numel, str(b.dtype)) for b in self.buckets]}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        mine, theirs = self.layout(), state["layout"]
        if {k: v for k, v in mine.items() if k != "rank"} != {k: v for k, v in theirs.items() if k != "rank"}:
            raise ValueError(
                f"optimizer checkpoint layout {theirs['stage']=}, {theirs['world_size']=} does not match this run "
                f"(stage={self.stage}, world_size={self.world}); resume with the same stage and data-parallel size"
            )
        self.inner.load_state_dict(state["inner"])
        for master, saved, st, aliased in zip(self.masters, state["masters"], self.reducer.states, self._aliased):
            if saved is not None and not aliased:
                master.copy_(saved)
                st.write_master(master)
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        for user_group, saved in zip(self.optimizer.param_groups, state.get("user_param_groups", [])):
            user_group.update(saved)

    # ------------------------------------------------------------------ accounting
    def _optimizer_state_bytes(self) -> int:
        """Bytes of the inner optimizer's per-parameter state tensors (scalars such as ``step`` excluded)."""
        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)

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

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def warn_if_not_elementwise(optimizer: torch.optim.Optimizer, stage: int) -> None:
    name = type(optimizer).__name__
    if stage >= 1 and name.lower() in {"lamb", "lars", "adafactor", "shampoo", "lbfgs"}:
        warnings.warn(f"{name} is not element-wise over flat shards; use zero.stage=0 for exact results")
