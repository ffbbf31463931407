"""Worker functions for the ZeRO-3 / offload multi-process tests (importable by the spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn as nn

from lightning_scale.comm import CommCounter
from lightning_scale.models.gpt import GPT, gpt_tiny, lm_loss, make_batch
from lightning_scale.zero import ZeroOptimizer
from lightning_scale.zero.param_shard import ShardedParameters
from lightning_scale.zero.stage3_optimizer import Stage3Optimizer
from lightning_scale.zero.precision import policy_for

import zero_workers as W

ALL_UNITS = ["wte", "wpe", "blocks.*", "ln_f", "lm_head"]


class Shared(nn.Module):
    """Block 0 runs twice per forward (a parameter used twice); block 1 only when ``use_b1`` (skipped unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 4)
        self.use_b1 = True

    def forward(self, x):
        h = torch.tanh(self.blocks[0](self.emb(x)))
        if self.use_b1:
            h = torch.tanh(self.blocks[1](h))
        h = torch.tanh(self.blocks[0](h))
        return self.head(h)


def _gpt(tie: bool = False, meta: bool = False, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = gpt_tiny(tie_weights=tie)
    if meta:
        with torch.device("meta"):
            return GPT(cfg), cfg
    return GPT(cfg).to(dtype), cfg


def reference_gpt(steps, accumulation, global_batch, clip, tie=False):
    torch.manual_seed(0)
    cfg = gpt_tiny(tie_weights=tie)
    model = GPT(cfg).to(torch.float64)
    opt = W.make_optimizer(model)
    for step in range(steps):
        for micro in range(accumulation):
            x, y = make_batch(cfg, global_batch, seed=1000 * step + micro)
            (lm_loss(model(x), y) / accumulation).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def zero3_train(rank, world, steps, accumulation, global_batch, clip, *, offload_optimizer=False,
                offload_params=False, meta=False, units=None, prefetch=1, persistent=0, tie=False, device="cpu"):
    model, cfg = _gpt(tie=tie, meta=meta)
    opt = W.make_optimizer(model)
    device = torch.device(device)
    sharded = ShardedParameters(model, [g["params"] for g in opt.param_groups], device=device,
                                param_dtype=torch.float64, unit_modules=units, prefetch_depth=prefetch,
                                persistent_threshold=persistent,
                                param_device=torch.device("cpu") if offload_params else None)
    sharded.shard_model()
    engine = Stage3Optimizer(opt, sharded, offload_optimizer=offload_optimizer)
    local = global_batch // world
    with CommCounter() as counter:
        for step in range(steps):
            for micro in range(accumulation):
                x, y = make_batch(cfg, global_batch, seed=1000 * step + micro)
                x, y = x[rank * local:(rank + 1) * local].to(device), y[rank * local:(rank + 1) * local].to(device)
                with engine.no_sync() if micro < accumulation - 1 else torch.enable_grad():
                    (lm_loss(model(x), y) / accumulation).backward()
            if clip:
                engine.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
    comm = {k: v for k, v in counter.by_op.items()}
    mem = sharded.memory_bytes()
    return sharded.full_state_dict(dtype=None), comm, mem, engine.memory_bytes()


def parity_suite(rank, world, steps, accumulation, global_batch, clip):
    out = {}
    out["stage3"] = zero3_train(rank, world, steps, accumulation, global_batch, clip)[0]
    out["stage3_meta"] = zero3_train(rank, world, steps, accumulation, global_batch, clip, meta=True)[0]
    out["stage3_all_units_prefetch2"] = zero3_train(rank, world, steps, accumulation, global_batch, clip,
                                                    units=ALL_UNITS, prefetch=2, persistent=100)[0]
    out["stage3_offload_all"] = zero3_train(rank, world, steps, accumulation, global_batch, clip,
                                            offload_optimizer=True, offload_params=True)[0]
    out["stage3_no_prefetch"] = zero3_train(rank, world, steps, accumulation, global_batch, clip, prefetch=0)[0]
    for stage in (1, 2):
        torch.manual_seed(0)
        cfg = gpt_tiny()
        model = GPT(cfg).to(torch.float64)
        opt = W.make_optimizer(model)
        zero = ZeroOptimizer(opt, stage=stage, bucket_mb=0.01, offload_optimizer=True)
        local = global_batch // world
        for step in range(steps):
            for micro in range(accumulation):
                x, y = make_batch(cfg, global_batch, seed=1000 * step + micro)
                x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
                with zero.no_sync() if micro < accumulation - 1 else torch.enable_grad():
                    (lm_loss(model(x), y) / accumulation).backward()
            zero.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
        out[f"stage{stage}_offload"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def tied(rank, world, steps, accumulation, global_batch, clip, units):
    return zero3_train(rank, world, steps, accumulation, global_batch, clip, tie=True, units=units)[0]


def comm_and_memory(rank, world, units, prefetch):
    _, comm, mem, _ = zero3_train(rank, world, 2, 1, 8, 0.0, units=units, prefetch=prefetch)
    return comm, mem


def _shared_reference_and_batches(steps):
    torch.manual_seed(0)
    model = Shared().double()
    batches = [(torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s)),
                torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + s)))
               for s in range(steps)]
    return model, batches


def shared_model(rank, world, steps):
    """Reference and ZeRO-3 on the Shared model in one rank (the reference needs no communication)."""
    ref, batches = _shared_reference_and_batches(steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s, (x, y) in enumerate(batches):
        ref.use_b1 = s % 2 == 0
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():  # a skipped unit gets a zero gradient (as under DDP), not "no gradient"
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
        ref_opt.zero_grad()
    model, _ = _shared_reference_and_batches(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sharded = ShardedParameters(model, [opt.param_groups[0]["params"]], device=torch.device("cpu"))
    sharded.shard_model()
    Stage3Optimizer(opt, sharded)
    local = 8 // world
    for s, (x, y) in enumerate(batches):
        model.use_b1 = s % 2 == 0  # the same branch on every rank
        out = model(x[rank * local:(rank + 1) * local])
        torch.nn.functional.mse_loss(out, y[rank * local:(rank + 1) * local]).backward()
        opt.step()
        opt.zero_grad()
    got = sharded.full_state_dict(dtype=None)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    return max((got[n] - want[n]).abs().max().item() for n in want)


def bf16_memory(rank, world):
    """Model-state bytes per rank under bf16-mixed (counted from distinct storages) after one step."""
    torch.manual_seed(0)
    cfg = gpt_tiny(d_model=64, n_layer=4)
    with torch.device("meta"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy = policy_for("bf16-mixed")
    sharded = ShardedParameters(model, [opt.param_groups[0]["params"]], device=torch.device("cpu"),
                                param_dtype=policy.param_dtype)
    sharded.shard_model()
    engine = Stage3Optimizer(opt, sharded, precision=policy)
    x, y = make_batch(cfg, 4, seed=rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()  # creates the Adam state; the gradient shards live until zero_grad
    tensors = [b.shard for b in sharded.buckets()] + [b.grad_shard for b in sharded.buckets()]
    tensors += list(engine.masters)
    for st in engine.inner.state.values():
        tensors += [v for v in st.values() if torch.is_tensor(v)]
    psi = sum(p.numel() for p in model.parameters())
    return psi, W._unique_bytes(tensors), engine.memory_bytes(), sharded.memory_bytes()


def bad_aliasing(rank, world):
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = nn.Parameter(self.a.weight.data[:, :])  # a view: same memory, distinct Parameter

    m = Aliased()
    try:
        ShardedParameters(m, [list(m.parameters())])
    except ValueError as err:
        return str(err)
    return None


def big_meta_init(rank, world, n_layer, d_model):
    """Build a GPT of ~1 GB (fp32, n_layer=20 at d=1024; 40: 2 GB) on meta and shard it; peak RSS growth of this rank vs the full size."""
    import gc
    import resource

    import psutil

    from lightning_scale.models.gpt import GPTConfig

    # Warm up the same code path on a tiny model first: the first use of the init / comm / matmul kernels maps
    # ~150 MB of library code and thread stacks, a constant that is not the model's memory.
    with torch.device("meta"):
        tiny = GPT(gpt_tiny())
    warm = ShardedParameters(tiny, [list(tiny.parameters())], device=torch.device("cpu"))
    warm.shard_model()
    with torch.no_grad():
        tiny(make_batch(tiny.cfg, 1, seed=0)[0])
    del tiny, warm
    gc.collect()
    before = psutil.Process().memory_info().rss
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=n_layer, n_head=8, d_model=d_model)
    with torch.device("meta"):
        model = GPT(cfg)
    sharded = ShardedParameters(model, [list(model.parameters())], device=torch.device("cpu"))
    sharded.shard_model()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # lifetime peak: an upper bound here
    full = cfg.num_params() * 4
    shards = sharded.memory_bytes()["param_shards"]
    # A spot check that the shards hold initialized values: every rank's shard of block 0 is non-trivial.
    x, _ = make_batch(cfg, 1, seed=0)
    with torch.no_grad():
        out = model(x[:, :8])
    return (peak - before) / full, shards / full, bool(torch.isfinite(out).all()), float(out.std())


def gpu_variants(rank, world, steps, accumulation, global_batch, clip):
    """On CUDA + NCCL: stage 3 plain, with optimizer offload, with everything offloaded (pinned host shards)."""
    torch.cuda.set_device(rank)
    out = {}
    for name, kw in (("stage3", {}), ("offload_optimizer", {"offload_optimizer": True}),
                     ("offload_all", {"offload_optimizer": True, "offload_params": True, "meta": True})):
        out[name] = zero3_train(rank, world, steps, accumulation, global_batch, clip, device="cuda", **kw)[0]
    return out
