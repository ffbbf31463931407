"""Llama 4's dense experts made routed (lightning_scale/tensor_parallel/routed_experts.py): the same model, k / E of the
expert work. The distributed uses (tp split, placed, ep exchanged) are in tests/dist/test_tp_expert_parallel.py,
tests/dist/test_ep_alltoall.py, tests/dist/test_hf_matrix.py and tests/strategies/test_hf_models.py."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from lightning_scale.models import hf_families as F  # noqa: E402
from lightning_scale.tensor_parallel.experts import is_experts  # noqa: E402
from lightning_scale.tensor_parallel.routed_experts import route_experts  # noqa: E402

warnings.filterwarnings("ignore", message=".*RoPE scaling.*")


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("k", [1, 2])
def test_routed_equals_dense_forward_and_backward(k):
    dense = F.build("llama4", overrides=dict(num_experts_per_tok=k))  # float64, rotary + chunked attention layers
    routed = copy.deepcopy(dense)
    assert route_experts(routed) == ["model.layers.1.feed_forward", "model.layers.3.feed_forward"]
    assert route_experts(routed) == []  # once only
    assert not any(is_experts(m) for m in dense.modules()) and sum(is_experts(m) for m in routed.modules()) == 2
    assert list(routed.state_dict()) == list(dense.state_dict())  # same keys, same parameters
    for step in range(2):
        x, y = F.batch(4, 12, seed=step)
        a, b = _loss(dense, x, y), _loss(routed, x, y)
        a.backward()
        b.backward()
        assert abs(a.item() - b.item()) <= 1e-14 * a.item(), (a.item(), b.item())
        for (name, p), q in zip(dense.named_parameters(), routed.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-18), name
            assert p.grad.abs().max() > 0 or "router" not in name, name


def test_routing_weight_scales_the_input_not_the_output():
    """Llama 4 computes expert(x * score): a routed layer that weighted the output instead would differ (sigmoid
    scores < 1 and SiLU are not homogeneous), so the check above can fail."""
    model = F.build("llama4")
    moe = model.model.layers[1].feed_forward
    route_experts(model)
    x = torch.randn(6, 32, dtype=torch.float64)
    index = torch.tensor([[0], [1], [2], [3], [0], [1]])
    weights = torch.full((6, 1), 0.3, dtype=torch.float64)
    out = moe.experts(x, index, weights)
    unscaled = moe.experts(x, index, torch.ones_like(weights))
    assert not torch.allclose(out, 0.3 * unscaled)
    assert torch.allclose(out, moe.experts(0.3 * x, index, torch.ones_like(weights)), rtol=1e-14, atol=0)


def test_routed_model_pickles_and_copies():
    model = F.build("llama4")
    route_experts(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        moe = clone.model.layers[1].feed_forward
        assert type(moe).__name__ == "RoutedLlama4TextMoe" and is_experts(moe.experts)
        x, y = F.batch(2, 12, seed=0)
        assert abs(_loss(clone, x, y).item() - _loss(model, x, y).item()) == 0


def test_routed_model_unpickles_in_a_fresh_process(tmp_path):
    """A routed model pickled here is read in a new interpreter that never routed one (its classes rebuilt by name)."""
    import subprocess
    import sys

    model = F.build("llama4")
    route_experts(model)
    x, y = F.batch(2, 12, seed=0)
    torch.save({"model": model, "loss": _loss(model, x, y).item()}, tmp_path / "m.pt")
    code = ("import torch, warnings; warnings.filterwarnings('ignore')\n"
            "from lightning_scale.models import hf_families as F\n"
            f"d = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False)\n"
            "x, y = F.batch(2, 12, seed=0)\n"
            "loss = torch.nn.functional.cross_entropy(d['model'](input_ids=x).logits.flatten(0, 1), y.flatten())\n"
            "assert type(d['model'].model.layers[1].feed_forward).__name__ == 'RoutedLlama4TextMoe'\n"
            "print(loss.item() == d['loss'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("True"), out.stdout + out.stderr[-2000:]


def test_routed_experts_do_k_of_E_of_the_expert_work():
    """transformers' Llama 4 runs every expert on every token; routed, each token runs its k: counted FLOPs of one
    MoE layer's forward, exactly (T tokens, hidden H, expert and shared widths I, E experts)."""
    from torch.utils.flop_counter import FlopCounterMode

    E, T, H, I = 8, 24, 32, 64
    dense = F.build("llama4", overrides=dict(num_local_experts=E))
    routed = copy.deepcopy(dense)
    route_experts(routed)
    x = torch.randn(T, H, dtype=torch.float64)
    counts = []
    for model in (dense, routed):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model.model.layers[1].feed_forward(x)
        counts.append(counter.get_total_flops())
    shared_and_router = 6 * T * H * I + 2 * T * H * E  # gate / up / down of the shared expert, the router
    assert counts[0] == 6 * T * H * I * E + shared_and_router, counts
    assert counts[1] == 6 * T * H * I * 1 + shared_and_router, counts  # top-1


def test_other_models_unchanged():
    model = F.build("mixtral")
    before = {n: type(m) for n, m in model.named_modules()}
    assert route_experts(model) == []
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_tp_plan_gives_the_experts_this_packages_split():
    """transformers' Llama 4 plan names its experts 'moe_tp_experts' (not implemented here as such); the built-in plan
    drops it and splits the routed experts with style 'experts' (every expert's width), its shared expert and
    dense MLPs column / row-wise as declared."""
    from lightning_scale.tensor_parallel import plan_tensor_parallel

    model = F.build("llama4")
    route_experts(model)
    plan = plan_tensor_parallel(model, None, 2)
    assert plan.styles["model.layers.1.feed_forward.experts"] == "experts"
    assert plan.styles["model.layers.1.feed_forward.shared_expert.down_proj"] == "rowwise"
    assert plan.styles["model.layers.0.feed_forward.gate_proj"] == "colwise"
    placed = plan_tensor_parallel(model, None, 2, expert_parallel=True)
    assert placed.styles["model.layers.1.feed_forward.experts"] == "expert_parallel"
    # plan_tensor_parallel changes nothing: on the dense model (apply_tensor_parallel and parallelize route it first)
    # the experts are not a module it can place, and it says so
    from lightning_scale.config import ConfigError

    with pytest.raises(ConfigError, match="tensor.expert_parallel=True: no experts of Llama4ForCausalLM"):
        plan_tensor_parallel(F.build("llama4"), None, 2, expert_parallel=True)
