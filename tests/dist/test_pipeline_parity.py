"""Pipeline parity: pp=2 and pp=4, every schedule, 3 AdamW steps in float64 == one process.

One spawned run per pipeline size trains a fresh tiny GPT with each schedule in turn (spawning is
the slow part) and returns each rank's parameters by their GPT names. pp=4 uses a tied embedding /
LM head, so the tied gradient exchange between the first and last stage is covered. The pp=2 run
also checks the transfers: shapes exchanged once per channel and batch shape, bytes recorded.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
from lightning_scale.testing import run_distributed

STEPS, BATCH, SEED, LR = 3, 8, 1234, 3e-2
HEADER_BYTES = 10 * 8  # p2p header: dtype, ndim, 8 sizes as int64

# (schedule, virtual stages, micro-batches, partition)
RUNS = {
    2: [("gpipe", 1, 4, "parameters"), ("1f1b", 1, 4, "parameters"), ("interleaved_1f1b", 2, 4, "uniform"),
        ("zero_bubble", 1, 8, "type:Block")],
    4: [("gpipe", 1, 4, "uniform"), ("1f1b", 1, 8, "parameters"), ("interleaved_1f1b", 2, 4, "uniform"),
        ("zero_bubble", 1, 4, "uniform")],
}
MODELS = {2: dict(n_layer=4, tie_weights=False), 4: dict(n_layer=6, tie_weights=True)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: OpenMP threads only contend with the other processes on the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def loss64(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy kept in float64 (lm_loss casts to float32, which would cap the parity at ~1e-7)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _runtime(topo, gpt, schedule, v, m, partition):
    from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers

    stage = build_stage(gpt_pipeline_layers(gpt), pp=topo.pp, pp_rank=topo.pp_rank, virtual_stages=v,
                        partition=partition)
    return PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"), loss_fn=loss64,
                           microbatches=m, schedule=schedule)


def _pipeline_worker(rank: int, world_size: int, model_kw: dict, runs: list, check_p2p: bool) -> dict:
    from lightning_scale.topology import Topology

    topo = Topology(pp=world_size, rank=rank).build_groups()
    cfg = gpt_tiny(**model_kw)
    out = {}
    for schedule, v, m, partition in runs:
        torch.manual_seed(SEED)
        gpt = GPT(cfg).double()
        runtime = _runtime(topo, gpt, schedule, v, m, partition)
        opt = _optimizer(runtime.stage.parameters())
        losses = []
        for step in range(STEPS):
            x, y = make_batch(cfg, BATCH, seed=step)
            losses.append(runtime.train_step(x, y).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        eval_loss = runtime.eval_step(*make_batch(cfg, BATCH, seed=99)).item()
        mine = {id(p) for p in runtime.stage.parameters()}
        params = {n: p.detach().clone() for n, p in gpt.named_parameters() if id(p) in mine}
        out[(schedule, v)] = dict(losses=losses, eval=eval_loss, params=params, reused=runtime.p2p.reused,
                                  path=_p2p_path(runtime.p2p))
    if check_p2p:
        out["p2p"] = _p2p_worker(topo, cfg)
    return out


def _p2p_path(p2p) -> str:
    """How the runtime's transfers went: "gloo" (one group, tags), "twin" (a group per direction: NCCL) or "pairs"
    (a group per (src, dst): a device-bound NCCL group); "+emulated" under the NCCL emulation."""
    path = "pairs" if p2p.pair_groups is not None else "twin" if p2p.reverse_group is not None else "gloo"
    return path + ("+emulated" if p2p.emulate else "")


def _p2p_worker(topo, cfg) -> dict:
    from lightning_scale.comm.accounting import CommCounter

    torch.manual_seed(0)
    gpt = GPT(cfg).double()
    rt = _runtime(topo, gpt, "1f1b", 1, 2, "uniform")
    out = {"losses": []}
    with CommCounter() as counter:
        for step in range(3):  # batch 4 -> micro-batches (2, T)
            out["losses"].append(rt.train_step(*make_batch(cfg, 4, seed=step)).item())
        out["eval"] = rt.eval_step(*make_batch(cfg, 2, seed=7)).item()  # new shape (1, T): new header
        out["losses"].append(rt.train_step(*make_batch(cfg, 4, seed=3)).item())  # cached again
    out["by_tag"] = dict(counter.by_tag)
    out["grads"] = {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}
    return out


@functools.lru_cache(maxsize=None)
def _spawned(pp: int) -> list:
    return run_distributed(_pipeline_worker, pp, (MODELS[pp], RUNS[pp], pp == 2), timeout=150)


def _reference(model_kw: dict):
    torch.manual_seed(SEED)
    cfg = gpt_tiny(**model_kw)
    gpt = GPT(cfg).double()
    opt = _optimizer(gpt.parameters())
    losses = []
    for step in range(STEPS):
        x, y = make_batch(cfg, BATCH, seed=step)
        loss = loss64(gpt(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    x, y = make_batch(cfg, BATCH, seed=99)
    with torch.no_grad():
        eval_loss = loss64(gpt(x), y).item()
    return losses, eval_loss, dict(gpt.named_parameters())


def check_every_schedule(results: list, pp: int, reference: tuple, path: str) -> None:
    """Every rank's losses, eval loss and parameters of every run = the single-process ``reference`` (1e-10), each
    parameter held by some rank; the transfers went the ``path`` way (:func:`_p2p_path`; the NCCL ones:
    tests/dist/test_pipeline_nccl_semantics.py)."""
    ref_losses, ref_eval, ref_params = reference
    for schedule, v, _, _ in RUNS[pp]:
        seen = set()
        for rank, res in enumerate(results):
            got = res[(schedule, v)]
            assert got["path"] == path, (schedule, rank, got["path"])
            assert got["losses"] == pytest.approx(ref_losses, abs=1e-10, rel=0), (schedule, rank)
            assert got["eval"] == pytest.approx(ref_eval, abs=1e-10, rel=0), (schedule, rank)
            for name, value in got["params"].items():
                err = (value - ref_params[name].detach()).abs().max().item()
                assert err <= 1e-10, f"{schedule} v={v} rank {rank}: {name} differs by {err:.3e}"
                seen.add(name)
        assert seen == set(ref_params), f"{schedule}: parameters held by no rank: {set(ref_params) - seen}"


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(pp):
    results = _spawned(pp)
    model_kw = MODELS[pp]
    ref_losses, ref_eval, ref_params = _reference(model_kw)
    torch.manual_seed(SEED)
    init = dict(GPT(gpt_tiny(**model_kw)).double().named_parameters())
    assert max((init[n] - ref_params[n]).abs().max().item() for n in init) > 1e-3  # training moved them
    check_every_schedule(results, pp, (ref_losses, ref_eval, ref_params), "gloo")
    # the exact results above include received gradient buffers refilled (the pool of P2P.recycle) where a full
    # backward frees one before the next gradient receive is posted: 1F1B's first rank
    assert results[0][("1f1b", 1)]["reused"] > 0, [res[("1f1b", 1)]["reused"] for res in results]


def test_shapes_exchanged_once_and_bytes_recorded():
    results = [res["p2p"] for res in _spawned(2)]
    cfg = gpt_tiny(**MODELS[2])
    act = 2 * cfg.seq_len * cfg.d_model * 8  # one (2, T, C) float64 micro-batch activation
    for rank, res in enumerate(results):
        # 3 headers cross the link: activations at (2, T, C) and (1, T, C), gradients at (2, T, C)
        # (the mean loss the last stage hands out has a fixed shape: no header)
        assert res["by_tag"]["pp_meta"] == 3 * HEADER_BYTES, (rank, res["by_tag"])
        assert res["by_tag"]["pp_loss"] == 5 * 2 * 8  # [loss, has loss] in float64: 4 train steps + 1 eval step
        # 4 train steps x 2 micro-batches at full size, the eval step's 2 micro-batches at half size
        assert res["by_tag"]["pp_act"] == 4 * 2 * act + 2 * (act // 2)
        assert res["by_tag"]["pp_grad"] == 4 * 2 * act
        assert res["losses"] == results[0]["losses"] and res["eval"] == results[0]["eval"]
    # reference: the same batches on one process; no optimizer, so gradients sum over the 4 steps
    torch.manual_seed(0)
    gpt = GPT(cfg).double()
    losses = []
    for step in range(4):
        x, y = make_batch(cfg, 4, seed=step)
        loss = loss64(gpt(x), y)
        loss.backward()
        losses.append(loss.item())
    assert results[0]["losses"] == pytest.approx(losses, abs=1e-12, rel=0)
    merged = {**results[0]["grads"], **results[1]["grads"]}
    for n, p in gpt.named_parameters():
        torch.testing.assert_close(merged[n], p.grad, rtol=0, atol=1e-12)
