"""The runtime on one process (pp = 1, several virtual stages) and the I/W split, against plain autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_scale.config import ConfigError
from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
from lightning_scale.pipeline import PipelineRuntime, build_stage, gpt_pipeline_layers
from lightning_scale.pipeline.backward import WeightGradSplitter, backward_input, backward_weight


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: OpenMP threads only contend with the other processes on the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def loss64(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _reference_grads(cfg, x, y, scale=1.0):
    torch.manual_seed(0)
    gpt = GPT(cfg).double()
    (loss64(gpt(x), y) * scale).backward()
    return {n: p.grad.clone() for n, p in gpt.named_parameters()}


def _runtime(cfg, schedule, v, m, partition="uniform"):
    torch.manual_seed(0)
    gpt = GPT(cfg).double()
    stage = build_stage(gpt_pipeline_layers(gpt), pp=1, pp_rank=0, virtual_stages=v, partition=partition)
    return gpt, PipelineRuntime(stage, loss_fn=loss64, microbatches=m, schedule=schedule)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 3), ("zero_bubble", 1)])
def test_single_rank_runtime_matches_autograd(schedule, v, tie):
    cfg = gpt_tiny(n_layer=4, tie_weights=tie)
    x, y = make_batch(cfg, 8, seed=1)
    ref = _reference_grads(cfg, x, y)
    gpt, rt = _runtime(cfg, schedule, v, 4)
    loss = rt.train_step(x, y)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(loss64(gpt(x), y).item(), abs=1e-12)
    for n, p in gpt.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=1e-12, msg=n)
    assert rt.last_step_s >= rt.last_compute_s > 0
    # the per-(kind, stage) compute times add up to the compute total; the window spans the step
    assert sum(rt.last_action_s.values()) == pytest.approx(rt.last_compute_s, rel=1e-9)
    assert {s for _, s in rt.last_action_s} == set(rt.stage.stage_ids)
    start, end = rt.last_window
    assert end - start == pytest.approx(rt.last_step_s, rel=1e-9) and rt.last_wait_s >= 0


def test_gradients_accumulate_over_steps_and_scale():
    cfg = gpt_tiny(n_layer=2)
    x, y = make_batch(cfg, 4, seed=3)
    ref = _reference_grads(cfg, x, y, scale=3.0)
    gpt, rt = _runtime(cfg, "1f1b", 1, 2)
    rt.train_step(x, y, grad_scale=1.0)
    rt.train_step(x, y, grad_scale=2.0)  # accumulation: (1 + 2) x the gradient of the mean loss
    for n, p in gpt.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-10, atol=1e-12)


def test_eval_step_returns_loss_and_outputs():
    cfg = gpt_tiny(n_layer=3)
    x, y = make_batch(cfg, 6, seed=5)
    gpt, rt = _runtime(cfg, "interleaved_1f1b", 2, 3, partition="parameters")
    loss, logits = rt.eval_step(x, y, return_outputs=True)
    with torch.no_grad():
        torch.testing.assert_close(logits, gpt(x), rtol=0, atol=1e-12)
        assert loss.item() == pytest.approx(loss64(gpt(x), y).item(), abs=1e-12)
    assert rt.eval_step(x) is None
    assert all(p.grad is None for p in gpt.parameters())


def test_bad_batches_raise_clear_errors():
    cfg = gpt_tiny(n_layer=2)
    x, y = make_batch(cfg, 6, seed=0)
    _, rt = _runtime(cfg, "1f1b", 1, 4)
    with pytest.raises(ConfigError, match="pipeline.microbatches=4 does not divide the batch size 6"):
        rt.train_step(x, y)
    _, rt = _runtime(cfg, "1f1b", 1, 2)
    with pytest.raises(ValueError, match="needs targets"):
        rt.train_step(x, None)
    with pytest.raises(ValueError, match="inputs on every pipeline rank"):
        rt.train_step(None, y)


def test_runtime_rejects_bad_layouts():
    cfg = gpt_tiny(n_layer=2)
    stage = build_stage(gpt_pipeline_layers(GPT(cfg)), pp=2, pp_rank=0)
    with pytest.raises(ConfigError, match="needs torch.distributed initialized"):
        PipelineRuntime(stage, loss_fn=loss64, microbatches=2, pp_ranks=[0, 1])
    with pytest.raises(ConfigError, match="pp_ranks"):
        PipelineRuntime(stage, loss_fn=loss64, microbatches=2, pp_ranks=[0])
    with pytest.raises(ConfigError, match="available: gpipe, 1f1b"):
        PipelineRuntime(stage, loss_fn=loss64, microbatches=2, schedule="bogus")


def test_split_backward_defers_weight_gradients():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    out = net(x)
    g = torch.randn_like(out)
    out.backward(g)
    ref = [p.grad.clone() for p in net.parameters()]
    ref_x = x.grad.clone()
    net.zero_grad(set_to_none=True)
    x.grad = None

    splitter = WeightGradSplitter(net)
    assert splitter.splittable
    with splitter.capture() as records:
        out = net(x)
    assert len(records) == 3  # the two Linears and the LayerNorm
    gx, work = backward_input(out, g, x, records, splitter.splittable)
    torch.testing.assert_close(gx, ref_x, rtol=0, atol=1e-14)
    assert all(p.grad is None for p in net.parameters())  # I computed no weight gradient
    backward_weight(work)
    for p, r in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=1e-14)


def test_split_backward_falls_back_when_a_parameter_has_two_owners():
    emb = nn.Embedding(5, 3).double()
    head = nn.Linear(3, 5, bias=False).double()
    head.weight = emb.weight
    net = nn.Sequential(emb, head)
    splitter = WeightGradSplitter(net)
    assert not splitter.splittable
    idx = torch.tensor([[1, 2, 3]])
    with splitter.capture() as records:
        out = net(idx).sum()
    assert records == []  # no hooks were installed
    gx, work = backward_input(out, None, idx, records, splitter.splittable)
    assert gx is None and work == []
    assert emb.weight.grad is not None  # the full backward ran in I


class _NeedsInputGrad(torch.autograd.Function):
    """Identity that records, per backward, whether autograd asked it for its input's gradient."""

    asked: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _NeedsInputGrad.asked.append(ctx.needs_input_grad[0])
        return grad


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(_NeedsInputGrad.apply(x))


@pytest.mark.parametrize("schedule,v", [("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_first_stage_does_not_compute_its_input_gradient(schedule, v):
    """A float batch into stage 0: no stage consumes its gradient, so autograd is never asked for it (before: the
    runtime made every stage input require a gradient, and stage 0 computed one for nothing); the second layer's
    input still gets its gradient. Gradients equal plain autograd."""
    torch.manual_seed(0)
    layers = [_Probe(), _Probe()]
    ref = [_Probe(), _Probe()]
    for a, b in zip(ref, layers):
        a.load_state_dict(b.state_dict())
    stage = build_stage(layers, pp=1, pp_rank=0, virtual_stages=v, partition="uniform")
    rt = PipelineRuntime(stage, loss_fn=lambda out, t: (out - t).pow(2).mean(), microbatches=2, schedule=schedule)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    _NeedsInputGrad.asked = []
    rt.train_step(x, y)
    # 2 micro-batches: only the second layer's probe runs a backward (its input needs a gradient); the first
    # layer's probe sees an input that requires none, so autograd never reaches it
    assert _NeedsInputGrad.asked == [True, True], _NeedsInputGrad.asked
    ((ref[1](ref[0](x[:2])) - y[:2]).pow(2).mean() / 2 + (ref[1](ref[0](x[2:])) - y[2:]).pow(2).mean() / 2).backward()
    for a, b in zip(ref, layers):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=1e-6)
