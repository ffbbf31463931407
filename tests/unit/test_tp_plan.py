"""Tensor-parallel plans, shard specs and bad input, without processes (planning is pure; tp=1 runs locally)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_scale.config import ConfigError, ParallelConfig
from lightning_scale.models import GPT, gpt_tiny
from lightning_scale.tensor_parallel import (
    ShardSpec,
    apply_tensor_parallel,
    consolidate_state_dict,
    merge_shards,
    plan_tensor_parallel,
    shard_tensor,
    tensor_parallel_state,
    vocab_parallel_cross_entropy,
)
from lightning_scale.tensor_parallel.sharding import make_spec, tp_counted_mask


# ----------------------------------------------------------------------------- shard specs
@pytest.mark.parametrize("size,tp,sections,pad,dim", [(12, 2, 3, False, 0), (10, 4, 1, True, 0), (5, 4, 1, True, 1),
                                                      (8, 4, 1, False, 1), (24, 4, 3, False, 1)])
def test_shard_then_merge_is_identity(size, tp, sections, pad, dim):
    spec = make_spec(dim, size, tp, sections=sections, pad=pad)
    full = torch.randn(size, 3) if dim == 0 else torch.randn(3, size)
    shards = [shard_tensor(full, spec, r) for r in range(tp)]
    assert all(s.shape[dim] == spec.local_size for s in shards)
    assert torch.equal(merge_shards(shards, spec), full)
    if pad:  # padding rows are zeros and sit at the end
        assert torch.count_nonzero(torch.cat(shards, dim).narrow(dim, size, spec.padded - size)) == 0


def test_fused_sections_are_split_per_part():
    spec = make_spec(0, 12, 2, sections=3)  # [q(4) | k(4) | v(4)], 2 heads of 2 per part
    full = torch.arange(12.0)
    assert shard_tensor(full, spec, 0).tolist() == [0, 1, 4, 5, 8, 9]  # q head 0, k head 0, v head 0
    assert shard_tensor(full, spec, 1).tolist() == [2, 3, 6, 7, 10, 11]


def test_unequal_fused_parts_grouped_query_qkv():
    # litgpt's GQA qkv: [q (4 heads) | k (2 groups) | v (2 groups)] of head size 2 at tp=2
    spec = make_spec(0, 16, 2, sections=3, parts=(8, 4, 4), what="attn.qkv out_features")
    assert spec.parts == (8, 4, 4) and spec.local_size == 8
    full = torch.arange(16.0)
    assert shard_tensor(full, spec, 0).tolist() == [0, 1, 2, 3, 8, 9, 12, 13]  # q heads 0-1, k/v group 0
    assert shard_tensor(full, spec, 1).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]  # q heads 2-3, k/v group 1
    assert spec.pieces(1) == ((0, 4, 4), (4, 10, 2), (6, 14, 2))
    both = torch.randn(16, 3), torch.randn(3, 16)
    for dim, x in enumerate(both):
        s = make_spec(dim, 16, 2, parts=(8, 4, 4))
        assert torch.equal(merge_shards([shard_tensor(x, s, r) for r in range(2)], s), x)
    gathered = torch.cat([shard_tensor(full, spec, r) for r in range(2)]).view(1, 16)  # a layer's gathered output
    assert torch.equal(merge_shards(list(gathered.chunk(2, -1)), spec, dim=-1), full.view(1, 16))
    with pytest.raises(ValueError, match="tp=4 does not divide"):  # one k/v row per rank would split a group
        make_spec(0, 12, 4, parts=(8, 2, 2), what="qkv")
    with pytest.raises(ValueError, match="unequal"):
        spec.section_local


def test_replicated_kv_parts_fewer_kv_heads_than_tp():
    # [q (4 heads) | k (2 heads) | v (2 heads)], head size 2, tp=4: each rank 1 q head and the kv head it uses
    spec = make_spec(0, 16, 4, parts=(8, 4, 4), splits=(4, 2, 2), what="qkv")
    assert spec.local_size == 6 and spec.replicated_parts
    full = torch.arange(16.0)
    shards = [shard_tensor(full, spec, r) for r in range(4)]
    assert shards[0].tolist() == [0, 1, 8, 9, 12, 13] and shards[1].tolist() == [2, 3, 8, 9, 12, 13]
    assert shards[3].tolist() == [6, 7, 10, 11, 14, 15]
    assert torch.equal(merge_shards(shards, spec), full)
    w = torch.zeros(6, 3)
    w.tp_spec = spec
    assert tp_counted_mask(w, 0) is None or bool(tp_counted_mask(w, 0).all())
    assert tp_counted_mask(w, 1).view(6, 3)[:, 0].tolist() == [True, True] + [False] * 4  # kv rows: rank 0's
    one = make_spec(0, 4, 4, splits=(1,), what="k_proj")  # one kv head (multi-query) at tp=4
    assert all(shard_tensor(torch.arange(4.0), one, r).tolist() == [0, 1, 2, 3] for r in range(4))
    assert one.local_range(3) == (0, 4)
    with pytest.raises(ValueError, match="cannot be replicated"):
        make_spec(0, 16, 4, parts=(8, 4, 4), splits=(4, 3, 3), what="qkv")


@pytest.mark.parametrize("reader", ["pretrained", "universal"])
def test_unequal_parts_map_to_the_right_rows_of_a_file_or_checkpoint(reader):
    """A flat range of a rank's GQA qkv shard (pretrained read / universal-checkpoint piece) covers exactly the
    rows ``shard_tensor`` gives it."""
    from lightning_scale.checkpoint.engine_pieces import flat_param_piece
    from lightning_scale.pretrained import tp_flat_piece

    spec = make_spec(0, 16, 2, sections=3, parts=(8, 4, 4))
    full = torch.arange(16.0 * 3).view(16, 3) + 1.0
    make = tp_flat_piece if reader == "pretrained" else flat_param_piece
    for rank in range(2):
        want = shard_tensor(full, spec, rank).reshape(-1)
        for start, end in [(0, 24), (5, 20), (11, 13)]:
            flat = torch.full((end - start,), float("nan"))
            piece = make("w", flat, (8, 3), start, spec, rank)
            for chunk, view in zip(piece.chunks, piece.tensors):
                view.copy_(full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))])
            assert torch.equal(flat, want[start:end]), (rank, start, end)


def test_spec_rejects_indivisible_size():
    with pytest.raises(ValueError, match="tp=2 does not divide fc out_features = 7"):
        make_spec(0, 7, 2, what="fc out_features")
    with pytest.raises(ValueError):
        ShardSpec(dim=0, size=12, tp=2, padded=14, sections=3)


# ----------------------------------------------------------------------------- planning (pure)
def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(gpt_tiny(**kw))


def test_gpt_builtin_plan_splits_qkv_per_head_and_shrinks_heads():
    p = plan_tensor_parallel(_gpt(), None, 2)
    styles = {a.name: (a.style.kind, a.style.sections) for a in p.actions}
    assert styles["blocks.0.attn.qkv"] == ("colwise", 3)
    assert styles["blocks.1.mlp.fc"] == ("colwise", 1)
    assert styles["blocks.0.attn.proj"] == ("rowwise", 1)
    assert styles["wte"][0] == "vocab" and styles["lm_head"] == ("colwise", 1)
    assert p.parent_fixes == {"blocks.0.attn": {"n_head": 2}, "blocks.1.attn": {"n_head": 2}}
    assert len(p.actions) == 2 + 4 * 2


def test_example_plan_of_the_issue_is_accepted():
    plan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise",
            "blocks.*.mlp.proj": "rowwise", "wte": "vocab", "lm_head": "vocab_colwise"}
    p = plan_tensor_parallel(_gpt(), plan, 4)
    assert {a.name for a in p.actions} == {a.name for a in plan_tensor_parallel(_gpt(), None, 4).actions}


def test_pattern_matching_nothing_lists_near_misses():
    with pytest.raises(ConfigError, match=r"'blocks\.\*\.attn\.qvk' matches no module.*blocks\.\*\.attn\.qkv"):
        plan_tensor_parallel(_gpt(), {"blocks.*.attn.qvk": "colwise"}, 2)
    with pytest.raises(ConfigError, match="module names look like"):
        plan_tensor_parallel(_gpt(), {"zzzz": "colwise"}, 2)


def test_unknown_style_lists_known_styles():
    with pytest.raises(ConfigError, match=r"unknown style 'columnwise'.*colwise.*rowwise"):
        plan_tensor_parallel(_gpt(), {"blocks.*.attn.qkv": "columnwise"}, 2)


def test_every_style_of_the_installed_transformers_is_implemented_or_refused_by_name():
    """Read from the installed release (not a copied list): each style transformers' tp / ep plans may name parses
    here, or raises the 'not implemented here' ConfigError that names it - never 'unknown style'."""
    tp_module = pytest.importorskip("transformers.integrations.tensor_parallel")
    from lightning_scale.tensor_parallel.styles import parse_style

    styles = sorted(tp_module.ALL_PARALLEL_STYLES)
    assert {"colwise", "rowwise", "replicated_with_grad_allreduce"} <= set(styles)
    for name in styles:
        try:
            parse_style(name, "layers.*.x")
        except ConfigError as err:
            assert "is not implemented here" in str(err) and repr(name) in str(err), (name, str(err))


def test_tp_not_dividing_heads_or_hidden_size():
    with pytest.raises(ConfigError, match=r"tp=2 does not divide the number of heads blocks\.0\.attn\.n_head=3"):
        plan_tensor_parallel(_gpt(n_head=3, d_model=24), None, 2)
    model = nn.Sequential(nn.Linear(8, 7), nn.GELU(), nn.Linear(7, 8))
    with pytest.raises(ConfigError, match="tp=2 does not divide 0 out_features = 7"):
        plan_tensor_parallel(model, {"0": "colwise", "2": "rowwise"}, 2)
    # a vocabulary is padded instead
    assert plan_tensor_parallel(_gpt(vocab_size=61), None, 4).actions[0].weight_spec.padded == 64


def test_wrong_module_type_and_double_match():
    with pytest.raises(ConfigError, match="needs nn.Linear or Conv1D; 'blocks.0.ln1' is LayerNorm"):
        plan_tensor_parallel(_gpt(), {"blocks.*.ln1": "colwise"}, 2)
    with pytest.raises(ConfigError, match="matched by both"):
        plan_tensor_parallel(_gpt(), {"blocks.*.mlp.fc": "colwise", "blocks.0.mlp.fc": "colwise"}, 2)


def test_tied_weights_must_be_split_alike():
    tied = _gpt(tie_weights=True)
    assert plan_tensor_parallel(tied, None, 2).ties == [[("wte", "weight"), ("lm_head", "weight")]]
    with pytest.raises(ConfigError, match="tied parameter wte.weight, lm_head.weight"):
        plan_tensor_parallel(tied, {"lm_head": "vocab_colwise"}, 2)


def test_sequence_parallel_needs_embedding_plan():
    with pytest.raises(ConfigError, match="'wpe': 'sequence_split'"):
        plan_tensor_parallel(_gpt(), {"wte": "vocab", "blocks.*.mlp.fc": "colwise"}, 2, sequence_parallel=True)
    p = plan_tensor_parallel(_gpt(), None, 2, sequence_parallel=True)
    assert {"wpe", "blocks.0.attn", "blocks.1.mlp"} <= {a.name for a in p.actions}


def test_tp_not_dividing_world_size_is_a_config_error():
    with pytest.raises(ConfigError, match="tp=3 x pp=1 does not divide the world size 4"):
        ParallelConfig(tp=3).validate(world_size=4)


# ----------------------------------------------------------------------------- Hugging Face plans
def test_hf_llama_plan_comes_from_the_model():
    import transformers  # a test dependency (pip install transformers); no download: built from a config

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    p = plan_tensor_parallel(model, None, 2)
    styles = {a.name: a.style.name for a in p.actions}
    assert styles["model.layers.1.self_attn.k_proj"] == "colwise"
    assert styles["lm_head"] == "colwise_gather_output" and styles["model.embed_tokens"] == "embedding_rowwise"
    at4 = {a.name: a for a in plan_tensor_parallel(model, None, 4).actions}  # 2 kv heads < tp=4: replicated
    assert at4["model.layers.0.self_attn.k_proj"].weight_spec.splits == (2,)
    assert at4["model.layers.0.self_attn.q_proj"].weight_spec.splits == ()
    cfg6 = transformers.LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                    num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=r"config.num_key_value_heads=2; 2 key/value head\(s\) can be neither"):
        plan_tensor_parallel(transformers.LlamaForCausalLM(cfg6), None, 3)  # tp=3: neither divides nor a multiple
    with pytest.raises(ConfigError, match="project GPT only"):
        plan_tensor_parallel(model, None, 2, sequence_parallel=True)


def test_hf_phi3_fused_projections_stay_split_by_parts():
    """Phi3 declares its fused qkv_proj / gate_up_proj 'colwise_gather_output' feeding 'rowwise_split_input': kept
    split instead ([q_r | k_r | v_r], [gate_r | up_r]) with plain 'rowwise' after them, and each attention reads
    its local head count from its own config view (the shared config is untouched)."""
    from lightning_scale.models import hf_families as F

    model = F.build("phi3")
    p = plan_tensor_parallel(model, None, 2)
    acts = {a.name: a for a in p.actions}
    qkv, gate_up = acts["model.layers.0.self_attn.qkv_proj"], acts["model.layers.0.mlp.gate_up_proj"]
    assert (qkv.style.name, qkv.weight_spec.parts) == ("qkv_colwise", (32, 16, 16)) and not qkv.style.gather_output
    assert (gate_up.style.name, gate_up.weight_spec.sections) == ("packed_colwise", 2)
    assert acts["model.layers.0.self_attn.o_proj"].style.name == "rowwise"
    assert acts["model.layers.0.mlp.down_proj"].style.name == "rowwise"
    assert p.config_views["model.layers.0.self_attn"] == {"num_attention_heads": 2}
    apply_tensor_parallel(model, None, None)  # tp=1: nothing split, no view
    assert model.model.layers[0].self_attn.config is model.config


def test_hf_gpt2_conv1d_qkv_is_split_per_head():
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4,
                                                                 bos_token_id=0, eos_token_id=0))
    p = plan_tensor_parallel(model, None, 2)
    qkv = next(a for a in p.actions if a.name == "transformer.h.0.attn.c_attn")
    assert qkv.style.sections == 3 and qkv.weight_spec.dim == 1  # Conv1D weight is (in, out)
    assert p.parent_fixes["transformer.h.0.attn"] == {"num_heads": 2, "split_size": 16, "embed_dim": 16}
    assert p.ties == [[("transformer.wte", "weight"), ("lm_head", "weight")]]


def test_hf_trainable_activation_scalars_on_split_features_get_their_gradient_summed():
    """Apertus' MLP activation (xIELU) holds trainable scalars (alpha_p, alpha_n) and runs on the split intermediate
    features between up_proj (colwise) and down_proj (rowwise); transformers' own plan leaves it out, so each tp rank's
    gradient of them was a partial sum and the copies drifted (9.4e-7 off one process after 3 float64 steps, nothing
    said). The built-in plan adds it as 'replicated_with_grad_allreduce' (the matrix's apertus tp2 rows: 0.0); modules
    with larger parameters beside split layers are left as the plan says (Llama: nothing added)."""
    from lightning_scale.models import hf_families as F

    plan = plan_tensor_parallel(F.build("apertus"), None, 2)
    summed = {n for n, s in plan.styles.items() if s == "replicated_with_grad_allreduce"}
    assert summed == {f"model.layers.{i}.{m}" for i in range(4) for m in ("mlp.act_fn", "self_attn.q_norm",
                                                                          "self_attn.k_norm")}, summed
    llama = plan_tensor_parallel(F.build("llama"), None, 2)
    assert not any(s == "replicated_with_grad_allreduce" for s in llama.styles.values())


# ----------------------------------------------------------------------------- apply at tp=1 (no processes)
def test_apply_at_tp1_keeps_outputs_keys_and_refuses_a_second_time():
    model = _gpt(vocab_size=61).double()
    ref = _gpt(vocab_size=61).double()
    idx = torch.randint(0, 61, (2, 16))
    apply_tensor_parallel(model, None, None)
    assert torch.allclose(model(idx), ref(idx), atol=1e-12)
    assert abs(model.loss(idx, idx).item() - F.cross_entropy(ref(idx).flatten(0, 1), idx.flatten()).item()) < 1e-12
    full = consolidate_state_dict(model)
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert tensor_parallel_state(model).vocab_size == 61
    with pytest.raises(ConfigError, match="already applied"):
        apply_tensor_parallel(model, None, None)


def test_vocab_parallel_cross_entropy_at_tp1_is_cross_entropy():
    logits = torch.randn(4, 7, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (4, 7))
    targets[0, 0] = -100
    got = vocab_parallel_cross_entropy(logits, targets, None)
    assert abs(got.item() - F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()) < 1e-12


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_at_tp1_matches_torch(norm_type):
    from lightning_scale.tensor_parallel import clip_grad_norm_, tp_replicated

    model, ref = _gpt().double(), _gpt().double()
    apply_tensor_parallel(model, None, None)
    idx = torch.randint(0, 64, (2, 16))
    model.loss(idx, idx).backward()
    F.cross_entropy(ref(idx).flatten(0, 1), idx.flatten()).backward()
    total = clip_grad_norm_(model, 0.1, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=norm_type)
    assert abs(total.item() - expected.item()) < 1e-12 and total.item() > 0.1
    assert all(torch.allclose(a.grad, b.grad, atol=1e-14) for a, b in zip(model.parameters(), ref.parameters()))
    assert not tp_replicated(model.blocks[0].attn.qkv.weight) and tp_replicated(model.blocks[0].ln1.weight)


def test_find_plannable_module_inside_a_wrapper():
    from lightning_scale.tensor_parallel import find_plannable_module

    class Wrapper(nn.Module):  # like a LightningModule holding self.model
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(2, 2)
            self.model = _gpt()

    wrapper = Wrapper()
    assert find_plannable_module(wrapper) == ("model", wrapper.model)
    with pytest.raises(ConfigError, match="no module with a built-in tensor-parallel plan"):
        find_plannable_module(nn.Sequential(nn.Linear(2, 2)))


def test_split_summary_and_the_startup_row_name_what_tp_left_whole():
    """The startup table's "tensor parallel" row: the share of the parameters tp split (a split one counted at its
    global size, from its ShardSpec) and the largest groups it left whole; a model whose plan splits little (an MoE
    whose own tp_plan covers attention only: its 3-D expert weights stay whole on every rank, Mixtral at tp=2: 16%)
    gets a WARNING in that row."""
    from lightning_scale.strategies.report import tensor_parallel_row
    from lightning_scale.tensor_parallel.state import split_summary

    def model(expert_size: int) -> nn.Module:
        m = nn.Module()
        m.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.fc = nn.Linear(8, 8, bias=False)  # this rank's half of a 16 x 8 column-parallel weight
            layer.fc.weight.tp_spec = make_spec(0, 16, 2)
            layer.norm = nn.LayerNorm(8, bias=False)
            layer.experts = nn.Parameter(torch.zeros(expert_size, 8))
            m.layers.append(layer)
        return m

    dense = split_summary(model(1), 2)
    assert (dense["split"], dense["total"]) == (2 * 128, 2 * 128 + 2 * 8 + 2 * 8)
    assert dense["replicated"] == [("layers.*.experts", 16), ("layers.*.norm.weight", 16)]
    row = tensor_parallel_row(dense)
    assert row == ("tensor parallel", "89% of 288 parameters split over tp=2; replicated on every tp rank: "
                                      "layers.*.experts (16), layers.*.norm.weight (16)")
    moe = split_summary(model(64), 2)
    assert moe["replicated"][0] == ("layers.*.experts", 1024) and moe["fraction"] < 0.5
    assert "WARNING: most parameters are not split" in tensor_parallel_row(moe)[1]
    assert tensor_parallel_row(None) is None


def test_hf_stablelm_and_bitnet_get_the_llama_plan_and_qk_layernorm_is_refused():
    """StableLM's and BitNet's configs declare no tp plan, but their layers have the Llama layout: transformers' Llama
    plan (the vocabulary-parallel embedding, q/k/v and gate/up column-wise, o/down row-wise, the gathered head), and
    BitNet's sub-layer RMSNorms over the split features kept split (style rmsnorm_split); the test matrix checks tp=2
    against one process. StableLM's per-head q/k LayerNorm lists (qk_layernorm=True) are not split: refused."""
    from lightning_scale.models import hf_families as F

    model = F.build("stablelm")
    styles = plan_tensor_parallel(model, None, 2).styles
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert styles["model.layers.3.mlp.down_proj"] == "rowwise"
    assert styles["model.embed_tokens"] == "embedding_rowwise" and styles["lm_head"] == "colwise_gather_output"
    with pytest.raises(ConfigError, match=r"StableLmForCausalLM with config.qk_layernorm=True"):
        plan_tensor_parallel(F.build("stablelm", overrides=dict(qk_layernorm=True)), None, 2)
    bitnet = plan_tensor_parallel(F.build("bitnet"), None, 2).styles  # + its sub-layer norms over split features
    assert bitnet["model.layers.0.self_attn.attn_sub_norm"] == bitnet["model.layers.0.mlp.ffn_sub_norm"] == \
        "rmsnorm_split"
    with pytest.raises(ConfigError, match=r"'rmsnorm_split' on 'model.layers.0.input_layernorm': Gemma3RMSNorm is not "
                                          r"a Llama-form RMSNorm"):  # Gemma's (1 + weight): refused by name
        plan_tensor_parallel(F.build("gemma3"), {"model.layers.*.self_attn.q_proj": "colwise",
                                                 "model.layers.0.input_layernorm": "rmsnorm_split"}, 2)
