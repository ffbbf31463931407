"""Stages 1-2: the background post-step all-gather vs the blocking one vs DDP, paired in the same 2 CPU ranks.

    python bench/zero_overlap.py STAGE STEPS        # e.g. python bench/zero_overlap.py 1 60

The same processes hold three copies of the bench GPT (7.4M, AdamW, 1024 tokens/step): torch DDP, ZeroOptimizer with
``overlap_param_gather=True`` and with ``False``. They alternate in blocks of 5 consecutive steps (order reversed every
block), so load drift on a shared machine hits all three alike, and a background gather overlaps only its own next
forward (each block ends with ``wait_params()``, counted in its time). Prints the median seconds per step of each and
their ratios. Not a test: nothing asserts on time."""
import statistics, sys, time
import torch, torch.distributed as dist
from lightning_scale.models.gpt import GPT, gpt_small, lm_loss, make_batch
from lightning_scale.testing import run_distributed

def worker(rank, world, stage, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lightning_scale.zero import ZeroOptimizer
    cfg = gpt_small()
    variants = {}
    for name in ("ddp", "overlap", "blocking"):
        torch.manual_seed(0)
        m = GPT(cfg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        if name == "ddp":
            mod = DDP(m); o = torch.optim.AdamW(mod.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
            variants[name] = (mod, o.step, o.zero_grad)
        else:
            z = ZeroOptimizer(opt, stage=stage, overlap_param_gather=(name == "overlap"))
            variants[name] = (m, z.step, z.zero_grad)
    times = {k: [] for k in variants}
    local = 8 // world
    block = 5  # consecutive steps per variant, so a background gather overlaps only its own next forward
    for b in range(steps // block + 1):
        order = list(variants) if b % 2 == 0 else list(reversed(list(variants)))
        for k in order:
            mod, step, zg = variants[k]
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(block):
                x, y = make_batch(cfg, 8, seed=b * block + i)
                x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
                loss = lm_loss(mod(x), y); loss.backward(); step(); zg()
            if k != "ddp":
                step.__self__.wait_params()  # the block's last gathers count in its time
            times[k].append((time.perf_counter() - t0) / block)
    times = {k: v[1:] for k, v in times.items()}  # first block: warm-up
    return {k: statistics.median(v) for k, v in times.items()}

if __name__ == "__main__":
    stage, steps = int(sys.argv[1]), int(sys.argv[2])
    out = run_distributed(worker, 2, (stage, steps), timeout=900)[0]
    print(f"stage {stage}: median s/step", {k: round(v, 4) for k, v in out.items()},
          "ddp/overlap", round(out["ddp"] / out["overlap"], 3), "ddp/blocking", round(out["ddp"] / out["blocking"], 3),
          "blocking/overlap", round(out["blocking"] / out["overlap"], 3))
