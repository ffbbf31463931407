"""ZeRO stages 0-2 vs torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, on the project GPT, 2 CPU ranks.

    python bench/zero.py                     # 3 interleaved rounds, prints a markdown table of ratios to DDP
    python bench/zero.py --rounds 5 --steps 30 --systems ddp,ls_z2,deepspeed_z2

Each (round, system) runs in fresh processes (peak RSS is per process). Every system trains the same GPT
(4 layers, d 256, 4 heads, vocab 8192, seq 128: 7.4M parameters) with AdamW on 1024 tokens per step,
one thread per rank, gloo. DeepSpeed rows appear when ``deepspeed`` is importable (``pip install
lightning-scale[bench]``; it runs on CPU with DS_ACCELERATOR=cpu). Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import live_tensor_mb, peak_rss_mb, ratio_table  # noqa: E402

from lightning_scale.models.gpt import GPT, gpt_small, lm_loss, make_batch  # noqa: E402
from lightning_scale.testing import run_distributed  # noqa: E402

ALL = ["ddp", "zero_redundancy", "fsdp2", "fsdp2_noreshard", "deepspeed_z1", "deepspeed_z2",
       "ls_z0", "ls_z1", "ls_z2"]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _build(system: str, model: torch.nn.Module, local_batch: int):
    """-> (module to call, step(), zero_grad())"""
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = _adamw(ddp.parameters())
        return ddp, opt.step, opt.zero_grad
    if system == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                      betas=(0.9, 0.95), weight_decay=0.1)
        return ddp, opt.step, opt.zero_grad
    if system.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = system == "fsdp2"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = _adamw(model.parameters())
        return model, opt.step, opt.zero_grad
    if system.startswith("deepspeed"):
        import deepspeed

        stage = int(system[-1])
        config = {"train_micro_batch_size_per_gpu": local_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0, "zero_optimization": {"stage": stage}, "zero_force_ds_cpu_optimizer": False,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters()), config=config,
                                                 dist_init_required=False)
        return engine, engine.step, lambda: None
    if system.startswith("ls_z"):
        from lightning_scale.zero import ZeroOptimizer

        opt = _adamw(model.parameters())
        zero = ZeroOptimizer(opt, stage=int(system[-1]))
        return model, zero.step, zero.zero_grad
    raise ValueError(f"unknown system {system!r}; known: {', '.join(ALL)}")


def worker(rank: int, world: int, system: str, steps: int, warmup: int, global_batch: int):
    if system.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = gpt_small()
    model = GPT(cfg)
    local = global_batch // world
    module, step, zero_grad = _build(system, model, local)
    tokens = 0
    t0 = None
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = make_batch(cfg, global_batch, seed=i)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        loss = lm_loss(module(x), y)
        if system.startswith("deepspeed"):
            module.backward(loss)
        else:
            loss.backward()
        step()
        if i == warmup + steps - 1:
            state_mb = live_tensor_mb()
        zero_grad()
        if i >= warmup:
            tokens += global_batch * cfg.seq_len
    dist.barrier()
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": tokens / elapsed, "state_mb": state_mb, "peak_rss_mb": peak_rss_mb(),
            "loss": float(loss)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--systems", default=",".join(ALL))
    args = ap.parse_args()
    systems = args.systems.split(",")
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or fails to import on this machine
        dropped = [s for s in systems if s.startswith("deepspeed")]
        systems = [s for s in systems if not s.startswith("deepspeed")]
        if dropped:
            print(f"deepspeed not importable: skipping {dropped}", flush=True)
    if "ddp" not in systems:
        systems.insert(0, "ddp")
    env = {"DS_ACCELERATOR": "cpu"}
    rounds = []
    for r in range(args.rounds):
        results = {}
        # Rotate the order each round so drift in machine load does not favour one system.
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for name in order:
            out = run_distributed(worker, args.world, (name, args.steps, args.warmup, args.global_batch),
                                  timeout=900, env=env)
            results[name] = {
                "tokens_per_s": out[0]["tokens_per_s"],
                "state_mb": max(o["state_mb"] for o in out),
                "peak_rss_mb": max(o["peak_rss_mb"] for o in out),
            }
            print(f"round {r} {name:16s} {results[name]['tokens_per_s']:8.0f} tok/s  "
                  f"state {results[name]['state_mb']:6.1f} MB  rss {results[name]['peak_rss_mb']:6.0f} MB", flush=True)
        rounds.append({k: results[k] for k in systems})
    print(f"\n## ZeRO vs peers ({datetime.date.today()}, {args.world} CPU ranks, GPT 7.4M, "
          f"{args.global_batch * 128} tokens/step, {args.rounds} rounds x {args.steps} steps)\n")
    print(ratio_table(rounds, "ddp"))


if __name__ == "__main__":
    main()
