"""Tiled MLP (lightning_scale.tiled_mlp, issue 16): exact, hooks fire once, the 4d-wide activations exist per tile.

* float64 GPT (and a tiny HF Llama): loss and every parameter gradient equal the untiled model's (1e-12), with and
  without full activation checkpointing, tiles that do not divide the length included;
* dropout: each tile's recompute draws the forward's mask (the reference runs the same tiles with plain autograd);
* each MLP parameter's post-accumulate-grad hook fires once per backward (ZeRO's buckets and ZeRO-3 count on it);
* bf16 autocast: the recompute runs under the forward's autocast (gradients equal the untiled autocast run's);
* memory: the step's peak live tensor bytes at L=1024 fall by at least the untiled MLP's hidden activations minus
  one tile's (measured with lightning_scale.memory.LiveTensorBytes);
* the blocks' norms run tiled too and the MLP keeps the post-attention norm's input, not its output (one B x L x d
  tensor per block less saved, counted with saved_tensors_hooks; gradients exact); the memory plan's tiled profile
  (activations_for_model(tiled_mlp=N)) keeps less and leaves the model untiled;
* bad settings are ConfigErrors naming them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_scale.config import ConfigError, from_flat_kwargs
from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch
from lightning_scale.tiled_mlp import tile_mlps, tiled_mlps, tiled_norms


def _gpt(**kw):
    torch.manual_seed(0)
    return GPT(gpt_tiny(**kw)).double()


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = model.loss(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ac", [None, "full"])
@pytest.mark.parametrize("tokens", [8, 5])  # 5 does not divide 32: a short last tile
def test_tiled_gpt_equals_untiled(ac, tokens):
    from lightning_scale.activation_checkpointing import checkpoint_units

    ref = _gpt(seq_len=32)
    model = copy.deepcopy(ref)
    assert tile_mlps(model, tokens) == ["blocks.0.mlp", "blocks.1.mlp"] == tiled_mlps(model)
    if ac:
        checkpoint_units(model, ac)
    x, y = make_batch(ref.cfg, 3, seed=1)
    loss_ref, g_ref = _grads(ref, x, y)
    loss, g = _grads(model, x, y)
    assert abs((loss - loss_ref).item()) < 1e-12
    assert set(g) == set(g_ref)
    assert max((g[n] - g_ref[n]).abs().max().item() for n in g) < 1e-12


def test_tiled_hf_llama_equals_untiled():
    from lightning_scale.models import hf_families as F

    ref = F.build("llama", "sdpa", dtype=torch.float64).train()
    model = copy.deepcopy(ref)
    names = tile_mlps(model, 4)
    assert names and all(n.endswith(".mlp") for n in names), names
    norms = tiled_norms(model)  # the blocks' RMSNorms run tiled too (the default); the final norm does not
    assert {n.rsplit(".", 1)[1] for n in norms} == {"input_layernorm", "post_attention_layernorm"}, norms
    x = torch.randint(1, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    out = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = out
    assert abs(float(l0 - l1)) < 1e-12
    assert max((g0[n] - g1[n]).abs().max().item() for n in g0) < 1e-12


def test_dropout_recompute_draws_the_forward_masks():
    """With dropout the tiles draw their masks tile by tile; the reference is the same tiles under plain autograd
    from the same seed: equal outputs and gradients mean each recompute reused its tile's forward mask."""
    torch.manual_seed(0)
    mlp = GPT(gpt_tiny(seq_len=32, dropout=0.3)).double().blocks[0].mlp.train()
    ref = copy.deepcopy(mlp)
    tile_mlps(mlp, 8, ["MLP"])
    x = torch.randn(2, 32, 32, dtype=torch.float64, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    torch.manual_seed(5)
    out = mlp(x)
    torch.manual_seed(5)
    out_ref = torch.cat([ref(t) for t in xr.split(8, dim=1)], dim=1)
    assert torch.equal(out, out_ref)
    g = torch.randn_like(out)
    torch.manual_seed(123)  # the backward must not depend on the RNG state it finds
    out.backward(g)
    out_ref.backward(g)
    assert torch.allclose(x.grad, xr.grad, rtol=0, atol=1e-12)
    for (n, p), (_, q) in zip(mlp.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12), n


def test_each_parameter_hook_fires_once_per_backward():
    model = _gpt(seq_len=32)
    tile_mlps(model, 4)  # 8 tiles per MLP
    counts = {}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: counts.__setitem__(n, counts.get(n, 0) + 1))
    x, y = make_batch(model.cfg, 2, seed=0)
    model.loss(x, y).backward()
    assert counts and set(counts.values()) == {1}, {n: c for n, c in counts.items() if c != 1}


def _saved_bytes(model, x, y):
    """Bytes of the distinct non-parameter storages autograd saves in one forward (the loss' included)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params:
            saved[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(x, y)
    return sum(saved.values()), loss


@pytest.mark.parametrize("ac", [None, "full"])
def test_tiled_norms_keep_their_input_and_the_mlp_keeps_the_norms_input(ac):
    """norms=True (the default): each block's ln1 / ln2 runs tiled and the MLP keeps ln2's input (kept by ln2
    anyway) instead of ln2's output: one B x L x d tensor per block less is saved; gradients stay exact."""
    from lightning_scale.activation_checkpointing import checkpoint_units

    B, L = 2, 32
    saved, grads = {}, {}
    for norms in (False, True):
        model = _gpt(seq_len=L)
        tile_mlps(model, 8, norms=norms)
        assert bool(tiled_norms(model)) == norms
        x, y = make_batch(model.cfg, B, seed=0)
        saved[norms], _ = _saved_bytes(model, x, y)  # without AC: every block's saved set
        if ac:
            checkpoint_units(model, ac)
        grads[norms] = _grads(model, x, y)
    d, n = model.cfg.d_model, model.cfg.n_layer
    assert saved[False] - saved[True] >= n * B * L * d * 8, (saved, n * B * L * d * 8)
    assert abs(float(grads[True][0] - grads[False][0])) < 1e-12
    assert max((grads[True][1][k] - grads[False][1][k]).abs().max().item() for k in grads[False][1]) < 1e-12


def test_the_plans_tiled_profile_leaves_the_model_untiled():
    """activations_for_model(tiled_mlp=N) profiles the unit tiled (the MLP's L x 4d hiddens no longer kept) and
    restores the module's forwards afterwards."""
    from lightning_scale.activation_plan import activations_for_model

    model = _gpt(seq_len=256).float()
    kw = dict(seq_len=256, micro_batch=1, precision="32-true", activation_checkpointing=None)
    plain = activations_for_model(model, **kw)
    tiled = activations_for_model(model, **kw, tiled_mlp=32)
    assert tiled_mlps(model) == [] and tiled_norms(model) == []
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert tiled.kept < plain.kept - 256 * 4 * model.cfg.d_model * 4 * model.cfg.n_layer, (tiled, plain)
    assert any("tiled_mlp=32" in n for n in tiled.notes)


def test_autocast_recompute_matches_untiled_autocast():
    torch.manual_seed(0)
    ref = GPT(gpt_tiny(seq_len=32))
    model = copy.deepcopy(ref)
    tile_mlps(model, 16)
    x, y = make_batch(ref.cfg, 2, seed=0)
    grads = []
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m.loss(x, y)
        loss.backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    fc = "blocks.0.mlp.fc.weight"
    assert torch.allclose(grads[0][fc], grads[1][fc], rtol=0.05, atol=1e-3)  # bf16 rows blocked differently
    assert grads[1][fc].abs().sum() > 0


def test_peak_memory_falls_by_the_mlp_hidden_activations():
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.memory import LiveTensorBytes

    L, d, B, tokens = 1024, 64, 1, 128
    peaks = {}
    for name in ("ac", "ac+tiled"):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(seq_len=L, d_model=d, n_head=4, vocab_size=64, loss_chunk=256))
        checkpoint_units(model, "full")
        if name.endswith("tiled"):
            tile_mlps(model, tokens)
        x, y = make_batch(model.cfg, B, seed=0)
        with LiveTensorBytes() as mem:
            model.loss(x, y).backward()
        peaks[name] = mem.peak
    hidden = B * L * 4 * d * 4  # one L x 4d fp32 tensor
    saved = peaks["ac"] - peaks["ac+tiled"]
    print(f"\npeak live bytes, L={L} d={d}: full AC {peaks['ac'] / 2**20:.2f} MiB, + tiled MLP ({tokens}) "
          f"{peaks['ac+tiled'] / 2**20:.2f} MiB; saved {saved / hidden:.2f} x one L x 4d tensor")
    assert saved >= 1.5 * hidden * (1 - tokens / L), peaks


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"tiled_mlp=-2 must be a number of positions per tile"):
        from_flat_kwargs(tiled_mlp=-2)
    with pytest.raises(ConfigError, match=r"tiled_mlp=4 with sequence_parallel=True"):
        from_flat_kwargs(tiled_mlp=4, tp=2, sequence_parallel=True, overlap_comm=False)
    with pytest.raises(ConfigError, match=r"tiled_mlp_modules=\('MLP',\) needs tiled_mlp=N"):
        from_flat_kwargs(tiled_mlp_modules=["MLP"])
    with pytest.raises(ConfigError, match=r"tiled_mlp=8: no MLP found to tile"):
        tile_mlps(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), 8, ["Nothing"])
    model = _gpt()
    tile_mlps(model, 8)
    with pytest.raises(ConfigError, match=r"blocks.0.mlp is tiled already"):
        tile_mlps(model, 8)


def test_mixture_of_experts_is_refused():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    model = MixtralForCausalLM(cfg)
    names = [n for n, _ in model.named_modules() if n.endswith("mlp") or n.endswith("block_sparse_moe")]
    with pytest.raises(ConfigError, match=r"mixture of experts"):
        tile_mlps(model, 8, [n for n in names if n.count(".") == 3] or names[:1])


def test_startup_table_row_names_the_tiles():
    from types import SimpleNamespace

    from lightning_scale.strategies.report import compile_and_checkpointing

    model = _gpt()
    tile_mlps(model, 8)
    rows = compile_and_checkpointing(SimpleNamespace(config=from_flat_kwargs(tiled_mlp=8)), model)
    assert ("tiled MLP", "8 positions per tile (2 MLPs)") in rows, rows


def test_compiled_blocks_keep_the_tiles_eager_and_exact():
    """``compiled=True`` (parallelize passes it when ``compile`` is on): the tiled region is a graph break inside a
    compiled block (aot_eager here); gradients equal the untiled eager model's."""
    ref = _gpt(seq_len=32)
    model = copy.deepcopy(ref)
    tile_mlps(model, 8, compiled=True)
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend="aot_eager")
    x, y = make_batch(ref.cfg, 2, seed=0)
    _, g_ref = _grads(ref, x, y)
    _, g = _grads(model, x, y)
    assert max((g[n] - g_ref[n]).abs().max().item() for n in g_ref) < 1e-12
