"""OneBitAdam: Adam whose data-parallel traffic drops to ~1 bit per element after a warm-up.

1-bit Adam (Tang et al., 2021, https://arxiv.org/abs/2102.02888): Adam's variance settles early in
training. Once it is frozen the update is linear in the momentum, so the momentum can be averaged
with 1-bit compression and error feedback (:mod:`lightning_scale.comm.compressed`) at Adam's
convergence speed.

* warm-up, steps ``1..freeze_step``: exact AdamW. The optimizer all-reduces the gradients itself in
  full precision (and writes the mean back to ``p.grad``, as DDP would).
* compression, later steps: ``v`` is frozen; each rank updates its momentum with its LOCAL gradient,
  ``m_i = b1 m + (1 - b1) g_i``, and the momenta are averaged by ``compressed_all_reduce``. The
  update uses the synchronized momentum, identical on all ranks.

Contract with strategies: ``handles_gradient_reduction = True``. A strategy that sees it does not
reduce this optimizer's gradients and calls ``bind_process_group(dp_group)`` before training; with
no strategy, ``group=None`` is the default world group. ``OneBitAdamShard`` is the same optimizer
for a ZeRO stage 1/2 engine (one rank's shard of a flat buffer); see docs/onebit_adam.md.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from lightning_scale.comm import pairwise
from lightning_scale.comm.collectives import all_gather, all_reduce, group_rank, group_size
from lightning_scale.comm.compressed import (
    SCALE_MODES, compressed_all_reduce, compressed_reduce_scatter, error_buffer_numels,
)
from lightning_scale.config import ConfigError

SUPPORTED_ZERO_STAGES = (0, 1, 2)
_STATE_VERSION = 1


def validate_hparams(*, lr=None, betas=None, eps=None, weight_decay=None, freeze_step=None, scale=None) -> None:
    """Reject impossible hyperparameters with a message naming the setting."""
    if lr is not None and not lr >= 0.0:
        raise ValueError(f"OneBitAdam: lr={lr} must be >= 0")
    if betas is not None:
        if len(betas) != 2:
            raise ValueError(f"OneBitAdam: betas={betas} must be a pair")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"OneBitAdam: betas[{i}]={b} must be in [0, 1)")
    if eps is not None and not eps >= 0.0:
        raise ValueError(f"OneBitAdam: eps={eps} must be >= 0")
    if weight_decay is not None and not weight_decay >= 0.0:
        raise ValueError(f"OneBitAdam: weight_decay={weight_decay} must be >= 0")
    if freeze_step is not None and (isinstance(freeze_step, bool) or not isinstance(freeze_step, int)
                                    or freeze_step < 1):
        raise ValueError(f"OneBitAdam: freeze_step={freeze_step!r} must be an integer >= 1 (the number of "
                         "exact-Adam warm-up steps; the variance is frozen after them)")
    if scale is not None and scale not in SCALE_MODES:
        raise ValueError(f"OneBitAdam: scale={scale!r}; choose one of {SCALE_MODES}")


def check_zero_stage(stage: int) -> None:
    """For strategies: raise ConfigError when OneBitAdam cannot run under ZeRO ``stage``."""
    if stage not in SUPPORTED_ZERO_STAGES:
        raise ConfigError(
            f"zero.stage={stage}: OneBitAdam supports ZeRO stages {SUPPORTED_ZERO_STAGES}. Stage 3 keeps no full "
            "local gradient to compress; use stage <= 2 with OneBitAdam, or another optimizer with stage 3")


def adam_update(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float, eps: float,
                weight_decay: float, bias_correction1: float, bias_correction2: float) -> None:
    """AdamW's parameter update (decoupled weight decay), in torch.optim.AdamW's order of operations."""
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def _bias_corrections(enabled: bool, betas: Tuple[float, float], step: int, v_step: int) -> Tuple[float, float]:
    if not enabled:
        return 1.0, 1.0
    # v_step == 0: the variance never saw a gradient (it is 0), so there is nothing to correct.
    return 1.0 - betas[0] ** step, (1.0 - betas[1] ** v_step) if v_step else 1.0


def mask_momentum(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float, bias_correction2: float) -> None:
    """Zero the momentum where the frozen ``sqrt(v_hat) <= eps``.

    A 1-bit code cannot send 0: after compression every entry of a segment carries about the
    segment's scale. Adam divides by ``sqrt(v_hat) + eps``, so an entry whose gradient is zero, or
    zero up to rounding (unused embedding rows; an attention key bias, which softmax ignores), would
    move by ``scale / eps`` per step, 1e4-1e5 times a normal step. Adam itself moves such entries by
    at most about half a step, so holding them is the smaller error.
    """
    exp_avg.masked_fill_(exp_avg_sq.sqrt() / math.sqrt(bias_correction2) <= eps, 0.0)


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam with error feedback (see the module docstring).

    ``freeze_step`` (required): warm-up steps of exact AdamW before the variance is frozen (the paper
    uses 15-25% of training). ``bias_correction=True`` makes the warm-up identical to torch's AdamW
    and keeps the frozen variance's correction ``1 - b2**freeze_step``; ``False`` is DeepSpeed's
    ``m / (sqrt(v) + eps)``. ``scale``: "l2" or "mean_abs" (see comm.compressed).
    ``mask_small_variance``: after the freeze, momentum entries whose frozen ``sqrt(v_hat) <= eps``
    are held at 0 (see :func:`mask_momentum`). A param group may also carry an
    ``exp_avg_mask`` (shaped like its params, DeepSpeed's option) that multiplies the synchronized
    momentum.
    ``bucket_numel``: elements per compressed exchange (bounds the temporary buffers).
    """

    handles_gradient_reduction = True
    supported_zero_stages = SUPPORTED_ZERO_STAGES

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, freeze_step: int, bias_correction: bool = True,
                 scale: str = "l2", mask_small_variance: bool = True, group=None, bucket_numel: int = 2 ** 25) -> None:
        validate_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                         scale=scale)
        if bucket_numel < 1:
            raise ValueError(f"OneBitAdam: bucket_numel={bucket_numel} must be >= 1")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, exp_avg_mask=None)
        super().__init__(params, defaults)
        self.freeze_step, self.bias_correction, self.scale = freeze_step, bias_correction, scale
        self.mask_small_variance, self.bucket_numel = mask_small_variance, bucket_numel
        self._group = group
        self._global_step = 0
        self._errors: Dict[Tuple[int, ...], Dict[str, torch.Tensor]] = {}  # bucket -> this rank's buffers
        self._loaded: Optional[Tuple[int, dict]] = None  # (world size, bucket -> {rank: buffers}) from a checkpoint
        self._gathered: Optional[Tuple[int, dict]] = None  # (step, bucket -> {name: (N, numel)})
        self._warned_single = False

    # ------------------------------------------------------------------ contract with strategies
    def bind_process_group(self, group) -> None:
        """Use ``group`` (the data-parallel group) for all communication; strategies call this."""
        if self._errors and group_size(group) != group_size(self._group):
            warnings.warn("OneBitAdam: the process group changed size; error-feedback buffers restart from zero")
            self._errors.clear()
        self._group = group

    @staticmethod
    def check_zero_stage(stage: int) -> None:
        check_zero_stage(stage)

    @property
    def compressing(self) -> bool:
        """True once the variance is frozen and the momentum travels in 1 bit (from step freeze_step + 1)."""
        return group_size(self._group) > 1 and self._global_step >= self.freeze_step

    def add_param_group(self, param_group: dict) -> None:
        merged = {**self.defaults, **param_group}
        validate_hparams(lr=merged["lr"], betas=merged["betas"], eps=merged["eps"],
                         weight_decay=merged["weight_decay"])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mask = group.get("exp_avg_mask")
        for p in group["params"]:
            if mask is not None and tuple(mask.shape) != tuple(p.shape):
                raise ValueError(f"OneBitAdam: exp_avg_mask of shape {tuple(mask.shape)} does not match a "
                                 f"parameter of shape {tuple(p.shape)} in its param group")

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world = group_size(self._group)
        if world == 1 and not self._warned_single:
            warnings.warn("OneBitAdam on a world size of 1 has nothing to compress: it runs as AdamW")
            self._warned_single = True
        compress = world > 1 and self._global_step >= self.freeze_step
        self._global_step += 1
        self._gathered = None
        used = set()
        for key, entries in self._buckets():
            if compress:
                self._compressed_step(key, entries, world)
                used.add(key)
            else:
                self._warmup_step(entries, world)
        if compress:
            self._errors = {k: v for k, v in self._errors.items() if k in used}
            self._loaded = None
        return loss

    def _buckets(self) -> List[Tuple[Tuple[int, ...], List[Tuple[torch.Tensor, dict]]]]:
        """Trainable params by (device, dtype), in param-group order, cut at ``bucket_numel``."""
        open_: Dict[tuple, Tuple[List[int], List[Tuple[torch.Tensor, dict]], int]] = {}
        done = []
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if not p.requires_grad:
                    continue  # frozen: no state, no communication
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"OneBitAdam does not support sparse gradients (parameter {index}, shape "
                                     f"{tuple(p.shape)}); use a dense embedding (sparse=False)")
                kind = (p.device, p.dtype)
                ids, entries, numel = open_.get(kind, ([], [], 0))
                if entries and numel + p.numel() > self.bucket_numel:
                    done.append((tuple(ids), entries))
                    ids, entries, numel = [], [], 0
                open_[kind] = (ids + [index], entries + [(p, group)], numel + p.numel())
        done += [(tuple(ids), entries) for ids, entries, _ in open_.values()]
        return done

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"], state["v_step"] = 0, 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        bc1, bc2 = _bias_corrections(self.bias_correction, group["betas"], state["step"], state["v_step"])
        adam_update(p, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], eps=group["eps"],
                    weight_decay=group["weight_decay"], bias_correction1=bc1, bias_correction2=bc2)

    def _warmup_step(self, entries: List[Tuple[torch.Tensor, dict]], world: int) -> None:
        params = [p for p, _ in entries]
        if world == 1:
            grads = [p.grad for p in params]
        else:
            # One flat all-reduce; the trailing flags tell which params had a gradient on any rank.
            ref = params[0]
            flags = torch.tensor([float(p.grad is not None) for p in params], dtype=ref.dtype, device=ref.device)
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                             + [flags])
            all_reduce(flat, self._group, tag="onebit.warmup")
            flat.div_(world)
            seen = (flat[-len(params):] > 0).tolist()
            grads = [g.view_as(p) if s else None
                     for p, g, s in zip(params, flat[:-len(params)].split([p.numel() for p in params]), seen)]
            for p, g in zip(params, grads):
                if p.grad is not None and g is not None:
                    p.grad.copy_(g)
        for (p, group), grad in zip(entries, grads):
            if grad is None:
                continue  # as AdamW: a parameter without a gradient anywhere is not stepped
            state = self._state(p)
            state["step"] += 1
            state["v_step"] += 1
            beta1, beta2 = group["betas"]
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            self._update(p, state, group)

    def _compressed_step(self, key: Tuple[int, ...], entries: List[Tuple[torch.Tensor, dict]], world: int) -> None:
        for p, group in entries:
            exp_avg = self._state(p)["exp_avg"]
            if p.grad is None:
                exp_avg.mul_(group["betas"][0])  # a missing local gradient counts as zero
            else:
                exp_avg.lerp_(p.grad, 1 - group["betas"][0])
        numels = [p.numel() for p, _ in entries]
        momenta = torch.cat([self.state[p]["exp_avg"].reshape(-1) for p, _ in entries])  # (n,)
        errors = self._error_buffers(key, momenta, world)
        synced = compressed_all_reduce(momenta, errors["worker_error"], errors["server_error"], self._group,
                                       segments=numels, scale=self.scale, tag="onebit.compressed")
        for (p, group), m in zip(entries, synced.split(numels)):
            state = self.state[p]
            state["exp_avg"].copy_(m.view_as(p))
            if group.get("exp_avg_mask") is not None:
                state["exp_avg"].mul_(group["exp_avg_mask"].to(device=p.device, dtype=p.dtype))
            if self.mask_small_variance:
                bc2 = _bias_corrections(self.bias_correction, group["betas"], 1, state["v_step"])[1]
                mask_momentum(state["exp_avg"], state["exp_avg_sq"], group["eps"], bc2)
            state["step"] += 1
            self._update(p, state, group)

    def _error_buffers(self, key: Tuple[int, ...], momenta: torch.Tensor, world: int) -> Dict[str, torch.Tensor]:
        if key in self._errors:
            return self._errors[key]
        n_worker, n_server = error_buffer_numels(momenta.numel(), world)
        buffers = {"worker_error": momenta.new_zeros(n_worker), "server_error": momenta.new_zeros(n_server)}
        if self._loaded is not None:
            saved_world, saved = self._loaded
            rank = group_rank(self._group)
            per_rank = saved.get(key, {}) if saved_world == world else {}
            if rank in per_rank and all(per_rank[rank][k].numel() == v.numel() for k, v in buffers.items()):
                for name, buf in buffers.items():
                    buf.copy_(per_rank[rank][name].reshape(-1))
            else:
                warnings.warn(f"OneBitAdam: the checkpoint holds no error-feedback buffers for rank {rank} of "
                              f"{world} (saved by {saved_world} ranks, or without consolidate_state_dict()); "
                              "they restart from zero, as DeepSpeed's 1-bit Adam does on every load")
        self._errors[key] = buffers
        return buffers

    # ------------------------------------------------------------------ checkpoints
    def consolidate_state_dict(self) -> None:
        """Collective: gather every rank's error buffers so ``state_dict()`` on any rank resumes all ranks.

        All ranks of the group must call it (as with ZeroRedundancyOptimizer); the gathered copy is
        valid until the next ``step()``. Without it, ``state_dict()`` holds this rank's buffers only.
        """
        world = group_size(self._group)
        gathered = {}
        for key in sorted(self._errors):
            gathered[key] = {}
            for name, buf in self._errors[key].items():
                out = buf.new_empty(world * buf.numel())
                all_gather(out, buf, self._group, tag="onebit.checkpoint")
                gathered[key][name] = out.view(world, -1)
        self._gathered = (self._global_step, gathered)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        world, rank = group_size(self._group), group_rank(self._group)
        gathered = self._gathered[1] if self._gathered and self._gathered[0] == self._global_step else None
        buckets = []
        for key, bufs in self._errors.items():
            if gathered is not None and key in gathered:
                errors = {r: {n: gathered[key][n][r] for n in bufs} for r in range(world)}
            else:
                errors = {rank: dict(bufs)}
            buckets.append({"params": list(key), "errors": errors})
        sd["onebit"] = {"version": _STATE_VERSION, "global_step": self._global_step, "world_size": world,
                        "buckets": buckets}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        self._errors, self._gathered = {}, None
        if extra is None:  # a state dict without our section (e.g. torch's AdamW): no error buffers
            self._global_step = max((s.get("step", 0) for s in self.state.values()), default=0)
            self._loaded = (0, {}) if self._global_step > self.freeze_step else None
            return
        self._global_step = int(extra["global_step"])
        buckets = {tuple(b["params"]): b["errors"] for b in extra["buckets"]}
        self._loaded = (int(extra["world_size"]), buckets) if buckets else None  # None: saved in warm-up


class OneBitAdamShard:
    """OneBitAdam on this rank's ZeRO stage 1/2 shard of one flat parameter buffer (for a ZeRO engine).

    Contract: the engine keeps ``numel`` parameters flat (``segments``: their numels in order, any
    alignment padding as segments of its own; each segment gets its own 1-bit scale); rank r owns
    ``[r*S, (r+1)*S)`` with ``S = ceil(numel / N)``. Instead of reduce-scattering the gradients it
    calls ``step(flat_grad)`` with the rank's LOCAL gradient of the whole buffer; ``shard`` (S
    elements, the fp32 master copy) is updated in place, and the engine all-gathers shards as usual.

    Warm-up: full-precision reduce-scatter, exact AdamW on the shard. Compression: the momentum
    lives only on its shard, so a rank cannot form ``b1 m + (1 - b1) g_i`` for the whole buffer.
    What travels is the momentum increment ``(1 - b1) g_i`` plus the rank's worker error, through
    ``compressed_reduce_scatter`` with no server recompression (the owner keeps the mean in full
    precision), and the owner applies ``m = b1 m + mean``. The exact ``b1 m`` part never goes through
    compression; docs/onebit_adam.md compares this with the all-reduce form.
    """

    def __init__(self, shard: torch.Tensor, numel: int, *, group=None, segments: Optional[Sequence[int]] = None,
                 lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int, bias_correction: bool = True, scale: str = "l2",
                 mask_small_variance: bool = True, exp_avg_mask: Optional[torch.Tensor] = None) -> None:
        validate_hparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step,
                         scale=scale)
        self.world = group_size(group)
        self.chunk = -(-int(numel) // self.world)
        if shard.numel() != self.chunk:
            raise ValueError(f"OneBitAdamShard: shard has {shard.numel()} elements; a flat buffer of {numel} over "
                             f"{self.world} ranks gives shards of ceil({numel}/{self.world}) = {self.chunk}")
        self.shard, self.numel, self.group = shard, int(numel), group
        self.segments = None if segments is None else [int(s) for s in segments]
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.freeze_step, self.bias_correction, self.scale = freeze_step, bias_correction, scale
        self.mask_small_variance, self.exp_avg_mask = mask_small_variance, exp_avg_mask
        self.state = {"step": 0, "v_step": 0, "exp_avg": torch.zeros_like(shard),
                      "exp_avg_sq": torch.zeros_like(shard), "worker_error": None}

    @classmethod
    def from_optimizer(cls, optimizer: OneBitAdam, shard: torch.Tensor, numel: int, *, param_group: int = 0,
                       group=None, segments: Optional[Sequence[int]] = None) -> "OneBitAdamShard":
        """The shard optimizer for one param group of a user's ``OneBitAdam`` (same hyperparameters)."""
        g = optimizer.param_groups[param_group]
        return cls(shard, numel, group=optimizer._group if group is None else group, segments=segments, lr=g["lr"],
                   betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"], freeze_step=optimizer.freeze_step,
                   bias_correction=optimizer.bias_correction, scale=optimizer.scale,
                   mask_small_variance=optimizer.mask_small_variance)

    @torch.no_grad()
    def step(self, flat_grad: torch.Tensor, lr: Optional[float] = None) -> None:
        """Update ``shard`` from this rank's local (unreduced) gradient of the whole flat buffer."""
        if flat_grad.numel() != self.numel:
            raise ValueError(f"OneBitAdamShard.step: flat_grad has {flat_grad.numel()} elements, expected {self.numel}")
        if lr is not None:
            self.lr = lr
        st, (beta1, beta2) = self.state, self.betas
        if self.world == 1 or st["step"] < self.freeze_step:
            padded = flat_grad.new_zeros(self.world * self.chunk)
            padded[: self.numel] = flat_grad.reshape(-1)
            grad = flat_grad.new_empty(self.chunk)
            pairwise.reduce_scatter(grad, padded, self.group, tag="onebit.warmup")
            grad.div_(self.world)
            st["v_step"] += 1
            st["exp_avg"].lerp_(grad, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        else:
            if st["worker_error"] is None:
                st["worker_error"] = flat_grad.new_zeros(self.numel)
            increment = compressed_reduce_scatter(flat_grad.reshape(-1) * (1 - beta1), st["worker_error"], None,
                                                  self.group, segments=self.segments, scale=self.scale,
                                                  tag="onebit.compressed")  # (S,)
            st["exp_avg"].mul_(beta1).add_(increment)
            if self.exp_avg_mask is not None:
                st["exp_avg"].mul_(self.exp_avg_mask)
            if self.mask_small_variance:
                bc2 = _bias_corrections(self.bias_correction, self.betas, 1, st["v_step"])[1]
                mask_momentum(st["exp_avg"], st["exp_avg_sq"], self.eps, bc2)
        st["step"] += 1
        bc1, bc2 = _bias_corrections(self.bias_correction, self.betas, st["step"], st["v_step"])
        adam_update(self.shard, st["exp_avg"], st["exp_avg_sq"], lr=self.lr, eps=self.eps,
                    weight_decay=self.weight_decay, bias_correction1=bc1, bias_correction2=bc2)

    def state_dict(self) -> dict:
        """This rank's state (the engine saves one per rank, like its other shard states)."""
        return {"version": _STATE_VERSION, "world_size": self.world, "numel": self.numel, "lr": self.lr,
                **{k: v for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("world_size") != self.world or sd.get("numel") != self.numel:
            raise ValueError(f"OneBitAdamShard: state saved for numel={sd.get('numel')} on {sd.get('world_size')} "
                             f"ranks cannot be loaded for numel={self.numel} on {self.world} ranks")
        self.lr = sd["lr"]
        for name in ("step", "v_step"):
            self.state[name] = int(sd[name])
        for name in ("exp_avg", "exp_avg_sq"):
            self.state[name].copy_(sd[name])
        we = sd["worker_error"]
        self.state["worker_error"] = None if we is None else we.to(self.shard.device, self.shard.dtype).clone()
