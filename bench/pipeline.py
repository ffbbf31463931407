"""Pipeline parallelism on CPU: lightning_scale schedules vs torch.distributed.pipelining, same split.

For pp = 2 and pp = 4 (one process per stage, gloo, one intra-op thread per process), a GPT
(gpt_small widths, 8 blocks) is split into ``pp * v`` contiguous stages by ``--partition``; both
systems get the very same stage modules. Systems run in interleaved rounds inside one process group
(order rotated every round) so machine noise hits them alike:

  ls 1f1b          lightning_scale PipelineRuntime, schedule "1f1b"
  torch 1f1b       torch.distributed.pipelining Schedule1F1B
  ls interleaved   lightning_scale "interleaved_1f1b", v = 2
  torch interl.    torch.distributed.pipelining ScheduleInterleaved1F1B, v = 2
  ls zero_bubble   lightning_scale ZB-H1 (no torch counterpart row)

The split. The default ``--partition compute`` balances parameters outside embedding tables, a
proxy for compute per token. The old default, ``type:Block`` (embedding with the first half of
the blocks, LM head with the second half), leaves the head's d x vocab matmul + cross-entropy as
extra work on the last stage: with d 256 / vocab 8192 the head costs about 2.8 blocks, so at pp=2
the last stage takes ~1.7x the first stage's time, and ``parameters`` gives the same split (it
counts the 8192 x 256 embedding table like the head). ``compute`` gives [embedding + 5 blocks |
3 blocks + head] at pp=2. Whole layers are the unit, so no split is perfectly even.

Reported per system: tokens/s (median over rounds; global tokens of one step / step time), the
ratio to the torch counterpart, peak RSS per stage while that system ran (MB, sampled every 10 ms),
and bubbles, for both systems from the same kind of record:

* the record: lightning_scale's runtime trace (``PipelineRuntime(trace=True)``, one event per compute,
  post and wait; :mod:`lightning_scale.pipeline.runtime_trace`); for torch, each
  ``forward_one_chunk`` (+ the last stage's loss) and ``backward_one_chunk`` call timed by wrapping
  those methods on its stage objects (so torch's per-chunk bookkeeping counts as its compute). Both
  are time.perf_counter stamps on one host, so ranks compare.
* measured: 1 - sum over ranks of compute time / (pp * makespan) per step, averaged over steps; the
  makespan runs from the first compute of any rank to the last, so a rank that finishes early idles
  until the last one is done, as in the theory; the loss hand-out and the optimizer step are outside.
  Idle time is therefore: waiting for the other stage's data (the schedule bubble, plus the time
  the other stage's extra work takes when stages are unequal), transfer latency, and runtime
  overhead (posting sends / receives, Python between actions).
* sim (each action's measured time): the schedule simulated (``validate_schedule``) per step with
  zero transfer cost and every action's own measured duration in that step (stage imbalance and
  that step's jitter included), averaged over steps: the bubble this schedule must have with these
  very compute times. measured / sim - 1 is what transfers and runtime overhead add (the 10% target).
  The table says when torch's compute order differs from our schedule's (then its sim is of ours).
* sim (mean stage times): the same with the mean time of each (action kind, stage): without the
  jitter (under load the jitter alone makes measured exceed this one).
* sim + hand-off latency (lightning_scale): the per-action sim with every transfer taking the median
  measured hand-off latency (a send's post to the end of the receiver's wait, over transfers the
  receiver was already waiting for: transfer plus wake-up time).
* theory (equal stages): (p-1)/(m+p-1) for 1F1B, (p-1)/(v m+p-1) interleaved, (p-1)/(3m+p-1)
  ZB-H1 (F = I = W); it holds only for stages of equal cost, which no split of this GPT achieves.

torch runs with ``return_outputs=False`` (our train_step keeps no outputs either).

The per-stage line lists each stage's measured compute per micro-batch (ms; F + B, or F + I + W);
the "blocked" line, per rank and step, the time spent waiting for receives, waiting for sends (at the
step's end: a send completes once the peer posted the receive), posting, Python between actions
(other) and after the schedule (epilogue).
Compute is wall time: on a machine with fewer free cores than processes (pp=4 on 2 cores, or any
shared machine), "compute" of one rank includes time its core was taken by another process, so
the GPT rows there do not measure the schedule.

Synthetic run (``--sleep-ms MS``): the GPT is replaced by pp * v equal stages that sleep (forward
MS / v per micro-batch; backward MS / v on the input-gradient path and MS / v on the weight-gradient
path, so F = I = W) on activations of the GPT's shape. Sleeping leaves the cores free, so this
measures the schedules' bubble at any pp on any machine, with stages exactly equal: measured -
theory is then transfer latency plus runtime overhead, and tokens/s vs torch compares the two
runtimes alone (same schedule, same transfers, no compute to hide behind).

Never asserts on time.

Full run (quiet machine):  python bench/pipeline.py
Old split:                 python bench/pipeline.py --partition type:Block
Runtime/schedule only:     python bench/pipeline.py --sleep-ms 20
Smoke run:                 python bench/pipeline.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSTEMS = ["ls 1f1b", "torch 1f1b", "ls interleaved", "torch interl.", "ls zero_bubble"]
PEER = {"ls 1f1b": "torch 1f1b", "ls interleaved": "torch interl."}
V = {"ls 1f1b": 1, "torch 1f1b": 1, "ls interleaved": 2, "torch interl.": 2, "ls zero_bubble": 1}


class _RssPeak:
    """Samples this process's RSS in a thread; ``peak_mb`` is the maximum seen while running."""

    def __init__(self) -> None:
        import psutil

        self._proc, self.peak = psutil.Process(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> "_RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def _sleep_layer_cls():
    """SleepLayer (built lazily: torch is imported inside the workers)."""
    import torch

    class _Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, seconds):
            ctx.seconds = seconds
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.seconds)
            return grad, None

    class SleepLayer(torch.nn.Module):
        """Synthetic stage of equal cost that leaves the cores free: the forward sleeps ``seconds``; the
        backward sleeps ``seconds`` on the input-gradient path (I) and ``seconds`` on the
        weight-gradient path (W), so F = I = W and B = 2 F, the costs the theoretical bubbles assume."""

        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(()))
            self.seconds = seconds

        def forward(self, x):
            time.sleep(self.seconds)
            return _Sleep.apply(x, self.seconds) * _Sleep.apply(self.weight, self.seconds)

    return SleepLayer


def _synthetic_loss(out, target):
    return out.mean()


def _build(system, cfg, topo, microbatches, partition, sleep_ms, prefetch=2):
    """A fresh model split into this rank's stage(s); returns (step_fn, params, trace of the last step: a callable
    returning TraceEvent tuples, compute only for torch)."""
    import torch
    from torch.distributed import pipelining as tp

    from lightning_scale.models.gpt import GPT, lm_loss
    from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers

    torch.manual_seed(0)
    v = V[system]
    if sleep_ms:
        # one layer per stage; a rank's v chunks together cost sleep_ms per micro-batch forward
        sleep_layer = _sleep_layer_cls()
        layers, loss_fn = [sleep_layer(sleep_ms / 1e3 / v) for _ in range(topo.pp * v)], _synthetic_loss
        partition = "uniform"
    else:
        layers, loss_fn = gpt_pipeline_layers(GPT(cfg)), lm_loss
    stage = build_stage(layers, pp=topo.pp, pp_rank=topo.pp_rank, virtual_stages=v, partition=partition)
    params = list(stage.parameters())
    if system.startswith("ls"):
        name = {"ls 1f1b": "1f1b", "ls interleaved": "interleaved_1f1b", "ls zero_bubble": "zero_bubble"}[system]
        rt = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=loss_fn,
                             microbatches=microbatches, schedule=name, trace=True, prefetch=prefetch)
        # the step's epilogue (tied-gradient sum + loss hand-out) as one extra event, outside the schedule's
        return (lambda x, y: rt.train_step(x, y)), params, (lambda: [tuple(e) for e in rt.last_trace] + [
            ("epilogue", -1, -1, "", rt.last_window[1], rt.last_window[1] + rt.last_epilogue_s)])
    stages = [tp.PipelineStage(stage.chunk(s), s, stage.num_stages, torch.device("cpu"), group=topo.pp_group)
              for s in stage.stage_ids]
    if v == 1:
        sched = tp.Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        sched = tp.ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    events = _time_torch_schedule(sched, stages)

    def step(x, y):
        # return_outputs=False: the runtime's train_step keeps no outputs either (torch's default would keep
        # every micro-batch's logits on the last stage and concatenate them after the schedule)
        events.clear()
        if stage.is_first and stage.is_last:
            sched.step(x, target=y, return_outputs=False)
        elif stage.is_first:
            sched.step(x, return_outputs=False)
        elif stage.is_last:
            sched.step(target=y, losses=[], return_outputs=False)
        else:
            sched.step(return_outputs=False)

    return step, params, lambda: list(events)


def _time_torch_schedule(sched, stages):
    """Record torch's compute like the runtime's trace: one ("F" | "B", stage, micro-batch, "", t0, t1) per
    ``forward_one_chunk`` / ``backward_one_chunk`` call (the chunk's bookkeeping inside those calls included),
    the last stage's loss added to its F (the runtime's F includes the loss). Instance attributes shadow the
    methods, so the schedule's own code runs unchanged. Returns the list the current step appends to."""
    events: list = []

    def timed(fn, kind, stage_id):
        def run(chunk_id, *args, **kwargs):
            t0 = time.perf_counter()
            out = fn(chunk_id, *args, **kwargs)
            events.append((kind, stage_id, chunk_id, "", t0, time.perf_counter()))
            return out
        return run

    for st in stages:
        st.forward_one_chunk = timed(st.forward_one_chunk, "F", st.stage_index)
        st.backward_one_chunk = timed(st.backward_one_chunk, "B", st.stage_index)
    compute_loss = sched._maybe_compute_loss

    def loss(stage, output, target_mbs, mb_index, *args, **kwargs):
        t0 = time.perf_counter()
        compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        dt = time.perf_counter() - t0
        for k in range(len(events) - 1, -1, -1):
            e = events[k]
            if e[:3] == ("F", stage.stage_index, mb_index):
                events[k] = e[:5] + (e[5] + dt,)
                break

    sched._maybe_compute_loss = loss
    return events


def _bench_worker(rank, world_size, cfg_kw, batch, microbatches, steps, rounds, partition, sleep_ms,
                  systems=tuple(SYSTEMS), prefetch=2):
    import torch

    from lightning_scale.models.gpt import GPTConfig, make_batch
    from lightning_scale.topology import Topology

    topo = Topology(pp=world_size, rank=rank).build_groups()
    cfg = GPTConfig(**cfg_kw)
    if sleep_ms:  # synthetic stages pass activations of the GPT's shape
        x = y = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(0))
    else:
        x, y = make_batch(cfg, batch, seed=0)
    # per ls system and step: this rank's trace of it (TraceEvent fields as tuples)
    systems = list(systems)
    out = {s: {"tok_s": [], "rss_mb": 0.0, "timing": []} for s in systems}
    for rnd in range(rounds):
        order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
        for system in order:
            step, params, trace = _build(system, cfg, topo, microbatches, partition, sleep_ms, prefetch)
            opt = torch.optim.AdamW(params, lr=1e-4)
            step(x, y)  # warm-up: shapes exchanged, allocator primed
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.distributed.barrier(topo.pp_group)
            with _RssPeak() as rss:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(x, y)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    out[system]["timing"].append(trace())
                torch.distributed.barrier(topo.pp_group)
                elapsed = time.perf_counter() - t0
            out[system]["tok_s"].append(steps * batch * cfg.seq_len / elapsed)
            out[system]["rss_mb"] = max(out[system]["rss_mb"], rss.peak_mb)
            del step, params, trace, opt
    return out


def _theory(system, pp, m):
    if system == "ls zero_bubble":
        return (pp - 1) / (3 * m + pp - 1)  # ZB-H1 with F = I = W
    return (pp - 1) / (V[system] * m + pp - 1)


SCHEDULE = {"ls 1f1b": "1f1b", "torch 1f1b": "1f1b", "ls interleaved": "interleaved_1f1b",
            "torch interl.": "interleaved_1f1b", "ls zero_bubble": "zero_bubble"}


def _bubbles(system, pp, results, microbatches):
    """Bubbles of one system from its per-step traces (every rank's), as a dict:

    measured: 1 - compute / (pp x makespan) per step (compute events only, both systems), mean over steps;
    sim: the schedule simulated per step with each action's own measured time in that step (so stage
      imbalance and that step's jitter are in it; transfers free), mean over steps;
    sim_mean: the same with the mean time of each (kind, stage) over all steps;
    same_order: every rank ran its computes in the simulated schedule's order (for torch: its schedule
      is the same as ours, so the simulation is of what it ran);
    and for lightning_scale (whose trace has the transfers): sim_lat (sim with every transfer taking the median
    measured hand-off latency), latency, costs {(kind, stage): mean s}, blocked per rank {wait kind: s per step}.
    """
    from lightning_scale.pipeline.runtime_trace import (COMPUTE, TraceEvent, blocked_s, compute_costs,
                                                        handoff_latencies, measured_bubble)
    from lightning_scale.pipeline.schedule import build_schedule
    from lightning_scale.pipeline.validate import validate_schedule

    steps = len(results[0][system]["timing"])
    traces = [[[TraceEvent(*e) for e in r[system]["timing"][k]] for r in results] for k in range(steps)]
    compute = [[[e for e in tr if e.action in COMPUTE] for tr in step] for step in traces]
    sch = build_schedule(SCHEDULE[system], pp, microbatches, V[system])
    order = [[(a.kind, a.stage, a.microbatch) for a in acts if a.kind in COMPUTE] for acts in sch.actions]
    same_order = all([(e.action, e.stage, e.microbatch) for e in sorted(tr, key=lambda e: e.t_start)] == order[r]
                      for step in compute for r, tr in enumerate(step))
    per_action = [{(e.action, e.stage, e.microbatch): e.t_end - e.t_start for tr in step for e in tr}
                  for step in compute]
    costs = {key: statistics.mean(v) for key, v in compute_costs([tr for step in compute for tr in step]).items()}
    out = dict(measured=statistics.mean(measured_bubble(step) for step in compute),
               sim=statistics.mean(validate_schedule(sch, costs=c).bubble_fraction for c in per_action),
               sim_mean=validate_schedule(sch, costs=costs).bubble_fraction, same_order=same_order, costs=costs)
    if system.startswith("ls"):
        lat = [x for step in traces for x in handoff_latencies(step)]
        out["latency"] = latency = statistics.median(lat) if lat else 0.0
        out["sim_lat"] = statistics.mean(validate_schedule(sch, costs=c, latency=latency).bubble_fraction
                                         for c in per_action)
        out["blocked"] = []
        for rank in range(pp):
            per = [blocked_s(step[rank]) for step in traces]
            # other: the rank's schedule window (first to last event) not inside any event: runtime Python
            # between actions
            other = [max(e.t_end for e in step[rank] if e.action != "epilogue")
                     - min(e.t_start for e in step[rank]) - sum(e.t_end - e.t_start for e in step[rank]
                                                               if e.action not in ("epilogue", "send_done"))
                     for step in traces]
            out["blocked"].append(dict({k: statistics.mean(p.get(k, 0.0) for p in per)
                                        for k in ("recv_wait", "send_wait", "send_post", "recv_post", "epilogue")},
                                       other=statistics.mean(other)))
    return out


def _report(pp, results, microbatches, systems=tuple(SYSTEMS)):
    print(f"\n## pp={pp} ({pp} processes), {microbatches} micro-batches")
    print("| system | tokens/s | vs torch | peak RSS MB per stage | bubble measured | bubble sim (each action's "
          "measured time) | measured / sim | sim (mean stage times) | sim + hand-off latency | theory (equal stages) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    stage_lines, blocked_lines, order_notes = [], [], []
    for system in systems:
        tok = statistics.median(results[0][system]["tok_s"])
        peer = PEER.get(system)
        ratio = f"{tok / statistics.median(results[0][peer]['tok_s']):.2f}x" if peer in systems else ""
        rss = " / ".join(f"{r[system]['rss_mb']:.0f}" for r in results)
        theory = f"{_theory(system, pp, microbatches):.3f}"
        b = _bubbles(system, pp, results, microbatches)
        if not b["same_order"]:
            order_notes.append(f"{system}: its compute order differs from our {SCHEDULE[system]!r} schedule's, so "
                               "its sim columns simulate ours with its action times")
        with_lat = ""
        if "blocked" in b:
            blocked_lines.append(f"{system}: " + "; ".join(
                f"rank {r} recv wait {x['recv_wait'] * 1e3:.0f} / send wait {x['send_wait'] * 1e3:.0f} / posts "
                f"{(x['send_post'] + x['recv_post']) * 1e3:.1f} / other {x['other'] * 1e3:.1f} / epilogue "
                f"{x['epilogue'] * 1e3:.1f}" for r, x in enumerate(b["blocked"])))
            with_lat = f"{b['sim_lat']:.3f} ({b['latency'] * 1e3:.1f} ms)"
        per_stage = {}
        for (kind, s), sec in b["costs"].items():
            per_stage.setdefault(s, []).append((kind, sec * 1e3))
        stage_lines.append(f"{system}: " + "; ".join(
            f"stage {s} " + " + ".join(f"{k} {ms:.1f}" for k, ms in sorted(per_stage[s],
                                                                            key=lambda x: "FBIW".index(x[0])))
            + f" = {sum(ms for _, ms in per_stage[s]):.1f}" for s in sorted(per_stage)))
        vs_sim = f"{b['measured'] / b['sim']:.2f}" if b["sim"] else ""
        print(f"| {system} | {tok:,.0f} | {ratio} | {rss} | {b['measured']:.3f} | {b['sim']:.3f} | {vs_sim} | "
              f"{b['sim_mean']:.3f} | {with_lat} | {theory} |")
    print("\ncompute per micro-batch, ms (mean over steps and rounds; torch: forward_one_chunk (+ loss) / "
          "backward_one_chunk):")
    for line in stage_lines:
        print(f"- {line}")
    print("\nblocked per step, ms (from the trace; mean over steps and rounds; other = the rank's schedule window "
          "outside every event: runtime Python between actions; epilogue = after the schedule: tied-gradient sum + "
          "loss hand-out):")
    for line in blocked_lines:
        print(f"- {line}")
    for line in order_notes:
        print(f"- note: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partition", default="compute",
                        help="pipeline split method for both systems (compute, parameters, uniform, type:Block)")
    parser.add_argument("--sleep-ms", type=float, default=0.0,
                        help="synthetic run: instead of the GPT, equal stages that sleep this many ms per micro-batch "
                             "forward (2x backward), leaving the cores free: measures schedule + transfers + runtime "
                             "overhead, at any pp, on any machine")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 round, 1 step")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS, metavar="SYSTEM",
                        help=f"a subset of {SYSTEMS} (quote names with spaces)")
    parser.add_argument("--prefetch", type=int, default=2, help="lightning_scale runtime: receives posted ahead")
    parser.add_argument("--dump", default="", help="also pickle every rank's results (traces) to DUMP.pp<N>.pkl")
    args = parser.parse_args()
    if args.smoke:
        args.d_model, args.vocab, args.seq, args.batch, args.microbatches = 64, 512, 32, 8, 4
        args.steps, args.rounds = 1, 1
    from lightning_scale.models.gpt import GPT, GPTConfig
    from lightning_scale.pipeline import gpt_pipeline_layers
    from lightning_scale.pipeline.partition import partition_layers
    from lightning_scale.testing import run_distributed

    cfg_kw = dict(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                  d_model=args.d_model)
    print(f"GPT {cfg_kw}, batch {args.batch} x seq {args.seq}, {args.steps} steps x {args.rounds} rounds, "
          f"split {args.partition}; torch {__import__('torch').__version__}")
    if args.sleep_ms:
        print(f"SYNTHETIC: no GPT; pp * v equal stages sleeping {args.sleep_ms} ms / v per micro-batch forward, "
              f"2x that backward (F = I = W); activations of shape ({args.batch // args.microbatches}, {args.seq}, "
              f"{args.d_model}) fp32")
    else:
        layers = list(gpt_pipeline_layers(GPT(GPTConfig(**cfg_kw))))
        names = ["emb" if k == 0 else "head" if k == len(layers) - 1 else "b" for k in range(len(layers))]
        for pp in args.pp:
            for v in sorted(set(V.values())):
                bounds = partition_layers(layers, pp * v, args.partition)
                print(f"pp={pp} v={v} stages: " + " | ".join(
                    "+".join(names[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)))
    for pp in args.pp:
        results = run_distributed(_bench_worker, pp, (cfg_kw, args.batch, args.microbatches, args.steps, args.rounds,
                                                      args.partition, args.sleep_ms, tuple(args.systems),
                                                      args.prefetch), timeout=3600)
        if args.dump:
            import pickle

            with open(f"{args.dump}.pp{pp}.pkl", "wb") as f:
                pickle.dump(results, f)
        _report(pp, results, args.microbatches, tuple(args.systems))


if __name__ == "__main__":
    main()
