"""ZeRO stage 3: parameters live as 1/N shards in per-unit flat buffers and are gathered just in time.

A *unit* is a module (by default each repeated block, e.g. a transformer block; or the modules the user
names by class or by name pattern). Each unit's trainable parameters are flattened per (optimizer param
group, dtype) into :class:`~lightning_scale.zero.flat_buffer.Bucket` s with the same per-bucket shard
layout as stages 1/2: rank r owns slice r. Parameters outside every unit form the *root unit*; small
parameters (``numel < persistent_threshold``) and parameters the LightningModule owns directly form the
*persistent unit*, which stays gathered (they are still sharded for gradients and the optimizer).

Life of a unit in one training step::

    forward pre-hook   all-gather its buckets (or wait for the prefetch), prefetch the next units
    forward hook       free the gathered buffers (not the forward's last unit: its backward is next);
                       hook the outputs so backward can re-gather
    output grad hook   all-gather again before the unit's backward (not a plain nn.Embedding unit: its
                       backward reads the indices only); prefetch the previous units
    grads accumulated  copy the gradients into a staging buffer, reduce-scatter it into the
                       persistent gradient shard, free the gradients and the gathered buffers
    end of backward    units that got no gradient (skipped branches) reduce zeros, in unit order,
                       so every rank issues the same collectives; all reductions are waited for

A gathered buffer is freed by resizing its storage to zero bytes; the parameters stay views into it
(same tensor objects, same shapes), so autograd's saved tensors see the re-gathered values and the
optimizer keeps the parameters the user gave it. Gradient accumulation reduce-scatters every
micro-batch into the shard (the full gradient never outlives one unit's backward).

Deferred initialization (:mod:`.shard_init`): when the model was built on the ``meta`` device
(``configure_model`` under the strategy), each unit is materialized on the device, initialized and cut to
its shard one unit at a time, so no rank ever holds the whole model. Initialization calls, per module, the nearest ancestor's
``init_module(name, module)`` when a model defines one (the project's GPT does: its values depend only
on a seed and the module name, so they equal a single-process init), else the module's own
``reset_parameters()``. A model built for real is sharded unit by unit from rank 0's values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from lightning_scale.comm import collectives as C
from lightning_scale.comm import pairwise
from lightning_scale.config import ConfigError
from lightning_scale.zero import param_guard, shard_init, shard_state
from lightning_scale.zero.flat_buffer import Bucket, build_buckets
from lightning_scale.zero.units import resolve_units  # noqa: F401  (re-exported: its home before)

_HUGE = 1 << 62
_MAX_INFLIGHT = 1  # gradient reduce-scatters (and their staging buffers) pending during backward


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# ---------------------------------------------------------------------------------------------- units
@dataclass
class ShardedBucket:
    """One flat buffer of a unit: the persistent shard and the transient gathered buffer."""

    bucket: Bucket
    unit: "Unit"
    group_id: int
    shard: torch.Tensor  # (S,) param dtype, on the param device (host under param offload)
    full: torch.Tensor  # (padded,) param dtype, on the compute device; storage empty unless gathered
    rank: int
    grad_shard: Optional[torch.Tensor] = None  # (S,) param dtype: reduced gradients, summed over micro-batches
    master: Optional[torch.Tensor] = None  # set by the optimizer engine
    master_aliased: bool = True
    init_master: Optional[torch.Tensor] = None  # exact source values of the shard when params are cast
    grad_device: Optional[torch.device] = None  # optimizer offload: reduced gradient shards go to the host
    grad_dtype: Optional[torch.dtype] = None

    @property
    def nbytes_full(self) -> int:
        return self.full.numel() * self.full.element_size()

    # The interface ZeroOptimizer uses on bucket states -------------------------------------------
    def reduced_grad(self) -> torch.Tensor:
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.shard.numel(), dtype=self.grad_dtype or self.full.dtype,
                                          device=self.grad_device or self.full.device)
        return self.grad_shard

    def write_master(self, master: torch.Tensor) -> None:
        self.shard.copy_(master)


@dataclass
class Unit:
    index: int
    name: str
    module: Optional[nn.Module]
    kind: str  # "unit" | "root" | "persistent"
    buckets: List[ShardedBucket] = field(default_factory=list)
    params: List[nn.Parameter] = field(default_factory=list)  # trainable, in bucket order
    gathered: bool = False
    pending: List[C.Handle] = field(default_factory=list)
    grads_ready: int = 0
    reduced: bool = False  # reduced in the current backward
    backward_started: bool = False
    kept: bool = False  # left gathered after its forward for the backward that comes next (the forward's last unit)
    # gathered again for its backward: not a plain nn.Embedding unit, whose backward reads the indices only (the
    # gradient is staged in the full buffer at the reduction, allocated then)
    backward_gather: bool = True
    reducing: List[C.Handle] = field(default_factory=list)  # reduce-scatters still reading the full buffers

    @property
    def numel(self) -> int:
        return sum(b.bucket.padded_numel for b in self.buckets)

    @property
    def nbytes_full(self) -> int:
        return sum(b.nbytes_full for b in self.buckets)


class ShardedParameters:
    """The module side of ZeRO-3: owns units, buckets, hooks, gathers and gradient reduce-scatters."""

    def __init__(self, root: nn.Module, param_groups: Sequence[Sequence[nn.Parameter]], *, group=None,
                 device: Optional[torch.device] = None, param_dtype: Optional[torch.dtype] = None,
                 unit_modules: Optional[Sequence[str]] = None, prefetch_depth: int = 1,
                 persistent_threshold: int = 0, param_device: Optional[torch.device] = None,
                 pin_memory: bool = False) -> None:
        if prefetch_depth < 0:
            raise ConfigError(f"zero.prefetch_depth={prefetch_depth} must be >= 0")
        if persistent_threshold < 0:
            raise ConfigError(f"zero.persistent_threshold={persistent_threshold} must be >= 0")
        self.root = root
        self.group = group
        self.world = C.group_size(group)
        self.rank = C.group_rank(group)
        self.prefetch_depth = prefetch_depth
        self.persistent_threshold = persistent_threshold
        first = next(iter(root.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None and not first.is_meta else torch.device("cpu"))
        self.param_device = torch.device(param_device) if param_device is not None else self.device
        self.params_offloaded = param_device is not None  # parameter offload: shards rest on the host
        self.pin_memory = pin_memory and self.param_device.type == "cpu" and self.device.type == "cuda"
        self.param_dtype = param_dtype
        self.names: Dict[int, str] = {}
        for n, p in root.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), n)
        self._check_aliasing()
        self.unit_specs = resolve_units(root, unit_modules)
        self.units: List[Unit] = []
        self._build(param_groups)
        self._where: Dict[int, Unit] = {id(p): u for u in self.units for p in u.params}
        self.forward_order: List[int] = []  # unit indices in the order the last forward used them
        self._order_now: List[int] = []
        self._callback_queued = False
        self._hooks: List[Any] = []
        self.peak_gathered_bytes = 0
        self._reductions: List[C.Handle] = []
        self._dirty = False  # a backward touched the units since the last finish_backward
        # Hooks are registered by shard_model(): materializing swaps tensor contents, hooks included.

    # ------------------------------------------------------------------ construction
    def _check_aliasing(self) -> None:
        """Distinct parameters sharing memory (one a view of another) cannot be flattened into shards."""
        spans: Dict[int, List[Tuple[int, int, str]]] = {}
        for p in {id(p): p for p in self.root.parameters()}.values():
            if p.is_meta or p.numel() == 0:
                continue
            st = p.untyped_storage()
            lo = p.storage_offset() * p.element_size()
            spans.setdefault(st.data_ptr(), []).append((lo, lo + p.numel() * p.element_size(), self.names[id(p)]))
        for items in spans.values():
            items.sort()
            for (a0, a1, an), (b0, b1, bn) in zip(items, items[1:]):
                if b0 < a1:
                    raise ConfigError(
                        f"zero.stage=3: parameters {an!r} and {bn!r} share memory (one is a view of the other); "
                        "ZeRO-3 cannot shard aliased parameters. Tie them as the same nn.Parameter object instead"
                    )

    def _owner_unit(self) -> Dict[int, int]:
        """param id -> index in unit_specs, or -1 (root) when outside units or shared between units."""
        owner: Dict[int, int] = {}
        for ui, (_, m) in enumerate(self.unit_specs):
            for p in m.parameters():
                owner[id(p)] = -1 if id(p) in owner and owner[id(p)] != ui else ui
        return owner

    def _build(self, param_groups: Sequence[Sequence[nn.Parameter]]) -> None:
        owner = self._owner_unit()
        direct = {id(p) for p in self.root.parameters(recurse=False)}
        group_of: Dict[int, int] = {}
        for gi, params in enumerate(param_groups):
            for p in params:
                if p.requires_grad:
                    group_of[id(p)] = gi
        n_specs = len(self.unit_specs)
        # Unit slots: the declared units, then root, then persistent.
        per_unit: List[List[List[nn.Parameter]]] = [[[] for _ in param_groups] for _ in range(n_specs + 2)]
        self.frozen: List[nn.Parameter] = []
        seen = set()
        for p in self.root.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in group_of:
                self.frozen.append(p)
                continue
            u = owner.get(id(p), -1)
            slot = n_specs if u < 0 else u
            if p.numel() < self.persistent_threshold or id(p) in direct:
                slot = n_specs + 1
            per_unit[slot][group_of[id(p)]].append(p)
        # Keep registration order inside a bucket (build_buckets reverses; undo that).
        for slot, groups in enumerate(per_unit):
            if not any(groups):
                continue
            if slot < n_specs:
                name, module, kind = self.unit_specs[slot][0], self.unit_specs[slot][1], "unit"
            elif slot == n_specs:
                name, module, kind = "<root>", None, "root"
            else:
                name, module, kind = "<persistent>", None, "persistent"
            unit = Unit(index=len(self.units), name=name, module=module, kind=kind,
                        backward_gather=not (type(module) is nn.Embedding and not module.sparse))
            buckets = build_buckets([list(reversed(g)) for g in groups], _HUGE, self.world)
            for b in buckets:
                unit.buckets.append(self._make_bucket(b, unit))
                unit.params.extend(b.params)
            self.units.append(unit)

    def _make_bucket(self, b: Bucket, unit: Unit) -> ShardedBucket:
        dtype = self.param_dtype or b.dtype
        if not dtype.is_floating_point:
            raise ConfigError(f"zero.stage=3 shards floating-point parameters only; "
                              f"{self.names[id(b.params[0])]!r} is {dtype}")
        shard = torch.zeros(b.shard_numel, dtype=dtype, device=self.param_device)
        if self.pin_memory:
            shard = shard.pin_memory()
        full = torch.empty(b.padded_numel, dtype=dtype, device=self.device)
        full.untyped_storage().resize_(0)
        return ShardedBucket(bucket=b, unit=unit, group_id=b.group_index, shard=shard, full=full, rank=self.rank)

    # ------------------------------------------------------------------ materialize + shard
    def shard_model(self) -> None:
        """Fill every shard from the model (``meta`` units materialized one at a time): :mod:`.shard_init`."""
        shard_init.shard_model(self)

    # ------------------------------------------------------------------ gather / free
    def _alloc(self, b: ShardedBucket) -> None:
        st = b.full.untyped_storage()
        if st.nbytes() == 0:
            st.resize_(b.nbytes_full)

    def _gather(self, unit: Unit, async_op: bool = False) -> None:
        """All-gather a unit's buckets into their full buffers (idempotent)."""
        if unit.gathered:
            if not async_op:
                self._wait(unit)
            return
        self._wait_reducing(unit)  # its full buffers may still be a reduce-scatter's input
        param_guard.thaw(unit.params)  # plain parameters while gathered (the guard costs nothing per op)
        for b in unit.buckets:
            self._alloc(b)
            shard = b.shard
            if shard.device != self.device:
                shard = shard.to(self.device, non_blocking=True)
            # Writing into the buffer must not bump the version counter autograd saved with the params.
            with torch.autograd._unsafe_preserve_version_counter(b.full):
                h = pairwise.all_gather(b.full, shard, self.group, async_op=True, tag="param")
            unit.pending.append(h)
        unit.gathered = True
        self._note_peak()
        if not async_op:
            self._wait(unit)

    @staticmethod
    def _wait(unit: Unit) -> None:
        for h in unit.pending:
            h.wait()
        unit.pending = []

    @staticmethod
    def _wait_reducing(unit: Unit) -> None:
        for h in unit.reducing:
            h.wait()  # idempotent: the handle may also be waited for from self._reductions
        unit.reducing = []

    def _free(self, unit: Unit) -> None:
        unit.kept = False
        if not unit.gathered or unit.kind == "persistent":
            return
        self._wait(unit)
        for b in unit.buckets:
            b.full.untyped_storage().resize_(0)
        param_guard.freeze(unit.params)  # reading values now raises ShardedParameterAccessError, not a segfault
        unit.gathered = False

    @contextlib.contextmanager
    def gathered(self, module: Optional[nn.Module] = None) -> Iterator[None]:
        """Full values of ``module``'s sharded parameters (all of them by default) inside the block, between
        steps (e.g. a callback logging weight norms). A collective: every rank of the group enters it, with the
        same ``module``. Read-only: writes are not copied back to the shards. Values are the parameters' own
        dtype (under mixed precision the fp32 masters are in ``full_state_dict()``)."""
        if _in_backward():
            raise RuntimeError("ShardedParameters.gathered() is for use between steps, not inside backward")
        wanted = self.units
        if module is not None:
            ids = {id(p) for p in module.parameters()}
            wanted = [u for u in self.units if any(id(p) in ids for p in u.params)]
        before = {u.index for u in wanted if u.gathered}
        for u in wanted:  # unit order: the same all-gathers on every rank
            self._gather(u)
        try:
            yield
        finally:
            for u in wanted:
                if u.index not in before:
                    self._free(u)

    def gathered_bytes(self) -> int:
        return sum(u.nbytes_full for u in self.units if u.gathered)

    def unit_buffer_bytes(self) -> int:
        """Bytes of the units' full buffers allocated now, the persistent unit's aside (always there, a model state):
        gathered, prefetched, or staging a reduce-scatter (``gathered`` is cleared when it starts, the storage goes
        when it is done). A memory count that sees aten ops misses them: they grow by ``untyped_storage().resize_``
        (:class:`lightning_scale.memory.LiveTensorBytes` ``extra``)."""
        return sum(b.full.untyped_storage().nbytes() for u in self.units if u.kind != "persistent" for b in u.buckets)

    def _note_peak(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def free_all(self) -> None:
        for u in self.units:
            self._free(u)

    # ------------------------------------------------------------------ hooks
    def _register_hooks(self) -> None:
        for u in self.units:
            if u.kind == "unit":
                self._hooks.append(u.module.register_forward_pre_hook(
                    lambda m, args, u=u: self._pre_forward(u)))
                self._hooks.append(u.module.register_forward_hook(
                    lambda m, args, out, u=u: self._post_forward(u, out)))
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, u=u: self._on_grad(u)))
        root_units = [u for u in self.units if u.kind == "root"]
        if root_units:
            ru = root_units[0]
            owned = {id(p) for p in ru.params}
            for name, m in self.root.named_modules():
                if any(id(p) in owned for p in m.parameters(recurse=False)):
                    self._hooks.append(m.register_forward_pre_hook(lambda m, args, u=ru: self._pre_forward(u)))

    def _pre_forward(self, unit: Unit) -> None:
        if _in_backward():  # activation-checkpoint recompute: the unit was gathered for its backward
            self._gather(unit)
            return
        first_use = unit.index not in self._order_now
        if first_use:
            self._order_now.append(unit.index)
        # a unit kept for a backward that has not come yet (another micro-batch's forward first) is still current: a
        # step frees every gathered unit (after_step), and so does a load
        self._gather(unit)
        # A unit prefetches the next ones; so does the root unit at its first module of the step (the first
        # block's gather then overlaps the embedding instead of blocking the first block).
        if self.prefetch_depth and (unit.kind == "unit" or first_use) and self.forward_order:
            self._prefetch(self.forward_order, unit.index)

    def _prefetch(self, order: List[int], current: int, backward: bool = False) -> None:
        if current not in order:
            return
        pos = order.index(current)
        for ui in order[pos + 1:pos + 1 + self.prefetch_depth]:
            u = self.units[ui]
            if u.kind == "unit" and (u.backward_gather or not backward):
                self._gather(u, async_op=True)

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        if _in_backward():
            return output
        tensors = []
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            for t in tensors:
                t.register_hook(lambda grad, u=unit: self._pre_backward(u))
        if tensors and self.forward_order and unit.index == self.forward_order[-1]:
            # the forward's last unit: its backward comes next; freeing it would only gather it again (the head under
            # zero.unit_modules, else the last block; torchtitan leaves FSDP's last block unresharded alike)
            unit.kept = True
            return output
        self._free(unit)
        return output

    def _queue_final_callback(self) -> None:
        self._dirty = True
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward_final)
            self._callback_queued = True

    def _pre_backward(self, unit: Unit) -> None:
        self._queue_final_callback()
        if unit.backward_started:
            return
        unit.backward_started = True
        unit.kept = False
        if self._order_now:  # first backward after a forward: the forward order is now known
            self.forward_order, self._order_now = self._order_now, []
        if unit.backward_gather:
            self._gather(unit)
        if self.prefetch_depth:
            self._prefetch(list(reversed(self.forward_order)), unit.index, backward=True)

    def _on_grad(self, unit: Unit) -> None:
        self._queue_final_callback()
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.params) and not unit.reduced:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        """Reduce-scatter the unit's gradients (zeros where a parameter got none) into the shards.

        A unit that is freed after its reduction (every kind but the persistent one) stages its gradients in its
        own full buffer: once all its gradients exist nothing reads its gathered values again, so no second
        unit-sized buffer is allocated (and zero-filled) per unit per step; the buffer is freed when the
        reduce-scatter is done. The persistent unit stays gathered, so it stages in a separate buffer."""
        in_place = unit.kind != "persistent"
        if in_place:
            self._wait(unit)  # a prefetch still writing the buffer
        for b in unit.buckets:
            if in_place:
                self._alloc(b)  # a unit reduced without being gathered (skipped in this step)
                staging = b.full
            else:
                staging = torch.empty(b.bucket.padded_numel, dtype=b.full.dtype, device=self.device)
            with torch.autograd._unsafe_preserve_version_counter(b.full):
                end = 0  # zeros wherever no gradient lands: gaps, padding, parameters that got none
                for slot in sorted(b.bucket.slots, key=lambda s: s.offset):
                    if slot.offset > end:
                        staging[end:slot.offset].zero_()
                    g = slot.param.grad
                    if g is not None:
                        staging[slot.offset:slot.offset + slot.numel].copy_(g.reshape(-1))
                        slot.param.grad = None
                    else:
                        staging[slot.offset:slot.offset + slot.numel].zero_()
                    end = max(end, slot.offset + slot.numel)
                staging[end:].zero_()
                staging.div_(self.world)
            out = torch.empty(b.bucket.shard_numel, dtype=b.full.dtype, device=self.device)
            h = pairwise.reduce_scatter(out, staging, self.group, async_op=True, tag="grad")

            def finish(b=b, out=out, h=h, staging=staging) -> None:
                h.wait()
                if in_place:
                    b.full.untyped_storage().resize_(0)
                if b.grad_device is not None:  # offload: the shard moves to the host as soon as it is reduced
                    out = out.to(device=b.grad_device, dtype=b.grad_dtype)
                if b.grad_shard is None:
                    b.grad_shard = out
                else:
                    b.grad_shard.add_(out)

            handle = C.Handle(None, finish)
            self._reductions.append(handle)
            if in_place:
                unit.reducing.append(handle)
            # Each pending reduction holds a unit-sized buffer: keep at most _MAX_INFLIGHT in flight, so the
            # backward peak stays at a few units' gradients, not the whole model's.
            while len(self._reductions) > _MAX_INFLIGHT:
                self._reductions.pop(0).wait()
        unit.reduced = True
        if in_place and unit.gathered:  # freed now; the buffers' storage goes when their reduce-scatter is done
            unit.gathered = False
            param_guard.freeze(unit.params)

    def _post_backward_final(self) -> None:
        self._callback_queued = False
        self.finish_backward()

    def finish_backward(self) -> None:
        """Reduce every unit not reduced yet (in unit order: the same collectives on every rank), wait."""
        if not self._dirty:
            return
        self._dirty = False
        for u in self.units:
            if u.params and not u.reduced:
                self._reduce(u)
        self.wait_reductions()
        for u in self.units:
            u.reducing = []
            u.grads_ready = 0
            u.reduced = False
            u.backward_started = False
            if u.kind == "unit":
                self._free(u)  # prefetched but never used

    def wait_reductions(self) -> None:
        for h in self._reductions:
            h.wait()
        self._reductions = []

    def flush(self) -> None:
        """Before the optimizer step: make sure every unit's gradient shard exists on every rank."""
        self.finish_backward()
        for u in self.units:
            for b in u.buckets:
                b.reduced_grad()

    # ------------------------------------------------------------------ after the optimizer step
    def after_step(self, group_ids: Optional[Iterable[int]] = None) -> None:
        """Shards changed: refresh the persistent unit, drop stale gathered copies."""
        ids = None if group_ids is None else set(group_ids)
        for u in self.units:
            if u.kind == "persistent":
                for b in u.buckets:
                    if ids is not None and b.group_id not in ids:
                        continue
                    shard = b.shard.to(self.device) if b.shard.device != self.device else b.shard
                    with torch.autograd._unsafe_preserve_version_counter(b.full):
                        pairwise.all_gather(b.full, shard, self.group, tag="param")
            else:
                self._free(u)

    def zero_grad(self, group_ids: Optional[Iterable[int]] = None) -> None:
        ids = None if group_ids is None else set(group_ids)
        for u in self.units:
            for b in u.buckets:
                if ids is None or b.group_id in ids:
                    b.grad_shard = None
            for p in u.params:
                p.grad = None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ state
    def buckets(self) -> List[ShardedBucket]:
        return [b for u in self.units for b in u.buckets]

    def layout(self) -> Dict[str, Any]:
        return shard_state.layout(self)

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's parameter shards (+ fp32 masters when separate) and the layout: :mod:`.shard_state`."""
        return shard_state.shard_state_dict(self)

    def load_shard_state_dict(self, state: Dict[str, Any]) -> None:
        shard_state.load_shard_state_dict(self, state)

    def full_state_dict(self, dtype: Optional[torch.dtype] = torch.float32, rank0_only: bool = False
                        ) -> Dict[str, torch.Tensor]:
        """All parameters (fp32 masters where they exist) and buffers, unsharded; a collective."""
        return shard_state.full_state_dict(self, dtype=dtype, rank0_only=rank0_only)

    # ------------------------------------------------------------------ accounting
    def unit_counts(self) -> Dict[str, int]:
        """Parameters (elements, this rank's local ones under tp) of the largest unit, of the largest two units next to
        each other and of the root unit, as this
        engine built them from ``unit_modules``: what :func:`lightning_scale.estimate.model_counts` predicts from the
        module tree for the default units."""
        def numel(u: Unit) -> int:
            return sum(p.numel() for p in u.params)

        sizes = [numel(u) for u in self.units if u.kind == "unit"]  # registration order: the forward's
        return {"largest_unit_params": max(sizes, default=0),
                "root_params": sum(numel(u) for u in self.units if u.kind == "root"),
                "unit_pair_params": max((a + b for a, b in zip(sizes, sizes[1:])), default=max(sizes, default=0))}

    def memory_bytes(self) -> Dict[str, int]:
        shard = sum(b.shard.numel() * b.shard.element_size() for b in self.buckets())
        grads = sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in self.buckets()
                    if b.grad_shard is not None)
        return {"param_shards": shard, "grad_shards": grads, "gathered": self.gathered_bytes(),
                "peak_gathered": self.peak_gathered_bytes,
                "persistent": sum(u.nbytes_full for u in self.units if u.kind == "persistent"),
                "largest_unit": max((u.nbytes_full for u in self.units if u.kind == "unit"), default=0)}
