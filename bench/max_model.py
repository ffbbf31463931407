"""Largest GPT that trains one step under a fixed device-memory budget: DDP vs ZeRO stages 1/2/3 and offload.

    python bench/max_model.py                               # budget 512 MiB, dp 1 and 2, all systems
    python bench/max_model.py --budget-mib 512 --dps 1,2 --systems ddp,z3_offload
    python bench/max_model.py --estimate-only               # only the estimator table (no runs)

Issue 3's ZeRO-Offload headline: with the same device memory, stage 3 + offload trains >= 10x the parameters
plain data parallelism (DDP = stage 0) can, and ZeRO scales that ~N x with N data-parallel ranks.

Method (this machine has no accelerator, so the budget is enforced by the engine's memory accounting):

* A fixed ladder of GPT configs grows layers x width together (vocab 8192, seq 128, head dim 64, fp32,
  AdamW). For each (system, dp) the estimator (``lightning_scale.estimate``, 32-true, AdamW) picks the first
  rung to try; then the real engine is built on that rung, trains ONE step on ``dp`` gloo ranks (dp=1 is a
  process group of one), and reports what it accounts to the device. The search moves up while the real
  step fits and down while it does not, so the answer is the largest rung whose *measured* accounting fits.
* Device bytes of a step =
    engine ``memory_bytes()['device']`` (the larger of: right after backward, right after the step;
      ``ZeroOptimizer`` at stages 0-2, ``Stage3Optimizer`` at stage 3: params/grads/master/state that
      are not on the host; offloaded master + optimizer state, and param shards under param offload,
      count as host),
  + stage 3: ``ShardedParameters.memory_bytes()['peak_gathered']`` (measured peak of gathered units) and the
      gradients in flight: one unit's full gradients + the *measured* bytes held by reduce-scatters launched
      but not yet waited for (the engine keeps at most one in flight at stage 3); the design / estimator figure is three
      units' gradients. The search runs twice over the same (cached) real runs: on the measured figure, then
      on the design figure,
  + activations saved for backward, *measured* in the step with ``torch.autograd.graph.saved_tensors_hooks``
      (distinct storages that are not parameters; batch 1 x 128 tokens per rank, no activation checkpointing).
  Under optimizer offload (stages 2 and 3) the engine streams each reduced gradient shard to the host and
  counts it as host bytes.
* Stage 3 units: ``wte``, ``wpe``, each block, ``ln_f``, ``lm_head`` (one unit each), prefetch depth 1.
* Host-RAM cap: the machine has 24 GiB shared with other jobs, so a rung is only *run* when its estimated
  model states (device + host, all ranks) plus ~0.5 GiB per process stay under ``--host-cap-gib`` (6 GiB).
  Where a system would still fit the budget above the cap, its row says "capped" and its ratio is a lower
  bound set by this machine's RAM, not by the budget.
* Then an estimator-only table (no runs, activations excluded, clearly labelled) repeats the search on the
  ladder extended far beyond the cap, for dp = 1, 2, 4, 8.

Not a test: prints tables; nothing asserts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import peak_rss_mb  # noqa: E402

from lightning_scale.estimate import estimate  # noqa: E402
from lightning_scale.models.gpt import GPT, GPTConfig, lm_loss, make_batch  # noqa: E402
from lightning_scale.testing import run_distributed  # noqa: E402

MiB, GiB = 2**20, 2**30
VOCAB, SEQ, HEAD_DIM = 8192, 128, 64
# (n_layer, d_model): layers x width grow together, ~1.2-1.6x parameters per rung.
LADDER: List[Tuple[int, int]] = [
    (2, 128), (4, 192), (4, 256), (6, 320), (6, 384), (8, 448), (8, 512), (10, 576), (10, 640), (12, 704),
    (12, 768), (14, 832), (14, 896), (16, 960), (16, 1024), (16, 1152), (18, 1280), (20, 1408), (24, 1536),
    (24, 1792), (28, 2048), (32, 2304), (32, 2560), (40, 3072), (48, 4096), (56, 5120), (64, 6144),
    (80, 8192), (96, 10240), (112, 12288),
]
# name -> (ZeRO stage, offload as lightning_scale.estimate names it)
SYSTEMS: Dict[str, Tuple[int, str]] = {
    "ddp": (0, "none"), "z1": (1, "none"), "z2": (2, "none"), "z3": (3, "none"),
    "z2_offload": (2, "optimizer"), "z3_offload": (3, "all"),
}
LABELS = {"ddp": "DDP (stage 0)", "z1": "stage 1", "z2": "stage 2", "z3": "stage 3",
          "z2_offload": "stage 2 + optimizer offload", "z3_offload": "stage 3 + offload (optimizer + params)"}
UNITS = ["wte", "wpe", "blocks.*", "ln_f", "lm_head"]
PROCESS_OVERHEAD = 0.5 * GiB  # python + torch + lightning_scale per rank, measured ~0.4-0.6 GiB here


def config(rung: int) -> GPTConfig:
    n_layer, d = LADDER[rung]
    return GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=n_layer, n_head=d // HEAD_DIM, d_model=d)


def counts(cfg: GPTConfig) -> Tuple[int, int]:
    """(parameters, parameters of the largest stage-3 unit: a block or the vocab x d embedding / head)."""
    d = cfg.d_model
    block = 4 * d + 3 * d * d + 3 * d + d * d + d + 4 * d * d + 4 * d + 4 * d * d + d
    return cfg.num_params(), max(block, VOCAB * d, SEQ * d)


def estimated(rung: int, system: str, dp: int):
    # offload_grads: under optimizer offload the engine streams each reduced gradient shard to the host at
    # stage 3 (Stage3Optimizer) and, since 2026-11-30 05:36, at stage 2 too (GradientReducer(stream_grads=True)).
    stage, offload = SYSTEMS[system]
    params, unit = counts(config(rung))
    return estimate(params, dp=dp, stage=stage, offload=offload, precision="32-true", optimizer="adamw",
                    largest_unit_params=unit if stage == 3 else 0, prefetch_depth=1,
                    offload_grads=stage >= 2 and offload != "none")


def host_needed(rung: int, system: str, dp: int) -> float:
    e = estimated(rung, system, dp)
    return dp * (e.device.total + e.host.total + PROCESS_OVERHEAD)


# ------------------------------------------------------------------------------------------- one real step
class SavedActivations:
    """Bytes of distinct non-parameter storages autograd saves for backward (a forward's activation memory)."""

    def __init__(self, params) -> None:
        self.param_ids = {id(p) for p in params}
        self.seen = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in self.param_ids and id(base) not in self.param_ids and t.device.type != "meta":
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in self.seen:
                self.seen.add(key)
                self.bytes += st.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def track_pending_reductions(sharded) -> Dict[str, int]:
    """Peak bytes of gradient buffers held by stage-3 reduce-scatters that were launched but not yet waited for.

    Introspection of ``ShardedParameters`` internals (bench-only, fragile by design): after every unit's
    ``_reduce`` it sums the distinct tensors the pending handles keep alive (the full-size staging buffer,
    the reduced shard, and the gloo fallback's receive buffer held in the inner handle's closure).
    """
    peak = {"bytes": 0, "pending_units": 0}
    original = sharded._reduce

    def tensors_of(fn) -> List[torch.Tensor]:
        out = [d for d in (getattr(fn, "__defaults__", None) or ()) if torch.is_tensor(d)]
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if torch.is_tensor(cell.cell_contents):
                    out.append(cell.cell_contents)
            except ValueError:  # empty cell
                pass
        return out

    def reduce(unit) -> None:
        original(unit)
        seen, total = set(), 0
        pending = [h for h in sharded._reductions if not h._done]
        for h in pending:
            ts = tensors_of(h._finish)
            for d in getattr(h._finish, "__defaults__", None) or ():
                if hasattr(d, "_finish"):  # the inner collective handle (gloo fallback keeps its recv buffer)
                    ts += tensors_of(d._finish)
            for t in ts:
                st = t.untyped_storage()
                if st.data_ptr() not in seen and st.nbytes():
                    seen.add(st.data_ptr())
                    total += st.nbytes()
        peak["bytes"] = max(peak["bytes"], total)
        peak["pending_units"] = max(peak["pending_units"], len(pending))

    sharded._reduce = reduce
    return peak


def step_worker(rank: int, world: int, system: str, rung: int, local_batch: int) -> Dict[str, float]:
    """Build ``system`` on ladder rung ``rung`` and train one step; return the device accounting."""
    stage, offload = SYSTEMS[system]
    cfg = config(rung)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    sharded = None
    if stage == 3:
        from lightning_scale.zero.param_shard import ShardedParameters
        from lightning_scale.zero.stage3_optimizer import Stage3Optimizer

        with torch.device("meta"):  # never whole on a rank: materialized and sliced one unit at a time
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sharded = ShardedParameters(model, [g["params"] for g in opt.param_groups], device=torch.device("cpu"),
                                    unit_modules=UNITS, prefetch_depth=1,
                                    param_device=torch.device("cpu") if offload in ("params", "all") else None)
        sharded.shard_model()
        engine = Stage3Optimizer(opt, sharded, offload_optimizer=offload in ("optimizer", "all"))
        pending = track_pending_reductions(sharded)
    else:
        from lightning_scale.zero import ZeroOptimizer

        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = ZeroOptimizer(opt, stage=stage, offload_optimizer=offload == "optimizer")
    build_s = time.perf_counter() - t0
    x, y = make_batch(cfg, world * local_batch, seed=0)
    x, y = x[rank * local_batch:(rank + 1) * local_batch], y[rank * local_batch:(rank + 1) * local_batch]
    acts = SavedActivations(model.parameters())
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(acts.pack, acts.unpack):
        loss = lm_loss(model(x), y)
    loss.backward()
    after_backward = engine.memory_bytes()
    if stage == 3:
        sharded.flush()  # gradient shards exist (what the step reads): count them too
        after_backward = engine.memory_bytes()
    opt.step()
    after_step = engine.memory_bytes()
    step_s = time.perf_counter() - t0
    states = max(after_backward["device"], after_step["device"])
    out = {"params": sum(p.numel() for p in model.parameters()), "engine_device": states,
           "engine_host": max(after_backward["host"], after_step["host"]), "grads_host_but_counted_device": 0,
           "peak_gathered": 0, "unit_grads": 0, "activations": acts.bytes, "loss": float(loss.detach()),
           "build_s": build_s, "step_s": step_s}
    if stage == 3:
        mem = sharded.memory_bytes()
        out["peak_gathered"] = mem["peak_gathered"]
        out["unit_grads"] = max(u.nbytes_full for u in sharded.units)  # one unit's full gradients
        out["pending_reduce_bytes"] = pending["bytes"]
        out["pending_units"] = pending["pending_units"]
        # (Stage3Optimizer.memory_bytes() counts gradient shards streamed to the host as host bytes since
        # 2026-11-30 06:00; grads_host_but_counted_device stays 0.)
    # "design": three units' gradients in flight (the estimator's transient); "device": what the engine
    # really holds in flight (the larger of that and the measured pending reduce-scatter buffers).
    base = out["engine_device"] - out["grads_host_but_counted_device"] + out["peak_gathered"] + out["activations"]
    # design (the estimator): three units' gradients (the unit being reduced, its staging copy, one in flight);
    # measured: the unit being reduced + the measured staging bytes of pending reduce-scatters.
    out["device_design"] = base + 3 * out["unit_grads"]
    out["device"] = base + out["unit_grads"] + out.get("pending_reduce_bytes", 0)
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def run_step(system: str, rung: int, dp: int, timeout: float) -> Dict[str, float]:
    outs = run_distributed(step_worker, dp, (system, rung, 1), timeout=timeout)
    res = dict(outs[0])
    for key in ("device", "device_design", "engine_device", "activations", "peak_gathered"):
        res[key] = max(o[key] for o in outs)  # the worst rank decides
    res["peak_rss_mb"] = max(o["peak_rss_mb"] for o in outs)
    res["rss_total_mb"] = sum(o["peak_rss_mb"] for o in outs)
    return res


# ------------------------------------------------------------------------------------------- search
def estimator_guess(system: str, dp: int, budget: float, top: int) -> int:
    """Largest rung <= top whose estimated device bytes (model states, no activations) fit the budget."""
    best = 0
    for r in range(top + 1):
        if estimated(r, system, dp).device.total <= budget:
            best = r
    return best


_CACHE: Dict[Tuple[str, int, int], Dict[str, float]] = {}


def search(system: str, dp: int, budget: float, cap_bytes: float, timeout: float, log,
           metric: str = "device") -> Dict[str, object]:
    """Largest rung whose real step's ``metric`` fits the budget (runs shared between metrics via a cache)."""
    cap = max([r for r in range(len(LADDER)) if host_needed(r, system, dp) <= cap_bytes], default=-1)
    if cap < 0:
        return {"system": system, "dp": dp, "rung": None, "why": "even the first rung exceeds the host cap"}
    guess = estimator_guess(system, dp, budget, cap)
    tried: Dict[int, Dict[str, float]] = {}

    def fits(r: int) -> bool:
        key = (system, dp, r)
        if key not in _CACHE:
            res = run_step(system, r, dp, timeout)
            _CACHE[key] = res
            n, d = LADDER[r]
            log(f"  {system:11s} dp={dp} rung {r:2d} (L{n} d{d}, {res['params'] / 1e6:8.1f}M): device "
                f"{res['device'] / MiB:8.1f} MiB (engine {res['engine_device'] / MiB:.1f}, grads on host "
                f"-{res['grads_host_but_counted_device'] / MiB:.1f}, gathered {res['peak_gathered'] / MiB:.1f}, "
                f"in-flight grads (one unit {res['unit_grads'] / MiB:.1f} + pending reduce-scatters "
                f"{res.get('pending_reduce_bytes', 0) / MiB:.1f} over {res.get('pending_units', 0)} units), "
                f"activations {res['activations'] / MiB:.1f}); design figure {res['device_design'] / MiB:.1f} MiB; "
                f"rss {res['rss_total_mb']:.0f} MB all ranks; build {res['build_s']:.1f}s step {res['step_s']:.1f}s")
        tried[r] = _CACHE[key]
        return tried[r][metric] <= budget

    r = guess
    if fits(r):
        while r + 1 <= cap and fits(r + 1):
            r += 1
        best = r
    else:
        while r > 0 and not fits(r - 1):
            r -= 1
        best = r - 1 if r > 0 else None
    capped = best == cap and cap + 1 < len(LADDER) and estimated(cap + 1, system, dp).device.total <= budget
    return {"system": system, "dp": dp, "rung": best, "guess": guess, "cap": cap, "capped": capped,
            "result": tried.get(best) if best is not None else None, "runs": len(tried), "metric": metric}


def print_table(results, args, metric: str) -> None:
    base = {r["dp"]: r for r in results if r["system"] == "ddp"}
    print("| dp | system | largest rung (layers x d) | params (M) | vs DDP same dp | device MiB: total = engine "
          "- grads on host + gathered + in-flight grads + activations | engine host MiB | peak RSS MB (all ranks) | "
          "rungs run (estimator's first guess) | note |")
    print("|---" * 10 + "|")
    for r in results:
        if r.get("rung") is None:
            print(f"| {r['dp']} | {LABELS[r['system']]} | none fits | - | - | - | - | - | {r.get('runs', 0)} | "
                  f"{r.get('why', 'rung 0 over budget')} |")
            continue
        res = r["result"]
        n, d = LADDER[r["rung"]]
        b = base.get(r["dp"])
        ratio = (res["params"] / b["result"]["params"]) if b and b.get("result") else float("nan")
        note = (f"capped by host RAM (rung {r['cap']} is the last the {args.host_cap_gib:.0f} GiB cap allows; "
                "the estimator says the next rung fits the budget)") if r["capped"] else "budget-limited"
        inflight = res["device"] - res["engine_device"] + res["grads_host_but_counted_device"] - \
            res["peak_gathered"] - res["activations"]
        if metric == "device_design":
            inflight = res["unit_grads"]
        print(f"| {r['dp']} | {LABELS[r['system']]} | {r['rung']} (L{n} x d{d}) | {res['params'] / 1e6:,.1f} | "
              f"{ratio:.1f}x{' (lower bound)' if r['capped'] else ''} | {res[metric] / MiB:,.0f} = "
              f"{res['engine_device'] / MiB:,.0f} - {res['grads_host_but_counted_device'] / MiB:,.0f} + "
              f"{res['peak_gathered'] / MiB:,.0f} + {inflight / MiB:,.0f} + {res['activations'] / MiB:,.0f}"
              f" | {res['engine_host'] / MiB:,.0f} | {res['rss_total_mb']:,.0f} | {r['runs']} ({r['guess']}) | "
              f"{note} |")


def estimate_only(system: str, dp: int, budget: float) -> Optional[int]:
    best = None
    for r in range(len(LADDER)):
        if estimated(r, system, dp).device.total <= budget:
            best = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=float, default=512.0, help="device-memory budget per rank")
    ap.add_argument("--dps", default="1,2", help="data-parallel sizes to run for real")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--host-cap-gib", type=float, default=6.0,
                    help="largest estimated host memory (all ranks, model states + 0.5 GiB/process) to run")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per real step run")
    ap.add_argument("--estimate-dps", default="1,2,4,8")
    ap.add_argument("--estimate-only", action="store_true", help="skip the real runs; print the estimator table")
    args = ap.parse_args()
    budget = args.budget_mib * MiB
    cap_bytes = args.host_cap_gib * GiB
    systems = [s.strip() for s in args.systems.split(",")]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: unknown {s!r}; known: {', '.join(SYSTEMS)}")
    dps = [int(x) for x in args.dps.split(",")]

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f"budget {args.budget_mib:.0f} MiB device per rank; host cap {args.host_cap_gib:.1f} GiB; ladder:")
    log("  " + ", ".join(f"{i}:L{n}xd{d}={counts(config(i))[0] / 1e6:.1f}M" for i, (n, d) in enumerate(LADDER)))
    if args.estimate_only:
        dps = []
    results = [search(s, dp, budget, cap_bytes, args.timeout, log) for dp in dps for s in systems]
    print(f"\n## Largest GPT under {args.budget_mib:.0f} MiB of accounted device memory per rank "
          f"({datetime.date.today()}, CPU, gloo, fp32 AdamW, 1 x {SEQ} tokens per rank, one real step)\n")
    print("In-flight gradients = what the engine really holds: stage 3 = one unit's gradients + measured "
          "buffers of launched-but-not-waited reduce-scatters).\n")
    print_table(results, args, "device")
    if dps and any(SYSTEMS[s][0] == 3 for s in systems):
        log("\n(search again with the design figure: stage 3 in-flight gradients = three units, as the estimator "
            "assumes; rungs already run are reused)")
        design = [search(s, dp, budget, cap_bytes, args.timeout, log, metric="device_design")
                  for dp in dps for s in systems]
        print("\n### Same budget, stage 3 counted as designed (three units' gradients in flight, not the measured "
              "pending reduce-scatters)\n")
        print_table(design, args, "device_design")

    edps = [int(x) for x in args.estimate_dps.split(",")]
    print(f"\n### ESTIMATE ONLY (lightning_scale.estimate, no runs, activations excluded): largest ladder rung "
          f"under {args.budget_mib:.0f} MiB, ladder extended to {counts(config(len(LADDER) - 1))[0] / 1e9:.0f}B\n")
    print("| system | " + " | ".join(f"dp={d}: params (vs DDP)" for d in edps) + " |")
    print("|---" * (1 + len(edps)) + "|")
    for s in systems:
        cells = []
        for dp in edps:
            r, rb = estimate_only(s, dp, budget), estimate_only("ddp", dp, budget)
            if r is None:
                cells.append("none")
                continue
            p = counts(config(r))[0]
            ratio = p / counts(config(rb))[0] if rb is not None else float("nan")
            top = " (top of ladder)" if r == len(LADDER) - 1 else ""
            cells.append(f"{p / 1e6:,.0f}M ({ratio:.1f}x){top}")
        print(f"| {LABELS[s]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
