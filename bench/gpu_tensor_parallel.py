"""Tensor parallelism on GPUs (prepared for a multi-GPU run): lightning_scale vs DTensor vs DDP, one torchrun job.

Launch with one process per GPU (NCCL)::

    torchrun --nproc-per-node 2 bench/gpu_tensor_parallel.py --layers 8 --d-model 1024 --heads 16 --batch 16
    torchrun --nproc-per-node 4 bench/gpu_tensor_parallel.py --precision bf16
    torchrun --nproc-per-node 2 bench/gpu_tensor_parallel.py --compile      # + the rows compiled per block

Every rank is one tp rank (tp = world size); DDP uses the same ranks as data parallel with the same
global batch. Systems run in interleaved rounds inside the one job, order rotated per round. Reported
per system (rank 0 prints): tokens/s (median over rounds), ratio to DDP and to DTensor, peak CUDA
memory per rank (``max_memory_allocated``), MFU (tokens/s x FLOPs per token / (world x ``--peak-tflops``, the
H200's 989 dense bf16 by default); FLOPs per token = 6 x (12 L d^2 + V d) + 12 L d T), final loss. ``--compile`` adds
"+compile" rows for ddp, lightning_scale and dtensor: every block's forward compiled with inductor after the model is
parallelized (``lightning_scale.compile.compile_units``, where ``Zero3DStrategy(compile=True)`` puts it; tp layers
are deliberate graph breaks), the warm-up steps absorb the compile. ``--device cpu`` runs the same code on gloo for a
smoke test without a GPU. Never asserts on time.

``lightning_scale_ov`` is ``lightning_scale`` with ``set_overlap(model, --overlap-chunks)`` (what
``Zero3DStrategy(overlap_chunks=N)`` applies): each row-parallel forward all-reduce overlapped with its next row
chunk's matmul. Under autocast (``--precision bf16``) the row-parallel layer takes its unfused path, where the
chunks do not apply: the row then measures the plain path; ``--precision bf16-true`` (the model cast to bf16, no
autocast) keeps the overlap on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SYSTEMS = ["ddp", "lightning_scale", "lightning_scale_ov", "dtensor"]
COMPILED = ["ddp+compile", "lightning_scale+compile", "dtensor+compile"]


def flops_per_token(cfg) -> float:
    """6 x the matmul parameters (blocks + LM head, no lookups) + 12 L d T (attention scores and values)."""
    return 6.0 * (12 * cfg.n_layer * cfg.d_model ** 2 + cfg.vocab_size * cfg.d_model) \
        + 12.0 * cfg.n_layer * cfg.d_model * cfg.seq_len


def _build(system, cfg, device, rank, world, args):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_scale.models import GPT, lm_loss
    from lightning_scale.tensor_parallel import apply_tensor_parallel, sync_tp_grads
    from tensor_parallel import _dtensor_loss, _dtensor_plan

    from lightning_scale.compile import compile_units

    system, _, compiled = system.partition("+")
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if args.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    if system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                        else None)
        loss_fn = lambda x, y: lm_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank])  # noqa: E731
        finish = None
    elif system in ("lightning_scale", "lightning_scale_ov"):
        from lightning_scale.tensor_parallel.overlap import set_overlap

        apply_tensor_parallel(model, None, None)
        if system == "lightning_scale_ov":
            set_overlap(model, args.overlap_chunks)
        loss_fn, finish = model.loss, sync_tp_grads
    else:
        _dtensor_plan(model, init_device_mesh(device.type, (world,)))
        loss_fn, finish = (lambda x, y: _dtensor_loss(model(x), y)), None
    if compiled:  # after the parallel plan, as Zero3DStrategy(compile=True) does
        compile_units(model, True)
    fused = device.type == "cuda" and system != "dtensor"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    return model, loss_fn, finish, opt


def _run(system, cfg, args, device, rank, world):
    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_scale.models import make_batch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, loss_fn, finish, opt = _build(system, cfg, device, rank, world, args)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "bf16-true": None}[args.precision]  # bf16-true: no autocast
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        x, y = (t.to(device) for t in make_batch(cfg, args.batch, seed=100 + i))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            with loss_parallel() if system.startswith("dtensor") else contextlib.nullcontext():
                loss = loss_fn(x, y)
                loss.backward()
        if finish is not None:
            finish(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return statistics.median(times), peak, float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16, help="global sequences per step")
    parser.add_argument("--precision", choices=["fp32", "bf16", "bf16-true"], default="bf16",
                        help="bf16: autocast over fp32 weights; bf16-true: the model in bf16")
    parser.add_argument("--overlap-chunks", type=int, default=2, help="row chunks of the lightning_scale_ov row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--compile", action="store_true", help="add +compile rows (inductor, per block)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU for MFU (H200: 989)")
    args = parser.parse_args()
    systems = SYSTEMS + (COMPILED if args.compile else [])

    import torch
    import torch.distributed as dist

    from lightning_scale.models import GPTConfig

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    runs = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems[r % len(systems):] + systems[: r % len(systems)]:
            step_s, peak, loss = _run(system, cfg, args, device, rank, world)
            worst = torch.tensor([step_s, peak], dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            runs[system].append((args.batch * args.seq / worst[0].item(), worst[1].item(), loss))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        print(f"GPT {args.layers}L d{args.d_model} h{args.heads} vocab {args.vocab} seq {args.seq}, batch "
              f"{args.batch}, {args.precision}, tp = dp = {world} ranks on {device.type}")
        print("| system | tokens/s | vs DDP | vs DTensor | MFU | peak memory MB/rank | final loss |")
        print("|---|---|---|---|---|---|---|")
        for s in systems:
            tps = statistics.median(x[0] for x in runs[s])
            peers = ("ddp+compile", "dtensor+compile") if s.endswith("+compile") else ("ddp", "dtensor")
            vs = [statistics.median(a[0] / b[0] for a, b in zip(runs[s], runs[p])) for p in peers]
            mem = statistics.median(x[1] for x in runs[s])
            mfu = tps * flops_per_token(cfg) / (world * args.peak_tflops * 1e12)
            print(f"| {s} | {tps:.0f} | {vs[0]:.2f} | {vs[1]:.2f} | {mfu:.1%} | {mem:.0f} | {runs[s][-1][2]:.4f} |")
        if args.compile:
            print("(+compile rows: ratios against the compiled DDP / DTensor rows)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
