"""Pipeline parallelism on CPU: lightning_scale schedules vs torch.distributed.pipelining, same split.

For pp = 2 and pp = 4 (one process per stage, gloo), a GPT (gpt_small widths, 8 blocks) is split
with ``partition="type:Block"`` (embedding with the first block, head with the last) into
``pp * v`` stages; both systems get the very same stage modules. Systems run in interleaved
rounds inside one process group (order rotated every round) so machine noise hits them alike:

  ls 1f1b          lightning_scale PipelineRuntime, schedule "1f1b"
  torch 1f1b       torch.distributed.pipelining Schedule1F1B
  ls interleaved   lightning_scale "interleaved_1f1b", v = 2
  torch interl.    torch.distributed.pipelining ScheduleInterleaved1F1B, v = 2
  ls zero_bubble   lightning_scale ZB-H1 (no torch counterpart row)

Reported per system: tokens/s (median over rounds; global tokens of one step / step time), the
ratio to the torch counterpart, peak RSS per stage while that system ran (MB, sampled every
10 ms), and for lightning_scale the measured bubble, 1 - (compute time / step time) averaged
over ranks, next to the schedule's theoretical bubble. Never asserts on time.

Full run (quiet machine):  python bench/pipeline.py
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


def _build(system, cfg, topo, microbatches):
    """A fresh model split into this rank's stage(s); returns (step_fn, params, runtime or None)."""
    import torch
    from torch.distributed import pipelining as tp

    from lightning_scale.models.gpt import GPT, lm_loss
    from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers

    torch.manual_seed(0)
    gpt = GPT(cfg)
    v = V[system]
    stage = build_stage(gpt_pipeline_layers(gpt), pp=topo.pp, pp_rank=topo.pp_rank, virtual_stages=v,
                        partition="type:Block")
    params = list(stage.parameters())
    if system.startswith("ls"):
        name = {"ls 1f1b": "1f1b", "ls interleaved": "interleaved_1f1b", "ls zero_bubble": "zero_bubble"}[system]
        rt = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=lm_loss,
                             microbatches=microbatches, schedule=name)
        return (lambda x, y: rt.train_step(x, y)), params, rt
    stages = [tp.PipelineStage(stage.chunk(s), s, stage.num_stages, torch.device("cpu"), group=topo.pp_group)
              for s in stage.stage_ids]
    if v == 1:
        sched = tp.Schedule1F1B(stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    else:
        sched = tp.ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=lm_loss)

    def step(x, y):
        if stage.is_first and stage.is_last:
            sched.step(x, target=y)
        elif stage.is_first:
            sched.step(x)
        elif stage.is_last:
            sched.step(target=y, losses=[])
        else:
            sched.step()

    return step, params, None


def _bench_worker(rank, world_size, cfg_kw, batch, microbatches, steps, rounds):
    import torch

    from lightning_scale.models.gpt import GPTConfig, make_batch
    from lightning_scale.topology import Topology

    topo = Topology(pp=world_size, rank=rank).build_groups()
    cfg = GPTConfig(**cfg_kw)
    x, y = make_batch(cfg, batch, seed=0)
    out = {s: {"tok_s": [], "rss_mb": 0.0, "bubble": []} for s in SYSTEMS}
    for rnd in range(rounds):
        order = SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)]
        for system in order:
            step, params, rt = _build(system, cfg, topo, microbatches)
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
                    if rt is not None:
                        out[system]["bubble"].append(1.0 - rt.last_compute_s / rt.last_step_s)
                torch.distributed.barrier(topo.pp_group)
                elapsed = time.perf_counter() - t0
            out[system]["tok_s"].append(steps * batch * cfg.seq_len / elapsed)
            out[system]["rss_mb"] = max(out[system]["rss_mb"], rss.peak_mb)
            del step, params, rt, opt
    return out


def _theory(system, pp, m):
    if system == "ls zero_bubble":
        return (pp - 1) / (3 * m + pp - 1)  # ZB-H1 with F = I = W
    return (pp - 1) / (V[system] * m + pp - 1)


def _report(pp, results, microbatches):
    print(f"\n## pp={pp} ({pp} processes), {microbatches} micro-batches")
    print("| system | tokens/s | vs torch | peak RSS MB per stage | bubble measured | bubble theory |")
    print("|---|---|---|---|---|---|")
    for system in SYSTEMS:
        tok = statistics.median(results[0][system]["tok_s"])
        peer = PEER.get(system)
        ratio = f"{tok / statistics.median(results[0][peer]['tok_s']):.2f}x" if peer else ""
        rss = " / ".join(f"{r[system]['rss_mb']:.0f}" for r in results)
        if system.startswith("ls"):
            measured = statistics.mean(b for r in results for b in r[system]["bubble"])
            bubble = f"{measured:.3f}"
            theory = f"{_theory(system, pp, microbatches):.3f}"
        else:
            bubble, theory = "n/a", f"{_theory(system, pp, microbatches):.3f}"
        print(f"| {system} | {tok:,.0f} | {ratio} | {rss} | {bubble} | {theory} |")


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
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 round, 1 step")
    args = parser.parse_args()
    if args.smoke:
        args.d_model, args.vocab, args.seq, args.batch, args.microbatches = 64, 512, 32, 8, 4
        args.steps, args.rounds = 1, 1
    from lightning_scale.testing import run_distributed

    cfg_kw = dict(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                  d_model=args.d_model)
    print(f"GPT {cfg_kw}, batch {args.batch} x seq {args.seq}, {args.steps} steps x {args.rounds} rounds, "
          f"split type:Block; torch {__import__('torch').__version__}")
    for pp in args.pp:
        results = run_distributed(_bench_worker, pp, (cfg_kw, args.batch, args.microbatches, args.steps, args.rounds),
                                  timeout=3600)
        _report(pp, results, args.microbatches)


if __name__ == "__main__":
    main()
