"""The memory plan: the predicted peak per device (model states + activations) for a batch, and the check of
step 1's measured peak against it.

The startup table (:mod:`lightning_scale.strategies.report`) prints the plan for one sequence of the model's length
(:func:`plan_rows`); after step 1 :class:`MemoryPlan` prints the plan for the real batch shape next to the measured
peak and warns past :data:`PLAN_TOLERANCE`. The activations come from a fake-tensor profile of one unit
(:func:`_profile`, :mod:`lightning_scale.activation_plan`) or, where that cannot run, a count of its layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl

from lightning_scale.config import ConfigError
from lightning_scale.estimate import GiB
from lightning_scale.strategies.report import _engine_optimizer, _estimates, _fmt, _module, measured_bytes

PLAN_PREFIX = "[lightning_scale memory]"
PLAN_TOLERANCE = 0.15  # step 1's measured peak vs the prediction: a larger gap warns


def _profile_source(strategy: Any, module: Any) -> Tuple[Any, int]:
    """(the model the activations are profiled on, the tp split still to apply to them). The live units run
    collectives at tp / sp > 1 and hold no full parameters at ZeRO-3: the project GPT is rebuilt on meta from its
    config instead, and so is a Hugging Face model at ZeRO-3 / sp without tp; other models at such layouts are
    counted from their (live) Linear sizes."""
    topo, cfg = strategy.topology, strategy.config
    gpt_cfg = getattr(module, "cfg", None)
    from lightning_scale.models.gpt import GPT, GPTConfig

    if isinstance(gpt_cfg, GPTConfig):
        import torch

        from lightning_scale.estimate import _no_init

        with torch.device("meta"), _no_init(torch):
            return GPT(gpt_cfg), topo.tp
    inner = getattr(module, "model", None) or module
    if topo.tp == 1 and topo.sp == 1 and cfg.zero.stage != 3:
        if getattr(topo, "pp", 1) > 1:
            # pp: the other stages' layers hold no storage on this rank, so a kind of layer found only there (one
            # layer a kind: DeepSeek-V4's, Hunyuan 4's) could not be profiled and was counted (1.45x / 1.8x under): a
            # Hugging Face model is rebuilt on meta from its config, every layer with its shapes
            rebuilt = _hf_on_meta(inner)
            if rebuilt is not None:
                return rebuilt, 1
        return inner, 1
    if cfg.zero.stage == 3 or topo.sp > 1:
        # ZeRO-3 / sp: a Hugging Face model rebuilt on meta from its config (the live one holds flat shards, or
        # attends through the sp exchange), at tp > 1 (or ep > 1, on the same axis) as one rank holds it (local
        # linears, expert / norm slices, local heads); tp alone at ZeRO 0-2 profiles the live units (_profile)
        rebuilt = _hf_on_meta(inner)
        if rebuilt is not None and topo.tp > 1:
            from lightning_scale.tensor_parallel.expert_alltoall import expert_data_parallel_plan
            from lightning_scale.tensor_parallel.local_view import local_on_meta

            ep = getattr(topo, "ep", 1)
            try:
                if ep > 1:
                    local_on_meta(rebuilt, expert_data_parallel_plan(rebuilt, ep), ep)
                else:
                    local_on_meta(rebuilt, cfg.tensor.plan, topo.tp, expert_parallel=cfg.tensor.expert_parallel)
            except Exception:  # noqa: BLE001 - a plan it cannot mirror: counted instead
                rebuilt = None
        if rebuilt is not None:
            return rebuilt, 1
    return None, 1


def _hf_on_meta(model: Any) -> Any:
    """A Hugging Face causal LM like ``model``, built on meta from its config (Llama 4's experts routed as
    ``parallelize()`` routes them); None for another model or one its class cannot build from the config alone."""
    import copy

    import torch

    from lightning_scale.models.hf_pipeline import is_hf_causal_lm
    from lightning_scale.sequence_parallel.models import wrapped_attention
    from lightning_scale.tensor_parallel.routed_experts import route_experts

    build = getattr(type(model), "_from_config", None)
    if not is_hf_causal_lm(model) or build is None:
        return None
    config = copy.deepcopy(model.config)
    if getattr(config, "_attn_implementation", None):  # under Ulysses: the attention it wraps (eager / sdpa)
        config._attn_implementation = wrapped_attention(config._attn_implementation)
    try:
        with torch.device("meta"):
            rebuilt = build(config)
    except Exception:  # noqa: BLE001 - a class that needs more than its config: counted instead
        return None
    route_experts(rebuilt)
    return rebuilt


def _profile(strategy: Any, module: Any, seq_len: int) -> Tuple[Any, int]:
    """(the unit profile the plan uses, the tp split applied to it) for ``seq_len`` positions per rank."""
    from lightning_scale.activation_plan import UnitProfile, profile_model, vocab_parallel_loss
    from lightning_scale.activation_profile import hidden_size
    from lightning_scale.estimate import _counted_profile, _units, _vocab_and_chunk

    source, tp = _profile_source(strategy, module)
    if source is not None:  # the live units are tiled already; the GPT rebuilt on meta is tiled for its profile
        tiled = int(getattr(strategy.config, "tiled_mlp", 0) or 0)
        heads = int(getattr(strategy.config, "tiled_attention", 0) or 0)
        # Ulysses: ``seq_len`` positions per rank, but each attention runs over all sp x seq_len of them with its
        # heads / sp under the whole sequence's mask (profile_unit scales what a mask or per-head scores cost)
        sp = int(getattr(strategy.topology, "sp", 1) or 1)
        prof = profile_model(source, seq_len=seq_len * sp, sp=sp, tp=tp, tiled_mlp=tiled, tiled_attention=heads)
        inner = getattr(module, "model", None) or module
        flags = [any(getattr(m, "_tiled_tokens", None) is not None for m in u.modules())
                 for u in _units(inner) if any(True for _ in u.parameters())]
        if tiled and source is not inner and 0 < sum(flags) < len(flags):
            # tiled_mlp_modules named only some units' MLPs: the rebuilt unit profiled untiled as well
            plain = profile_model(source, seq_len=seq_len * sp, sp=sp, tp=tp, tiled_mlp=0, tiled_attention=heads)
            prof = dataclasses.replace(prof, layers=sum(flags), untiled=(plain.per_token, len(flags) - sum(flags)))
        return prof, tp
    inner = getattr(module, "model", None) or module
    topo, cfg = strategy.topology, strategy.config
    relief = getattr(cfg, "tiled_mlp", 0) or getattr(cfg, "tiled_attention", 0)
    if topo.tp > 1 and topo.sp == 1 and cfg.zero.stage != 3 and not relief:
        # the live split units profiled at their local sizes (counting their layers missed the per-head scores of
        # sliding-window attention: Mistral / Gemma3 at tp=2 2.8-3.2x under). Tiled units stay counted (profiled
        # this way a tiled Llama + AC came out 1.38x under; counted, 0.87).
        from lightning_scale.tensor_parallel.local_view import local_linears

        with local_linears(inner):
            return profile_model(inner, seq_len=seq_len, sp=1, tp=1), 1
    units = [u for u in _units(inner) if any(True for _ in u.parameters())]
    hidden = hidden_size(units[0]) or 0
    vocab, chunk = _vocab_and_chunk(inner, None)
    return UnitProfile(per_token=_counted_profile(units[0], hidden, 1), layers=len(units), hidden=hidden,
                       vocab=vocab, chunk=chunk, unit_type=type(units[0]), source="counted", notes=(),
                       vocab_parallel=vocab_parallel_loss(inner)), 1


def _step_numel(strategy: Any) -> Optional[float]:
    """The largest tensor the engines' optimizers step (0 when every one is torch's fused Adam/AdamW)."""
    inner = [getattr(e, "inner", None) or _engine_optimizer(e) for e in getattr(strategy, "engines", []) or []]
    step_numel = max((p.numel() for o in inner if o is not None for g in o.param_groups for p in g["params"]),
                     default=None)
    stepped = [o for o in inner if o is not None]
    if stepped and all(getattr(o, "offload_step_impl", None) == "fused" for o in stepped):
        step_numel = 0  # torch's fused Adam/AdamW (CPU masters): one pass over each tensor, no temporaries of its size
    return step_numel


def _pipeline(strategy: Any) -> Any:
    """This rank's pipeline (stage, runtime, micro-batches) at pp > 1, else None."""
    glue = getattr(strategy, "_pipeline", None)
    return glue if glue is not None and getattr(glue, "runtime", None) is not None else None


def _stage_units(prof: Any, module: Any, held: Dict[int, List[Any]], ac: Any = None
                 ) -> Tuple[Dict[int, int], Dict[int, Any]]:
    """Per pipeline stage (``held``: its layers): how many repeated units it holds and, for units of several kinds
    (``prof.per_unit``), their own per-token bytes. Counting the largest unit's class alone and giving every stage
    the model's mean left a hybrid's stages 1.3-1.8x under their measured peaks (Jamba's two layer classes, OLMo
    hybrid's). ``ac``: the activation checkpointing policy (the order of the units' working sets,
    :func:`lightning_scale.activation_plan.ordered_backward`)."""
    from lightning_scale.activation_plan import _units, units_profile

    counts = {s: sum(1 for layer in layers for m in layer.modules() if type(m) is prof.unit_type)
              for s, layers in held.items()}
    every = list(_units(getattr(module, "model", None) or module))
    if prof.per_unit is None or len(prof.per_unit) != len(every):
        return counts, {}
    index = {id(u): i for i, u in enumerate(every)}
    found = {s: [index[id(m)] for layer in layers for m in layer.modules() if id(m) in index]
             for s, layers in held.items()}
    if sum(map(len, found.values())) < sum(counts.values()):  # the stage's layers are not the model's modules
        return counts, {}
    return {s: len(ids) for s, ids in found.items()}, {s: units_profile(prof, ids, ac) for s, ids in found.items()}


def stage_plan(strategy: Any, prof: Any, tp: int, micro_batch: int, seq_len: int, *, pp_rank: int,
               units: Dict[int, int], schedule: Any, prefetch: int, tied_numel: int,
               split_widths: Optional[Dict[int, float]] = None,
               stage_per_token: Optional[Dict[int, Any]] = None) -> Any:
    """The activations of pipeline rank ``pp_rank`` for a batch of ``micro_batch`` sequences split into the
    schedule's micro-batches (:func:`lightning_scale.pipeline_plan.pipeline_activations`; ``split_widths``: each
    stage's :func:`lightning_scale.pipeline_plan.split_backward_width`, for a split backward)."""
    from lightning_scale.pipeline_plan import pipeline_activations

    cfg = strategy.config
    m = schedule.num_microbatches
    if micro_batch % m:
        raise ConfigError(f"pipeline.microbatches={m} does not divide the batch size {micro_batch}")
    offload = bool(getattr(cfg, "offload_activations", False)) and strategy.root_device.type != "cpu"
    return pipeline_activations(
        schedule=schedule, pp_rank=pp_rank, units=units, seq_len=seq_len, micro_batch=micro_batch // m,
        per_token=prof.per_token, hidden=prof.hidden, vocab=prof.vocab,
        precision=str(getattr(strategy.precision_plugin, "precision", "32-true")),
        activation_checkpointing=getattr(cfg, "activation_checkpointing", None), offload_activations=offload, tp=tp,
        prefetch=prefetch, tied_numel=tied_numel, source=prof.source, notes=prof.notes, split_widths=split_widths,
        vocab_parallel=prof.vocab_parallel, stage_per_token=stage_per_token)


def plan_for_batch(strategy: Any, micro_batch: int, seq_len: int) -> Optional[Any]:
    """This run's estimate row with the activations of ``micro_batch`` sequences of ``seq_len`` (this rank's
    positions, after the sp split) attached; None without a model. At pp > 1 ``micro_batch`` is the whole batch
    of the step (the schedule splits it) and the activations are this pipeline rank's schedule walk."""
    from lightning_scale.activation_plan import mix_units, units_profile
    from lightning_scale.estimate import estimate_activations, with_activations
    from lightning_scale.pipeline_plan import split_backward_width

    estimates = _estimates(strategy)
    if estimates is None:
        return None
    row = estimates[1]
    module, cfg = _module(strategy), strategy.config
    precision = str(getattr(strategy.precision_plugin, "precision", "32-true"))
    ac = getattr(cfg, "activation_checkpointing", None)
    # nothing moves on a CPU run: the units' inputs stay where they are (host memory already)
    offload = bool(getattr(cfg, "offload_activations", False)) and strategy.root_device.type != "cpu"
    prof, tp = _profile(strategy, module, seq_len)
    glue = _pipeline(strategy) if getattr(cfg, "pp", 1) > 1 else None
    if glue is not None:
        stage = glue.stage
        units, kinds = _stage_units(prof, module, {s: [stage.chunk(s)] for s in stage.stage_ids}, ac)
        acts = stage_plan(strategy, prof, tp, micro_batch, seq_len, pp_rank=stage.pp_rank, units=units,
                          stage_per_token=kinds,
                          schedule=glue.runtime.schedule, prefetch=glue.runtime.prefetch,
                          tied_numel=sum(t.param.numel() for t in stage.tied),
                          split_widths={s: split_backward_width([stage.chunk(s)], prof.unit_type,
                                                                s == stage.num_stages - 1) for s in stage.stage_ids})
    else:
        common = dict(seq_len=seq_len, micro_batch=micro_batch, hidden=prof.hidden, vocab=prof.vocab,
                      precision=precision, activation_checkpointing=ac, offload_activations=offload, sp=1, tp=tp,
                      loss_chunk=prof.chunk, source=prof.source, notes=prof.notes, vocab_parallel=prof.vocab_parallel)
        # units of several kinds: the mean of what they keep, and the working set their backward adds in the order
        # they run (activation_plan.ordered_backward)
        per_token = units_profile(prof, range(len(prof.per_unit or ())), ac)
        acts = estimate_activations(layers=prof.layers, per_token=per_token, **common)
        if prof.untiled is not None:  # tiled_mlp_modules tiled only some units
            acts = mix_units(acts, estimate_activations(layers=prof.untiled[1], per_token=prof.untiled[0], **common))
    return with_activations(row, acts, step_tensor_numel=_step_numel(strategy))


def _model_seq_len(module: Any) -> Optional[int]:
    """The longest sequence the model is built for: GPT ``cfg.seq_len``, HF ``config.max_position_embeddings``."""
    for m in [module] + list(module.modules()):
        cfg = getattr(m, "cfg", None) or getattr(m, "config", None)
        for key in ("seq_len", "max_position_embeddings", "n_positions"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _stage_rows(strategy: Any, module: Any, seq: int, unit: str) -> List[Tuple[str, str]]:
    """pp > 1: one 'predicted peak / device' row per pipeline rank, for one sequence of ``seq`` positions per
    micro-batch: this rank's from its engines, the others' model states from their layers' parameters (the
    runtime's partition, ``stage.bounds``), every rank's activations from a walk of its own schedule."""
    from lightning_scale.estimate import _unique_trainable, with_activations
    from lightning_scale.pipeline.layers import pipeline_layers
    from lightning_scale.pipeline_plan import split_backward_width

    glue = _pipeline(strategy)
    if glue is None:
        return []
    stage, sch = glue.stage, glue.runtime.schedule
    prof, tp = _profile(strategy, module, seq)
    layers = pipeline_layers(module)
    bounds = stage.bounds
    rows = []
    for r in range(stage.pp):
        ids = sch.rank_stages(r)
        held = [layer for s in ids for layer in layers[bounds[s]:bounds[s + 1]]]
        units, kinds = _stage_units(prof, module, {s: layers[bounds[s]:bounds[s + 1]] for s in ids},
                                    getattr(strategy.config, "activation_checkpointing", None))
        mine = r == stage.pp_rank
        params = None if mine else max(sum(p.numel() for p in _unique_trainable(
            p for layer in held for p in layer.parameters())), 1)
        row = _estimates(strategy, params)[1]
        tied = sum(t.param.numel() for t in stage.tied) if mine else 0
        if not mine:  # a parameter this rank's layers share with another rank's (a tied embedding / head)
            others = {id(p) for layer in layers if layer not in held for p in layer.parameters()}
            tied = sum(p.numel() for p in _unique_trainable(p for layer in held for p in layer.parameters())
                       if id(p) in others)
        acts = stage_plan(strategy, prof, tp, sch.num_microbatches, seq, pp_rank=r, units=units, schedule=sch,
                          prefetch=glue.runtime.prefetch, tied_numel=tied, stage_per_token=kinds,
                          split_widths={s: split_backward_width(layers[bounds[s]:bounds[s + 1]], prof.unit_type,
                                                               s == sch.num_stages - 1) for s in ids})
        e = with_activations(row, acts, step_tensor_numel=_step_numel(strategy) if mine else None)
        rows.append((f"predicted peak / device, pp rank {r}", plan_line(e, unit)))
    return rows


def plan_rows(strategy: Any, module: Any, unit: str) -> List[Tuple[str, str]]:
    """The startup table's memory-plan row: the predicted peak per device for one sequence of the model's length
    (the batch is not known yet; after step 1 the strategy prints the plan for the real batch, measured). At
    pp > 1 one row per pipeline rank, one sequence per micro-batch."""
    seq = _model_seq_len(module) if module is not None else None
    sp = getattr(strategy.topology, "sp", 1)
    if not seq or seq % sp:
        return []
    pp = getattr(strategy.config, "pp", 1)
    try:
        if pp > 1:
            rows = _stage_rows(strategy, module, seq // sp, unit)
            note = (f"for {strategy.config.pipeline.microbatches} micro-batches of 1 x {seq:,} tokens (the model's "
                    "length" + (f", /sp={sp}" if sp > 1 else "") + "); step 1 prints each stage's real batch, measured")
            return rows + [("", note)] if rows else []
        e = plan_for_batch(strategy, 1, seq // sp)
    except Exception as err:  # noqa: BLE001 -- a plan must never stop a run
        return [("predicted peak / device", f"unavailable ({type(err).__name__}: {err})")]
    if e is None:
        return []
    return [("predicted peak / device", plan_line(e, unit) + f"; for 1 x {seq:,} tokens (the model's length"
             + (f", /sp={sp}" if sp > 1 else "") + "); step 1 prints the real batch's, measured")]


def _sequence_shape(batch: Any) -> Optional[Tuple[int, int]]:
    """(micro-batch, positions) of the first integer tensor of two or more dimensions in the batch (token ids)."""
    import torch
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(batch)[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point():
            return int(t.shape[0]), int(t.shape[1])
    return None


def plan_line(e: Any, unit: str = "MiB") -> str:
    scale = GiB if unit == "GiB" else 2**20
    a = e.activations
    states = e.device.total
    pipe = ""
    # ZeRO-3's gathered units and staged gradients live only inside forward / backward: not summed with the rest
    phased = " in phases (ZeRO-3)" if e.stage == 3 else ""
    if a.pipeline is not None:
        w = a.pipeline
        pipe = (f", {w.in_flight} of {w.microbatches} micro-batches in flight ({w.schedule}, at {w.at}), "
                f"p2p buffers {_fmt(w.p2p, scale, unit)}")
    return (f"{_fmt(e.first_step_peak, scale, unit)} step 1, {_fmt(e.predicted_peak, scale, unit)} from step 2 "
            f"(model states {_fmt(states, scale, unit)}{phased} + activations {_fmt(a.peak, scale, unit)}: "
            f"{a.tokens:,} tokens x {a.layers} units, checkpointing {a.policy}, kept {_fmt(a.kept, scale, unit)}, "
            f"loss {_fmt(a.loss, scale, unit)}{pipe})")


class MemoryPlan(pl.Callback):
    """Measures step 1's peak (GPU: ``max_memory_allocated``; CPU: the engines' bytes at the step's start + the
    peak of :class:`lightning_scale.memory.LiveTensorBytes` over the step) against the plan for the real batch
    shape; rank 0 prints both and warns past :data:`PLAN_TOLERANCE`. ``strategy.memory_plan`` holds the numbers."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.plan: Dict[str, Any] = {}
        strategy.memory_plan = self.plan
        self._mode: Any = None
        self._done = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._done or self._mode is not None or "predicted" in self.plan:
            return
        import torch

        from lightning_scale.compile import compiled_units

        shape = _sequence_shape(batch)
        if compiled_units(self.strategy.model):  # a dispatch mode around step 1 would change what Dynamo captures
            self.plan["skipped"] = "compiled units"
            self._done = True
            return
        try:
            e = plan_for_batch(self.strategy, *shape) if shape else None
        except Exception as err:  # noqa: BLE001 -- a plan must never stop a run, nor vanish without a word
            e, self.plan["error"] = None, f"{type(err).__name__}: {err}"
            if trainer.is_global_zero:
                print(f"{PLAN_PREFIX} no plan for step 1 ({self.plan['error']}): its peak is not checked",
                      flush=True)
        if e is None:
            self._done = True
            return
        self.plan.update(predicted=e.first_step_peak, predicted_steady=e.predicted_peak, estimate=e,
                         micro_batch=shape[0], seq_len=shape[1])
        device = self.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.plan["baseline"] = float(torch.cuda.memory_allocated(device))
            self._mode = "cuda"
        else:
            from lightning_scale.memory import LiveTensorBytes

            self.plan["baseline"] = measured_bytes(list(getattr(self.strategy, "engines", []) or []))["device"]
            sharded = getattr(self.strategy, "sharded", None)  # ZeRO-3: the gathered units grow by storage resize
            self._mode = LiveTensorBytes(device=device.type, extra=getattr(sharded, "unit_buffer_bytes", None))
            self._mode.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._mode is None or trainer.global_step < 1:
            return
        import torch

        if self._mode == "cuda":
            measured = float(torch.cuda.max_memory_allocated(self.strategy.root_device))
        else:
            self._mode.__exit__(None, None, None)
            measured = self.plan["baseline"] + self._mode.peak
        self._mode, self._done = None, True
        self.finish(measured, self._reports(trainer))

    def _reports(self, trainer: Any) -> bool:
        """Rank 0 prints; at pp > 1 the first rank of every pipeline stage (dp, sp, tp coordinates 0)."""
        if getattr(self.strategy.config, "pp", 1) <= 1:
            return trainer.is_global_zero
        c = self.strategy.topology.coords()
        return c.dp == 0 and c.sp == 0 and c.tp == 0

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # a run that stopped inside step 1
        if self._mode is not None and self._mode != "cuda":
            self._mode.__exit__(None, None, None)
        self._mode, self._done = None, True

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def finish(self, measured: float, rank_zero: bool) -> None:
        predicted = self.plan["predicted"]
        ratio = measured / predicted if predicted else float("inf")
        self.plan.update(measured=measured, ratio=ratio, within=abs(ratio - 1) <= PLAN_TOLERANCE)
        if not rank_zero:
            return
        e = self.plan["estimate"]
        pipe = e.activations.pipeline
        where = f" (pp rank {pipe.pp_rank})" if pipe is not None else ""
        print(f"{PLAN_PREFIX} step 1 peak per device{where}: measured {measured / 2**20:,.2f} MiB, predicted "
              f"{predicted / 2**20:,.2f} MiB (ratio {ratio:.2f}); plan: {plan_line(e)}", flush=True)
        if not self.plan["within"]:
            import warnings

            warnings.warn(f"{PLAN_PREFIX} step 1's measured peak{where} {measured / 2**20:,.2f} MiB differs from the "
                          f"memory plan's {predicted / 2**20:,.2f} MiB by {abs(ratio - 1):.0%} (> "
                          f"{PLAN_TOLERANCE:.0%}); see docs/long_sequences.md, the memory plan", stacklevel=2)


def install_memory_plan(strategy: Any, trainer: Any) -> None:
    """Add the step-1 memory-plan check (a Lightning callback) to a fitting Trainer, once."""
    if not any(isinstance(cb, MemoryPlan) for cb in trainer.callbacks):
        trainer.callbacks.append(MemoryPlan(strategy))
