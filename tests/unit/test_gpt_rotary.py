"""The project GPT with rotary positions, ``GPTConfig(position="rotary")`` (issue 16: no position table that grows
with the length).

* the rotation equals Hugging Face Llama's ``apply_rotary_pos_emb`` with its ``LlamaRotaryEmbedding`` (float32, same
  base), so a rotary GPT attends as a Llama does;
* no ``wpe``: the parameters are the learned GPT's less the table, and the torch-free count agrees;
* positions matter: the same tokens at shifted positions give different logits, and the attention scores depend only
  on relative positions (q at i, k at j rotated together by any offset: the same scores);
* head-tiled attention and full checkpointing on a rotary GPT equal the plain rotary GPT (float64);
* a bad ``position`` or an odd head size is named.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_scale.models.gpt import GPT, RotaryPositions, apply_rotary, gpt_tiny, make_batch


def test_rotation_equals_hf_llama_rope():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    D, T, theta = 16, 24, 500.0
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=theta,
                                          max_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, T, D, generator=g), torch.randn(2, 4, T, D, generator=g)
    cos, sin = hf(q, torch.arange(T)[None])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = RotaryPositions(D, theta)(torch.arange(T), torch.float32)
    assert (apply_rotary(q, c, s) - q_hf).abs().max() < 1e-5
    assert (apply_rotary(k, c, s) - k_hf).abs().max() < 1e-5


def test_scores_depend_only_on_relative_positions():
    D = 8
    rope = RotaryPositions(D, 10000.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, D, generator=g,
                                                                                  dtype=torch.float64)

    def score(i, j):
        ci, si = rope(torch.tensor([i]), torch.float64)
        cj, sj = rope(torch.tensor([j]), torch.float64)
        return float((apply_rotary(q, ci, si) * apply_rotary(k, cj, sj)).sum())

    assert abs(score(7, 3) - score(107, 103)) < 1e-9
    assert abs(score(7, 3) - score(7, 4)) > 1e-6


def test_no_position_table_and_counts():
    torch.manual_seed(0)
    learned, rotary = GPT(gpt_tiny(seq_len=64)), GPT(gpt_tiny(seq_len=64, position="rotary"))
    assert rotary.wpe is None and not any(n.startswith("wpe") for n, _ in rotary.named_parameters())
    assert not list(rotary.blocks[0].attn.rotary.parameters()) and not list(rotary.blocks[0].attn.rotary.buffers())
    n_learned = sum(p.numel() for p in learned.parameters())
    n_rotary = sum(p.numel() for p in rotary.parameters())
    assert n_learned - n_rotary == 64 * learned.cfg.d_model
    assert rotary.cfg.num_params() == n_rotary


def test_positions_change_the_output():
    torch.manual_seed(0)
    model = GPT(gpt_tiny(seq_len=32, position="rotary")).double()
    x = torch.randint(0, 64, (1, 16))
    # the last token's logits with 0 or 8 tokens before the same 8 (a causal model: the prefix matters only
    # through position when it repeats the tokens): rotary makes the second occurrence differ
    doubled = torch.cat([x[:, :8], x[:, :8]], dim=1)
    out = model(doubled)
    assert (out[0, 7] - out[0, 15]).abs().max() > 1e-6


@pytest.mark.parametrize("ac", [None, "full"])
def test_tiled_attention_and_checkpointing_on_rotary_equal_plain(ac):
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.tiled_attention import tile_attention

    torch.manual_seed(0)
    ref = GPT(gpt_tiny(seq_len=32, n_head=8, d_model=64, position="rotary")).double()
    model = copy.deepcopy(ref)
    if ac:
        checkpoint_units(model, ac)
    tile_attention(model, 3)
    x, y = make_batch(ref.cfg, 2, seed=0)
    losses, grads = [], []
    for m in (ref, model):
        loss = m.loss(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert abs(losses[0] - losses[1]) < 1e-12
    assert max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]) < 1e-12


def test_bad_position_settings_are_named():
    with pytest.raises(ValueError, match=r"model.position='alibi' must be 'learned' or 'rotary'"):
        gpt_tiny(position="alibi").validate()
    with pytest.raises(ValueError, match=r"model.position='rotary' needs an even head size"):
        gpt_tiny(d_model=36, n_head=4, position="rotary").validate()
    with pytest.raises(ValueError, match=r"model.rope_theta=0"):
        gpt_tiny(position="rotary", rope_theta=0).validate()
