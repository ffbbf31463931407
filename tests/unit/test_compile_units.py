"""compile_units on models with many layers (one process, ``aot_eager``: Dynamo + AOTAutograd, no code generation).

* An unchanged Hugging Face Llama of 10 layers compiles ONE graph for its 10 layers and equals eager exactly. Before,
  its training forward kept a KV cache: each layer got its own cache slot, Dynamo guarded on it, compiled one graph per
  layer and, past torch's recompile limit (8), ran the last 2 layers eagerly with nothing in the report.
* Units that really do specialize (a per-layer attribute in Python control flow) are all compiled under ``compile=``
  (the recompile limit is raised to the number of units); under a user's own ``torch.compile`` (torch's limit kept)
  the limit hit is counted in ``compile_stats()["eager_fallbacks"]`` and the Trainer's compile report warns.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from lightning_scale.compile import compile_stats, compile_units

AOT = {"backend": "aot_eager"}


def _delta(before, after):
    return after["graphs"] - before["graphs"], after["eager_fallbacks"] - before["eager_fallbacks"]


def test_hf_llama_of_ten_layers_compiles_one_graph_and_equals_eager():
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_scale.models import hf_families as F

    cfg = AutoConfig.for_model("llama", **dict(F._COMMON, num_hidden_layers=10, num_key_value_heads=2))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    assert model.config.use_cache is True  # the default a user's model has
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    before = compile_stats()
    names = compile_units(model, AOT)
    assert len(names) == 10
    assert model.config.use_cache is False
    x, _ = F.batch(2, 12, seed=0)
    for _ in range(2):
        out, want = model(input_ids=x).logits, ref(input_ids=x).logits
        out.sum().backward()
        want.sum().backward()
        assert torch.equal(out, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert _delta(before, compile_stats()) == (1, 0)  # one graph for ten layers, none left eager


class _Specialized(nn.Module):
    """A block whose forward depends on its position in Python: Dynamo compiles one graph per block."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin, self.index = nn.Linear(4, 4), index

    def forward(self, x):
        for _ in range(self.index):
            x = x + 1
        return self.lin(x)


class _Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Specialized(i) for i in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("how", ["compile_setting", "user_compile"])
def test_units_that_specialize_are_all_compiled_or_the_fallback_is_counted(how):
    import inspect

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Stack(10)
    ref = copy.deepcopy(model)
    before = compile_stats()
    if how == "compile_setting":
        compile_units(model, AOT)
    else:  # a user's own torch.compile: its context compiles the units, torch's recompile limit (8) is kept
        compile_units(model, None, compiler=lambda fn: torch.compile(fn, **AOT))
    x = torch.randn(2, 4)
    out = model(x)
    assert torch.equal(out, ref(x))
    graphs, fallbacks = _delta(before, compile_stats())
    if how == "compile_setting" and "recompile_limit" in inspect.signature(torch.compile).parameters:
        assert (graphs, fallbacks) == (10, 0)
    else:
        assert (graphs, fallbacks) == (8, 1)


def test_compile_report_warns_on_a_recompile_limit_hit(capsys):
    from lightning_scale.strategies.compile_glue import _fallbacks

    assert _fallbacks({"eager_fallbacks": 0}) == ""
    assert "run EAGERLY" in _fallbacks({"eager_fallbacks": 1})


def test_graph_break_reasons_add_up_to_the_total():
    """Reasons that share their first line (Dynamo names the function on a later one) are summed in
    ``break_reasons``, not overwritten: the report's counts add up to ``graph_breaks``."""

    @torch.compiler.disable
    def first(x):
        return x + 1

    @torch.compiler.disable
    def second(x):
        return x * 2

    class Unit(nn.Module):
        def forward(self, x):
            return second(first(x).sin()).cos()

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Unit(), Unit()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch._dynamo.reset()
    model = Two()
    compile_units(model, AOT)
    model(torch.randn(3))
    stats = compile_stats()
    assert stats["graph_breaks"] >= 2
    assert sum(stats["break_reasons"].values()) == stats["graph_breaks"], stats


@pytest.mark.parametrize("setting,value", [("tp", 2), ("sp", 2), ("tiled_mlp", 4), ("tiled_attention", 2)])
def test_fullgraph_with_graph_breaks_inside_the_units_is_a_config_error(setting, value):
    """compile={"fullgraph": True} with what breaks every unit's graph on purpose: a ConfigError naming both settings
    before training (it was Dynamo's "Unsupported: Skip calling torch.compiler.disable()d function" at step 1 on every
    rank); without those, fullgraph is accepted."""
    from lightning_scale.config import ConfigError, from_flat_kwargs

    with pytest.raises(ConfigError, match=rf"compile.fullgraph=True with {setting}={value}: it puts deliberate graph "
                                          r"breaks inside every unit"):
        from_flat_kwargs(compile={"fullgraph": True}, **{setting: value}).validate()
    from_flat_kwargs(compile={"fullgraph": True}, stage=3).validate()
    from_flat_kwargs(compile={"fullgraph": False}, **{setting: value}).validate()


def _hf_llama(layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_scale.models import hf_families as F

    cfg = AutoConfig.for_model("llama", **dict(F._COMMON, num_hidden_layers=layers, num_key_value_heads=2))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), F.batch(2, 12, seed=0)[0]


@pytest.mark.parametrize("ac", [None, "full"])
def test_the_memory_plan_profile_leaves_compiled_hf_units_compiled(ac):
    """The strategy's layout table profiles a unit on fake tensors (a TorchDispatchMode) after ``parallelize`` has
    compiled it. It used to call the compiled inner forward of a checkpointed unit: Dynamo skipped that frame under
    the mode and marked the Hugging Face layer's code skipped for good, so every step ran eagerly (0 graphs, nothing
    said). The profile now runs the eager forward; the units compile at the first real step."""
    pytest.importorskip("transformers")
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.activation_plan import profile_model
    from lightning_scale.compile import units_running_eagerly

    torch._dynamo.reset()
    model, x = _hf_llama()
    if ac:
        checkpoint_units(model, ac)
    names = compile_units(model, AOT)
    prof = profile_model(model, seq_len=12)
    assert prof.source == "profiled", prof.notes
    before = compile_stats()
    model(input_ids=x).logits.sum().backward()
    assert _delta(before, compile_stats()) == (1, 0)
    assert units_running_eagerly(model) == []
    assert len(names) == 2


def test_units_that_ran_eagerly_are_named(monkeypatch):
    """The detector behind the compile report's warning, on the old defect put back: the profile handed the compiled
    inner forward of checkpointed units (Dynamo skipped its code for good); the real step then compiles nothing and
    every unit is named. Before any call no unit has compiled code either; after a good run none is named."""
    pytest.importorskip("transformers")
    import lightning_scale.compile as LC
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.activation_plan import profile_model
    from lightning_scale.compile import units_running_eagerly
    from lightning_scale.strategies.compile_glue import _eager_units

    torch._dynamo.reset()
    model, x = _hf_llama()
    checkpoint_units(model, "full")
    compile_units(model, AOT)
    assert units_running_eagerly(model) == ["model.layers.0", "model.layers.1"]  # nothing ran yet
    with monkeypatch.context() as m:
        m.setattr(LC, "eager_forward", lambda unit: unit.__dict__["_ac_inner_forward"])  # the compiled one
        profile_model(model, seq_len=12)
    before = compile_stats()
    model(input_ids=x).logits.sum().backward()
    assert _delta(before, compile_stats())[0] == 0  # skipped for good: the real step ran eagerly
    eager = units_running_eagerly(model)
    assert eager == ["model.layers.0", "model.layers.1"]
    assert "2 compiled unit(s) ran EAGERLY in step 1 (model.layers.0, model.layers.1)" in _eager_units(eager)
    assert _eager_units([]) == "" and _eager_units(None) == ""
