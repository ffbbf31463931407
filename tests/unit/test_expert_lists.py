"""litgpt's MoE block routed (its experts list called on routes) and its experts placed by ownership, in one process.

``lightning_scale.tensor_parallel.expert_lists``: the routed block must be litgpt's ``LLaMAMoE`` bit for bit (plain
top-k router with its float32 softmax, DeepSeek-V3's grouped router, a routed scaling factor, a shared expert), keep
its state-dict keys, pickle (also into a fresh process), and a placed list must keep its experts under their global
names, marked owned (not replicated: a global norm counts them on their rank). Expert counts the ranks do not divide
are refused by name, before anything changes.
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

pytest.importorskip("litgpt", reason="litgpt is not installed (pip install litgpt==0.5.13 --no-deps)")

from lightning_scale.config import ConfigError  # noqa: E402
from lightning_scale.tensor_parallel import expert_lists as L  # noqa: E402

BASE = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64, n_query_groups=2,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMoE", intermediate_size=64, moe_intermediate_size=32,
            n_expert=4, n_expert_per_token=2, n_shared_expert=1, parallel_residual=False, bias=False,
            rotary_percentage=1.0)
ROUTERS = {
    "topk": {},
    # DeepSeek-V3's grouped router (sigmoid scores, 2 groups, best group only, normalized), scaled routes
    "grouped": dict(n_expert_groups=2, n_topk_groups=1, n_topk_scores_per_group=1, norm_topk_prob=True,
                    routed_scaling_factor=2.5),
    "no_shared": dict(n_shared_expert=0),
}


def _gpt(**overrides):
    from litgpt import GPT, Config

    torch.manual_seed(0)
    model = GPT(Config(**{**BASE, **overrides}))
    model.apply(model._init_weights)
    return model.double()


@pytest.mark.parametrize("router", list(ROUTERS))
def test_routed_block_is_litgpts_bit_for_bit(router):
    plain = _gpt(**ROUTERS[router])
    routed = copy.deepcopy(plain)
    assert L.route_blocks(routed) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert L.route_blocks(routed) == []  # a second call finds none
    assert isinstance(routed.transformer.h[0].mlp.experts, L.ExpertList)
    assert list(routed.state_dict()) == list(plain.state_dict())
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    for m in (plain, routed):
        m(x).square().mean().backward()
    assert torch.equal(plain(x), routed(x))
    for (name, a), b in zip(plain.named_parameters(), routed.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name


def test_routed_model_pickles_into_a_fresh_process(tmp_path):
    model = _gpt()
    L.route_blocks(model)
    copy.deepcopy(model)
    path = tmp_path / "routed.pt"
    with open(path, "wb") as f:
        pickle.dump(model, f)
    code = ("import pickle, sys; m = pickle.load(open(sys.argv[1], 'rb')); "
            "print(type(m.transformer.h[0].mlp).__name__, type(m.transformer.h[0].mlp.experts).__name__)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["RoutedLLaMAMoE", "ExpertList"]


def test_a_placed_list_keeps_its_experts_by_name_and_marks_them_owned():
    from lightning_scale.tensor_parallel.sharding import tp_replicated

    model = _gpt()
    L.route_blocks(model)
    experts = model.transformer.h[0].mlp.experts
    whole = copy.deepcopy(experts)
    assert L.keep_local("transformer.h.0.mlp.experts", experts, 2, 1) == 2
    assert list(experts._modules) == ["2", "3"]
    assert experts.num_experts == 2
    names = [n for n, _ in model.named_parameters() if ".mlp.experts." in n and ".h.0." in n]
    assert names and all(n.split(".experts.")[1][0] in "23" for n in names), names
    assert not any(tp_replicated(p) for p in experts.parameters())
    assert tp_replicated(model.transformer.h[0].mlp.gate.weight)
    # local ids 0 / 1 are experts 2 / 3: the same outputs as the whole list's
    rows = torch.randn(5, 32, dtype=torch.float64)
    ids, w = torch.tensor([[0], [1], [1], [0], [1]]), torch.rand(5, 1, dtype=torch.float64)
    assert torch.equal(experts(rows, ids, w), whole(rows, ids + 2, w))
    # .to() rebuilds the parameters: still owned
    model.to(torch.float32)
    assert all(getattr(p, "tp_owned", False) for p in experts.parameters())
    full = model.state_dict().keys() | {f"transformer.h.0.mlp.experts.{e}.fc_1.weight" for e in (0, 1)}
    assert L.foreign_keys(model, full) == {f"transformer.h.0.mlp.experts.{e}.fc_1.weight" for e in (0, 1)}
    with pytest.raises(ValueError, match=r"4 experts of 'b' do not split over 3 ranks"):
        L.keep_local("b", model.transformer.h[1].mlp.experts, 3, 0)


def test_expert_counts_the_ranks_do_not_divide_are_refused_by_name():
    from lightning_scale.tensor_parallel.expert_alltoall import expert_data_parallel_plan
    from lightning_scale.tensor_parallel.plan import plan_tensor_parallel

    model = _gpt(n_expert=3)
    with pytest.raises(ConfigError, match=r"^ep=2: transformer\.h\.0\.mlp\.experts: 3 experts do not split over ep=2"):
        expert_data_parallel_plan(model, 2)
    with pytest.raises(ConfigError, match=r"^tensor\.expert_parallel=True: tp=2 does not divide the number of experts "
                                          r"of transformer\.h\.0\.mlp\.experts = 3"):
        plan_tensor_parallel(_gpt(n_expert=3), None, 2, expert_parallel=True)
    # 4 experts: planned, nothing changed by the plan (the routing happens when it is applied)
    model = _gpt()
    plan = plan_tensor_parallel(model, None, 2, expert_parallel=True)
    assert plan.styles["transformer.h.0.mlp.experts"] == "expert_parallel"
    assert plan.styles["transformer.h.0.mlp.shared_experts.fc_1"] == "colwise"
    assert type(model.transformer.h[0].mlp).__name__ == "LLaMAMoE"
    assert expert_data_parallel_plan(model, 2) == {f"transformer.h.{i}.mlp.experts": "expert_data_parallel"
                                                   for i in (0, 1)}
