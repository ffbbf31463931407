"""The table rank 0 prints at start: layout, ZeRO stage, precision, and bytes per rank."""

from __future__ import annotations

from typing import Any, Dict

# Optimizer state per master element, for the estimate printed before the first step creates it.
_STATE_PER_ELEMENT = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "RMSprop": 1,
                      "Adadelta": 2, "SGD": 1, "OneBitAdam": 2}


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def engine_bytes(engine: Any) -> Dict[str, float]:
    mem = engine.memory_bytes()
    if mem["optimizer_state"] == 0:
        per = _STATE_PER_ELEMENT.get(type(engine.inner).__name__, 0)
        mem["optimizer_state"] = per * sum(m.numel() * m.element_size() for m in engine.masters)
        mem["total"] = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer_state"]
    return mem


def layout_table(strategy: Any) -> str:
    topo = strategy.topology
    cfg = strategy.config
    rows = [("layout", f"dp={topo.dp} x pp={topo.pp} x tp={topo.tp} (world {topo.world_size})"),
            ("ZeRO stage", str(cfg.zero.stage)),
            ("precision", str(getattr(strategy.precision_plugin, "precision", "?")))]
    totals: Dict[str, float] = {"params": 0, "grads": 0, "master": 0, "optimizer_state": 0, "total": 0}
    for engine in strategy.engines:
        for k, v in engine_bytes(engine).items():
            totals[k] += v
    if strategy.engines:
        rows += [("params / rank", _mb(totals["params"])),
                 ("grads / rank", _mb(totals["grads"]) + (" (transient buckets not counted)" if cfg.zero.stage == 2 else "")),
                 ("fp32 master / rank", _mb(totals["master"])),
                 ("optimizer state / rank", _mb(totals["optimizer_state"])),
                 ("model state / rank", _mb(totals["total"]))]
    width = max(len(k) for k, _ in rows)
    lines = ["lightning_scale Zero3DStrategy"] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
