"""Universal checkpoints across tp, pp and offload, in a plain torch.distributed script (issue 13, reshard matrix).

parallelize() + make_engines() on 2 gloo ranks, a float64 GPT: four saving layouts train 2 steps of AdamW and save
with ``checkpoint.engine_pieces.save_engines`` (what ``checkpoint_format="universal"`` writes); six resuming
layouts load one of them with ``load_engines`` and train 2 more steps. The 3D grid (dp2 x pp2 x tp2 on 8 ranks) and
dp=4 save in launches of their own, resumed at dp4 ZeRO-3 / dp2 / one process (``grid``). Every loss and the final
parameters equal one process that trained the same 4 global batches (float64, 1e-10: tp and dp change the reduction
order, nothing else). Saving layouts: dp2 ZeRO-2, tp2 ZeRO-1, pp2 ZeRO-1, dp2 ZeRO-2 with optimizer offload. Resumes: tp 2->1 and
1->2, pp 2->1 and 1->2, offload on->off and off->on. One launch of 2 ranks for the whole module.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

# the ranks fork from the zygote that imported torch._dynamo (torch.optim's first optimizer imports it: ~3 s of
# CPU per rank here), the one the HF tests start anyway (a zygote of its own costs more than it saves)
CKPT_PRELOAD = HF_RANK_PRELOAD

MODEL = dict(n_layer=2, vocab_size=64, seq_len=16)
STEPS, SAVE_AT, BATCH, LR = 4, 2, 4, 3e-3
TOL = 1e-10
pytestmark = pytest.mark.slow  # one 2-rank launch, 10 layouts: 27 s on the shared 2-core box
SAVES = {"dp2": dict(stage=2), "tp2": dict(tp=2, stage=1), "pp2": dict(pp=2, stage=1, microbatches=2),
         "offload": dict(stage=2, offload="optimizer")}
# resumed layout <- the saving layout whose step-2 checkpoint it loads
RESUMES = {"tp2_to_tp1": ("tp2", dict(stage=2)), "tp1_to_tp2": ("dp2", dict(tp=2, stage=1)),
           "pp2_to_pp1": ("pp2", dict(stage=1)), "pp1_to_pp2": ("dp2", dict(pp=2, stage=1, microbatches=2)),
           "offload_on_to_off": ("offload", dict(stage=2)),
           "offload_off_to_on": ("dp2", dict(stage=2, offload="optimizer"))}


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _reference():
    from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch

    torch.manual_seed(0)
    model = GPT(gpt_tiny(**MODEL)).double()
    opt = torch.optim.AdamW(_groups(model), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model.loss(*make_batch(gpt_tiny(**MODEL), BATCH, seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Run:
    """One layout on this rank: the parallelized GPT, its engine, a step on the global batch."""

    def __init__(self, rank, world, layout):
        from lightning_scale.config import from_flat_kwargs
        from lightning_scale.models.gpt import GPT, gpt_tiny, lm_loss
        from lightning_scale.parallelize import local_topology, parallelize

        self.config = from_flat_kwargs(**layout)
        self.topo = local_topology(self.config, world, rank)
        torch.manual_seed(0)
        self.model = GPT(gpt_tiny(**MODEL)).double()
        self.opt = torch.optim.AdamW(_groups(self.model), lr=LR)
        if self.config.tp > 1:
            from lightning_scale.tensor_parallel import tensor_parallel_state

            loss_fn = lambda logits, y: tensor_parallel_state(self.model).cross_entropy(logits, y)  # noqa: E731
        else:
            loss_fn = lm_loss
        self.pm = parallelize(self.model, self.config, self.topo, "cpu", optimizers=[self.opt], loss_fn=loss_fn)
        (self.engine,) = self.pm.make_engines(overlap_comm=False)
        self.tp_rank = self.topo.tp_rank if self.config.tp > 1 else 0

    def step(self, step):
        import torch.distributed as dist

        from lightning_scale.models.gpt import gpt_tiny, make_batch

        x, y = make_batch(gpt_tiny(**MODEL), BATCH, seed=step)
        x, y = x.chunk(self.topo.dp)[self.topo.dp_rank], y.chunk(self.topo.dp)[self.topo.dp_rank]  # tp / pp peers: same
        if self.pm.pipeline is not None:
            with self.engine.no_sync():
                loss = self.pm.pipeline.runtime.train_step(x, y)  # every pp rank: its dp rows' mean loss
        else:
            loss = self.model.loss(x, y)
            loss.backward()
        self.opt.step()  # routed to the engine
        self.opt.zero_grad()
        loss = loss.detach().double().clone()
        if self.topo.dp > 1:
            dist.all_reduce(loss, group=self.topo.dp_group)
            loss /= self.topo.dp
        return loss.item()

    def save(self, path):
        from lightning_scale.checkpoint.engine_pieces import save_engines

        save_engines(path, self.model, [self.engine], tp_rank=self.tp_rank, meta={"step": SAVE_AT})

    def load(self, path):
        from lightning_scale.checkpoint.engine_pieces import load_engines

        return load_engines(path, self.model, [self.engine], tp_rank=self.tp_rank)

    def full_state(self):
        if self.pm.sharded is not None:  # ZeRO-3: the dp-gathered shards, then tp / pp consolidated
            full = self.pm.consolidate_stage3(self.pm.sharded.full_state_dict(dtype=None))
        else:
            full = self.pm.full_state_dict()
        return {k: v.clone() for k, v in full.items()}


def _matrix_worker(rank, world, root):
    out = {"saves": {}, "resumes": {}}
    for name, layout in SAVES.items():
        run = _Run(rank, world, layout)
        losses = [run.step(s) for s in range(SAVE_AT)]
        run.save(os.path.join(root, name))
        out["saves"][name] = {"losses": losses, "engine": type(run.engine).__name__,
                              "host_bytes": run.engine.memory_bytes()["host"]}
    for name, (source, layout) in RESUMES.items():
        run = _Run(rank, world, layout)
        res = run.load(os.path.join(root, source))
        losses = [run.step(s) for s in range(SAVE_AT, STEPS)]
        out["resumes"][name] = {"losses": losses, "state": run.full_state(), "step": res.meta["step"],
                                "saved_layout": source}
    return out


# The 3D grid and dp 4 <-> 2 (issue 13's reshard matrix), in launches of 8, 4, 2 and 1 ranks sharing one folder.
GRID_SAVES = {8: {"grid": dict(tp=2, pp=2, stage=1, microbatches=2)}, 4: {"dp4_z1": dict(stage=1)}}
GRID_RESUMES = {  # world -> resumed layout <- the saving layout whose step-2 checkpoint it loads
    4: {"grid_to_dp4_z3": ("grid", dict(stage=3))},
    2: {"dp4_z1_to_dp2_z3": ("dp4_z1", dict(stage=3)), "grid_to_dp2_z2": ("grid", dict(stage=2))},
    1: {"grid_to_one": ("grid", dict(stage=2)), "dp4_z1_to_one": ("dp4_z1", dict(stage=1))},
}


def _grid_worker(rank, world, root):
    out = {"saves": {}, "resumes": {}}
    for name, layout in GRID_SAVES.get(world, {}).items():
        run = _Run(rank, world, layout)
        losses = [run.step(s) for s in range(SAVE_AT)]
        run.save(os.path.join(root, name))
        out["saves"][name] = {"losses": losses, "layout": (run.topo.dp, run.topo.pp, run.topo.tp)}
    for name, (source, layout) in GRID_RESUMES.get(world, {}).items():
        run = _Run(rank, world, layout)
        res = run.load(os.path.join(root, source))
        losses = [run.step(s) for s in range(SAVE_AT, STEPS)]
        out["resumes"][name] = {"losses": losses, "state": run.full_state(), "step": res.meta["step"],
                                "saved_layout": source, "engine": type(run.engine).__name__}
    return out


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard_grid"))
    saves, resumes = {}, {}
    for world in (8, 4, 2, 1):  # the savers first (8: the grid, 4: dp4), then the layouts that resume them
        results = run_distributed(_grid_worker, world, args=(root,), timeout=240, preload=CKPT_PRELOAD)
        for r in results:
            for name, v in r["saves"].items():
                saves.setdefault(name, []).append(v)
            for name, v in r["resumes"].items():
                resumes.setdefault(name, []).append(v)
    return _reference(), saves, resumes


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", [n for per_world in GRID_RESUMES.values() for n in per_world])
def test_3d_grid_and_dp4_checkpoints_resume_on_other_layouts(grid, name):
    """dp2 x pp2 x tp2 (8 ranks, ZeRO-1, 1F1B with 2 micro-batches) -> dp4 ZeRO-3, dp2 ZeRO-2 and one process;
    dp4 ZeRO-1 -> dp2 ZeRO-3 and one process: every rank's losses of all 4 steps and its final parameters equal one
    process's (float64, 1e-10)."""
    (ref_losses, ref_state), saves, resumes = grid
    for rank, r in enumerate(resumes[name]):
        assert r["step"] == SAVE_AT
        got = saves[r["saved_layout"]][0]["losses"] + r["losses"]
        assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= TOL, (name, rank, got, ref_losses)
        assert sorted(r["state"]) == sorted(ref_state)
        worst = max((r["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst <= TOL, (name, rank, worst)
    assert resumes[name][0]["engine"] == ("Stage3Optimizer" if "z3" in name else "ZeroOptimizer")
    assert saves["grid"][0]["layout"] == (2, 2, 2) and len(saves["grid"]) == 8 and len(saves["dp4_z1"]) == 4
    for per_rank in saves.values():  # the saving layouts themselves train as one process does
        for s in per_rank:
            assert max(abs(a - b) for a, b in zip(s["losses"], ref_losses)) <= TOL


def _bf16_worker(rank, world, root):
    """dp2 ZeRO-2 under bf16-mixed (bf16 parameters, fp32 masters, bf16 autocast) saves at step 2; dp2 ZeRO-1 in
    32-true (float32 parameters = the masters) resumes from it for 2 steps."""
    import contextlib

    import torch.distributed as dist

    from lightning_scale.checkpoint.engine_pieces import load_engines, save_engines
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.zero.precision import policy_for

    out = {}
    for name, stage, precision in (("save", 2, "bf16-mixed"), ("resume", 1, "32-true")):
        config = from_flat_kwargs(stage=stage)
        topo = local_topology(config, world, rank)
        torch.manual_seed(0)
        model = GPT(gpt_tiny(**MODEL))
        opt = torch.optim.AdamW(_groups(model), lr=LR)
        pm = parallelize(model, config, topo, "cpu", optimizers=[opt])
        (engine,) = pm.make_engines(precision=policy_for(precision), overlap_comm=False)
        steps = range(SAVE_AT) if name == "save" else range(SAVE_AT, STEPS)
        if name == "resume":
            load_engines(os.path.join(root, "bf16"), model, [engine])
        losses, dtypes = [], {str(p.dtype) for p in model.parameters()}
        for step in steps:
            x, y = make_batch(gpt_tiny(**MODEL), BATCH, seed=step)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else \
                contextlib.nullcontext()
            with autocast:
                loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach().float().clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        if name == "save":
            save_engines(os.path.join(root, "bf16"), model, [engine], meta={"step": SAVE_AT})
        out[name] = {"losses": losses, "dtypes": sorted(dtypes),
                     "state": {k: v.detach().clone() for k, v in pm.full_state_dict().items()}}
    return out


@pytest.mark.timeout(300)
def test_bf16_mixed_checkpoint_resumes_in_32_true_like_one_process_from_the_same_state(tmp_path):
    """bf16-mixed -> 32-true: the resumed losses and parameters equal one float32 process that starts from the
    checkpoint's own state (its fp32 masters and Adam state, read back with torch's dcp_to_torch_save) - 1e-5."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch

    results = run_distributed(_bf16_worker, 2, args=(str(tmp_path),), timeout=240, preload=CKPT_PRELOAD)
    assert results[0]["save"]["dtypes"] == ["torch.bfloat16"] and results[0]["resume"]["dtypes"] == ["torch.float32"]
    dcp_to_torch_save(str(tmp_path / "bf16"), str(tmp_path / "full.pt"))
    full = torch.load(str(tmp_path / "full.pt"), weights_only=False)
    assert any(k.startswith("master/") for k in full)  # bf16-mixed kept fp32 masters: the weights come from them
    torch.manual_seed(0)
    model = GPT(gpt_tiny(**MODEL))
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(full[f"master/{n}"])
    opt = torch.optim.AdamW(_groups(model), lr=LR)
    for group in opt.param_groups:
        for p in group["params"]:
            n = names[id(p)]
            opt.state[p] = {k: full[f"optim/{n}/{k}"].clone().float() for k in ("step", "exp_avg", "exp_avg_sq")}
    losses = []
    for step in range(SAVE_AT, STEPS):
        loss = model.loss(*make_batch(gpt_tiny(**MODEL), BATCH, seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for rank, res in enumerate(results):
        got = res["resume"]["losses"]
        assert max(abs(a - b) for a, b in zip(got, losses)) <= 1e-5, (rank, got, losses)
        worst = max((res["resume"]["state"][k] - v).abs().max().item() for k, v in model.state_dict().items())
        assert worst <= 1e-5, (rank, worst)
    assert abs(results[0]["save"]["losses"][0] - losses[0]) > 1e-3  # the resumed run starts from the trained state


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    return _reference(), run_distributed(_matrix_worker, 2, args=(root,), timeout=240, preload=CKPT_PRELOAD)


def _check(matrix, name):
    (ref_losses, ref_state), results = matrix
    for rank, res in enumerate(results):
        r = res["resumes"][name]
        assert r["step"] == SAVE_AT
        saved = res["saves"][r["saved_layout"]]["losses"]
        got = saved + r["losses"]
        assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= TOL, (name, rank, got, ref_losses)
        assert sorted(r["state"]) == sorted(ref_state)
        worst = max((r["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst <= TOL, (name, rank, worst)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_on_another_layout_equals_one_process(matrix, name):
    _check(matrix, name)


@pytest.mark.timeout(300)
def test_saving_layouts_are_the_ones_named(matrix):
    (ref_losses, _), results = matrix
    for res in results:
        assert {n: s["engine"] for n, s in res["saves"].items()} == {n: "ZeroOptimizer" for n in SAVES}
        assert res["saves"]["offload"]["host_bytes"] > 0 and res["saves"]["dp2"]["host_bytes"] == 0  # offloaded
        for s in res["saves"].values():  # every saving layout itself trains as one process does
            assert max(abs(a - b) for a, b in zip(s["losses"], ref_losses)) <= TOL
