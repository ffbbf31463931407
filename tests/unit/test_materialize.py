"""The deferred-init contract (lightning_scale/materialize.py) that ZeRO-3, tp and pipelines share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_scale.materialize import has_meta, init_owners, materialize_, swap_in


def test_gpt_built_on_meta_materializes_to_the_plain_init_bit_for_bit():
    from lightning_scale.models import GPT, gpt_tiny

    cfg = gpt_tiny(n_layer=2, tie_weights=True)
    torch.manual_seed(3)
    ref = GPT(cfg)
    torch.manual_seed(3)
    with torch.device("meta"):
        model = GPT(cfg)
    params = list(model.parameters())
    assert materialize_(model, torch.device("cpu"), lambda name, m: True) == sum(p.numel() for p in params)
    assert not has_meta(model, recurse=True)
    assert all(a is b for a, b in zip(params, model.parameters()))  # same objects: optimizers keep them
    assert model.lm_head.weight is model.wte.weight
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def test_keep_materializes_only_the_selected_modules():
    from lightning_scale.models import GPT, gpt_tiny

    with torch.device("meta"):
        model = GPT(gpt_tiny(n_layer=2))
    materialize_(model, torch.device("cpu"), lambda name, m: name.startswith("blocks.1"))
    assert not has_meta(model.blocks[1], recurse=True)
    assert model.blocks[0].attn.qkv.weight.is_meta and model.wte.weight.is_meta


def test_hugging_face_model_uses_its_own_init_weights():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   initializer_range=0.02)
    ref = transformers.LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert any(name == "model" for name, _ in init_owners(model))  # the PreTrainedModel owns its modules
    materialize_(model, torch.device("cpu"), lambda name, m: True)
    assert not has_meta(model, recurse=True)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # normal(0, initializer_range), not nn.Linear's kaiming-uniform (std ~0.1 at fan-in 32)
            assert abs(p.std().item() - 0.02) < 0.006, (name, p.std().item())
    for (name, a), b in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(a, b), name  # rotary frequencies recomputed, not left as empty memory


def test_swap_in_keeps_identity_and_attributes():
    p = nn.Parameter(torch.empty(3, 4, device="meta"))
    p.tp_spec = "marker"
    swap_in(p, torch.zeros(3, 4))
    assert not p.is_meta and p.tp_spec == "marker" and p.requires_grad and p.shape == (3, 4)


def test_every_hugging_face_family_built_in_the_strategy_context_has_the_plain_builds_buffers():
    """configure_model runs under parameters_on_meta (the ZeRO-3 / tp / pp context): parameters on meta, buffers
    computed as in a plain build. Under `torch.device("meta")` buffers came out of materialization as uninitialized
    memory where nothing else sets them: Falcon-H1's non-persistent mup_vector (in no checkpoint: written by
    FalconH1Model's branch of _init_weights, not its own module's) and Apertus' xIELU beta / eps (no branch at all),
    so those models computed wrong outputs, silently; GPT-J / CodeGen's rotary table differed by float32 rounding.
    Every family of hf_families: the same buffers, bit for bit, and the same logits once given the same parameters."""
    pytest.importorskip("transformers")
    import warnings

    from lightning_scale.materialize import parameters_on_meta
    from lightning_scale.models import hf_families as F

    warnings.filterwarnings("ignore")
    bad = {}
    for name in F.FAMILIES:
        real = F.build(name, "eager")
        with parameters_on_meta():
            built = F.build(name, "eager")
        assert all(p.is_meta for p in built.parameters()), name  # the model's parameters are never held
        materialize_(built, torch.device("cpu"), lambda n, m: True)
        theirs = dict(built.named_buffers())
        bad.update({f"{name}: {n}": float((b.double() - theirs[n].double()).abs().max())
                    for n, b in real.named_buffers() if not torch.equal(b, theirs[n])})
        if name in ("falcon_h1", "apertus"):
            built.load_state_dict(real.state_dict())
            x, _ = F.batch(2, 8, seed=0)
            with torch.no_grad():
                assert torch.equal(built(input_ids=x).logits, real(input_ids=x).logits), name
    assert not bad, bad


def test_parameters_on_meta_moves_parameters_only_and_materialize_moves_the_buffers():
    from lightning_scale.materialize import allocate_, parameters_on_meta

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.gain = nn.Parameter(torch.full((4,), 2.0))  # created with data: dropped to meta too
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with parameters_on_meta():
        m = Scaled()
    assert m.lin.weight.is_meta and m.gain.is_meta and isinstance(m.gain, nn.Parameter)
    assert torch.equal(m.table, torch.arange(4.0))
    assert not Scaled().lin.weight.is_meta  # the patch is undone on exit
    allocate_(m, torch.device("meta"))  # another device than the buffers': they follow the parameters
    assert m.table.is_meta


@pytest.mark.gpu
def test_buffers_computed_at_construction_follow_the_parameters_to_the_gpu():
    """A Hugging Face model built under parameters_on_meta holds its buffers (rotary inv_freq) on the CPU; materializing
    it on a GPU moves them there with the parameters, and it runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    from lightning_scale.materialize import parameters_on_meta
    from lightning_scale.models import hf_families as F

    with parameters_on_meta():
        model = F.build("llama", "sdpa", dtype=torch.float32)
    device = torch.device("cuda")
    materialize_(model, device, lambda n, m: True)
    assert all(t.device.type == "cuda" for t in list(model.parameters()) + list(model.buffers()))
    x, _ = F.batch(2, 8, seed=0)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=x.to(device)).logits).all()
