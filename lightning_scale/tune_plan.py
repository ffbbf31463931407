"""The autotuner's layouts and their memory plan (issue 17 item 4; docs/tune.md "Candidates", "Pruning", "Long
sequences"): a :class:`Candidate` layout, the candidates of a device count (:func:`enumerate_candidates`), the memory
relief ladder of a layout that does not fit (:func:`relief_steps`, in :mod:`lightning_scale.tune_relief`), its
predicted bytes (:func:`predict_bytes`, :func:`one_memory_bytes`), the cheap prior that orders the probes (:func:`prior`) and :func:`plan`, which makes the
rows. :mod:`lightning_scale.tune` keeps the search, the table and the CLI, and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from lightning_scale.config import ConfigError
# the relief ladder (lightning_scale/tune_relief.py): plan() climbs it; the rest re-exported
from lightning_scale.tune_relief import (RELIEF, module_prefix, relief_ladder, relief_steps,  # noqa: F401
                                         relief_support, root_split_units)

MiB = 2**20
AC_CHOICES = (None, "full", "selective")


@dataclass(frozen=True)
class Candidate:
    """One layout. ``micro_batch`` sequences per forward; ``accum`` micro-batches per optimizer step per dp rank
    (``pipeline.microbatches`` at pp > 1, else ``trainer.accumulate_grad_batches``)."""

    stage: int
    offload: str
    dp: int
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    accum: int = 1
    bucket_mb: float = 25.0
    ac: Optional[str] = None
    compile: bool = False
    sp: int = 1  # Ulysses sequence parallelism: sp ranks share each sequence (L / sp positions each)
    # memory relief (plan()'s ladder, only where the layout does not fit without it): the MLPs and norms tiled over
    # tiled_mlp positions, the attention run tiled_attention heads at a time, the checkpointed units' inputs offloaded
    tiled_mlp: int = 0
    tiled_attention: int = 0
    act_offload: bool = False
    # mixture of experts at tp > 1: the experts placed whole on the tp ranks instead of every expert split
    expert_parallel: bool = False
    # mixture of experts at tp = 1: the experts placed whole on ep data-parallel ranks, routes exchanged by all-to-all
    # (data-parallel ranks: dp x ep)
    ep: int = 1
    # ZeRO-3's units (zero.unit_modules; () the repeated blocks): the relief rung split_root names the root unit's
    # large modules (embeddings, head) as units of their own, gathered only around their use
    unit_modules: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_modules", tuple(self.unit_modules or ()))  # a list after a JSON round trip

    @property
    def world(self) -> int:
        return self.dp * self.sp * self.tp * self.pp * self.ep

    @property
    def data_ranks(self) -> int:
        """The ranks that read different rows: dp x ep."""
        return self.dp * self.ep

    @property
    def split(self) -> str:
        return (f"dp{self.dp}tp{self.tp}pp{self.pp}" + (f"sp{self.sp}" if self.sp > 1 else "")
                + ("ep" if self.expert_parallel else "") + (f"ep{self.ep}" if self.ep > 1 else ""))

    @property
    def relief(self) -> str:
        """The relief settings in the key ("" for none)."""
        return (("/splitroot" if self.unit_modules else "")
                + (f"/tmlp{self.tiled_mlp}" if self.tiled_mlp else "")
                + (f"/theads{self.tiled_attention}" if self.tiled_attention else "")
                + ("/actoff" if self.act_offload else ""))

    @property
    def key(self) -> str:
        return (f"z{self.stage}/{self.offload}/{self.split}/mb{self.micro_batch}x{self.accum}"
                f"/b{self.bucket_mb:g}/ac-{self.ac or 'none'}/{'compile' if self.compile else 'eager'}{self.relief}")

    @property
    def family(self) -> str:
        return (f"stage {self.stage} offload={self.offload} dp{self.dp} tp{self.tp} pp{self.pp}"
                + (f" sp{self.sp}" if self.sp > 1 else "") + (" expert_parallel" if self.expert_parallel else "")
                + (f" ep{self.ep}" if self.ep > 1 else ""))

    def strategy_kwargs(self) -> Dict:
        kw = dict(stage=self.stage, offload=self.offload, tp=self.tp, pp=self.pp, bucket_mb=self.bucket_mb,
                  activation_checkpointing=self.ac, compile=self.compile)
        if self.pp > 1:
            kw["microbatches"] = self.accum
        if self.sp > 1:
            kw["sp"] = self.sp
        if self.tiled_mlp:
            kw["tiled_mlp"] = self.tiled_mlp
        if self.tiled_attention:
            kw["tiled_attention"] = self.tiled_attention
        if self.act_offload:
            kw["offload_activations"] = True
        if self.expert_parallel:
            kw["expert_parallel"] = True
        if self.ep > 1:
            kw["ep"] = self.ep
        if self.unit_modules:
            kw["unit_modules"] = list(self.unit_modules)
        return kw

    def overrides(self, precision: str = "32-true") -> List[str]:
        """The Hydra override line of examples/train.py (conf/): real keys only."""
        batch = self.micro_batch * (self.accum if self.pp > 1 else 1)  # data.batch_size: one dp rank's batch
        line = ["strategy=zero3d", f"strategy.stage={self.stage}", f"strategy.offload={self.offload}",
                f"strategy.tp={self.tp}", f"strategy.pp={self.pp}", f"strategy.bucket_mb={self.bucket_mb:g}",
                f"trainer.devices={self.world}", f"data.batch_size={batch}"]
        if self.sp > 1:
            line.append(f"strategy.sp={self.sp}")
        if self.pp > 1:
            line.append(f"strategy.microbatches={self.accum}")
        else:
            line.append(f"trainer.accumulate_grad_batches={self.accum}")
        if self.ac:
            line.append(f"strategy.activation_checkpointing={self.ac}")
        if self.tiled_mlp:
            line.append(f"strategy.tiled_mlp={self.tiled_mlp}")
        if self.tiled_attention:
            line.append(f"strategy.tiled_attention={self.tiled_attention}")
        if self.act_offload:
            line.append("strategy.offload_activations=true")
        if self.compile:
            line.append("strategy.compile=true")
        if self.expert_parallel:
            line.append("strategy.expert_parallel=true")
        if self.ep > 1:
            line.append(f"strategy.ep={self.ep}")
        if self.unit_modules:
            line.append(f"strategy.unit_modules=[{','.join(self.unit_modules)}]")
        group = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16_true"}
        if precision not in group:
            raise ConfigError(f"--precision={precision!r}: conf/precision has {', '.join(group)}")
        return line + [f"precision={group[precision]}"]


@dataclass
class Row:
    candidate: Candidate
    predicted: float = 0.0  # device bytes per rank
    predicted_all: float = 0.0  # + host bytes (what a CPU probe measures)
    reason: str = ""  # why rejected ("" = a survivor)
    prior: float = 0.0
    result: Optional[Dict] = None  # what a probe measured (tokens_per_s, measured_bytes, ...) or {"error": ...}


@dataclass(frozen=True)
class Shape:
    """What the planner needs of a model that is not the package GPT (``--module``, ``autotune=True``): head and layer
    counts (tp / pp divisibility), the sequence length and vocabulary of the probes' random tokens, and the parameters
    of the embeddings and the head (a pipeline's heaviest stage). ``module``: the LightningModule's import path (the
    CLI's probes build it in each rank); ``n_head`` None: unknown, tp is not searched."""

    n_head: Optional[int]
    n_layer: int
    seq_len: int
    vocab_size: int
    d_model: int = 0
    n_kv_head: Optional[int] = None
    embed_params: int = 0
    head_params: int = 0
    tie_weights: bool = False
    module: Optional[str] = None
    name: str = "model"
    sys_path: Tuple[str, ...] = ()
    n_experts: int = 0  # routed experts per mixture-of-experts layer (0: none): tp > 1 also tries expert_parallel,
    # tp = 1 also ep > 1
    unit_prefix: str = ""  # the model's qualified name in the LightningModule (+ "."): zero.unit_modules names there


def _embed_head(gpt) -> Tuple[float, float]:
    """Parameters of the embeddings (token + learned positions) and of an untied head."""
    if isinstance(gpt, Shape):
        return float(gpt.embed_params), float(gpt.head_params)
    embed = gpt.vocab_size * gpt.d_model + gpt.seq_len * gpt.d_model
    return float(embed), float(0 if gpt.tie_weights else gpt.vocab_size * gpt.d_model)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------------------------ candidates
def enumerate_candidates(gpt, devices: int, global_batch: int, *, stages=(0, 1, 2, 3), offloads=None,
                         tps=None, pps=None, buckets=(5.0, 25.0), acs=(None, "full"), compile_options=(False,),
                         micro_batches=None, sps=(1,), eps=None, eds=None) -> Tuple[List[Candidate], List[Row]]:
    """Every layout of ``devices`` for the GPTConfig (or :class:`Shape`) ``gpt``; (candidates, rows rejected by
    arithmetic). ``sps``: Ulysses degrees to try (None: every divisor; the default 1: none). ``eps``: the
    ``expert_parallel`` values to try (None: both where the model has experts tp places, else False). ``eds``: the ``ep``
    sizes to try at tp = 1 (None: 1 and every divisor of the data-parallel ranks that divides the expert count)."""
    if not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"--devices={devices!r} must be a positive integer")
    for name, values in (("--tp", tps), ("--pp", pps), ("--sp", sps)):
        for v in values or ():
            if not isinstance(v, int) or v < 1 or devices % v:
                raise ConfigError(f"{name}={v} does not divide --devices={devices}")
    rejected: List[Row] = []
    cands: List[Candidate] = []
    for tp in (tps or _divisors(devices)):
        for pp in (pps or _divisors(devices // tp)):
            if devices % (tp * pp):
                continue
            for sp in (sps or _divisors(devices // (tp * pp))):
                if devices % (tp * pp * sp):
                    continue
                data = devices // (tp * pp * sp)  # the data-parallel ranks: dp x ep
                probe = Candidate(stage=0, offload="none", dp=data, tp=tp, pp=pp, sp=sp)
                why = _split_problem(gpt, data, tp, pp, sp, global_batch)
                experts = _expert_options(gpt, tp, eps)
                if not why and not experts:
                    why = (f"expert_parallel=True: tp={tp} places no experts (tp > 1 dividing the "
                           f"{getattr(gpt, 'n_experts', 0) or 0} experts per layer needed)")
                if why:
                    rejected.append(Row(probe, reason=why))
                    continue
                per_rank = global_batch // data
                for ep_size in _ep_options(gpt, tp, data, eds):
                    probe = dataclasses.replace(probe, dp=data // ep_size, ep=ep_size)
                    cands += _split_candidates(probe, per_rank, experts, rejected, stages=stages, offloads=offloads,
                                               micro_batches=micro_batches, buckets=buckets, acs=acs,
                                               compile_options=compile_options)
    return cands, rejected


def _split_candidates(probe: Candidate, per_rank: int, experts, rejected: List[Row], *, stages, offloads,
                      micro_batches, buckets, acs, compile_options) -> List[Candidate]:
    """Every stage x offload x micro-batch x bucket x checkpointing x compile x expert placement of one split
    (``probe``'s dp, tp, pp, sp, ep); what the split cannot run goes to ``rejected``."""
    from lightning_scale.estimate import CHOICES

    out: List[Candidate] = []
    for stage, offload in CHOICES:
        if stage not in stages or (offloads and offload not in offloads):
            continue
        if stage == 3 and probe.tp > 1 and probe.pp > 1:
            rejected.append(Row(dataclasses.replace(probe, stage=3, offload=offload),
                                reason="zero.stage=3 composes with tp or pp, not both"))
            continue
        for mb in (micro_batches or _divisors(per_rank)):
            if per_rank % mb:
                continue
            accum = per_rank // mb
            if probe.pp > 1 and accum < probe.pp:  # fewer micro-batches than stages: mostly bubble
                continue
            for bucket in (buckets if stage in (0, 1, 2) else (25.0,)):
                for ac in acs:
                    for comp in compile_options:
                        for placed in experts:
                            out.append(dataclasses.replace(
                                probe, stage=stage, offload=offload, micro_batch=mb, accum=accum,
                                bucket_mb=float(bucket), ac=ac, compile=bool(comp), expert_parallel=placed))
    return out


def _ep_options(gpt, tp: int, data: int, eds=None) -> Tuple[int, ...]:
    """The ``ep`` sizes of a split with ``data`` data-parallel ranks: 1, and at tp = 1 every divisor of ``data`` that
    divides the expert count of a mixture of experts; ``eds`` (a user's fixed setting) keeps only those values."""
    n = getattr(gpt, "n_experts", 0) or 0
    valid = (1,) + tuple(e for e in _divisors(data) if e > 1 and tp == 1 and n and n % e == 0)
    return valid if eds is None else tuple(v for v in valid if v in eds)


def _expert_options(gpt, tp: int, eps=None) -> Tuple[bool, ...]:
    """A mixture of experts at tp > 1 is tried both ways (every expert split, the experts placed whole) where tp
    divides its expert count; ``eps`` (a user's fixed setting) keeps only those values."""
    n = getattr(gpt, "n_experts", 0) or 0
    valid = (False, True) if tp > 1 and n and n % tp == 0 else (False,)
    return valid if eps is None else tuple(v for v in valid if v in eps)


def _split_problem(gpt, dp: int, tp: int, pp: int, sp: int, global_batch: int) -> str:
    """Why a dp x tp x pp x sp split cannot run this model ("" if it can)."""
    kv = getattr(gpt, "n_kv_head", None)
    name = getattr(gpt, "name", "the model")
    if (tp > 1 or sp > 1) and gpt.n_head is None:
        return f"{'tp' if tp > 1 else 'sp'}={tp if tp > 1 else sp}: the head count of {name} is unknown"
    if tp > 1 and gpt.n_head % tp:
        return f"tp={tp} does not divide model.n_head={gpt.n_head}"
    if tp > 1 and kv and kv % tp:
        return f"tp={tp} does not divide the {kv} key/value heads"
    if sp > 1 and gpt.n_head % (tp * sp):
        return f"sp={sp} does not divide the {gpt.n_head // tp} heads per tp rank (model.n_head={gpt.n_head}, tp={tp})"
    if sp > 1 and kv and kv % (tp * sp):
        return f"sp={sp} does not divide the {kv // tp} key/value heads per tp rank"
    if sp > 1 and gpt.seq_len % sp:
        return f"sp={sp} does not divide the sequence length {gpt.seq_len}"
    if pp > 1 and gpt.n_layer % pp:
        return f"pp={pp} does not divide model.n_layer={gpt.n_layer}"
    if global_batch % dp:
        return f"--global-batch={global_batch} sequences is not divisible by dp={dp}"
    return ""




# ------------------------------------------------------------------------------------------------ estimate
_ACTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {shape key: activation plan}


def predict_bytes(model, gpt, c: Candidate, precision: str = "32-true", unit_prefix: str = "",
                  counts_cache: Optional[Dict] = None) -> Tuple[float, float]:
    """(device bytes per rank: model states + activations of one micro-batch + the step's scratch, the same + the
    host's model states). On a CPU both spaces are one memory: the probes measure the second. ``unit_prefix``:
    ``model``'s name in the module the engine shards (``c.unit_modules`` are named there). ``counts_cache``: a dict
    kept across the calls of one plan (the model's parameter counts per unit choice: a walk of every parameter)."""
    from lightning_scale import estimate as E

    units = tuple(u[len(unit_prefix):] if unit_prefix and u.startswith(unit_prefix) else u for u in c.unit_modules)
    cache = {} if counts_cache is None else counts_cache
    if units not in cache:
        cache[units] = E.model_counts(model, units=units or None)
    counts = cache[units]
    embed, head = _embed_head(gpt)
    blocks = counts["params"] - embed - head
    params = counts["params"] if c.pp == 1 else blocks / c.pp + max(embed, head)  # the heaviest stage
    params /= c.tp
    unit = counts["largest_unit_params"] / c.tp
    pair = counts["unit_pair_params"] / c.tp  # a unit and the next one: gathered / staged together
    # ZeRO-3's root unit (embeddings, final norm, head), gathered through the whole forward and backward; a
    # pipeline stage holds the embedding or the head (the heaviest stage, as ``params``)
    root = (counts["root_params"] if c.pp == 1 else max(embed, head)) / c.tp
    if c.ep > 1:  # every expert on one of the ep ranks, the rest whole: the experts' share of the blocks / ep
        share = expert_share(model) * (1 - 1 / c.ep)
        params -= share * (blocks if c.pp == 1 else blocks / c.pp)
        unit -= share * counts["largest_unit_params"]
        pair -= share * counts["unit_pair_params"]
    shards = c.dp * c.sp  # ZeRO shards over dp x sp (every sp rank of a replica holds the same parameters)
    est = E.estimate(max(1.0, params), dp=shards, stage=c.stage, offload=c.offload, precision=precision,
                     largest_unit_params=min(unit, params), bucket_mb=c.bucket_mb, optimizer="adamw",
                     root_params=min(root, params), unit_pair_params=min(pair, 2 * min(unit, params)))
    key = (gpt.seq_len, c.micro_batch, precision, c.ac, c.tp, c.sp, c.tiled_mlp, c.tiled_attention, c.act_offload)
    cache = _ACTS.setdefault(model, {})
    if key not in cache:  # the profile runs the unit on fake tensors: once per shape
        cache[key] = E.activations_for_model(model, seq_len=gpt.seq_len, micro_batch=c.micro_batch,
                                             precision=precision, activation_checkpointing=c.ac, tp=c.tp, sp=c.sp,
                                             tiled_mlp=c.tiled_mlp, tiled_attention=c.tiled_attention,
                                             offload_activations=c.act_offload)
    acts = cache[key]
    if c.pp > 1:  # a stage holds layers/pp units, and 1F1B keeps up to pp micro-batches' activations in flight
        acts = dataclasses.replace(acts, kept=acts.kept / c.pp * min(c.accum, c.pp))
    # the largest tensor one optimizer step call sees: a parameter (stage 0 steps the user's params), a flat
    # bucket's shard (stages 1-2) or the largest unit's shard (stage 3; the root unit holds embeddings and head)
    if c.stage == 0:
        step_numel = max(p.numel() for p in model.parameters()) / c.tp
    elif c.stage in (1, 2):
        step_numel = min(params, c.bucket_mb * MiB / 4) / shards
    else:
        step_numel = max(unit, params - counts["largest_unit_params"] * gpt.n_layer / c.pp / c.tp) / shards
    est = E.with_activations(est, acts, step_tensor_numel=step_numel)
    # stages 1-2 accumulating over micro-batches (no_sync) hold every gradient whole until the last one is reduced
    # into the shard: the later micro-batches' activations sit on top of that (measured: +30 MiB on the bench GPT)
    accumulated = params * E._PRECISION_BYTES[E._precision_key(precision)][1] if (
        c.stage in (1, 2) and c.accum > 1) else 0.0
    if c.stage == 3:  # in phases: the gathered units and staged gradients live only inside forward and backward
        resident, compute, step = est.stage3_phases(est.activation_bytes,
                                                    held=est.device.grads if c.accum > 1 else 0.0)
        device = resident + max(compute, step)
    else:
        device = est.device.total + est.activation_bytes + est.step_scratch + accumulated
    return device, one_memory_bytes(est, accumulated, c.accum)


_EXPERT_SHARE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def expert_share(model) -> float:
    """The fraction of ``model``'s repeated units' parameters in transformers experts modules (what ep places)."""
    if model not in _EXPERT_SHARE:
        from lightning_scale.activation_plan import _units
        from lightning_scale.tensor_parallel.experts import is_experts

        units = [u for u in _units(model) if any(True for _ in u.parameters())]
        total = sum(p.numel() for u in units for p in u.parameters())
        experts = sum(p.numel() for u in units for m in u.modules() if is_experts(m)
                      for p in m.parameters(recurse=False))
        _EXPERT_SHARE[model] = experts / total if total else 0.0
    return _EXPERT_SHARE[model]


def one_memory_bytes(est, accumulated: float = 0.0, accum: int = 1) -> float:
    """The peak live tensor bytes of a step when device and host are one memory (a CPU run): what the probes measure.

    Each model state counts once, wherever it lives: offload's host copy of a tensor in the same dtype *is* the
    device tensor on a CPU (the reducer aliases the fp32 master to the parameter shard, the gradient copy to the
    gradient shard: ``master_aliased``; parameter offload's device working copy is the host shard), so in fp32 the host
    master and host gradients are not added again; in mixed
    precision they are real fp32 copies. The step's transients are phases, not a sum: the activation peak (at the
    loss, before a gradient exists) with the gathered units, or the end of the backward (its staging buffers + the
    gradients), or the optimizer step (the gradients + its scratch). Stages 0-2 without offload keep their flat
    gradient buffer between steps; ZeRO-3 and the offloaded copies free theirs at ``zero_grad``. Checked against the
    probes' measurement on the bench GPT (fp32, 2 ranks): every stage x offload, mb 4 + full AC and mb 1 without AC,
    within 0-12% (docs/tune.md). ``accumulated``: whole gradients held while micro-batches accumulate (stages 1-2),
    alive with the activations of the later ones (ZeRO-3: its gradient shards, with ``accum`` micro-batches). With
    activation checkpointing the backward is a phase of its own: what is kept + one unit recomputed + the gradients
    staged for their reduction. ZeRO-3 gathers its root unit (embeddings, head) for the whole forward and backward
    (in ``gathered``); the backward's end holds it, its gradients and every gradient shard."""
    from lightning_scale.estimate import _PRECISION_BYTES

    d, h = est.device, est.host
    aliased = _PRECISION_BYTES[est.precision][2] == 0  # no separate master dtype: the copies would be aliases
    # parameter offload without a master dtype: the device's working copy of the shard (its master) is the host shard
    work_copy = 0.0 if aliased and est.offload == "params" else d.master
    resident = d.params + h.params + work_copy + d.optimizer_state + h.optimizer_state + (0.0 if aliased else h.master)
    grads = max(d.grads, h.grads) if aliased else d.grads + h.grads
    if est.stage < 3 and est.offload == "none":  # the flat gradient buffer (stage 0: full, 1-2: the shard) stays
        resident, grads = resident + grads, 0.0  # allocated between steps (zero_grad zeroes it)
    a = est.activations
    host_acts = a.host if a is not None else 0.0  # offloaded unit inputs: the same memory on a CPU
    if est.stage == 3 and accum > 1:  # the gradient shards of the earlier micro-batches (reduced into, kept)
        accumulated += grads
    # ZeRO-3's backward ends with the root unit's reduction: its gathered buffer and its gradients (the transient)
    # next to the gradient shards of every other unit (measured: 52.3 MiB of 54.2 at the step's peak, bench GPT)
    phases = [est.activation_bytes + host_acts + d.gathered + accumulated, d.transient + grads + est.root_gathered,
              grads + est.step_scratch]
    if a is not None and a.pipeline is None and a.policy != "none":
        # checkpointing moves the activation peak into the backward (a unit recomputed), where the gradients
        # staged for their reduction are alive: measured +33 MiB at L=4096 on the bench GPT without this phase
        phases.append(a.kept + host_acts + a.recompute + d.transient + d.gathered + accumulated)
    return resident + max(phases)


def prior(c: Candidate) -> float:
    """A cheap guess of the step time relative to plain data parallel (lower is better), from the CPU figures in
    shared/PEERS.md and bench/RESULTS.md: sharding and offload cost a little, tp and recompute a lot, the pipeline
    its bubble, small micro-batches their per-call overhead."""
    t = {0: 1.0, 1: 1.04, 2: 1.06, 3: 1.14}[c.stage]
    t *= {"none": 1.0, "optimizer": 1.12, "params": 1.08, "all": 1.2}[c.offload]
    t *= 1.0 + 0.2 * (c.tp > 1)
    # ep: two all-to-alls per MoE layer each way, the whole parameters' gradients summed at the step (2 CPU ranks,
    # HF Mixtral: 0.96x of ZeRO-2 over the same ranks, bench/RESULTS.md 2026-12-06)
    t *= 1.04 if c.ep > 1 else 1.0
    # measured at L=2048 on the bench GPT (2 ranks, docs/tune.md "Long sequences"): sp=2 1.06, the tiled MLP 1.11,
    # + head tiling 1.17, activation offload + 0.015 over full AC (a CPU: no copy across a bus)
    t *= 1.0 + 0.08 * (c.sp > 1)  # two all-to-alls per attention, forward and backward
    # a split root: the embeddings and the head gathered around their use, one more unit each (hooks, a gather not
    # overlapped); measured 0.94x the whole root's tokens/s (bench GPT, z3 dp2 mb2, 4 rounds, 2026-12-07)
    t *= 1.06 if c.unit_modules else 1.0
    # the tiled MLP recomputes each tile's forward: x1.16 measured at 512-2048 positions (tiles of 128-512), x1.33 at
    # 128 (tiles of 32: the MLP is most of a short sequence's compute); z2 dp2, 3 rounds, 2026-12-07
    if c.tiled_mlp:
        t *= 1.16 + 0.17 * max(0.0, min(1.0, math.log2(128 / c.tiled_mlp) / 2))
    t *= (1.06 if c.tiled_attention else 1.0) * (1.03 if c.act_offload else 1.0)
    if c.pp > 1:
        t *= 1.1 * (c.accum + c.pp - 1) / c.accum
    t *= {None: 1.0, "selective": 1.12, "full": 1.33}[c.ac]
    t *= 1.0 + 0.03 * (c.accum - 1) if c.pp == 1 else 1.0
    t *= 1.0 + 0.2 / c.micro_batch  # a forward of one sequence runs the small-matrix kernels
    t *= 1.02 if (c.stage < 3 and c.bucket_mb < 10) else 1.0
    t *= 0.95 if c.compile else 1.0  # inductor fuses the elementwise ops (a guess; the probe decides)
    return t


def plan(model, gpt, devices: int, global_batch: int, budget_bytes: float, *, precision: str = "32-true",
         allow_compile: bool = False, relief: Sequence[str] = RELIEF, fixed_relief: Optional[Dict] = None,
         unit_prefix: Optional[str] = None, **space) -> List[Row]:
    """Every candidate as a Row: survivors (reason "") sorted by prior, then the rejected with their reasons.

    A layout that does not fit climbs its relief ladder (:func:`relief_steps`: at ZeRO-3 the root's embeddings and
    head as units of their own, tiled MLP, head-tiled attention, activation offload; ``relief`` names the rungs
    allowed, () none), taking a rung only where it lowers the
    prediction (the activation peak may sit in the loss, not in the units): the first rung that fits is the
    survivor, the rungs below it are rejected with their predicted bytes; one that fits as it is gets no relief
    (each rung costs time).
    ``fixed_relief``: Candidate fields every layout keeps (the user set them: ``tiled_mlp=...``). ``unit_prefix``:
    ``model``'s qualified name (with its dot) in the module the engine shards (:func:`module_prefix`: a
    LightningModule around it), which the unit names of ``split_root`` need; None: ``gpt.unit_prefix`` (a
    :class:`Shape`'s), else ""."""
    if unit_prefix is None:
        unit_prefix = getattr(gpt, "unit_prefix", "")
    cands, rejected = enumerate_candidates(gpt, devices, global_batch, **space)
    bad = [r for r in relief if r not in RELIEF]
    if bad:
        raise ConfigError(f"--relief={','.join(relief)}: unknown {', '.join(bad)} (choose from {', '.join(RELIEF)})")
    rows: List[Row] = []
    counts_cache: Dict = {}  # the model's counts per unit choice, for this plan's candidates
    for base in cands:
        base = dataclasses.replace(base, **(fixed_relief or {}))
        if base.act_offload and not base.ac:  # a user's offload_activations=True kept for every layout
            rows.append(Row(base, prior=prior(base), reason="offload_activations=True needs activation_checkpointing "
                            "'full' or 'selective'"))
            continue
        if base.compile and not allow_compile:
            rows.append(Row(base, prior=prior(base), reason="compile: the first inductor compile costs ~26 s per "
                            "graph on a CPU (pass --compile)"))
            continue
        row = _planned(model, gpt, base, precision, budget_bytes, unit_prefix, counts_cache)
        rows.append(row)
        for step in relief_steps(model, gpt, base, relief, unit_prefix) if relief and row.reason else ():
            nxt = _planned(model, gpt, dataclasses.replace(row.candidate, **step), precision, budget_bytes, unit_prefix,
                           counts_cache)
            if nxt.predicted >= row.predicted:
                continue  # no lower: not worth its time
            row = nxt
            rows.append(row)
            if not row.reason:
                break
    survivors = sorted((r for r in rows if not r.reason), key=lambda r: (r.prior, r.predicted))
    return survivors + [r for r in rows if r.reason] + rejected


def _planned(model, gpt, c: Candidate, precision: str, budget_bytes: float, unit_prefix: str = "",
             counts_cache: Optional[Dict] = None) -> Row:
    row = Row(c, prior=prior(c))
    row.predicted, row.predicted_all = predict_bytes(model, gpt, c, precision, unit_prefix, counts_cache)
    if row.predicted > budget_bytes:
        row.reason = f"predicted {row.predicted / MiB:,.1f} MiB/rank > budget {budget_bytes / MiB:,.1f} MiB"
    return row


def no_fit_message(rows: Sequence[Row], budget_bytes: float, budget_name: str = "--memory-budget") -> str:
    """One line per candidate family (stage, offload, split): why every member was rejected."""
    fam: Dict[str, List[Row]] = {}
    for r in rows:
        fam.setdefault(r.candidate.family, []).append(r)
    lines = [f"no layout fits {budget_name}={budget_bytes / MiB:,.1f} MiB per device:"]
    for name, members in fam.items():
        fits = [m for m in members if m.predicted]
        best = min(fits, key=lambda m: m.predicted) if fits else members[0]
        extra = f" (smallest: {best.candidate.key})" if fits else ""
        lines.append(f"  {name}: {best.reason}{extra}")
    return "\n".join(lines)
