"""ZeRO stages 0-3 and offload vs torch DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, project GPT, 2 CPU ranks.

    python bench/zero.py                     # 3 interleaved rounds, prints a markdown table of ratios to DDP
    python bench/zero.py --rounds 5 --steps 30 --systems ddp,ls_z2,deepspeed_z2
    python bench/zero.py --systems stage3    # groups: stage3 (z3 + offload rows and their peers), stage012, all
    python bench/zero.py --compile           # + a compiled row ("+compile") for DDP, FSDP2, DeepSpeed and every ls row

Rows and the peer each lightning_scale row is compared with (second table, ratios per round, median):

    ls_z3          lightning_scale ZeRO-3 (ShardedParameters + Stage3Optimizer, one unit per block, prefetch 1)
                   vs fsdp2 (fully_shard per block + root, reshard_after_forward=True) and deepspeed_z3
    ls_z2_offload  ZeroOptimizer(stage=2, offload_optimizer=True)  vs deepspeed_z2_offload (DeepSpeedCPUAdam)
    ls_z3_offload  stage 3 with parameter offload (param_device=cpu) and optimizer offload
                   vs deepspeed_z3_offload (offload_param + offload_optimizer cpu, DeepSpeedCPUAdam)

``--compile``: the "+compile" rows compile every block's forward with inductor (lightning_scale.compile.compile_units,
the same per-unit placement as ``Zero3DStrategy(compile=True)``; for DDP and FSDP2 too, torchtitan style); the
warm-up steps absorb the compile time. DeepSpeed's rows compile its own way (``engine.compile()``, inductor: the whole
module, DeepSpeed's documented path). Compiled rows are compared with DDP+compile (stages 0-2, target 0.97),
FSDP2+compile (stage 3, target 1.1) and DeepSpeed+compile at the same stage (target 1.2).

On this CPU-only machine "offload" moves nothing (host and device are the same memory): the offload rows
measure the cost of the offload code path (host copies of gradient shards, the CPU optimizer kernel).
A DeepSpeed row that fails (config not supported on CPU, JIT build error...) prints its error and the run
continues without it.

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
from common import live_tensor_mb, peak_rss_mb, peer_table, ratio_table, round_ratios, write_plot  # noqa: E402

from lightning_scale.models.gpt import GPT, gpt_small, lm_loss, make_batch  # noqa: E402
from lightning_scale.testing import run_distributed  # noqa: E402

ALL = ["ddp", "zero_redundancy", "fsdp2", "fsdp2_noreshard", "deepspeed_z1", "deepspeed_z2",
       "ls_z0", "ls_z1", "ls_z2",
       "deepspeed_z3", "deepspeed_z2_offload", "deepspeed_z3_offload", "ls_z3", "ls_z2_offload", "ls_z3_offload"]
GROUPS = {
    "all": ALL,
    "stage012": ALL[:9],
    "stage3": ["ddp", "fsdp2", "deepspeed_z3", "deepspeed_z2_offload", "deepspeed_z3_offload",
               "ls_z3", "ls_z2_offload", "ls_z3_offload"],
}
# lightning_scale row -> [(peer row, target tokens/s ratio from issue 3)]
PEERS = {
    "ls_z3": [("fsdp2", 1.05), ("deepspeed_z3", 1.2)],
    "ls_z2_offload": [("deepspeed_z2_offload", 1.1)],
    "ls_z3_offload": [("deepspeed_z3_offload", 1.1)],
    "ls_z1": [("zero_redundancy", None), ("deepspeed_z1", 1.2)],
    "ls_z2": [("fsdp2_noreshard", None), ("deepspeed_z2", 1.2)],
}
COMPILE_PEERS = {"ls_z0": [("ddp", 0.97)], "ls_z1": [("ddp", 0.97), ("deepspeed_z1", 1.2)],
                 "ls_z2": [("ddp", 0.97), ("deepspeed_z2", 1.2)], "ls_z3": [("fsdp2", 1.1), ("deepspeed_z3", 1.2)],
                 "ls_z2_offload": [("deepspeed_z2_offload", 1.1)], "ls_z3_offload": [("deepspeed_z3_offload", 1.1)]}
COMPILABLE = ("ddp", "fsdp2", "ls_", "deepspeed")  # ZeroRedundancyOptimizer rows stay eager


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

        stage = int(system.split("_z")[1][0])
        offload = system.endswith("_offload")
        zero: dict = {"stage": stage}
        if offload:  # DeepSpeed's ZeRO-Offload: optimizer state + step on the host with its C++ CPUAdam
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
            if stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        config = {"train_micro_batch_size_per_gpu": local_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0, "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        if offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                         adamw_mode=True)
        else:
            optimizer = _adamw(model.parameters())
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                 dist_init_required=False)
        return engine, engine.step, lambda: None
    if system in ("ls_z3", "ls_z3_offload"):
        from lightning_scale.zero.param_shard import ShardedParameters
        from lightning_scale.zero.stage3_optimizer import Stage3Optimizer

        offload = system.endswith("_offload")
        opt = _adamw(model.parameters())
        sharded = ShardedParameters(model, [g["params"] for g in opt.param_groups], device=torch.device("cpu"),
                                    prefetch_depth=1, param_device=torch.device("cpu") if offload else None)
        sharded.shard_model()
        Stage3Optimizer(opt, sharded, offload_optimizer=offload)  # routes opt.step / opt.zero_grad
        return model, opt.step, opt.zero_grad
    if system == "ls_z2_offload":
        from lightning_scale.zero import ZeroOptimizer

        opt = _adamw(model.parameters())
        zero = ZeroOptimizer(opt, stage=2, offload_optimizer=True)
        return model, zero.step, zero.zero_grad
    if system.startswith("ls_z"):  # ls_z1, or ls_z1@8: bucket_mb=8
        from lightning_scale.zero import ZeroOptimizer

        name, _, bucket_mb = system.partition("@")
        opt = _adamw(model.parameters())
        zero = ZeroOptimizer(opt, stage=int(name[-1]), bucket_mb=float(bucket_mb or 25.0))
        return model, zero.step, zero.zero_grad
    raise ValueError(f"unknown system {system!r}; known: {', '.join(ALL)}")


def worker(rank: int, world: int, system: str, steps: int, warmup: int, global_batch: int):
    import warnings

    warnings.filterwarnings("ignore", message=".*\\.grad attribute of a Tensor that is not a leaf.*")
    if system.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = gpt_small()
    model = GPT(cfg)
    local = global_batch // world
    system, _, compiled = system.partition("+")
    module, step, zero_grad = _build(system, model, local)
    if compiled and system.startswith("deepspeed"):
        module.compile(backend="inductor")  # DeepSpeed's own compile: the engine's module, whole
    elif compiled:
        from lightning_scale.compile import compile_units

        compile_units(model, True)  # every block's forward, inductor
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
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) if compiled else 0
    return {"tokens_per_s": tokens / elapsed, "state_mb": state_mb, "peak_rss_mb": peak_rss_mb(),
            "loss": float(loss.detach()), "graphs": graphs}


def _expand(spec: str):
    out = []
    for item in spec.split(","):
        item = item.strip()
        for name in GROUPS.get(item, [item]):
            if name not in ALL:
                raise SystemExit(f"--systems: unknown system {name!r}; known: {', '.join(ALL)}; "
                                 f"groups: {', '.join(GROUPS)}")
            if name not in out:
                out.append(name)
    return out


def _short_error(err: BaseException, lines: int = 6) -> str:
    text = str(err).strip().splitlines()
    keep = [t for t in text if t.strip()][-lines:]
    return " | ".join(t.strip() for t in keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--systems", default="all",
                    help=f"comma-separated rows and/or groups ({', '.join(GROUPS)}); ddp is always added")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per (round, system) run")
    ap.add_argument("--plot", default=None, metavar="PATH", help="also write the ratios vs DDP as a bar chart (PNG)")
    ap.add_argument("--compile", action="store_true", help="add a +compile row for DDP, FSDP2, DeepSpeed and lightning_scale")
    args = ap.parse_args()
    systems = _expand(args.systems)
    if args.compile:
        compiled = [f"{s}+compile" for s in ["ddp", *systems] if s.startswith(COMPILABLE)]
        systems = list(dict.fromkeys(systems + compiled))  # ddp+compile once (it ran twice with ddp listed)
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # noqa: BLE001 - not installed, or fails to import on this machine
        dropped = [s for s in systems if s.startswith("deepspeed")]
        systems = [s for s in systems if not s.startswith("deepspeed")]
        if dropped:
            print(f"deepspeed not importable ({err!r}): skipping {dropped}", flush=True)
    if "ddp" not in systems:
        systems.insert(0, "ddp")
    env = {"DS_ACCELERATOR": "cpu"}
    failed = {}  # system -> error text; a failed system is not retried in later rounds
    rounds = []
    for r in range(args.rounds):
        results = {}
        # Rotate the order each round so drift in machine load does not favour one system.
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for name in order:
            if name in failed:
                continue
            try:
                out = run_distributed(worker, args.world, (name, args.steps, args.warmup, args.global_batch),
                                      timeout=args.timeout, env=env)
            except Exception as err:  # noqa: BLE001 - report why, keep going with the other rows
                failed[name] = _short_error(err)
                print(f"round {r} {name:20s} FAILED: {failed[name]}", flush=True)
                if name == "ddp":
                    raise
                continue
            results[name] = {
                "tokens_per_s": out[0]["tokens_per_s"],
                "state_mb": max(o["state_mb"] for o in out),
                "peak_rss_mb": max(o["peak_rss_mb"] for o in out),
                "loss": out[0]["loss"],
                "graphs": out[0]["graphs"],
            }
            print(f"round {r} {name:20s} {results[name]['tokens_per_s']:8.0f} tok/s  "
                  f"state {results[name]['state_mb']:6.1f} MB  rss {results[name]['peak_rss_mb']:6.0f} MB  "
                  f"loss {results[name]['loss']:.4f}"
                  + (f"  graphs {results[name]['graphs']}" if "+" in name else ""), flush=True)
        rounds.append({k: results[k] for k in systems if k in results})
    ok = [s for s in systems if s not in failed]
    rounds = [{k: r[k] for k in ok if k in r} for r in rounds]
    print(f"\n## ZeRO vs peers ({datetime.date.today()}, {args.world} CPU ranks, GPT 7.4M, "
          f"{args.global_batch * 128} tokens/step, {args.rounds} rounds x {args.steps} steps)\n")
    print(ratio_table(rounds, "ddp"))
    print("\nfinal-step loss (round 0; same data and init for every row): "
          + ", ".join(f"{k} {v['loss']:.4f}" for k, v in rounds[0].items()))
    compiled_rows = {k: v["graphs"] for k, v in rounds[0].items() if "+" in k}
    if compiled_rows:
        print("graphs compiled per rank (round 0; 0 = nothing compiled): "
              + ", ".join(f"{k} {n}" for k, n in compiled_rows.items()))
    pairs = [(ls, peer, target) for ls, peers in PEERS.items() if ls in ok for peer, target in peers]
    pairs += [(f"{ls}+compile", f"{peer}+compile", target) for ls, peers in COMPILE_PEERS.items()
              if f"{ls}+compile" in ok for peer, target in peers]
    if pairs:
        print("\n### lightning_scale rows vs their named peer (same rounds)\n")
        print(peer_table(rounds, pairs, failed))
    if args.plot:
        write_plot(args.plot, round_ratios(rounds, "ddp"), baseline="ddp",
                   title=f"ZeRO vs peers, tokens/s ({args.world} CPU ranks, {datetime.date.today()})")
    if failed:
        print("\nRows that failed (not in the tables):")
        for name, why in failed.items():
            print(f"- {name}: {why}")


if __name__ == "__main__":
    main()
