"""Stages 1-2: the background post-step all-gather vs the blocking one vs DDP, paired in the same 2 CPU ranks.
Stage 3: where a ZeRO-3 step's time goes, prefetch 1 vs 2, parameter guard on / off, vs DDP.

    python bench/zero_overlap.py STAGE STEPS        # e.g. python bench/zero_overlap.py 1 60
    python bench/zero_overlap.py 3 STEPS            # stage 3 breakdown (see z3_worker)

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

class _Timed:
    """Wraps a collective's handle: the time its wait blocks is added to ``acc[key]``."""

    def __init__(self, h, acc, key):
        self._h, self._acc, self._key = h, acc, key

    def wait(self):
        t0 = time.perf_counter()
        self._h.wait()
        self._acc[self._key] += time.perf_counter() - t0

    def is_completed(self):
        return self._h.is_completed()


def _timed_comm(acc):
    """A stand-in for lightning_scale.comm.collectives inside zero/param_shard.py: all-gathers and reduce-scatters
    timed (time inside the call = launch; time blocked in wait = gather_wait / rs_wait)."""
    import types
    from lightning_scale.comm import collectives as C

    def wrap(fn, launch, wait):
        def call(*a, **k):
            t0 = time.perf_counter()
            h = fn(*a, **k)
            acc[launch] += time.perf_counter() - t0
            return _Timed(h, acc, wait) if h is not None else None
        return call

    ns = types.SimpleNamespace(**{k: getattr(C, k) for k in dir(C) if not k.startswith("__")})
    ns.all_gather = wrap(C.all_gather, "gather_launch", "gather_wait")
    ns.reduce_scatter = wrap(C.reduce_scatter, "rs_launch", "rs_wait")
    return ns


def z3_worker(rank, world, steps):
    """Stage 3 on the bench GPT (7.4M, AdamW, 1024 tokens/step, one unit per block, as bench/zero.py's ls_z3), four
    copies in the same processes, alternating in blocks of 5 steps (order reversed every block): DDP; ZeRO-3 prefetch
    1 (bench/zero.py's setting); prefetch 2; prefetch 1 with the parameter guard off (freeze / thaw no-ops: the
    class swap per parameter per gather / free that c4ac05d added). Per ZeRO-3 step: time blocked waiting for
    all-gathers (gather_wait) and reduce-scatters (rs_wait), time inside the launching calls, the optimizer step,
    and the rest (compute + hooks). Medians over blocks, ms per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lightning_scale.zero import param_guard, param_shard
    from lightning_scale.zero.param_shard import ShardedParameters
    from lightning_scale.zero.stage3_optimizer import Stage3Optimizer
    cfg = gpt_small()
    acc = {k: 0.0 for k in ("gather_launch", "gather_wait", "rs_launch", "rs_wait", "opt")}
    param_shard.C = _timed_comm(acc)
    real = (param_guard.freeze, param_guard.thaw)
    noop = (lambda ps: None, lambda ps: None)
    variants = {}
    for name in ("ddp", "z3_p1", "z3_p2", "z3_p1_noguard"):
        torch.manual_seed(0)
        m = GPT(cfg)
        if name == "ddp":
            mod = DDP(m)
            o = torch.optim.AdamW(mod.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
            variants[name] = (mod, o)
            continue
        o = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sh = ShardedParameters(m, [g["params"] for g in o.param_groups], device=torch.device("cpu"),
                               prefetch_depth=2 if name == "z3_p2" else 1)
        sh.shard_model()
        Stage3Optimizer(o, sh)
        if name.endswith("noguard"):
            param_guard.thaw(list(m.parameters()))  # plain parameters for good; its blocks run with no-op guards
        variants[name] = (m, o)
    times = {k: [] for k in variants}
    parts = {k: [] for k in variants if k != "ddp"}
    local, block = 8 // world, 5
    for b in range(steps // block + 1):
        order = list(variants) if b % 2 == 0 else list(reversed(list(variants)))
        for k in order:
            mod, o = variants[k]
            param_guard.freeze, param_guard.thaw = noop if k.endswith("noguard") else real
            for key in acc:
                acc[key] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(block):
                x, y = make_batch(cfg, 8, seed=b * block + i)
                x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
                loss = lm_loss(mod(x), y); loss.backward()
                t1 = time.perf_counter(); o.step(); acc["opt"] += time.perf_counter() - t1
                o.zero_grad()
            total = (time.perf_counter() - t0) / block
            times[k].append(total)
            if k != "ddp":
                row = {key: v / block for key, v in acc.items()}
                row["rest"] = total - sum(row.values())
                parts[k].append(row)
    param_guard.freeze, param_guard.thaw = real
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    brk = {k: {key: statistics.median(r[key] for r in rows[1:]) for key in rows[0]} for k, rows in parts.items()}
    return med, brk


if __name__ == "__main__" and sys.argv[1] == "3":
    steps = int(sys.argv[2])
    res = run_distributed(z3_worker, 2, (steps,), timeout=1800)
    for rank, (med, brk) in enumerate(res):
        print(f"rank {rank}: median ms/step " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in med.items())
              + "; ddp/z3: " + ", ".join(f"{k} {med['ddp'] / v:.3f}" for k, v in med.items() if k != "ddp"))
        for k, row in brk.items():
            print(f"  {k}: " + ", ".join(f"{key} {1e3 * v:.1f}" for key, v in row.items()))
elif __name__ == "__main__":
    stage, steps = int(sys.argv[1]), int(sys.argv[2])
    out = run_distributed(worker, 2, (stage, steps), timeout=900)[0]
    print(f"stage {stage}: median s/step", {k: round(v, 4) for k, v in out.items()},
          "ddp/overlap", round(out["ddp"] / out["overlap"], 3), "ddp/blocking", round(out["ddp"] / out["blocking"], 3),
          "blocking/overlap", round(out["blocking"] / out["overlap"], 3))
