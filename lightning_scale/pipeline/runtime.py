"""The one place where a pipeline schedule meets point-to-point communication and autograd.

:class:`PipelineRuntime` walks this rank's action list of a :class:`~lightning_scale.pipeline.schedule.Schedule`:

* ``RECV_*`` posts an asynchronous receive (the first on a channel also learns the shape);
* ``F`` runs a chunk on the micro-batch input (stage 0) or the received activation; on the last
  stage it applies ``loss_fn(output, target)``;
* ``B`` backpropagates the received output gradient (on the last stage: ``loss * grad_scale / M``,
  so accumulated gradients are those of the mean loss over micro-batches); ``I`` / ``W`` split it
  for zero-bubble schedules (:mod:`lightning_scale.pipeline.backward`);
* ``SEND_*`` posts an asynchronous send; all sends are waited at the end of the step, so a stage
  never waits for its own send before its next compute (``blocking=True`` waits every send before
  the next compute and prefetches nothing: the reference the asynchronous path equals bit for bit).

Gradients accumulate in ``.grad`` like a normal backward (nothing is zeroed), so optimizers,
gradient clipping and accumulation over several ``train_step`` calls work as usual. After the
schedule, gradients of parameters tied across ranks (embedding / LM head) are summed between their
holders, and the last stage sends the mean loss to every other pipeline rank without waiting for it to be
received (its own step ends there), so every pipeline rank returns it. Each of these messages has its own tag,
made of the runtime's number on this pipeline and the step's (:func:`~lightning_scale.comm.p2p.stream_tag`),
and its send is kept alive until it completes, also past the runtime (see :meth:`PipelineRuntime.close`).

If anything raises mid-schedule, the runtime makes its pipeline neighbours fail at once
(:meth:`P2P.abort`) and re-raises: no rank is left blocked in a receive. A ``timeout`` bounds
every wait as a second line of defence.

``trace=True`` (or ``LIGHTNING_SCALE_PIPELINE_TRACE=1``) records every compute, post and wait of the
last step in ``last_trace`` (:mod:`lightning_scale.pipeline.runtime_trace`); off by default.
"""

from __future__ import annotations

import bisect
import datetime
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from lightning_scale.comm.p2p import P2P, PendingRecv, stream_tag, wait_detached
from lightning_scale.config import ConfigError
from lightning_scale.pipeline import schedule as S
from lightning_scale.pipeline.backward import WeightGradSplitter, backward_input, backward_weight
from lightning_scale.pipeline.runtime_trace import TraceEvent, Tracer, trace_from_env
from lightning_scale.pipeline.stage import PipelineStage
from lightning_scale.pipeline.validate import validate_schedule

Key = Tuple[int, int]  # (stage, microbatch)
# Runtimes built so far in this process per pipeline (its global ranks): every rank of a pipeline builds its
# runtimes in the same order, so the n-th runtime has the same number on each and the loss tags agree.
_RUNTIMES_BUILT: Dict[Tuple[int, ...], int] = {}


@dataclass
class _Step:
    """Everything one step keeps between actions; dropped when the step ends."""

    inputs: List[torch.Tensor]
    targets: Optional[List[torch.Tensor]]
    train: bool
    grad_scale: float
    batch_key: tuple
    keep_outputs: bool = False
    recvs: Dict[Tuple[str, int, int], PendingRecv] = field(default_factory=dict)
    saved: Dict[Key, tuple] = field(default_factory=dict)  # F -> (input, output or loss, records)
    outputs: Dict[Key, torch.Tensor] = field(default_factory=dict)  # activations to send / hand over
    input_grads: Dict[Key, torch.Tensor] = field(default_factory=dict)  # to send / hand over
    weight_work: Dict[Key, list] = field(default_factory=dict)
    losses: List[torch.Tensor] = field(default_factory=list)
    results: Dict[int, torch.Tensor] = field(default_factory=dict)  # eval outputs by micro-batch
    compute_s: float = 0.0
    wait_s: float = 0.0  # blocked in receives (data from a peer) and in the final wait for sends
    action_s: dict[tuple[str, int], float] = field(default_factory=dict)  # (kind, stage) -> compute seconds
    tracer: Optional[Tracer] = None


class PipelineRuntime:
    """Run training / evaluation steps of one pipeline rank.

    Args:
        stage: this rank's chunks (:func:`~lightning_scale.pipeline.stage.build_stage`).
        pp_group: the process group of this pipeline (``Topology.pp_group``); None when pp == 1.
        pp_ranks: global ranks of the pipeline ranks, in stage order (``Topology.axis_ranks("pp")``).
        loss_fn: ``loss_fn(output, target) -> scalar`` applied per micro-batch on the last stage.
        microbatches: micro-batches per step; must divide the batch size.
        schedule: a name from :func:`~lightning_scale.pipeline.schedule.available_schedules` or a Schedule.
        timeout: bound on every wait for a peer (default: the process group's timeout).
        prefetch: receives posted ahead of the schedule (once their shape is cached), so data
            arrives while this rank computes.
        trace: record the last step's events in ``last_trace`` (default: the environment variable
            ``LIGHTNING_SCALE_PIPELINE_TRACE``; off).
        blocking: the synchronous reference (slower): no receive is prefetched and every send is
            waited before this rank's next compute. (Not right where it is posted: under gloo a send
            completes when the peer has posted its receive, so in 1F1B two neighbours would each
            wait in a send to the other before posting the receive the other one needs.)
    """

    def __init__(self, stage: PipelineStage, *, pp_group=None, pp_ranks: Optional[Sequence[int]] = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], microbatches: int,
                 schedule: Union[str, S.Schedule] = "1f1b", timeout: Optional[datetime.timedelta] = None,
                 prefetch: int = 2, trace: Optional[bool] = None, blocking: bool = False) -> None:
        self.stage, self.loss_fn, self.microbatches = stage, loss_fn, microbatches
        self.blocking, self.trace = bool(blocking), trace_from_env(trace)
        self.prefetch = 0 if self.blocking else prefetch
        if isinstance(schedule, S.Schedule):
            self.schedule = schedule
        else:
            self.schedule = S.build_schedule(schedule, stage.pp, microbatches, stage.virtual_stages)
        sch = self.schedule
        if (sch.num_ranks, sch.virtual_stages, sch.num_microbatches) != (stage.pp, stage.virtual_stages, microbatches):
            raise ConfigError(f"schedule {sch.name!r} is for pp={sch.num_ranks}, virtual_stages={sch.virtual_stages}, "
                              f"microbatches={sch.num_microbatches}; the stage has pp={stage.pp}, virtual_stages="
                              f"{stage.virtual_stages} and microbatches={microbatches}")
        validate_schedule(sch)  # cheap; a hand-written schedule fails here, not in a hang
        if self.blocking and stage.pp > 1 and sch.virtual_stages > 1:
            # each rank waits in a send whose receive the other posts only later in its list (seen at pp=2, v=2, 4
            # micro-batches: both ranks in a send until the timeout); gpipe / 1f1b / zero_bubble run
            raise ConfigError(f"PipelineRuntime(blocking=True) is the synchronous reference for schedules without "
                              f"virtual stages; {sch.name!r} with virtual_stages={sch.virtual_stages} would deadlock "
                              "in it (use the default blocking=False)")
        self._eval_schedule = sch.forward_only()
        validate_schedule(self._eval_schedule)
        self.pp_ranks = list(pp_ranks) if pp_ranks is not None else list(range(stage.pp))
        self._check_group(pp_group)
        self.pp_group = pp_group
        self.device = next((p.device for p in stage.parameters()), torch.device("cpu"))
        self.p2p = P2P(pp_group, timeout=timeout, device=self.device, ranks=self.pp_ranks) if stage.pp > 1 else None
        # this runtime's number on its pipeline and its step count: the loss hand-out's tag (stream_tag)
        self._stream = _RUNTIMES_BUILT.get(tuple(self.pp_ranks), 0) if stage.pp > 1 else 0
        if stage.pp > 1:
            _RUNTIMES_BUILT[tuple(self.pp_ranks)] = self._stream + 1
        self._steps = 0
        split = sch.splits_backward
        self._splitters = {s: WeightGradSplitter(stage.chunk(s)) for s in stage.stage_ids} if split else {}
        # Timing of this rank's last schedule run (not the tied-gradient sum, not the loss hand-out):
        # wall time, compute (F/B/I/W), time blocked on peers (receives, final wait for sends),
        # compute per (action kind, stage), and the (start, end) time.perf_counter() stamps. On one
        # host perf_counter is the system monotonic clock, so stamps of different ranks compare:
        # max(end) - min(start) over the pipeline ranks is the step's makespan, the window in which
        # the schedule's bubble (the idle share of p * makespan) is defined. A rank's own
        # last_step_s misses the time it idles after its last action while others still work.
        self.last_compute_s = self.last_step_s = self.last_wait_s = 0.0
        self.last_action_s: dict[tuple[str, int], float] = {}
        self.last_window: tuple[float, float] = (0.0, 0.0)
        self.last_trace: List[TraceEvent] = []  # filled only with trace=True
        # seconds the last step spent after its schedule (tied-gradient sum, loss hand-out)
        self.last_epilogue_s = 0.0
        self.sync_tied_parameters()

    def _check_group(self, pp_group) -> None:
        st = self.stage
        if len(self.pp_ranks) != st.pp:
            raise ConfigError(f"pp_ranks={self.pp_ranks} must list pp={st.pp} global ranks")
        if st.pp > 1:
            if pp_group is None or not dist.is_initialized():
                raise ConfigError("pp > 1 needs torch.distributed initialized and a pp_group (Topology.pp_group)")
            if dist.get_world_size(pp_group) != st.pp:
                raise ConfigError(f"pp_group has {dist.get_world_size(pp_group)} ranks but pp={st.pp}")
            if dist.get_rank() != self.pp_ranks[st.pp_rank]:
                raise ConfigError(f"this process is global rank {dist.get_rank()} but pp_ranks[{st.pp_rank}] = "
                                  f"{self.pp_ranks[st.pp_rank]}")

    # ------------------------------------------------------------------ public steps
    def train_step(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                   grad_scale: float = 1.0) -> torch.Tensor:
        """Forward + backward of one batch; returns the mean micro-batch loss (float64) on every pp rank.

        Every pipeline rank passes the same ``inputs`` (the first stage computes on them, the others
        read their shape); ``targets`` are needed on the rank holding the last stage. Gradients of
        the mean loss times ``grad_scale`` are accumulated into this rank's parameters' ``.grad``.
        """
        with self._abort_on_error():
            step = self._new_step(inputs, targets, train=True, grad_scale=grad_scale)
            snapshots = [t.param.grad.clone() if t.param.grad is not None else None for t in self.stage.tied]
            self._run(self.schedule, step)
            t0 = time.perf_counter()
            self._sum_tied_grads(snapshots)
            loss = self._mean_loss(step)
            self.last_epilogue_s = time.perf_counter() - t0
            return loss

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                  return_outputs: bool = False):
        """Forward only. Returns the mean loss on every pp rank (None when the last stage got no
        targets); with ``return_outputs`` returns ``(loss, outputs)``, the last stage's outputs
        concatenated over micro-batches (None on other ranks)."""
        with self._abort_on_error():
            step = self._new_step(inputs, targets, train=False, grad_scale=1.0)
            step.keep_outputs = return_outputs
            self._run(self._eval_schedule, step)
            t0 = time.perf_counter()
            loss = self._mean_loss(step)
            self.last_epilogue_s = time.perf_counter() - t0
        if not return_outputs:
            return loss
        outs = torch.cat([step.results[i] for i in range(self.microbatches)]) if self.stage.is_last else None
        return loss, outs

    # ------------------------------------------------------------------ driver
    def _new_step(self, inputs, targets, *, train: bool, grad_scale: float) -> _Step:
        if inputs is None:
            raise ValueError("train_step/eval_step need the batch inputs on every pipeline rank "
                             "(only their shape is read off the first stage)")
        mb_inputs = _split(inputs, self.microbatches, "inputs")
        mb_targets = None
        if self.stage.is_last:
            if targets is None and train:
                raise ValueError("the rank holding the last pipeline stage needs targets for the loss")
            mb_targets = _split(targets, self.microbatches, "targets") if targets is not None else None
        key = (tuple(mb_inputs[0].shape), str(mb_inputs[0].dtype), torch.is_autocast_enabled())
        return _Step(mb_inputs, mb_targets, train, grad_scale, key)

    @contextmanager
    def _abort_on_error(self) -> Iterator[None]:
        """On any error, wake the pipeline peers (they fail instead of waiting for us), then re-raise."""
        try:
            yield
        except BaseException:
            if self.p2p is not None:
                self.p2p.abort([r for k, r in enumerate(self.pp_ranks) if k != self.stage.pp_rank])
            raise

    def _run(self, sch: S.Schedule, step: _Step) -> None:
        """Execute this rank's actions; receives are posted up to ``prefetch`` ahead once their shape is known."""
        start = time.perf_counter()
        step.tracer = Tracer() if self.trace else None
        acts = sch.actions[self.stage.pp_rank]
        recv_at = [k for k, a in enumerate(acts) if a.kind in (S.RECV_F, S.RECV_B)]
        posted = 0  # acts[recv_at[:posted]] are posted, always in list order (channels match in order)
        for k, action in enumerate(acts):
            if action.kind in (S.RECV_F, S.RECV_B):
                if posted < len(recv_at) and recv_at[posted] == k:
                    self._post_recv(action, step)
                    posted += 1
            else:
                self._dispatch(action, step)
            reached = bisect.bisect_right(recv_at, k)
            while posted < min(len(recv_at), reached + self.prefetch):
                ahead = acts[recv_at[posted]]
                if not self.p2p.has_shape(*self._recv_channel(ahead, step)):
                    break  # its header must be received when the schedule gets there, not earlier
                self._post_recv(ahead, step)
                posted += 1
        if self.p2p is not None:
            t0 = time.perf_counter()
            if step.tracer is not None:
                step.tracer.wait_sends()  # each send's wait recorded; the headers follow untraced
            self.p2p.wait_sends()
            self.p2p.release_free()
            step.wait_s += time.perf_counter() - t0
        end = time.perf_counter()
        self.last_compute_s, self.last_step_s, self.last_window = step.compute_s, end - start, (start, end)
        self.last_wait_s, self.last_action_s = step.wait_s, step.action_s
        self.last_trace = step.tracer.events if step.tracer is not None else []

    def _recv_channel(self, a: S.Action, step: _Step) -> Tuple[int, str, tuple]:
        if a.kind == S.RECV_F:
            return self._peer(-1), "act", (a.stage - 1, step.batch_key)
        return self._peer(+1), "grad", (a.stage + 1, step.batch_key)

    def _post_recv(self, a: S.Action, step: _Step) -> None:
        src, kind, key = self._recv_channel(a, step)
        t0 = time.perf_counter()
        step.recvs[(kind, a.stage, a.microbatch)] = self.p2p.recv(src, kind, key, self.device)
        if step.tracer is not None:
            step.tracer.add("recv_post", a.stage, a.microbatch, kind, t0, time.perf_counter())

    def _wait_recv(self, kind: str, s: int, i: int, step: _Step) -> torch.Tensor:
        pending = step.recvs.pop((kind, s, i))
        if step.tracer is None:
            return pending.wait()
        t0 = time.perf_counter()
        out = pending.wait()
        step.tracer.add("recv_wait", s, i, kind, t0, time.perf_counter())
        return out

    def _send(self, tensor: torch.Tensor, direction: int, kind: str, a: S.Action, step: _Step) -> None:
        t0 = time.perf_counter()
        handle = self.p2p.send(tensor, self._peer(direction), kind, (a.stage, step.batch_key))
        if step.tracer is not None:
            step.tracer.sent(handle, a.stage, a.microbatch, kind, t0)

    def _dispatch(self, a: S.Action, step: _Step) -> None:
        kind = a.kind
        if kind == S.SEND_F:
            self._send(step.outputs.pop((a.stage, a.microbatch)), +1, "act", a, step)
        elif kind == S.SEND_B:
            self._send(step.input_grads.pop((a.stage, a.microbatch)), -1, "grad", a, step)
        else:
            s, i = a.stage, a.microbatch
            # wait for the data first, so compute_s measures compute only (the rest is bubble)
            t0 = time.perf_counter()
            if self.blocking:  # the synchronous reference: this rank's sends finish before it computes again
                step.tracer.wait_sends() if step.tracer is not None else self.p2p.wait_sends()
            if kind == S.F:
                x = self._forward_input(s, i, step)
            elif kind in (S.B, S.I):
                grad = self._output_grad(s, i, step)
            t1 = time.perf_counter()
            step.wait_s += t1 - t0
            if step.tracer is not None:
                step.tracer.poll_sends()
            t0 = time.perf_counter()
            if kind == S.F:
                self._forward(s, i, x, step)
            elif kind in (S.B, S.I):
                self._backward(s, i, grad, step, split=kind == S.I)
            elif kind == S.W:
                backward_weight(step.weight_work.pop((s, i)))
            else:
                raise S.ScheduleError(f"unknown action {a}")
            t1 = time.perf_counter()
            dt = t1 - t0
            if step.tracer is not None:
                step.tracer.add(kind, s, i, "", t0, t1)
            step.compute_s += dt
            step.action_s[(kind, s)] = step.action_s.get((kind, s), 0.0) + dt

    def _peer(self, direction: int) -> int:
        return self.pp_ranks[(self.stage.pp_rank + direction) % self.stage.pp]

    # ------------------------------------------------------------------ compute
    def _forward_input(self, s: int, i: int, step: _Step) -> torch.Tensor:
        if s == 0:
            return step.inputs[i]
        if (s - 1) in self.stage.stage_ids:  # previous chunk on this rank (pp == 1): hand over locally
            return step.outputs.pop((s - 1, i))
        return self._wait_recv("act", s, i, step)

    def _output_grad(self, s: int, i: int, step: _Step) -> Optional[torch.Tensor]:
        if s == self.stage.num_stages - 1:
            return None  # the loss starts the backward
        if (s + 1) in self.stage.stage_ids:
            return step.input_grads.pop((s + 1, i))
        return self._wait_recv("grad", s, i, step)

    def _forward(self, s: int, i: int, x: torch.Tensor, step: _Step) -> None:
        last = s == self.stage.num_stages - 1
        if step.train and s > 0 and x.is_floating_point():
            # stage 0's input gradient has no consumer: asking for it would run the whole input-gradient
            # path of the first layer (for a float input) for nothing
            x = x.detach().requires_grad_(True)
        chunk = self.stage.chunk(s)
        splitter = self._splitters.get(s) if step.train else None
        if splitter is not None:
            with splitter.capture() as records:
                out = chunk(x)
        else:
            records, out = [], chunk(x)
        if last:
            if step.keep_outputs:
                step.results[i] = out
            if step.targets is not None:
                out = self.loss_fn(out, step.targets[i])
                step.losses.append(out.detach())
        else:
            step.outputs[(s, i)] = out.detach()
        if step.train:
            step.saved[(s, i)] = (x, out, records)

    def _backward(self, s: int, i: int, grad: Optional[torch.Tensor], step: _Step, split: bool) -> None:
        x, out, records = step.saved.pop((s, i))
        if s == self.stage.num_stages - 1:
            out = out * (step.grad_scale / self.microbatches)  # mean over micro-batches
        if split:
            gx, work = backward_input(out, grad, x, records, self._splitters[s].splittable)
            step.weight_work[(s, i)] = work
        else:
            torch.autograd.backward(out, grad)
            gx = x.grad if x.requires_grad else None
            if grad is not None and self.p2p is not None and (s + 1) not in self.stage.stage_ids:
                # the received gradient buffer, if nothing holds it now (the caller's variable, this argument and
                # getrefcount's: 3 references; its storage used by it alone), fills the next gradient receive
                if sys.getrefcount(grad) <= 3 and _storage_unshared(grad):
                    self.p2p.recycle(grad)
        if s > 0:
            if gx is None:
                raise RuntimeError(f"stage {s} produced no gradient for its input; every stage output "
                                   "passed between stages must depend on the stage input")
            step.input_grads[(s, i)] = gx

    # ------------------------------------------------------------------ after the schedule
    def _mean_loss(self, step: _Step) -> Optional[torch.Tensor]:
        """Mean micro-batch loss of the last stage, on every pp rank (None when it had no targets).

        The last stage sends ``[loss, has loss]`` (float64, fixed: no header) to each other rank point to point
        and does not wait: it has the value, and under gloo a send completes only once the peer posts the
        receive, i.e. (1F1B) after the first stage's last backward; gloo's broadcast held the last stage, and at
        pp=4 the middle ranks, there. Each step's message has its own tag (this runtime's number, the step's),
        so a receive can only take the message of its own runtime and step. The sends are waited with the next
        step's, and kept alive past this runtime until they complete (a gloo send whose handle is freed before
        the peer posts its receive never arrives: 266806c lost the header of a one-step runtime this way, and
        the first stage hung in the next receive)."""
        buf = torch.zeros(2, dtype=torch.float64, device=self.device)  # [loss, has loss]
        if self.stage.is_last and step.losses:
            buf[0] = torch.stack([loss.to(torch.float64) for loss in step.losses]).mean()
            buf[1] = 1.0
        if self.stage.pp > 1:
            tag = stream_tag(self._stream, self._steps)
            self._steps += 1
            if self.stage.is_last:
                for dst in self.pp_ranks[:-1]:
                    self.p2p.send_detached(buf, dst, tag, "pp_loss")
                buf = buf.clone()  # the sent tensor stays untouched
            else:
                buf = self.p2p.recv_tagged(buf, self.pp_ranks[-1], tag, "pp_loss").wait()
        return buf[0] if buf[1] > 0 else None

    def close(self) -> None:
        """Wait until this process's loss hand-outs have been received (the last stage's last step leaves them in
        flight). Call it, or any collective of the pipeline group, before destroying the process group right
        after a step; at interpreter exit it runs by itself. Safe to call more than once; steps may follow."""
        if self.p2p is not None:
            self.p2p.wait_sends()
        wait_detached()

    def _sum_tied_grads(self, snapshots: Sequence[Optional[torch.Tensor]]) -> None:
        """Add the other holder's contribution of this step to each tied parameter's gradient."""
        me = self.stage.pp_rank
        for tied, before in zip(self.stage.tied, snapshots):
            p = tied.param
            local = torch.zeros_like(p) if p.grad is None else (p.grad - before if before is not None else p.grad)
            (peer,) = [r for r in tied.ranks if r != me]
            other = self.p2p.exchange(local, self.pp_ranks[peer], "tied")
            if p.grad is None:
                p.grad = other
            else:
                p.grad.add_(other)

    @torch.no_grad()
    def sync_tied_parameters(self) -> None:
        """Copy each tied parameter from its first holder to the other (they must start equal)."""
        me = self.stage.pp_rank
        for tied in self.stage.tied:
            first, second = tied.ranks
            data = self.p2p.exchange(tied.param.detach(), self.pp_ranks[second if me == first else first], "tied")
            if me == second:
                tied.param.copy_(data)


def _storage_unshared(t: torch.Tensor) -> bool:
    """True when no other tensor (a view, an alias autograd kept) uses ``t``'s storage."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return use_count(t.untyped_storage()._cdata) <= 2  # t's and the temporary storage object's references


def _split(t: torch.Tensor, m: int, what: str) -> List[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"pipeline {what} must be a tensor with the batch in dim 0, got {type(t).__name__}")
    if t.dim() == 0 or t.shape[0] % m:
        size = t.shape[0] if t.dim() else "a scalar"
        raise ConfigError(f"pipeline.microbatches={m} does not divide the batch size {size} of the {what}")
    return list(t.split(t.shape[0] // m))
