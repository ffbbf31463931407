"""``Zero3DStrategy(autotune=True | dict(...))``: a short probe at the start of ``fit`` picks the layout (issue 17
item 4; docs/tune.md "autotune=True").

Inside the ranks Lightning already launched (no new processes), before ``parallelize()``:

1. **Space**: ZeRO stage x offload x dp/tp/pp split of the world size x micro-batches (pp > 1) x buckets x
   activation checkpointing (x compile with ``autotune.compile``); a setting the user set explicitly
   (``Zero3DStrategy(stage=3, autotune=True)``, a Hydra value other than the schema default) is fixed, and an
   ``autotune`` restriction that excludes it is a ConfigError.
2. **Prune** with the memory plan of :mod:`lightning_scale.tune` (the LightningModule's lightning_scale GPT, the
   sequence length and per-rank batch of the dataloader's first batch) against ``memory`` per device; nothing fits:
   a ConfigError listing every family and why, on every rank (the plan is deterministic), before training.
3. **Measure** the survivors best-first by the prior: each on a deep copy of the LightningModule, through
   ``parallelize()`` + the engines with the Trainer's precision, ``warmup + steps`` optimizer steps of
   ``training_step`` on the first real batch; the slowest rank's median step and the largest rank's live tensor
   bytes (all-reduced, so every rank holds the same table); the copy, its engines and hooks freed after each.
   Each probe runs on process groups of its own: a probe that raises on some ranks only is agreed at once
   (:class:`ProbeGuard`: the first error published on the c10d store, the probe groups broken so no rank waits in
   a collective for a timeout) and ranked ``failed: rank R: <error>``; the search goes on with the next layout.
   ``compile=[False, True]`` searches compile per unit too (compile seconds apart from the steady step).
   Rank 0 decides whether the time box (``budget_s``) allows the next probe and which row won (broadcast).
4. **Apply** the winner's settings to the strategy (config and topology) and go on; rank 0 prints the ranked table
   and the override line; ``strategy.autotune_result`` records it. The RNG states are restored, so training runs
   as the same layout set by hand would.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import gc
import random
import statistics
import time
import uuid
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_scale.config import SCHEMA, ConfigError, ParallelConfig, config_from_flat
from lightning_scale.strategies.probe_guard import ProbeGuard, agreed_error, describe, probe_groups, probe_store

KNOWN = {"budget_s": 60.0, "memory": None, "steps": 2, "warmup": 1, "max_probes": None, "stages": None,
         "offloads": None, "tp": None, "pp": None, "ac": None, "buckets": (5.0, 25.0), "microbatches": None,
         "compile": None, "probe_timeout_s": 300.0, "sp": None, "relief": None}
SEARCHED = ("stage", "offload", "tp", "pp", "sp", "dp", "bucket_mb", "activation_checkpointing", "microbatches",
            "compile", "tiled_mlp", "tiled_attention", "offload_activations", "expert_parallel", "ep")
RELIEF_KEYS = {"tiled_mlp": "tiled_mlp", "tiled_attention": "tiled_attention", "offload_activations": "act_offload"}


def options(value: Any) -> Dict[str, Any]:
    """``True`` / a dict -> the autotune options with defaults; unknown keys and bad values are ConfigErrors."""
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"autotune={value!r}: use True or a dict of {', '.join(KNOWN)}")
    unknown = sorted(set(value) - set(KNOWN))
    if unknown:
        raise ConfigError(f"autotune: unknown key {unknown[0]!r}; known: {', '.join(KNOWN)}")
    out = dict(KNOWN, **value)
    for key in ("stages", "offloads", "tp", "pp", "sp", "ac", "buckets", "microbatches", "compile", "relief"):
        if out[key] is not None and not isinstance(out[key], (list, tuple)):
            out[key] = (out[key],)
        if out[key] is not None:
            out[key] = tuple(None if v in ("none", None) and key == "ac" else v for v in out[key])
    for key in ("budget_s", "probe_timeout_s"):
        if not isinstance(out[key], (int, float)) or isinstance(out[key], bool) or out[key] <= 0:
            raise ConfigError(f"autotune.{key}={out[key]!r} must be a positive number of seconds")
    if out["compile"] is not None:
        _check_compile_values(out["compile"])
    from lightning_scale.tune import RELIEF

    bad = [r for r in out["relief"] or () if r not in RELIEF]
    if bad:
        raise ConfigError(f"autotune.relief={list(out['relief'])!r}: unknown {bad[0]!r}; choose from "
                          f"{', '.join(RELIEF)} ([] for none)")
    for key in ("tp", "pp", "sp"):
        for v in out[key] or ():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"autotune.{key}={list(out[key])!r}: sizes are positive integers")
    return out


def _check_compile_values(values: Sequence[Any]) -> None:
    """``autotune.compile``: eager (False) and at most one compiled setting (True or torch.compile options)."""
    from lightning_scale.config import _check_compile

    for v in values:
        try:
            _check_compile(v)
        except ConfigError as err:
            raise ConfigError(f"autotune.compile={list(values)!r}: {err}") from None
    if len([v for v in values if v]) > 1:
        raise ConfigError(f"autotune.compile={list(values)!r}: at most one compiled setting (True or one dict of "
                          f"torch.compile options) next to False")


def compile_setting(values: Sequence[Any]) -> Any:
    """The compiled setting of a searched ``compile`` list (what a candidate with ``compile=True`` probes with)."""
    return next((v for v in values if v), True)


def explicit_settings(config: ParallelConfig, given: Optional[Sequence[str]]) -> Dict[str, Any]:
    """The searched settings the user fixed: the keywords passed (``given``), else values off the schema default."""
    values = flat_values(config)
    if given is not None:
        return {k: values[k] for k in given if k in SEARCHED}
    return {k: values[k] for k in SEARCHED if k in SCHEMA and values[k] != SCHEMA[k].default}


def flat_values(config: ParallelConfig) -> Dict[str, Any]:
    out = {}
    for flat, key in SCHEMA.items():
        if flat == "offload":
            off = config.offload
            out[flat] = {(False, False): "none", (True, False): "optimizer", (False, True): "params",
                         (True, True): "all"}[(off.optimizer != "none", off.params != "none")]
            continue
        obj = config
        for part in key.paths[0].split("."):
            obj = getattr(obj, part)
        out[flat] = obj
    return out


def with_settings(config: ParallelConfig, **flat: Any) -> ParallelConfig:
    """``config`` with flat keys replaced (the other settings kept): rebuilt through the one flat builder."""
    values = flat_values(config)
    values.update(flat)
    return config_from_flat(values)


def search_space(opts: Dict[str, Any], fixed: Dict[str, Any], world: int, n_head: int, n_layer: int
                 ) -> Tuple[Dict[str, Any], List[Tuple[int, int, int, int]]]:
    """(plan() keyword arguments, the (dp, tp, pp, sp) splits); a restriction that excludes a fixed value:
    ConfigError. Ulysses (sp) is searched only where ``autotune.sp`` names sizes or ``sp`` is set; memory relief
    (the tiled MLP, head-tiled attention, activation offload) is the ladder of :func:`lightning_scale.tune.plan`
    unless one of them is set (then that value is kept for every layout) or ``autotune.relief`` restricts it."""
    from lightning_scale.tune import _divisors

    def pick(opt_key: str, flat: str, default):
        if flat in fixed:
            if opts[opt_key] is not None and fixed[flat] not in opts[opt_key]:
                raise ConfigError(f"autotune.{opt_key}={list(opts[opt_key])} excludes {flat}={fixed[flat]!r}, set "
                                  f"explicitly; drop one of them")
            return (fixed[flat],)
        return opts[opt_key] if opts[opt_key] is not None else default

    space = dict(stages=pick("stages", "stage", (0, 1, 2, 3)), offloads=pick("offloads", "offload", None),
                 acs=pick("ac", "activation_checkpointing", (None, "full")),
                 buckets=pick("buckets", "bucket_mb", (5.0, 25.0)))
    compiles = pick("compile", "compile", (False,))
    _check_compile_values(compiles)
    space["compile_options"] = tuple(dict.fromkeys(bool(v) for v in compiles))
    from lightning_scale.tune import RELIEF

    fixed_relief = {RELIEF_KEYS[k]: fixed[k] for k in RELIEF_KEYS if fixed.get(k)}
    space["relief"] = () if fixed_relief else tuple(opts["relief"] if opts["relief"] is not None else RELIEF)
    if fixed.get("unit_modules"):  # the user's ZeRO-3 units: kept (and counted) for every layout, no split_root rung
        fixed_relief["unit_modules"] = tuple(fixed["unit_modules"])
        space["relief"] = tuple(r for r in space["relief"] if r != "split_root")
    space["fixed_relief"] = fixed_relief
    space["eps"] = (fixed["expert_parallel"],) if "expert_parallel" in fixed else None  # a user's choice is kept
    # ep (expert parallelism over the data-parallel ranks): at tp = 1, every divisor of dp dividing the expert count
    # (tune_plan._ep_options); a user's setting is kept
    space["eds"] = (fixed["ep"],) if "ep" in fixed else None
    tps, pps = pick("tp", "tp", _divisors(world)), pick("pp", "pp", _divisors(world))
    sps = pick("sp", "sp", (1,))
    splits = [(world // (t * p * q), t, p, q) for t in tps for p in pps for q in sps if world % (t * p * q) == 0]
    if "dp" in fixed and fixed["dp"] is not None:
        splits = [s for s in splits if s[0] == fixed["dp"]]
    if not splits:
        raise ConfigError(f"autotune: no dp x tp x pp x sp split of {world} ranks with tp in {list(tps)}, pp in "
                          f"{list(pps)}, sp in {list(sps)}")
    return space, splits


def default_memory(device: torch.device, local_world: int) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory * 0.9
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, local_world) * 0.8


def find_gpt(module: torch.nn.Module):
    """(the model the memory plan counts, its GPTConfig or :class:`lightning_scale.tune.Shape`): the package GPT, a
    Hugging Face PreTrainedModel, or repeated units with a token embedding (else a ConfigError)."""
    from lightning_scale.tune import find_model

    return find_model(module, "autotune")


def first_batch(trainer) -> Any:
    """The first batch of the training dataloader (not distributed yet: every rank reads the same one)."""
    source = trainer.fit_loop._data_source
    loader = source.dataloader()
    batch = next(iter(loader))
    return batch


def plan_rows(gpt_module, gpt, opts, fixed, world: int, batch_size: int, precision: str, budget: float,
              accumulate: int, unit_prefix: str = ""):
    """Every candidate of this world size as tune.Row (survivors first, by prior). ``unit_prefix``: the model's name in
    the LightningModule the engines shard (:func:`lightning_scale.tune_plan.module_prefix`)."""
    from lightning_scale.tune import _divisors, plan

    space, splits = search_space(opts, fixed, world, gpt.n_head, gpt.n_layer)
    rows = []
    for dp, tp, pp, sp in splits:
        if pp > 1:
            mbs = [batch_size // m for m in (opts["microbatches"] or _divisors(batch_size)) if batch_size % m == 0]
            if "microbatches" in fixed and fixed["microbatches"] > 1:
                mbs = [batch_size // fixed["microbatches"]] if batch_size % fixed["microbatches"] == 0 else []
        else:
            mbs = [batch_size]
        rows += plan(gpt_module, gpt, world, dp * batch_size, budget, precision=precision, tps=(tp,), pps=(pp,),
                     sps=(sp,), micro_batches=tuple(mbs) or (batch_size,), allow_compile=True,
                     unit_prefix=unit_prefix, **space)
    survivors = sorted((r for r in rows if not r.reason), key=lambda r: (r.prior, r.predicted))
    return survivors + [r for r in rows if r.reason]


# ------------------------------------------------------------------------------------------------ one probe
def _optimizers(module) -> List[torch.optim.Optimizer]:
    from lightning.pytorch.core.optimizer import _configure_optimizers, _init_optimizers_and_lr_schedulers

    if getattr(module, "_trainer", None) is None:  # a CLI probe: no Trainer, the module's own configure_optimizers
        return _configure_optimizers(module.configure_optimizers())[0]
    return _init_optimizers_and_lr_schedulers(module)[0]


def prepare(strategy, trainer, config: ParallelConfig, batch) -> Tuple[torch.nn.Module, Any, int]:
    """(a copy of the LightningModule on this rank's device where ``parallelize()`` would move it, the batch there, the
    live bytes before it). Nothing here communicates: a failure on one rank is agreed before the probe's first
    collective (``parallelize()`` broadcasts rank 0's parameters over the default group)."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from lightning_scale.materialize import has_meta
    from lightning_scale.tune_probe import _live_bytes, _space

    base = _live_bytes(_space(strategy.root_device))
    lm = strategy.lightning_module
    module = copy.deepcopy(lm, memo={id(trainer): trainer, id(lm._trainer): lm._trainer})
    module.trainer = trainer  # the same Trainer (configure_optimizers may read it)
    if not has_meta(module, recurse=True) and (config.zero.stage != 3 or config.tp > 1 or config.pp > 1):
        module.to(strategy.root_device)  # ZeRO-3 alone places its shards itself
    # on the device whole: probe_one keeps this rank's positions of the candidate's sp split (not the strategy's)
    return module, move_data_to_device(batch, strategy.root_device), base


def measure_module(module, config: ParallelConfig, topo, device, batch, steps: int, warmup: int, precision,
                   timeout=None, *, base_bytes: Optional[int] = None, accum: int = 1, group=None) -> Dict[str, float]:
    """A LightningModule (consumed: parallelized in place) through ``parallelize()`` + the engines at ``precision``:
    ``warmup + steps`` optimizer steps of its ``training_step`` on ``batch`` (``accum`` micro-batches of it per step at
    pp = 1; the pipeline schedule at pp > 1), then one more under ``LiveTensorBytes``. Returns the median step, the
    warm-up's extra seconds over that median (``compile_s``: the compile of a ``compile=True`` layout), the live
    model-state bytes between steps and the step's peak above them. Used by ``autotune=True`` (on a copy, in the
    launched ranks) and by the CLI's probes of ``--module`` (built in each probe rank). ``group``: the steps'
    barrier (the default group unless given: ``autotune=True`` keeps the probes off it)."""
    from lightning_scale.memory import LiveTensorBytes
    from lightning_scale.parallelize import parallelize
    from lightning_scale.strategies.pipeline_glue import PipelineGlue, split_batch
    from lightning_scale.strategies.precision import ZeroPrecision
    from lightning_scale.compile import compile_stats, compiled_units
    from lightning_scale.tune_probe import _live_bytes, _space

    space = _space(torch.device(device))  # a GPU: its own bytes; a CPU: every tensor (one memory)
    base = _live_bytes(space) if base_bytes is None else base_bytes
    graphs0 = compile_stats()["graphs"]
    module.log = module.log_dict = lambda *a, **k: None  # no loop is running: a probe logs nothing
    plugin = ZeroPrecision(precision, config.loss_scale)
    plugin.device_type = torch.device(device).type
    stage3, pp = config.zero.stage == 3, config.pp
    pm = parallelize(module, config, topo, device, optimizers=lambda: _optimizers(module),
                     loss_fn=PipelineGlue.loss_fn(module) if pp > 1 else None, timeout=timeout,
                     param_dtype=plugin.policy.param_dtype if stage3 else None)
    engines = pm.make_engines(precision=plugin.policy, loss_scaler=plugin.loss_scaler,
                              overlap_comm=None if len(pm.optimizers) == 1 else False)
    if not stage3:
        plugin.convert_module(module)
    glue = PipelineGlue(pm.pipeline) if pp > 1 else None
    if glue is None and accum > 1:
        parts = [tuple(t.chunk(accum)[j] for t in batch) for j in range(accum)]
    else:
        parts = [batch]

    def step() -> None:
        scale = float(plugin.loss_scaler.scale) if plugin.policy.loss_scaling else 1.0
        if glue is not None:
            inputs, targets = split_batch(batch)
            glue._begin(batch)
            with contextlib_stack(engines), plugin.forward_context():
                glue.runtime.train_step(inputs, targets, grad_scale=scale)
        else:
            for j, part in enumerate(parts):
                with contextlib_stack(engines) if j < len(parts) - 1 else contextlib_stack(()):
                    with plugin.forward_context():
                        out = module.training_step(part, 0)
                    loss = out["loss"] if isinstance(out, dict) else out
                    (loss.float() * (scale / len(parts))).backward()
        for engine in engines:
            engine.reduce_gradients()
            engine.step()
            engine.zero_grad()

    try:
        times = []
        for _ in range(warmup + steps):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        states = _live_bytes(space) - base
        # ZeRO-3's units grow by storage resize, which no aten op shows: sampled at every op
        with LiveTensorBytes(device=space, extra=getattr(pm.sharded, "unit_buffer_bytes", None)) as mem:
            step()
        median = statistics.median(times[warmup:])
        return {"step_s": median, "measured_bytes": float(states + mem.peak), "states_bytes": float(states),
                "space": "device" if space else "one memory",
                "peak_bytes": float(mem.peak), "compile_s": max(0.0, sum(times[:warmup]) - warmup * median),
                "graphs": float(compile_stats()["graphs"] - graphs0),
                "compiled_units": float(len(compiled_units(module)))}
    finally:
        for engine in engines:
            engine.remove_hooks()
        del engines, pm, glue
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class contextlib_stack:
    """``no_sync()`` of every engine (the pipeline reduces once per optimizer step)."""

    def __init__(self, engines) -> None:
        import contextlib

        self.stack, self.engines = contextlib.ExitStack(), engines

    def __enter__(self):
        for e in self.engines:
            self.stack.enter_context(e.no_sync())

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


# ------------------------------------------------------------------------------------------------ the search
def _agree(obj: Any) -> Any:
    """Rank 0's value on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _max(values: Sequence[float], device) -> List[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


_RESULT_KEYS = ("step_s", "measured_bytes", "states_bytes", "peak_bytes", "compile_s", "graphs", "compiled_units")


def probe_one(strategy, trainer, c, cfg: ParallelConfig, batch, opts: Dict[str, Any], key: str) -> Dict[str, Any]:
    """One candidate on every rank: the result (the slowest rank's step, the largest rank's bytes), or
    ``{"error": "rank R: ..."}`` on every rank when it raised on any (agreed at once: :class:`ProbeGuard`)."""
    world, rank = strategy.world_size, strategy.global_rank
    # a compiled layout recompiles once at its second step (Dynamo's first guards fail): 2 warm-up steps at least
    warmup = max(opts["warmup"], 2) if c.compile else opts["warmup"]
    t0 = time.perf_counter()
    error, module = "", None
    try:
        module, dev_batch, base = prepare(strategy, trainer, cfg, batch)
    except Exception as err:  # noqa: BLE001
        error = describe(err)
    if _max([float(bool(error))], strategy.root_device)[0]:  # agreed before the probe's first collective
        return {"error": agreed_error(error, None), "probe_s": time.perf_counter() - t0}
    topo, groups, whole = probe_groups(cfg, world, rank, opts["probe_timeout_s"])
    if topo.sp > 1:
        from lightning_scale.sequence_parallel import shard_sequence

        dev_batch = shard_sequence(dev_batch, topo.sp_rank, topo.sp)
    res = None
    guard = ProbeGuard(probe_store(), key, groups, rank)
    try:
        with guard:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res = measure_module(module, cfg, topo, strategy.root_device, dev_batch, opts["steps"],
                                         warmup, strategy.precision_plugin.precision,
                                         datetime.timedelta(seconds=float(opts["probe_timeout_s"])), base_bytes=base,
                                         group=whole)
            except Exception as err:  # noqa: BLE001 - a failing layout is a result; the others still run
                error = describe(err)
                guard.fail(error)
        del module
        failed, *values = _max([float(bool(error))] + [res[k] if res else 0.0 for k in _RESULT_KEYS],
                               strategy.root_device)
        if failed:
            return {"error": agreed_error(error, guard), "probe_s": time.perf_counter() - t0}
        out = dict(zip(_RESULT_KEYS, values))
        out.update(probe_s=time.perf_counter() - t0, warmup=warmup,
                   space="one memory" if strategy.root_device.type == "cpu" else "device")
        return out
    finally:
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - broken by the failure: gone either way
                pass
        gc.collect()


def run(strategy, trainer, value: Any, given: Optional[Sequence[str]]) -> Dict[str, Any]:
    """Search, apply the winner to ``strategy`` (config, topology), return the record (``autotune_result``)."""
    from lightning_scale.parallelize import check_config, local_topology
    from lightning_scale.tune import MiB, format_ranked, module_prefix, no_fit_message, parse_bytes

    opts = options(value)
    world, rank = strategy.world_size, strategy.global_rank
    fixed = explicit_settings(strategy.config, given)
    gpt_module, shape = find_gpt(strategy.lightning_module)
    batch = first_batch(trainer)
    x = batch[0] if isinstance(batch, (tuple, list)) else next(iter(batch.values())) if isinstance(batch, dict) else batch
    batch_size, seq_len = int(x.shape[0]), int(x.shape[-1])
    gpt = dataclasses.replace(shape, seq_len=seq_len)
    budget = (parse_bytes(opts["memory"]) if opts["memory"] is not None
              else default_memory(strategy.root_device, strategy.num_processes))
    precision = strategy.precision_plugin.precision
    prefix = module_prefix(strategy.lightning_module, gpt_module)
    rows = plan_rows(gpt_module, gpt, opts, fixed, world, batch_size, str(precision), budget,
                     trainer.accumulate_grad_batches, prefix)
    survivors = [r for r in rows if not r.reason]
    if not survivors and opts["sp"] is None and "sp" not in fixed and world > 1:
        from lightning_scale.tune import _divisors  # nothing fits whole sequences: split them (Ulysses) too

        rows = plan_rows(gpt_module, gpt, dict(opts, sp=tuple(_divisors(world))), fixed, world, batch_size,
                         str(precision), budget, trainer.accumulate_grad_batches, prefix)
        survivors = [r for r in rows if not r.reason]
        if rank == 0:
            print("[lightning_scale autotune] no layout fits whole sequences per rank: Ulysses (sp) searched too",
                  flush=True)
    if not survivors:
        raise ConfigError("autotune: " + no_fit_message(rows, budget, "autotune.memory"))
    compiled = compile_setting((fixed["compile"],) if "compile" in fixed else (opts["compile"] or ()))
    states = _rng_states()
    start, say = time.perf_counter(), (print if rank == 0 else (lambda *a, **k: None))
    say(f"[lightning_scale autotune] {len(rows)} layouts, {len(survivors)} fit {budget / MiB:,.1f} MiB/device; "
        f"measuring (budget {opts['budget_s']:g} s)", flush=True)
    run_key = _agree(f"ls_autotune/{uuid.uuid4().hex[:12]}")  # this search's keys on the c10d store
    probes = 0
    for i, row in enumerate(survivors):
        go = _agree(probes == 0 or (time.perf_counter() - start < opts["budget_s"] and
                                    (opts["max_probes"] is None or probes < opts["max_probes"])))
        if not go:
            break
        c = row.candidate
        cfg = settings_config(strategy.config, c, world, compiled)
        check_config(cfg)
        result = probe_one(strategy, trainer, c, cfg, batch, opts, f"{run_key}/{i}")
        probes += 1
        if "error" not in result:
            result["tokens_per_s"] = c.dp * c.ep * batch_size * seq_len / result["step_s"]  # every data rank
        row.result = result
        speed = f"{result['tokens_per_s']:,.0f} tokens/s" if "error" not in result else "failed: " + result["error"]
        say(f"[lightning_scale autotune] [{i + 1}/{len(survivors)}] {c.key}: {speed} "
            f"({time.perf_counter() - start:,.0f}/{opts['budget_s']:g} s)", flush=True)
    _set_rng_states(states)
    ranked = sorted((r for r in survivors if r.result and "tokens_per_s" in r.result),
                    key=lambda r: -r.result["tokens_per_s"])
    failed = [r for r in survivors if r.result and "error" in r.result]
    if not ranked:
        raise ConfigError("autotune: every probed layout failed: " +
                          "; ".join(f"{r.candidate.key}: {r.result['error']}" for r in failed))
    key = _agree(ranked[0].candidate.key)
    winner = next(r for r in ranked if r.candidate.key == key)
    c = winner.candidate
    strategy.config = settings_config(strategy.config, c, world, compiled)
    old = strategy.topology
    if (c.dp, c.tp * c.ep, c.pp, c.sp, c.ep) != (old.dp, old.tp, old.pp, old.sp, getattr(old, "ep", 1)):
        strategy.topology = local_topology(strategy.config, world, rank)  # the Trainer's groups, not the probe's
    line = ["strategy.autotune=null"] + [o for o in c.overrides(str(precision)) if not o.startswith("precision")]
    if c.compile and compiled is not True:
        line = [o if o != "strategy.compile=true" else "strategy.compile={" + ", ".join(
            f"{k}: {v}" for k, v in compiled.items()) + "}" for o in line]
    if rank == 0:
        print(format_ranked(ranked, failed=failed), flush=True)
        print("[lightning_scale autotune] winner: " + " ".join(line), flush=True)
    return {"winner": c.key, "settings": dict(settings(c, compiled), dp=c.dp), "overrides": line,
            "precision": str(precision), "predicted_bytes": winner.predicted,
            "predicted_all_bytes": winner.predicted_all,
            "measured_bytes": winner.result["measured_bytes"], "space": winner.result.get("space"), "fixed": fixed,
            "table": [dict(key=r.candidate.key, **r.result, predicted_bytes=r.predicted,
                           predicted_all_bytes=r.predicted_all) for r in ranked + failed],
            "rejected": [(r.candidate.key, r.reason) for r in rows if r.reason],
            "seconds": time.perf_counter() - start}


def settings(c, compiled: Any = True) -> Dict[str, Any]:
    """The strategy settings of candidate ``c`` (``compiled``: the compile setting of a compiled candidate)."""
    # the candidate's own keywords; sp, ep and expert_parallel always (a winner at sp=1 / ep=1 / with the experts split
    # replaces a user's launch-time setting), compile as set
    return dict(c.strategy_kwargs(), sp=c.sp, ep=c.ep, expert_parallel=c.expert_parallel,
                compile=compiled if c.compile else False)


def settings_config(config: ParallelConfig, c, world: int, compiled: Any = True) -> ParallelConfig:
    cfg = with_settings(config, **settings(c, compiled))
    if cfg.dp is not None and cfg.dp != c.dp:
        cfg = with_settings(cfg, dp=c.dp)
    return cfg.validate(world)


def _rng_states():
    import numpy

    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            random.getstate(), numpy.random.get_state())


def _set_rng_states(states) -> None:
    import numpy

    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])
    random.setstate(states[2])
    numpy.random.set_state(states[3])
