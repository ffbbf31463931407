"""ZeRO stage 3, optimizer side: the ZeroOptimizer step over the unit shards of a ShardedParameters.

The module side (units, gathers, hooks, gradient reduce-scatters) is in ``param_shard.py``; this file only
adapts it to the interface :class:`~lightning_scale.zero.optimizer.ShardEngine` drives (a reducer with bucket
states), creates the fp32 masters (on the host under optimizer offload) and writes the updated shards back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence

import torch

from lightning_scale.zero.model_parallel import CrossAxis
from lightning_scale.zero.optimizer import ShardEngine
from lightning_scale.zero.param_shard import ShardedBucket, ShardedParameters
from lightning_scale.zero.precision import PrecisionPolicy


class _Stage3Reducer:
    """The reducer interface ZeroOptimizer drives, backed by the module-level ShardedParameters."""

    def __init__(self, sharded: ShardedParameters, states: List[ShardedBucket], group_ids: Sequence[int]) -> None:
        self.sharded, self.states, self.group_ids = sharded, states, list(group_ids)
        self.sync_enabled = True

    def reduce(self) -> None:
        self.sharded.flush()

    def new_cycle(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.sharded.zero_grad(self.group_ids)

    def remove_hooks(self) -> None:
        pass  # the ShardedParameters owns the hooks


class Stage3Optimizer(ShardEngine):
    """ZeRO stage 3 around the user's optimizer: the same step as stages 1/2 over the unit buckets' shards.

    ``group_offset``: where this optimizer's param groups start in the group list the ShardedParameters was
    built from (several optimizers share one sharded model). ``offload_optimizer``: fp32 masters and the
    optimizer state live on the host and the step runs there (the fastest CPU kernel for Adam/AdamW).
    ``cross_axis``: the tp / pp agreement (norm mask, overflow vote, sequence parallel's partial sums).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, sharded: ShardedParameters, *, group_offset: int = 0,
                 precision=None, loss_scaler=None, offload_optimizer: bool = False, pin_memory: bool = True,
                 route_user_calls: bool = True, cross_axis: Optional[CrossAxis] = None) -> None:
        precision = precision or PrecisionPolicy()
        self.sharded = sharded
        ids = list(range(group_offset, group_offset + len(optimizer.param_groups)))
        self._group_ids = ids
        states = [b for b in sharded.buckets() if b.group_id in ids]
        if not states:
            raise ValueError("the optimizer holds no trainable parameter")
        # Parameter offload alone keeps the master (and the step) on the compute device; optimizer offload moves both.
        master_device = torch.device("cpu") if offload_optimizer else sharded.device
        for b in states:
            master_dtype = precision.master_dtype_for(b.shard.dtype)
            aliased = b.shard.dtype == master_dtype and b.shard.device == master_device
            if aliased:
                b.master = b.shard
            else:
                src = b.init_master if b.init_master is not None else b.shard
                b.master = src.to(device=master_device, dtype=master_dtype).clone()
                if pin_memory and master_device.type == "cpu" and sharded.device.type == "cuda":
                    b.master = b.master.pin_memory()
            b.master_aliased = aliased
            b.init_master = None
            if offload_optimizer:  # gradient shards are streamed to the host in the master dtype
                b.grad_device, b.grad_dtype = master_device, master_dtype
        self.buckets = [b.bucket for b in states]
        inner_groups = [dict(g, params=[]) for g in optimizer.param_groups]
        for b in states:
            inner_groups[b.group_id - group_offset]["params"].append(b.master)
        super().__init__(
            optimizer, stage=3, group=sharded.group, reducer=_Stage3Reducer(sharded, states, ids),
            masters=[b.master for b in states], aliased=[b.master_aliased for b in states],
            inner=self._make_inner(optimizer, inner_groups, offload=offload_optimizer), precision=precision,
            loss_scaler=loss_scaler, offload_optimizer=offload_optimizer, cross_axis=cross_axis,
            route_user_calls=route_user_calls)

    def no_sync(self):
        """Stage 3 reduce-scatters every micro-batch into the gradient shard: nothing to skip."""
        return contextlib.nullcontext()

    def _write_back_and_gather(self) -> None:
        for st, master, aliased in zip(self.reducer.states, self.masters, self._aliased):
            if not aliased:
                st.write_master(master)
        self.sharded.after_step(self._group_ids)

    def layout(self) -> Dict[str, Any]:
        return {"stage": 3, "world_size": self.world, "rank": self.rank,
                "buckets": [(b.numel, b.padded_numel, str(b.dtype)) for b in self.buckets]}

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds for this optimizer's buckets, and which side (device / host) holds them."""
        params = sum(st.shard.numel() * st.shard.element_size() for st in self.reducer.states)
        grads = sum(st.grad_shard.numel() * st.grad_shard.element_size() for st in self.reducer.states
                    if st.grad_shard is not None)
        masters = sum(m.numel() * m.element_size() for m, a in zip(self.masters, self._aliased) if not a)
        state = self._optimizer_state_bytes()
        host = (masters + state if self.offload_optimizer else 0)
        host += sum(st.grad_shard.numel() * st.grad_shard.element_size() for st in self.reducer.states
                    if st.grad_shard is not None and st.grad_device is not None)  # streamed to the host
        if self.sharded.params_offloaded:
            host += params
        total = params + grads + masters + state
        return {"params": params, "grads": grads, "master": masters, "optimizer_state": state, "total": total,
                "device": total - host, "host": host}
