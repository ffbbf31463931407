"""How evenly the router spreads the routes over the tp ranks when the experts are placed whole (``expert_parallel``),
or over the ep ranks (``ep > 1``: each routes its own tokens, the counts are summed over the group at each check).

With ``Zero3DStrategy(tp=N, expert_parallel=True)`` each tp rank runs the routes to its own experts, so the rank
whose experts get the most routes sets every step's pace (an even spread: 1 / N of them each). Nothing else would say
so: a router at its initial values (GPT-OSS starts its routers at zero: every token picks the same experts) or one
that collapsed onto a few experts just makes training slower. The placed experts modules count the routes per tp
rank as they run (every rank of a tp group routes the same tokens alike, so each counts them all; no message,
:func:`~lightning_scale.tensor_parallel.expert_parallel.route_load`); after optimizer steps 1, 10, 100, 1000 and
10000 this callback reads the counts since the previous check. The first check prints one line; a check where the
busiest rank ran more than ``UNEVEN`` x an even share warns (rank 0 of the tp group's first pipeline rank; at pp > 1
the first rank of each stage holding placed experts). ``strategy.expert_load`` keeps every check's record.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

from lightning_scale.strategies.report import _module
from lightning_scale.strategies.step_checks import StepChecks

LOAD_PREFIX = "[lightning_scale experts]"
UNEVEN = 1.25  # the busiest tp rank's routes over an even share: above it warns
REMEDY = {"tp": "expert_parallel=False splits every expert over tp instead, even by construction",
          "ep": "ep=1 with zero.stage=3 shards every expert over the ranks instead, even by construction"}


def load_record(load: List[int], step: int, since: int) -> Dict[str, Any]:
    total = sum(load)
    busiest = max(range(len(load)), key=load.__getitem__)
    ratio = load[busiest] * len(load) / total if total else 1.0
    return dict(steps=(since, step), routes=list(load), busiest=busiest, ratio=ratio)


def load_line(rec: Dict[str, Any]) -> str:
    since, step = rec["steps"]
    share = 100.0 * rec["routes"][rec["busiest"]] / max(1, sum(rec["routes"]))
    axis = rec.get("axis", "tp")
    return (f"{LOAD_PREFIX} steps {since}-{step}: routes per {axis} rank {rec['routes']} (busiest: {axis} rank "
            f"{rec['busiest']}, {share:.0f}% of them, {rec['ratio']:.2f}x an even share)")


class ExpertLoad(StepChecks):
    def check(self, step: int, since: int) -> None:
        from lightning_scale.tensor_parallel.expert_parallel import route_load

        load = route_load(_module(self.strategy), reset=True)
        if load is not None and self.strategy.config.ep > 1:  # ep ranks route their own tokens: add them up
            load = _summed(load, self.strategy.topology.tp_group)
        if load is None or not sum(load):
            return
        rec = load_record(load, step, since)
        rec["axis"] = "ep" if self.strategy.config.ep > 1 else "tp"
        self.history.append(rec)
        self.strategy.expert_load = self.history
        if not self._reports():
            return
        line = load_line(rec)
        if len(self.history) == 1:
            print(line, flush=True)
        if rec["ratio"] > UNEVEN:
            warnings.warn(f"{line}: the busiest rank sets every step's pace ({rec['ratio']:.2f}x the time of an even "
                          f"spread). The router sends most tokens to that rank's experts (a router still at its "
                          f"initial values, or collapsed onto a few experts: a load-balancing loss, e.g. "
                          f"output_router_logits=True, evens it); {REMEDY[rec['axis']]}", stacklevel=2)

    def _reports(self) -> bool:
        c = self.strategy.topology.coords()
        return c.dp == 0 and c.sp == 0 and c.tp == 0


def _summed(load: List[int], group) -> List[int]:
    import torch

    from lightning_scale.comm import collectives as C

    t = torch.tensor(load, dtype=torch.float64)  # gloo and nccl both reduce it (a host tensor: counts are small)
    C.all_reduce(t, group, tag="expert_load")
    return [int(v) for v in t.tolist()]


def install_expert_load(strategy: Any, trainer: Any) -> None:
    """Add the route-balance check (a Lightning callback) to a fitting Trainer when experts are placed, once."""
    placed = getattr(strategy.config.tensor, "expert_parallel", False) or strategy.config.ep > 1
    if placed and not any(
            isinstance(cb, ExpertLoad) for cb in trainer.callbacks):
        trainer.callbacks.append(ExpertLoad(strategy))
