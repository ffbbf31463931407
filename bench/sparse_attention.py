"""Block-sparse attention on the CPU: lightning_scale vs dense SDPA, masked SDPA and compiled FlexAttention.

    python bench/sparse_attention.py                         # L = 4k, 8k, 16k; Longformer and BigBird at ~10%
    python bench/sparse_attention.py --lengths 1024 2048 --rounds 1 --no-memory   # smoke run

fp32, B=1, H=4, D=64 by default. Per length, every method runs in interleaved rounds (order rotated
per round); the table gives median times and ratios against dense ``scaled_dot_product_attention``
measured in the same rounds:

* ``sdpa``       dense SDPA (torch's fused CPU kernel, O(L) memory)
* ``sdpa+mask``  SDPA with the layout as a boolean (H, L, L) mask (materializes scores; up to --masked-max)
* ``flex``       ``torch.compile(flex_attention)`` with the same BlockMask (forward only: no CPU backward)
* ``ours``       ``lightning_scale.nn.SparseSelfAttention`` (block-gather engine)

Peak extra memory is measured in a fresh subprocess per (method, length, pass): resident memory is
sampled every millisecond around one call (after a warm-up) with glibc's mmap threshold lowered so
freed buffers leave the process. The longest sequence that trains one step under ``--budget-gib`` is
projected from the measured bytes per token (linear-memory methods) or per token^2 (masked SDPA).
Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("LIGHTNING_SCALE_SKIP_REGISTER", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_scale.kernels.block_sparse_attention import expand_layout  # noqa: E402
from lightning_scale.nn import (  # noqa: E402
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    SparseSelfAttention,
    layout_density,
    layout_to_block_mask,
)

METHODS = ("sdpa", "sdpa+mask", "flex", "ours")


def make_config(pattern: str, L: int, heads: int, block: int, density: float, causal: bool):
    """The pattern's window chosen so the layout density is closest to ``density``."""
    nb = L // block
    attention = "unidirectional" if causal else "bidirectional"
    best = None
    for window in range(1, nb + 1, 2):
        if pattern == "longformer":
            cfg = BSLongformerSparsityConfig(heads, block, num_sliding_window_blocks=window, attention=attention)
        else:
            cfg = BigBirdSparsityConfig(heads, block, num_sliding_window_blocks=window, num_random_blocks=2,
                                        attention=attention)
        d = layout_density(cfg.make_layout(L), causal)
        if best is None or abs(d - density) < abs(best[1] - density):
            best = (cfg, d)
        if d > density:
            break
    return best


class Case:
    """Inputs and one callable per (method, pass) for one pattern and length."""

    def __init__(self, args, pattern: str, L: int) -> None:
        self.L, self.causal = L, args.causal
        self.cfg, self.density = make_config(pattern, L, args.heads, args.block, args.density, args.causal)
        g = torch.Generator().manual_seed(0)
        self.qkv = [torch.randn(1, args.heads, L, args.head_dim, generator=g) for _ in range(3)]
        self.ours = SparseSelfAttention(self.cfg, max_seq_length=L, causal=args.causal, backend="torch",
                                        chunk_bytes=(args.chunk_mib << 20) or None)
        self.layout = self.cfg.make_layout(L)
        self._mask = self._flex = None

    def mask(self):
        if self._mask is None:
            self._mask = expand_layout(self.layout, self.cfg.block, self.causal)[None]  # (1, H, L, L) bool
        return self._mask

    def flex(self):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            block_mask = layout_to_block_mask(self.layout, self.cfg.block, causal=self.causal)
            compiled = torch.compile(flex_attention, dynamic=False)
            self._flex = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
        return self._flex

    def call(self, method: str):
        if method == "sdpa":
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        if method == "sdpa+mask":
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask())
        if method == "flex":
            return self.flex()
        return self.ours

    def run(self, method: str, backward: bool) -> None:
        fn = self.call(method)
        if backward:
            q, k, v = (t.detach().requires_grad_() for t in self.qkv)
            fn(q, k, v).sum().backward()
        else:
            with torch.no_grad():
                fn(*self.qkv)


def available(method: str, backward: bool, L: int, args) -> bool:
    if method == "flex":
        return not backward and not args.no_flex
    if method == "sdpa+mask":
        return L <= args.masked_max
    return True


def time_case(case: Case, args) -> dict:
    """Median seconds per (method, pass) over interleaved rounds (one warm-up call each first)."""
    keys = [(m, b) for m in METHODS for b in (False, True) if available(m, b, case.L, args)]
    for m, b in keys:
        case.run(m, b)  # warm-up: compile, plans, allocator
    times = {key: [] for key in keys}
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            start = time.perf_counter()
            case.run(*key)
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(v) for key, v in times.items()}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_memory(args) -> None:
    """Subprocess entry: peak extra resident bytes of one call, printed as JSON."""
    case = Case(args, args.patterns[0], args.child_length)
    backward = args.child_pass == "fwd+bwd"
    case.run(args.child_method, backward)  # warm-up (compile, plans)
    base, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    case.run(args.child_method, backward)
    done.set()
    sampler.join()
    print(json.dumps({"extra": max(peak[0], _rss_bytes()) - base}))


def measure_memory(method: str, L: int, backward: bool, args) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-method", method, "--child-length", str(L),
           "--child-pass", "fwd+bwd" if backward else "fwd", "--patterns", args.patterns[0],
           "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--block", str(args.block),
           "--density", str(args.density), "--chunk-mib", str(args.chunk_mib), "--threads", str(args.threads)]
    if args.causal:
        cmd.append("--causal")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout)
    if run.returncode != 0:
        print(f"  memory child failed for {method} L={L}: {run.stderr.strip().splitlines()[-1:]}", flush=True)
        return float("nan")
    return json.loads(run.stdout.strip().splitlines()[-1])["extra"]


def projected_max_length(method: str, L: int, extra: float, args) -> float:
    """Longest L whose inputs (q, k, v) plus measured extra memory fit ``--budget-gib``."""
    inputs = 3 * args.heads * args.head_dim * 4  # bytes per token of q, k, v
    budget = args.budget_gib * 2**30
    if method == "sdpa+mask":  # dominated by (H, L, L) scores and mask: fit c * L^2
        return math.sqrt(budget / (extra / L**2))
    return budget / (inputs + extra / L)


def fmt_ratio(t: float, base: float) -> str:
    return f"{t:8.3f}s {t / base:5.2f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--patterns", nargs="+", default=["longformer", "bigbird"], choices=["longformer", "bigbird"])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--density", type=float, default=0.10)
    p.add_argument("--causal", action="store_true", help="unidirectional patterns vs causal SDPA")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--chunk-mib", type=int, default=0, help="working-set bound of one chunk of our engine (0: auto)")
    p.add_argument("--masked-max", type=int, default=8192, help="longest L for the masked SDPA (O(L^2) memory)")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--budget-gib", type=float, default=8.0)
    p.add_argument("--child-timeout", type=int, default=900)
    p.add_argument("--child-method", help=argparse.SUPPRESS)
    p.add_argument("--child-length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-pass", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_method:
        return child_memory(args)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, B=1, H={args.heads}, D={args.head_dim}, "
          f"block={args.block}, {'causal' if args.causal else 'bidirectional'}, rounds={args.rounds}", flush=True)
    for pattern in args.patterns:
        print(f"\n## {pattern}: time (median) and ratio to dense SDPA")
        print(f"| L | density | pass | {' | '.join(METHODS)} |")
        print("|---|---|---|" + "---|" * len(METHODS))
        for L in args.lengths:
            case = Case(args, pattern, L)
            times = time_case(case, args)
            for backward in (False, True):
                base = times[("sdpa", backward)]
                cells = [fmt_ratio(times[(m, backward)], base) if (m, backward) in times else "n/a" for m in METHODS]
                print(f"| {L} | {case.density:.3f} | {'fwd+bwd' if backward else 'fwd'} | {' | '.join(cells)} |",
                      flush=True)
            del case
    if args.no_memory:
        return
    print(f"\n## peak extra memory (MiB) and ratio to dense SDPA ({args.patterns[0]}); projected longest "
          f"trainable L under {args.budget_gib:g} GiB")
    print("| L | pass | " + " | ".join(METHODS) + " |")
    print("|---|---|" + "---|" * len(METHODS))
    last = {}
    for L in args.lengths:
        for backward in (False, True):
            mem = {m: measure_memory(m, L, backward, args) for m in METHODS if available(m, backward, L, args)}
            base = mem["sdpa"]
            cells = [f"{mem[m] / 2**20:8.1f} {mem[m] / base:5.2f}x" if m in mem else "n/a" for m in METHODS]
            print(f"| {L} | {'fwd+bwd' if backward else 'fwd'} | {' | '.join(cells)} |", flush=True)
            if backward:
                last.update({m: (L, mem[m]) for m in mem})
    lengths = {m: projected_max_length(m, *last[m], args) for m in last}
    print("\n| method | projected longest L (fwd+bwd) | vs sdpa | vs sdpa+mask |\n|---|---|---|---|")
    for m, n in lengths.items():
        vs_mask = f"{n / lengths['sdpa+mask']:.1f}x" if "sdpa+mask" in lengths else "n/a"
        print(f"| {m} | {n:,.0f} | {n / lengths['sdpa']:.2f}x | {vs_mask} |")


if __name__ == "__main__":
    main()
