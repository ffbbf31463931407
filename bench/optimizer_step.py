"""The offload optimizer step on the CPU: torch Adam/AdamW (for-loop, foreach, fused), DeepSpeedCPUAdam, and
lightning_scale's ``make_offload_optimizer``, against the machine's memory bandwidth.

    python bench/optimizer_step.py --numel 50e6 --rounds 3 --steps 5

The parameters are fp32 flat shards (``--chunks`` tensors, like the engine's CPU master shards). Adam is
memory-bound: per element it reads param, grad, m, v and writes param, m, v = 7 x 4 = 28 bytes, so
"GB/s" = 28 * numel / step time (the algorithmic minimum traffic; implementations that make several
passes move more). The physical limit is measured by the same script: a triad ``a = b + s * c``
(read 2, write 1 = 12 bytes/element) and a copy (8 bytes/element) with torch on the same threads.
Rounds alternate the systems (order rotated each round, reversed every other round); every figure is a
median over rounds and each ratio is taken inside one round. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ADAM_BYTES_PER_ELEMENT = 28  # fp32: read p, g, m, v (16) + write p, m, v (12)
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def make_shards(numel: int, chunks: int, seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [numel // chunks + (1 if i < numel % chunks else 0) for i in range(chunks)]
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=g) * 0.02)
        p.grad = torch.randn(n, generator=g) * 1e-3
        params.append(p)
    return params


def torch_adam(cls, **impl) -> Callable[[List[torch.Tensor]], torch.optim.Optimizer]:
    return lambda params: cls(params, **HYPER, **impl)


def deepspeed_cpu_adam(adamw: bool) -> Optional[Callable]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.zeros(8)
        DeepSpeedCPUAdam([probe], **HYPER, adamw_mode=adamw).step()  # triggers (or loads) the C++ JIT build
    except Exception as err:  # noqa: BLE001 - any failure means "no DeepSpeed row", reported
        print(f"DeepSpeedCPUAdam unavailable: {type(err).__name__}: {err}".splitlines()[0], flush=True)
        return None
    import deepspeed

    print(f"DeepSpeedCPUAdam from deepspeed {deepspeed.__version__}", flush=True)
    return lambda params: DeepSpeedCPUAdam(params, **HYPER, adamw_mode=adamw)


def lightning_scale_offload(cls) -> Callable:
    from lightning_scale.optim.cpu_adam import make_offload_optimizer

    def build(params):
        user = cls([torch.nn.Parameter(torch.zeros(1))], **HYPER)  # what a user's configure_optimizers returns
        return make_offload_optimizer(cls, [dict(user.param_groups[0], params=params)], user.defaults)

    return build


def time_steps(build: Callable, params: List[torch.Tensor], steps: int) -> float:
    """Median seconds per step after one untimed step (which allocates the state)."""
    opt = build(params)
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt
    gc.collect()
    return statistics.median(times)


def bandwidth(numel: int, repeats: int = 5) -> Dict[str, float]:
    """Best-of GB/s of a triad (12 B/element) and a copy (8 B/element) on fp32 tensors of ``numel``."""
    b, c, a = torch.rand(numel), torch.rand(numel), torch.empty(numel)
    best_triad = best_copy = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        t1 = time.perf_counter()
        a.copy_(b)
        t2 = time.perf_counter()
        best_triad = max(best_triad, 12 * numel / (t1 - t0) / 1e9)
        best_copy = max(best_copy, 8 * numel / (t2 - t1) / 1e9)
    del a, b, c
    return {"triad": best_triad, "copy": best_copy}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=50e6)
    ap.add_argument("--chunks", type=int, default=8, help="flat shard tensors the elements are split into")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args(argv)
    numel = int(args.numel)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # DeepSpeedCPUAdam's OpenMP loop

    systems: Dict[str, Callable] = {
        "torch Adam for-loop": torch_adam(torch.optim.Adam, foreach=False, fused=False),
        "torch Adam foreach": torch_adam(torch.optim.Adam, foreach=True),
        "torch Adam fused": torch_adam(torch.optim.Adam, fused=True),
        "torch AdamW for-loop": torch_adam(torch.optim.AdamW, foreach=False, fused=False),
        "torch AdamW foreach": torch_adam(torch.optim.AdamW, foreach=True),
        "torch AdamW fused": torch_adam(torch.optim.AdamW, fused=True),
    }
    if not args.no_deepspeed:
        for name, adamw in (("DeepSpeedCPUAdam (Adam)", False), ("DeepSpeedCPUAdam (AdamW)", True)):
            build = deepspeed_cpu_adam(adamw)
            if build is not None:
                systems[name] = build
    systems["lightning_scale offload AdamW"] = lightning_scale_offload(torch.optim.AdamW)
    baseline = "torch AdamW foreach"

    print(f"numel={numel:,} fp32 in {args.chunks} shards, torch {torch.__version__}, {threads} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    params = make_shards(numel, args.chunks)
    names = list(systems)
    rounds: List[Dict[str, float]] = []
    bw_rounds: List[Dict[str, float]] = []
    for r in range(args.rounds):
        # Rotate, and reverse every other round, so no system always follows the same neighbour (an OpenMP
        # pool still spinning after DeepSpeedCPUAdam, a cache warmed by the previous system...).
        order = names[r % len(names):] + names[:r % len(names)]
        order = order[::-1] if r % 2 else order
        times: Dict[str, float] = {}
        bw_rounds.append(bandwidth(numel))
        for name in order:
            times[name] = time_steps(systems[name], params, args.steps)
            print(f"  round {r}: {name:32s} {times[name] * 1e3:8.1f} ms/step", flush=True)
        rounds.append(times)

    triad = statistics.median(b["triad"] for b in bw_rounds)
    copy = statistics.median(b["copy"] for b in bw_rounds)
    print(f"\nmeasured memory bandwidth (median over rounds of best-of-5): triad {triad:.1f} GB/s, "
          f"copy {copy:.1f} GB/s")
    print(f"\n| system | ms/step (median) | speed vs {baseline} (median, range) | GB/s (28 B/elem) | % of triad |")
    print("|---|---|---|---|---|")
    for name in names:
        ms = statistics.median(r[name] for r in rounds) * 1e3
        ratios = [r[baseline] / r[name] for r in rounds]
        gbs = ADAM_BYTES_PER_ELEMENT * numel / (ms / 1e3) / 1e9
        print(f"| {name} | {ms:,.1f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{gbs:.1f} | {100 * gbs / triad:.0f}% |")
    fastest_peer = min((n for n in names if not n.startswith("lightning_scale")),
                       key=lambda n: statistics.median(r[n] for r in rounds))
    ours = [r[fastest_peer] / r["lightning_scale offload AdamW"] for r in rounds]
    print(f"\nlightning_scale offload AdamW vs the fastest peer ({fastest_peer}): "
          f"{statistics.median(ours):.2f}x (per-round {', '.join(f'{x:.2f}' for x in ours)})")


if __name__ == "__main__":
    main()
