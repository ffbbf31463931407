"""The activation plan: activation bytes per rank for one micro-batch, the memory plan's second half.

:mod:`lightning_scale.estimate` counts model states (params, grads, master, optimizer state, gathered units,
transient); this module counts what the forward keeps for the backward and what the backward / loss step needs at
once, for the model's shapes, the checkpointing policy, ``sp``, ``tp``, the micro-batch size and the precision.
``MemoryEstimate.predicted_peak`` adds the two (see ``docs/long_sequences.md``, "The memory plan").

Notation: ``T = micro_batch * seq_len / sp`` positions per rank, ``n`` repeated units (blocks), ``b`` bytes of an
activation element (the compute dtype: 2 under bf16/16 mixed or true, 4 under 32-true, 8 under 64-true), ``H`` the
hidden width, ``V`` the head's vocabulary width (``V / tp`` per rank where the model's loss takes the vocabulary-split
logits, the project GPT's ``vocab_parallel_loss``; a Hugging Face / litgpt head gathers them: ``V``), ``C`` the loss
chunk (0: not chunked).
One unit's per-token bytes come from a fake-tensor run of the largest unit
(:func:`lightning_scale.activation_profile.profile_unit`, float32, scaled by ``b / 4``; tp applied there):
``s`` saved for backward without checkpointing, ``s_in`` its input, ``s_sel`` what the selective policy keeps,
``g`` the backward's working set (gradient temporaries). Per rank:

===========  ==========================  ====================================
policy       kept (forward -> backward)  recompute (one unit's backward)
===========  ==========================  ====================================
none         n * s * T                   g * T
full         n * s_in * T                (s - s_in + g) * T
selective    n * s_sel * T               (max(s - s_sel, 0) + g) * T
===========  ==========================  ====================================

* ``offload_activations`` (needs full or selective): the unit inputs ``n * s_in * T`` are on the host; the device
  keeps ``min(n, 2)`` of them (the one in use + the prefetched one), so kept drops by ``(n - min(n, 2)) * s_in * T``.
* head: ``2 * T * H * b`` (the final norm's input and the head's input).
* loss: ``T_c * V' * (12 + b')`` (``V' = V / tp`` or ``V``, above) with ``T_c = micro_batch * min(C, L/sp)`` when chunked (else ``T``):
  the fp32 log-softmax kept + its gradient + the logits' gradient (3 x 4 bytes) and the ``b``-byte logits when
  the compute dtype is not fp32 (``b' = b``, else 0).
* peak = kept + max(head + loss, recompute).

* ``tiled_mlp=N``: the unit is profiled with its MLP and norms tiled (:func:`lightning_scale.tiled_mlp.tiled_unit`):
  ``s`` then counts the MLP's input (or, after a tiled norm, the norm's input, shared with the norm) instead of the
  MLP's ``4d``-wide hiddens, and ``g`` one tile's recompute and the summed parameter gradients (one MLP's, twice:
  the running sum and the tile's) instead of the whole sequence's hiddens. The counted fallback ignores it.

pp > 1: :mod:`lightning_scale.pipeline_plan` walks each pipeline rank's schedule with these per-micro-batch
numbers (the micro-batches in flight, the p2p buffers). Not modelled: the attention's
own working set beyond what the profile sees (SDPA kernels' scratch on GPU), allocator fragmentation / caching,
and the data loader. A unit that does not run alone on fake tensors (masks, rotary tables) is counted from its
Linear layers' sizes instead (``source="counted"``, with a note).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

from lightning_scale.activation_count import (  # what a unit keeps, counted from its layers' sizes
    _counted_profile,
    _expert_bytes,
    _expert_weights,
    _experts_stubbed,
    experts_per_token,
)
from lightning_scale.config import ConfigError

__all__ = ["AC_POLICIES", "ActivationEstimate", "UnitProfile", "estimate_activations", "activations_for_model",
           "mix_units", "profile_model"]


def _precision_key(precision: str) -> str:
    from lightning_scale.estimate import _precision_key as key

    return key(precision)


def _units(module):
    from lightning_scale.estimate import _units as units

    return units(module)


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes per rank for one micro-batch (the memory plan; formulas in the docstring of
    :mod:`lightning_scale.activation_plan`)."""

    tokens: int  # T = micro_batch * seq_len / sp, the positions one rank's units see
    layers: int  # n, the repeated units
    policy: str  # "none" | "full" | "selective"
    per_token_layer: float  # s: bytes one unit saves per token without checkpointing
    kept: float  # device bytes kept from forward to backward (all units)
    recompute: float  # one unit's backward working set (+ its recomputed activations under checkpointing)
    head: float  # final norm + head inputs
    loss: float  # logits-sized buffers of the loss step (one chunk's under the chunked loss)
    host: float = 0.0  # unit inputs offloaded to the host (offload_activations)
    source: str = "profiled"  # "profiled" (fake-tensor run of one unit) | "counted" (Linear sizes) | "given"
    notes: Tuple[str, ...] = field(default=())
    # pp > 1: the walk of this rank's schedule (lightning_scale.pipeline_plan.PipelinePeak); its peak is the peak
    pipeline: Optional[Any] = None

    @property
    def peak(self) -> float:
        """The most activation bytes at once: what is kept + the larger of the loss step and one unit's backward
        (pp > 1: the schedule walk's step-1 peak, micro-batches in flight and p2p buffers included)."""
        if self.pipeline is not None:
            return self.pipeline.peak
        return self.kept + max(self.head + self.loss, self.recompute)

    @property
    def steady_peak(self) -> float:
        """The peak from step 2 on: the same, except that at pp > 1 receives are prefetched from the start."""
        return self.pipeline.steady if self.pipeline is not None else self.peak


AC_POLICIES = ("none", "full", "selective")


def _act_bytes(precision: str) -> int:
    """Bytes of an activation element: the compute dtype (autocast's under mixed precision)."""
    return {"32-true": 4, "64-true": 8}.get(_precision_key(precision), 2)


def _policy(activation_checkpointing) -> str:
    policy = "none" if activation_checkpointing in (None, False, "none") else str(activation_checkpointing)
    if policy not in AC_POLICIES:
        raise ConfigError(f"activation_checkpointing={activation_checkpointing!r}: must be 'full', 'selective' "
                          "or None (off)")
    return policy


def estimate_activations(*, seq_len: int, micro_batch: int = 1, layers: int, per_token: Dict[str, float],
                         hidden: int, vocab: int, precision: str = "bf16-mixed", activation_checkpointing=None,
                         offload_activations: bool = False, sp: int = 1, tp: int = 1, loss_chunk: int = 0,
                         source: str = "given", notes: Sequence[str] = (), vocab_parallel: bool = True
                         ) -> ActivationEstimate:
    """The activation plan from one unit's per-token bytes (float32 profile: ``saved``, ``input``, ``selective``,
    ``backward``; tp already applied) -- the formulas of the module docstring. Pure python. ``vocab_parallel``:
    the loss runs on this rank's ``vocab / tp`` columns (the project GPT); False: on all ``vocab`` (a model whose
    head gathers its logits, as every Hugging Face model's does)."""
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("sp", sp), ("tp", tp),
                        ("layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if seq_len % sp:
        raise ConfigError(f"sp={sp} does not divide seq_len={seq_len}")
    if not isinstance(loss_chunk, int) or loss_chunk < 0:
        raise ConfigError(f"chunked_loss={loss_chunk!r} must be an integer >= 0 (0: not chunked)")
    policy = _policy(activation_checkpointing)
    if offload_activations and policy == "none":
        raise ConfigError("offload_activations=True needs activation_checkpointing='full' or 'selective'")
    scale = _act_bytes(precision) / 4.0  # the profile runs in float32
    s, s_in = per_token["saved"] * scale, per_token["input"] * scale
    s_sel, g = per_token["selective"] * scale, per_token["backward"] * scale
    # selective: the kept outputs autograd saves too; a recompute regenerates the rest of the saved set (a counted
    # profile has no such entry: all of them taken as saved)
    s_ss = _overlap(per_token) * scale
    local = seq_len // sp
    T = micro_batch * local
    kept_per_token = {"none": layers * s, "full": layers * s_in, "selective": layers * s_sel}[policy]
    # a sliding-window model's one explicit mask (boolean, ~ L^2 / sp: this rank's rows), alive from the first unit's
    # forward to the last one's backward; per token at the profiled length (the plan profiles at the length it plans)
    kept_per_token += per_token.get("mask", 0.0)
    host = 0.0
    if offload_activations:  # the unit inputs wait on the host; the device holds the one in use + the prefetched one
        host = layers * s_in * T
        kept_per_token -= (layers - min(layers, 2)) * s_in
    extra = {"none": g, "full": s - s_in + g, "selective": max(s - s_ss, 0.0) + g}[policy]
    b = _act_bytes(precision)
    chunk_tokens = micro_batch * (min(loss_chunk, local) if loss_chunk and local > loss_chunk else local)
    # loss in fp32 (lm_loss): the log-softmax kept + its gradient + the logits' gradient; + the b-byte logits
    # when they are not fp32 already
    loss = chunk_tokens * loss_vocab(vocab, tp, vocab_parallel) * (3 * 4 + (b if b != 4 else 0))
    head = 2 * T * hidden * b  # the final norm's input and the head's input
    return ActivationEstimate(tokens=T, layers=layers, policy=policy, per_token_layer=s, kept=kept_per_token * T,
                              recompute=extra * T, head=head, loss=loss, host=host, source=source, notes=tuple(notes))


def loss_vocab(vocab: int, tp: int, vocab_parallel: bool) -> float:
    """The logits columns the loss runs on per rank: ``vocab / tp`` when the loss takes the vocabulary-split logits,
    else all ``vocab`` (the head gathered them)."""
    return vocab / tp if vocab_parallel else float(vocab)


def vocab_parallel_loss(module) -> bool:
    """Whether ``module``'s loss takes the vocabulary-split logits at tp > 1 (a model declaring
    ``vocab_parallel_loss``: the project GPT). A Hugging Face or litgpt model's head gathers them and its loss runs on
    the whole vocabulary on every rank: counted at ``V / tp``, an HF Llama's step-1 plan at tp=2 was 10% under."""
    return any(getattr(m, "vocab_parallel_loss", False) for m in [module, *module.modules()])


def _config_vocab(module) -> int:
    """The vocabulary size a model's config declares (a multimodal config's text config's), 0 where none."""
    for m in [module, *module.modules()]:
        cfg = getattr(m, "cfg", None) or getattr(m, "config", None)
        text = getattr(cfg, "get_text_config", None)
        for c in (cfg, text() if callable(text) else None):
            v = getattr(c, "vocab_size", None)
            if isinstance(v, int) and v > 0:
                return v
    return 0


def _vocab_and_chunk(module, chunked_loss) -> Tuple[int, int]:
    """(vocabulary width of the head, this rank's; loss chunk) read from the model (GPT: cfg.loss_chunk). A model
    without :func:`vocab_parallel_loss` gets the whole vocabulary, whatever the width of its (maybe split, or
    ``local_linears``) head."""
    import torch.nn as nn

    vocab = 0 if vocab_parallel_loss(module) else _config_vocab(module)
    head = getattr(module, "lm_head", None)
    if head is None:
        for m in module.modules():
            if hasattr(m, "lm_head"):
                head = m.lm_head
                break
    if isinstance(head, nn.Linear):
        vocab = max(vocab, head.out_features)
    if not vocab:
        cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
        vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if chunked_loss is None:
        cfg = getattr(module, "cfg", None)
        for m in module.modules():
            cfg = cfg or getattr(m, "cfg", None)
        chunk = int(getattr(cfg, "loss_chunk", 0) or 0)
    elif chunked_loss is True:
        chunk = 512
    else:
        chunk = int(chunked_loss or 0)
    return vocab, chunk


@dataclass(frozen=True)
class UnitProfile:
    """One model's activation inputs: the largest unit's per-token bytes and the shapes around it."""

    per_token: Dict[str, float]
    layers: int  # repeated units of the whole model
    hidden: int
    vocab: int
    chunk: int  # the loss chunk (0: not chunked)
    unit_type: type
    source: str
    notes: Tuple[str, ...]
    # tiled_mlp_modules tiling only some units: the untiled units' per-token bytes and how many of the units
    # they are (``per_token`` is then the tiled units')
    untiled: Optional[Tuple[Dict[str, float], int]] = None
    vocab_parallel: bool = True  # the loss runs on vocab / tp columns per rank (vocab_parallel_loss)
    # units of several kinds: each unit's per-token bytes (its kind's profile), in the order of ``_units(module)``
    # (None for a unit with no parameters); a pipeline stage's plan takes its own units' (:func:`units_profile`)
    per_unit: Optional[Tuple[Optional[Dict[str, float]], ...]] = None


def units_profile(prof: "UnitProfile", indices: Sequence[int], activation_checkpointing=None) -> Dict[str, float]:
    """The per-token bytes of the units at ``indices`` (of ``prof.per_unit``, in the order they run): their mean, with
    the working set their backward adds on top of what they keep (:func:`ordered_backward`); the model's when ``prof``
    has one kind of unit."""
    parts = [_with_overlap(prof.per_unit[i]) for i in indices
             if prof.per_unit is not None and prof.per_unit[i] is not None]
    if not parts:
        return prof.per_token
    keys = set().union(*parts)
    mean = {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in keys}
    if "mask" in keys:  # the model's one mask: held once if any unit reads it
        mean["mask"] = max(p.get("mask", 0.0) for p in parts)
    mean["backward"] = ordered_backward(parts, mean, _policy(activation_checkpointing))
    return mean


def _overlap(per_token: Dict[str, float]) -> float:
    """Per-token bytes of what selective checkpointing keeps that autograd saves too (``selective_saved`` of a profile;
    a counted profile has none: all it keeps)."""
    return per_token.get("selective_saved", per_token.get("selective", 0.0))


def _with_overlap(per_token: Dict[str, float]) -> Dict[str, float]:
    return per_token if "selective_saved" in per_token else {**per_token, "selective_saved": _overlap(per_token)}


def ordered_backward(parts: Sequence[Dict[str, float]], mean: Dict[str, float], policy: str) -> float:
    """The ``backward`` entry for units of several kinds run in the order of ``parts``, such that
    :func:`estimate_activations` on their ``mean`` gives the true peak of the backward: unit i's backward runs after
    the units behind it freed what they kept, so the peak is the largest of (what units 1..i keep + unit i's working
    set), not (what all keep + the largest working set). Jamba's Mamba layer has the larger working set and comes
    first: at pp=2 a stage [Mamba, attention] was planned 1.2x over its measured peak. Under checkpointing a unit's
    working set is its recomputed activations + its backward's; units keep their inputs (full) or the selected
    outputs (selective) meanwhile."""
    if policy == "full":
        kept = lambda p: p["input"]  # noqa: E731
        work = lambda p: p["saved"] - p["input"] + p["backward"]  # noqa: E731
        base = mean["saved"] - mean["input"]
    elif policy == "selective":
        kept = lambda p: p["selective"]  # noqa: E731
        work = lambda p: max(p["saved"] - _overlap(p), 0.0) + p["backward"]  # noqa: E731
        base = max(mean["saved"] - _overlap(mean), 0.0)
    else:
        kept, work, base = (lambda p: p["saved"]), (lambda p: p["backward"]), 0.0
    behind, best = 0.0, 0.0
    for p in reversed(parts):
        best = max(best, work(p) - behind)
        behind += kept(p)
    return max(best - base, 0.0)


def mix_units(tiled: ActivationEstimate, untiled: Optional[ActivationEstimate]) -> ActivationEstimate:
    """One model whose units are partly tiled (``tiled_mlp_modules``): every unit keeps its own bytes (summed), one
    unit's backward at a time (the larger), the head and the loss once."""
    if untiled is None:
        return tiled
    import dataclasses

    return dataclasses.replace(
        tiled, layers=tiled.layers + untiled.layers, kept=tiled.kept + untiled.kept, host=tiled.host + untiled.host,
        recompute=max(tiled.recompute, untiled.recompute),
        per_token_layer=max(tiled.per_token_layer, untiled.per_token_layer),
        notes=tuple(tiled.notes) + (f"tiled_mlp_modules: {tiled.layers} of {tiled.layers + untiled.layers} units "
                                    "tiled, each kind profiled",))


_NO_ATTENTION_TOKENS = 64


def _profile_one(unit, hidden: int, tokens: int, sp: int, tp: int, tiled_mlp: int, tiled_attention: int
                 ) -> Tuple[Dict[str, float], str, list]:
    """(per-token bytes, "profiled" | "counted", notes) of one unit."""
    from lightning_scale.activation_profile import profile_unit
    from lightning_scale.tiled_attention import tiled_attention_unit
    from lightning_scale.tiled_mlp import tiled_unit

    notes: list = []
    if not any("Attention" in type(m).__name__ for m in unit.modules()):
        # a unit without attention (a hybrid's Mamba or convolution layer) makes the same bytes per token at any length:
        # profiled over one Mamba-2 chunk (its chunk_size: no padding to it), else _NO_ATTENTION_TOKENS positions
        # (Jamba's Mamba-1 scan loops over the positions in Python: 67 s on fake tensors at 1024 tokens, 3.5 s at 256,
        # 0.95 s at 64, the bytes per token within 0.6% of each other)
        chunk = max((c for m in unit.modules() if isinstance(c := getattr(m, "chunk_size", None), int)), default=0)
        tokens = min(tokens, chunk or _NO_ATTENTION_TOKENS)
    try:
        if _expert_weights(unit):
            # a mixture of experts: the unit runs on fake tensors with its experts stubbed (routing has data-dependent
            # shapes) and the experts are counted on top. Counted from its Linear sizes alone, what a mask, an eager
            # attention's scores or a Mamba scan make was missed (Llama 4 1.5-1.9x under, GPT-OSS 7.2x), and so was
            # what float32 casts and a dense MLP beside the experts keep (Gemma 4's MoE layers 1.27x under; until
            # 2026-12-07 only units with a mask, eager attention or a mixer took this path)
            extra = _expert_bytes(unit, tp)
            with _experts_stubbed(unit) as stubbed:
                if not stubbed:
                    raise RuntimeError("experts outside transformers experts modules")
                per_token = profile_unit(unit, tokens, tp=tp, hidden=hidden or None, sp=sp)
            # the experts' kept matmul outputs are saved by what follows them (the activation, the routing product)
            extra = {**extra, "selective_saved": extra.get("selective", 0.0)}
            per_token = {key: (max(v, extra.get(key, 0.0)) if key == "backward" else v + extra.get(key, 0.0))
                         for key, v in per_token.items()}
            notes.append(f"{type(unit).__name__}: a mixture of experts: profiled with its "
                         f"experts stubbed, and its {len(_expert_weights(unit))} stacked expert weights counted "
                         f"(each token through {experts_per_token(unit)} experts)")
            return per_token, "profiled", notes
        with tiled_unit(unit, tiled_mlp or 0), tiled_attention_unit(unit, tiled_attention or 0):
            per_token = profile_unit(unit, tokens, tp=tp, hidden=hidden or None, sp=sp)
        if tiled_mlp:
            notes.append(f"tiled_mlp={tiled_mlp}: the unit profiled with its MLP and norms tiled")
        if tiled_attention:
            notes.append(f"tiled_attention={tiled_attention}: the unit profiled with its attention head-tiled")
        return per_token, "profiled", notes
    except Exception as err:  # a unit that needs more than one tensor (masks, rotary tables): count instead
        experts = _expert_weights(unit)
        why = ("is a mixture of experts (routing with data-dependent shapes: no fake-tensor profile)" if experts else
               f"did not run alone on fake tensors ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})")
        notes.append(f"{type(unit).__name__} {why}; activations counted from its Linear sizes" + (
            f" and its {len(experts)} stacked expert weights (each token through {experts_per_token(unit)} experts)"
            if experts else ""))
        return _counted_profile(unit, hidden, tp), "counted", notes


def profile_model(module, *, seq_len: int, sp: int = 1, tp: int = 1, chunked_loss=None,
                  tiled_mlp: int = 0, tiled_attention: int = 0) -> UnitProfile:
    """Profile ``module``'s largest unit on fake tensors for ``seq_len / sp`` positions
    (:func:`lightning_scale.activation_profile.profile_unit`), else count it from its Linear sizes. A model whose
    units are of several kinds (Llama 4: mixture-of-experts and dense layers, chunked and full attention) has the
    largest unit of each kind profiled: the per-token bytes are their mean over the units (the backward's working
    set: the largest)."""
    from lightning_scale.activation_profile import _mask_inputs, hidden_size

    every = list(_units(module))
    units = [u for u in every if any(True for _ in u.parameters())]
    if not units:
        raise ConfigError("the model has no repeated unit to estimate activations for")
    unit = max(units, key=lambda u: sum(p.numel() for p in u.parameters()))
    hidden = hidden_size(unit) or 0
    vocab, chunk = _vocab_and_chunk(module, chunked_loss)
    split_loss = vocab_parallel_loss(module)
    tokens = max(1, seq_len // max(sp, 1))
    kinds: Dict[Tuple[Any, ...], list] = {}
    for u in units:  # of a kind: the same class holding the same classes (a hybrid's block holds a Mamba mixer or an
        # attention: Nemotron-H's largest, a Mamba block, taken for all was 1.7x over), experts or not, an explicit
        # attention mask or not
        inner = tuple(sorted({type(m).__name__ for m in u.modules()}))
        kinds.setdefault((type(u), inner, bool(_expert_weights(u)), bool(_mask_inputs(u, tokens))), []).append(u)
    if len(kinds) == 1:  # one kind: the largest unit (several, of one class or not: Jamba's Mamba and attention layers)
        per_token, source, notes = _profile_one(unit, hidden, tokens, sp, tp, tiled_mlp, tiled_attention)
        return UnitProfile(per_token=per_token, layers=len(units), hidden=hidden, vocab=vocab, chunk=chunk,
                           unit_type=type(unit), source=source, notes=tuple(notes), vocab_parallel=split_loss)
    parts, notes, sources, of_unit = [], [], set(), {}
    for group in kinds.values():
        largest = max(group, key=lambda u: sum(p.numel() for p in u.parameters()))
        per_token, source, more = _profile_one(largest, hidden, tokens, sp, tp, tiled_mlp, tiled_attention)
        per_token = _with_overlap(per_token)
        parts.append((per_token, len(group)))
        of_unit.update((id(u), per_token) for u in group)
        notes += [n for n in more if n not in notes]
        sources.add(source)
    keys = set().union(*(p for p, _ in parts))
    mean = {k: sum(p.get(k, 0.0) * n for p, n in parts) / len(units) for k in keys}
    mean["backward"] = max(p.get("backward", 0.0) for p, _ in parts)
    # the sliding-window mask is the model's one (estimate_activations adds it once): held if any kind reads it, not a
    # mean (Gemma 4's sliding / full layers halved it)
    mean["mask"] = max(p.get("mask", 0.0) for p, _ in parts)
    notes.append(f"{len(kinds)} kinds of units ({', '.join(str(n) for _, n in parts)} of them): each kind's largest "
                 "profiled, the per-token bytes their mean")
    return UnitProfile(per_token=mean, layers=len(units), hidden=hidden, vocab=vocab, chunk=chunk,
                       unit_type=type(unit), source="counted" if sources == {"counted"} else "profiled",
                       notes=tuple(notes), vocab_parallel=split_loss,
                       per_unit=tuple(of_unit.get(id(u)) for u in every))


def activations_for_model(module, *, seq_len: int, micro_batch: int = 1, precision: str = "bf16-mixed",
                          activation_checkpointing=None, offload_activations: bool = False, sp: int = 1,
                          tp: int = 1, chunked_loss=None, tiled_mlp: int = 0,
                          tiled_attention: int = 0) -> ActivationEstimate:
    """The activation plan for ``module``'s largest unit, profiled on fake tensors
    (:func:`lightning_scale.activation_profile.profile_unit`), else counted from its Linear sizes.
    ``chunked_loss``: None = the model's own setting (GPT ``loss_chunk``), True = 512, an int = the chunk, 0 = off.
    ``tiled_mlp``: the ``tiled_mlp=N`` setting -- the unit is profiled with its MLP and norms tiled over N
    positions (:func:`lightning_scale.tiled_mlp.tiled_unit`; a unit tiled already is profiled as it is), so the
    saved set holds the MLP's input, not its ``4d``-wide hiddens, and the backward's working set one tile's.
    ``tiled_attention``: the unit is profiled with its attention run a group of heads at a time
    (:func:`lightning_scale.tiled_attention.tiled_attention_unit`)."""
    prof = profile_model(module, seq_len=seq_len, sp=sp, tp=tp, chunked_loss=chunked_loss, tiled_mlp=tiled_mlp,
                         tiled_attention=tiled_attention)
    # units of several kinds: their working sets in the order they run, under this checkpointing policy
    per_token = units_profile(prof, range(len(prof.per_unit or ())), activation_checkpointing)
    return estimate_activations(seq_len=seq_len, micro_batch=micro_batch, layers=prof.layers,
                                per_token=per_token, hidden=prof.hidden, vocab=prof.vocab, precision=precision,
                                activation_checkpointing=activation_checkpointing,
                                offload_activations=offload_activations, sp=sp, tp=tp, loss_chunk=prof.chunk,
                                source=prof.source, notes=prof.notes, vocab_parallel=prof.vocab_parallel)
