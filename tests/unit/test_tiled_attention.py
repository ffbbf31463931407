"""Head-tiled attention (lightning_scale.tiled_attention, issue 16): exact, hooks fire once, less memory.

* float64 GPT: loss and every parameter gradient equal the untiled model's (1e-12), with and without full activation
  checkpointing and the tiled MLP (whose tiled norm hands the attention its input: the norm is recomputed), groups
  that do not divide the head count included; the tiled path really runs group by group (counted);
* a block-sparse core: each group runs its own heads' layout (per-head layouts that differ), equal to untiled;
* each qkv parameter's post-accumulate-grad hook fires once per backward (ZeRO's buckets and ZeRO-3 count on it);
* bf16 autocast: the recompute runs under the forward's autocast (gradients equal the untiled autocast run's);
* through parallelize() on 2 ranks (ZeRO-3, sp, pp): tests/dist/test_tiled_attention_dist.py;
* memory: with full AC + tiled MLP at L=1024 the step's peak live bytes fall by at least two L x d tensors;
* bad settings are ConfigErrors naming them.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_scale.config import ConfigError, from_flat_kwargs
from lightning_scale.models.gpt import GPT, CausalSelfAttention, gpt_tiny, make_batch
from lightning_scale.tiled_attention import tile_attention, tiled_attentions
from test_tiled_mlp import _gpt, _grads


def _assert_equal(ref, model, x, y, tol=1e-12):
    loss_ref, g_ref = _grads(ref, x, y)
    loss, g = _grads(model, x, y)
    assert abs((loss - loss_ref).item()) < tol
    assert set(g) == set(g_ref)
    worst = max((g[n] - g_ref[n]).abs().max().item() for n in g)
    assert worst < tol, worst


@pytest.mark.parametrize("ac", [None, "full"])
@pytest.mark.parametrize("tiled_mlp", [0, 8])
@pytest.mark.parametrize("per", [1, 3])  # 3 does not divide 8 heads: a short last group
def test_tiled_attention_equals_untiled(ac, tiled_mlp, per, monkeypatch):
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.tiled_mlp import tile_mlps

    ref = _gpt(seq_len=32, n_head=8, d_model=32)
    model = copy.deepcopy(ref)
    if ac:
        checkpoint_units(model, ac)
    if tiled_mlp:
        tile_mlps(model, tiled_mlp)
    assert tile_attention(model, per) == ["blocks.0.attn", "blocks.1.attn"] == tiled_attentions(model)
    calls = []
    heads = CausalSelfAttention.heads
    monkeypatch.setattr(CausalSelfAttention, "heads",
                        lambda self, x, first=0, last=None: calls.append((first, last)) or heads(self, x, first, last))
    x, y = make_batch(ref.cfg, 3, seed=1)
    _assert_equal(ref, model, x, y)
    groups = -(-8 // per)
    # per block: the forward's groups, the backward's recompute of each (+ the AC recompute's forward)
    assert len([c for c in calls if c != (0, None)]) == 2 * groups * (3 if ac else 2)
    assert (0, 8) not in calls


def test_sparse_core_runs_each_groups_own_layout():
    from lightning_scale.nn import FixedSparsityConfig, swap_gpt_attention

    ref = _gpt(seq_len=64, n_head=4, d_model=32, loss_chunk=0)
    layout = FixedSparsityConfig(num_heads=4, block=16, num_local_blocks=2, num_global_blocks=1,
                                 different_layout_per_head=True, num_different_global_patterns=2)
    swap_gpt_attention(ref, layout)
    first, second = layout.make_layout(64)[:2]
    assert not torch.equal(first, second), "the test needs heads whose layouts differ"
    model = copy.deepcopy(ref)
    tile_attention(model, 1)
    x, y = make_batch(ref.cfg, 2, seed=3)
    _assert_equal(ref, model, x, y, tol=1e-10)


def test_qkv_hooks_fire_once_per_backward():
    model = _gpt(seq_len=32, n_head=8, d_model=32)
    tile_attention(model, 2)
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x, y = make_batch(model.cfg, 2, seed=0)
    model.loss(x, y).backward()
    assert sorted(fired) == sorted(n for n, _ in model.named_parameters())  # each exactly once


def test_autocast_recompute_matches_untiled_autocast():
    torch.manual_seed(0)
    ref = GPT(gpt_tiny(seq_len=32, n_head=8, d_model=32))
    model = copy.deepcopy(ref)
    tile_attention(model, 2)
    x, y = make_batch(ref.cfg, 2, seed=0)
    out = []
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m.loss(x, y)
        loss.backward()
        out.append((loss.item(), {n: p.grad.float() for n, p in m.named_parameters()}))
    assert abs(out[0][0] - out[1][0]) < 1e-6
    # bf16 matmuls on a subset of the qkv rows: the same products, summed in the same order per row
    worst = max((out[0][1][n] - out[1][1][n]).abs().max().item() for n in out[0][1])
    assert worst < 2e-3, worst


def test_peak_memory_falls_by_the_attention_tensors():
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.memory import LiveTensorBytes
    from lightning_scale.tiled_mlp import tile_mlps

    L, d, B = 1024, 64, 1
    peaks = {}
    for name in ("ac+mlp", "ac+mlp+heads"):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(seq_len=L, d_model=d, n_head=8, vocab_size=64, loss_chunk=256))
        checkpoint_units(model, "full")
        tile_mlps(model, 128)
        if name.endswith("heads"):
            tile_attention(model, 1)
        x, y = make_batch(model.cfg, B, seed=0)
        with LiveTensorBytes() as mem:
            model.loss(x, y).backward()
        peaks[name] = mem.peak
    unit = B * L * d * 4  # one L x d fp32 tensor
    saved = peaks["ac+mlp"] - peaks["ac+mlp+heads"]
    print(f"\npeak live bytes, L={L} d={d}: full AC + tiled MLP {peaks['ac+mlp'] / 2**20:.2f} MiB, + tiled "
          f"attention (1 head) {peaks['ac+mlp+heads'] / 2**20:.2f} MiB; saved {saved / unit:.2f} x one L x d tensor")
    assert saved >= 2 * unit, peaks


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"tiled_attention=-1 must be a number of heads per group"):
        from_flat_kwargs(tiled_attention=-1)
    with pytest.raises(ConfigError, match=r"tiled_attention=2 with tp=2") as err:
        from_flat_kwargs(tiled_attention=2, tp=2)
    assert set(err.value.settings) >= {"tiled_attention", "tp"}
    with pytest.raises(ConfigError, match=r"tiled_attention=2: no attention found"):
        tile_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2, ["Nothing"])
    model = _gpt()
    model._lightning_scale_sp = 2  # as sequence parallelism marks the model
    with pytest.raises(ConfigError, match=r"tiled_attention=1 is not a multiple of sp=2"):
        tile_attention(model, 1)
    model = _gpt()
    tile_attention(model, 2)
    with pytest.raises(ConfigError, match=r"blocks.0.attn is tiled already"):
        tile_attention(model, 2)


@pytest.mark.parametrize("family,attn,ac,compiled", [
    ("llama", "eager", None, False), ("llama", "sdpa", "full", False), ("qwen3", "sdpa", None, False),
    ("qwen2", "eager", "full", False), ("mistral", "sdpa", None, False), ("gemma3", "eager", None, False),
    # compiled decoder layers (aot_eager): the tiled attention a graph break; its backward's recompute tiled itself
    # again and failed ("start (32) + length (32) exceeds dimension size (32)") before the whole entry was eager
    ("llama", "sdpa", None, True), ("llama", "sdpa", "full", True)])
def test_hugging_face_attention_equals_untiled(family, attn, ac, compiled, monkeypatch):
    """An unchanged HF attention (GQA 4 query / 2 key-value heads; Qwen3's per-head q/k norms, Qwen2's biases,
    Mistral's sliding window, Gemma3's scaling): its own forward runs per group with sliced q/k/v projections (each
    group takes whole key/value heads: 1 head per group rounds up to 2) and o_proj applied once outside; also inside
    decoder layers compiled per unit."""
    import lightning_scale.tiled_attention as TA
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.compile import compile_units
    from lightning_scale.models import hf_families as F

    ref = F.build(family, attn, dtype=torch.float64).train()
    model = copy.deepcopy(ref)
    if ac:
        checkpoint_units(model, ac)
    assert len(tile_attention(model, 1, compiled=compiled)) == ref.config.num_hidden_layers
    if compiled:
        torch._dynamo.reset()
        compile_units(model, {"backend": "aot_eager"})
    assert model.model.layers[0].self_attn._tiled_heads_per == 2
    calls = []
    only = TA._hf_heads_only
    monkeypatch.setattr(TA, "_hf_heads_only", lambda m, *a: calls.append(a[:4]) or only(m, *a))
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    out = []
    for m in (ref, model):
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        out.append((loss.item(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    assert abs(out[0][0] - out[1][0]) < 1e-12
    scale = max(g.abs().max().item() for g in out[0][1].values())
    assert max((out[0][1][n] - out[1][1][n]).abs().max().item() for n in out[0][1]) < 1e-9 * max(scale, 1.0)
    assert sorted(set(calls)) == [(0, 2, 0, 1), (2, 4, 1, 2)]
    per_pass = ref.config.num_hidden_layers * 2
    assert len(calls) == per_pass * (3 if ac else 2)  # forward, (the AC recompute,) the backward's recompute


def test_an_attention_without_the_head_path_is_named():
    from lightning_scale.models import hf_families as F

    model = F.build("phi3", "eager", dtype=torch.float32)  # fused qkv_proj
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn \(Phi3Attention\) has no head-tiled path"):
        tile_attention(model, 1)
    # under sp a Hugging Face GQA group (rounded up to whole key/value heads) must split over the sp ranks
    llama = F.build("llama", "eager", dtype=torch.float32)  # 4 query heads, 2 key/value heads: groups of 2
    llama._lightning_scale_sp = 4
    with pytest.raises(ConfigError, match=r"tiled_attention=1: model.layers.0.self_attn's groups take whole "
                                          r"key/value heads, 2 query heads each, not a multiple of sp=4 \(each "
                                          r"group goes through the sequence-parallel all-to-all\); use a multiple "
                                          r"of 4"):
        tile_attention(llama, 1)
    assert not tiled_attentions(llama)  # the failed layer was unwrapped
    llama._lightning_scale_sp = 2
    names = tile_attention(llama, 1)  # 1 -> 2 heads, a multiple of sp=2
    assert names and names == tiled_attentions(llama) and all(llama.get_submodule(n)._tiled_heads_per == 2
                                                               for n in names)


def test_compiled_blocks_keep_the_groups_eager_and_exact():
    """``compiled=True`` (parallelize passes it when ``compile`` is on): the tiled region is a graph break inside a
    compiled block (aot_eager here); gradients equal the untiled eager model's."""
    ref = _gpt(seq_len=32, n_head=8, d_model=32)
    model = copy.deepcopy(ref)
    tile_attention(model, 2, compiled=True)
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend="aot_eager")
    x, y = make_batch(ref.cfg, 2, seed=0)
    _assert_equal(ref, model, x, y)


def test_startup_table_names_the_tiled_attention():
    from types import SimpleNamespace

    from lightning_scale.strategies.report import compile_and_checkpointing

    model = _gpt(n_head=4)
    tile_attention(model, 2)
    rows = compile_and_checkpointing(SimpleNamespace(config=from_flat_kwargs(tiled_attention=2)), model)
    assert ("tiled attention", "2 heads per group (2 attentions)") in rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_tiled_attention_and_rotary_match_untiled_and_use_less_memory():
    """On a GPU (flash SDPA, bf16 autocast): a rotary GPT with full AC + tiled MLP + head tiling has the untiled
    run's gradients (bf16 tolerance) and a lower ``max_memory_allocated`` at L=8192."""
    from lightning_scale.activation_checkpointing import checkpoint_units
    from lightning_scale.tiled_mlp import tile_mlps

    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = GPT(gpt_tiny(seq_len=8192, n_head=16, d_model=1024, n_layer=2, vocab_size=4096, position="rotary")).to(dev)
    checkpoint_units(ref, "full")
    tile_mlps(ref, 1024)
    model = copy.deepcopy(ref)
    tile_attention(model, 2)
    x, y = make_batch(ref.cfg, 1, seed=0, device=dev)
    out = []
    for m in (ref, model):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m.loss(x, y)
        loss.backward()
        torch.cuda.synchronize()
        out.append((loss.item(), {n: p.grad.float() for n, p in m.named_parameters()},
                    torch.cuda.max_memory_allocated()))
    assert abs(out[0][0] - out[1][0]) < 1e-3
    for n, g in out[0][1].items():
        assert (g - out[1][1][n]).abs().max() <= 2e-2 * g.abs().max() + 1e-6, n
    print(f"\npeak GiB untiled {out[0][2] / 2**30:.3f}, head-tiled {out[1][2] / 2**30:.3f}")
    assert out[1][2] < out[0][2]
