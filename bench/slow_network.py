"""Slow network: data parallelism (dp=4) vs pipeline x data (pp=2 x dp=2), same GPT, same capped link.

4 ranks run as 2 hosts x 2 ranks (lightning_scale.testing_netns: one Linux network namespace per
host, the link between hosts capped with tc tbf; the two ranks of a host talk over its loopback).
Topology puts pp outermost, so with pp=2 x dp=2 each host holds one pipeline stage: only stage
boundary activations (forward) and their gradients (backward) cross the link, and each stage's
ZeRO-1 reduce-scatter / all-gather stays inside its host. With dp=4 every step's gradients and
parameters cross the link. Systems (interleaved rounds, order rotated, in one process group per rate):

  dp4 allreduce    ZeroOptimizer stage 0 over all 4 ranks: DDP-style bucketed all-reduce, overlapped
                   with backward (the baseline: the faster dp system over a slow link)
  dp4 zero1        ZeroOptimizer stage 1 over all 4 ranks (reduce-scatter + all-gather), overlapped
  pp2xdp2 zero1    ZeroPipeline: 1F1B over 2 stages, ZeRO-1 per stage over its dp pair (in-host)

Reported per rate: tokens/s (global tokens of a step / step time, median over rounds), speedup vs
dp4 allreduce (median of per-round ratios, min-max), step time, and MB each rank sends per step
(lightning_scale.comm.accounting: collectives + pipeline p2p). Never asserts on time. The seed
claim to compare with: pipeline parallelism is 2-7x faster where bandwidth is limited.

Needs root / CAP_NET_ADMIN and iproute2 (Debian: apt-get install -y iproute2); says why and exits otherwise.

Full run (quiet machine):  python bench/slow_network.py
Smoke run:                 python bench/slow_network.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASELINE = "dp4 allreduce"
ALL_SYSTEMS = ["dp4 allreduce", "dp4 zero1", "pp2xdp2 zero1"]


def _optimizer(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def _build(system, rank, cfg, microbatches):
    """Returns step(x, y) for this rank; x, y are the global batch (each system takes its share)."""
    import torch

    from lightning_scale.models.gpt import GPT, lm_loss
    from lightning_scale.pipeline import PipelineRuntime, ZeroPipeline, build_stage, gpt_pipeline_layers
    from lightning_scale.topology import Topology
    from lightning_scale.zero import ZeroOptimizer

    torch.manual_seed(0)
    gpt = GPT(cfg)
    if system.startswith("dp4"):
        topo = Topology(dp=4, rank=rank).build_groups()
        engine = ZeroOptimizer(_optimizer(gpt.parameters()), stage=0 if "allreduce" in system else 1,
                               group=topo.dp_group, overlap_comm=True)

        def step(x, y):
            share = x.shape[0] // topo.dp
            lo = topo.dp_rank * share
            lm_loss(gpt(x[lo:lo + share]), y[lo:lo + share]).backward()
            engine.step()
            engine.zero_grad()

        return step
    topo = Topology(dp=2, pp=2, rank=rank).build_groups()
    stage = build_stage(gpt_pipeline_layers(gpt), pp=topo.pp, pp_rank=topo.pp_rank, partition="parameters")
    runtime = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=lm_loss,
                              microbatches=microbatches, schedule="1f1b")
    engine = ZeroOptimizer(_optimizer(stage.parameters()), stage=1, group=topo.dp_group, overlap_comm=False)
    zp = ZeroPipeline(runtime, [engine])

    def step(x, y):
        share = x.shape[0] // topo.dp
        lo = topo.dp_rank * share
        zp.train_step(x[lo:lo + share], y[lo:lo + share])
        zp.step()
        zp.zero_grad()

    return step


def _bench_worker(rank, world_size, cfg_kw, systems, batch, microbatches, steps, warmup, rounds):
    import torch
    import torch.distributed as dist

    from lightning_scale.comm.accounting import CommCounter
    from lightning_scale.models.gpt import GPTConfig, make_batch

    cfg = GPTConfig(**cfg_kw)
    steppers = {s: _build(s, rank, cfg, microbatches) for s in systems}
    x, y = make_batch(cfg, batch, seed=0)
    out = []
    for r in range(rounds):
        row = {}
        for k in range(len(systems)):
            system = systems[(r + k) % len(systems)]  # rotate the order: drift hits every system alike
            for _ in range(warmup if r == 0 else 0):
                steppers[system](x, y)
            dist.barrier()
            with CommCounter() as counter:
                t0 = time.perf_counter()
                for _ in range(steps):
                    steppers[system](x, y)
                dist.barrier()
                seconds = (time.perf_counter() - t0) / steps
            sent = torch.tensor([counter.total / steps / 2**20])
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            row[system] = {"tokens_per_s": batch * cfg.seq_len / seconds, "step_s": seconds,
                           "sent_mb": float(sent)}
        out.append(row)
    return out


def _report(rate, rounds, systems):
    print(f"\n## link {rate} between 2 hosts x 2 ranks ({len(rounds)} rounds)")
    print(f"| system | tokens/s | speedup vs {BASELINE} | step s | MB sent per rank per step (max) |")
    print("|---|---|---|---|---|")
    for s in systems:
        tok = statistics.median(r[s]["tokens_per_s"] for r in rounds)
        ratios = [r[s]["tokens_per_s"] / r[BASELINE]["tokens_per_s"] for r in rounds] if BASELINE in systems else []
        ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        step_s = statistics.median(r[s]["step_s"] for r in rounds)
        sent = statistics.median(r[s]["sent_mb"] for r in rounds)
        print(f"| {s} | {tok:,.0f} | {ratio} | {step_s:.2f} | {sent:,.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"], help="tc rates, e.g. 1gbit 100mbit")
    parser.add_argument("--systems", nargs="+", default=ALL_SYSTEMS, choices=ALL_SYSTEMS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over dp")
    parser.add_argument("--microbatches", type=int, default=4, help="per pipeline replica")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per system per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per system before the first round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--smoke", action="store_true", help="tiny model, one rate, 1 round, 1 step")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.d_model, args.heads, args.vocab, args.seq = 4, 128, 4, 1024, 64
        args.rates, args.steps, args.rounds = args.rates[-1:], 1, 1

    from lightning_scale import testing_netns as N
    from lightning_scale.models.gpt import GPTConfig

    reason = N.unavailable_reason()
    if reason is not None:
        print(f"slow-network benchmark skipped: {reason}")
        return
    cfg_kw = dict(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, vocab_size=args.vocab,
                  seq_len=args.seq)
    params = GPTConfig(**cfg_kw).num_params()
    print(f"GPT {cfg_kw}: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:,.0f} MB of fp32 gradients); "
          f"global batch {args.batch} x {args.seq} tokens, {args.microbatches} micro-batches per pipeline replica; "
          f"{args.steps} timed steps x {args.rounds} rounds per rate")
    for rate in args.rates:
        with N.SlowNetwork(hosts=2, rate=rate) as net:
            rounds = N.run_on_hosts(_bench_worker, net, ranks_per_host=2, timeout=args.timeout,
                                    args=(cfg_kw, args.systems, args.batch, args.microbatches, args.steps,
                                          args.warmup, args.rounds))[0]
        _report(rate, rounds, args.systems)


if __name__ == "__main__":
    main()
