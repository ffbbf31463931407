"""Worker functions for the ZeRO multi-process tests (importable by the spawned ranks)."""

from __future__ import annotations

import torch

from lightning_scale.comm import CommCounter
from lightning_scale.models.gpt import GPT, gpt_tiny, lm_loss, make_batch
from lightning_scale.zero import ZeroOptimizer


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1, "lr": 3e-3}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}],
        lr=2e-3, betas=(0.9, 0.95),
    )


def reference_train(steps: int, accumulation: int, global_batch: int, clip: float, dtype=torch.float64):
    """Single process, the whole global batch, same hyperparameters: the parity reference."""
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg).to(dtype)
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            x, y = make_batch(cfg, global_batch, seed=1000 * step + micro)
            loss = lm_loss(model(x), y) / accumulation
            loss.backward()
            losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def zero_train(rank: int, world: int, stage: int, steps: int, accumulation: int, global_batch: int,
               clip: float, overlap: bool = True):
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg).to(torch.float64)
    opt = make_optimizer(model)
    zero = ZeroOptimizer(opt, stage=stage, bucket_mb=0.01, overlap_comm=overlap)
    local = global_batch // world
    with CommCounter() as counter:
        for step in range(steps):
            for micro in range(accumulation):
                x, y = make_batch(cfg, global_batch, seed=1000 * step + micro)
                x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
                ctx = zero.no_sync() if micro < accumulation - 1 else torch.enable_grad()
                with ctx:
                    loss = lm_loss(model(x), y) / accumulation
                    loss.backward()
            if clip:
                zero.clip_grad_norm_(clip)
            opt.step()  # routed to the ZeRO engine
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, dict(counter.by_op), zero.memory_bytes()


def parity_all_stages(rank: int, world: int, steps: int, accumulation: int, global_batch: int, clip: float):
    """Stages 0, 1, 2 (overlap on) and stage 2 (overlap off) in one spawn: parameters and bytes moved."""
    out = {}
    for stage, overlap in ((0, True), (1, True), (2, True), (2, False)):
        params, comm, _ = zero_train(rank, world, stage, steps, accumulation, global_batch, clip, overlap)
        out[(stage, overlap)] = (params, comm)
    return out


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.dim() == 0:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def measure_all_stages(rank: int, world: int, precision: str):
    return {stage: measure_model_state(rank, world, stage, precision) for stage in (0, 1, 2)}


def measure_model_state(rank: int, world: int, stage: int, precision: str):
    """Bytes of every distinct storage reachable from the model and the optimizer after a step."""
    from lightning_scale.models.gpt import GPTConfig
    from lightning_scale.zero.precision import policy_for

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, d_model=128)
    model = GPT(cfg)
    psi = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model)
    zero = ZeroOptimizer(opt, stage=stage, precision=policy_for(precision), bucket_mb=0.25)
    x, y = make_batch(cfg, 2, seed=rank)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [t for st in zero.reducer.states for t in (st.param_buffer, st.grad_buffer, st.shard_grad, st.staging)]
    tensors += [m for m in zero.masters] + [m.grad for m in zero.masters]
    tensors += [v for s in zero.inner.state.values() for v in s.values()]
    return psi, _unique_bytes(tensors), zero.memory_bytes()


def fp16_overflow(rank: int, world: int):
    """An inf in rank 1's gradient only: every rank skips the step and backs off the scale."""
    from lightning_scale.zero.precision import DynamicLossScaler, policy_for

    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg)
    opt = make_optimizer(model)
    scaler = DynamicLossScaler()
    zero = ZeroOptimizer(opt, stage=2, precision=policy_for("16-mixed"), loss_scaler=scaler, bucket_mb=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    results = []
    for step in range(2):
        x, y = make_batch(cfg, 2, seed=rank + 10 * step)
        loss = lm_loss(model(x), y)
        if step == 0 and rank == 1:  # an inf in one gradient element, on rank 1 only
            loss = loss + next(model.parameters()).view(-1)[0] * float("inf")
        (loss * scaler.scale).backward()
        zero.step()
        zero.zero_grad()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        results.append((scaler.scale, scaler.skipped_steps, changed))
        before = [p.detach().clone() for p in model.parameters()]
    return results


def fallback_collectives(rank: int, world: int):
    """The all_to_all / list all_gather fallbacks give the native results and count the same bytes."""
    from lightning_scale.comm import collectives as C

    torch.manual_seed(rank)
    inp = torch.randn(world * 5, dtype=torch.float64)
    native, fallback = torch.empty(5, dtype=torch.float64), torch.empty(5, dtype=torch.float64)
    with CommCounter() as a:
        C.reduce_scatter(native, inp, fallback=False)
    with CommCounter() as b:
        C.reduce_scatter(fallback, inp, async_op=True, fallback=True).wait()
    full_n, full_f = torch.empty(world * 5, dtype=torch.float64), torch.empty(world * 5, dtype=torch.float64)
    C.all_gather(full_n, native, fallback=False)
    C.all_gather(full_f, native, fallback=True)
    return torch.allclose(native, fallback, rtol=0, atol=1e-12), torch.equal(full_n, full_f), a.total, b.total


def pairwise_collectives(rank: int, world: int):
    """comm.pairwise (gloo's reduce-scatter / all-gather as point-to-point sends) against the native collectives:
    on the world group and on a subgroup whose ranks are not its global ranks, two of each in flight at once."""
    import torch.distributed as dist

    from lightning_scale.comm import collectives as C
    from lightning_scale.comm import pairwise

    out = {}
    sub = dist.new_group([1, 2])  # every rank creates it
    for name, group in (("world", None), ("sub", sub)):
        if group is not None and rank not in (1, 2):
            continue
        n = C.group_size(group)
        torch.manual_seed(rank)
        a, b = torch.randn(n * 7, dtype=torch.float64), torch.randn(n * 3, dtype=torch.float64)
        na, nb = torch.empty(7, dtype=torch.float64), torch.empty(3, dtype=torch.float64)
        C.reduce_scatter(na, a, group, fallback=False)
        C.reduce_scatter(nb, b, group, fallback=False)
        pa, pb = torch.empty(7, dtype=torch.float64), torch.empty(3, dtype=torch.float64)
        with CommCounter() as counted:
            ha = pairwise.reduce_scatter(pa, a, group, async_op=True, tag="grad")
            hb = pairwise.reduce_scatter(pb, b, group, async_op=True, tag="grad")
            hb.wait()
            ha.wait()
        with CommCounter() as native_counted:
            C.reduce_scatter(torch.empty(7, dtype=torch.float64), a, group, fallback=False, tag="grad")
            C.reduce_scatter(torch.empty(3, dtype=torch.float64), b, group, fallback=False, tag="grad")
        fa, fb = torch.empty(n * 7, dtype=torch.float64), torch.empty(n * 3, dtype=torch.float64)
        C.all_gather(fa, na, group, fallback=False)
        C.all_gather(fb, nb, group, fallback=False)
        me = C.group_rank(group)
        ga, gb = torch.zeros(n * 7, dtype=torch.float64), torch.zeros(n * 3, dtype=torch.float64)
        ga[me * 7:(me + 1) * 7] = na  # in place: the shard is the output's own chunk
        h1 = pairwise.all_gather(ga, ga[me * 7:(me + 1) * 7], group, async_op=True)
        h2 = pairwise.all_gather(gb, nb.clone(), group, async_op=True)  # a separate input
        h1.wait()
        h2.wait()
        # all_reduce: one full exchange on a 2-rank group (up to ALL_REDUCE_MAX_BYTES), the native collective else;
        # two in flight, the same bits as gloo's ring and the same bytes counted
        x, z = torch.randn(1000, dtype=torch.float64), torch.randn(17, dtype=torch.float64)
        nx, nz = x.clone(), z.clone()
        with CommCounter() as ar_native:
            C.all_reduce(nx, group, tag="tp")
            C.all_reduce(nz, group, tag="tp")
        px, pz = x.clone(), z.clone()
        native_calls = []
        real_all_reduce = dist.all_reduce
        dist.all_reduce = lambda *a, **k: native_calls.append(1) or real_all_reduce(*a, **k)
        try:
            with CommCounter() as ar_counted:
                hx = pairwise.all_reduce(px, group, async_op=True, tag="tp")
                hz = pairwise.all_reduce(pz, group, async_op=True, tag="tp")
                hz.wait()
                hx.wait()
        finally:
            dist.all_reduce = real_all_reduce
        big = torch.randn(pairwise.ALL_REDUCE_MAX_BYTES // 8 + 1, dtype=torch.float64)
        nbig = big.clone()
        C.all_reduce(nbig, group)
        pairwise.all_reduce(big, group)
        out[name] = dict(pairwise=pairwise.uses_pairwise(group),
                         ar_equal=torch.equal(px, nx) and torch.equal(pz, nz) and torch.equal(big, nbig),
                         ar_bytes=(ar_counted.total, ar_native.total), ar_native_calls=len(native_calls),
                         rs_err=max((pa - na).abs().max().item(), (pb - nb).abs().max().item()),
                         rs_equal=torch.equal(pa, na) and torch.equal(pb, nb),
                         ag_equal=torch.equal(ga, fa) and torch.equal(gb, fb),
                         bytes=(counted.total, native_counted.total))
    return out


def engines_skip_gloo_native(rank: int, world: int):
    """Stages 1-3 on gloo never call gloo's own reduce-scatter / all-gather (slow on CPU, see comm.pairwise): the
    native entry points raise here, and a step with overlapped and blocking post-step gathers still trains."""
    from lightning_scale.comm import collectives as C
    from lightning_scale.zero.param_shard import ShardedParameters
    from lightning_scale.zero.stage3_optimizer import Stage3Optimizer

    def refuse(*args, **kwargs):
        raise AssertionError("gloo's native reduce_scatter / all_gather called")

    C._reduce_scatter_native = C._all_gather_native = refuse
    C._NATIVE_BROKEN.clear()
    cfg = gpt_tiny()
    losses = {}
    for stage in (1, 2, 3):
        for overlap in (True, False):
            torch.manual_seed(0)
            model = GPT(cfg).double()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if stage == 3:
                sharded = ShardedParameters(model, [g["params"] for g in opt.param_groups],
                                            device=torch.device("cpu"))
                sharded.shard_model()
                Stage3Optimizer(opt, sharded)
                if not overlap:
                    continue
            else:
                ZeroOptimizer(opt, stage=stage, overlap_comm=overlap, overlap_param_gather=overlap)
            x, y = make_batch(cfg, 4, seed=rank)
            for _ in range(2):
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses[(stage, overlap)] = float(lm_loss(model(x), y).detach())
    return losses, C._NATIVE_BROKEN.copy()


def two_optimizers(rank: int, world: int, stage: int):
    """Two optimizers over disjoint halves of the model (manual-optimization style), stepped in turn."""
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg).double()
    first = [p for n, p in model.named_parameters() if n.startswith("blocks.0")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.0")]
    # Adagrad's eps keeps g / sqrt(sum g^2) well conditioned for gradients that are ~0 (unused tokens).
    opts = [torch.optim.SGD(first, lr=0.1, momentum=0.9), torch.optim.Adagrad(rest, lr=0.05, eps=1e-6)]
    _engines = [ZeroOptimizer(o, stage=stage, overlap_comm=False) for o in opts] if world > 1 else None
    local = 8 // world
    for step in range(2):
        for i, opt in enumerate(opts):
            x, y = make_batch(cfg, 8, seed=10 * step + i)
            x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
            lm_loss(model(x), y).backward()
            opt.step()
            for o in opts:
                o.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
