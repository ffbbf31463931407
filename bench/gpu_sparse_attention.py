"""Block-sparse attention on one GPU: our fused Triton kernels vs compiled FlexAttention and dense SDPA.

    python bench/gpu_sparse_attention.py                        # bf16, D 64/128, L 4k/16k/64k, 5 densities
    python bench/gpu_sparse_attention.py --lengths 4096 --head-dims 64 --densities 0.1 --rounds 1   # quick

Prepared for a GPU run (needs CUDA; prints the reason and exits otherwise). For every (D, L, density)
the same layout (sliding window + one global block, ``--block`` tokens, bidirectional unless
``--causal``) runs through

* ``ours``   ``triton_block_sparse_attention`` (index built once, cached like the module does)
* ``flex``   ``torch.compile(flex_attention)`` with the same ``BlockMask`` (forward and backward)
* ``sdpa``   dense ``scaled_dot_product_attention`` restricted to the FlashAttention backend

in interleaved rounds (CUDA events, median). Columns: milliseconds, ratio ours/flex (target <= 1),
ratio ours/sdpa against the target (1.25 * density + 0.02), and effective TFLOP/s (useful flops:
4 * pairs * D forward, 10 * pairs * D backward, pairs = attended (query, key) pairs). A first check
compares ours with FlexAttention numerically. Never asserts on time.

``--device cpu`` runs the same code on tiny shapes with the kernels in Triton's interpreter (a smoke
test of the script, not a measurement)::

    python bench/gpu_sparse_attention.py --device cpu --lengths 256 --head-dims 64 --densities 0.5 \
        --heads 2 --block 64 --rounds 1 --iters 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("LIGHTNING_SCALE_SKIP_REGISTER", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_scale.kernels.block_sparse_attention import build_block_index, causal_layout, index_to  # noqa: E402
from lightning_scale.nn import BSLongformerSparsityConfig, DenseSparsityConfig, layout_to_block_mask  # noqa: E402


def make_layout(L: int, heads: int, block: int, density: float, causal: bool) -> torch.Tensor:
    """Sliding window + global block 0 with the window that brings the density closest to the target."""
    if density >= 1.0:
        return DenseSparsityConfig(heads, block).make_layout(L)
    nb, best = L // block, None
    for window in range(1, 2 * nb, 2):
        layout = BSLongformerSparsityConfig(heads, block, num_sliding_window_blocks=window).make_layout(L)
        d = float(causal_layout(layout, causal).float().mean()) / (0.5 if causal else 1.0)
        if best is None or abs(d - density) < abs(best[1] - density):
            best = (layout, d)
        if d > density:
            break
    return best[0]


def attended_pairs(layout: torch.Tensor, block: int, causal: bool) -> float:
    """(query, key) pairs computed, summed over heads (diagonal blocks count half when causal)."""
    fine = causal_layout(layout, causal)
    if not causal:
        return float(fine.sum()) * block * block
    diag = fine.diagonal(dim1=1, dim2=2).sum()
    return float(fine.sum() - diag) * block * block + float(diag) * block * (block + 1) / 2


class Methods:
    def __init__(self, args, layout: torch.Tensor, L: int, D: int) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        from lightning_scale.kernels.block_sparse_attention.launch import triton_block_sparse_attention

        self.causal = args.causal
        tile = max(64, args.block)
        self.index = index_to(build_block_index(layout, args.block, L, tile, args.causal), args.device)
        self.block_mask = layout_to_block_mask(layout, args.block, causal=args.causal, device=args.device)
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.ours_fn = triton_block_sparse_attention
        self.options = args.kernel_options

    def run(self, name: str, q, k, v):
        if name == "ours":
            return self.ours_fn(q, k, v, self.index, kernel_options=self.options)
        if name == "flex":
            return self.flex(q, k, v, block_mask=self.block_mask)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def cuda_time(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls (CUDA events; a wall clock on the CPU)."""
    times = []
    if not torch.cuda.is_available():
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(args) -> None:
    """Numbers first: ours vs FlexAttention (fp32 reference of the same mask) at a small length."""
    L, heads = min(2048, max(args.lengths)), args.heads
    for D in args.head_dims:
        layout = make_layout(L, heads, args.block, 0.25, args.causal)
        methods = Methods(args, layout, L, D)
        g = torch.Generator(device=args.device).manual_seed(0)
        q, k, v = (torch.randn(args.batch, heads, L, D, device=args.device, generator=g) for _ in range(3))
        ref = methods.run("flex", q, k, v)
        qb, kb, vb = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
        out = methods.run("ours", qb, kb, vb)
        out.float().square().sum().backward()
        err = (out.float() - ref).abs().max().item()
        finite = all(bool(torch.isfinite(t.grad).all()) for t in (qb, kb, vb))
        print(f"check D={D}: max |ours(bf16) - flex(fp32)| = {err:.3e}, grads finite: {finite}", flush=True)


def bench_case(args, L: int, D: int, density: float) -> dict:
    layout = make_layout(L, args.heads, args.block, density, args.causal)
    methods = Methods(args, layout, L, D)
    g = torch.Generator(device=args.device).manual_seed(0)
    qkv = [torch.randn(args.batch, args.heads, L, D, device=args.device, generator=g).to(torch.bfloat16)
           for _ in range(3)]
    grads = [t.detach().clone().requires_grad_() for t in qkv]
    dout = torch.randn_like(qkv[0])

    def fwd(name):
        with torch.no_grad():
            methods.run(name, *qkv)

    def fwd_bwd(name):
        methods.run(name, *grads).backward(dout)

    keys = [(name, p) for name in ("ours", "flex", "sdpa") for p in ("fwd", "fwd+bwd")
            if not (name == "flex" and p == "fwd+bwd" and args.device == "cpu")]  # no CPU flex backward
    calls = {(n, "fwd"): (lambda n=n: fwd(n)) for n in ("ours", "flex", "sdpa")}
    calls.update({(n, "fwd+bwd"): (lambda n=n: fwd_bwd(n)) for n in ("ours", "flex", "sdpa")})
    for key in keys:  # warm-up: compile, autotune, allocator
        calls[key]()
        calls[key]()
    times = {key: [] for key in keys}
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            times[key].append(cuda_time(calls[key], args.iters))
    pairs = attended_pairs(layout, args.block, args.causal) * args.batch
    dense_pairs = args.batch * args.heads * L * (L + 1) / 2 if args.causal else args.batch * args.heads * L * L
    real_density = pairs / dense_pairs
    result = {"L": L, "D": D, "density": real_density}
    for p, flops_per_pair in (("fwd", 4 * D), ("fwd+bwd", 14 * D)):
        ms = {n: statistics.median(times[(n, p)]) if (n, p) in times else float("nan")
              for n in ("ours", "flex", "sdpa")}
        result[p] = ms
        result[p + "_tflops"] = {n: (dense_pairs if n == "sdpa" else pairs) * flops_per_pair / (ms[n] * 1e9)
                                 for n in ms}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1, 0.05])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warps", type=int, default=None, help="override num_warps of our kernels")
    p.add_argument("--stages", type=int, default=None, help="override num_stages of our kernels")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: interpreter smoke test")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_sparse_attention.py needs a CUDA GPU (or --device cpu for a smoke test); nothing to do.")
        return
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported (lazily, in Methods)
    args.kernel_options = {k: v for k, v in (("num_warps", args.warps), ("num_stages", args.stages)) if v}
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter smoke test)"
    print(f"{name}, torch {torch.__version__}, bf16, B={args.batch}, H={args.heads}, "
          f"block={args.block}, {'causal' if args.causal else 'bidirectional'}, rounds={args.rounds}x{args.iters}")
    check(args)
    print("\n| D | L | density | pass | ours ms | flex ms | sdpa ms | ours/flex (<=1) | ours/sdpa | target "
          "| ours TF/s | flex TF/s | sdpa TF/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for D in args.head_dims:
        for L in args.lengths:
            for density in args.densities:
                r = bench_case(args, L, D, density)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                target = 1.25 * r["density"] + 0.02
                for pas in ("fwd", "fwd+bwd"):
                    ms, tf = r[pas], r[pas + "_tflops"]
                    vs_flex, vs_sdpa = ms["ours"] / ms["flex"], ms["ours"] / ms["sdpa"]
                    mark = "ok" if vs_flex <= 1 and vs_sdpa <= target else "MISS"
                    print(f"| {D} | {L} | {r['density']:.3f} | {pas} | {ms['ours']:.3f} | {ms['flex']:.3f} | "
                          f"{ms['sdpa']:.3f} | {vs_flex:.2f} | {vs_sdpa:.3f} | {target:.3f} {mark} | "
                          f"{tf['ours']:.0f} | {tf['flex']:.0f} | {tf['sdpa']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
