"""Replicated parameters stay replicated over tp: a check after optimizer steps 1, 10, 100, 1000 and 10000.

Under tensor parallelism (and ``ep``, which rides the tp axis) a parameter the plan leaves whole is held by every rank
of the tp group and must stay the same on all of them: its gradient is the same everywhere (or a partial sum the plan
sums: sequence-parallel norms, ``replicated_with_grad_allreduce``, ep's dense parameters). A plan that misses one, a
parameter used on split activations with no sum over tp (transformers' own Apertus plan left its MLP activation's
trainable scalars out: 9.4e-7 off one process after 3 float64 steps), trains each rank's copy on its own partial
gradient: the copies drift apart and nothing fails. After the check steps every rank of the tp group computes each
replicated trainable parameter's sum (float64) and the group's spread (two max all-reduces of one vector); a
parameter whose copies differ by more than ``TOLERANCE`` of its size is named in a WARNING on every rank, with the
plan styles that sum a gradient over tp. ``strategy.tp_replicas`` keeps every check's record.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist

from lightning_scale.strategies.report import _module
from lightning_scale.strategies.step_checks import StepChecks

PREFIX = "[lightning_scale tp replicas]"
TOLERANCE = 1e-6  # of the parameter's sum of magnitudes: copies of a replicated parameter are bit for bit equal


@torch.no_grad()
def replica_spread(module: torch.nn.Module, group) -> Dict[str, float]:
    """``{name: spread}`` of every trainable tp-replicated parameter of ``module`` whose copies over ``group`` differ
    by more than ``TOLERANCE`` (the largest minus the smallest sum over the ranks, relative to its sum of magnitudes).
    Collective over ``group``."""
    from lightning_scale.comm import collectives as C
    from lightning_scale.tensor_parallel.sharding import tp_replicated

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and tp_replicated(p) and p.numel()]
    if not named:
        return {}
    device = named[0][1].device  # nccl reduces device tensors, gloo host ones: the parameters' own
    sums = torch.stack([p.detach().double().sum().to(device) for _, p in named])
    size = torch.stack([p.detach().double().abs().sum().to(device) for _, p in named])
    high, low = sums.clone(), -sums
    C.all_reduce(high, group, op=dist.ReduceOp.MAX, tag="tp_replicas")
    C.all_reduce(low, group, op=dist.ReduceOp.MAX, tag="tp_replicas")
    spread = (high + low) / size.clamp_min(1e-30)
    return {n: float(s) for (n, _), s in zip(named, spread.cpu()) if s > TOLERANCE}


class ReplicaCheck(StepChecks):
    def check(self, step: int, since: int) -> None:
        for engine in getattr(self.strategy, "engines", []) or []:
            engine.wait_params()  # stages 1-2: the step's parameters may still be gathering in the background
        module = _module(self.strategy)
        with self.strategy.gathered(module):
            drifted = replica_spread(module, self.strategy.topology.tp_group)
        self.history.append({"step": step, "drifted": drifted})
        self.strategy.tp_replicas = self.history
        if drifted:
            worst = sorted(drifted.items(), key=lambda kv: -kv[1])
            names = ", ".join(f"{n} ({s:.1e})" for n, s in worst[:5]) + (
                f" and {len(worst) - 5} more" if len(worst) > 5 else "")
            warnings.warn(f"{PREFIX} after step {step}: parameters the tensor-parallel plan keeps whole differ between "
                          f"the tp ranks: {names} (relative spread of their sums). Each rank trained its copy on its "
                          f"own partial gradient: the plan leaves out a parameter used on split activations. Give "
                          f"its module style 'replicated_with_grad_allreduce' (a parameter applied per element or per "
                          f"head), 'rmsnorm_split' (a norm over the split features) or split it; training goes on "
                          f"with the copies apart", stacklevel=2)


def install_replica_check(strategy: Any, trainer: Any) -> None:
    """Add the check (a Lightning callback) to a fitting Trainer when the tp axis is in use (tp > 1 or ep > 1), once."""
    if strategy.topology.tp > 1 and not any(isinstance(cb, ReplicaCheck) for cb in trainer.callbacks):
        trainer.callbacks.append(ReplicaCheck(strategy))
