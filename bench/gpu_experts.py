"""One tp rank's mixture-of-experts work on one GPU: every expert split over tp vs the experts placed whole.

    python bench/gpu_experts.py                        # Mixtral-8x7B and DeepSeek-V3 layer shapes, tp 2 / 4 / 8, bf16
    python bench/gpu_experts.py --device cpu --preset tiny --reps 2   # the same code on CPU (a smoke run)
    python bench/gpu_experts.py --llama4 scout          # + Llama 4's MoE layer: transformers' dense path vs routed
    python bench/gpu_experts.py --litgpt qwen3_30b      # + litgpt's LLaMAMoE: its own expert loop vs the routed list

At tp = N a rank of ``Zero3DStrategy(tp=N)`` holds 1 / N of every expert (style ``experts``: all E experts at width
I / N, every route of every token), and with ``expert_parallel=True`` N-th of the experts whole (E / N experts at
width I, the routes to them: about k / N per token, gathered one per row). The FLOPs are the same; the difference is
the GEMM shapes (I / N-wide slices against whole experts), the loop or grouped launch over E vs E / N experts, and the
routing's gather. Both layouts end in one all-reduce of the layer's output, the same size, so one GPU measures what
differs: this script runs rank 0's share of one experts layer through the package's own code paths
(``tensor_parallel.experts.split_experts`` and ``tensor_parallel.expert_parallel.place_experts`` with a group of one,
so their region entry / exit are identities) and transformers' ``grouped_mm`` experts (``--impl``), forward +
backward, tokens routed uniformly at random (top-k of a random router's logits; the busiest rank of a real router
sets the pace, not modelled here). Prints ms per layer for each, the ratio split / placed (> 1: placing is faster)
and the achieved TFLOP/s (6 x routes x 3 x H x I per rank / time). Needs no process group; nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

# (hidden H, expert width I, experts E, routes per token k, tokens T)
PRESETS = {"mixtral_8x7b": (4096, 14336, 8, 2, 8192), "deepseek_v3": (7168, 2048, 256, 8, 8192),
           "tiny": (64, 96, 8, 2, 256)}


def _experts(h: int, i: int, e: int, impl: str):
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        module = MixtralExperts(cfg)
    return module


def _materialize(module, dtype, device):
    import torch

    module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module.to(dtype)


def _layout(kind: str, h, i, e, tp, impl, dtype, device):
    from lightning_scale.tensor_parallel import expert_parallel, experts

    module = _experts(h, i, e, impl)
    if kind == "split":
        handles = experts.split_experts("e", module, experts.expert_specs("e", module, tp), None)
    else:
        handles = expert_parallel.place_experts("e", module, expert_parallel.placed_specs("e", module, tp), None)
    return _materialize(module, dtype, device), handles


def _time(module, hidden, index, weights, reps: int, sync) -> float:
    times = []
    for r in range(reps + 1):  # the first: warm-up
        x = hidden.detach().requires_grad_(True)
        w = weights.detach().requires_grad_(True)
        sync()
        t0 = time.perf_counter()
        out = module(x, index, w)
        out.float().square().mean().backward()
        sync()
        if r:
            times.append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=True)
    return statistics.median(times)


# Llama 4 (H, I, E, top-k, tokens): Scout's MoE layer (16 experts, top-1, a shared expert)
LLAMA4 = {"scout": (5120, 8192, 16, 1, 8192), "tiny": (64, 96, 16, 1, 256)}
# litgpt's LLaMAMoE: (hidden H, expert width I, experts E, top-k, tokens T): Qwen3-30B-A3B's and Mixtral-8x7B's layers
LITGPT = {"qwen3_30b": (2048, 768, 128, 8, 8192), "mixtral_8x7b": (4096, 14336, 8, 2, 4096), "tiny": (64, 96, 16, 2, 256)}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # bf16 dense (the anchor); other devices: MFU not printed


def _layer_times(models: dict, run, x, reps: int, sync, device, what: str) -> dict:
    """``{name: median seconds}`` of ``run(model, x)`` forward + backward for each of ``models`` (the first of
    ``reps + 1`` runs untimed); an error (an OOM) is reported and gives NaN."""
    import torch

    row = {}
    for name, m in models.items():
        times = []
        try:
            for r in range(reps + 1):
                xi = x.detach().requires_grad_(True)
                sync()
                t0 = time.perf_counter()
                run(m, xi).float().square().mean().backward()
                sync()
                if r:
                    times.append(time.perf_counter() - t0)
                m.zero_grad(set_to_none=True)
            row[name] = statistics.median(times)
        except Exception as err:  # noqa: BLE001 - an OOM: report, keep going
            row[name] = float("nan")
            print(f"  {what} {name}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def llama4(preset: str, device, dtype, reps: int, sync) -> None:
    """transformers' Llama4TextMoe (every expert on every token) vs the same layer routed by the package
    (tensor_parallel/routed_experts.py: each token its top-k experts), forward + backward of one layer; the useful
    FLOPs are the routed ones (k routes per token + the shared expert)."""
    import copy

    import torch
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    from lightning_scale.tensor_parallel.routed_experts import route_experts

    h, i, e, k, t = LLAMA4[preset]
    cfg = Llama4TextConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k)
    torch.manual_seed(0)
    dense = torch.nn.ModuleDict({"moe": Llama4TextMoe(cfg)})
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.02)
    dense = dense.to(device=device, dtype=dtype)
    routed = copy.deepcopy(dense)
    route_experts(routed)
    x = torch.randn(t, h, device=device, dtype=dtype)
    row = _layer_times({"dense": dense, "routed": routed}, lambda m, xi: m["moe"](xi)[0], x, reps, sync, device,
                       f"llama4 {preset}")
    flops = 6.0 * t * (k + 1) * 3 * h * i  # routed experts + the shared expert, forward + backward
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = next((v for key, v in PEAK_TFLOPS.items() if key in gpu), None)
    mfu = {n: (f"{flops / v / 1e12 / peak:.1%}" if peak else "-") for n, v in row.items()}
    print(f"| llama4 {preset} ({h}, {i}, {e}, {k}, {t}) | {row['dense'] * 1e3:.2f} | {row['routed'] * 1e3:.2f} | "
          f"{row['dense'] / row['routed']:.2f} | {flops / row['routed'] / 1e12:.1f} | {mfu['routed']} |", flush=True)


def litgpt_moe(preset: str, device, dtype, reps: int, sync) -> None:
    """litgpt's ``LLaMAMoE`` as litgpt runs it (a loop over every expert, a ``torch.where`` of its tokens each: one
    host sync per expert) vs the same block routed by the package (``tensor_parallel/expert_lists.py``: the routes
    sorted by expert once, one host read of the counts), forward + backward of one layer, the same values (the routed
    block is litgpt's bit for bit on CPU). The placed layouts (ep / tp ``expert_parallel``) run the routed one."""
    import copy

    import torch
    from litgpt import Config
    from litgpt.model import LLaMAMoE

    from lightning_scale.tensor_parallel.expert_lists import route_blocks

    h, i, e, k, t = LITGPT[preset]
    cfg = Config(n_embd=h, n_head=max(1, h // 128), mlp_class_name="LLaMAMoE", intermediate_size=i,
                 moe_intermediate_size=i, n_expert=e, n_expert_per_token=k, bias=False)
    torch.manual_seed(0)
    plain = torch.nn.ModuleDict({"moe": LLaMAMoE(cfg)})
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.02)
    plain = plain.to(device=device, dtype=dtype)
    routed = copy.deepcopy(plain)
    route_blocks(routed)
    x = torch.randn(1, t, h, device=device, dtype=dtype)
    row = _layer_times({"litgpt": plain, "routed": routed}, lambda m, xi: m["moe"](xi), x, reps, sync, device,
                       f"litgpt {preset}")
    flops = 6.0 * t * k * 3 * h * i  # the routed experts, forward + backward
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = next((v for key, v in PEAK_TFLOPS.items() if key in gpu), None)
    mfu = {n: (f"{flops / v / 1e12 / peak:.1%}" if peak else "-") for n, v in row.items()}
    print(f"| litgpt {preset} ({h}, {i}, {e}, {k}, {t}) | {row['litgpt'] * 1e3:.2f} | {row['routed'] * 1e3:.2f} | "
          f"{row['litgpt'] / row['routed']:.2f} | {flops / row['routed'] / 1e12:.1f} | {mfu['litgpt']} | "
          f"{mfu['routed']} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["mixtral_8x7b", "deepseek_v3"], choices=sorted(PRESETS))
    ap.add_argument("--tp", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--impl", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per layer call (default: the preset's)")
    ap.add_argument("--llama4", nargs="*", default=None, choices=sorted(LLAMA4),
                    help="also time Llama 4's MoE layer, transformers' dense path vs routed (default preset: scout)")
    ap.add_argument("--litgpt", nargs="*", default=None, choices=sorted(LITGPT),
                    help="also time litgpt's LLaMAMoE, its own loop vs the routed list (default preset: qwen3_30b)")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --device cpu --preset tiny for a smoke run", file=sys.stderr)
        return 2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    print("| layer (H, I, E, top-k, tokens) | tp | split ms | placed ms | split / placed | split TFLOP/s | "
          "placed TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.preset:
        h, i, e, k, t = PRESETS[name]
        t = args.tokens or t
        hidden = torch.randn(t, h, device=device, dtype=dtype)
        logits = torch.randn(t, e, device=device)
        weights, index = torch.topk(logits.softmax(-1), k)
        weights = weights.to(dtype)
        for tp in args.tp:
            if e % tp or i % tp:
                print(f"| {name} ({h}, {i}, {e}, {k}, {t}) | {tp} | tp does not divide E or I | | | | |")
                continue
            row = {}
            for kind in ("split", "placed"):
                module, _ = _layout(kind, h, i, e, tp, args.impl, dtype, device)
                try:
                    row[kind] = _time(module, hidden, index, weights, args.reps, sync)
                except Exception as err:  # noqa: BLE001 - an OOM or a kernel refusal: report, keep going
                    row[kind] = float("nan")
                    print(f"  {name} tp={tp} {kind}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                del module
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            flops = 6.0 * t * k * 3 * h * i / tp  # forward + backward of this rank's share of the routes' GEMMs
            tf = {kk: flops / v / 1e12 for kk, v in row.items()}
            print(f"| {name} ({h}, {i}, {e}, {k}, {t}) | {tp} | {row['split'] * 1e3:.2f} | "
                  f"{row['placed'] * 1e3:.2f} | {row['split'] / row['placed']:.2f} | {tf['split']:.1f} | "
                  f"{tf['placed']:.1f} |", flush=True)
    if args.llama4 is not None:
        print("\n| Llama 4 MoE layer (H, I, E, top-k, tokens) | dense ms | routed ms | dense / routed | routed TFLOP/s | "
              "routed MFU |")
        print("|---|---|---|---|---|---|")
        for preset in args.llama4 or ["scout"]:
            llama4(preset, device, dtype, args.reps, sync)
    if args.litgpt is not None:
        print("\n| litgpt LLaMAMoE layer (H, I, E, top-k, tokens) | litgpt ms | routed ms | litgpt / routed | routed "
              "TFLOP/s | litgpt MFU | routed MFU |")
        print("|---|---|---|---|---|---|---|")
        for preset in args.litgpt or ["qwen3_30b"]:
            litgpt_moe(preset, device, dtype, args.reps, sync)
    return 0


if __name__ == "__main__":
    sys.exit(main())
