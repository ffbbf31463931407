"""The table rank 0 prints at start: layout, ZeRO stage, precision in effect, attention, and bytes per rank.

The bytes lines and the estimate table below them (``python -m lightning_scale.estimate``) speak of the same
thing in the same unit: per-rank model states of this run. The header is *measured* from the engines (what
``memory_bytes()`` reports now); what the first backward / step has not allocated yet (stage-3 gradient shards,
the optimizer's m and v) is filled in from this run's row of the estimate and marked so. The header's
device / host totals then equal the table's ``*`` row (``tests/unit/test_report.py`` checks every stage). The
predicted peak row (model states + activations) and step 1's check of it:
:mod:`lightning_scale.strategies.memory_plan`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from lightning_scale.config import ConfigError
from lightning_scale.estimate import STATE_PER_ELEMENT, GiB, estimate_all, format_table, model_counts

_STATE_PER_ELEMENT = STATE_PER_ELEMENT  # one table (the package no longer imports this module eagerly)

_CATEGORIES = (("params", "params"), ("grads", "grads"), ("master", "fp32 master"),
               ("optimizer_state", "optimizer state"))


def _engine_optimizer(engine: Any) -> Any:
    """The user's optimizer an engine wraps (its class names the state per element)."""
    return getattr(engine, "optimizer", None) or getattr(engine, "inner", None)


def measured_bytes(engines: List[Any]) -> Dict[str, float]:
    """Sum of the engines' ``memory_bytes()``: params, grads, master, optimizer_state, device, host."""
    totals: Dict[str, float] = {k: 0.0 for k, _ in _CATEGORIES}
    totals.update(device=0.0, host=0.0)
    for engine in engines:
        mem = engine.memory_bytes()
        for k in totals:
            totals[k] += mem.get(k, 0)
        if "device" not in mem:  # an engine without the split keeps everything on the device
            totals["device"] += mem.get("total", sum(mem.get(k, 0) for k, _ in _CATEGORIES))
    return totals


def reconcile(measured: Dict[str, float], row: Any) -> Tuple[Dict[str, float], Dict[str, float], List[str]]:
    """(bytes per category, {"device", "host"} totals, categories still to be allocated). A category the
    engines hold nothing of yet, while this run's estimate row has bytes for it, takes the row's bytes (on the
    row's side); what exists is never replaced by a formula."""
    per_cat, sides = {}, {"device": measured["device"], "host": measured["host"]}
    pending: List[str] = []
    for key, _ in _CATEGORIES:
        est_dev, est_host = getattr(row.device, key), getattr(row.host, key)
        per_cat[key] = measured[key]
        if measured[key] == 0 and est_dev + est_host > 0:
            per_cat[key] = est_dev + est_host
            sides["device"] += est_dev
            sides["host"] += est_host
            pending.append(key)
    return per_cat, sides, pending


def _fmt(nbytes: float, scale: float, unit: str) -> str:
    return f"{nbytes / scale:,.2f} {unit}"


def memory_rows(strategy: Any, row: Any, unit: str) -> List[Tuple[str, str]]:
    """The header's bytes lines, in the table's unit; the last one equals the table's * row."""
    scale = GiB if unit == "GiB" else 2**20
    per_cat, sides, pending = reconcile(measured_bytes(list(getattr(strategy, "engines", []) or [])), row)
    rows: List[Tuple[str, str]] = []
    for key, label in _CATEGORIES:
        note = " (estimate: allocated by the first step)" if key in pending else ""
        rows.append((f"{label} / rank", _fmt(per_cat[key], scale, unit) + note))
    dev, gathered, transient = sides["device"], row.device.gathered, row.device.transient
    rows.append(("model states / rank", f"{_fmt(dev, scale, unit)} device + {_fmt(sides['host'], scale, unit)} host"))
    if gathered or transient:
        rows.append(("+ gathered, transient", f"{_fmt(gathered, scale, unit)} + {_fmt(transient, scale, unit)} "
                                              "(estimate: stage-3 units in use, buckets / fp32 grad copy)"))
    rows.append(("device / rank (peak)", f"{_fmt(dev + gathered + transient, scale, unit)} device, "
                                         f"{_fmt(sides['host'], scale, unit)} host (= the * row below)"))
    return rows


# ---------------------------------------------------------------------------------------- what runs
def precision_in_effect(strategy: Any) -> str:
    """The precision the strategy's plugin really uses (Lightning may have turned 16-mixed into bf16 on CPU)."""
    plugin = getattr(strategy, "precision_plugin", None)
    name = str(getattr(plugin, "precision", "?"))
    policy = getattr(plugin, "policy", None)
    if policy is None:
        return name
    dtype = lambda d: str(d).replace("torch.", "") if d is not None else "as built"  # noqa: E731
    parts = [f"params/grads {dtype(policy.param_dtype)}"]
    if policy.master_dtype is not None:
        parts.append(f"{dtype(policy.master_dtype)} master")
    if policy.autocast_dtype is not None:
        parts.append(f"autocast {dtype(policy.autocast_dtype)}")
    scaler = getattr(plugin, "loss_scaler", None)
    if policy.loss_scaling and scaler is not None:
        parts.append(f"dynamic loss scale {getattr(scaler, 'scale', '?')}")
    return f"{name} ({', '.join(parts)})"


def _module(strategy: Any) -> Any:
    module = getattr(strategy, "lightning_module", None)
    return module if module is not None else getattr(strategy, "model", None)


def attention_in_effect(module: Any) -> Optional[str]:
    """dense, or the block-sparse layout the attention modules really run and its density."""
    if module is None:
        return None
    from lightning_scale.nn.sparse_attention import SparseSelfAttention

    sparse = [m for m in module.modules() if isinstance(m, SparseSelfAttention)]
    if not sparse:
        return "dense"
    cfg, seq = sparse[0].sparsity_config, sparse[0].max_seq_length
    layout = cfg.make_layout(seq)  # (heads, L/block, L/block) 0/1
    blocks = layout.shape[-1]
    density = float(layout.sum()) / layout.numel()
    causal = blocks * (blocks + 1) / 2 * layout.shape[0]  # the blocks a causal dense model computes
    return (f"{type(cfg).__name__} (block {cfg.block}, seq {seq}): {density:.1%} of blocks, "
            f"{float(layout.sum()) / causal:.1%} of causal dense; {len(sparse)} layers")


def _compile_row(value: Any, module: Any) -> str:
    from lightning_scale.compile import compiled_units

    options = {} if value is True else dict(value)
    units = len(compiled_units(module)) if module is not None else 0
    extra = ", ".join(f"{k}={v}" for k, v in options.items() if k != "backend")
    return f"per unit ({units} units), backend {options.get('backend', 'inductor')}" + (f", {extra}" if extra else "")


def compile_and_checkpointing(strategy: Any, module: Any) -> List[Tuple[str, str]]:
    """torch.compile and activation checkpointing when the run uses them (config options or wrapped modules)."""
    rows = []
    cfg = getattr(strategy, "config", None)
    for option, label in (("compile", "torch.compile"), ("activation_checkpointing", "activation checkpointing")):
        value = getattr(cfg, option, None)
        if value not in (None, False, "none"):
            rows.append((label, _compile_row(value, module) if option == "compile" else str(value)))
    if getattr(cfg, "tiled_mlp", 0):
        from lightning_scale.tiled_mlp import tiled_mlps

        count = len(tiled_mlps(module)) if module is not None else 0
        rows.append(("tiled MLP", f"{cfg.tiled_mlp} positions per tile ({count} MLPs)"))
    if getattr(cfg, "tiled_attention", 0):
        from lightning_scale.tiled_attention import tiled_attentions

        count = len(tiled_attentions(module)) if module is not None else 0
        rows.append(("tiled attention", f"{cfg.tiled_attention} heads per group ({count} attentions)"))
    if module is not None and not rows:
        names = {type(m).__name__ for m in module.modules()}
        if "OptimizedModule" in names:
            rows.append(("torch.compile", "on (compiled submodules)"))
        wrapped = sum(1 for m in module.modules() if type(m).__name__ == "CheckpointWrapper")
        if wrapped:
            rows.append(("activation checkpointing", f"{wrapped} wrapped modules"))
    return rows


# ---------------------------------------------------------------------------------------- the table
def _offload_choice(offload: Any) -> str:
    opt = getattr(offload, "optimizer", "none") != "none"
    par = getattr(offload, "params", "none") != "none"
    names = {(False, False): "none", (True, False): "optimizer", (False, True): "params", (True, True): "all"}
    return names[(opt, par)]


def state_elements(optimizer: Any) -> int:
    """State elements per parameter that ``optimizer`` (a torch optimizer) will hold, read from its settings: SGD 0
    without momentum (torch keeps no buffer; the table's 1 planned a parameter's worth of bytes that never came),
    1 with; Adam / AdamW 2, 3 with ``amsgrad``; RMSprop 1, +1 with momentum, +1 centered; others by name
    (:data:`~lightning_scale.estimate.STATE_PER_ELEMENT`), else 2."""
    name = type(optimizer).__name__.lower()
    groups = getattr(optimizer, "param_groups", None) or [{}]
    if name == "sgd":
        return int(any(g.get("momentum", 0) for g in groups))
    if name in ("adam", "adamw"):
        return 2 + int(any(g.get("amsgrad", False) for g in groups))
    if name == "rmsprop":
        return (1 + int(any(g.get("momentum", 0) for g in groups))
                + int(any(g.get("centered", False) for g in groups)))
    return STATE_PER_ELEMENT.get(name, 2)


def _estimates(strategy: Any, params: Optional[int] = None) -> Optional[Tuple[List[Any], Any, int, Tuple[int, str]]]:
    """(every row, this run's row, params counted, (stage, offload)) for this rank's real model, or None.
    ``params``: the trainable parameters of another rank (another pipeline stage) instead of this rank's."""
    module = _module(strategy)
    if module is None:
        return None
    cfg = strategy.config
    counts = model_counts(module, cfg.zero.persistent_threshold)
    sharded = getattr(strategy, "sharded", None)
    if sharded is not None and getattr(sharded, "units", None):  # ZeRO-3 built: its units as configured
        counts = {**counts, **sharded.unit_counts()}  # (zero.unit_modules may cut the embeddings from the root)
    engines: List[Any] = list(getattr(strategy, "engines", []) or [])
    # The engines' buckets hold exactly the trainable parameters this rank's (tp/pp-local) model trains.
    bucketed = [b.numel for e in engines for b in getattr(e, "buckets", [])]
    if params is None:
        params = max(sum(bucketed) if bucketed else counts["params"], 1)
    optimizer: Any = "adam"
    if engines and _engine_optimizer(engines[0]) is not None:
        inner = _engine_optimizer(engines[0])
        name, k = type(inner).__name__.lower(), state_elements(inner)
        optimizer = name if STATE_PER_ELEMENT.get(name) == k else k  # the name where it says more (1-bit Adam)
    selected = (cfg.zero.stage, _offload_choice(cfg.offload))
    rows = estimate_all(params, dp=strategy.topology.dp * getattr(strategy.topology, "sp", 1),  # ZeRO: dp x sp
                        precision=str(getattr(strategy.precision_plugin, "precision", "32-true")),
                        largest_unit_params=min(counts["largest_unit_params"], params),
                        persistent_params=min(counts["persistent_params"], params),
                        root_params=min(counts["root_params"], params),
                        unit_pair_params=min(counts["unit_pair_params"], 2 * min(counts["largest_unit_params"], params)),
                        prefetch_depth=cfg.zero.prefetch_depth, optimizer=optimizer, bucket_mb=cfg.zero.bucket_mb)
    mine = next((e for e in rows if (e.stage, e.offload) == selected), rows[0])
    return rows, mine, params, selected


def estimate_section(strategy: Any, estimates=None) -> Optional[str]:
    """The estimator's table (lightning_scale.estimate) for this rank's real model, every stage/offload row,
    the configured one marked with *. None when there is no model."""
    try:
        estimates = estimates or _estimates(strategy)
    except ConfigError as err:  # an estimate must never stop a run
        return f"  memory estimate unavailable: {err}"
    if estimates is None:
        return None
    rows, mine, params, selected = estimates
    header = (f"  memory estimate per rank (python -m lightning_scale.estimate; {params:,} params, "
              f"dp={strategy.topology.dp}{_sp(strategy.topology)}, model states only, * = this run):")
    table = format_table(rows, selected=selected, unit=_unit(mine))
    return header + "\n" + "\n".join("  " + line for line in table.splitlines())


def _sp(topo: Any) -> str:
    """The sequence-parallel axis where there is one (ZeRO then shards over dp x sp)."""
    sp = getattr(topo, "sp", 1)
    return f" x sp={sp}" if sp > 1 else ""


def _unit(row: Any) -> str:
    return "GiB" if max(row.device.total, row.host.total) >= GiB else "MiB"


TP_MOSTLY_REPLICATED = 0.5  # below this fraction of the parameters split over tp, the row warns


def tensor_parallel_row(summary: Optional[Dict[str, Any]]) -> Optional[Tuple[str, str]]:
    """The startup table's "tensor parallel" row from :func:`~lightning_scale.tensor_parallel.state.split_summary`:
    the share of the parameters tp split and the largest groups it left whole on every tp rank (a model's own
    ``tp_plan`` may cover its attention only; the built-in plan adds the experts of a mixture-of-experts layer where
    it can, and the row names those it left whole and why)."""
    if not summary:
        return None
    if summary.get("exchanged"):  # ep > 1: the experts are the only split parameters
        modules, local, total = summary["experts_placed"]
        return ("expert parallel", f"experts placed whole over ep={summary['tp']} in {modules} layer"
                f"{'s' if modules > 1 else ''}: {local} of {total} per rank ({summary['fraction']:.0%} of "
                f"{summary['total']:,} parameters), routes exchanged by all-to-all; every other parameter whole, "
                "its gradient summed over ep")
    text = f"{summary['fraction']:.0%} of {summary['total']:,} parameters split over tp={summary['tp']}"
    if summary["replicated"]:
        text += "; replicated on every tp rank: " + ", ".join(f"{k} ({n:,})" for k, n in summary["replicated"])
    if summary.get("experts_placed"):
        modules, local, total = summary["experts_placed"]
        text += (f"; experts placed whole (expert_parallel) in {modules} layer{'s' if modules > 1 else ''}: "
                 f"{local} of {total} per rank")
    for pattern, why in (summary.get("experts_whole") or {}).items():
        text += f"; {pattern} left whole: {why}"
    if summary["fraction"] < TP_MOSTLY_REPLICATED:
        text += (" - WARNING: most parameters are not split (the plan covers little of this model), so tp saves "
                 "little memory here; zero.stage=3 shards what tp leaves whole over dp")
    return ("tensor parallel", text)


def root_unit_split(sharded: Any) -> Optional[Tuple[List[str], List[str]]]:
    """:func:`lightning_scale.zero.units.split_root` of a built ZeRO-3 engine: (the root unit's large modules, the
    ``zero.unit_modules`` that gather each only around its use), or None."""
    from lightning_scale.zero.units import split_root

    root = [u for u in sharded.units if u.kind == "root"]
    units = [u.module for u in sharded.units if u.kind == "unit"]
    return split_root(sharded.root, root[0].params, units) if root else None


def root_unit_hint(sharded: Any) -> str:
    """The startup table's words for :func:`root_unit_split` ("" where it has none)."""
    split = root_unit_split(sharded)
    if split is None:
        return ""
    large, suggested = split
    return (f"; the root ({', '.join(large)}) stays gathered from its first use in the forward to the backward's end: "
            f"zero.unit_modules={suggested} gathers each only around its use (docs/zero3.md)")


def layout_table(strategy: Any) -> str:
    topo, cfg = strategy.topology, strategy.config
    module = _module(strategy)
    axes = f"ep={topo.ep}" if getattr(topo, "ep", 1) > 1 else f"tp={topo.tp}"
    rows = [("layout", f"dp={topo.dp} x pp={topo.pp} x {axes}{_sp(topo)} (world {topo.world_size})"),
            ("ZeRO stage", str(cfg.zero.stage) + (f", offload {_offload_choice(cfg.offload)}"
                                                  if _offload_choice(cfg.offload) != "none" else "")),
            ("precision", precision_in_effect(strategy))]
    attention = attention_in_effect(module)
    if attention is not None:
        rows.append(("attention", attention))
    rows += compile_and_checkpointing(strategy, module)
    routed = getattr(getattr(strategy, "_parallel", None), "routed", None)
    if routed:  # Llama 4: tensor_parallel/routed_experts.py
        rows.append(("experts", f"{len(routed)} dense MoE layers routed: each token runs its k experts, not all "
                                "(transformers' every-expert path; same math)"))
    tp_row = tensor_parallel_row(getattr(getattr(strategy, "_parallel", None), "tp_summary", None))
    if tp_row is not None:
        rows.append(tp_row)
    engines = list(getattr(strategy, "engines", []) or [])
    if engines:
        rows.append(("optimizer", ", ".join(f"{type(_engine_optimizer(e)).__name__} in {type(e).__name__}"
                                            for e in engines)))
    try:
        estimates = _estimates(strategy)
    except ConfigError:
        estimates = None
    if engines and estimates is not None:
        from lightning_scale.strategies.memory_plan import plan_rows  # it reads this module's helpers

        rows += memory_rows(strategy, estimates[1], _unit(estimates[1]))
        rows += plan_rows(strategy, module, _unit(estimates[1]))
    sharded = getattr(strategy, "sharded", None)
    if sharded is not None:  # ZeRO-3: what is gathered at a time (device)
        mem = sharded.memory_bytes()
        n_units = sum(1 for u in sharded.units if u.kind == "unit")
        root = sum(u.nbytes_full for u in sharded.units if u.kind == "root")
        rows += [("stage-3 units", f"{n_units} (+ root {root / 2**20:,.2f} MiB, persistent "
                                   f"{mem['persistent'] / 2**20:,.2f} MiB), prefetch depth {sharded.prefetch_depth}"
                                   + root_unit_hint(sharded)),
                 ("largest unit gathered", f"{mem['largest_unit'] / 2**20:,.2f} MiB")]
    width = max(len(k) for k, _ in rows)
    lines = ["lightning_scale Zero3DStrategy"] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    table = estimate_section(strategy, estimates)
    if table:
        lines.append(table)
    return "\n".join(lines)
