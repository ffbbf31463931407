"""The memory plan at pp > 1: each pipeline rank's activation peak, walked over its own schedule.

A pipeline rank holds the activations of every micro-batch whose forward has run on it and whose backward has not:
1F1B keeps ``min(pp - s, m)`` of them on stage ``s``, GPipe all ``m``; interleaved and zero-bubble schedules keep a
number that depends on the order. Rather than a formula per schedule, :func:`schedule_peak` walks the rank's action
list of :mod:`lightning_scale.pipeline.schedule` (the list the runtime executes) and adds up, at every compute
action, the bytes alive then:

* each live micro-batch's ``keep`` on its stage (from its ``F`` to its ``B``; to its ``W`` when the backward is
  split: ``I`` keeps the graph, :func:`lightning_scale.pipeline.backward.backward_input` runs it with
  ``retain_graph=True``, so nothing of ``keep`` is freed before ``W``);
* at a ``B`` / ``I``, that micro-batch's ``backward`` working set above its ``keep`` (one unit's recompute and
  gradients, on the last stage the loss step);
* split backward (zero-bubble): from its ``F`` a micro-batch also keeps the recorded module outputs no op saves
  (a GPT block: the two output projections, 2 d; the embeddings; the head's logits), and from its ``I`` to its
  ``W`` ``work``, the gradient of the output of every parameter-owning module of the stage (the ``WeightWork``
  ``W`` consumes: a GPT block 11 d, the head ``V / tp``; :func:`split_backward_width`); the ``I``'s working set is
  the larger of ``backward`` and ``work`` (measured on one GPT stage: the gradients, at their end). A stage
  holding activation-checkpointed units is not split (:class:`~lightning_scale.pipeline.backward.WeightGradSplitter`:
  W would re-run each unit's recompute): its whole backward runs in ``I``, which the walk counts as a ``B``
  (``keep`` freed there, no records, no ``work``), its ``W`` is empty;
* the point-to-point buffers, as :class:`lightning_scale.pipeline.runtime.PipelineRuntime` keeps them: every sent
  activation / input gradient stays referenced by its posted send until the step's end (``P2P.wait_sends``), and
  receives are posted up to ``prefetch`` ahead of the schedule once their channel's shape is known (step 1 learns
  each shape at the channel's first receive; the walk mirrors the runtime's posting loop);
* after the schedule, the tied-parameter gradient exchange (two tensors of the tied parameters' size).

Per micro-batch and stage (``T`` = positions of one micro-batch on this rank, the unit numbers from
:func:`lightning_scale.activation_plan.estimate_activations` for the stage's ``n_s`` units, ``b`` activation bytes):
``keep = kept(n_s)`` (+ on the last stage ``head + T * V/tp * 4``, the fp32 log-softmax the loss keeps);
``backward = recompute`` (last stage: ``max(head + loss, recompute) - head - T * V/tp * 4``); sent activation and
input gradient ``T * H * b`` each. The loss is not chunked under pp (the last stage's loss gets the head's logits).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from lightning_scale.config import ConfigError

__all__ = ["PipelinePeak", "StageBytes", "schedule_peak", "pipeline_activations", "split_backward_width"]


@dataclass(frozen=True)
class StageBytes:
    """Bytes one micro-batch costs on one (virtual) stage."""

    keep: float  # from its forward to its backward
    backward: float  # above ``keep``, at the peak of its backward
    out: float = 0.0  # the activation sent to the next stage (0 on the last)
    grad: float = 0.0  # the input gradient sent back (0 on stage 0)
    recv_f: float = 0.0  # a received activation (the stage's input), before its forward uses it
    recv_b: float = 0.0  # a received output gradient, before its backward uses it
    work: float = 0.0  # split backward: the module-output gradients held from I to W
    split: bool = True  # False: a split schedule runs this stage's whole backward in I (checkpointed units)


@dataclass(frozen=True)
class PipelinePeak:
    """One pipeline rank's activation peak over one step of its schedule."""

    schedule: str
    pp_rank: int
    stages: Tuple[int, ...]
    microbatches: int
    peak: float  # step 1 (each receive channel's shape learned at its first receive)
    steady: float  # from step 2 on (shapes cached: receives posted ``prefetch`` ahead from the start)
    in_flight: int  # micro-batches holding activations at the step-1 peak
    max_in_flight: int  # most micro-batches live at once over the step
    p2p: float  # send / receive buffers alive at the step-1 peak
    kept: float  # what the live micro-batches keep at the step-1 peak
    at: str  # the action of the peak, e.g. "B(s0,m1)"


def _channel(a) -> Tuple[str, int]:
    from lightning_scale.pipeline import schedule as S

    return ("act", a.stage - 1) if a.kind == S.RECV_F else ("grad", a.stage + 1)


def _walk(schedule, rank: int, stages: Dict[int, StageBytes], prefetch: int, known: set,
          tied_bytes: float) -> Tuple[float, int, int, float, float, str]:
    """(peak bytes, live micro-batches then, most live ever, p2p bytes then, kept bytes then, the action)."""
    from lightning_scale.pipeline import schedule as S

    acts = schedule.actions[rank]
    recv_at = [k for k, a in enumerate(acts) if a.kind in (S.RECV_F, S.RECV_B)]
    live: Dict[Tuple[int, int], float] = {}
    bufs: Dict[Tuple[str, int, int], float] = {}  # posted receives not yet used
    sent = 0.0
    best = (0.0, 0, 0.0, 0.0, "")
    most = 0
    posted = 0

    def post(q: int) -> None:
        a = acts[recv_at[q]]
        st = stages[a.stage]
        bufs[(a.kind, a.stage, a.microbatch)] = st.recv_f if a.kind == S.RECV_F else st.recv_b
        known.add(_channel(a))

    for k, a in enumerate(acts):
        moment = kept = None
        if a.kind in (S.RECV_F, S.RECV_B):
            if posted < len(recv_at) and recv_at[posted] == k:
                post(posted)
                posted += 1
        elif a.kind == S.F:
            bufs.pop((S.RECV_F, a.stage, a.microbatch), None)  # the received input is now part of keep
            live[(a.stage, a.microbatch)] = stages[a.stage].keep
            sent += stages[a.stage].out  # held by its send until the step's end
            moment = kept = sum(live.values())
        elif a.kind in (S.B, S.I):
            bufs.pop((S.RECV_B, a.stage, a.microbatch), None)  # the incoming gradient: in the backward set
            kept = sum(live.values())
            moment = kept + stages[a.stage].backward
            if a.kind == S.B or not stages[a.stage].split:  # an unsplit I is a whole backward: keep freed
                live.pop((a.stage, a.microbatch), None)
            else:  # I makes the module-output gradients W consumes (its working set: they dominate it); they live
                # with the graph until the W
                work = stages[a.stage].work
                moment = kept + max(stages[a.stage].backward, work)
                live[(a.stage, a.microbatch)] = live.get((a.stage, a.microbatch), 0.0) + work
            sent += stages[a.stage].grad
        elif a.kind == S.W:
            live.pop((a.stage, a.microbatch), None)
        most = max(most, len(live))
        if moment is not None:
            p2p = sum(bufs.values()) + sent
            if moment + p2p > best[0]:
                best = (moment + p2p, len(live) + (a.kind == S.B or (a.kind == S.I and not stages[a.stage].split)),
                        p2p, kept, str(a))
        reached = bisect.bisect_right(recv_at, k)
        while posted < min(len(recv_at), reached + prefetch):
            if _channel(acts[recv_at[posted]]) not in known:
                break  # the runtime receives this channel's header when the schedule gets there
            post(posted)
            posted += 1
    if tied_bytes > best[0]:  # after the schedule: the tied gradients' local part and the peer's
        best = (tied_bytes, 0, 0.0, 0.0, "tied gradient exchange")
    return best[0], best[1], most, best[2], best[3], best[4]


def schedule_peak(schedule, rank: int, stages: Dict[int, StageBytes], *, prefetch: int = 2,
                  tied_bytes: float = 0.0) -> PipelinePeak:
    """The activation peak of pipeline rank ``rank`` over ``schedule`` (see the module docstring); ``stages``
    maps each of the rank's stage ids to its per-micro-batch bytes."""
    mine = schedule.rank_stages(rank)
    missing = [s for s in mine if s not in stages]
    if missing:
        raise ValueError(f"no bytes given for stage(s) {missing} of pipeline rank {rank}")
    peak, in_flight, most, p2p, kept, at = _walk(schedule, rank, stages, prefetch, set(), tied_bytes)
    everything = {_channel(a) for a in schedule.actions[rank] if a.kind in ("RECV_F", "RECV_B")}
    steady = _walk(schedule, rank, stages, prefetch, set(everything), tied_bytes)[0]
    return PipelinePeak(schedule=schedule.name, pp_rank=rank, stages=tuple(mine),
                        microbatches=schedule.num_microbatches, peak=peak, steady=max(steady, peak),
                        in_flight=in_flight, max_in_flight=most, p2p=p2p, kept=kept, at=at)


def _output_width(module) -> float:
    """Elements per token of ``module``'s output, read from its own parameters (Linear / tp slices: the weight's
    rows; Embedding / HF ``Conv1D``: the weight's columns; norms: the weight's length)."""
    import torch.nn as nn

    weight = getattr(module, "weight", None)
    w = weight if weight is not None and weight.dim() > 0 else getattr(module, "bias", None)
    if w is None or w.dim() == 0:
        return 0.0
    if w.dim() == 1:
        return float(w.shape[0])
    columns = isinstance(module, nn.Embedding) or type(module).__name__ == "Conv1D"
    return float(w.shape[1] if columns else w.shape[0])


def split_backward_width(layers: Sequence, unit_type: Optional[type] = None, last: bool = False
                         ) -> Tuple[float, float]:
    """(gradient, unsaved) elements per token a split backward holds on a stage of ``layers``, beyond the plain
    schedules' ``keep``. :class:`lightning_scale.pipeline.backward.WeightGradSplitter` records the output of every
    module owning a trainable parameter from the ``F`` to the ``W``, and ``I`` makes each one's gradient: *gradient*
    is one element per output element of all of them. *unsaved* counts the outputs outside ``unit_type`` modules
    that no op saves (the units' own come from their profile's ``recorded``): an embedding's (its sum with the
    positions saves nothing) and, on the ``last`` stage, the head's logits (the loss keeps its log-softmax only).
    (0, 0) when a parameter has two owners (the runtime then runs the whole backward in ``I``)."""
    owner: Dict[int, int] = {}
    inside = {id(m) for layer in layers for u in layer.modules() if unit_type is not None and type(u) is unit_type
              for m in u.modules()}
    width = unsaved = 0.0
    head = None
    for layer in layers:
        for m in layer.modules():
            own = [p for p in m.parameters(recurse=False) if p.requires_grad]
            for p in own:
                if owner.setdefault(id(p), id(m)) != id(m):
                    return 0.0, 0.0
            if not own:
                continue
            width += _output_width(m)
            if id(m) not in inside:
                unsaved += _output_width(m) if _is_embedding(m) else 0.0
                head = m
    if last and head is not None and not _is_embedding(head) and getattr(head, "weight", None) is not None \
            and head.weight.dim() == 2:
        unsaved += _output_width(head)
    return width, unsaved


def _is_embedding(module) -> bool:
    import torch.nn as nn

    return isinstance(module, nn.Embedding) or "Embedding" in type(module).__name__


def pipeline_activations(*, schedule, pp_rank: int, units: Dict[int, int], seq_len: int, micro_batch: int,
                         per_token: Dict[str, float], hidden: int, vocab: int, precision: str = "bf16-mixed",
                         activation_checkpointing=None, offload_activations: bool = False, sp: int = 1,
                         tp: int = 1, prefetch: int = 2, tied_numel: int = 0, source: str = "given",
                         notes: Sequence[str] = (), split_widths: Optional[Dict[int, Tuple[float, float]]] = None,
                         vocab_parallel: bool = True, stage_per_token: Optional[Dict[int, Dict[str, float]]] = None):
    """The activation plan of pipeline rank ``pp_rank``: ``units`` maps its stage ids to their unit counts,
    ``stage_per_token`` (optional) a stage id to its own units' per-token bytes (units of several kinds: a hybrid's
    attention and Mamba layers are not spread evenly over the stages), else every stage takes ``per_token``;
    ``micro_batch`` is the sequences of one pipeline micro-batch; ``split_widths`` its stage ids to
    :func:`split_backward_width` (read when the schedule splits the backward; missing: 0). Returns an ``ActivationEstimate`` whose
    ``pipeline`` holds the schedule walk (its ``peak`` is the walk's)."""
    import dataclasses

    from lightning_scale.activation_plan import _act_bytes, estimate_activations, loss_vocab

    last_id = schedule.num_stages - 1
    b = _act_bytes(precision)
    stages: Dict[int, StageBytes] = {}
    per_stage = {}
    for s in schedule.rank_stages(pp_rank):
        if s not in units:
            raise ConfigError(f"pipeline stage {s} of pipeline rank {pp_rank}: its unit count is unknown")
        n = units[s]
        mine = (stage_per_token or {}).get(s, per_token)
        est = estimate_activations(seq_len=seq_len, micro_batch=micro_batch, layers=max(n, 1), per_token=mine,
                                   hidden=hidden, vocab=vocab, precision=precision,
                                   activation_checkpointing=activation_checkpointing,
                                   offload_activations=offload_activations, sp=sp, tp=tp, loss_chunk=0,
                                   source=source, notes=notes, vocab_parallel=vocab_parallel)
        kept, recompute = (est.kept, est.recompute) if n else (0.0, 0.0)
        hidden_bytes = est.tokens * hidden * b  # one micro-batch's hidden states between stages
        keep, backward = kept, recompute
        if s == last_id:
            lsm = est.tokens * loss_vocab(vocab, tp, vocab_parallel) * 4  # the fp32 log-softmax the loss keeps for its backward
            keep = kept + est.head + lsm
            backward = max(est.head + est.loss, recompute) - est.head - lsm
        work = 0.0
        # checkpointed units on the stage: WeightGradSplitter does not split it (a whole backward in I, as 1F1B's B)
        split = schedule.splits_backward and not (n and est.policy != "none")
        if split:  # zero-bubble: the records and the gradients W consumes (module docstring)
            grads, unsaved = (split_widths or {}).get(s, (0.0, 0.0))
            work = est.tokens * grads * b
            keep += est.tokens * (unsaved * b + n * mine.get("recorded", 0.0) * b / 4.0) if grads else 0.0
        stages[s] = StageBytes(keep=keep, backward=backward, out=hidden_bytes if s < last_id else 0.0,
                               grad=hidden_bytes if s > 0 else 0.0, recv_f=hidden_bytes if s > 0 else 0.0,
                               recv_b=hidden_bytes if s < last_id else 0.0, work=work, split=split)
        per_stage[s] = est
    walk = schedule_peak(schedule, pp_rank, stages, prefetch=prefetch, tied_bytes=2.0 * tied_numel * b)
    first = per_stage[schedule.rank_stages(pp_rank)[0]]
    extra = ()
    unsplit = [s for s in stages if schedule.splits_backward and not stages[s].split]
    if unsplit:
        extra = (f"zero-bubble with activation checkpointing: stage(s) {unsplit} hold checkpointed units, so their "
                 "backward is not split (all of it in I, as 1F1B; no W overlap)",)
    is_last = last_id in stages
    layers = sum(units[s] for s in stages)
    return dataclasses.replace(
        first, layers=layers, kept=walk.kept, recompute=max(stages[s].backward for s in stages),
        head=first.head if is_last else 0.0, loss=per_stage[last_id].loss if is_last else 0.0,
        host=sum(e.host for e in per_stage.values()) * walk.max_in_flight, pipeline=walk,
        notes=tuple(first.notes) + extra + (f"pp: stages {list(stages)} of pipeline rank {pp_rank}, schedule {schedule.name}, "
                                   f"{walk.in_flight} of {schedule.num_microbatches} micro-batches in flight at the "
                                   f"peak ({walk.at})",))
