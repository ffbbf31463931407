"""The Hugging Face pipeline adapter: the layer chain computes exactly the unsplit model (masks included)."""

import re
import warnings

import pytest
import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.models import hf_families as F
from lightning_scale.models.hf_pipeline import HFDecoderLayer, hf_pipeline_layers
from lightning_scale.pipeline import pipeline_layers

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*eos_token_id.*")

CASES = [(n, a) for n in F.FAMILIES for a in ("eager", "sdpa") if not (n in F.NO_SDPA and a == "sdpa")]


@pytest.mark.parametrize("name,attn", CASES)
def test_chain_equals_model_with_and_without_padding(name, attn):
    model = F.build(name, attn)
    if name in F.NO_PP:  # refused by name, before anything is cut
        with pytest.raises(ConfigError, match=re.escape(F.NO_PP[name])):
            pipeline_layers(model)
        return
    x, _ = F.batch(2, 12, seed=0)
    mask = torch.ones_like(x)
    mask[0, -3:] = 0  # right padding on row 0 (left padding gives NaN rows in HF's own eager attention)
    with torch.no_grad():
        ref = model(input_ids=x).logits
        ref_pad = model(input_ids=x, attention_mask=mask).logits
        out = nn.Sequential(*pipeline_layers(model))(x)  # found through the registered provider
        out_pad = hf_pipeline_layers(model, attention_mask=True)(torch.stack([x, mask], 1))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(out_pad, ref_pad, rtol=0, atol=0)
    from lightning_scale.tensor_parallel.experts import is_experts
    from lightning_scale.tensor_parallel.routed_experts import route_experts

    # hf_families.MOE (the matrix's expert-parallel column) lists exactly the families with experts modules (Llama 4's
    # once its dense experts are routed, as parallelize() does)
    route_experts(model)
    assert any(is_experts(m) for m in model.modules()) == (name in F.MOE), name
    # the unpadded row is untouched, up to rounding: a mixture of experts gathers other rows' tokens into each expert's
    # matmul, and another row count may take another BLAS blocking (PhiMoE: 8.3e-17 on one machine, 0 on another)
    assert (ref_pad[1] - ref[1]).abs().max() <= 1e-12
    assert (ref_pad[0, -3:] - ref[0, -3:]).abs().max() > 1e-4  # the padding mask matters (pad queries)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_a_missing_mask_is_caught(name, monkeypatch):
    """The check above can fail: eager layers without their mask (the bug of issue 14) differ from the model."""
    model = F.build(name, "eager")
    x, _ = F.batch(2, 12, seed=0)
    with torch.no_grad():
        ref = model(input_ids=x).logits
        monkeypatch.setattr(HFDecoderLayer, "_mask", lambda self, h, padding, pos: None)
        out = hf_pipeline_layers(model)(x)
    assert (out - ref).abs().max() > 1e-3


def test_tied_head_shares_the_embedding_parameter():
    model = F.build("gemma", "eager")
    layers = pipeline_layers(model)
    assert layers[-1].head.weight is layers[0].embed[0].weight
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}


def test_found_inside_a_wrapper_and_unsupported_family_named():
    wrapper = nn.Module()
    wrapper.model = F.build("llama", "sdpa")
    assert len(pipeline_layers(wrapper)) == 4 + 2
    from transformers import OPTConfig, OPTForCausalLM  # GPT-2 has its own adapter now (no base_model_pp_plan)

    with pytest.raises(ConfigError, match=r"OPTForCausalLM \(model_type 'opt'\).*pipeline_layers\(\)"):
        pipeline_layers(OPTForCausalLM(OPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, ffn_dim=32,
                                                 vocab_size=32, word_embed_proj_dim=16)))


def test_a_router_auxiliary_loss_is_refused_not_dropped():
    """A mixture of experts with ``output_router_logits=True`` adds the router's load-balancing loss to its loss in
    its own forward; the adapter runs the layers one by one and would train without it, silently: a ConfigError that
    names the setting. Off (the default), the chain equals the model."""
    model = F.build("mixtral", "eager")
    x, _ = F.batch(2, 8, seed=0)
    assert torch.equal(hf_pipeline_layers(model)(x), model(input_ids=x).logits)
    model.config.output_router_logits = True
    with pytest.raises(ConfigError, match=r"MixtralForCausalLM .*output_router_logits=True.*auxiliary"):
        pipeline_layers(model)
    jamba = F.build("jamba", "eager")  # a hybrid whose structure is known here (no pp plan of its own): checked too
    jamba.config.output_router_logits = True
    with pytest.raises(ConfigError, match=r"JambaForCausalLM .*output_router_logits=True.*auxiliary"):
        pipeline_layers(jamba)


def test_a_scaling_outside_the_known_families_is_refused_by_name():
    """Granite's and Cohere's scalings are applied by the adapter (their chains equal the model above); the same
    config attribute on another family is refused, naming it: that family's forward may use it some other way."""
    model = F.build("llama", "eager")
    model.config.logit_scale = 0.5
    with pytest.raises(ConfigError, match=r"config\.logit_scale=0\.5"):
        hf_pipeline_layers(model)


def test_layer_types_map_to_their_masks_and_an_unknown_type_is_refused():
    """Each decoder layer's mask comes from its config.layer_types entry (Llama 4: chunked attention on its rotary
    layers); a type with no known mask function is refused by name, under pp and under Ulysses sp, instead of being
    built as a plain causal mask (Llama 4's chunked layers were, under sp: losses 3.7e-3 off, nothing said)."""
    from lightning_scale.config import ConfigError
    from lightning_scale.sequence_parallel.models import _FullMasks

    model = F.build("llama4", "eager")
    assert [layer.layer_type for layer in hf_pipeline_layers(model)[1:-1]] == model.config.layer_types
    assert "chunked_attention" in model.config.layer_types
    masks = _FullMasks(model, "eager")
    assert masks.by_type and masks.types == {"chunked_attention", "full_attention"} and masks.windowed
    x, _ = F.batch(1, 12, seed=0)
    built = masks.build(1, 12, None, torch.arange(12).unsqueeze(0), "cpu")
    chunked, full = built["chunked_attention"], built["full_attention"]
    assert chunked[0, 0, 9, 7].item() < -1e30 and full[0, 0, 9, 7].item() == 0  # position 9 sees 7 only unchunked
    model.config.layer_types[0] = "moba_attention"  # a type no mask function is known for here
    with pytest.raises(ConfigError, match="'moba_attention'"):
        hf_pipeline_layers(model)
    with pytest.raises(ConfigError, match="'moba_attention'"):
        _FullMasks(model, "eager")


def test_nanochat_runs_its_weightless_norm_on_the_first_and_the_last_stage():
    """NanoChat norms its embeddings with the module that norms the last layer's output; that norm has no weights,
    so the first stage (after the embedding) and the last (before the head) each run it (refused before); with
    weights it would live in two stages: refused by name."""
    model = F.build("nanochat")
    layers = pipeline_layers(model)
    assert layers[0].embed[1] is model.model.norm and layers[-1].post[0] is model.model.norm
    model.model.norm = nn.RMSNorm(model.config.hidden_size, dtype=torch.float64)
    with pytest.raises(ConfigError, match="norms its embeddings with the module that norms the last layer's output"):
        pipeline_layers(model)


def test_falcon_variants_the_adapter_and_the_plan_cannot_run_are_refused_by_name():
    """Falcon (rotary, new or old decoder layout) runs under pp / tp / ZeRO-3 (the matrix); its ALiBi variant (the base
    model adds every head's bias onto the mask) is refused by pp and tp, the old layout with multi-query attention
    (one key / value head after all the queries in the fused projection) by tp."""
    from lightning_scale.tensor_parallel.hf import hf_plan

    alibi = F.build("falcon", "eager", overrides={"alibi": True})
    with pytest.raises(ConfigError, match=r"config\.alibi=True"):
        pipeline_layers(alibi)
    with pytest.raises(ConfigError, match=r"config\.alibi=True: the base model adds every head's ALiBi bias"):
        hf_plan(alibi)
    mqa = F.build("falcon", "eager", overrides={"new_decoder_architecture": False, "multi_query": True})
    with pytest.raises(ConfigError, match=r"config\.multi_query=True with the old decoder layout"):
        hf_plan(mqa)
    assert len(pipeline_layers(mqa)) == 4 + 2  # pp runs it
    assert "transformer.h.*.self_attention.query_key_value" in hf_plan(F.build("falcon", "eager"))
    # a flag set to True is refused: `True in (None, False, 1, 1.0)` holds, so flags passed as the neutral scale 1
    bidirectional = F.build("gemma3", "eager", overrides={"use_bidirectional_attention": True})
    with pytest.raises(ConfigError, match=r"config\.use_bidirectional_attention=True"):
        pipeline_layers(bidirectional)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_token_ids_ride_exactly_in_any_float_dtype_and_the_streams_come_back(dtype):
    """DeepSeek-V4's stages carry its hyper-connection streams flattened and the token ids (its hash-routed layers pick
    experts by id) as three base-256 digits: exact in bfloat16 / float16 too, where an id as one channel is not (129279
    in bfloat16 is 129024)."""
    from lightning_scale.models.hf_pipeline import _Carry

    carry = _Carry(width=8, streams=2, ids=True)
    ids = torch.tensor([[0, 1, 255, 256, 129279], [65535, 65536, 2 ** 24 - 1, 7, 100000]])
    streams = torch.randn(2, 5, 2, 8).to(dtype)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    x = carry.join(streams, ids, mask)
    assert x.shape == (2, 5, 2 * 8 + 3 + 1) and x.dtype == dtype
    back, back_ids, back_mask, _ = carry.split(x, None)
    assert torch.equal(back_ids, ids) and torch.equal(back_mask, mask) and torch.equal(back, streams)
    assert torch.tensor(129279.0).to(torch.bfloat16).item() != 129279  # why one channel would not do
    # Hunyuan 4: each token's top-k picks ride too (its "shared" layers reuse the previous layer's), padded with the
    # first pick where the sequence is shorter than index_topk (a set of positions: the same mask)
    with_picks = _Carry(width=8, streams=2, ids=False, picks=4)
    picks = torch.tensor([[[3, 1, 0], [70000, 2, 2]]], dtype=torch.int32)
    back, _, _, back_picks = with_picks.split(with_picks.join(streams[:1, :2], None, None, picks), False)
    assert torch.equal(back_picks, torch.cat([picks, picks[..., :1]], -1)) and torch.equal(back, streams[:1, :2])


def test_hyper_connection_streams_are_refused_where_the_adapter_does_not_carry_them():
    """A config with hc_mult > 1 (several residual streams between layers) outside the families whose streams the
    adapter carries (DeepSeek-V4) is refused by name: a stage would have cut the streams' layout silently."""
    model = F.build("llama", "eager")
    model.config.hc_mult = 4
    with pytest.raises(ConfigError, match=r"config\.hc_mult=4"):
        hf_pipeline_layers(model)
    v4 = F.build("deepseek_v4", "eager")
    v4.config.vocab_size = 2 ** 24 + 1  # more ids than three digits carry
    with pytest.raises(ConfigError, match=r"vocab_size=16777217"):
        hf_pipeline_layers(v4)
