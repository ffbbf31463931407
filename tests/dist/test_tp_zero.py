"""dp=2 x tp=2 with ZeRO-1 / ZeRO-2 over dp trains like the single-process GPT (float64, 3 clipped AdamW steps).

Each rank's local tp slices (and replicated parameters) are sharded by a ZeroOptimizer over its dp group;
clipping uses the global dp x tp norm. Every rank also trains the unsplit reference on the global batch
with ``torch.nn.utils.clip_grad_norm_`` and compares the consolidated parameters, the norms and losses.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lightning_scale.testing import run_distributed

TOL = 1e-10
STEPS = 3
MAX_NORM = 0.5  # below the reference's gradient norms (asserted), so clipping really scales


def _cfg():
    from lightning_scale.models import gpt_tiny

    # vocab 61: padded at tp=2; seq 16 divisible by tp for sequence parallelism
    return gpt_tiny(vocab_size=61, n_layer=2, n_head=4, d_model=32, seq_len=16, tie_weights=False)


def _groups(model):
    """Two param groups: matrices decayed at one lr, vectors (LayerNorm, biases) undecayed at another."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-2}]


def _reference(cfg, batches):
    from lightning_scale.models import GPT

    torch.manual_seed(0)
    model = GPT(cfg).double()
    start = copy.deepcopy(model)
    opt = torch.optim.AdamW(_groups(model), lr=3e-3)
    losses, norms = [], []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return start, model, losses, norms


def _train(topo, start, batches, stage: int, sp: bool):
    from lightning_scale.comm import collectives
    from lightning_scale.tensor_parallel import apply_tensor_parallel, consolidate_state_dict
    from lightning_scale.parallelize import cross_axis_for
    from lightning_scale.zero import ZeroOptimizer

    model = apply_tensor_parallel(copy.deepcopy(start), None, topo.tp_group, sequence_parallel=sp)
    opt = torch.optim.AdamW(_groups(model), lr=3e-3)
    # Small buckets: several per param group, and shards that cut through parameters.
    engine = ZeroOptimizer(opt, stage=stage, group=topo.dp_group, bucket_mb=2000 * 8 / 2**20, overlap_comm=False,
                           cross_axis=cross_axis_for(model, topo.tp_group))
    losses, norms = [], []
    for x, y in batches:
        dp = collectives.group_size(topo.dp_group)
        xs, ys = x.chunk(dp)[topo.dp_rank], y.chunk(dp)[topo.dp_rank]  # tp peers: the same micro-batch
        loss = model.loss(xs, ys)
        loss.backward()
        engine.reduce_gradients()  # partial sums over tp, then over dp
        norms.append(engine.clip_grad_norm_(MAX_NORM).item())
        opt.step()  # routed to the engine
        opt.zero_grad()
        collectives.all_reduce(mean := loss.detach().clone(), topo.dp_group)
        losses.append(mean.item() / dp)
    return consolidate_state_dict(model), losses, norms, len(engine.buckets)


def _train_stage3(topo, start, batches, sp: bool):
    """ZeRO-3 over dp of each rank's tp slices: ShardedParameters + the tp-aware Stage3Optimizer."""
    from lightning_scale.comm import collectives
    from lightning_scale.parallelize import cross_axis_for, tp_full_state_dict
    from lightning_scale.tensor_parallel import apply_tensor_parallel
    from lightning_scale.zero.param_shard import ShardedParameters
    from lightning_scale.zero.stage3_optimizer import Stage3Optimizer

    model = apply_tensor_parallel(copy.deepcopy(start), None, topo.tp_group, sequence_parallel=sp)
    groups = _groups(model)
    opt = torch.optim.AdamW(groups, lr=3e-3)
    sharded = ShardedParameters(model, [g["params"] for g in groups], group=topo.dp_group,
                                unit_modules=["Block"])
    sharded.shard_model()
    engine = Stage3Optimizer(opt, sharded, cross_axis=cross_axis_for(model, topo.tp_group))
    losses, norms = [], []
    for x, y in batches:
        dp = collectives.group_size(topo.dp_group)
        xs, ys = x.chunk(dp)[topo.dp_rank], y.chunk(dp)[topo.dp_rank]
        loss = model.loss(xs, ys)
        loss.backward()
        norms.append(engine.clip_grad_norm_(MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        collectives.all_reduce(mean := loss.detach().clone(), topo.dp_group)
        losses.append(mean.item() / dp)
    full = tp_full_state_dict(model, "", model, values=sharded.full_state_dict(dtype=None))
    order = list(model.state_dict(keep_vars=True))
    return {k: full[k] for k in order}, losses, norms, len(engine.buckets)


def _worker(rank: int, world_size: int, configs):
    import torch.distributed as dist

    from lightning_scale.models import make_batch
    from lightning_scale.topology import Topology

    cfg = _cfg()
    batches = [make_batch(cfg, 4, seed=20 + s) for s in range(STEPS)]
    start, ref, ref_losses, ref_norms = _reference(cfg, batches)
    topo = Topology(dp=2, tp=2, rank=rank).build_groups()
    out = {"ref_norms": ref_norms}
    expected = ref.state_dict()
    for stage, sp in configs:
        if stage == 3:
            full, losses, norms, n_buckets = _train_stage3(topo, start, batches, sp)
        else:
            full, losses, norms, n_buckets = _train(topo, start, batches, stage, sp)
        errs = {f"loss {i}": abs(a - b) for i, (a, b) in enumerate(zip(losses, ref_losses))}
        errs.update({f"norm {i}": abs(a - b) for i, (a, b) in enumerate(zip(norms, ref_norms))})
        assert list(full) == list(expected)
        errs.update({k: (full[k] - v).abs().max().item() for k, v in expected.items()})
        out[(stage, sp)] = (errs, n_buckets)
        dist.barrier()
    return out


def _sp_overlap_worker(rank: int, world_size: int):
    from lightning_scale.config import ConfigError
    from lightning_scale.models import GPT
    from lightning_scale.tensor_parallel import apply_tensor_parallel
    from lightning_scale.parallelize import cross_axis_for
    from lightning_scale.topology import Topology
    from lightning_scale.zero import ZeroOptimizer

    topo = Topology(dp=2, tp=2, rank=rank).build_groups()
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(_cfg()).double(), None, topo.tp_group, sequence_parallel=True)
    try:
        ZeroOptimizer(torch.optim.AdamW(model.parameters()), stage=2, group=topo.dp_group, overlap_comm=True,
                      cross_axis=cross_axis_for(model, topo.tp_group))
    except ConfigError as err:
        return str(err)
    return None


def _overflow_worker(rank: int, world_size: int):
    """An inf on one tp rank's gradient makes every rank of the dp x tp grid skip the step."""
    from lightning_scale.config import LossScaleConfig
    from lightning_scale.models import GPT, make_batch
    from lightning_scale.tensor_parallel import apply_tensor_parallel
    from lightning_scale.parallelize import cross_axis_for
    from lightning_scale.topology import Topology
    from lightning_scale.zero import ZeroOptimizer
    from lightning_scale.zero.precision import DynamicLossScaler

    topo = Topology(dp=2, tp=2, rank=rank).build_groups()
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(_cfg()).double(), None, topo.tp_group)
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale=1.0))
    opt = torch.optim.AdamW(model.parameters())
    engine = ZeroOptimizer(opt, stage=1, group=topo.dp_group, loss_scaler=scaler, overlap_comm=False,
                           cross_axis=cross_axis_for(model, topo.tp_group))
    x, y = make_batch(_cfg(), 2, seed=3)
    model.loss(x, y).backward()
    if topo.tp_rank == 1 and topo.dp_rank == 0:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    engine.reduce_gradients()
    norm = engine.clip_grad_norm_(1.0).item()
    opt.step()
    same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return norm, same, scaler.skipped_steps


_CONFIGS = [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]


def _all_worker(rank: int, world_size: int):
    out = _worker(rank, world_size, _CONFIGS)
    out["overlap"] = _sp_overlap_worker(rank, world_size)
    out["overflow"] = _overflow_worker(rank, world_size)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_worker, 4, timeout=240)


@pytest.mark.parametrize("stage,sp", _CONFIGS, ids=["zero1", "zero1-sp", "zero2", "zero2-sp", "zero3", "zero3-sp"])
def test_dp2_tp2_zero_matches_single_process(results, stage, sp):
    for rank, per_rank in enumerate(results):
        assert min(per_rank["ref_norms"]) > MAX_NORM  # clipping is active on every step
        errs, n_buckets = per_rank[(stage, sp)]
        assert n_buckets > 2  # several buckets: shard ranges cut through parameters
        assert len(errs) == 2 * STEPS + 29  # every key of the GPT state_dict is compared
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_sequence_parallel_refuses_overlapped_reduction(results):
    for per_rank in results:
        assert per_rank["overlap"] is not None and "overlap_comm" in per_rank["overlap"]


def test_overflow_on_one_tp_rank_skips_the_step_everywhere(results):
    for rank, per_rank in enumerate(results):
        norm, unchanged, skipped = per_rank["overflow"]
        assert not math.isfinite(norm) and unchanged and skipped == 1, (rank, norm, unchanged, skipped)


def test_shard_norm_weights_count_replicated_params_on_tp_rank_zero_only():
    """Pure: the masks follow the slots and the shard range (no processes)."""
    from lightning_scale.tensor_parallel.sharding import make_spec, mark_sharded, tp_replicated
    from lightning_scale.zero.flat_buffer import build_buckets
    from lightning_scale.zero.model_parallel import norm_mask

    def shard_norm_weights(bucket, shard, tp_rank):  # the one cross-axis module's mask, with tp's predicate
        return norm_mask(bucket, shard, tp_rank, replicated=tp_replicated)

    sharded, replicated = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(3))
    mark_sharded(sharded, make_spec(0, 8, 2))
    (bucket,) = build_buckets([[sharded, replicated]], 100, world_size=2)  # reversed: replicated first
    assert bucket.padded_numel == 12 and [s.offset for s in bucket.slots] == [0, 3]
    # rank 0 of dp owns [0, 6): 3 replicated + 3 sharded; rank 1 owns [6, 12): 5 sharded + 1 padding
    assert shard_norm_weights(bucket, slice(0, 6), tp_rank=0) is None
    assert shard_norm_weights(bucket, slice(0, 6), tp_rank=1).tolist() == [False] * 3 + [True] * 3
    for tp_rank in (0, 1):
        assert shard_norm_weights(bucket, slice(6, 12), tp_rank).tolist() == [True] * 5 + [False]
