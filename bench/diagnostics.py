"""Cost of the diagnostics (issue 15) on bench/zero.py's GPT, and the time from a fault to every rank gone.

    python bench/diagnostics.py                       # 3 interleaved rounds, 2 CPU ranks
    python bench/diagnostics.py --rounds 5 --steps 20 --systems ls_z2,ls_z3

Overhead rows (tokens/s ratio to the same system with the diagnostics off, per round, median):
    watchdog   the watchdog thread (heartbeat every 2 s through the c10d store) + the per-step stop check
               (one store check) that the Lightning callback makes
    debug      LIGHTNING_SCALE_DEBUG_COLLECTIVES=1: every collective fingerprinted through the store
    noguard    (ls_z3 only) the ZeRO-3 freed-parameter guard disabled: its cost is the ratio off / noguard
Then the watchdog's cost per call (should_stop + step_done per step, one heartbeat tick), timed call by call, as a
share of the median 'off' step: the bound that the tokens/s rows cannot resolve on a shared box.
Each (round, system, mode) runs in fresh processes, in rotated order. The store here is run_distributed's
FileStore (Lightning / torchrun use a TCPStore). Fault rows: one rank hangs (hang_timeout 3 s), raises,
is SIGKILLed, or gets SIGTERM; the time is from the fault (written by the faulting rank) to all ranks exited.
Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero import _build  # noqa: E402

from lightning_scale.diagnostics import DiagnosticsConfig, start_watchdog, trace  # noqa: E402
from lightning_scale.models.gpt import GPT, gpt_small, lm_loss, make_batch  # noqa: E402
from lightning_scale.testing import DistributedTestError, run_distributed  # noqa: E402

MODES = ["off", "watchdog", "debug"]


def speed_worker(rank: int, world: int, system: str, mode: str, steps: int, warmup: int, global_batch: int):
    if mode == "noguard":
        from lightning_scale.zero import param_guard

        param_guard.freeze = param_guard.thaw = lambda params: None
    wd = start_watchdog(DiagnosticsConfig(debug_collectives=mode == "debug")) if mode in ("watchdog", "debug") else None
    torch.manual_seed(0)
    cfg = gpt_small()
    model = GPT(cfg)
    local = global_batch // world
    module, step, zero_grad = _build(system, model, local)
    tokens, t0 = 0, None
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = make_batch(cfg, global_batch, seed=i)
        loss = lm_loss(module(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local])
        loss.backward()
        step()
        zero_grad()
        if wd is not None:  # what DiagnosticsCallback does per batch
            trace.step_done(i + 1)
            wd.should_stop(i + 1)
        if i >= warmup:
            tokens += global_batch * cfg.seq_len
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if wd is not None:
        wd.close()
    return {"tokens_per_s": tokens / elapsed, "loss": float(loss.detach())}


def cost_worker(rank: int, world: int, calls: int):
    """What the watchdog adds per step on the training thread, timed call by call (a bound that the tokens/s noise
    of a shared box cannot hide): ``should_stop`` (one store check) and ``step_done``; and one heartbeat tick (the
    side thread's work every ``heartbeat_interval``: a JSON heartbeat set + an abort / stop-request check)."""
    wd = start_watchdog(DiagnosticsConfig())
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(calls):
        trace.step_done(i + 1)
        wd.should_stop(i + 1)
    per_step = (time.perf_counter() - t0) / calls
    t0 = time.perf_counter()
    for _ in range(calls // 10):
        wd._tick()
    per_tick = (time.perf_counter() - t0) / (calls // 10)
    dist.barrier()
    wd.close()
    return {"per_step_s": per_step, "per_tick_s": per_tick, "interval_s": wd.config.heartbeat_interval}


def fault_worker(rank: int, world: int, kind: str, mark: str):
    import signal

    from lightning_scale.comm import collectives as C

    wd = start_watchdog(DiagnosticsConfig(hang_timeout=3.0, first_step_grace=0.0, heartbeat_interval=0.5))
    wd.install_signal_handlers()
    buf = torch.ones(1 << 16)
    with wd.guard():
        for i in range(200):
            if rank == 1 and i == 5:
                with open(mark, "w") as f:
                    f.write(repr(time.time()))
                if kind == "hang":
                    time.sleep(300)
                elif kind == "raise":
                    raise RuntimeError("injected")
                elif kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif kind == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
            C.all_reduce(buf, tag="grad")
            time.sleep(0.02)
            trace.step_done(i + 1)
            if wd.should_stop(i + 1):
                return i + 1
    return -1


def fault_times(kinds):
    rows = []
    for kind in kinds:
        mark = os.path.join(tempfile.mkdtemp(prefix="ls_fault_"), "t")
        try:
            out = run_distributed(fault_worker, 2, args=(kind, mark), timeout=60)
            how = f"clean stop at step {out[0]} on both ranks"
        except DistributedTestError as err:
            how = str(err).splitlines()[0][:90]
        end = time.time()
        rows.append((kind, end - float(open(mark).read()), how))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--systems", default="ls_z2,ls_z3")
    ap.add_argument("--faults", default="hang,raise,sigkill,sigterm")
    ap.add_argument("--calls", type=int, default=2000, help="calls timed for the per-call watchdog cost row")
    args = ap.parse_args()
    systems = args.systems.split(",")
    runs = [(s, m) for s in systems for m in MODES + (["noguard"] if s == "ls_z3" else [])]
    results = {r: [] for r in runs}
    for rnd in range(args.rounds):
        order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
        for system, mode in order:
            out = run_distributed(speed_worker, 2, args=(system, mode, args.steps, args.warmup, args.global_batch),
                                  timeout=900)
            results[(system, mode)].append(out[0]["tokens_per_s"])
            print(f"round {rnd} {system:6s} {mode:8s} {out[0]['tokens_per_s']:8.0f} tokens/s", flush=True)
    print("\n| system | mode | tokens/s (median) | ratio to off (median of per-round ratios) |")
    print("|---|---|---|---|")
    for system, mode in runs:
        ratios = [a / b for a, b in zip(results[(system, mode)], results[(system, "off")])]
        print(f"| {system} | {mode} | {statistics.median(results[(system, mode)]):.0f} | "
              f"{statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)}) |")
    cost = run_distributed(cost_worker, 2, args=(args.calls,), timeout=300)[0]
    off = statistics.median(v for s in systems for v in results[(s, "off")])
    step_s = args.global_batch * gpt_small().seq_len / off  # tokens per step / tokens per second
    share = (cost["per_step_s"] + cost["per_tick_s"] * step_s / cost["interval_s"]) / step_s
    print(f"\nwatchdog cost per call (rank 0, {args.calls} calls): should_stop + step_done "
          f"{cost['per_step_s'] * 1e6:.0f} us/step, heartbeat tick {cost['per_tick_s'] * 1e6:.0f} us every "
          f"{cost['interval_s']:g} s; against the median 'off' step ({step_s * 1e3:.0f} ms): {share:.4%} of a step")
    if args.faults:
        print("\n| fault (rank 1 at step 5) | fault -> all ranks exited (s) | outcome |")
        print("|---|---|---|")
        for kind, secs, how in fault_times(args.faults.split(",")):
            print(f"| {kind} | {secs:.1f} | {how} |")


if __name__ == "__main__":
    main()
