"""Longest sequence that trains one step under a fixed per-rank memory budget (issue 16), GPT d 512 on 1 rank.

    python bench/long_sequence.py                                   # budget 512 MiB, every system
    python bench/long_sequence.py --budget-mib 256 --systems dense,ac_chunked --max-len 4096   # smoke run

Systems (one rank: a world-1 gloo group, the real ``parallelize()`` + engine path at ZeRO stage 0, AdamW, fp32):

* ``dense``          dense SDPA, no activation checkpointing, the unchunked loss (``loss_chunk=0``) -- the baseline
* ``ac``             + ``activation_checkpointing="full"`` (every block)
* ``ac_selective``   + ``activation_checkpointing="selective"`` (matmul / attention outputs kept)
* ``chunked``        + the chunked loss only (``loss_chunk=512``, the default)
* ``ac_chunked``     full checkpointing + the chunked loss
* ``sparse``         block-sparse attention (BSLongformer, block 64, window 3 blocks, global block 0), nothing else
* ``sparse_ac_chunked``  block-sparse + full checkpointing + the chunked loss

How memory is measured: ``lightning_scale.memory.LiveTensorBytes`` (a TorchDispatchMode) is active from building
the model to the end of the optimizer step; the figure is the peak of the live bytes of every tensor storage
created inside (parameters, the engine's buffers, activations, gradients, Adam state, the loss's logits), at op
granularity. Scratch memory an op frees inside its own kernel is not seen. A length *fits* when that peak is at
most the budget. The search doubles the length from ``--start`` while it fits, then bisects to ``--granularity``
positions; every probe is a real training step (batch 1). Step times are at the baseline's longest length (and
at each system's own longest). This machine has no accelerator; ``bench/gpu_long_sequence.py`` is the GPU version.

Not a test: prints a table; nothing asserts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import Dict, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("LIGHTNING_SCALE_SKIP_REGISTER", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_scale.config import from_flat_kwargs  # noqa: E402
from lightning_scale.memory import LiveTensorBytes  # noqa: E402
from lightning_scale.models.gpt import GPT, GPTConfig  # noqa: E402
from lightning_scale.parallelize import local_topology, parallelize  # noqa: E402

MiB = 2**20
SYSTEMS: Dict[str, dict] = {  # name -> (strategy options, loss_chunk, sparse)
    "dense": dict(ac=None, chunk=0, sparse=False),
    "ac": dict(ac="full", chunk=0, sparse=False),
    "ac_selective": dict(ac="selective", chunk=0, sparse=False),
    "chunked": dict(ac=None, chunk=512, sparse=False),
    "ac_chunked": dict(ac="full", chunk=512, sparse=False),
    "sparse": dict(ac=None, chunk=0, sparse=True),
    "sparse_ac_chunked": dict(ac="full", chunk=512, sparse=True),
}


def model_config(args, length: int, chunk: int) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=length, n_layer=args.layers, n_head=args.heads, d_model=512,
                     loss_chunk=chunk)


def one_step(args, name: str, length: int, topo) -> Tuple[int, float]:
    """(peak live bytes, seconds) of building the model and training one step at ``length``."""
    spec = SYSTEMS[name]
    config = from_flat_kwargs(stage=0, activation_checkpointing=spec["ac"])
    cfg = model_config(args, length, spec["chunk"])
    torch.manual_seed(0)
    with LiveTensorBytes() as mem:
        model = GPT(cfg)
        if spec["sparse"]:
            from lightning_scale.nn import BSLongformerSparsityConfig, swap_gpt_attention

            swap_gpt_attention(model, BSLongformerSparsityConfig(num_heads=args.heads, block=64,
                                                                 num_sliding_window_blocks=3,
                                                                 global_block_indices=(0,)))
        pm = parallelize(model, config, topo, "cpu", optimizers=lambda m=model: [torch.optim.AdamW(m.parameters())])
        (engine,) = pm.make_engines()
        idx = torch.randint(0, cfg.vocab_size, (1, length + 1), generator=torch.Generator().manual_seed(length))
        start = time.perf_counter()
        model.loss(idx[:, :-1], idx[:, 1:]).backward()
        engine.step()
        engine.zero_grad()
        seconds = time.perf_counter() - start
        engine.remove_hooks()
        del engine, pm, model
    return mem.peak, seconds


def longest(args, name: str, topo, cache: Dict[Tuple[str, int], Tuple[int, float]]) -> Tuple[int, Optional[int]]:
    """(longest fitting length, the first failing length probed) on the --granularity grid."""
    budget = args.budget_mib * MiB

    def fits(length: int) -> bool:
        if (name, length) not in cache:
            cache[(name, length)] = one_step(args, name, length, topo)
            peak, sec = cache[(name, length)]
            print(f"  {name:18s} L={length:6d}: peak {peak / MiB:7.1f} MiB, step {sec:6.2f} s "
                  f"{'fits' if peak <= budget else 'over'}", flush=True)
        return cache[(name, length)][0] <= budget

    good, bad, length = 0, None, args.start
    while length <= args.max_len and fits(length):
        good, length = length, length * 2
    if length <= args.max_len:
        bad = length
    elif good:
        return good, None  # still fits at --max-len: a lower bound
    if good == 0:
        return 0, bad
    while bad - good > args.granularity:
        mid = (good + bad) // 2 // args.granularity * args.granularity
        if mid in (good, bad):
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=float, default=512)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--start", type=int, default=512)
    ap.add_argument("--granularity", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [s for s in args.systems.split(",") if s]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    store = os.path.join(tempfile.mkdtemp(prefix="ls_longseq_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    topo = local_topology(from_flat_kwargs(stage=0), 1, 0)
    print(f"# long_sequence: GPT d512 x {args.layers} layers, {args.heads} heads, vocab {args.vocab}, fp32, batch 1, "
          f"AdamW, 1 rank; budget {args.budget_mib:.0f} MiB of live tensor bytes; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs", flush=True)
    cache: Dict[Tuple[str, int], Tuple[int, float]] = {}
    found = {name: longest(args, name, topo, cache) for name in names}
    base = found.get("dense", (0, None))[0] if "dense" in found else None
    if base:  # every system's step time at the baseline's length, measured in this run
        for name in names:
            if (name, base) not in cache and found[name][0] >= base:
                cache[(name, base)] = one_step(args, name, base, topo)
    print()
    print(f"| system | longest L (budget {args.budget_mib:.0f} MiB) | x dense | peak MiB at longest | "
          f"step s at longest | step s at dense's L={base} | x dense time |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        good, bad = found[name]
        bound = "" if bad is not None else " (>=, --max-len)"
        peak, sec = cache.get((name, good), (0, float("nan")))
        ratio = f"{good / base:.2f}" if base else "-"
        at_base = cache.get((name, base)) if base else None
        t_base = f"{at_base[1]:.2f}" if at_base else "-"
        t_ratio = f"{at_base[1] / cache[('dense', base)][1]:.2f}" if at_base and ("dense", base) in cache else "-"
        print(f"| {name} | {good}{bound} | {ratio} | {peak / MiB:.0f} | {sec:.2f} | {t_base} | {t_ratio} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
