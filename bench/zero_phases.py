"""Where a ZeRO 0-2 step spends its time vs DDP, by phase, on both ranks (bench/zero.py's GPT, AdamW, gloo).

    python bench/zero_phases.py --systems ddp,ls_z1,ls_z2 --blocks 4 --block 4

Phases (milliseconds per step, median over steps, each rank):
    fwd         forward + loss; at stages 1-2 includes the waits for the background parameter gathers
    gwait       of fwd: time spent inside those waits (ParamGathers wait_begin -> wait_end)
    bwd         loss.backward(), gradient hooks and the reductions launched from them included
    reduce      (ls) step: finishing the gradient reduction (wait for the reduce-scatters / all-reduces)
    opt         (ls) step: the inner optimizer over the shard; (ddp) the whole optimizer.step()
    gather      (ls) step: write back + launch the all-gathers (and wait when not overlapped)
    zero        zero_grad()
    total       wall time of the step
    cpu         CPU time of the step, all the process's threads (gloo's included): the work, less sensitive to load
Not a test: nothing asserts on time. Say the load average next to any figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero import _build  # noqa: E402

from lightning_scale.models.gpt import GPT, gpt_small, lm_loss, make_batch  # noqa: E402
from lightning_scale.testing import run_distributed  # noqa: E402

PHASES = ["fwd", "gwait", "bwd", "reduce", "opt", "gather", "zero", "total", "cpu"]


def _timed(fn, acc, key):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
    return wrapper


def _native_uses_pairwise(group=None) -> bool:
    return False


from lightning_scale.comm.pairwise import uses_pairwise as _USES_PAIRWISE  # noqa: E402


class _System:
    def __init__(self, name: str, rank: int, local: int) -> None:
        torch.manual_seed(0)
        self.name, self.cfg = name, gpt_small()
        self.native = name.endswith("-native")  # gloo's own reduce-scatter / all-gather, not comm.pairwise
        name = name[:-len("-native")] if self.native else name
        self.module, self.step, self.zero_grad = _build(name, GPT(self.cfg), local)
        self.acc: dict = {}
        self.rows: list = []
        self.ls = name.startswith("ls_z")
        if self.ls:
            engine = self.step.__self__
            engine.reducer.reduce = _timed(engine.reducer.reduce, self.acc, "reduce")
            engine.inner.step = _timed(engine.inner.step, self.acc, "opt")
            engine._gather_after_step = _timed(engine._gather_after_step, self.acc, "gather")
            waits = {}

            def on_event(kind, bucket):
                if kind == "wait_begin":
                    waits[bucket] = time.perf_counter()
                elif kind == "wait_end":
                    self.acc["gwait"] = self.acc.get("gwait", 0.0) + time.perf_counter() - waits.pop(bucket)
            engine.gathers.on_event = on_event

    def run(self, x, y, keep: bool) -> None:
        from lightning_scale.comm import pairwise

        pairwise.uses_pairwise = _native_uses_pairwise if self.native else _USES_PAIRWISE
        acc = self.acc
        acc.clear()
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = lm_loss(self.module(x), y)
        t1 = time.perf_counter()
        fwd_wait = acc.get("gwait", 0.0)
        loss.backward()
        t2 = time.perf_counter()
        self.step()
        t3 = time.perf_counter()
        self.zero_grad()
        t4 = time.perf_counter()
        cpu = time.process_time() - c0
        if not keep:
            return
        row = {"fwd": t1 - t0, "gwait": fwd_wait, "bwd": t2 - t1, "zero": t4 - t3, "total": t4 - t0, "cpu": cpu}
        if self.ls:
            row.update(reduce=acc.get("reduce", 0.0), opt=acc.get("opt", 0.0), gather=acc.get("gather", 0.0))
        else:
            row["opt"] = t3 - t2
        self.rows.append(row)


def worker(rank: int, world: int, systems, blocks: int, block: int, global_batch: int):
    """Every system in the same two processes, in blocks of ``block`` steps taken in turn (the first step of each
    block is not counted: the previous system's background work may still run), so load drift hits all alike."""
    import warnings

    warnings.filterwarnings("ignore", message=".*\\.grad attribute of a Tensor that is not a leaf.*")
    local = global_batch // world
    built = [_System(name, rank, local) for name in systems]
    cfg = built[0].cfg
    i = 0
    for b in range(blocks + 1):  # block 0: warm-up
        for sys_ in built[b % len(built):] + built[:b % len(built)]:  # rotated: no system always follows another
            for k in range(block):
                x, y = make_batch(cfg, global_batch, seed=i)
                i += 1
                x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
                sys_.run(x, y, keep=b > 0 and k > 0)
    dist.barrier()
    out = {}
    for sys_ in built:
        out[sys_.name] = {k: statistics.median(r.get(k, 0.0) for r in sys_.rows) * 1e3 for k in PHASES}
        out[sys_.name]["mean_total"] = statistics.mean(r["total"] for r in sys_.rows) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="ddp,ls_z0,ls_z1,ls_z2")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block", type=int, default=4, help="steps per block (the first is not counted)")
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()
    systems = args.systems.split(",")
    print(f"load before: {os.getloadavg()}", flush=True)
    out = run_distributed(worker, 2, (systems, args.blocks, args.block, args.global_batch), timeout=900)
    print(f"load after: {os.getloadavg()}\n")
    print("| system | rank | " + " | ".join(PHASES) + " | vs ddp (mean step) |")
    print("|---|---|" + "---|" * (len(PHASES) + 1))
    for name in systems:
        for rank, o in enumerate(out):
            ratio = o["ddp"]["mean_total"] / o[name]["mean_total"] if "ddp" in o else float("nan")
            print(f"| {name} | {rank} | " + " | ".join(f"{o[name][k]:.1f}" for k in PHASES) + f" | {ratio:.3f} |")


if __name__ == "__main__":
    main()
