"""AdamW (torch DDP) vs OneBitAdam (stage 0 and ZeRO-2) on the project GPT, data parallel over gloo on CPU.

For dp = 2 and dp = 4, all systems train the same GPT (``gpt_small`` widths: 4 layers, d 256,
4 heads, seq 128; byte vocabulary 256) on the Python stdlib byte corpus, same seed, same batches,
same learning-rate schedule (linear warm-up, cosine):

  AdamW       torch DDP + torch.optim.AdamW: the peer (its bytes: the ring all-reduce formula of
              the accounting layer, 2 (N-1)/N * 4n per step, since DDP's reducer is not ours)
  OneBitAdam  lightning_scale.optim.OneBitAdam, freeze_step = 20% of the steps (bytes measured by
              the accounting layer)
  OneBitAdam ZeRO-2
              the same optimizer under lightning_scale.zero.onebit.OneBitZeroOptimizer (stage 2):
              sharded m / v, 1-bit reduce-scatter onto the shards, fp32 parameter all-gather

Reported per dp: bytes per rank (whole run, and per compression-stage step) with the ratio,
tokens/s (median step time; median over rounds, systems interleaved with the order rotated every
round) and its ratio to DDP, final train and validation loss, and tokens/s projected over slower
links: measured step time + bytes / bandwidth (a model, labelled as such). With ``--link RATE`` and
the rate-limited link harness (lightning_scale.testing_netns: 2 hosts in network namespaces, one
rank each, link capped by tc tbf; needs root), every system also runs ``--link-steps`` steps over
that link and tokens/s are measured there. Loss curves go to a PNG (matplotlib). Never asserts on time.

Full run (quiet machine, ~30 min):  python bench/onebit_adam.py --results bench/RESULTS.md
Smoke run:                         python bench/onebit_adam.py --smoke
Modest run + 100 Mbit/s link:      python bench/onebit_adam.py --worlds 2 --steps 60 --rounds 1 --link 100mbit
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from lightning_scale.comm import CommCounter, algorithmic_bytes  # noqa: E402
from lightning_scale.testing import run_distributed  # noqa: E402

SYSTEMS = ("AdamW (DDP)", "OneBitAdam", "OneBitAdam ZeRO-2")
LINKS_GBIT = (0.1, 1.0, 10.0)


def _windows(data: torch.Tensor, n: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (n,), generator=g)
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]  # (B, T), (B, T)


def _train(rank: int, world: int, system: str, opts: dict) -> dict:
    """One run on one rank: per-step global loss and time, bytes, final validation loss."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_scale.data import split, stdlib_corpus
    from lightning_scale.models.gpt import GPT, gpt_small, lm_loss
    from lightning_scale.optim import OneBitAdam
    from lightning_scale.zero.onebit import OneBitZeroOptimizer

    train, val = split(stdlib_corpus(opts["corpus_bytes"]), val_fraction=0.05)
    torch.manual_seed(0)
    model = GPT(gpt_small(vocab_size=256))
    n = sum(p.numel() for p in model.parameters())
    kw = dict(lr=opts["lr"], betas=(0.9, 0.999), weight_decay=0.01)
    if system.startswith("OneBitAdam"):
        net, opt = model, OneBitAdam(model.parameters(), freeze_step=opts["freeze"], **kw)
        if system == "OneBitAdam ZeRO-2":
            OneBitZeroOptimizer(opt, stage=2, group=None)  # routes opt.step() / opt.zero_grad() to the engine
    else:
        net, opt = DistributedDataParallel(model), torch.optim.AdamW(model.parameters(), **kw)
    steps, batch, seq = opts["steps"], opts["batch"], model.cfg.seq_len
    losses, times, step_bytes = [], [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = opts["lr"] * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        x, y = _windows(train, batch, seq, seed=1000 * step + rank)
        start = time.perf_counter()
        with CommCounter() as counter:
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(net(x), y)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - start)
        step_bytes.append(counter.total if system != "AdamW (DDP)" else algorithmic_bytes("all_reduce", 4 * n, world))
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # logging only, outside the counter
        losses.append(mean_loss.item() / world)
    with torch.no_grad():
        x, y = _windows(val, 128, seq, seed=12345)
        val_loss = sum(model.loss(x[i:i + 32], y[i:i + 32]).item() for i in range(0, 128, 32)) / 4
    return {"losses": losses, "times": times, "bytes": step_bytes, "val": val_loss, "params": n}


def _run(world: int, opts: dict) -> dict:
    results = {s: [] for s in SYSTEMS}
    for r in range(opts["rounds"]):
        order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))
        for system in order:
            out = run_distributed(_train, world, args=(system, opts), timeout=opts["timeout"])
            results[system].append(out[0])
    return results


def _run_link(opts: dict, rate: str) -> dict:
    """Every system once over 2 hosts (one rank each) joined by a link capped at ``rate``; None if unavailable."""
    from lightning_scale import testing_netns as N

    reason = N.unavailable_reason()
    if reason is not None:
        print(f"rate-limited link skipped: {reason}")
        return None
    results = {}
    with N.SlowNetwork(hosts=2, rate=rate) as net:
        for system in SYSTEMS:
            results[system] = N.run_on_hosts(_train, net, ranks_per_host=1, args=(system, opts),
                                             timeout=opts["timeout"])[0]
    return results


def _link_table(results: dict, opts: dict, rate: str) -> str:
    tokens = 2 * opts["batch"] * 128
    lines = [f"| system (dp=2, 2 hosts, {rate} link) | tok/s, whole run | vs DDP | tok/s, 1-bit steps (median) | "
             "vs DDP | MB/rank per 1-bit step |", "|---|---|---|---|---|---|"]
    base = None
    for system in SYSTEMS:
        run = results[system]
        skip = min(2, opts["freeze"])
        whole = tokens * (len(run["times"]) - skip) / sum(run["times"][skip:])
        late = [t for i, t in enumerate(run["times"]) if i >= opts["freeze"]] or run["times"]
        onebit = tokens / statistics.median(late)
        per_step = statistics.median([b for i, b in enumerate(run["bytes"]) if i >= opts["freeze"]] or run["bytes"])
        base = base or (whole, onebit)
        lines.append(f"| {system} | {whole:.0f} | {whole / base[0]:.2f} | {onebit:.0f} | {onebit / base[1]:.2f} | "
                     f"{per_step / 1e6:.2f} |")
    return "\n".join(lines)


def _summary(world: int, results: dict, opts: dict) -> list:
    rows = []
    tokens = world * opts["batch"] * 128
    base = None
    for system in SYSTEMS:
        runs = results[system]
        skip = min(3, opts["steps"] - 1)
        step_s = statistics.median(statistics.median(run["times"][skip:]) for run in runs)
        first = runs[0]
        total = sum(first["bytes"])
        compressed = [b for i, b in enumerate(first["bytes"]) if i >= opts["freeze"]] or [float("nan")]
        row = {"dp": world, "system": system, "tokens_s": tokens / step_s, "step_s": step_s,
               "bytes_total": total, "bytes_step_compressed": statistics.median(compressed),
               "train": statistics.fmean(first["losses"][-10:]), "val": first["val"]}
        base = base or row
        row["bytes_ratio"] = base["bytes_total"] / total
        row["speed_ratio"] = row["tokens_s"] / base["tokens_s"]
        for gbit in LINKS_GBIT:
            per_step = total / len(first["bytes"])
            row[f"proj_{gbit}"] = tokens / (step_s + per_step * 8 / (gbit * 1e9))
        rows.append(row)
    return rows


def _table(rows: list) -> str:
    head = ("| dp | system | bytes/rank, run (MB) | x fewer | bytes/rank per 1-bit step (KB) | tokens/s | "
            "vs DDP | train loss | val loss | " + " | ".join(f"proj. tok/s @{g:g} Gbit/s" for g in LINKS_GBIT) + " |")
    lines = [head, "|" + "---|" * (9 + len(LINKS_GBIT))]
    for r in rows:
        lines.append(
            f"| {r['dp']} | {r['system']} | {r['bytes_total'] / 1e6:.1f} | {r['bytes_ratio']:.2f} | "
            f"{r['bytes_step_compressed'] / 1e3:.1f} | {r['tokens_s']:.0f} | {r['speed_ratio']:.2f} | "
            f"{r['train']:.3f} | {r['val']:.3f} | " + " | ".join(f"{r[f'proj_{g}']:.0f}" for g in LINKS_GBIT) + " |")
    return "\n".join(lines)


def _plot(all_results: dict, opts: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, len(all_results), figsize=(6 * len(all_results), 4), squeeze=False)
    for ax, (world, results) in zip(axes[0], sorted(all_results.items())):
        for system in SYSTEMS:
            losses = torch.tensor(results[system][0]["losses"])
            k = min(10, len(losses))
            smooth = torch.nn.functional.avg_pool1d(losses.view(1, 1, -1), k, stride=1).flatten()
            ax.plot(range(k - 1, len(losses)), smooth.tolist(), label=f"{system} (val {results[system][0]['val']:.3f})")
        ax.axvline(opts["freeze"], color="gray", linestyle="--", label="freeze_step (1-bit from here)")
        ax.set_title(f"GPT (gpt_small widths, byte vocab), dp={world}")
        ax.set_xlabel("step")
        ax.set_ylabel(f"train loss (mean of {min(10, opts['steps'])} steps)")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"loss curves: {path}")


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--freeze", type=int, default=None, help="default: 20%% of --steps")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 128 bytes per rank and step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plot", default=os.path.join(root, "docs", "onebit_adam_loss.png"))
    parser.add_argument("--results", default=None, help="append the dated table to this markdown file")
    parser.add_argument("--smoke", action="store_true", help="dp=2, 12 steps, 1 round, plot to /tmp")
    parser.add_argument("--link", default=None, help="also run dp=2 over the rate-limited link harness, e.g. 100mbit")
    parser.add_argument("--link-steps", type=int, default=20, help="steps per system over the link")
    args = parser.parse_args()
    if args.smoke:
        args.worlds, args.steps, args.rounds, args.plot = "2", 12, 1, "/tmp/onebit_adam_smoke.png"
    opts = dict(steps=args.steps, freeze=args.freeze or max(1, args.steps // 5), batch=args.batch, lr=args.lr,
                rounds=args.rounds, corpus_bytes=4 * 2**20, timeout=max(600.0, 10.0 * args.steps))
    all_results, rows = {}, []
    for world in [int(w) for w in args.worlds.split(",")]:
        all_results[world] = _run(world, opts)
        rows += _summary(world, all_results[world], opts)
    table = _table(rows)
    params = next(iter(all_results.values()))[SYSTEMS[0]][0]["params"]
    print(f"\nGPT gpt_small widths (byte vocab, {params / 1e6:.2f}M "
          f"params), {opts['steps']} steps, freeze_step {opts['freeze']}, {opts['batch']}x128 tokens/rank/step, "
          f"{opts['rounds']} round(s)\n")
    print(table)
    print("\nprojected tok/s: measured step time + bytes per step / link bandwidth (a model, not a measurement)")
    _plot(all_results, opts, args.plot)
    link_table = ""
    if args.link:
        link_opts = dict(opts, steps=args.link_steps, freeze=max(1, args.link_steps // 5))
        link = _run_link(link_opts, args.link)
        if link is not None:
            link_table = (f"\nOver the rate-limited link ({args.link}, lightning_scale.testing_netns), "
                          f"{link_opts['steps']} steps, freeze_step {link_opts['freeze']}; whole run excludes the "
                          f"first {min(2, link_opts['freeze'])} steps:\n\n" + _link_table(link, link_opts, args.link))
            print(link_table)
    if args.results:
        with open(args.results, "a") as f:
            f.write(f"\n## OneBitAdam vs AdamW (DDP), {datetime.date.today().isoformat()}\n\n"
                    f"`python bench/onebit_adam.py` ({opts['steps']} steps, freeze_step {opts['freeze']}, "
                    f"{opts['rounds']} rounds). Plot: docs/onebit_adam_loss.png\n\n{table}\n{link_table}\n")


if __name__ == "__main__":
    main()
