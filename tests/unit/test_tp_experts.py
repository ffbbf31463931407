"""Tensor-parallel experts (style ``experts``): the split of each expert layout transformers records, and the refusals.

Every layout ``use_experts_implementation`` declares (``[gate | up]`` concatenated or interleaved, transposed or not,
no gate) is split by :func:`expert_specs`; run through transformers' own ``batched_mm`` / ``grouped_mm`` experts
implementation on each rank's slices, the slices' outputs sum to the whole module's output (what the all-reduce of
the tp region does), in float64. A wrong cut (the interleaved layout cut as two sections, the down projection along
the wrong dim) fails it. The dist test (tests/dist/test_tp_experts_dist.py) runs real Mixtral / Qwen2-MoE at tp=2.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel.experts import expert_specs, unsupported
from lightning_scale.tensor_parallel.sharding import shard_tensor

E, H, I, TOKENS, TOP_K = 4, 8, 6, 10, 2


def _experts(*, is_transposed=False, has_gate=True, is_concatenated=True, has_bias=False, post_norm=False,
             impl="batched_mm", width=I):
    moe = pytest.importorskip("transformers.integrations.moe")

    @moe.use_experts_implementation(is_transposed=is_transposed, has_gate=has_gate, is_concatenated=is_concatenated,
                                    has_bias=has_bias, has_post_expert_norm=post_norm)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            rows = 2 * width if has_gate else width
            up = (E, H, rows) if is_transposed else (E, rows, H)
            setattr(self, "gate_up_proj" if has_gate else "up_proj", nn.Parameter(torch.randn(up, dtype=torch.float64)))
            self.down_proj = nn.Parameter(torch.randn((E, width, H) if is_transposed else (E, H, width),
                                                      dtype=torch.float64))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the configured implementation runs, not this")

        if not is_concatenated:
            def _apply_gate(self, gate_up):  # interleaved [g0, u0, g1, u1, ...] (GPT-OSS's layout)
                return self.act_fn(gate_up[..., ::2]) * gate_up[..., 1::2]

    torch.manual_seed(0)
    return Experts(types.SimpleNamespace(_experts_implementation=impl))


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(TOKENS, H, dtype=dtype, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(TOKENS)])
    w = torch.rand(TOKENS, TOP_K, dtype=dtype, generator=g)
    return h, idx, w


def _sum_of_slices(module, specs, tp):
    h, idx, w = _inputs(module.down_proj.dtype)
    total = 0
    for rank in range(tp):
        local = copy.deepcopy(module)
        for pname, spec in specs.items():
            setattr(local, pname, nn.Parameter(shard_tensor(getattr(module, pname).detach(), spec, rank)))
        total = total + local(h, idx, w)
    return total, module(h, idx, w)


LAYOUTS = {
    "concatenated": {},  # Mixtral, Qwen2-MoE, DeepSeek, ... (66 families in transformers 5)
    "transposed": {"is_transposed": True},  # Aria
    "interleaved": {"is_concatenated": False, "is_transposed": True},  # GPT-OSS's weights (without its biases)
    "no_gate": {"has_gate": False},  # Nemotron-H
    "no_gate_transposed": {"has_gate": False, "is_transposed": True},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("tp", [2, 3])
def test_every_layout_split_sums_to_the_whole(layout, tp):
    module = _experts(**LAYOUTS[layout])
    specs = expert_specs("mlp.experts", module, tp)
    up_dim, down_dim = (2, 1) if LAYOUTS[layout].get("is_transposed") else (1, 2)
    assert [(s.dim, s.local_size) for s in specs.values()] == [(up_dim, I * (2 if "gate" not in layout else 1) // tp),
                                                                 (down_dim, I // tp)]
    got, want = _sum_of_slices(module, specs, tp)
    assert (got - want).abs().max().item() < 1e-12


def test_grouped_mm_runs_on_the_slices():
    module = _experts(impl="grouped_mm", width=8)  # grouped_mm wants 16-byte strides: 4 float32 per slice row
    module.float()
    got, want = _sum_of_slices(module, expert_specs("e", module, 2), 2)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_a_wrong_cut_is_caught():
    """The checks above can fail: the interleaved layout cut as two [gate | up] sections pairs gates with the wrong
    ups, and the down projection cut along the hidden dim does not line up with the intermediate slices."""
    import dataclasses

    module = _experts(**LAYOUTS["interleaved"])
    specs = expert_specs("e", module, 2)
    wrong = dict(specs, gate_up_proj=dataclasses.replace(specs["gate_up_proj"], sections=2))
    got, want = _sum_of_slices(module, wrong, 2)
    assert (got - want).abs().max().item() > 1e-3
    module = _experts()
    specs = expert_specs("e", module, 2)
    wrong = dict(specs, down_proj=dataclasses.replace(specs["down_proj"], dim=1, size=H, padded=H))
    with pytest.raises(Exception):  # a hidden-dim slice cannot even multiply the intermediate slice
        _sum_of_slices(module, wrong, 2)


@pytest.mark.parametrize("kind, words", [({"post_norm": True}, "normalizes"),
                                         ("plain", "not a transformers experts module")])
def test_unsplittable_experts_are_named(kind, words):
    assert unsupported(_experts(has_bias=True)) is None  # biased experts split (GPT-OSS; tests/dist/test_tp_experts_dist)
    module = nn.Linear(2, 2) if kind == "plain" else _experts(**kind)
    assert words in unsupported(module)
    model = nn.Module()
    model.experts = module
    from lightning_scale.tensor_parallel.plan import plan_tensor_parallel

    with pytest.raises(ConfigError, match=rf"tensor.plan: style 'experts' on 'experts'.*{words}"):
        plan_tensor_parallel(model, {"experts": "experts"}, 2)


def test_a_width_tp_does_not_divide():
    """A user's plan naming such experts: ConfigError naming the width. The built-in plan of a Hugging Face MoE
    leaves them whole instead and records why (the startup table's tensor parallel row prints it)."""
    from lightning_scale.tensor_parallel.plan import plan_tensor_parallel

    model = nn.Module()
    model.experts = _experts(width=5)
    with pytest.raises(ConfigError, match="tp=2 does not divide the intermediate width 5 of the experts 'experts'"):
        plan_tensor_parallel(model, {"experts": "experts"}, 2)
    pytest.importorskip("transformers")
    from lightning_scale.models import hf_families as F

    hf = F.build("mixtral", "eager", overrides={"intermediate_size": 33})
    plan = plan_tensor_parallel(hf, None, 2)
    assert not any(s == "experts" for s in plan.styles.values())
    assert plan.experts_whole == {"model.layers.*.mlp.experts": "tp=2 does not divide the intermediate width 33 of "
                                  "the experts 'model.layers.0.mlp.experts'"}
    from lightning_scale.strategies.report import tensor_parallel_row

    row = tensor_parallel_row({"tp": 2, "split": 1, "total": 2, "fraction": 0.5, "replicated": [],
                               "experts_whole": plan.experts_whole})
    assert "; model.layers.*.mlp.experts left whole: tp=2 does not divide" in row[1]


def test_builtin_plan_splits_moe_experts_and_shared_expert():
    """Mixtral's and Qwen2-MoE's own tp_plan covers attention only; the built-in plan adds their experts and
    Qwen2-MoE's shared expert (a gated MLP next to them)."""
    pytest.importorskip("transformers")
    from lightning_scale.models import hf_families as F
    from lightning_scale.tensor_parallel.plan import plan_tensor_parallel

    mixtral = plan_tensor_parallel(F.build("mixtral", "eager"), None, 2).styles
    assert mixtral["model.layers.0.mlp.experts"] == "experts"
    assert "model.layers.0.mlp.gate" not in mixtral  # the router stays whole
    qwen = plan_tensor_parallel(F.build("qwen2_moe", "eager"), None, 2).styles
    assert [qwen[f"model.layers.1.mlp.{n}"] for n in ("experts", "shared_expert.gate_proj", "shared_expert.up_proj",
                                                      "shared_expert.down_proj")] == [
        "experts", "colwise", "colwise", "rowwise"]
    assert "model.layers.1.mlp.shared_expert_gate" not in qwen


def test_the_estimator_counts_experts_split_at_tp_without_trying_fake_tensors():
    """The memory estimator / autotuner count a mixture-of-experts unit's experts (their routing cannot run on fake
    tensors; with eager attention the rest of the unit is profiled with them stubbed): at tp > 1 every expert's
    intermediate width is now split, so the count uses the local widths. The experts never run on fake tensors: with
    transformers' default grouped_mm experts torch logged that at ERROR level (an 'E...' RuntimeError line in the
    autotuner's output)."""
    import logging

    pytest.importorskip("transformers")
    from lightning_scale.activation_count import _expert_matmuls
    from lightning_scale.activation_plan import _units, profile_model
    from lightning_scale.models import hf_families as F

    model = F.build("mixtral", "eager", dtype=torch.float32, overrides={"experts_implementation": "grouped_mm"})
    logged = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = logged.append
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")  # where torch reports the failed meta kernel
    fake_log.addHandler(handler)
    try:
        whole, split = profile_model(model, seq_len=16, tp=1), profile_model(model, seq_len=16, tp=2)
    finally:
        fake_log.removeHandler(handler)
    assert not logged, [r.getMessage() for r in logged]
    assert whole.source == "profiled" and "experts stubbed" in whole.notes[0], whole.notes  # eager attention
    experts = model.model.layers[0].mlp.experts
    e, two_i, h = experts.gate_up_proj.shape
    unit = next(u for u in _units(model) if any(True for _ in u.parameters()))
    assert _expert_matmuls(unit, 1) == [(h, two_i), (two_i // 2, h)]
    assert _expert_matmuls(unit, 2) == [(h, two_i // 2), (two_i // 4, h)]
    assert split.per_token["saved"] < whole.per_token["saved"]


def test_split_experts_stay_marked_through_materialization_and_copies():
    """A model split on meta is materialized with ``to_empty``, which builds new Parameters: the experts' shard
    specs (read by checkpoints, pretrained reads and gradient norms) are marked again; a deep copy keeps its own."""
    pytest.importorskip("transformers")
    from lightning_scale.models import hf_families as F
    from lightning_scale.tensor_parallel.experts import split_experts
    from lightning_scale.tensor_parallel.sharding import tp_spec

    with torch.device("meta"):
        model = F.build("mixtral", "eager")
    experts = model.model.layers[0].mlp.experts
    specs = expert_specs("e", experts, 2)
    for hook in split_experts("e", experts, specs, None):  # a group of one: the hooks are identities
        hook.remove()
    copied = copy.deepcopy(model).model.layers[0].mlp.experts
    for module in (experts, copied):
        module.to_empty(device="cpu")
        assert {n: tp_spec(getattr(module, n)) for n in specs} == specs
        assert module.gate_up_proj.shape[1] == specs["gate_up_proj"].local_size
