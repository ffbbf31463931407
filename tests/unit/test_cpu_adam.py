"""make_offload_optimizer: the fastest CPU kernel for Adam/AdamW, plain construction otherwise; same step."""

import pytest
import torch

from lightning_scale.optim import make_offload_optimizer, offload_step_impl


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g, dtype=dtype)) for n in (37, 1000, 5)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
    return ps


def _clone(ps):
    out = []
    for p in ps:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


def _groups(ps, **extra):
    return [dict(params=ps[:2], lr=1e-2, weight_decay=0.1, **extra), dict(params=ps[2:], lr=3e-3, weight_decay=0.0)]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_parity_with_plain_torch_optimizer(cls, dtype, tol, amsgrad):
    ref_params, our_params = _params(dtype), None
    our_params = _clone(ref_params)
    ref = cls(_groups(ref_params), betas=(0.8, 0.99), eps=1e-6, amsgrad=amsgrad, foreach=False)
    # As the engine calls it: groups copied from the user's groups (they carry foreach/fused keys too).
    user = cls(_groups(_clone(ref_params)), betas=(0.8, 0.99), eps=1e-6, amsgrad=amsgrad)
    groups = [dict(g, params=p) for g, p in zip(user.param_groups, (our_params[:2], our_params[2:]))]
    ours = make_offload_optimizer(cls, groups, user.defaults)
    assert ours.offload_step_impl == "fused" and all(g["fused"] for g in ours.param_groups)
    for step in range(3):
        ref.step()
        ours.step()
        for a, b in zip(ref_params, our_params):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)
            b.grad = a.grad = torch.randn_like(a) * (step + 1)
    for a, b in zip(ref.state.values(), ours.state.values()):
        torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"], rtol=tol, atol=tol)


def test_other_classes_and_explicit_choices_are_constructed_as_given():
    ps = _params(torch.float64)
    sgd = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    opt = make_offload_optimizer(torch.optim.SGD, [dict(sgd.param_groups[0], params=_clone(ps))], sgd.defaults)
    assert type(opt) is torch.optim.SGD and opt.offload_step_impl == "as-given"
    assert opt.param_groups[0]["momentum"] == 0.9
    explicit = torch.optim.AdamW(ps, foreach=True)
    opt = make_offload_optimizer(torch.optim.AdamW, [dict(explicit.param_groups[0], params=_clone(ps))],
                                 explicit.defaults)
    assert opt.offload_step_impl == "as-given" and opt.param_groups[0]["foreach"] is True


def test_sgd_step_matches():
    ps = _params(torch.float64)
    mine = _clone(ps)
    ref = torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)
    ours = make_offload_optimizer(torch.optim.SGD, [dict(params=mine)], ref.defaults)
    ref.step()
    ours.step()
    for a, b in zip(ps, mine):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_impl_choice_rules():
    cpu = [torch.zeros(2)]
    assert offload_step_impl(torch.optim.Adam, {"foreach": None, "fused": None}, cpu) == "fused"
    assert offload_step_impl(torch.optim.Adam, {"fused": False}, cpu) == "as-given"
    assert offload_step_impl(torch.optim.Adam, {"differentiable": True}, cpu) == "as-given"
    assert offload_step_impl(torch.optim.Adam, {}, [torch.zeros(2, dtype=torch.int64)]) == "as-given"

    class MyAdam(torch.optim.Adam):
        pass

    assert offload_step_impl(MyAdam, {}, cpu) == "as-given"  # a subclass may override step()


def test_missing_params_key():
    with pytest.raises(ValueError, match=r"param_groups\[0\]"):
        make_offload_optimizer(torch.optim.Adam, [dict(lr=1.0)], {})


def test_engines_step_cpu_masters_with_the_fused_kernel_without_offload():
    # CPU training (no offload): the masters are on the CPU, so the engine's inner AdamW is torch's fused one
    # (1.42x a tp=2 HF Llama step on the CPU box); a user's explicit choice is kept; a CUDA master keeps torch's.
    from lightning_scale.zero.optimizer import ShardEngine

    w = torch.nn.Parameter(torch.zeros(8))
    user = torch.optim.AdamW([w], lr=1e-3)
    inner = ShardEngine._make_inner(user, [dict(user.param_groups[0], params=[torch.zeros(4)])])
    assert inner.offload_step_impl == "fused" and inner.param_groups[0]["fused"] is True
    chosen = torch.optim.AdamW([w], lr=1e-3, foreach=False)
    inner = ShardEngine._make_inner(chosen, [dict(chosen.param_groups[0], params=[torch.zeros(4)])])
    assert inner.offload_step_impl == "as-given" and not inner.param_groups[0]["fused"]
    meta = ShardEngine._make_inner(user, [dict(user.param_groups[0], params=[torch.zeros(4, device="meta")])])
    assert not getattr(meta, "offload_step_impl", None) == "fused"
