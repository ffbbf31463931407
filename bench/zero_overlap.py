"""Stages 1-2: the background post-step all-gather vs the blocking one vs DDP, paired in the same 2 CPU ranks.
Stage 3: where a ZeRO-3 step's time goes, and an A/B of its per-gather costs, vs DDP and FSDP2 (see z3_worker).

    python bench/zero_overlap.py STAGE STEPS        # e.g. python bench/zero_overlap.py 1 60
    python bench/zero_overlap.py 3 STEPS [VARIANTS]  # stage 3 breakdown + A/B (see z3_worker, Z3)

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


def _old_reduce(self, unit):
    """ShardedParameters._reduce before the gradients were staged in the unit's own full buffer (a fresh zero-filled
    staging buffer per unit per step, the full buffer freed at once): the "staging" A/B variant."""
    from lightning_scale.zero import param_shard as PS
    C = PS.C
    for b in unit.buckets:
        staging = torch.zeros(b.bucket.padded_numel, dtype=b.full.dtype, device=self.device)
        for slot in b.bucket.slots:
            g = slot.param.grad
            if g is not None:
                staging[slot.offset:slot.offset + slot.numel].copy_(g.reshape(-1))
                slot.param.grad = None
        staging.div_(self.world)
        out = torch.empty(b.bucket.shard_numel, dtype=b.full.dtype, device=self.device)
        h = C.reduce_scatter(out, staging, self.group, async_op=True, tag="grad")

        def finish(b=b, out=out, h=h, staging=staging):
            h.wait()
            if b.grad_shard is None:
                b.grad_shard = out
            else:
                b.grad_shard.add_(out)

        self._reductions.append(PS.C.Handle(None, finish))
        while len(self._reductions) > PS._MAX_INFLIGHT:
            self._reductions.pop(0).wait()
    unit.reduced = True
    if unit.kind in ("unit", "root"):
        self._free(unit)


def _old_pre_forward(self, unit):
    """ShardedParameters._pre_forward before the root unit prefetched the first block."""
    from lightning_scale.zero.param_shard import _in_backward
    if _in_backward():
        self._gather(unit)
        return
    if unit.index not in self._order_now:
        self._order_now.append(unit.index)
    self._gather(unit)
    if self.prefetch_depth and unit.kind == "unit" and self.forward_order:
        self._prefetch(self.forward_order, unit.index)


# stage-3 A/B variants: name -> (prefetch depth, settings of the block)
Z3 = {
    "z3": (1, {}),  # bench/zero.py's ls_z3: the current code, collectives through the one-entry indirection
    "z3_p2": (2, {}),
    "z3_noguard": (1, {"guard": False}),  # freeze / thaw no-ops (issue 15's class swap per gather / free)
    "z3_direct": (1, {"direct": True}),  # collectives and Handle.wait called without the compile indirection
    "z3_dynamo": (1, {"dynamo": True}),  # the indirection pointing at torch.compiler.disable (torch._dynamo imported)
    "z3_staging": (1, {"old_reduce": True}),  # a separate zero-filled staging buffer per unit (before this change)
    "z3_before": (1, {"old_reduce": True, "old_prefetch": True}),  # + no root prefetch: the code before both changes
}


def z3_worker(rank, world, steps, only=None):
    """Stage 3 on the bench GPT (7.4M, AdamW, 1024 tokens/step, one unit per block, as bench/zero.py's ls_z3), several
    copies in the same processes, alternating in blocks of 5 steps (order reversed every block): DDP, FSDP2
    (fully_shard per block + root, reshard after forward, bench/zero.py's fsdp2 row) and the ZeRO-3 variants of ``Z3``
    (the per-gather costs A/B: prefetch depth, parameter guard, compile indirection, staging buffer, root prefetch).
    Per ZeRO-3 step: time blocked waiting for all-gathers (gather_wait) and reduce-scatters (rs_wait), time inside the
    launching calls, the optimizer step, and the rest (compute + hooks). Medians over blocks, ms per step."""
    import types
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.fsdp import fully_shard
    from lightning_scale.comm import collectives as C
    from lightning_scale.zero import param_guard, param_shard
    from lightning_scale.zero.param_shard import ShardedParameters
    from lightning_scale.zero.stage3_optimizer import Stage3Optimizer
    cfg = gpt_small()
    acc = {k: 0.0 for k in ("gather_launch", "gather_wait", "rs_launch", "rs_wait", "opt")}
    timed = _timed_comm(acc)
    param_shard.C = timed
    real = (param_guard.freeze, param_guard.thaw)
    noop = (lambda ps: None, lambda ps: None)
    raw = {id(impl): fn for impl, fn in C._EAGER}
    disabled = {id(impl): torch.compiler.disable(fn) for impl, fn in C._EAGER}
    wait_indirect = C.Handle.wait
    names = ["ddp", "fsdp2"] + [k for k in Z3 if only is None or k in only]
    variants = {}
    for name in names:
        torch.manual_seed(0)
        m = GPT(cfg)
        if name == "ddp":
            mod = DDP(m)
            variants[name] = (mod, torch.optim.AdamW(mod.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1))
            continue
        if name == "fsdp2":
            for blk in m.blocks:
                fully_shard(blk)
            fully_shard(m)
            variants[name] = (m, torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1))
            continue
        depth, opts = Z3[name]
        o = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sh = ShardedParameters(m, [g["params"] for g in o.param_groups], device=torch.device("cpu"),
                               prefetch_depth=depth)
        sh.shard_model()
        Stage3Optimizer(o, sh)
        if opts.get("old_reduce"):
            sh._reduce = types.MethodType(_old_reduce, sh)
        if opts.get("old_prefetch"):
            sh._pre_forward = types.MethodType(_old_pre_forward, sh)
        if opts.get("guard") is False:
            param_guard.thaw(list(m.parameters()))  # plain parameters for good; its blocks run with no-op guards
        variants[name] = (m, o)

    def configure(name):
        opts = Z3.get(name, (1, {}))[1]
        param_guard.freeze, param_guard.thaw = noop if opts.get("guard") is False else real
        for impl, _ in C._EAGER:
            impl[0] = disabled[id(impl)] if opts.get("dynamo") else raw[id(impl)]
        direct = opts.get("direct", False)
        C.Handle.wait = wait_indirect.__wrapped__ if direct else wait_indirect
        timed.all_gather = _timed_comm_one(C.all_gather.__wrapped__ if direct else C.all_gather, acc, "gather")
        timed.reduce_scatter = _timed_comm_one(C.reduce_scatter.__wrapped__ if direct else C.reduce_scatter, acc, "rs")

    times = {k: [] for k in variants}
    parts = {k: [] for k in variants if k in Z3}
    losses = {k: None for k in variants}
    local, block = 8 // world, 5
    for b in range(steps // block + 1):
        order = list(variants) if b % 2 == 0 else list(reversed(list(variants)))
        for k in order:
            mod, o = variants[k]
            configure(k)
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
            losses[k] = float(loss.detach())
            if k in parts:
                row = {key: v / block for key, v in acc.items()}
                row["rest"] = total - sum(row.values())
                parts[k].append(row)
    configure("z3")
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    brk = {k: {key: statistics.median(r[key] for r in rows[1:]) for key in rows[0]} for k, rows in parts.items()}
    return med, brk, losses


def _timed_comm_one(fn, acc, prefix):
    def call(*a, **k):
        t0 = time.perf_counter()
        h = fn(*a, **k)
        acc[f"{prefix}_launch"] += time.perf_counter() - t0
        return _Timed(h, acc, f"{prefix}_wait") if h is not None else None
    return call


if __name__ == "__main__" and sys.argv[1] == "3":
    steps = int(sys.argv[2])
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None  # e.g. z3,z3_before
    with open("/proc/loadavg") as f:
        print("load before:", f.read().split()[:3])
    res = run_distributed(z3_worker, 2, (steps, only), timeout=1800)
    with open("/proc/loadavg") as f:
        print("load after:", f.read().split()[:3])
    for rank, (med, brk, losses) in enumerate(res):
        print(f"rank {rank}: median ms/step " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in med.items()))
        print("  tokens/s vs ddp: " + ", ".join(f"{k} {med['ddp'] / v:.3f}" for k, v in med.items() if k != "ddp"))
        print("  tokens/s vs fsdp2: " + ", ".join(f"{k} {med['fsdp2'] / v:.3f}" for k, v in med.items() if k in Z3))
        print("  tokens/s vs z3_before: " + ", ".join(f"{k} {med['z3_before'] / v:.3f}" for k, v in med.items()
                                                      if k in Z3 and "z3_before" in med))
        for k, row in brk.items():
            print(f"  {k}: " + ", ".join(f"{key} {1e3 * v:.1f}" for key, v in row.items()))
        print("  last loss: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
elif __name__ == "__main__":
    stage, steps = int(sys.argv[1]), int(sys.argv[2])
    out = run_distributed(worker, 2, (stage, steps), timeout=900)[0]
    print(f"stage {stage}: median s/step", {k: round(v, 4) for k, v in out.items()},
          "ddp/overlap", round(out["ddp"] / out["overlap"], 3), "ddp/blocking", round(out["ddp"] / out["blocking"], 3),
          "blocking/overlap", round(out["blocking"] / out["overlap"], 3))
