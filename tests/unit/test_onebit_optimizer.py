"""OneBitAdam in one process: AdamW parity on a world size of 1, contracts, bad input, state dicts."""

import io
import warnings

import pytest
import torch

from lightning_scale.config import ConfigError
from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
from lightning_scale.optim import OneBitAdam, OneBitAdamShard, check_zero_stage


def _model(seed=0):
    torch.manual_seed(seed)
    return GPT(gpt_tiny()).double()


def _train(model, opt, steps, seed=0):
    for s in range(steps):
        x, y = make_batch(model.cfg, 4, seed=seed + s)
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()


def test_world_size_one_is_adamw_with_a_warning():
    a, b = _model(), _model()
    opt_a = OneBitAdam(a.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, freeze_step=2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)
    with pytest.warns(UserWarning, match="world size of 1"):
        _train(a, opt_a, 6)  # past freeze_step: nothing is frozen on one process
    _train(b, opt_b, 6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-12, atol=1e-14)
    assert not opt_a.compressing


def test_frozen_parameters_are_untouched_and_have_no_state():
    model = _model()
    model.wpe.weight.requires_grad_(False)
    before = model.wpe.weight.detach().clone()
    opt = OneBitAdam(model.parameters(), lr=1e-2, weight_decay=0.1, freeze_step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, opt, 2)
    assert torch.equal(model.wpe.weight, before)
    assert model.wpe.weight not in opt.state


def test_strategy_contract():
    assert OneBitAdam.handles_gradient_reduction is True
    opt = OneBitAdam(_model().parameters(), freeze_step=3)
    opt.bind_process_group(None)
    for stage in (0, 1, 2):
        check_zero_stage(stage)
        opt.check_zero_stage(stage)
    with pytest.raises(ConfigError, match="zero.stage=3"):
        opt.check_zero_stage(3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(freeze_step=-1), "freeze_step"),
    (dict(freeze_step=0), "freeze_step"),
    (dict(freeze_step=2.5), "freeze_step"),
    (dict(freeze_step=True), "freeze_step"),
    (dict(freeze_step=5, betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(freeze_step=5, betas=(0.9, -0.1)), r"betas\[1\]"),
    (dict(freeze_step=5, lr=-1.0), "lr"),
    (dict(freeze_step=5, eps=-1e-8), "eps"),
    (dict(freeze_step=5, weight_decay=-0.1), "weight_decay"),
    (dict(freeze_step=5, scale="max"), "scale"),
    (dict(freeze_step=5, bucket_numel=0), "bucket_numel"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitAdam(_model().parameters(), **kwargs)


def test_freeze_step_is_required():
    with pytest.raises(TypeError, match="freeze_step"):
        OneBitAdam(_model().parameters())


def test_bad_param_group_and_mask():
    model = _model()
    with pytest.raises(ValueError, match=r"betas\[0\]"):
        OneBitAdam([{"params": model.ln_f.parameters(), "betas": (1.5, 0.9)}], freeze_step=2)
    with pytest.raises(ValueError, match="exp_avg_mask"):
        OneBitAdam([{"params": [model.wte.weight], "exp_avg_mask": torch.ones(3)}], freeze_step=2)


@pytest.mark.filterwarnings("ignore:OneBitAdam on a world size")
def test_sparse_gradients_are_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OneBitAdam(emb.parameters(), freeze_step=2)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradients"):
        opt.step()


def test_state_dict_round_trip_continues_identically():
    a = _model()
    opt_a = OneBitAdam(a.parameters(), lr=3e-3, freeze_step=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(a, opt_a, 3)
        buf = io.BytesIO()
        torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
        _train(a, opt_a, 2, seed=100)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        b = _model(seed=1)
        b.load_state_dict(saved["model"])
        opt_b = OneBitAdam(b.parameters(), lr=3e-3, freeze_step=2)
        opt_b.load_state_dict(saved["opt"])
        _train(b, opt_b, 2, seed=100)
    assert opt_b.state_dict()["onebit"]["global_step"] == 5
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_shard_helper_rejects_mismatched_sizes():
    shard = torch.zeros(10)
    with pytest.raises(ValueError, match="ceil"):
        OneBitAdamShard(shard, 11, freeze_step=2)  # one rank: the shard is the whole buffer
    helper = OneBitAdamShard(shard, 10, freeze_step=2)
    with pytest.raises(ValueError, match="flat_grad"):
        helper.step(torch.zeros(9))
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdamShard(shard, 10, freeze_step=-3)


def test_shard_helper_on_one_rank_is_adamw():
    torch.manual_seed(0)
    start = torch.randn(50, dtype=torch.float64)
    ref = start.clone().requires_grad_(True)
    adamw = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    shard = start.clone()
    helper = OneBitAdamShard(shard, 50, lr=1e-2, weight_decay=0.1, freeze_step=2, segments=[20, 30])
    for step in range(5):
        grad = torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        ref.grad = grad.clone()
        adamw.step()
        helper.step(grad)
    torch.testing.assert_close(shard, ref.detach(), rtol=1e-12, atol=1e-14)


def test_shard_helper_state_dict_resumes_exactly():
    grads = [torch.randn(30, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    a = OneBitAdamShard(torch.ones(30, dtype=torch.float64), 30, lr=1e-2, freeze_step=2)
    for g in grads[:3]:
        a.step(g)
    buf = io.BytesIO()
    torch.save({"shard": a.shard, "opt": a.state_dict()}, buf)
    for g in grads[3:]:
        a.step(g)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    b = OneBitAdamShard(saved["shard"].clone(), 30, lr=1e-2, freeze_step=2)
    b.load_state_dict(saved["opt"])
    for g in grads[3:]:
        b.step(g)
    assert torch.equal(a.shard, b.shard)
    with pytest.raises(ValueError, match="numel=30"):
        OneBitAdamShard(torch.ones(31, dtype=torch.float64), 31, freeze_step=2).load_state_dict(saved["opt"])
