"""Longest sequence a 1B GPT trains one step at on one GPU (issue 16: the H200 figure at sp=1).

    python bench/gpu_long_sequence.py --dry-run               # the plan (no GPU needed)
    python bench/gpu_long_sequence.py                         # budget: the whole device; every system
    python bench/gpu_long_sequence.py --budget-gib 80 --systems dense,ac_chunked --out /tmp/gls
    python bench/gpu_long_sequence.py --cpu-smoke             # the same code on a tiny GPT on the CPU

The GPU counterpart of ``bench/long_sequence.py``: the project GPT at d 2048, 16 layers, 16 heads, vocabulary
32000, seq positions as long as probed (learned positions grow with it), 0.94B parameters at L = 4096; fp32
parameters and AdamW (16 bytes per parameter of model state, ~15 GiB), forward under ``torch.autocast(bfloat16)``;
batch 1; one rank (a world-1 NCCL group through ``parallelize()`` at ZeRO stage 0). Systems as in the CPU script:
``dense`` (no checkpointing, unchunked loss), ``ac``, ``ac_selective``, ``chunked``, ``ac_chunked``, ``sparse``
and ``sparse_ac_chunked`` (Triton block-sparse attention, BSLongformer block 64); ``ac_offload_chunked`` and
``sparse_ac_offload_chunked`` add ``offload_activations=True`` (block inputs in pinned host memory; not counted in
the device peak); ``*_tiled`` add ``tiled_mlp=1024`` (each block's MLP run and recomputed 1024 positions at a time);
``*_heads`` add ``tiled_attention=2`` (the attention 2 heads at a time); ``rotary_*`` is the GPT with
``position="rotary"`` (no position table).

Memory: ``torch.cuda.max_memory_allocated()`` over building the model + one training step (reset before each
probe); a probe that raises ``torch.OutOfMemoryError`` does not fit. A length fits when the peak is <= the budget
(default: the device's total memory minus 2 GiB). Search: double from --start while it fits, then bisect to
--granularity. Tokens/s of a second timed step at the baseline's longest length, and its MFU: model FLOPs per token
6 x (12 L d^2 + V d) + 12 L d T (no recompute counted, PaLM's convention) x tokens/s / ``--peak-tflops`` (989, the
H200's dense bf16). No compiled rows here: every probed length is a new shape (a compile per probe would spend the
script's budget compiling); compiled speed is gpu_zero's, gpu_models' and gpu_tensor_parallel's. ``$OUT`` (or --out)
gets ``gpu_long_sequence.{json,md}``. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Dict, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("LIGHTNING_SCALE_SKIP_REGISTER", "1")

SYSTEMS: Dict[str, dict] = {
    "dense": dict(ac=None, chunk=0, sparse=False),
    "ac": dict(ac="full", chunk=0, sparse=False),
    "ac_selective": dict(ac="selective", chunk=0, sparse=False),
    "chunked": dict(ac=None, chunk=1024, sparse=False),
    "ac_chunked": dict(ac="full", chunk=1024, sparse=False),
    "sparse": dict(ac=None, chunk=0, sparse=True),
    "sparse_ac_chunked": dict(ac="full", chunk=1024, sparse=True),
    "ac_offload_chunked": dict(ac="full", chunk=1024, sparse=False, offload=True),
    "sparse_ac_offload_chunked": dict(ac="full", chunk=1024, sparse=True, offload=True),
    "ac_offload_chunked_tiled": dict(ac="full", chunk=1024, sparse=False, offload=True, tiled=1024),
    "sparse_ac_offload_chunked_tiled": dict(ac="full", chunk=1024, sparse=True, offload=True, tiled=1024),
    # + head-tiled attention (tiled_attention=2: 2 of the 16 heads at a time), and the rotary GPT (no position table)
    "ac_offload_chunked_tiled_heads": dict(ac="full", chunk=1024, sparse=False, offload=True, tiled=1024, heads=2),
    "rotary_ac_offload_chunked_tiled_heads": dict(ac="full", chunk=1024, sparse=False, offload=True, tiled=1024,
                                                  heads=2, position="rotary"),
}
GIB = 2**30


def gpt_kwargs(args) -> dict:
    if args.cpu_smoke:
        return dict(vocab_size=512, n_layer=2, n_head=4, d_model=64)
    return dict(vocab_size=32000, n_layer=16, n_head=16, d_model=2048)


def n_params(kw: dict, length: int) -> int:
    d, L, v = kw["d_model"], kw["n_layer"], kw["vocab_size"]
    return 2 * v * d + length * d + L * (12 * d * d + 13 * d) + 2 * d


def flops_per_token(kw: dict, length: int) -> float:
    d, L, v = kw["d_model"], kw["n_layer"], kw["vocab_size"]
    return 6.0 * (12 * L * d * d + v * d) + 12.0 * L * d * length


def one_step(args, name: str, length: int, topo, device, timed: bool = False) -> Tuple[Optional[int], float]:
    """(peak bytes or None when out of memory, seconds of the step)."""
    import torch

    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import GPT, GPTConfig
    from lightning_scale.parallelize import parallelize

    spec = SYSTEMS[name]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = pm = engine = None
    try:
        cfg = GPTConfig(seq_len=length, loss_chunk=spec["chunk"], position=spec.get("position", "learned"),
                        **gpt_kwargs(args))
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        if spec["sparse"]:
            from lightning_scale.nn import BSLongformerSparsityConfig, swap_gpt_attention

            layout = BSLongformerSparsityConfig(num_heads=cfg.n_head, block=64, num_sliding_window_blocks=3,
                                                global_block_indices=(0,))
            swap_gpt_attention(model, layout)
        config = from_flat_kwargs(stage=0, activation_checkpointing=spec["ac"],
                                  offload_activations=spec.get("offload", False), tiled_mlp=spec.get("tiled", 0),
                                  tiled_attention=spec.get("heads", 0))
        pm = parallelize(model, config, topo, device, optimizers=lambda m=model: [torch.optim.AdamW(m.parameters())])
        (engine,) = pm.make_engines()
        idx = torch.randint(0, cfg.vocab_size, (1, length + 1), device=device)
        seconds = 0.0
        for _ in range(2 if timed else 1):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model.loss(idx[:, :-1], idx[:, 1:])
            loss.backward()
            engine.step()
            engine.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return peak, seconds
    except torch.OutOfMemoryError:
        return None, float("nan")
    finally:
        if engine is not None:
            engine.remove_hooks()
        del model, pm, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--start", type=int, default=4096)
    ap.add_argument("--granularity", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=1 << 20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny GPT on the CPU, lengths 256..512 (code check)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200: 989)")
    args = ap.parse_args()
    names = [s for s in args.systems.split(",") if s]
    if any(s not in SYSTEMS for s in names):
        raise SystemExit(f"unknown systems; known: {', '.join(SYSTEMS)}")
    kw = gpt_kwargs(args)
    print(f"# gpu_long_sequence: GPT {kw}, {n_params(kw, 4096) / 1e9:.2f}B parameters at L=4096, bf16 autocast, "
          f"fp32 AdamW, batch 1, 1 rank; systems {names}")
    if args.dry_run:
        for name in names:
            print(f"  {name}: {SYSTEMS[name]}")
        return
    import torch
    import torch.distributed as dist

    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology

    if args.cpu_smoke:
        device, backend = torch.device("cpu"), "gloo"
        args.start, args.granularity, args.max_len = 256, 256, 512
        budget = float("inf")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/gpu_long_sequence.py needs a CUDA GPU; use --dry-run / --cpu-smoke, or "
                             "bench/long_sequence.py on the CPU")
        device, backend = torch.device("cuda", 0), "nccl"
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        budget = args.budget_gib * GIB if args.budget_gib else total - 2 * GIB
    store = os.path.join(tempfile.mkdtemp(prefix="ls_gls_"), "store")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    topo = local_topology(from_flat_kwargs(stage=0), 1, 0)
    rows, base = {}, None
    for name in names:
        probes: Dict[int, Tuple[Optional[int], float]] = {}

        def fits(length: int) -> bool:
            probes[length] = one_step(args, name, length, topo, device)
            peak, sec = probes[length]
            ok = peak is not None and peak <= budget
            print(f"  {name:18s} L={length:8d}: peak {('OOM' if peak is None else f'{peak / GIB:.2f} GiB'):>10s} "
                  f"step {sec:.2f} s {'fits' if ok else 'over'}", flush=True)
            return ok

        good, bad, length = 0, None, args.start
        while length <= args.max_len and fits(length):
            good, length = length, length * 2
        bad = length if length <= args.max_len else None
        while bad is not None and good and bad - good > args.granularity:
            mid = (good + bad) // 2 // args.granularity * args.granularity
            if mid in (good, bad):
                break
            good, bad = (mid, bad) if fits(mid) else (good, mid)
        rows[name] = {"longest": good, "first_over": bad, "peak_gib": (probes.get(good, (0, 0))[0] or 0) / GIB}
        if name == "dense":
            base = good
    if base:
        for name in names:
            if rows[name]["longest"] >= base:
                _, sec = one_step(args, name, base, topo, device, timed=True)
                rows[name]["tokens_per_s_at_dense_len"] = base / sec
                rows[name]["mfu_at_dense_len"] = base / sec * flops_per_token(kw, base) / (args.peak_tflops * 1e12)
    lines = [f"| system | longest L | x dense | peak GiB | tokens/s at L={base} | MFU at L={base} |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ratio = f"{r['longest'] / base:.2f}" if base else "-"
        tps, mfu = r.get("tokens_per_s_at_dense_len"), r.get("mfu_at_dense_len")
        lines.append(f"| {name} | {r['longest']}{'' if r['first_over'] else ' (>=)'} | {ratio} | "
                     f"{r['peak_gib']:.2f} | {f'{tps:.0f}' if tps else '-'} | {f'{mfu:.1%}' if mfu else '-'} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    with open(os.path.join(args.out, "gpu_long_sequence.json"), "w") as f:
        json.dump({"date": stamp, "model": kw, "budget_bytes": budget, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "gpu_long_sequence.md"), "w") as f:
        f.write(f"# gpu_long_sequence {stamp}\n\n{table}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
