"""OneBitAdam in the universal checkpoint: error feedback kept on the same layout, reset (warned) on another.

parallelize() + make_engines() on 2 gloo ranks, a float64 GPT, OneBitAdam(freeze_step=2): a run saves after 3 steps
(one compressed step: the error-feedback buffers exist) and goes on for 2 more. Resumed on the same layout (ZeRO-2,
and stage 0) the 2 losses and the parameters equal the uninterrupted run's bit for bit, with no warning. Resumed on
another layout (ZeRO-2 -> stage 1, -> stage 0; stage 0 -> ZeRO-2) the buffers restart from zero with a warning that
says so, and everything else is the saved state: the losses equal those of the same-layout resume with its buffers
zeroed by hand (stage 1 / 2 share the compression numerics), and the loaded parameters equal the saved ones.
One launch of 2 ranks for the whole module.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

# the ranks fork from the zygote that imported torch._dynamo (torch.optim's first optimizer imports it: ~3 s of
# CPU per rank here), the one the HF tests start anyway (a zygote of its own costs more than it saves)
CKPT_PRELOAD = HF_RANK_PRELOAD

MODEL = dict(n_layer=1, vocab_size=64, seq_len=16)
SAVE_AT, AFTER, BATCH, FREEZE = 3, 2, 4, 2


def _run(rank, world, layout):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import GPT, gpt_tiny
    from lightning_scale.optim import OneBitAdam
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(**layout)
    topo = local_topology(config, world, rank)
    torch.manual_seed(0)
    model = GPT(gpt_tiny(**MODEL)).double()
    opt = OneBitAdam(model.parameters(), lr=3e-3, freeze_step=FREEZE)
    pm = parallelize(model, config, topo, "cpu", optimizers=[opt])
    (engine,) = pm.make_engines(overlap_comm=False)
    return model, opt, engine, topo


def _step(model, opt, topo, step):
    import torch.distributed as dist

    from lightning_scale.models.gpt import gpt_tiny, make_batch

    x, y = make_batch(gpt_tiny(**MODEL), BATCH, seed=step)
    loss = model.loss(x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / topo.dp


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _resume(rank, world, layout, path, zero_errors=False):
    from lightning_scale.checkpoint.engine_pieces import load_engines

    model, opt, engine, topo = _run(rank, world, layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_engines(path, model, [engine])
        loaded = _params(model)
        if zero_errors:
            for st in engine.states:
                st.helper.state["worker_error"] = None
        losses = [_step(model, opt, topo, s) for s in range(SAVE_AT, SAVE_AT + AFTER)]
    said = [str(w.message) for w in caught if "error-feedback" in str(w.message)]
    return {"losses": losses, "loaded": loaded, "warned": said}


def _worker(rank, world, root):
    from lightning_scale.checkpoint.engine_pieces import save_engines

    out = {}
    for name, layout in (("zero2", dict(stage=2)), ("stage0", dict(stage=0))):
        model, opt, engine, topo = _run(rank, world, layout)
        losses = [_step(model, opt, topo, s) for s in range(SAVE_AT)]
        save_engines(os.path.join(root, name), model, [engine])
        saved = _params(model)
        losses += [_step(model, opt, topo, s) for s in range(SAVE_AT, SAVE_AT + AFTER)]
        out[name] = {"losses": losses, "saved": saved, "engine": type(engine).__name__}
    z2, s0 = os.path.join(root, "zero2"), os.path.join(root, "stage0")
    out["same_zero2"] = _resume(rank, world, dict(stage=2), z2)
    out["same_stage0"] = _resume(rank, world, dict(stage=0), s0)
    out["zero2_errors_zeroed"] = _resume(rank, world, dict(stage=2), z2, zero_errors=True)
    out["zero2_to_stage1"] = _resume(rank, world, dict(stage=1), z2)
    out["zero2_to_stage0"] = _resume(rank, world, dict(stage=0), z2)
    out["stage0_to_zero2"] = _resume(rank, world, dict(stage=2), s0)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_worker, 2, args=(str(tmp_path_factory.mktemp("onebit")),), timeout=240,
                           preload=CKPT_PRELOAD)


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_same_layout_resume_is_bit_identical_with_the_error_feedback(runs):
    for res in runs:
        assert res["zero2"]["engine"] == "OneBitZeroOptimizer" and res["stage0"]["engine"] == "SelfReducingEngine"
        for saved, resumed in (("zero2", "same_zero2"), ("stage0", "same_stage0")):
            assert res[resumed]["losses"] == res[saved]["losses"][SAVE_AT:], (saved, res[resumed]["losses"])
            assert res[resumed]["warned"] == [] and _same(res[resumed]["loaded"], res[saved]["saved"])
        # the buffers matter: zeroing them changes the next compressed steps
        assert res["zero2_errors_zeroed"]["losses"] != res["zero2"]["losses"][SAVE_AT:]


@pytest.mark.timeout(300)
def test_another_layout_resets_the_error_feedback_with_a_warning(runs):
    for rank, res in enumerate(runs):
        for name, saved in (("zero2_to_stage1", "zero2"), ("zero2_to_stage0", "zero2"), ("stage0_to_zero2", "stage0")):
            r = res[name]
            assert len(r["warned"]) == 1 and "restart from zero" in r["warned"][0], (name, r["warned"])
            assert f"rank {rank} of 2" in r["warned"][0]
            assert _same(r["loaded"], res[saved]["saved"]), name  # weights (and masters) as saved
        # stage 1 and 2 compress alike: the reset run is the same-layout resume with its buffers zeroed
        assert res["zero2_to_stage1"]["losses"] == res["zero2_errors_zeroed"]["losses"]
