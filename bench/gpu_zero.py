"""ZeRO stage 2/3 and offload on ONE GPU: lightning_scale vs torch DDP, FSDP2 and DeepSpeed (prepared script).

    python bench/gpu_zero.py --dry-run                 # print the plan; works without a GPU
    python bench/gpu_zero.py                           # ~5-8 min on one H100/H200-class GPU; writes $OUT/gpu_zero.{json,md}
    python bench/gpu_zero.py --systems ddp,fsdp2,ls_z3 --steps 10 --out /tmp/gz
    python bench/gpu_zero.py --compile                 # + ddp/fsdp2/ls_z2/ls_z3 with every block compiled (inductor)

The GPU counterpart of ``bench/zero.py`` (same rows, same peers): each row runs in a fresh process
(one rank, NCCL process group of size 1) so ``torch.cuda.max_memory_allocated`` is per system; rows
run in interleaved rounds (order rotated each round). With one rank ZeRO shards nothing: what this
measures is the cost of each engine's machinery (stage 3 gather/free hooks, offload copies and the CPU
optimizer step over PCIe) and the device memory each keeps - offload rows should show the optimizer
state (and, for stage 3 + param offload, the parameters) gone from the device.

Rows (a DeepSpeed row is skipped with the reason when deepspeed is not importable or fails):

    ddp                    torch DDP, AdamW                                          (baseline for ratios)
    fsdp2                  torch fully_shard per block + root, reshard_after_forward=True
    deepspeed_z2/z3        DeepSpeed ZeRO-2/3, torch AdamW
    deepspeed_z2_offload   ZeRO-2 + offload_optimizer cpu (DeepSpeedCPUAdam; JIT build ~1-3 min on first use)
    deepspeed_z3_offload   ZeRO-3 + offload_optimizer + offload_param cpu (DeepSpeedCPUAdam)
    ls_z2, ls_z3           lightning_scale ZeroOptimizer(stage=2) / ShardedParameters + Stage3Optimizer
    ls_z2_offload          ZeroOptimizer(stage=2, offload_optimizer=True)
    ls_z3_offload          Stage3Optimizer(offload_optimizer=True) + ShardedParameters(param_device=cpu)

Peers compared in the output: ls_z3 vs fsdp2 and deepspeed_z3; ls_z2 vs deepspeed_z2; ls_z2_offload vs
deepspeed_z2_offload; ls_z3_offload vs deepspeed_z3_offload (issue 3 targets: >= 1.05x FSDP2, >= 1.2x
DeepSpeed stage 3, offload >= 1.1x DeepSpeed offload). A wall-clock budget (``--budget-s``, default 540)
stops starting new rows so the whole script stays under 10 minutes; skipped rows are listed.
Precision: ``--precision bf16`` (default) runs every system under ``torch.autocast(bfloat16)`` with fp32
parameters and fp32 AdamW (the same numerics everywhere); ``fp32`` uses TF32 matmuls. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSTEMS = ["ddp", "fsdp2", "deepspeed_z2", "deepspeed_z3", "deepspeed_z2_offload", "deepspeed_z3_offload",
           "ls_z2", "ls_z3", "ls_z2_offload", "ls_z3_offload"]
PEERS = {"ls_z3": [("fsdp2", 1.05), ("deepspeed_z3", 1.2)], "ls_z2": [("deepspeed_z2", None)],
         "ls_z2_offload": [("deepspeed_z2_offload", 1.1)], "ls_z3_offload": [("deepspeed_z3_offload", 1.1)],
         # --compile rows (issue 17): every block's forward compiled (inductor), torchtitan style, for all three
         "ls_z2+compile": [("ddp+compile", 0.97)], "ls_z3+compile": [("fsdp2+compile", 1.1)]}
COMPILED = ["ddp+compile", "fsdp2+compile", "ls_z2+compile", "ls_z3+compile"]
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 tensor-core peak, FLOP/s


def _flops_per_token(cfg) -> float:
    """Training FLOPs per token: 6 x parameters + attention's 12 x layers x d_model x seq (PaLM appendix B)."""
    return 6 * cfg.num_params() + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def _adamw(params):
    """torch's default AdamW implementation on CUDA (foreach) for every row; offload rows pick their CPU kernel."""
    import torch

    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _build(system, model, local_batch, device):
    """-> (module, backward(loss), step(), zero_grad())"""
    import torch

    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index])
        opt = _adamw(ddp.parameters())
        return ddp, lambda loss: loss.backward(), opt.step, opt.zero_grad
    if system == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        opt = _adamw(model.parameters())
        return model, lambda loss: loss.backward(), opt.step, opt.zero_grad
    if system.startswith("deepspeed"):
        import deepspeed

        stage = int(system.split("_z")[1][0])
        offload = system.endswith("_offload")
        zero = {"stage": stage}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        config = {"train_micro_batch_size_per_gpu": local_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0, "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        if offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                         adamw_mode=True)
        else:
            optimizer = _adamw(model.parameters())  # DeepSpeed steps flat fp32 partitions itself
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               dist_init_required=False)
        return engine, engine.backward, engine.step, lambda: None
    if system in ("ls_z3", "ls_z3_offload"):
        from lightning_scale.zero.param_shard import ShardedParameters
        from lightning_scale.zero.stage3_optimizer import Stage3Optimizer

        offload = system.endswith("_offload")
        opt = _adamw(model.parameters())  # the engine re-creates it over its shards
        sharded = ShardedParameters(model, [g["params"] for g in opt.param_groups], device=device, prefetch_depth=1,
                                    param_device=torch.device("cpu") if offload else None, pin_memory=offload)
        sharded.shard_model()
        Stage3Optimizer(opt, sharded, offload_optimizer=offload, pin_memory=True)
        return model, lambda loss: loss.backward(), opt.step, opt.zero_grad
    if system in ("ls_z2", "ls_z2_offload"):
        from lightning_scale.zero import ZeroOptimizer

        opt = _adamw(model.parameters())
        zero = ZeroOptimizer(opt, stage=2, offload_optimizer=system.endswith("_offload"))
        return model, lambda loss: loss.backward(), zero.step, zero.zero_grad
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def worker(rank, world, system, model_kw, steps, warmup, batch, precision):
    import contextlib

    import torch
    import torch.distributed as dist

    from lightning_scale.models.gpt import GPT, GPTConfig, lm_loss, make_batch

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if system.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    cfg = GPTConfig(**model_kw)
    system, _, compiled = system.partition("+")
    if system.startswith("ls_z3"):
        with torch.device("meta"):  # deferred init: materialized unit by unit on the device
            model = GPT(cfg)
    else:
        model = GPT(cfg).to(device)
    t0 = time.perf_counter()
    module, backward, step, zero_grad = _build(system, model, batch, device)
    if compiled:  # the warm-up steps absorb the compile time
        from lightning_scale.compile import compile_units

        compile_units(model, True)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats(device)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
    tokens, t_start = 0, None
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            dist.barrier()
            t_start = time.perf_counter()
        x, y = make_batch(cfg, batch, seed=i, device=device)
        with amp:
            logits = module(x)
        loss = lm_loss(logits, y)
        backward(loss)
        step()
        zero_grad()
        if i >= warmup:
            tokens += batch * cfg.seq_len
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t_start
    peak = next((v for k, v in PEAK_BF16.items() if k in torch.cuda.get_device_name(device)), None)
    return {"tokens_per_s": tokens / elapsed, "peak_mem_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "loss": float(loss.detach()), "setup_s": setup_s,
            "mfu": (tokens / elapsed) * _flops_per_token(cfg) / peak if peak and precision == "bf16" else None}


def _plan(args, systems) -> str:
    kw = _model_kw(args)
    from lightning_scale.models.gpt import GPTConfig

    n = GPTConfig(**kw).num_params()
    return (f"plan: {len(systems)} rows x {args.rounds} rounds, each a fresh 1-rank NCCL process: "
            f"{', '.join(systems)}\n"
            f"model: GPT {kw['n_layer']} layers, d {kw['d_model']}, {kw['n_head']} heads, vocab {kw['vocab_size']}, "
            f"seq {kw['seq_len']} ({n / 1e6:.1f}M params); batch {args.batch} ({args.batch * kw['seq_len']} "
            f"tokens/step); {args.warmup} warm-up + {args.steps} timed steps; precision {args.precision}\n"
            f"wall-clock budget {args.budget_s:.0f}s (rows not started after it are listed as skipped); "
            f"per-row timeout {args.timeout:.0f}s; output: {args.out}/gpu_zero.json and gpu_zero.md\n"
            f"peers: " + "; ".join(f"{k} vs {', '.join(p for p, _ in v)}" for k, v in PEERS.items()))


def _model_kw(args):
    return dict(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.d_model // 64,
                d_model=args.d_model)


def _table(rounds, failed, skipped) -> str:
    systems = [s for s in SYSTEMS + COMPILED if any(s in r for r in rounds)]
    lines = ["| system | tokens/s (median) | vs ddp (median, min-max) | MFU (bf16 peak) | peak device MiB "
             "| final loss |",
             "|---|---|---|---|---|---|"]
    for s in systems:
        vals = [r[s]["tokens_per_s"] for r in rounds if s in r]
        ratios = [r[s]["tokens_per_s"] / r["ddp"]["tokens_per_s"] for r in rounds if s in r and "ddp" in r]
        mem = statistics.median(r[s]["peak_mem_mib"] for r in rounds if s in r)
        loss = [r[s]["loss"] for r in rounds if s in r][-1]
        rr = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "n/a"
        mfus = [r[s]["mfu"] for r in rounds if s in r and r[s].get("mfu") is not None]
        mfu = f"{statistics.median(mfus):.1%}" if mfus else "n/a"
        lines.append(f"| {s} | {statistics.median(vals):,.0f} | {rr} | {mfu} | {mem:,.0f} | {loss:.4f} |")
    lines += ["", "| system | peer | ratio vs peer (median) | target | met? | peak MiB system / peer |",
              "|---|---|---|---|---|---|"]
    for s, peers in PEERS.items():
        for p, target in peers:
            both = [r for r in rounds if s in r and p in r]
            if not both:
                why = failed.get(p) or failed.get(s) or ("skipped (budget)" if p in skipped or s in skipped
                                                         else "not run")
                lines.append(f"| {s} | {p} | n/a: {why[:100]} | {target or '-'} | - | - |")
                continue
            med = statistics.median(r[s]["tokens_per_s"] / r[p]["tokens_per_s"] for r in both)
            ms = statistics.median(r[s]["peak_mem_mib"] for r in both)
            mp = statistics.median(r[p]["peak_mem_mib"] for r in both)
            met = "-" if target is None else ("met" if med >= target else "missed")
            lines.append(f"| {s} | {p} | {med:.2f} | {'-' if target is None else f'>= {target}'} | {met} | "
                         f"{ms:,.0f} / {mp:,.0f} |")
    if failed:
        lines += ["", "Failed rows: " + "; ".join(f"{k}: {v[:200]}" for k, v in failed.items())]
    if skipped:
        lines += ["", "Skipped (wall-clock budget): " + ", ".join(sorted(skipped))]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting rows after this many seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per row (DeepSpeedCPUAdam JIT included)")
    ap.add_argument("--compile", action="store_true", help="add the +compile rows (ddp, fsdp2, ls_z2, ls_z3)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_zero_out"))
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.compile:
        systems += [s for s in COMPILED if s not in systems]
    unknown = [s for s in systems if s not in SYSTEMS + COMPILED]
    if unknown:
        print(f"error: --systems {unknown}: known rows are {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    if "ddp" not in systems:
        systems.insert(0, "ddp")
    print(_plan(args, systems), flush=True)
    if args.dry_run:
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: bench/gpu_zero.py needs a CUDA GPU (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}). Use --dry-run to see the plan, or bench/zero.py for the CPU comparison.",
              file=sys.stderr)
        return 2
    from lightning_scale.testing import run_distributed

    failed, skipped, rounds = {}, set(), []
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # noqa: BLE001
        for s in systems:
            if s.startswith("deepspeed"):
                failed[s] = f"deepspeed not importable: {err!r}"
    t_begin = time.perf_counter()
    for r in range(args.rounds):
        results = {}
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            if s in failed:
                continue
            if time.perf_counter() - t_begin > args.budget_s:
                skipped.add(s)
                continue
            try:
                out = run_distributed(worker, 1, (s, _model_kw(args), args.steps, args.warmup, args.batch,
                                                  args.precision), timeout=args.timeout, backend="nccl", threads=4)
            except Exception as err:  # noqa: BLE001 - report and continue
                lines = [t for t in str(err).splitlines() if t.strip()]
                failed[s] = " | ".join(lines[-4:])
                print(f"round {r} {s:22s} FAILED: {failed[s]}", flush=True)
                continue
            results[s] = out[0]
            print(f"round {r} {s:22s} {out[0]['tokens_per_s']:10,.0f} tok/s  peak {out[0]['peak_mem_mib']:8,.0f} MiB  "
                  f"loss {out[0]['loss']:.4f}  setup {out[0]['setup_s']:.1f}s", flush=True)
        rounds.append(results)
    skipped -= {s for r in rounds for s in r}
    rounds = [r for r in rounds if "ddp" in r]
    if not rounds:
        print("error: the ddp baseline did not complete in any round", file=sys.stderr)
        return 1
    header = (f"## ZeRO on one GPU ({datetime.date.today()}, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"{len(rounds)} rounds x {args.steps} steps, precision {args.precision})\n\n")
    md = header + _table(rounds, failed, skipped) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_zero.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "gpu_zero.json"), "w") as f:
        json.dump({"args": vars(args), "rounds": rounds, "failed": failed, "skipped": sorted(skipped),
                   "wall_s": time.perf_counter() - t_begin}, f, indent=1)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
