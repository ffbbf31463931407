"""The table rank 0 prints at start: layout, ZeRO stage, precision, and bytes per rank."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from lightning_scale.config import ConfigError

# Optimizer state per master element (lower-case class names), for the estimate printed before the first
# step creates it. The same table as lightning_scale.estimate.STATE_PER_ELEMENT, which is imported lazily
# below: importing it here (package import time) would make `python -m lightning_scale.estimate` warn
# that the module was already imported.
_STATE_PER_ELEMENT = {"adam": 2, "adamw": 2, "adamax": 2, "nadam": 2, "radam": 2, "onebitadam": 2,
                      "adagrad": 1, "rmsprop": 1, "adadelta": 2, "sgd": 1}


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def engine_bytes(engine: Any) -> Dict[str, float]:
    mem = engine.memory_bytes()
    if mem["optimizer_state"] == 0:
        per = _STATE_PER_ELEMENT.get(type(engine.inner).__name__.lower(), 0)
        state = per * sum(m.numel() * m.element_size() for m in engine.masters)
        mem["optimizer_state"] = state
        mem["total"] = mem["params"] + mem["grads"] + mem["master"] + mem["optimizer_state"]
        # Engines that split device / host bytes: the not-yet-created state lives with the masters.
        side = "host" if getattr(engine, "offload_optimizer", False) else "device"
        if side in mem:
            mem[side] += state
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
            totals[k] = totals.get(k, 0) + v  # engines may report more keys (device / host split)
    if strategy.engines:
        rows += [("params / rank", _mb(totals["params"])),
                 ("grads / rank", _mb(totals["grads"]) + (" (transient buckets not counted)" if cfg.zero.stage == 2 else "")),
                 ("fp32 master / rank", _mb(totals["master"])),
                 ("optimizer state / rank", _mb(totals["optimizer_state"])),
                 ("model state / rank", _mb(totals["total"]))]
        if totals.get("host"):
            rows += [("  on device / rank", _mb(totals.get("device", 0))), ("  on host / rank", _mb(totals["host"]))]
    sharded = getattr(strategy, "sharded", None)
    if sharded is not None:  # ZeRO-3: what is gathered at a time (device)
        mem = sharded.memory_bytes()
        n_units = sum(1 for u in sharded.units if u.kind == "unit")
        root = sum(u.nbytes_full for u in sharded.units if u.kind == "root")
        rows += [("stage-3 units", f"{n_units} (+ root {_mb(root)}, persistent {_mb(mem['persistent'])}), "
                                   f"prefetch depth {sharded.prefetch_depth}"),
                 ("largest unit gathered", _mb(mem["largest_unit"]))]
    width = max(len(k) for k, _ in rows)
    lines = ["lightning_scale Zero3DStrategy"] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    table = estimate_section(strategy)
    if table:
        lines.append(table)
    return "\n".join(lines)


def _offload_choice(offload: Any) -> str:
    opt = getattr(offload, "optimizer", "none") != "none"
    par = getattr(offload, "params", "none") != "none"
    names = {(False, False): "none", (True, False): "optimizer", (False, True): "params", (True, True): "all"}
    return names[(opt, par)]


def estimate_section(strategy: Any) -> Optional[str]:
    """The estimator's table (lightning_scale.estimate) for this rank's real model, every stage/offload row,
    the configured one marked with *. None when there is no model."""
    from lightning_scale.estimate import STATE_PER_ELEMENT, GiB, estimate_all, format_table, model_counts

    module = getattr(strategy, "lightning_module", None)
    module = module if module is not None else getattr(strategy, "model", None)
    if module is None:
        return None
    cfg = strategy.config
    counts = model_counts(module, cfg.zero.persistent_threshold)
    engines: List[Any] = list(getattr(strategy, "engines", []) or [])
    # The engines' buckets hold exactly the trainable parameters this rank's (tp/pp-local) model trains.
    bucketed = [b.numel for e in engines for b in getattr(e, "buckets", [])]
    params = sum(bucketed) if bucketed else counts["params"]
    optimizer: Any = "adam"
    if engines and hasattr(engines[0], "inner"):
        name = type(engines[0].inner).__name__.lower()
        optimizer = name if name in STATE_PER_ELEMENT else 2
    selected = (cfg.zero.stage, _offload_choice(cfg.offload))
    dp = strategy.topology.dp
    try:
        rows = estimate_all(max(params, 1), dp=dp,
                            precision=str(getattr(strategy.precision_plugin, "precision", "32-true")),
                            largest_unit_params=min(counts["largest_unit_params"], max(params, 1)),
                            persistent_params=min(counts["persistent_params"], max(params, 1)),
                            prefetch_depth=cfg.zero.prefetch_depth, optimizer=optimizer, bucket_mb=cfg.zero.bucket_mb)
    except ConfigError as err:  # an estimate must never stop a run
        return f"  memory estimate unavailable: {err}"
    mine = next((e for e in rows if (e.stage, e.offload) == selected), rows[0])
    unit = "GiB" if max(mine.device.total, mine.host.total) >= GiB else "MiB"
    header = (f"  memory estimate per rank (python -m lightning_scale.estimate; {params:,} params, dp={dp}, "
              f"model states only, * = this run):")
    table = format_table(rows, selected=selected, unit=unit)
    return header + "\n" + "\n".join("  " + line for line in table.splitlines())
