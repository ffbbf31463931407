"""Expert parallelism over data-parallel ranks (``ep=2``): each rank reads its own rows, holds half of the experts of
every mixture-of-experts layer whole, and exchanges routes by all-to-all; training equals one process on all rows.

One 2-rank launch, float64. (1) Forward and backward of unchanged Hugging Face MoE models built from their config
classes (Mixtral, Qwen2-MoE with its shared expert through transformers' ``batched_mm`` experts, DeepSeek-V3 with
multi-head latent attention, GPT-OSS with per-expert biases, and a Mixtral whose zeroed routers send every route to
one rank's experts, so the other rank's receive none): each rank runs half of the batch; the mean of the two ranks'
losses is one process's loss on the whole batch, and every gradient, after the ep sum of the whole parameters and the
division by ep the engines do, equals one process's (1e-12 relative; DeepSeek-V3's float32 router 1e-6). Mutations
checked by hand: without the partial-gradient marks or without the engines' 1 / ep, these tests fail.
(2) Training through ``parallelize`` at ZeRO stages 1 and 3 (ep=2, AdamW, 4 steps): the losses equal one process
stepping on the whole batch (1e-10); clipped by the global norm as well (every step's norm and loss 1e-10).
(3) A universal checkpoint written at ep=2 (stage 1, after 2 steps) resumes at dp=2 without ep (experts whole on
every rank) and steps 3-4 equal one process; one written at dp=2 resumes at ep=2.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

# the families, their builders and the reference loss / gradients of the tp-placed experts' test (one process's
# forward + backward of the same models and batches)
from test_tp_expert_parallel import FAMILIES, _batch, _build, _grads, _loss

STEPS, SAVE_AT, LR = 4, 2, 1e-2
# DeepSeek-V3's router computes its logits in float32 (a cast inside the model): its weight's gradient is a float32
# sum over the tokens, which two half batches add in another order (any data-parallel split does: 1e-7 here)
FLOAT32_PARTS = {("deepseek_v3", "gate"): 1e-6}
TRAIN = "qwen2_moe"  # its router's softmax runs in float64 here: exact to 1e-10 over steps
CLIP = 0.05  # below every step's global norm: the clip acts


def _layout(layout: dict, rank: int, world_size: int, overlap: bool = False):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(**layout)
    topo = local_topology(config, world_size, rank)
    model = _build(TRAIN)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    pm = parallelize(model, config, topo, "cpu", optimizers=[opt])
    (engine,) = pm.make_engines(overlap_comm=None if overlap else False)  # None: the config's default
    return model, opt, engine, topo


def worker(rank: int, world_size: int, root: str) -> dict:
    import warnings

    import torch.distributed as dist

    from lightning_scale.checkpoint.engine_pieces import load_engines, save_engines
    from lightning_scale.comm.accounting import CommCounter
    from lightning_scale.tensor_parallel import apply_tensor_parallel, consolidate_state_dict, sync_tp_grads
    from lightning_scale.tensor_parallel.expert_alltoall import expert_data_parallel_plan
    from lightning_scale.testing import dp_step

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for family in FAMILIES:
        whole = _build(family)
        model = apply_tensor_parallel(whole, expert_data_parallel_plan(whole, 2), dist.group.WORLD)
        x, y = (t.chunk(2)[rank] for t in _batch())
        with CommCounter() as counter:
            loss = _loss(model(input_ids=x).logits, y)
            loss.backward()
        sync_tp_grads(model)  # the whole parameters' partial gradients summed over ep
        grads = {n: g / 2 for n, g in _grads(model).items()}  # the engines' 1 / ep
        named = [(n, m) for n, m in model.named_modules() if n.endswith(".experts")]
        experts = [m for _, m in named]
        out[family] = dict(loss=loss.item(), grads=consolidate_state_dict(model, values=grads),
                           num_experts=sorted({m.num_experts for m in experts}),
                           exchanged=counter.by_tag.get(f"ep/{named[0][0]}", 0),
                           load=[m._ep_load.tolist() for m in experts])
    for stage in (1, 3):
        model, opt, engine, topo = _layout(dict(ep=2, stage=stage), rank, world_size)
        out[f"stage{stage}"] = [dp_step(model, opt, topo, *_batch(step), _loss) for step in range(STEPS)]
        # clipped by the global norm: the whole parameters counted once, each rank's experts once
        model, opt, engine, topo = _layout(dict(ep=2, stage=stage), rank, world_size)
        norms = []
        out[f"clip{stage}"] = [dp_step(model, opt, topo, *_batch(step), _loss,
                                       before_step=lambda: norms.append(float(engine.clip_grad_norm_(CLIP))))
                               for step in range(STEPS)]
        out[f"clip{stage}_norms"] = norms
    # ZeRO 0 and 2 with the default overlap: the whole parameters' gradients are summed over ep bucket by bucket inside
    # the backward (on the tp group's twin), each bucket's dp reduction after its sum
    for stage in (0, 2):
        model, opt, engine, topo = _layout(dict(ep=2, stage=stage, bucket_mb=0.05), rank, world_size, overlap=True)
        inside = []

        def step(x, y):
            with CommCounter() as counter:
                loss = _loss(model(input_ids=x).logits, y)
                loss.backward()
            inside.append(counter.by_tag.get("tp/partial_grads", 0))
            return loss

        losses = []
        for i in range(STEPS):
            x, y = (t.chunk(2)[rank] for t in _batch(i))
            loss = step(x, y).detach().clone()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss)
            losses.append(float(loss / 2))
        out[f"overlap{stage}"] = dict(losses=losses, inside=inside, overlap=engine.reducer.overlap_comm,
                                      buckets=len(engine.reducer.states))
    # ep=2 -> universal checkpoint -> dp=2 (experts whole), and back
    for first, second, name in ((dict(ep=2, stage=1), dict(stage=1), "ep_to_dp"),
                                (dict(stage=1), dict(ep=2, stage=1), "dp_to_ep")):
        path = f"{root}/{name}"
        model, opt, engine, topo = _layout(first, rank, world_size)
        losses = [dp_step(model, opt, topo, *_batch(step), _loss) for step in range(SAVE_AT)]
        save_engines(path, model, [engine], tp_rank=topo.tp_rank)
        dist.barrier()
        model, opt, engine, topo = _layout(second, rank, world_size)
        load_engines(path, model, [engine], tp_rank=topo.tp_rank)
        losses += [dp_step(model, opt, topo, *_batch(step), _loss) for step in range(SAVE_AT, STEPS)]
        out[name] = losses
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp("ep_alltoall"))
    return run_distributed(worker, 2, (root,), timeout=300, preload=HF_RANK_PRELOAD)


def _reference(clip=None):
    model = _build(TRAIN)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    want, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _loss(model(input_ids=x).logits, y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    return want, norms


@pytest.fixture(scope="module")
def reference_losses():
    return _reference()[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_forward_backward_equal_one_process(runs, family):
    ref = _build(family)
    x, y = _batch()
    loss = _loss(ref(input_ids=x).logits, y)
    loss.backward()
    grads = _grads(ref)
    mean = sum(run[family]["loss"] for run in runs) / 2
    assert abs(mean - loss.item()) <= 1e-12 * abs(loss.item()), (mean, loss.item())
    for rank, run in enumerate(runs):
        r = run[family]
        assert r["num_experts"] == [2], r["num_experts"]  # 4 experts, 2 per rank
        assert r["exchanged"] > 0, "no route was exchanged"
        worst = {n: ((r["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-300)).item()
                 for n, g in grads.items()}
        bad = {n: w for n, w in worst.items() if not w <= FLOAT32_PARTS.get((family, n.rsplit(".", 2)[-2]), 1e-12)}
        assert not bad, (family, rank, bad)
    if family.endswith("_idle"):  # every route of both ranks went to one rank's experts, none to the other's
        for run in runs:
            assert all(sorted(load) == [0, 48] for load in run[family]["load"]), run[family]["load"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("what", ["stage1", "stage3", "ep_to_dp", "dp_to_ep"])
def test_ep2_training_equals_one_process(runs, reference_losses, what):
    for rank, run in enumerate(runs):
        diff = max(abs(a - b) for a, b in zip(run[what], reference_losses))
        assert diff <= 1e-10, (what, rank, run[what], reference_losses)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [1, 3])
def test_ep2_global_norm_clipping_equals_one_process(runs, stage):
    want, norms = _reference(CLIP)
    assert min(norms) > CLIP, norms  # every step clipped
    for rank, run in enumerate(runs):
        got = run[f"clip{stage}_norms"]
        assert max(abs(a - b) / b for a, b in zip(got, norms)) <= 1e-10, (rank, got, norms)
        assert max(abs(a - b) for a, b in zip(run[f"clip{stage}"], want)) <= 1e-10, (rank, run[f"clip{stage}"], want)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [0, 2])
def test_ep2_gradient_sums_run_inside_the_backward(runs, reference_losses, stage):
    """The default engine overlaps: every step's ep sums of the whole parameters' gradients left during the backward
    (bytes on the twin group's tag before any optimizer call), over many small buckets, and training = one process."""
    for rank, run in enumerate(runs):
        r = run[f"overlap{stage}"]
        assert r["overlap"] is True and r["buckets"] > 4, r
        assert all(b > 0 for b in r["inside"]), r["inside"]
        assert max(abs(a - b) for a, b in zip(r["losses"], reference_losses)) <= 1e-10, (rank, r, reference_losses)
