"""Modules and helpers around SparseSelfAttention: GPT / Hugging Face swaps, the multi-head module,
padding helpers, FlexAttention BlockMask conversion and the Hydra ``attention/`` group."""

import os
import warnings

import pytest
import torch

from lightning_scale.config import ConfigError
from lightning_scale.kernels.block_sparse_attention import dense_reference
from lightning_scale.models.gpt import GPT, GPTConfig, make_batch
from lightning_scale.nn import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseMultiheadAttention,
    SparseSelfAttention,
    VariableSparsityConfig,
    apply_sparse_attention,
    block_mask_to_layout,
    layout_mask_mod,
    layout_to_block_mask,
    pad_inputs_to_block_size,
    pad_to_block_size,
    swap_gpt_attention,
    unpad_sequence_output,
)

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "attention")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt(seed=0, seq_len=64):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, seq_len=seq_len, n_layer=2, n_head=4, d_model=64))


def test_gpt_swap_dense_layout_equals_sdpa_at_any_length():
    dense, sparse = tiny_gpt(), tiny_gpt()
    swap_gpt_attention(sparse, DenseSparsityConfig(num_heads=4, block=16))
    assert all(isinstance(b.attn.core, SparseSelfAttention) and b.attn.core.causal for b in sparse.blocks)
    x, _ = make_batch(dense.cfg, 2, seed=0)
    for length in (64, 37):  # 37: padded to 48 inside the causal core
        torch.testing.assert_close(sparse(x[:, :length]), dense(x[:, :length]), atol=2e-5, rtol=1e-4)


def test_gpt_swap_matches_masked_reference_and_trains():
    model = tiny_gpt()
    cfg = BSLongformerSparsityConfig(num_heads=4, block=16, num_sliding_window_blocks=1, attention="unidirectional")
    swap_gpt_attention(model, cfg)
    core = model.blocks[0].attn.core
    q, k, v = (torch.randn(2, 4, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ref = dense_reference(q, k, v, cfg.make_layout(64), 16, causal=True)
    torch.testing.assert_close(core(q, k, v).double(), ref, atol=1e-6, rtol=0)
    x, y = make_batch(model.cfg, 4, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_swap_none_is_noop_and_head_mismatch_raises():
    model = tiny_gpt()
    core = model.blocks[0].attn.core
    assert apply_sparse_attention(model, None) is model and model.blocks[0].attn.core is core
    with pytest.raises(ConfigError, match="num_heads=2 but the model's attention has n_head=4"):
        apply_sparse_attention(model, FixedSparsityConfig(num_heads=2))
    with pytest.raises(ConfigError, match="no attention"):
        apply_sparse_attention(torch.nn.Linear(2, 2), FixedSparsityConfig(num_heads=2))
    with pytest.raises(ConfigError, match="must be a SparsityConfig"):
        apply_sparse_attention(model, {"num_heads": 4})


def test_multihead_module_matches_manual_computation():
    cfg = BigBirdSparsityConfig(num_heads=2, block=16)
    mha = SparseMultiheadAttention(32, cfg, max_seq_length=64)
    x = torch.randn(2, 64, 32)
    keep = torch.ones(2, 64)
    keep[1, 40:] = 0
    kpm = torch.zeros(2, 64).masked_fill(keep == 0, float("-inf"))
    out = mha(x, key_padding_mask=kpm)
    q, k, v = mha.qkv(x).view(2, 64, 3, 2, 16).permute(2, 0, 3, 1, 4)
    ref = dense_reference(q, k, v, cfg.make_layout(64), 16, key_padding_mask=kpm).float()
    torch.testing.assert_close(out, mha.proj(ref.transpose(1, 2).reshape(2, 64, 32)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="does not divide d_model=30"):
        SparseMultiheadAttention(30, FixedSparsityConfig(num_heads=4))


def test_hugging_face_model_through_attention_interface():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        apply_sparse_attention(model, DenseSparsityConfig(num_heads=4, block=16))
        out = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out[1, :30], ref[1, :30], atol=1e-5, rtol=1e-4)
        assert model._lightning_scale_sparse_cores[True]._plans  # the sparse core ran
        apply_sparse_attention(model, LocalSlidingWindowSparsityConfig(num_heads=4, block=16,
                                                                       num_sliding_window_blocks=1))
        local = model(ids).logits
    assert not torch.allclose(local[:, 20:], ref[:, 20:], atol=1e-3)  # tokens past block 1 lost context
    torch.testing.assert_close(local[:, :16], ref[:, :16], atol=1e-5, rtol=1e-4)  # block 0: same context as dense


def test_padding_helpers():
    x = torch.randn(2, 50, 8)
    padded, pad = pad_to_block_size(x, 16, dim=1)
    assert padded.shape == (2, 64, 8) and pad == 14 and bool((padded[:, 50:] == 0).all())
    assert torch.equal(unpad_sequence_output(pad, padded), x)
    assert pad_to_block_size(x[:, :48], 16)[1] == 0
    ids = torch.randint(1, 9, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 15:] = 0
    ids2, mask2, pad = pad_inputs_to_block_size(16, ids, mask, pad_token_id=0)
    assert ids2.shape == (2, 32) and pad == 12 and bool((ids2[:, 20:] == 0).all())
    assert mask2[0].tolist() == [1] * 15 + [0] * 17 and int(mask2[1].sum()) == 20
    with pytest.raises(ConfigError, match="power of two"):
        pad_to_block_size(x, 12)
    with pytest.raises(ValueError, match="attention_mask shape"):
        pad_inputs_to_block_size(16, ids, mask[:, :5])


@pytest.mark.parametrize("causal", [False, True])
def test_flex_block_mask_round_trip_and_output(causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cfg = BigBirdSparsityConfig(num_heads=2, block=16, different_layout_per_head=True)
    layout = cfg.make_layout(128)
    block_mask = layout_to_block_mask(layout, 16, causal=causal)
    expected = create_block_mask(layout_mask_mod(layout, 16, causal), None, 2, 128, 128, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(block_mask.to_dense(), expected.to_dense())
    assert torch.equal(block_mask.full_kv_num_blocks, expected.full_kv_num_blocks)
    back, block = block_mask_to_layout(block_mask)
    assert block == 16 and torch.equal(back, torch.tril(layout) if causal else layout)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ours = SparseSelfAttention(cfg, max_seq_length=128, causal=causal)(q, k, v)
    with warnings.catch_warnings():  # eager FlexAttention warns (once) that it is unfused; fine for a check
        warnings.simplefilter("ignore", UserWarning)
        flex = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(ours, flex, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, cls", [("fixed", FixedSparsityConfig), ("bigbird", BigBirdSparsityConfig),
                                       ("longformer", BSLongformerSparsityConfig),
                                       ("variable", VariableSparsityConfig)])
def test_hydra_attention_group_builds_configs(name, cls):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.merge({"model": {"n_head": 4}}, {"attention": OmegaConf.load(os.path.join(CONF, f"{name}.yaml"))})
    cfg = instantiate(node.attention)
    assert isinstance(cfg, cls) and cfg.num_heads == 4 and cfg.attention == "unidirectional"
    model = tiny_gpt()
    swap_gpt_attention(model, cfg)
    x, _ = make_batch(model.cfg, 1, seed=0)
    assert torch.isfinite(model(x)).all()


def test_hydra_dense_option_is_null():
    from omegaconf import OmegaConf

    text = open(os.path.join(CONF, "dense.yaml")).read()
    assert "@package _global_" in text and OmegaConf.load(os.path.join(CONF, "dense.yaml")).attention is None
