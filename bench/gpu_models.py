"""A 1B Llama-shaped Hugging Face model on GPU: lightning_scale zero2 / zero3 / tp / pp vs torch, MFU printed.

    python bench/gpu_models.py --dry-run            # the plan: model, rows, FLOP count (no GPU needed)
    python bench/gpu_models.py                      # every visible GPU, 2 rounds x 10 timed steps
    python bench/gpu_models.py --systems ddp,ls_z3,fsdp2 --steps 5 --out /tmp/gm
    python bench/gpu_models.py --systems ddp,ls_z2,ls_z3,fsdp2 --compile   # + the same rows compiled (inductor)

The GPU counterpart of ``bench/models.py`` (same rows, same peers; the Lightning Trainer rows are left to the CPU
script). The model is an unchanged ``LlamaForCausalLM`` from ``LlamaConfig``: hidden 2048, 16 layers, 32 query /
8 key-value heads, MLP 8192, vocabulary 32000, untied head (1.10B parameters), sdpa attention, fp32 parameters and
AdamW, forward under ``torch.autocast(bfloat16)`` for every row. One rank per GPU (NCCL). Rows: ``ddp``,
``ls_z2``, ``ls_z3`` (dp = all GPUs), ``ls_tp`` (tp = all GPUs, the model's own tp_plan), ``ls_pp`` (pp = all
GPUs, 1F1B, 4 micro-batches), ``fsdp2`` (fully_shard per layer + root), ``dtensor_tp`` (torchtitan's plan);
the tp / pp rows need >= 2 GPUs and are skipped with the reason on one. ``--compile`` adds a "+compile" row per row:
every decoder layer's forward compiled with inductor (lightning_scale rows: ``compile=True`` through ``parallelize``;
ddp / fsdp2 / dtensor_tp: ``lightning_scale.compile.compile_units`` on the layers before wrapping, torchtitan's
order), compared with the peer at the same setting (issue 17: ls_z2 >= 0.97x ddp, ls_z3 >= 1.1x fsdp2); the warm-up
steps absorb the compile, and the graphs each compiled row built are printed (0 would mean it ran eagerly).

MFU = tokens/s x FLOPs per token / (world x 989e12), the H200's dense bf16 peak (``--peak-tflops`` to change);
FLOPs per token = 6 x (parameters outside the input embedding) + 12 x layers x hidden x seq (attention scores
and values, forward + backward; PaLM's count). ``$OUT/gpu_models.{json,md}`` get the table. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SYSTEMS = ["ddp", "ls_z2", "ls_z3", "ls_tp", "ls_pp", "fsdp2", "dtensor_tp"]
PEERS = {"ls_z3": ("fsdp2", 1.05), "ls_tp": ("dtensor_tp", 1.3), "ls_z2": ("ddp", None),
         "ls_z2+compile": ("ddp+compile", 0.97), "ls_z3+compile": ("fsdp2+compile", 1.1),
         "ls_tp+compile": ("dtensor_tp+compile", None), "ls_pp+compile": ("ls_pp", None)}
MODEL = dict(vocab=32000, hidden=2048, mlp=8192, layers=16, heads=32, kv_heads=8)


def flops_per_token(kw: dict) -> float:
    h, L, kv = kw["hidden"], kw["layers"], kw["hidden"] * kw["kv_heads"] // kw["heads"]
    matmul_params = L * (2 * h * h + 2 * h * kv + 3 * h * kw["mlp"]) + kw["vocab"] * h  # + lm_head; no lookup
    return 6.0 * matmul_params + 12.0 * L * h * kw["seq"]


def n_params(kw: dict) -> int:
    h, L, kv = kw["hidden"], kw["layers"], kw["hidden"] * kw["kv_heads"] // kw["heads"]
    return 2 * kw["vocab"] * h + L * (2 * h * h + 2 * h * kv + 3 * h * kw["mlp"] + 2 * h) + h


def _layout(system: str, world: int):
    return {"ls_z2": dict(stage=2), "ls_z3": dict(stage=3), "ls_tp": dict(tp=world, stage=1),
            "ls_pp": dict(pp=world, stage=1, microbatches=4)}.get(system)


def _step_fn(system: str, model, rank: int, world: int, device):
    """step(x, y) -> loss (global batch) for one row; x, y: the global batch on ``device``."""
    import torch
    import torch.distributed as dist
    from models import _dtensor_plan, _fsdp2, _loss

    from lightning_scale.compile import compile_units

    system, _, compiled = system.partition("+")
    compile_layers = (lambda: compile_units(model, True)) if compiled else (lambda: None)  # noqa: E731
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    if _layout(system, world) is not None:
        import lightning_scale.models  # noqa: F401  (registers the HF pipeline adapter)
        from lightning_scale.config import from_flat_kwargs
        from lightning_scale.parallelize import local_topology, parallelize

        config = from_flat_kwargs(**_layout(system, world), **({"compile": True} if compiled else {}))
        topo = local_topology(config, world, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pm = parallelize(model, config, topo, device, optimizers=[opt], loss_fn=_loss)
        (engine,) = pm.make_engines()

        def step(x, y):
            with autocast():
                if pm.pipeline is not None:
                    with engine.no_sync():
                        loss = pm.pipeline.runtime.train_step(x, y)
                else:
                    x, y = x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank]
                    loss = _loss(model(input_ids=x).logits.float(), y)
            if pm.pipeline is None:
                loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    if system == "dtensor_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        _dtensor_plan(model.to(device), init_device_mesh("cuda", (world,)))
        compile_layers()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x, y):
            with loss_parallel():
                with autocast():
                    logits = model(input_ids=x).logits
                loss = _loss(logits.float(), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.full_tensor().detach()
        return step
    model.to(device)
    compile_layers()
    if system == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        _fsdp2(model)
        module = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        with autocast():
            loss = _loss(module(input_ids=x).logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss / world
    return step


def worker(rank: int, world: int, system: str, kw: dict, batch: int, warmup: int, steps: int) -> dict:
    import torch
    from models import build_llama

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(1)
    step = _step_fn(system, build_llama(kw), rank, world, device)
    torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(warmup + steps):
        ids = torch.randint(0, kw["vocab"], (batch, kw["seq"] + 1), generator=g).to(device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(float(step(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())))  # float() syncs
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[warmup:]), "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "loss0": losses[0], "loss": losses[-1],
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) if "+" in system else None}


def _plan(args, kw, systems, world) -> str:
    fpt = flops_per_token(kw)
    lines = [f"gpu_models plan: LlamaForCausalLM {n_params(kw) / 1e9:.2f}B params (hidden {kw['hidden']}, "
             f"{kw['layers']} layers, {kw['heads']}/{kw['kv_heads']} heads, MLP {kw['mlp']}, vocab {kw['vocab']}, "
             f"untied), seq {kw['seq']}, global batch {args.batch} ({args.batch * kw['seq']} tokens/step)",
             f"  world {world} GPU(s) (one rank each, NCCL); bf16 autocast, fp32 params + AdamW",
             f"  FLOPs/token {fpt / 1e9:.2f} GFLOP (6N + 12 L h T); MFU peak {args.peak_tflops:g} TFLOP/s per GPU",
             f"  rows: {', '.join(systems)}; {args.rounds} rounds x ({args.warmup} warmup + {args.steps} timed) steps, "
             f"order rotated per round",
             "  peers: " + ", ".join(f"{s} vs {p}" + (f" (>= {t}x)" if t else "") for s, (p, t) in PEERS.items()),
             f"  output: {args.out}/gpu_models.json, .md"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global sequences per step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=MODEL["layers"])
    ap.add_argument("--world", type=int, default=0, help="GPUs to use (0: all visible)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H200: 989)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--compile", action="store_true", help="add a +compile row (inductor, per layer) for every row")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_models_out"))
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if [s for s in systems if s.partition("+")[0] not in SYSTEMS or s.partition("+")[2] not in ("", "compile")]:
        print(f"error: --systems: known rows are {', '.join(SYSTEMS)} (each also as ROW+compile)", file=sys.stderr)
        return 2
    if args.compile:
        systems = list(dict.fromkeys(systems + [f"{s}+compile" for s in systems if "+" not in s]))
    kw = dict(MODEL, layers=args.layers, seq=args.seq)
    import torch

    world = args.world or max(torch.cuda.device_count(), 1)
    print(_plan(args, kw, systems, world), flush=True)
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("error: bench/gpu_models.py needs a CUDA GPU; use --dry-run, or bench/models.py on CPU", file=sys.stderr)
        return 2
    from lightning_scale.testing import run_distributed

    failed, rounds = {}, []
    for s in systems:
        if s.partition("+")[0] in ("ls_tp", "ls_pp", "dtensor_tp") and world < 2:
            failed[s] = "needs >= 2 GPUs"
    for r in range(args.rounds):
        results = {}
        for s in systems[r % len(systems):] + systems[:r % len(systems)]:
            if s in failed:
                continue
            try:
                out = run_distributed(worker, world, (s, kw, args.batch, args.warmup, args.steps),
                                      timeout=args.timeout, backend="nccl", threads=4)
            except Exception as err:  # noqa: BLE001 - report and continue
                failed[s] = " | ".join([t for t in str(err).splitlines() if t.strip()][-3:])
                print(f"round {r} {s:12s} FAILED: {failed[s]}", flush=True)
                continue
            tps = args.batch * kw["seq"] / max(o["step_s"] for o in out)
            results[s] = {"tokens_per_s": tps, "mfu": tps * flops_per_token(kw) / (world * args.peak_tflops * 1e12),
                          "peak_gib": max(o["peak_gib"] for o in out), "loss0": out[0]["loss0"],
                          "loss": out[0]["loss"], "graphs": out[0]["graphs"]}
            print(f"round {r} {s:18s} {tps:9.0f} tok/s  MFU {results[s]['mfu']:.1%}  peak "
                  f"{results[s]['peak_gib']:.1f} GiB  loss {results[s]['loss0']:.4f} -> {results[s]['loss']:.4f}"
                  + (f"  graphs {results[s]['graphs']}" if results[s]["graphs"] is not None else ""), flush=True)
        rounds.append(results)
    table = _table(rounds, systems, failed, kw, world, args)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_models.json"), "w") as f:
        json.dump({"rounds": rounds, "failed": failed, "model": kw, "world": world}, f, indent=1)
    with open(os.path.join(args.out, "gpu_models.md"), "w") as f:
        f.write(table + "\n")
    return 0


def _table(rounds, systems, failed, kw, world, args) -> str:
    med = lambda s, k: statistics.median(r[s][k] for r in rounds if s in r)  # noqa: E731
    ran = [s for s in systems if any(s in r for r in rounds)]
    lines = [f"## gpu_models ({datetime.date.today()}): Llama {n_params(kw) / 1e9:.2f}B, {world} GPU(s), seq "
             f"{kw['seq']}, {args.batch * kw['seq']} tokens/step, bf16 autocast, {args.rounds} rounds", "",
             "| system | tokens/s | MFU | peak GiB/rank | ratio vs peer (target) |", "|---|---|---|---|---|"]
    for s in ran:
        peer, target = PEERS.get(s, (None, None))
        both = [r for r in rounds if s in r and peer in r]
        vs = (f"{statistics.median(r[s]['tokens_per_s'] / r[peer]['tokens_per_s'] for r in both):.2f}x {peer}"
              + (f" (>= {target})" if target else "")) if both else "-"
        lines.append(f"| {s} | {med(s, 'tokens_per_s'):,.0f} | {med(s, 'mfu'):.1%} | {med(s, 'peak_gib'):.1f} | {vs} |")
    lines += [f"- {s}: not run ({why})" for s, why in failed.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
