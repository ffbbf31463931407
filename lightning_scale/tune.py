"""The autotuner: the fastest layout that fits, chosen by measurement (issue 17 item 4; docs/tune.md).

    python -m lightning_scale.tune --model gpt_small --devices 2 --memory-budget 2GiB --global-batch 8 --budget-s 120
    python -m lightning_scale.tune --config-name config model=gpt_smoke --devices 2 --memory-budget 512MiB
    python -m lightning_scale.tune --model gpt_tiny --devices 2 --memory-budget 64MiB --resume tune.jsonl

1. **Candidates**: ZeRO stage x offload (``estimate.CHOICES``) x dp/tp/pp split of ``--devices`` (tp where it
   divides the heads, pp where it divides the layers) x micro-batch size and count (``--global-batch`` sequences per optimizer
   step, the same work for every row) x bucket size (stages 0-2) x activation checkpointing x compile.
2. **Prune** with the memory plan (:mod:`lightning_scale.estimate`: model states + activations + the step's scratch)
   against ``--memory-budget`` per device; every rejected candidate keeps its reason.
3. **Measure** the survivors best-first by a cheap prior (:func:`prior`), each in a fresh process group
   (``lightning_scale.testing.run_distributed``: :func:`parallelize` + the engines, a few steps), until ``--budget-s``
   or ``--max-probes``; each result is appended to a JSON-lines file, and ``--resume FILE`` skips what it holds.
4. **Output**: a ranked table (tokens/s, predicted vs measured memory per rank) and the winner as a Hydra override line
   for ``examples/train.py``, checked with :func:`lightning_scale.hydra_config.check_before_training`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lightning_scale.config import ConfigError
# the probes live in lightning_scale/tune_probe.py; re-exported here (callers and tests import them from tune)
from lightning_scale.tune_probe import (_live_bytes, _probe_config, build_module, measure,  # noqa: F401
                                        module_worker, probe_worker)

MiB, GiB = 2**20, 2**30
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

    @property
    def world(self) -> int:
        return self.dp * self.sp * self.tp * self.pp

    @property
    def split(self) -> str:
        return f"dp{self.dp}tp{self.tp}pp{self.pp}" + (f"sp{self.sp}" if self.sp > 1 else "")

    @property
    def relief(self) -> str:
        """The relief settings in the key ("" for none)."""
        return ((f"/tmlp{self.tiled_mlp}" if self.tiled_mlp else "")
                + (f"/theads{self.tiled_attention}" if self.tiled_attention else "")
                + ("/actoff" if self.act_offload else ""))

    @property
    def key(self) -> str:
        return (f"z{self.stage}/{self.offload}/{self.split}/mb{self.micro_batch}x{self.accum}"
                f"/b{self.bucket_mb:g}/ac-{self.ac or 'none'}/{'compile' if self.compile else 'eager'}{self.relief}")

    @property
    def family(self) -> str:
        return (f"stage {self.stage} offload={self.offload} dp{self.dp} tp{self.tp} pp{self.pp}"
                + (f" sp{self.sp}" if self.sp > 1 else ""))

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


def find_model(root, setting: str = "--module"):
    """(model, Shape or the GPT's config) inside a LightningModule (or a model): the package GPT, else a Hugging Face
    ``PreTrainedModel`` (its config gives heads, layers, vocabulary), else ``root`` itself if the estimator finds
    repeated units in it (a ModuleList of one class, or ``layer_modules()``)."""
    from lightning_scale.estimate import _units

    gpts = [m for m in root.modules() if type(m).__name__ == "GPT" and hasattr(m, "cfg")]
    if gpts:
        return gpts[0], gpts[0].cfg
    for m in root.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "num_hidden_layers") and callable(getattr(m, "get_input_embeddings", None)):
            emb, head = m.get_input_embeddings(), m.get_output_embeddings()
            embed = sum(p.numel() for p in emb.parameters()) if emb is not None else 0
            tied = bool(getattr(cfg, "tie_word_embeddings", False))
            out = 0 if (head is None or tied) else sum(p.numel() for p in head.parameters())
            heads = getattr(cfg, "num_attention_heads", None)
            return m, Shape(n_head=heads, n_layer=int(cfg.num_hidden_layers),
                            seq_len=int(getattr(cfg, "max_position_embeddings", 128) or 128),
                            vocab_size=int(cfg.vocab_size), d_model=int(getattr(cfg, "hidden_size", 0) or 0),
                            n_kv_head=getattr(cfg, "num_key_value_heads", heads), embed_params=embed,
                            head_params=out, tie_weights=tied, name=type(m).__name__)
    units = [u for u in _units(root) if any(True for _ in u.parameters())]
    embeds = [m for m in root.modules() if type(m).__name__ == "Embedding"]
    if len(units) < 2 or not embeds:
        raise ConfigError(f"{setting}: the tuner needs a model the estimator can count: the package GPT, a Hugging Face "
                          f"PreTrainedModel, or repeated units (a ModuleList of one block class) with a token "
                          f"nn.Embedding; none found in {type(root).__name__} after configure_model()")
    return root, Shape(n_head=None, n_layer=len(units), seq_len=128, vocab_size=int(embeds[0].num_embeddings),
                       embed_params=sum(e.weight.numel() for e in embeds), name=type(root).__name__)


def _embed_head(gpt) -> Tuple[float, float]:
    """Parameters of the embeddings (token + learned positions) and of an untied head."""
    if isinstance(gpt, Shape):
        return float(gpt.embed_params), float(gpt.head_params)
    embed = gpt.vocab_size * gpt.d_model + gpt.seq_len * gpt.d_model
    return float(embed), float(0 if gpt.tie_weights else gpt.vocab_size * gpt.d_model)


def parse_bytes(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5e9`` -> bytes."""
    units = {"kib": 2**10, "mib": MiB, "gib": GiB, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    low = str(text).strip().lower()
    for suffix, scale in units.items():
        if low.endswith(suffix):
            try:
                return int(float(low[: -len(suffix)]) * scale)
            except ValueError:
                break
    try:
        return int(float(low))
    except ValueError:
        raise ConfigError(f"--memory-budget={text!r}: use a size like 2GiB, 512MiB or 1e9") from None


def resolve_device(requested: str, devices: int) -> str:
    """``--device``: ``cpu``, ``cuda`` (one GPU per probe rank on this machine), or ``auto`` (cuda when this machine
    has a GPU). Never a silent fall-back: a GPU machine with fewer GPUs than ``--devices`` is an error, not a CPU
    measurement of a GPU layout."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device={requested!r}: choose auto, cpu or cuda")
    has = torch.cuda.is_available()
    if requested == "cpu" or (requested == "auto" and not has):
        return "cpu"
    if not has:
        raise ConfigError("--device=cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if devices > count:
        raise ConfigError(f"--devices={devices}: this machine has {count} GPU(s) and the CLI's probes run on one "
                          f"machine, one GPU per rank; tune the layout of a larger job with Zero3DStrategy("
                          f"autotune=True) inside its own launch, or pass --device=cpu for a CPU estimate")
    return "cuda"


def _ints(name: str, text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{name}={text!r}: use sizes like 1,2") from None


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------------------------ candidates
def enumerate_candidates(gpt, devices: int, global_batch: int, *, stages=(0, 1, 2, 3), offloads=None,
                         tps=None, pps=None, buckets=(5.0, 25.0), acs=(None, "full"), compile_options=(False,),
                         micro_batches=None, sps=(1,)) -> Tuple[List[Candidate], List[Row]]:
    """Every layout of ``devices`` for the GPTConfig (or :class:`Shape`) ``gpt``; (candidates, rows rejected by
    arithmetic). ``sps``: Ulysses degrees to try (None: every divisor; the default 1: none)."""
    from lightning_scale.estimate import CHOICES

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
                dp = devices // (tp * pp * sp)
                probe = Candidate(stage=0, offload="none", dp=dp, tp=tp, pp=pp, sp=sp)
                why = _split_problem(gpt, dp, tp, pp, sp, global_batch)
                if why:
                    rejected.append(Row(probe, reason=why))
                    continue
                per_rank = global_batch // dp
                for stage, offload in CHOICES:
                    if stage not in stages or (offloads and offload not in offloads):
                        continue
                    if stage == 3 and tp > 1 and pp > 1:
                        rejected.append(Row(dataclasses.replace(probe, stage=3, offload=offload),
                                            reason="zero.stage=3 composes with tp or pp, not both"))
                        continue
                    for mb in (micro_batches or _divisors(per_rank)):
                        if per_rank % mb:
                            continue
                        accum = per_rank // mb
                        if pp > 1 and accum < pp:  # fewer micro-batches than stages: mostly bubble
                            continue
                        for bucket in (buckets if stage in (0, 1, 2) else (25.0,)):
                            for ac in acs:
                                for comp in compile_options:
                                    cands.append(Candidate(stage, offload, dp, tp, pp, mb, accum, float(bucket), ac,
                                                           bool(comp), sp))
    return cands, rejected


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


RELIEF = ("tiled_mlp", "tiled_attention", "offload_activations")
# per model object, dropped with it (an id() key outlives its model: a later model at the same address would read a
# stale entry)
_RELIEF_SUPPORT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def relief_support(model) -> Tuple[bool, bool, int]:
    """(tiled MLP, head-tiled attention, query heads per key/value head) for ``model``'s largest unit: whether
    :mod:`lightning_scale.tiled_mlp` finds an MLP in it and :mod:`lightning_scale.tiled_attention` a head-tiled path
    (the project GPT's attention, or a Hugging Face one with q/k/v/o_proj), and the GQA group a Hugging Face head
    group rounds up to (1: none)."""
    if model not in _RELIEF_SUPPORT:
        from lightning_scale.activation_plan import _units
        from lightning_scale.tiled_attention import _default_attention, _hf_layout, tiled_attention_unit, tiled_attentions
        from lightning_scale.tiled_mlp import _default_mlps

        units = [u for u in _units(model) if any(True for _ in u.parameters())]
        mlp = heads = False
        group = 1
        if units:
            unit = max(units, key=lambda u: sum(p.numel() for p in u.parameters()))
            mlp = bool(_default_mlps(unit))
            with tiled_attention_unit(unit, 1):
                heads = bool(tiled_attentions(unit))
            layouts = [_hf_layout(m) for _, m in _default_attention(unit)]
            group = max([lay[0] // lay[1] for lay in layouts if lay is not None] + [1])
        _RELIEF_SUPPORT[model] = (mlp, heads, group)
    return _RELIEF_SUPPORT[model]


def relief_steps(model, gpt, c: Candidate, relief: Sequence[str] = RELIEF) -> List[Dict]:
    """The memory relief ``c`` can take, cheapest first, each as the Candidate fields it sets: the tiled MLP and
    norms (512 positions per tile, or a quarter of the local sequence if that is shorter), the attention a group of
    heads at a time (sp heads per group -- one per sp rank --, with whole key/value heads under GQA; not with tp), the
    checkpointed units' inputs offloaded
    (with activation checkpointing). Only what the model supports (:func:`relief_support`), ``relief`` names and
    ``c`` does not set already."""
    mlp, heads, group = relief_support(model)
    local = gpt.seq_len // max(1, c.sp)
    out: List[Dict] = []
    if "tiled_mlp" in relief and mlp and local >= 8 and not c.tiled_mlp:
        out.append(dict(tiled_mlp=min(512, max(2, local // 4))))
    if "tiled_attention" in relief and c.tp == 1 and heads and not c.tiled_attention:
        out.append(dict(tiled_attention=c.sp if c.sp == 1 else math.lcm(c.sp, group)))
    if "offload_activations" in relief and c.ac and not c.act_offload:
        out.append(dict(act_offload=True))
    return out


def relief_ladder(model, gpt, c: Candidate, relief: Sequence[str] = RELIEF) -> List[Candidate]:
    """``c``, then ``c`` with each of :func:`relief_steps` added in turn (every rung keeps the ones below it)."""
    out = [c]
    for step in relief_steps(model, gpt, c, relief):
        out.append(dataclasses.replace(out[-1], **step))
    return out


# ------------------------------------------------------------------------------------------------ estimate
_ACTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {shape key: activation plan}


def predict_bytes(model, gpt, c: Candidate, precision: str = "32-true") -> Tuple[float, float]:
    """(device bytes per rank: model states + activations of one micro-batch + the step's scratch, the same + the
    host's model states). On a CPU both spaces are one memory: the probes measure the second."""
    from lightning_scale import estimate as E

    counts = E.model_counts(model)
    embed, head = _embed_head(gpt)
    blocks = counts["params"] - embed - head
    params = counts["params"] if c.pp == 1 else blocks / c.pp + max(embed, head)  # the heaviest stage
    params /= c.tp
    unit = counts["largest_unit_params"] / c.tp
    shards = c.dp * c.sp  # ZeRO shards over dp x sp (every sp rank of a replica holds the same parameters)
    est = E.estimate(max(1.0, params), dp=shards, stage=c.stage, offload=c.offload, precision=precision,
                     largest_unit_params=min(unit, params), bucket_mb=c.bucket_mb, optimizer="adamw")
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
    device = est.device.total + est.activation_bytes + est.step_scratch + accumulated
    return device, one_memory_bytes(est, accumulated)


def one_memory_bytes(est, accumulated: float = 0.0) -> float:
    """The peak live tensor bytes of a step when device and host are one memory (a CPU run): what the probes measure.

    Each model state counts once, wherever it lives: offload's host copy of a tensor in the same dtype *is* the
    device tensor on a CPU (the reducer aliases the fp32 master to the parameter shard, the gradient copy to the
    gradient shard: ``master_aliased``), so in fp32 the host master and host gradients are not added again; in mixed
    precision they are real fp32 copies. The step's transients are phases, not a sum: the activation peak (at the
    loss, before a gradient exists) with the gathered units, or the end of the backward (its staging buffers + the
    gradients), or the optimizer step (the gradients + its scratch). Stages 0-2 without offload keep their flat
    gradient buffer between steps; ZeRO-3 and the offloaded copies free theirs at ``zero_grad``. Checked against the
    probes' measurement on the bench GPT (fp32, 2 ranks): every stage x offload, mb 4 + full AC and mb 1 without AC,
    within 0-12% (docs/tune.md). ``accumulated``: whole gradients held while micro-batches accumulate (stages 1-2),
    alive with the activations of the later ones. With activation checkpointing the backward is a phase of its own:
    what is kept + one unit recomputed + the gradients staged for their reduction."""
    from lightning_scale.estimate import _PRECISION_BYTES

    d, h = est.device, est.host
    aliased = _PRECISION_BYTES[est.precision][2] == 0  # no separate master dtype: the copies would be aliases
    resident = d.params + h.params + d.master + d.optimizer_state + h.optimizer_state + (0.0 if aliased else h.master)
    grads = max(d.grads, h.grads) if aliased else d.grads + h.grads
    if est.stage < 3 and est.offload == "none":  # the flat gradient buffer (stage 0: full, 1-2: the shard) stays
        resident, grads = resident + grads, 0.0  # allocated between steps (zero_grad zeroes it)
    a = est.activations
    host_acts = a.host if a is not None else 0.0  # offloaded unit inputs: the same memory on a CPU
    phases = [est.activation_bytes + host_acts + d.gathered + accumulated, d.transient + grads,
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
    # measured at L=2048 on the bench GPT (2 ranks, docs/tune.md "Long sequences"): sp=2 1.06, the tiled MLP 1.11,
    # + head tiling 1.17, activation offload + 0.015 over full AC (a CPU: no copy across a bus)
    t *= 1.0 + 0.08 * (c.sp > 1)  # two all-to-alls per attention, forward and backward
    t *= (1.1 if c.tiled_mlp else 1.0) * (1.06 if c.tiled_attention else 1.0) * (1.03 if c.act_offload else 1.0)
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
         **space) -> List[Row]:
    """Every candidate as a Row: survivors (reason "") sorted by prior, then the rejected with their reasons.

    A layout that does not fit climbs its relief ladder (:func:`relief_steps`: tiled MLP, head-tiled attention,
    activation offload; ``relief`` names the rungs allowed, () none), taking a rung only where it lowers the
    prediction (the activation peak may sit in the loss, not in the units): the first rung that fits is the
    survivor, the rungs below it are rejected with their predicted bytes; one that fits as it is gets no relief
    (each rung costs time).
    ``fixed_relief``: Candidate fields every layout keeps (the user set them: ``tiled_mlp=...``)."""
    cands, rejected = enumerate_candidates(gpt, devices, global_batch, **space)
    bad = [r for r in relief if r not in RELIEF]
    if bad:
        raise ConfigError(f"--relief={','.join(relief)}: unknown {', '.join(bad)} (choose from {', '.join(RELIEF)})")
    rows: List[Row] = []
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
        row = _planned(model, gpt, base, precision, budget_bytes)
        rows.append(row)
        for step in relief_steps(model, gpt, base, relief) if relief and row.reason else ():
            nxt = _planned(model, gpt, dataclasses.replace(row.candidate, **step), precision, budget_bytes)
            if nxt.predicted >= row.predicted:
                continue  # no lower: not worth its time
            row = nxt
            rows.append(row)
            if not row.reason:
                break
    survivors = sorted((r for r in rows if not r.reason), key=lambda r: (r.prior, r.predicted))
    return survivors + [r for r in rows if r.reason] + rejected


def _planned(model, gpt, c: Candidate, precision: str, budget_bytes: float) -> Row:
    row = Row(c, prior=prior(c))
    row.predicted, row.predicted_all = predict_bytes(model, gpt, c, precision)
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


# ------------------------------------------------------------------------------------------------ the loop
def load_results(path: Optional[str]) -> Dict[str, Dict]:
    done: Dict[str, Dict] = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    done[rec["key"]] = rec
    return done


def tune(rows: List[Row], gpt, *, budget_s: float = 300.0, max_probes: Optional[int] = None,
         results_path: Optional[str] = None, measure_fn: Callable = measure, log: Callable = print,
         confirm: int = 3, **probe) -> List[Row]:
    """Measure the survivors best-first until the time budget or ``max_probes``, then the ``confirm`` fastest once
    more (ranked by the mean of their probes); returns the measured rows ranked."""
    survivors = [r for r in rows if not r.reason]
    done = load_results(results_path)
    start, probes = time.perf_counter(), 0
    for i, row in enumerate(survivors):
        key = row.candidate.key
        if key in done:
            row.result = done[key]
            log(f"[{i + 1}/{len(survivors)}] {key}: from {results_path} (skipped)")
            continue
        if (max_probes is not None and probes >= max_probes) or time.perf_counter() - start > budget_s:
            break
        try:
            row.result = measure_fn(gpt, row.candidate, **probe)
        except Exception as err:  # noqa: BLE001 - a failed layout is a result, not the end of the search
            row.result = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"}
        probes += 1
        row.result.update(key=key, predicted_bytes=row.predicted, predicted_all_bytes=row.predicted_all)
        if results_path:
            with open(results_path, "a") as f:
                f.write(json.dumps(row.result) + "\n")
        speed = (f"{row.result['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row.result
                 else row.result["error"])
        log(f"[{i + 1}/{len(survivors)}] {key}: {speed} ({time.perf_counter() - start:,.0f}/{budget_s:g} s)")
    measured = sorted((r for r in survivors if r.result and "tokens_per_s" in r.result),
                      key=lambda r: -r.result["tokens_per_s"])
    for row in measured[:confirm] if confirm and len(measured) > 1 else ():
        # one probe is noisy (a shared CPU: +-10-30%): the leaders are measured again, ranked by the mean
        if len(row.result.get("repeats", [])) >= 2:
            continue
        try:
            again = measure_fn(gpt, row.candidate, **probe)["tokens_per_s"]
        except Exception:  # noqa: BLE001
            continue
        runs = row.result.get("repeats", [row.result["tokens_per_s"]]) + [again]
        row.result.update(repeats=runs, tokens_per_s=statistics.mean(runs))
        if results_path:
            with open(results_path, "a") as f:
                f.write(json.dumps(row.result) + "\n")
        log(f"confirm {row.candidate.key}: {again:,.0f} tokens/s (mean {row.result['tokens_per_s']:,.0f})")
    return sorted(measured, key=lambda r: -r.result["tokens_per_s"])


def format_ranked(ranked: Sequence[Row], limit: int = 15, failed: Sequence[Row] = ()) -> str:
    """tokens/s are the steady steps' (after the warm-up); ``compile s``: the warm-up's seconds above that pace (the
    inductor compile of a compiled layout, ~0 for eager), not in tokens/s. ``failed``: probed rows that raised, listed
    after the ranked ones as ``failed: <error>``."""
    lines = ["| # | layout | tokens/s | compile s | predicted device MiB/rank | predicted one memory (CPU) | "
             "measured MiB/rank |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(ranked[:limit]):
        m = r.result.get("measured_bytes")
        lines.append(f"| {i + 1} | {r.candidate.key} | {r.result['tokens_per_s']:,.0f} | "
                     f"{r.result.get('compile_s', 0.0):,.1f} | {r.predicted / MiB:,.1f} | {r.predicted_all / MiB:,.1f} | "
                     f"{'-' if m is None else f'{m / MiB:,.1f}'} |")
    for r in failed:
        lines.append(f"| - | {r.candidate.key} | failed: {r.result['error']} | - | {r.predicted / MiB:,.1f} | "
                     f"{r.predicted_all / MiB:,.1f} | - |")
    return "\n".join(lines)


def check_overrides(line: Sequence[str], base: Sequence[str] = ()) -> None:
    """Compose conf/ with the override line and run the pre-training checks (ConfigError names the Hydra key)."""
    from hydra import compose, initialize_config_dir

    from lightning_scale.hydra_config import check_before_training, register_configs

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    register_configs()
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(base) + ["trainer.accelerator=cpu"] + list(line))
    check_before_training(cfg)


# ------------------------------------------------------------------------------------------------ CLI
_SHAPE = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model")


def _model(args):
    """(meta module, GPTConfig, Hydra overrides that select it) from --model / --config-name overrides / --module."""
    from lightning_scale.estimate import _model_from_spec

    if args.module:
        lm = build_module(args.module, meta=True)
        model, shape = find_model(lm)
        if not isinstance(shape, Shape):  # the package GPT: its Hydra keys
            return model, shape, [f"model.{k}={getattr(shape, k)}" for k in _SHAPE]
        shape = dataclasses.replace(shape, module=args.module, sys_path=tuple(p for p in sys.path if p))
        return model, shape, None
    if args.config_name or args.overrides:
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        from lightning_scale.hydra_config import register_configs
        from lightning_scale.models.gpt import GPTConfig

        register_configs()
        conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose(config_name=args.config_name or "config", overrides=args.overrides)
        gpt = GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True))
        spec = "gpt_small:" + ",".join(f"{k}={getattr(gpt, k)}" for k in _SHAPE)
        return _model_from_spec(spec), gpt, [o for o in args.overrides if o.startswith("model")]
    model = _model_from_spec(args.model)
    return model, model.cfg, [f"model.{k}={getattr(model.cfg, k)}" for k in _SHAPE]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_scale.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/ (with --config-name)")
    ap.add_argument("--config-name", default=None)
    ap.add_argument("--model", default="gpt_small", help="gpt_tiny / gpt_small[:key=value,...]")
    ap.add_argument("--module", default=None, help="pkg.mod:LightningModule (built with no arguments; configure_model "
                    "builds the package GPT, a Hugging Face model, or repeated blocks; training_step takes (tokens, targets))")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--memory-budget", default="2GiB", help="per device")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--max-probes", type=int, default=None)
    ap.add_argument("--confirm", type=int, default=3, help="the fastest N are measured twice (mean)")
    ap.add_argument("--seq-len", type=int, default=None, help="overrides the model's seq_len")
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (all ranks)")
    ap.add_argument("--precision", default="32-true", help="the probes' precision: 32-true, bf16-mixed, 16-mixed, ...")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="auto", help="where the probes run: auto (a GPU per rank when this machine "
                    "has them), cpu (gloo), cuda (nccl)")
    ap.add_argument("--compile", action="store_true", help="also probe compile=True (per-unit inductor; its compile "
                    "seconds are reported apart from the steady tokens/s; ~1 min per compiled probe on a loaded 2-core CPU)")
    ap.add_argument("--compile-backend", default="inductor", help="the compiled probes' torch.compile backend "
                    "(aot_eager: Dynamo + AOTAutograd without inductor's C++ build, for a quick check of the path)")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--offloads", default=None, help="e.g. none,optimizer")
    ap.add_argument("--tp", default=None, help="tp sizes to try, e.g. 1,2")
    ap.add_argument("--pp", default=None, help="pp sizes to try")
    ap.add_argument("--ac", default="none,full", help="none,full,selective")
    ap.add_argument("--sp", default="auto", help="Ulysses sizes to try, e.g. 1,2; 'all': every divisor of --devices; "
                    "'auto' (default): 1, and every divisor when no layout fits at 1")
    ap.add_argument("--relief", default=",".join(RELIEF), help="memory relief a layout that does not fit may climb "
                    f"to, cheapest first (default {','.join(RELIEF)}; 'none': off)")
    ap.add_argument("--estimate-only", action="store_true", help="prune and rank by the prior; measure nothing")
    ap.add_argument("--results", default="tune_results.jsonl", help="JSON-lines file the probes append to")
    ap.add_argument("--resume", default=None, help="a results file: its candidates are not measured again")
    args = ap.parse_args(argv)
    try:
        model, gpt, base = _model(args)
        if args.seq_len and isinstance(gpt, Shape):
            gpt = dataclasses.replace(gpt, seq_len=args.seq_len)
        elif args.seq_len:
            from lightning_scale.estimate import _model_from_spec

            gpt = dataclasses.replace(gpt, seq_len=args.seq_len)
            model = _model_from_spec("gpt_small:" + ",".join(f"{k}={getattr(gpt, k)}" for k in _SHAPE))
            base = [b for b in base if not b.startswith("model.seq_len")] + [f"model.seq_len={args.seq_len}"]
        ints = lambda s: tuple(int(v) for v in s.split(",")) if s else None  # noqa: E731
        budget = parse_bytes(args.memory_budget)

        def planned(sps):
            return plan(model, gpt, args.devices, args.global_batch, budget, precision=args.precision,
                        allow_compile=args.compile, stages=ints(args.stages),
                        offloads=tuple(args.offloads.split(",")) if args.offloads else None, tps=ints(args.tp),
                        pps=ints(args.pp), acs=tuple(None if a == "none" else a for a in args.ac.split(",")),
                        compile_options=(False, True), sps=sps,
                        relief=() if args.relief in ("", "none") else tuple(args.relief.split(",")))

        auto = args.sp == "auto"
        rows = planned((1,) if auto else None if args.sp == "all" else _ints("--sp", args.sp))
        survivors = [r for r in rows if not r.reason]
        if auto and not survivors and args.devices > 1:  # nothing fits whole sequences: split them too
            rows = planned(None)
            survivors = [r for r in rows if not r.reason]
            print("no layout fits with whole sequences per rank: Ulysses (sp) searched too")
        device = resolve_device(args.device, args.devices) if not args.estimate_only else None
        print(f"{len(rows)} candidates, {len(survivors)} fit {budget / MiB:,.1f} MiB/device" + (
            "" if device is None else f"; probes on {device} ({'nccl' if device == 'cuda' else 'gloo'}): measured = "
            + ("the GPU's tensor bytes, vs the predicted device column" if device == "cuda"
               else "every live tensor, vs the predicted one-memory column (a CPU)")))
        if not survivors:
            raise ConfigError(no_fit_message(rows, budget))
        if args.estimate_only:
            ranked = survivors
            print("\n".join(f"{r.prior:.3f}  {r.candidate.key}  {r.predicted / MiB:,.1f} MiB" for r in ranked[:15]))
        else:
            path = args.resume or args.results
            ranked = tune(rows, gpt, budget_s=args.budget_s, max_probes=args.max_probes, results_path=path,
                          confirm=args.confirm, steps=args.steps, precision=args.precision, device=device,
                          compile_setting=True if args.compile_backend == "inductor" else {"backend": args.compile_backend})
            failed = [r for r in rows if r.result and "error" in r.result]
            if not ranked:
                raise ConfigError("every probed layout failed: " + "; ".join(
                    f"{r.candidate.key}: {r.result['error']}" for r in failed) + f" (the results file: {path})")
            print(format_ranked(ranked, failed=failed))
        line = ranked[0].candidate.overrides(args.precision)
        if base is None:  # a LightningModule of its own: the strategy's settings, not examples/train.py's config
            kw = ", ".join(f"{k}={v!r}" for k, v in ranked[0].candidate.strategy_kwargs().items())
            print(f"\nwinner: Zero3DStrategy({kw}) on {ranked[0].candidate.world}"
                  f" devices, {ranked[0].candidate.micro_batch} sequences per micro-batch x {ranked[0].candidate.accum}")
        else:
            check_overrides(line, base)
            print("\nwinner: python examples/train.py " + " ".join(base + line))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # ``python -m lightning_scale.tune`` runs this file as __main__: run the package module's main, so that its
    # Candidate / Shape are the classes the probes (lightning_scale.tune_probe) check against (a __main__.Shape was
    # not a lightning_scale.tune.Shape: --module probes ran the GPT worker and failed)
    from lightning_scale.tune import main as _main

    sys.exit(_main())
