"""Tensor parallelism on CPU: lightning_scale vs DTensor vs Lightning's ModelParallelStrategy, as ratios to DDP.

The same GPT (``gpt_small``: 4 layers, d 256, 4 heads, vocab 8192, seq 128; fp32) on 2 CPU ranks (gloo,
one thread each), the same global batch (``--batch`` sequences per step) and AdamW:

  ddp              torch DistributedDataParallel, each rank half the batch (the baseline of every ratio)
  lightning_scale  apply_tensor_parallel(tp=2), built-in plan: vocab-parallel embedding / head / loss
  lightning_scale_ov  the same + set_overlap(model, 2): row-parallel all-reduces overlapped chunk by chunk
  dtensor          torch parallelize_module: Colwise/Rowwise blocks, Rowwise embedding, Colwise head
                   with Shard(-1) logits + loss_parallel (torchtitan's setup, so no rank gathers logits)
  lightning_mp     Lightning Trainer + ModelParallelStrategy(tensor_parallel_size=2), same DTensor plan
                   applied in configure_model

Every (round, system) runs in fresh processes, in an order rotated every round, so machine noise and
leftover memory hit the systems alike. Reported: tokens/s (median of the timed steps, then median over
rounds), the ratio to DDP measured in the same round (median over rounds), peak RSS per rank (max over
ranks, sampled while training), and the final loss (all systems see the same data and init).
Never asserts on time.

Full run (quiet machine):  python bench/tensor_parallel.py
Smoke run:                 python bench/tensor_parallel.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSTEMS = ["ddp", "lightning_scale", "lightning_scale_ov", "dtensor", "lightning_mp"]


class _RssPeak:
    """Samples this process's RSS in a thread; ``peak_mb`` is the maximum seen while running."""

    def __init__(self) -> None:
        import psutil

        self._proc, self.peak = psutil.Process(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> "_RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _dtensor_plan(model, mesh) -> None:
    """Colwise/Rowwise DTensor plan on the GPT; the fused qkv rows are permuted so shards hold whole heads."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    with torch.no_grad():
        for block in model.blocks:  # [q|k|v] -> [q0|k0|v0|q1|k1|v1] so a contiguous split is per head
            for t in (block.attn.qkv.weight, block.attn.qkv.bias):
                t.copy_(t.unflatten(0, (3, tp, -1)).transpose(0, 1).flatten(0, 2))
            block.attn.n_head //= tp
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)


def _dtensor_loss(logits, y):
    """Cross-entropy of Shard(-1) DTensor logits; call it (and backward) inside ``loss_parallel()``."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _plain_step(system, cfg, batch, rank):
    """(step_fn(x, y) -> loss, tokens per step) for the systems driven by a plain training loop."""
    import torch
    import torch.distributed as dist

    from lightning_scale.models import GPT, lm_loss

    torch.manual_seed(0)
    model = GPT(cfg)
    if system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        world = dist.get_world_size()

        def step(x, y):
            loss = lm_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step
    if system in ("lightning_scale", "lightning_scale_ov"):
        from lightning_scale.tensor_parallel import apply_tensor_parallel, sync_tp_grads
        from lightning_scale.tensor_parallel.overlap import set_overlap

        apply_tensor_parallel(model, None, None)
        if system == "lightning_scale_ov":
            set_overlap(model, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x, y):
            loss = model.loss(x, y)
            loss.backward()
            sync_tp_grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    _dtensor_plan(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y):
        with loss_parallel():
            loss = _dtensor_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return step


def _lightning_run(cfg, batches, warmup, rank, world_size):
    """Lightning Trainer + ModelParallelStrategy inside the already initialized process group."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_scale.models import GPT

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    times, losses = [], []

    class Module(pl.LightningModule):
        def configure_model(self):
            torch.manual_seed(0)
            self.model = GPT(cfg)
            _dtensor_plan(self.model, self.device_mesh["tensor_parallel"])

        def training_step(self, batch, _):
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                return _dtensor_loss(self.model(batch[0]), batch[1])

        def backward(self, loss, *args, **kwargs):
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss.backward()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            loss = outputs["loss"]
            losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
            times.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=ModelParallelStrategy(1, world_size),
                         max_steps=len(batches), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    times.append(time.perf_counter())
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # the pre-made (x, y) batches, in order
    trainer.fit(Module(), train_dataloaders=loader)
    step_times = [b - a for a, b in zip(times[warmup:], times[warmup + 1:])]
    return step_times, losses


def _worker(rank, world_size, system, cfg, batch, warmup, steps):
    from lightning_scale.models import make_batch

    batches = [make_batch(cfg, batch, seed=100 + s) for s in range(warmup + steps)]
    with _RssPeak() as rss:
        if system == "lightning_mp":
            step_times, losses = _lightning_run(cfg, batches, warmup, rank, world_size)
        else:
            step = _plain_step(system, cfg, batch, rank)
            step_times, losses = [], []
            for i, (x, y) in enumerate(batches):
                t0 = time.perf_counter()
                loss = step(x, y)
                if i >= warmup:
                    step_times.append(time.perf_counter() - t0)
                losses.append(float(loss.detach()))
    return {"step_s": statistics.median(step_times), "rss_mb": rss.peak / 2**20, "loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="global sequences per step (x 128 tokens)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--smoke", action="store_true", help="1 round, 2 timed steps, small model")
    parser.add_argument("--plot", default=None, metavar="PATH", help="also write the ratios vs DTensor as a bar chart")
    args = parser.parse_args()

    from lightning_scale.models import gpt_small
    from lightning_scale.testing import run_distributed

    systems = args.systems.split(",")
    cfg = gpt_small()
    if args.smoke:
        args.rounds, args.warmup, args.steps = 1, 1, 2
        cfg = gpt_small(n_layer=2, d_model=128, vocab_size=2048)
    tokens = args.batch * cfg.seq_len
    runs = {s: [] for s in systems}
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[: r % len(systems)]
        for system in order:
            res = run_distributed(_worker, 2, args=(system, cfg, args.batch, args.warmup, args.steps), timeout=900)
            runs[system].append({"tps": tokens / max(x["step_s"] for x in res),
                                 "rss": max(x["rss_mb"] for x in res),
                                 # DDP ranks see half the batch each: their mean is the global loss
                                 "loss": statistics.mean(x["loss"] for x in res)})
            print(f"round {r} {system:16s} {runs[system][-1]['tps']:8.0f} tokens/s", flush=True)
    _print_table(runs, systems, cfg, args)
    if args.plot and "dtensor" in runs:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import write_plot

        ratios = {s: [a["tps"] / b["tps"] for a, b in zip(runs[s], runs["dtensor"])] for s in systems}
        write_plot(args.plot, ratios, baseline="dtensor", targets={"lightning_scale": 1.5},
                   title=f"tensor parallel tp=2, tokens/s (2 CPU ranks, {args.rounds} rounds)")


def _print_table(runs, systems, cfg, args) -> None:
    base = runs.get("ddp")
    print(f"\nGPT {cfg.n_layer}L d{cfg.d_model} h{cfg.n_head} vocab {cfg.vocab_size} seq {cfg.seq_len}, "
          f"{args.batch} seq/step, 2 CPU ranks, {args.rounds} rounds x {args.steps} steps")
    print("| system | tokens/s | ratio vs DDP | ratio vs DTensor | peak RSS MB/rank | final loss |")
    print("|---|---|---|---|---|---|")
    for s in systems:
        tps = statistics.median(x["tps"] for x in runs[s])
        ratio = statistics.median(a["tps"] / b["tps"] for a, b in zip(runs[s], base)) if base else float("nan")
        dt = runs.get("dtensor")
        vs_dt = statistics.median(a["tps"] / b["tps"] for a, b in zip(runs[s], dt)) if dt else float("nan")
        rss = statistics.median(x["rss"] for x in runs[s])
        print(f"| {s} | {tps:.0f} | {ratio:.2f} | {vs_dt:.2f} | {rss:.0f} | {runs[s][-1]['loss']:.4f} |")


if __name__ == "__main__":
    main()
