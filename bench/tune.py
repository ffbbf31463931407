"""The autotuner's pick vs the best of an exhaustive sweep, bench GPT (shared/PEERS.md), 2 CPU ranks.

    python bench/tune.py                          # sweep every candidate, then the tuner; prints both ratios
    python bench/tune.py --share 0.15 --steps 4
    python bench/tune.py --model gpt_small:n_layer=8,d_model=192,n_head=6,vocab_size=4096,seq_len=256  # out of sample
    python bench/tune.py --model gpt_small:seq_len=2048 --global-batch 2 --sp 1,2 --memory-budget-mib 200
        # long sequences: a budget where most layouts fit only with memory relief (tiled MLP, head tiling,
        # activation offload) or Ulysses

Both measure with the same probe (lightning_scale.tune.measure: parallelize() + engines in a fresh 2-rank group,
``--steps`` timed steps after 2 warm-up steps). The sweep measures every candidate that fits; the tuner measures the
first ``--share`` of them in its prior's order (``--max-probes``), then its pick is the fastest it measured. The
figures: the pick's tokens/s as the *sweep* measured it / the sweep's best (target >= 0.95), and the tuner's
wall time / the sweep's (target <= 0.20). The order alternates (sweep first, tuner first) per round. Both maxima are noisy, so when the pick is not the sweep's
best the two are then measured side by side ``--h2h`` times (interleaved) and the median ratio printed.
Not a test: nothing asserts on time. The box is noisy: DDP against itself spans ~0.6-1.3 here.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_scale.estimate import _model_from_spec  # noqa: E402
from lightning_scale.tune import measure, plan, tune  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--global-batch", type=int, default=4, help="sequences of 128 tokens per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--h2h", type=int, default=3, help="interleaved re-measurements of the sweep's best vs the pick")
    ap.add_argument("--share", type=float, default=0.12, help="the tuner's probes, as a share of the survivors")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--memory-budget-mib", type=float, default=2048)
    ap.add_argument("--model", default="gpt_small", help="an estimator spec (gpt_small[:key=value,...]); the prior's "
                    "factors were fitted on gpt_small, so another shape is an out-of-sample check")
    ap.add_argument("--sp", default="1", help="Ulysses sizes searched, e.g. 1,2 (a long --model seq_len)")
    args = ap.parse_args()
    model = _model_from_spec(args.model)
    space = dict(stages=(0, 2, 3), offloads=("none", "optimizer"), buckets=(25.0,), acs=(None, "full"),
                 sps=tuple(int(v) for v in args.sp.split(",")))
    rows = plan(model, model.cfg, 2, args.global_batch, args.memory_budget_mib * 2**20, **space)
    survivors = [r for r in rows if not r.reason]
    probes = max(1, math.ceil(args.share * len(survivors)))
    print(f"{args.model}: {len(rows)} candidates, {len(survivors)} fit; the tuner probes {probes}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    quiet = lambda s: None  # noqa: E731
    for rnd in range(args.rounds):
        out = {}
        for who in (("sweep", "tuner") if rnd % 2 == 0 else ("tuner", "sweep")):
            fresh = plan(model, model.cfg, 2, args.global_batch, args.memory_budget_mib * 2**20, **space)
            t0 = time.perf_counter()
            ranked = tune(fresh, model.cfg, budget_s=1e9, max_probes=None if who == "sweep" else probes,
                          results_path=None, log=quiet if who == "sweep" else print, steps=args.steps)
            out[who] = (ranked, time.perf_counter() - t0)
            print(f"{who}: {len(ranked)} measured in {out[who][1]:,.0f} s; best {ranked[0].candidate.key} "
                  f"{ranked[0].result['tokens_per_s']:,.0f} tokens/s", flush=True)
        sweep, sweep_s = out["sweep"]
        tuned, tuner_s = out["tuner"]
        by_key = {r.candidate.key: r.result["tokens_per_s"] for r in sweep}
        pick = tuned[0].candidate.key
        print("\n| round | sweep best | sweep tokens/s | tuner pick | pick's sweep tokens/s | ratio (target >= 0.95)"
              " | pick's rank in sweep | tuner s / sweep s (target <= 0.20) |\n|---|---|---|---|---|---|---|---|")
        rank = [r.candidate.key for r in sweep].index(pick) + 1
        print(f"| {rnd + 1} | {sweep[0].candidate.key} | {sweep[0].result['tokens_per_s']:,.0f} | {pick} | "
              f"{by_key[pick]:,.0f} | {by_key[pick] / sweep[0].result['tokens_per_s']:.3f} | {rank}/{len(sweep)} | "
              f"{tuner_s:,.0f} / {sweep_s:,.0f} = {tuner_s / sweep_s:.2f} |")
        if pick != sweep[0].candidate.key and args.h2h:  # both maxima are noisy: measure the two side by side
            pair, ratios = (sweep[0].candidate, tuned[0].candidate), []
            for i in range(args.h2h):
                order = pair if i % 2 == 0 else pair[::-1]
                got = {c.key: measure(model.cfg, c, steps=args.steps)["tokens_per_s"] for c in order}
                ratios.append(got[pick] / got[pair[0].key])
                print(f"  head-to-head {i + 1}: pick / sweep best = {ratios[-1]:.3f}", flush=True)
            print(f"head-to-head median (pick / sweep best, {args.h2h} interleaved pairs): "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"load average {os.getloadavg()[0]:.1f} after round {rnd + 1}", flush=True)
        top = "\n".join(f"  {r.candidate.key}: {r.result['tokens_per_s']:,.0f}" for r in sweep[:8])
        print("\nsweep top 8:\n" + top, flush=True)


if __name__ == "__main__":
    main()
