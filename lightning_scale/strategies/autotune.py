"""``Zero3DStrategy(autotune=True | dict(...))``: a short probe at the start of ``fit`` picks the layout (issue 17
item 4; docs/tune.md "autotune=True").

Inside the ranks Lightning already launched (no new processes), before ``parallelize()``:

1. **Space**: ZeRO stage x offload x dp/tp/pp split of the world size x micro-batches (pp > 1) x buckets x
   activation checkpointing; a setting the user set explicitly (``Zero3DStrategy(stage=3, autotune=True)``, a Hydra
   value other than the schema default) is fixed, and an ``autotune`` restriction that excludes it is a ConfigError.
2. **Prune** with the memory plan of :mod:`lightning_scale.tune` (the LightningModule's lightning_scale GPT, the
   sequence length and per-rank batch of the dataloader's first batch) against ``memory`` per device; nothing fits:
   a ConfigError listing every family and why, on every rank (the plan is deterministic), before training.
3. **Measure** the survivors best-first by the prior: each on a deep copy of the LightningModule, through
   ``parallelize()`` + the engines with the Trainer's precision, ``warmup + steps`` optimizer steps of
   ``training_step`` on the first real batch; the slowest rank's median step and the largest rank's live tensor
   bytes (all-reduced, so every rank holds the same table); the copy, its engines and hooks freed after each.
   Rank 0 decides whether the time box (``budget_s``) allows the next probe and which row won (broadcast).
4. **Apply** the winner's settings to the strategy (config and topology) and go on; rank 0 prints the ranked table
   and the override line; ``strategy.autotune_result`` records it. The RNG states are restored, so training runs
   as the same layout set by hand would.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import random
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lightning_scale.config import SCHEMA, ConfigError, ParallelConfig, config_from_flat

KNOWN = {"budget_s": 60.0, "memory": None, "steps": 2, "warmup": 1, "max_probes": None, "stages": None,
         "offloads": None, "tp": None, "pp": None, "ac": None, "buckets": (5.0, 25.0), "microbatches": None}
SEARCHED = ("stage", "offload", "tp", "pp", "dp", "bucket_mb", "activation_checkpointing", "microbatches")


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
    for key in ("stages", "offloads", "tp", "pp", "ac", "buckets", "microbatches"):
        if out[key] is not None and not isinstance(out[key], (list, tuple)):
            out[key] = (out[key],)
        if out[key] is not None:
            out[key] = tuple(None if v in ("none", None) and key == "ac" else v for v in out[key])
    if not isinstance(out["budget_s"], (int, float)) or out["budget_s"] <= 0:
        raise ConfigError(f"autotune.budget_s={out['budget_s']!r} must be a positive number of seconds")
    return out


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
                 ) -> Tuple[Dict[str, Any], List[Tuple[int, int, int]]]:
    """(plan() keyword arguments, the (dp, tp, pp) splits); a restriction that excludes a fixed value: ConfigError."""
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
    tps, pps = pick("tp", "tp", _divisors(world)), pick("pp", "pp", _divisors(world))
    splits = [(world // (t * p), t, p) for t in tps for p in pps if world % (t * p) == 0]
    if "dp" in fixed and fixed["dp"] is not None:
        splits = [s for s in splits if s[0] == fixed["dp"]]
    if not splits:
        raise ConfigError(f"autotune: no dp x tp x pp split of {world} ranks with tp in {list(tps)}, pp in "
                          f"{list(pps)}")
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
              accumulate: int):
    """Every candidate of this world size as tune.Row (survivors first, by prior)."""
    from lightning_scale.tune import _divisors, plan

    space, splits = search_space(opts, fixed, world, gpt.n_head, gpt.n_layer)
    rows = []
    for dp, tp, pp in splits:
        if pp > 1:
            mbs = [batch_size // m for m in (opts["microbatches"] or _divisors(batch_size)) if batch_size % m == 0]
            if "microbatches" in fixed and fixed["microbatches"] > 1:
                mbs = [batch_size // fixed["microbatches"]] if batch_size % fixed["microbatches"] == 0 else []
        else:
            mbs = [batch_size]
        rows += plan(gpt_module, gpt, world, dp * batch_size, budget, precision=precision, tps=(tp,), pps=(pp,),
                     micro_batches=tuple(mbs) or (batch_size,), **space)
    survivors = sorted((r for r in rows if not r.reason), key=lambda r: (r.prior, r.predicted))
    return survivors + [r for r in rows if r.reason]


# ------------------------------------------------------------------------------------------------ one probe
def _optimizers(module) -> List[torch.optim.Optimizer]:
    from lightning.pytorch.core.optimizer import _configure_optimizers, _init_optimizers_and_lr_schedulers

    if getattr(module, "_trainer", None) is None:  # a CLI probe: no Trainer, the module's own configure_optimizers
        return _configure_optimizers(module.configure_optimizers())[0]
    return _init_optimizers_and_lr_schedulers(module)[0]


def probe(strategy, trainer, cand, config: ParallelConfig, topo, batch, steps: int, warmup: int) -> Dict[str, float]:
    """One layout on a copy of the LightningModule: seconds per optimizer step (median) and live bytes at the peak."""
    from lightning_scale.tune import _live_bytes

    base = _live_bytes()
    lm = strategy.lightning_module
    module = copy.deepcopy(lm, memo={id(trainer): trainer, id(lm._trainer): lm._trainer})
    module.trainer = trainer  # the same Trainer (configure_optimizers may read it)
    batch = strategy.batch_to_device(batch) if topo.sp == 1 else batch
    return measure_module(module, config, topo, strategy.root_device, batch, steps, warmup,
                          strategy.precision_plugin.precision, strategy._timeout, base_bytes=base)


def measure_module(module, config: ParallelConfig, topo, device, batch, steps: int, warmup: int, precision,
                   timeout=None, *, base_bytes: Optional[int] = None, accum: int = 1) -> Dict[str, float]:
    """A LightningModule (consumed: parallelized in place) through ``parallelize()`` + the engines at ``precision``:
    ``warmup + steps`` optimizer steps of its ``training_step`` on ``batch`` (``accum`` micro-batches of it per step at
    pp = 1; the pipeline schedule at pp > 1), then one more under ``LiveTensorBytes``. Returns the median step, the
    warm-up's extra seconds over that median (``compile_s``: the compile of a ``compile=True`` layout), the live
    model-state bytes between steps and the step's peak above them. Used by ``autotune=True`` (on a copy, in the
    launched ranks) and by the CLI's probes of ``--module`` (built in each probe rank)."""
    from lightning_scale.memory import LiveTensorBytes
    from lightning_scale.parallelize import parallelize
    from lightning_scale.strategies.pipeline_glue import PipelineGlue, split_batch
    from lightning_scale.strategies.precision import ZeroPrecision
    from lightning_scale.tune import _live_bytes

    base = _live_bytes() if base_bytes is None else base_bytes
    module.log = module.log_dict = lambda *a, **k: None  # no loop is running: a probe logs nothing
    plugin = ZeroPrecision(precision, config.loss_scale)
    plugin.device_type = torch.device(device).type
    stage3, pp = config.zero.stage == 3, config.pp
    pm = parallelize(module, config, topo, device, optimizers=lambda: _optimizers(module),
                     loss_fn=PipelineGlue.loss_fn(module) if pp > 1 else None, timeout=timeout,
                     param_dtype=plugin.policy.param_dtype if stage3 else None)
    engines = pm.make_engines(precision=plugin.policy, loss_scaler=plugin.loss_scaler,
                              overlap_comm=config.zero.overlap_comm and len(pm.optimizers) == 1
                              and not config.tensor.sequence_parallel)
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
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        states = _live_bytes() - base
        with LiveTensorBytes() as mem:
            step()
        median = statistics.median(times[warmup:])
        return {"step_s": median, "measured_bytes": float(states + mem.peak), "states_bytes": float(states),
                "peak_bytes": float(mem.peak), "compile_s": max(0.0, sum(times[:warmup]) - warmup * median)}
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


def run(strategy, trainer, value: Any, given: Optional[Sequence[str]]) -> Dict[str, Any]:
    """Search, apply the winner to ``strategy`` (config, topology), return the record (``autotune_result``)."""
    from lightning_scale.parallelize import check_config, local_topology
    from lightning_scale.tune import MiB, format_ranked, no_fit_message, parse_bytes

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
    rows = plan_rows(gpt_module, gpt, opts, fixed, world, batch_size, str(precision), budget,
                     trainer.accumulate_grad_batches)
    survivors = [r for r in rows if not r.reason]
    if not survivors:
        raise ConfigError("autotune: " + no_fit_message(rows, budget, "autotune.memory"))
    states = _rng_states()
    topologies = {(strategy.topology.dp, strategy.topology.tp, strategy.topology.pp): strategy.topology}
    start, say = time.perf_counter(), (print if rank == 0 else (lambda *a, **k: None))
    say(f"[lightning_scale autotune] {len(rows)} layouts, {len(survivors)} fit {budget / MiB:,.1f} MiB/device; "
        f"measuring (budget {opts['budget_s']:g} s)", flush=True)
    probes = 0
    for i, row in enumerate(survivors):
        go = _agree(probes == 0 or (time.perf_counter() - start < opts["budget_s"] and
                                    (opts["max_probes"] is None or probes < opts["max_probes"])))
        if not go:
            break
        c = row.candidate
        cfg = settings_config(strategy.config, c, world)
        check_config(cfg)
        split = (c.dp, c.tp, c.pp)
        if split not in topologies:
            topologies[split] = local_topology(cfg, world, rank)
        error = ""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = probe(strategy, trainer, c, cfg, topologies[split], batch, opts["steps"], opts["warmup"])
        except Exception as err:  # noqa: BLE001 - a failing layout is a result; the others still run
            error, res = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:160] if str(err) else ''}", None
        failed, step_s, measured, st, pk, res_compile = _max([float(bool(error))] + [res[k] if res else 0.0 for k in (
            "step_s", "measured_bytes", "states_bytes", "peak_bytes", "compile_s")], strategy.root_device)
        probes += 1
        if failed:
            row.result = {"error": _agree(error or "failed on another rank")}
        else:
            tokens = c.dp * batch_size * seq_len
            row.result = {"tokens_per_s": tokens / step_s, "step_s": step_s, "measured_bytes": measured,
                          "states_bytes": st, "peak_bytes": pk, "compile_s": res_compile}
        speed = f"{row.result['tokens_per_s']:,.0f} tokens/s" if not failed else row.result["error"]
        say(f"[lightning_scale autotune] [{i + 1}/{len(survivors)}] {c.key}: {speed} "
            f"({time.perf_counter() - start:,.0f}/{opts['budget_s']:g} s)", flush=True)
    _set_rng_states(states)
    ranked = sorted((r for r in survivors if r.result and "tokens_per_s" in r.result),
                    key=lambda r: -r.result["tokens_per_s"])
    if not ranked:
        raise ConfigError("autotune: every probed layout failed: " +
                          "; ".join(f"{r.candidate.key}: {r.result['error']}" for r in survivors if r.result))
    key = _agree(ranked[0].candidate.key)
    winner = next(r for r in ranked if r.candidate.key == key)
    c = winner.candidate
    strategy.config = settings_config(strategy.config, c, world)
    strategy.topology = topologies[(c.dp, c.tp, c.pp)]
    line = ["strategy.autotune=null"] + [o for o in c.overrides(str(precision)) if not o.startswith("precision")]
    if rank == 0:
        print(format_ranked(ranked), flush=True)
        print("[lightning_scale autotune] winner: " + " ".join(line), flush=True)
    return {"winner": c.key, "settings": dict(settings(c), dp=c.dp), "overrides": line, "precision": str(precision),
            "predicted_bytes": winner.predicted, "predicted_all_bytes": winner.predicted_all,
            "measured_bytes": winner.result["measured_bytes"], "fixed": fixed,
            "table": [dict(key=r.candidate.key, **r.result, predicted_bytes=r.predicted,
                           predicted_all_bytes=r.predicted_all) for r in ranked],
            "rejected": [(r.candidate.key, r.reason) for r in rows if r.reason],
            "seconds": time.perf_counter() - start}


def settings(c) -> Dict[str, Any]:
    out = dict(stage=c.stage, offload=c.offload, tp=c.tp, pp=c.pp, bucket_mb=c.bucket_mb,
               activation_checkpointing=c.ac)
    if c.pp > 1:
        out["microbatches"] = c.accum
    return out


def settings_config(config: ParallelConfig, c, world: int) -> ParallelConfig:
    cfg = with_settings(config, **settings(c))
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
