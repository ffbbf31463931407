"""Memory estimator: per-rank device and host bytes of model states for every ZeRO stage / offload choice.

Like DeepSpeed's ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_...`` helpers, but for this
project's engine (``zero/optimizer.py``, ``zero/reducer.py``, ``zero/precision.py``) and for all stages in
one table::

    python -m lightning_scale.estimate --params 13e9 --dp 8 --stage 3 --offload optimizer
    python -m lightning_scale.estimate --model gpt_small --dp 2
    python -m lightning_scale.estimate --model gpt_small:n_layer=48,d_model=1600 --dp 8

Notation: ``P`` trainable parameters, ``N = dp`` ranks, ``U`` parameters of the largest unit (one
transformer block), ``Q`` persistent (never sharded) parameters at stage 3, ``R`` the stage-3 root unit's
parameters (everything outside the repeated units: embeddings, head, final norm; gathered from its first use in the
forward to the end of the backward, as FSDP2 keeps its root), ``d`` prefetch depth, ``W`` the largest two units next
to each other in the forward (a unit and the one it prefetches; ``2*U`` where every unit is a block alike, less
where ``zero.unit_modules`` makes the embeddings and the head units: the head next to the last block, never next to
the embeddings).
Bytes per element by precision (``b_p`` params, ``b_g`` grads, ``b_m`` fp32 master, ``b_s`` optimizer
state per element, ``k`` state elements per master element: Adam/AdamW 2 (m, v), SGD 1, ...):

============  ===  ===  ==================  =====================  =====================
precision     b_p  b_g  b_m                 b_s                    K = b_m + k*b_s (Adam)
============  ===  ===  ==================  =====================  =====================
bf16-mixed    2    2    4                   4 (fp32)               12
16-mixed      2    2    4                   4 (fp32)               12
32-true       4    4    0 (master = param)  4                      8
64-true       8    8    0                   8                      16
bf16-true     2    2    0                   2                      4
============  ===  ===  ==================  =====================  =====================

Device bytes per rank (no offload); ``M = b_m + k*b_s`` (master + optimizer state per parameter):

=====  ========  ==========  ===========  ======================  ==================================
stage  params    grads       master+state gathered units          transient (largest of)
=====  ========  ==========  ===========  ======================  ==================================
0      P*b_p     P*b_g       P*M          -                       fp32 grad copy P*b_m (mixed only)
1      P*b_p     P*b_g/N     P*M/N        -                       the full grads P*b_g (backward to the
                                                                  step boundary), or the fp32 grad copy
                                                                  P*b_m/N
2      P*b_p     P*b_g/N     P*M/N        -                       one staging bucket (bucket_mb MiB of
                                                                  grads, stage 2 reduce-scatter input;
                                                                  a parameter larger than that is a
                                                                  bucket of its own),
                                                                  or the fp32 grad copy P*b_m/N
3      P*b_p/N   P*b_g/N     P*M/N        (1+d)*U*b_p (d=1: W*b_p)  the full grads of two units and of the
                                          + (R+Q)*b_p             root (W+R)*b_g, or the fp32 grad copy
                                                                  P*b_m/N
=====  ========  ==========  ===========  ======================  ==================================

Stage 1 holds the full gradients only from backward to the step boundary (flat buffers, the params' ``.grad``
are views), reduce-scatters them into a gradient shard and frees them: between steps it holds what stage 2
holds (ZeRO-1's footprint with the gradients reduced into the shard, as DeepSpeed's stage 1), and its peak is
that plus the full gradients, counted as its transient (OneBitAdam's stage 1 keeps its full gradient buffer
between steps: counted as grads, no transient). With mixed
precision the engine makes an fp32 copy of the reduced gradient shard for the step (``master.grad``):
that is the "fp32 grad copy" transient. The total column adds the gathered peak and the larger
transient, an upper bound (they do not all peak at the same moment).

Offload (``offload=``, the names of ``Zero3DStrategy(offload=...)``):

* ``"optimizer"`` (stages 1-3): the fp32 master shard, the optimizer state and the fp32 gradient copy
  used by the CPU step live on the host: host ``P*(b_m' + k*b_s + b_m')/N`` where ``b_m'`` is the
  master dtype size (4 under mixed precision *and* under 32-true: the host needs its own fp32 copy of
  the param shard, no longer aliased). The device keeps the params and grads as in the table above
  (so 2P + 2P/N bytes for stage 2 bf16-mixed); no fp32 grad copy on the device. With
  ``offload_grads=True`` (stages 2-3) the gradient shards stream to the host as they are reduced and the
  device keeps none (only the transient bucket / unit): DeepSpeed's ZeRO-Offload does this, and it is
  what fits 13B parameters (2P = 26 GB of bf16 params) on one 32 GB device at stage 2. Stage 1 keeps its
  gradient shard (and, during backward, the full gradients) on the device.
* ``"params"`` (stage 3 only): the parameter shards ``P*b_p/N`` rest on the host and move to the
  device only when their unit is gathered; the master / optimizer state stay on the device (without
  mixed precision the device step needs a working copy of the shard, ``P*b_p/N``, counted as master).
* ``"all"`` (stage 3): both. The host param shard is the master when the precision has no separate
  master (32-true), so it is not counted twice.

Host bytes here are model states only (not the process, data loaders or pinned staging buffers).
Padding of flat buckets to multiples of N elements is ignored (< N elements per bucket).
Stage 2 transient: ``GradientReducer`` keeps at most two buckets' reduce-scatters (and their staging
buffers) in flight during backward, so the table counts two staging buckets.

What this engine does with gradients under optimizer offload (the default of ``offload_grads``): stages 2
and 3 stream each reduced gradient shard to the host (fp32) as soon as its reduce-scatter finishes (the
device keeps no gradient shard); stage 1 keeps its gradient shard on the device. Stage 3 keeps one
unit's reduce-scatter (and its staging gradients) in flight while the next unit's gradients are copied.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from lightning_scale.config import ConfigError
from lightning_scale.activation_plan import (  # noqa: F401  (re-exported: callers import them from here)
    AC_POLICIES, ActivationEstimate, _act_bytes, _counted_profile, _policy, _vocab_and_chunk, activations_for_model,
    estimate_activations)

STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "optimizer", "params", "all")
# (b_p, b_g, b_m, b_s): bytes of a param, a grad, a separate master element (0: the param is the
# master), an optimizer-state element.
_PRECISION_BYTES: Dict[str, Tuple[int, int, int, int]] = {
    "bf16-mixed": (2, 2, 4, 4),
    "16-mixed": (2, 2, 4, 4),
    "32-true": (4, 4, 0, 4),
    "64-true": (8, 8, 0, 8),
    "bf16-true": (2, 2, 0, 2),
    "16-true": (2, 2, 0, 2),
}
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "bf16": "bf16-mixed", "16": "16-mixed",
                      "fp32": "32-true", "fp16": "16-mixed", "bf16_true": "bf16-true"}
# Optimizer state elements per master element (Adam: exp_avg + exp_avg_sq).
STATE_PER_ELEMENT = {"adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "radam": 2, "onebitadam": 2,
                     "adagrad": 1, "rmsprop": 1, "adadelta": 2, "sgd": 1}
# The rows of the table: every valid (stage, offload) pair.
CHOICES: Tuple[Tuple[int, str], ...] = ((0, "none"), (1, "none"), (1, "optimizer"), (2, "none"),
                                        (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "params"),
                                        (3, "all"))
GiB = 2**30


@dataclass(frozen=True)
class Breakdown:
    """Bytes of one memory space (device or host) for one rank."""

    params: float = 0.0
    grads: float = 0.0
    master: float = 0.0
    optimizer_state: float = 0.0
    gathered: float = 0.0  # stage 3: peak of gathered units (+ persistent params)
    transient: float = 0.0  # stage-1 full grads / stage-2 staging bucket / two units' full grads / fp32 grad copy

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer_state + self.gathered + self.transient

    def as_dict(self) -> Dict[str, float]:
        return {"params": self.params, "grads": self.grads, "master": self.master,
                "optimizer_state": self.optimizer_state, "gathered": self.gathered,
                "transient": self.transient, "total": self.total}


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    dp: int
    stage: int
    offload: str
    precision: str
    optimizer: str
    device: Breakdown
    host: Breakdown
    notes: Tuple[str, ...] = field(default=())
    activations: Optional[ActivationEstimate] = None
    step_scratch: float = 0.0  # the optimizer step's temporaries (torch Adam: two of its largest tensor)
    root_gathered: float = 0.0  # stage 3: the root unit's full bytes (part of device.gathered), alive to the backward's end
    step_transient: float = 0.0  # the step's share of device.transient (the fp32 gradient copy of mixed precision)

    @property
    def activation_bytes(self) -> float:
        return self.activations.peak if self.activations is not None else 0.0

    @property
    def predicted_peak(self) -> float:
        """Device bytes per rank at the peak of a training step from step 2 on: model states (the table's total:
        params, grads, master, optimizer state, gathered units, transient) + the activation peak. ZeRO-3 in phases
        (:meth:`stage3_phases`)."""
        steady = self.activations.steady_peak if self.activations is not None else 0.0
        if self.stage == 3:
            resident, compute, step = self.stage3_phases(steady)
            return resident + max(compute, step)
        return self.device.total + max(steady, self.step_scratch)

    @property
    def first_step_peak(self) -> float:
        """The peak of step 1: its forward / backward run before the optimizer state exists (the step makes it,
        after the activations are freed)."""
        if self.stage == 3:
            resident, compute, step = self.stage3_phases(self.activation_bytes)
            return max(resident - self.device.optimizer_state + compute, resident + step)
        return max(self.device.total - self.device.optimizer_state + self.activation_bytes,
                   self.device.total + self.step_scratch)

    def stage3_phases(self, activations: float, held: float = 0.0) -> Tuple[float, float, float]:
        """ZeRO-3's device bytes as (resident, forward / backward, optimizer step): its gathered units and staged
        gradients exist only inside the forward and backward, its gradient shards from the backward to
        ``zero_grad``. The forward / backward peak is the activation peak with the gathered units (the root and the
        prefetched blocks), or the backward's end: the root's gathered buffer and gradients with every gradient
        shard; the step holds the shards, its fp32 gradient copy and scratch. The table's total adds them all (an
        upper bound: a user's MoE model at dp=2 measured 0.66 of it). ``held``: bytes alive with the activations
        (the gradient shards of earlier micro-batches while gradients accumulate)."""
        d = self.device
        resident = d.params + d.master + d.optimizer_state
        backward = d.grads + d.transient + self.root_gathered
        compute = max(activations + d.gathered + held, backward)
        step = d.grads + self.step_transient + self.step_scratch
        return resident, compute, step

    @property
    def host_peak(self) -> float:
        return self.host.total + (self.activations.host if self.activations is not None else 0.0)


def _precision_key(precision: str) -> str:
    key = _PRECISION_ALIASES.get(str(precision), str(precision))
    if key not in _PRECISION_BYTES:
        raise ConfigError(f"precision={precision!r}: must be one of {', '.join(_PRECISION_BYTES)}")
    return key


def _state_elements(optimizer) -> int:
    if isinstance(optimizer, str) and optimizer.isdigit():  # an Estimate's optimizer: the count, as text
        optimizer = int(optimizer)
    if isinstance(optimizer, int) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ConfigError(f"optimizer={optimizer}: state elements per parameter must be >= 0")
        return optimizer
    key = str(optimizer).lower().replace("_", "").replace("-", "")
    if key not in STATE_PER_ELEMENT:
        raise ConfigError(f"optimizer={optimizer!r}: must be one of {', '.join(STATE_PER_ELEMENT)} "
                          f"or an int (state elements per parameter)")
    return STATE_PER_ELEMENT[key]


def _check_count(name: str, value, minimum: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum:
        raise ConfigError(f"{name}={value!r} must be a number >= {minimum:g}")


def validate(params, *, dp, stage, offload, precision="bf16-mixed", largest_unit_params=0,
             persistent_params=0, prefetch_depth=1, bucket_mb=25.0, root_params=0, unit_pair_params=0) -> None:
    """Raise ConfigError naming the setting for impossible inputs (same rules as ``OffloadConfig``)."""
    _check_count("params", params, 1)
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"dp={dp!r} must be a positive integer")
    if stage not in STAGES:
        raise ConfigError(f"zero.stage={stage!r}: must be one of 0, 1, 2, 3")
    if offload not in OFFLOADS:
        raise ConfigError(f"offload={offload!r}: must be one of {', '.join(OFFLOADS)}")
    if offload == "optimizer" and stage == 0:
        raise ConfigError("offload='optimizer' needs zero.stage >= 1 (stage 0 keeps no optimizer shard)")
    if offload in ("params", "all") and stage != 3:
        raise ConfigError(f"offload={offload!r} (parameter offload) needs zero.stage=3 (got stage {stage})")
    _precision_key(precision)
    if not isinstance(prefetch_depth, int) or isinstance(prefetch_depth, bool) or prefetch_depth < 0:
        raise ConfigError(f"zero.prefetch_depth={prefetch_depth!r} must be an integer >= 0")
    _check_count("largest_unit_params", largest_unit_params, 0)
    _check_count("persistent_params", persistent_params, 0)
    _check_count("zero.bucket_mb", bucket_mb, 0)
    if bucket_mb <= 0:
        raise ConfigError(f"zero.bucket_mb={bucket_mb} must be > 0")
    if largest_unit_params > params:
        raise ConfigError(f"largest_unit_params={largest_unit_params:g} exceeds params={params:g}")
    if persistent_params > params:
        raise ConfigError(f"persistent_params={persistent_params:g} exceeds params={params:g}")
    _check_count("root_params", root_params, 0)
    _check_count("unit_pair_params", unit_pair_params, 0)
    if unit_pair_params > 2 * largest_unit_params:
        raise ConfigError(f"unit_pair_params={unit_pair_params:g} exceeds two largest units "
                          f"(2 x largest_unit_params={largest_unit_params:g})")
    if root_params > params:
        raise ConfigError(f"root_params={root_params:g} exceeds params={params:g}")


def estimate(params, *, dp: int, stage: int, offload: str = "none", precision: str = "bf16-mixed",
             largest_unit_params=0, persistent_params=0, prefetch_depth: int = 1, optimizer="adam",
             bucket_mb: float = 25.0, offload_grads: Optional[bool] = None, root_params=0,
             unit_pair_params=0) -> MemoryEstimate:
    """Per-rank device and host bytes of model states; see the module docstring for the formulas.

    ``offload_grads=None``: what this engine does (stream gradient shards to the host at stages 2 and 3).
    ``unit_pair_params``: ``W``, the largest two units next to each other in the forward (0: unknown, ``2*U``)."""
    if offload_grads is None:
        offload_grads = stage >= 2
    validate(params, dp=dp, stage=stage, offload=offload, precision=precision,
             largest_unit_params=largest_unit_params, persistent_params=persistent_params,
             prefetch_depth=prefetch_depth, bucket_mb=bucket_mb, root_params=root_params,
             unit_pair_params=unit_pair_params)
    key = _precision_key(precision)
    k = _state_elements(optimizer)
    b_p, b_g, b_m, b_s = _PRECISION_BYTES[key]
    P, N, U, Q, R = float(params), dp, float(largest_unit_params), float(persistent_params), float(root_params)
    W = float(unit_pair_params) or 2 * U  # a unit in use + the next one (prefetched in the forward, reduced in backward)
    opt_off = offload in ("optimizer", "all")
    par_off = offload in ("params", "all")
    # OneBitAdam's stage-1 engine keeps its full gradient buffer (the compressed exchange reads it at the step)
    onebit = str(optimizer).lower().replace("_", "").replace("-", "") == "onebitadam"
    grads_full = stage == 0 or (stage == 1 and onebit)
    shard = P / N if stage >= 1 else P  # elements of master / state this rank owns
    # Mixed precision keeps a separate fp32 master; otherwise the param shard is the master unless it
    # moved to the other memory space (then that space needs its own copy).
    b_master_dtype = b_m or b_p
    notes: List[str] = []

    dev = dict(params=P * b_p / N if stage == 3 else P * b_p, grads=P * b_g if grads_full else P * b_g / N,
               master=0.0, optimizer_state=0.0, gathered=0.0, transient=0.0)
    host = dict(params=0.0, grads=0.0, master=0.0, optimizer_state=0.0, gathered=0.0, transient=0.0)
    if par_off:
        host["params"], dev["params"] = dev["params"], 0.0
    if opt_off and offload_grads and stage >= 2:
        dev["grads"] = 0.0  # streamed to the host copy as they are reduced
    if opt_off:
        host["optimizer_state"] = shard * k * b_s
        host["grads"] = shard * b_master_dtype  # the gradient copy the CPU step reads
        host_has_params = par_off and b_m == 0  # the host param shard is the master itself
        host["master"] = 0.0 if host_has_params else shard * b_master_dtype
    else:
        dev["optimizer_state"] = shard * k * b_s
        dev["master"] = shard * b_master_dtype if (b_m or par_off) else 0.0
    if stage == 3:
        dev["gathered"] = (W if prefetch_depth == 1 else (1 + prefetch_depth) * U) * b_p + (R + Q) * b_p
        if U == 0:
            notes.append("largest unit unknown (0): the gathered-unit peak is not counted")
    backward = 0.0
    if stage == 1 and not onebit:
        backward = P * b_g  # the full gradients, from backward until they are reduced into the shard
    elif stage == 2:
        bucket_numel = min(P, bucket_mb * 2**20 / b_p)
        backward = min(P, 2 * bucket_numel) * b_g  # at most two staging buckets in flight
    elif stage == 3:
        # a unit's grads (staged in its own full buffer) + one reduce-scatter in flight, next to the root unit's
        # gradients: made by the head's backward, alive until the embedding's ends the root's (one reduce for all)
        backward = (W + R) * b_g
    step = shard * b_m if (b_m and not opt_off) else 0.0
    dev["transient"] = max(backward, step)
    return MemoryEstimate(params=int(P), dp=N, stage=stage, offload=offload, precision=key,
                          optimizer=str(optimizer), device=Breakdown(**dev), host=Breakdown(**host),
                          notes=tuple(notes), root_gathered=R * b_p if stage == 3 else 0.0, step_transient=step)


def estimate_all(params, *, dp: int, precision: str = "bf16-mixed", choices: Sequence[Tuple[int, str]] = CHOICES,
                 **kwargs) -> List[MemoryEstimate]:
    """One estimate per (stage, offload) choice, in table order."""
    return [estimate(params, dp=dp, stage=s, offload=o, precision=precision, **kwargs) for s, o in choices]


# ---------------------------------------------------------------------------------------- models
def _unique_trainable(params: Iterable) -> List:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _units(module) -> List:
    """The repeated units: ``layer_modules()`` of the module or of its first submodule that has it, else the children
    of every ModuleList of one class (a Hugging Face model's decoder layers), else the module's children."""
    for m in module.modules():
        if callable(getattr(m, "layer_modules", None)):
            return list(m.layer_modules())
    from lightning_scale.zero.units import resolve_units  # ZeRO-3's discovery: a ModuleList of one class

    return [m for _, m in resolve_units(module)] or list(module.children())


def model_counts(module, persistent_threshold: int = 0, units: Optional[Sequence[str]] = None) -> Dict[str, int]:
    """Trainable parameters (tied ones once), the largest unit's, those below the persistence threshold, and the
    ZeRO-3 root unit's: the rest outside the repeated units (embeddings, head, final norm; a parameter two units
    share), which the engine gathers for the whole forward and backward. Parameters held directly by ``module``
    are persistent there, as in :class:`lightning_scale.zero.param_shard.ShardedParameters`; and the largest two
    units next to each other (``unit_pair_params``). ``units``: the ``zero.unit_modules`` in effect (None: every
    repeated block)."""
    from lightning_scale.zero.units import resolve_units, root_parameters

    params = _unique_trainable(module.parameters())
    if units:
        units = [m for _, m in resolve_units(module, units)]
    else:
        units = _units(module)
    sizes = [sum(p.numel() for p in _unique_trainable(u.parameters())) for u in units]
    largest = max(sizes, default=0)
    # a unit and the next one in the forward (registration order: the order a forward uses them): the two gathered
    # together at prefetch depth 1, or staged together for their reductions in the backward
    pair = max((a + b for a, b in zip(sizes, sizes[1:])), default=largest)
    persistent = sum(p.numel() for p in params if p.numel() < persistent_threshold)
    root = sum(p.numel() for p in root_parameters(module, units, params) if p.numel() >= persistent_threshold)
    return {"params": sum(p.numel() for p in params), "largest_unit_params": largest,
            "persistent_params": persistent, "root_params": root, "unit_pair_params": pair}


def estimate_for_model(module, *, dp: int, stage: int, offload: str = "none", precision: str = "bf16-mixed",
                       prefetch_depth: int = 1, persistent_threshold: int = 0, optimizer="adam",
                       bucket_mb: float = 25.0, offload_grads: Optional[bool] = None, seq_len: Optional[int] = None,
                       micro_batch: int = 1, activation_checkpointing: Optional[str] = None,
                       offload_activations: bool = False, sp: int = 1, tp: int = 1, chunked_loss=None,
                       profile_tp: Optional[int] = None, tiled_mlp: int = 0,
                       tiled_attention: int = 0) -> MemoryEstimate:
    """:func:`estimate` with the counts taken from an ``nn.Module`` (works on ``meta`` modules).

    With ``seq_len`` the result carries the activation plan (:func:`activations_for_model`; ``predicted_peak``,
    ``first_step_peak``) for ``micro_batch`` sequences of ``seq_len`` tokens, ``activation_checkpointing`` None |
    "full" | "selective", ``offload_activations``, ``sp`` (each rank holds ``seq_len / sp`` positions), ``tp`` and
    ``chunked_loss`` (None: the model's own setting), ``tiled_mlp`` (positions per tile, 0: off) and
    ``tiled_attention`` (heads per group, 0: off). ``dp`` is the
    ZeRO sharding degree (dp x sp under sequence parallelism). Model states are counted on ``module`` as given
    (pass the tp-local model for exact tp counts); ``profile_tp`` (default ``tp``) is the split applied to the
    activations profiled on it: 1 for a module that is tp-sliced already.
    """
    counts = model_counts(module, persistent_threshold)
    est = estimate(counts["params"], dp=dp, stage=stage, offload=offload, precision=precision,
                   largest_unit_params=counts["largest_unit_params"], persistent_params=counts["persistent_params"],
                   prefetch_depth=prefetch_depth, optimizer=optimizer, bucket_mb=bucket_mb,
                   offload_grads=offload_grads, root_params=counts["root_params"],
                   unit_pair_params=counts["unit_pair_params"])
    if seq_len is None:
        return est
    acts = activations_for_model(module, seq_len=seq_len, micro_batch=micro_batch, precision=precision,
                                 activation_checkpointing=activation_checkpointing,
                                 offload_activations=offload_activations, sp=sp,
                                 tp=tp if profile_tp is None else profile_tp, chunked_loss=chunked_loss,
                                 tiled_mlp=tiled_mlp, tiled_attention=tiled_attention)
    shard = 1 if stage == 0 else dp  # the largest tensor a per-tensor optimizer steps: a parameter (its shard)
    largest = max((p.numel() for p in _unique_trainable(module.parameters())), default=0) / shard
    return with_activations(est, acts, step_tensor_numel=largest)


def with_activations(est: MemoryEstimate, acts: Optional[ActivationEstimate],
                     step_tensor_numel: Optional[float] = None) -> MemoryEstimate:
    """``est`` with the activation plan attached and, given the largest tensor the optimizer steps (a flat
    bucket for this project's engines), the step's scratch: two temporaries of it in the optimizer state's
    dtype (torch's per-tensor Adam: ``sqrt`` then the division of ``denom``)."""
    import dataclasses

    scratch = est.step_scratch
    if step_tensor_numel is not None and est.offload in ("none", "params"):  # else the step runs on the host
        k = _state_elements(est.optimizer)
        scratch = (2 if k >= 2 else 1) * step_tensor_numel * _PRECISION_BYTES[est.precision][3]
    return dataclasses.replace(est, activations=acts, step_scratch=float(scratch))


# ---------------------------------------------------------------------------------------- table
def _fmt(nbytes: float, unit: float) -> str:
    value = nbytes / unit
    return "-" if nbytes == 0 else (f"{value:,.2f}" if value < 100 else f"{value:,.0f}")


_COLUMNS = ("params", "grads", "master", "optimizer_state", "gathered", "transient")
_HEADERS = ("params", "grads", "master", "optim", "gathered", "transient")


def format_table(estimates: Sequence[MemoryEstimate], *, selected: Optional[Tuple[int, str]] = None,
                 ranks_per_host: int = 1, unit: str = "GiB") -> str:
    """A markdown-style table: one row per estimate, device breakdown + totals, host per rank and per host."""
    if not estimates:
        raise ValueError("format_table needs at least one estimate")
    if ranks_per_host < 1:
        raise ConfigError(f"ranks_per_host={ranks_per_host!r} must be >= 1")
    scale = {"GiB": GiB, "MiB": 2**20}.get(unit)
    if scale is None:
        raise ValueError(f"unit={unit!r}: use 'GiB' or 'MiB'")
    head = ["", "stage", "offload"] + [f"dev {h}" for h in _HEADERS] + [f"device/rank {unit}", f"host/rank {unit}"]
    per_node = ranks_per_host > 1
    if per_node:
        head.append(f"host/node {unit} (x{ranks_per_host})")
    rows = [head]
    for e in estimates:
        mark = "*" if selected == (e.stage, e.offload) else ""
        rows.append([mark, str(e.stage), e.offload] + [_fmt(getattr(e.device, c), scale) for c in _COLUMNS]
                    + [_fmt(e.device.total, scale), _fmt(e.host.total, scale)]
                    + ([_fmt(e.host.total * ranks_per_host, scale)] if per_node else []))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(rows[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
              for r in rows[1:]]
    return "\n".join(lines)


def _human_count(n: float) -> str:
    """1.3B / 124.4M / 912.1K: three significant figures at any size (0.001B said nothing for a 0.9M model)."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:,.3g}{unit}" if n / div < 1000 else f"{n / div:,.0f}{unit}"
    return f"{int(n)}"


def describe(e: MemoryEstimate, largest_unit_params: float = 0, prefetch_depth: int = 1) -> str:
    return (f"{_human_count(e.params)} trainable params, dp={e.dp}, {e.precision}, optimizer={e.optimizer} "
            f"({_state_elements(e.optimizer)} state elements/param), largest unit {largest_unit_params / 1e6:,.1f}M "
            f"params, prefetch_depth={prefetch_depth}")


# ---------------------------------------------------------------------------------------- CLI
def _value(text: str):
    """An override's value: int, float, true/false, else the string."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _config_from_spec(spec: str):
    """``gpt_small`` or ``gpt_small:n_layer=48,d_model=1600`` -> its GPTConfig (pure Python: no torch)."""
    import pathlib

    from lightning_scale.models.gpt_config import MODELS, GPTConfig

    name, _, args = spec.partition(":")
    conf = pathlib.Path(__file__).resolve().parents[1] / "conf" / "model"  # the Hydra model group, in a checkout
    hydra = sorted(p.stem for p in conf.glob("*.yaml")) if conf.is_dir() else []
    if name not in MODELS and name not in hydra:
        raise ConfigError(f"--model={name!r}: must be one of {', '.join([*MODELS, *hydra])} (optionally "
                          "name:key=value,...)")
    if name not in MODELS:  # e.g. gpt_mini: what `python examples/train.py model=gpt_mini` trains
        import yaml

        fields = yaml.safe_load((conf / f"{name}.yaml").read_text()) or {}
        make = lambda **kw: GPTConfig(**{**fields, **kw})  # noqa: E731
    else:
        make = MODELS[name]
    overrides = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--model override {item!r}: use key=value")
        overrides[key.strip()] = _value(value)
    try:
        return make(**overrides).validate()
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--model={spec!r}: {err}") from err


def _model_from_spec(spec: str):
    """The spec's GPT on the meta device (imports torch: only the activation profile needs a module)."""
    import torch

    from lightning_scale.models import gpt

    cfg = _config_from_spec(spec)
    with torch.device("meta"), _no_init(torch):
        return gpt.GPT(cfg)


@contextlib.contextmanager
def _no_init(torch):
    """Meta tensors hold no values: skip the random init. Its meta kernels go through torch's reference
    implementations, which import torch._dynamo (~1.5 s of the CLI's start)."""
    saved = {name: getattr(torch.Tensor, name) for name in ("normal_", "uniform_")}
    for name in saved:
        setattr(torch.Tensor, name, lambda self, *a, **k: self)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lightning_scale.estimate``: the command line (:mod:`lightning_scale.estimate_cli`)."""
    from lightning_scale.estimate_cli import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
