"""Expert parallelism over tp (style ``expert_parallel``, ``Zero3DStrategy(tp=N, expert_parallel=True)``): whole
experts per rank, and the refusals.

Every expert layout transformers records, with per-expert biases (which style ``experts`` refuses), placed over tp
ranks by :func:`placed_specs` and run through transformers' own ``batched_mm`` experts on each rank's experts with
only the routes to them, one per row (:func:`local_routes`, the module's ``num_experts`` the local count): the
ranks' outputs, each route added to its token's row, sum to the whole module's output (what the region's all-reduce
does), in float64. Run with every route instead, each rank computes other ranks' routes on its own experts and the
check fails. The 2-rank runs of real models, gradients and
the checkpoint are tests/dist/test_tp_expert_parallel.py.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.tensor_parallel.expert_parallel import local_routes, placed_specs, unsupported
from lightning_scale.tensor_parallel.sharding import shard_tensor

E, H, I, TOKENS, TOP_K = 4, 8, 6, 10, 2


def _experts(*, is_transposed=False, has_gate=True, is_concatenated=True, has_bias=False, impl="batched_mm",
             experts=E, width=I):
    moe = pytest.importorskip("transformers.integrations.moe")

    @moe.use_experts_implementation(is_transposed=is_transposed, has_gate=has_gate, is_concatenated=is_concatenated,
                                    has_bias=has_bias)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = experts
            rows = 2 * width if has_gate else width
            up = (experts, H, rows) if is_transposed else (experts, rows, H)
            name = "gate_up_proj" if has_gate else "up_proj"
            setattr(self, name, nn.Parameter(torch.randn(up, dtype=torch.float64)))
            self.down_proj = nn.Parameter(torch.randn((experts, width, H) if is_transposed else (experts, H, width),
                                                      dtype=torch.float64))
            if has_bias:
                setattr(self, f"{name}_bias", nn.Parameter(torch.randn(experts, rows, dtype=torch.float64)))
                self.down_proj_bias = nn.Parameter(torch.randn(experts, H, dtype=torch.float64))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the configured implementation runs, not this")

        if not is_concatenated:
            def _apply_gate(self, gate_up):  # interleaved [g0, u0, g1, u1, ...] (GPT-OSS's layout)
                return self.act_fn(gate_up[..., ::2]) * gate_up[..., 1::2]

    torch.manual_seed(0)
    return Experts(types.SimpleNamespace(_experts_implementation=impl))


def _inputs():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(TOKENS, H, dtype=torch.float64, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(TOKENS)])
    w = torch.rand(TOKENS, TOP_K, dtype=torch.float64, generator=g)
    return h, idx, w


def _sum_of_ranks(module, specs, tp, mask=True):
    h, idx, w = _inputs()
    dtype = next(module.parameters()).dtype
    h, w = h.to(dtype), w.to(dtype)
    total, local_n = 0, module.num_experts // tp
    for rank in range(tp):
        local = copy.deepcopy(module)
        for pname, spec in specs.items():
            setattr(local, pname, nn.Parameter(shard_tensor(getattr(module, pname).detach(), spec, rank)))
        local.num_experts = local_n
        if mask:
            token, slot, ids = local_routes(idx, rank * local_n, local_n)
            out = local(h[token], ids.unsqueeze(1), w[token, slot].unsqueeze(1))
            total = total + torch.zeros_like(h).index_add(0, token, out)
        else:
            total = total + local(h, idx % local_n, w)
    return total, module(h, idx, w)


LAYOUTS = {
    "concatenated": {},
    "transposed": {"is_transposed": True},
    "interleaved_biases": {"is_concatenated": False, "is_transposed": True, "has_bias": True},  # GPT-OSS
    "no_gate": {"has_gate": False},
    "biases": {"has_bias": True},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("tp", [2, 4])
def test_every_layout_placed_sums_to_the_whole(layout, tp):
    module = _experts(**LAYOUTS[layout])
    specs = placed_specs("mlp.experts", module, tp)
    assert set(specs) == {n for n, _ in module.named_parameters()}
    assert all(s.dim == 0 and s.local_size == E // tp for s in specs.values())
    got, want = _sum_of_ranks(module, specs, tp)
    assert (got - want).abs().max().item() < 1e-12


def test_unmasked_routes_are_caught():
    module = _experts()
    got, want = _sum_of_ranks(module, placed_specs("e", module, 2), 2, mask=False)
    assert (got - want).abs().max().item() > 1e-3


def test_local_routes():
    idx = torch.tensor([[0, 3], [2, 1], [5, 4]])
    token, slot, ids = local_routes(idx, 2, 2)  # experts 2 and 3 of 6 on this rank
    assert (token.tolist(), slot.tolist(), ids.tolist()) == ([0, 1], [1, 0], [1, 0])


@pytest.mark.parametrize("impl", ["eager_template", "batched_mm", "grouped_mm"])
def test_every_implementation_runs_the_local_routes_and_none(impl):
    """transformers' batched_mm / grouped_mm and an eager loop of transformers' template run the local routes (one per
    row); a rank with no route to its experts gets an empty call and adds nothing."""
    moe = pytest.importorskip("transformers.integrations.moe")
    module = _experts(impl="eager" if impl == "eager_template" else impl)
    if impl == "eager_template":  # transformers' MoE template (Mixtral's eager forward), on this module
        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
                e = e[0]
                if e == self.num_experts:
                    continue
                pos, tok = torch.where(mask[e])
                gate, up = nn.functional.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, y)
            return out

        module.forward = types.MethodType(forward, module)
    if impl == "grouped_mm":  # float32 / bfloat16 only, 16-byte strides: 4 float32 per row at least
        module = _experts(impl=impl, width=8).float()
    del moe
    dtype = next(module.parameters()).dtype
    specs = placed_specs("e", module, 2)
    got, want = _sum_of_ranks(module, specs, 2)
    tol = 1e-12 if dtype == torch.float64 else 1e-4 * want.abs().max().item()
    assert (got - want).abs().max().item() < tol
    local = copy.deepcopy(module)
    local.num_experts = E // 2
    for pname, spec in specs.items():
        setattr(local, pname, nn.Parameter(shard_tensor(getattr(module, pname).detach(), spec, 0)))
    empty = local(torch.zeros(0, H, dtype=dtype), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=dtype))
    assert empty.shape == (0, H)


def _wrap(module):
    model = nn.Module()
    model.experts = module
    return model


def test_refusals_name_the_reason():
    from lightning_scale.tensor_parallel.plan import plan_tensor_parallel

    with pytest.raises(ConfigError, match="tp=2 does not divide the number of experts of 'experts'"):
        plan_tensor_parallel(_wrap(_experts(experts=3)), {"experts": "expert_parallel"}, 2)
    assert "not a transformers experts module" in unsupported(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="style 'expert_parallel' on 'experts'.*not a transformers experts"):
        plan_tensor_parallel(_wrap(nn.Linear(2, 2)), {"experts": "expert_parallel"}, 2)

    class Block(nn.Module):  # litgpt's LLaMAMoE layout: a gate and an experts list of MLPs
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2, bias=False)
            self.experts = nn.ModuleList(nn.Module() for _ in range(2))
            for e in self.experts:
                e.fc_1, e.fc_2, e.proj = nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 4)

    why = unsupported(Block())
    assert "hold them in a lightning_scale.nn.ExpertList" in why and "split every expert over tp with style 'experts'" \
        in why, why
    with pytest.raises(ConfigError, match="tensor.expert_parallel=True: 'experts': .*mixture-of-experts block"):
        plan_tensor_parallel(_wrap(Block()), {"experts": "experts"}, 2, expert_parallel=True)


def test_strategy_settings_are_checked_before_training():
    from lightning_scale.strategies import Zero3DStrategy

    with pytest.raises(ConfigError, match=r"^expert_parallel=True needs tp > 1"):
        Zero3DStrategy(expert_parallel=True)
    with pytest.raises(ConfigError, match=r"^expert_parallel='yes' must be True or False"):
        Zero3DStrategy(tp=2, expert_parallel="yes")
    assert Zero3DStrategy(tp=2, expert_parallel=True).config.tensor.expert_parallel is True


def test_builtin_plan_places_hugging_face_experts_and_refuses_what_it_cannot():
    pytest.importorskip("transformers")
    from lightning_scale.models import hf_families as F
    from lightning_scale.tensor_parallel.plan import plan_tensor_parallel

    qwen = plan_tensor_parallel(F.build("qwen2_moe", "eager"), None, 2, expert_parallel=True).styles
    assert [qwen[f"model.layers.1.mlp.{n}"] for n in ("experts", "shared_expert.gate_proj", "shared_expert.down_proj")
            ] == ["expert_parallel", "colwise", "rowwise"]  # the shared expert (dense) is split as before
    assert "model.layers.1.mlp.gate" not in qwen  # the router stays whole
    # a plan of one's own naming the experts with 'experts' places them under expert_parallel=True
    own = plan_tensor_parallel(F.build("mixtral", "eager"), {"model.layers.*.mlp.experts": "experts"}, 2,
                               expert_parallel=True).styles
    assert own == {f"model.layers.{i}.mlp.experts": "expert_parallel" for i in range(4)}, own
    # 3 experts over tp=2: left whole and named, and expert parallelism asked for has nothing to place
    with pytest.raises(ConfigError, match=r"tensor.expert_parallel=True: no experts of MixtralForCausalLM can be "
                                          r"placed.*tp=2 does not divide the number of experts"):
        plan_tensor_parallel(F.build("mixtral", "eager", overrides={"num_local_experts": 3}), None, 2,
                             expert_parallel=True)
    with pytest.raises(ConfigError, match="no experts of LlamaForCausalLM can be placed.*no transformers experts"):
        plan_tensor_parallel(F.build("llama", "eager"), None, 2, expert_parallel=True)
    # GPT-OSS: per-expert biases placed whole with their experts; its eager forward gets the local routes only
    gpt_oss = plan_tensor_parallel(F.build("gpt_oss", "eager"), None, 2, expert_parallel=True).styles
    assert gpt_oss["model.layers.0.mlp.experts"] == "expert_parallel"
    # DBRX: its experts as 2-D rows indexed by the global expert id: split (style experts), never placed, and said so
    assert plan_tensor_parallel(F.build("dbrx", "eager"), None, 2).styles["transformer.blocks.0.ffn.experts"] == \
        "experts"
    with pytest.raises(ConfigError, match="no experts of DbrxForCausalLM can be placed.*DBRX.*style 'experts'"):
        plan_tensor_parallel(F.build("dbrx", "eager"), None, 2, expert_parallel=True)


def test_the_memory_plan_counts_placed_experts_per_rank():
    """A placed unit: full-width experts, each rank runs 1 / tp of the routes: every expert matmul's input and output
    counted at 1 / tp of the whole unit's (split experts read the whole hidden state on each of the k routes), and
    the hidden rows gathered for the local routes."""
    pytest.importorskip("transformers")
    from lightning_scale.activation_count import _expert_matmuls
    from lightning_scale.activation_plan import _units
    from lightning_scale.models import hf_families as F
    from lightning_scale.tensor_parallel.expert_parallel import place_experts

    model = F.build("mixtral", "eager")
    unit = next(u for u in _units(model) if any(True for _ in u.parameters()))
    whole = _expert_matmuls(unit, 1)
    experts = model.model.layers[0].mlp.experts
    for hook in place_experts("e", experts, placed_specs("e", experts, 2), None):  # a group of one: identities
        hook.remove()
    assert experts.num_experts == E // 2 and experts.gate_up_proj.shape[0] == E // 2
    hidden = experts.gate_up_proj.shape[2]  # + the gathered hidden rows of the local routes
    assert _expert_matmuls(unit, 2) == [(i / 2, o / 2) for i, o in whole] + [(hidden / 2, 0.0)]


def test_the_startup_table_says_the_experts_are_placed():
    from lightning_scale.strategies.report import tensor_parallel_row

    row = tensor_parallel_row({"tp": 2, "split": 99, "total": 100, "fraction": 0.99, "replicated": [],
                               "experts_placed": (4, 2, 4)})
    assert "experts placed whole (expert_parallel) in 4 layers: 2 of 4 per rank" in row[1]


def test_uneven_routes_over_the_tp_ranks_warn():
    """The placed experts count the routes per tp rank as they run (every rank routes alike); the Trainer's check after
    step 1 prints them and warns when the busiest rank runs > 1.25x an even share. A Mixtral whose routers are zero
    (GPT-OSS starts so) sends every token to the same two experts, both on one rank: 2.0x, a warning naming the cause
    and expert_parallel=False; the same model with its own routers: no warning."""
    import types as pytypes
    import warnings

    pytest.importorskip("transformers")
    from lightning_scale.models import hf_families as F
    from lightning_scale.strategies.expert_load import ExpertLoad
    from lightning_scale.tensor_parallel.expert_parallel import place_experts, route_load

    def run(zero_routers):
        model = F.build("mixtral", "eager")
        for layer in model.model.layers:
            if zero_routers:
                with torch.no_grad():
                    layer.mlp.gate.weight.zero_()
            e = layer.mlp.experts
            place_experts("e", e, placed_specs("e", e, 2), None)  # a group of one: rank 0 of tp=2, its hooks count
        strategy = pytypes.SimpleNamespace(lightning_module=model, config=pytypes.SimpleNamespace(ep=1),
                                           topology=pytypes.SimpleNamespace(
                                               coords=lambda: pytypes.SimpleNamespace(dp=0, sp=0, tp=0)))
        callback = ExpertLoad(strategy)
        x, _ = F.batch(4, 12, seed=0)
        model(input_ids=x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            callback.on_train_batch_end(pytypes.SimpleNamespace(global_step=1), model, None, None, 0)
        return strategy, [str(w.message) for w in caught]

    strategy, warned = run(zero_routers=True)
    (rec,) = strategy.expert_load
    assert sum(rec["routes"]) == 4 * 12 * 2 * 4 and max(rec["routes"]) == sum(rec["routes"]), rec  # all on one rank
    assert rec["ratio"] == 2.0 and len(warned) == 1, (rec, warned)
    assert "2.00x an even share" in warned[0] and "expert_parallel=False" in warned[0], warned
    strategy, warned = run(zero_routers=False)
    assert strategy.expert_load[0]["ratio"] < 1.25 and not warned, (strategy.expert_load, warned)
    model = F.build("mixtral", "eager")
    assert route_load(model) is None  # nothing placed: nothing counted
