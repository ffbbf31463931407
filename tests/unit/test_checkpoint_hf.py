"""Hugging Face safetensors in and out (lightning_scale.checkpoint.hf), on tiny Llama and GPT-2 built from configs.

Weights are scaled and shifted before ``save_pretrained`` so a fresh init is told apart from a load. Checked:
regions read with ``get_slice`` equal the full tensors' slices (sharded directory); a model built on meta and
filled by ``load_hf_weights_`` gives ``from_pretrained``'s logits exactly (rotary buffers recomputed; GPT-2's tied
head absent from the file; a GPT2Model checkpoint without the ``transformer.`` prefix); flat-shard pieces filled
region by region equal the tensors; ``export_hf`` (from a state dict and from a layout-free checkpoint folder) ->
``from_pretrained`` -> the same logits (1e-6), sharded with an index, keys = the HF class's own state_dict keys.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def _scaled(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01 * torch.randn(p.shape, generator=g))
    return model.eval()


def _llama_cfg():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=False)


def _gpt2_cfg():
    return transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=4,
                                   bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = _scaled(transformers.LlamaForCausalLM(_llama_cfg()), 1)
    gpt2 = _scaled(transformers.GPT2LMHeadModel(_gpt2_cfg()), 2)
    llama.save_pretrained(root / "llama", max_shard_size="20KB")  # sharded: index + several files
    gpt2.save_pretrained(root / "gpt2")
    gpt2.transformer.save_pretrained(root / "gpt2_base")  # GPT2Model: keys without "transformer."
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    return {"root": root, "llama": llama, "gpt2": gpt2, "ids": ids}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_sharded_dir_and_regions_equal_full_slices(hf_dirs):
    from lightning_scale.checkpoint.hf import HFCheckpoint, read_region
    from lightning_scale.checkpoint.layout import Chunk, flat_range_to_chunks

    d = str(hf_dirs["root"] / "llama")
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    ckpt = HFCheckpoint(d)
    for name, full in hf_dirs["llama"].state_dict().items():
        assert ckpt.resolve(name) == name
        n = full.numel()
        chunks = [c for c, _ in flat_range_to_chunks(full.shape, n // 3, n - n // 5)]
        if full.dim() == 2:
            chunks.append(Chunk((full.shape[0] // 2, 0), (full.shape[0] - full.shape[0] // 2, full.shape[1])))
            chunks.append(Chunk((0, 3), (full.shape[0], 5)))  # a column slice (row-parallel tp)
        for c, got in zip(chunks, read_region(d, name, chunks)):
            want = full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))]
            assert torch.equal(got, want), (name, c)
    assert read_region(d, "lm_head.weight", [Chunk((0, 0), (2, 16))], torch.float64)[0].dtype == torch.float64


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt2_base"])
def test_load_hf_weights_on_meta_gives_from_pretrained_logits(hf_dirs, arch):
    from lightning_scale.checkpoint.hf import load_hf_weights_

    d = str(hf_dirs["root"] / arch)
    ids = hf_dirs["ids"]
    cls, cfg = ((transformers.LlamaForCausalLM, _llama_cfg()) if arch == "llama"
                else (transformers.GPT2LMHeadModel, _gpt2_cfg()))
    ref = _logits(hf_dirs["llama" if arch == "llama" else "gpt2"], ids)
    with torch.device("meta"):
        model = cls(cfg)
    report = load_hf_weights_(model, d)
    model.eval()
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert torch.equal(_logits(model, ids), ref)
    if arch != "llama":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied: filled once, through the embedding
    torch.manual_seed(0)
    fresh = cls(cfg).eval()
    assert (_logits(fresh, ids) - ref).abs().max() > 1e-2  # a fresh init is told apart
    if arch == "llama":
        assert torch.equal(_logits(transformers.LlamaForCausalLM.from_pretrained(d), ids), ref)
        assert report["missing"] == [] and report["unexpected"] == []


def test_load_hf_pieces_fills_flat_shards(hf_dirs):
    from lightning_scale.checkpoint.hf import load_hf_pieces_
    from lightning_scale.checkpoint.layout import flat_piece

    state = hf_dirs["llama"].state_dict()
    total = sum(t.numel() for t in state.values())
    for rank in range(2):  # dp=2 over one flat buffer: tensors split mid-row
        lo, hi = rank * total // 2, (rank + 1) * total // 2
        buf = torch.full((hi - lo,), float("nan"))
        pieces, pos = [], 0
        for k, t in state.items():
            a, b = max(lo, pos), min(hi, pos + t.numel())
            if a < b:
                pieces.append(flat_piece(f"model/{k}", buf[a - lo:b - lo], t.shape, a - pos))
            pos += t.numel()
        assert load_hf_pieces_(str(hf_dirs["root"] / "llama"), pieces) == []
        want = torch.cat([t.reshape(-1) for t in state.values()])[lo:hi]
        assert torch.equal(buf, want)


def _flat_pieces(state, rank, world):
    from lightning_scale.checkpoint.layout import flat_piece

    total = sum(t.numel() for t in state.values())
    lo, hi = rank * total // world, (rank + 1) * total // world
    flat = torch.cat([t.reshape(-1) for t in state.values()])[lo:hi].clone()
    pieces, pos = [], 0
    for k, t in state.items():
        a, b = max(lo, pos), min(hi, pos + t.numel())
        if a < b:
            pieces.append(flat_piece(f"model/model.{k}", flat[a - lo:b - lo], t.shape, a - pos))  # LightningModule keys
        pos += t.numel()
    return pieces


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_hf_loads_in_from_pretrained_with_the_same_logits(hf_dirs, tmp_path, arch):
    from lightning_scale.checkpoint import dcp_format
    from lightning_scale.checkpoint.hf import export_hf, export_hf_from_checkpoint

    model, ids = hf_dirs[arch], hf_dirs["ids"]
    cls = type(model)
    ref = _logits(model, ids)
    sd = model.state_dict()
    keys = [k for k in sd if not (arch == "gpt2" and k == "lm_head.weight")]  # tied: the file holds wte only
    out = str(tmp_path / "direct")
    files = export_hf(((k, sd[k]) for k in keys), out, config=model.config, max_shard_bytes=8 << 10)
    assert len(set(files.values())) > 1 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    back = cls.from_pretrained(out).eval()
    assert (_logits(back, ids) - ref).abs().max() <= 1e-6
    # from a layout-free checkpoint holding the chunks of a dp=2 flat-shard layout (one process saves both ranks'
    # pieces; the multi-rank export is in tests/dist/test_checkpoint_dcp.py)
    ckpt = str(tmp_path / "ckpt")
    state = {k: sd[k] for k in keys}
    dcp_format.save(ckpt, _flat_pieces(state, 0, 2) + _flat_pieces(state, 1, 2))
    out2 = str(tmp_path / "from_ckpt")
    export_hf_from_checkpoint(ckpt, out2, config_dir=str(hf_dirs["root"] / arch), strip_prefix="model.",
                              max_shard_bytes=8 << 10)
    back2 = cls.from_pretrained(out2).eval()
    assert (_logits(back2, ids) - ref).abs().max() <= 1e-6
    index = json.load(open(os.path.join(out2, "model.safetensors.index.json")))
    assert sorted(index["weight_map"]) == sorted(keys)
    assert set(keys) <= set(cls(model.config).state_dict())
    assert index["metadata"]["total_size"] == sum(sd[k].numel() * sd[k].element_size() for k in keys)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left
    assert math.isclose(sum(os.path.getsize(os.path.join(out2, f)) for f in set(index["weight_map"].values())),
                        index["metadata"]["total_size"], rel_tol=0.2)


@pytest.mark.parametrize("family", ["apertus", "falcon_h1"])
def test_pretrained_weights_into_the_strategies_meta_build_give_the_saved_models_logits(tmp_path, family):
    """The strategies' configure_model context (parameters on meta, buffers computed) + the files: Apertus' xIELU
    `beta` / `eps` are 0-dim tensors in the files (reading them raised IndexError: `sl[:]` on a 0-dim safetensors
    slice), Falcon-H1's `mup_vector` is in no file (it was uninitialized memory under `torch.device("meta")`)."""
    from lightning_scale.checkpoint.hf import load_hf_weights_
    from lightning_scale.materialize import parameters_on_meta
    from lightning_scale.models import hf_families as F

    torch.manual_seed(0)
    saved = _scaled(F.build(family, "eager", dtype=torch.float32), 4)
    saved.save_pretrained(tmp_path / family)
    with parameters_on_meta():
        model = F.build(family, "eager", dtype=torch.float32)
    load_hf_weights_(model, str(tmp_path / family))
    ids = torch.randint(0, F.VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    assert torch.equal(_logits(model.eval(), ids), _logits(saved, ids))
    from lightning_scale.checkpoint.hf import HFCheckpoint
    from lightning_scale.checkpoint.layout import Chunk

    ckpt = HFCheckpoint(str(tmp_path / family))  # the strategies read regions (their shard / slices / stage)
    for name, t in saved.state_dict().items():
        if t.dim() == 0 and ckpt.resolve(name) is not None:
            assert torch.equal(ckpt.read_chunk(ckpt.resolve(name), Chunk((), ())), t), name


def test_every_family_from_pretrained_in_the_strategies_context_gives_the_saved_models_logits(tmp_path):
    """What a user writes in configure_model, `AutoModelForCausalLM.from_pretrained(dir)`, under the strategies'
    context (parameters on meta, the directory recorded) and materialized by region reads (the tp / pp path; ZeRO-3
    reads its shards through the same resolution): every family of hf_families gives the saved model's logits bit for
    bit. GPT-NeoX ("no tensor for ['lm_head.weight']": its file says embed_out) and GraniteMoE / Granite 4 (the
    router's `router.layer.weight`) failed, their renamings being escaped literals that were taken for regexes; Falcon's
    tied head failed the source check (its file names the tensor transformer.word_embeddings.weight only)."""
    import warnings

    from transformers import AutoModelForCausalLM

    from lightning_scale.materialize import materialize_, parameters_on_meta
    from lightning_scale.models import hf_families as F
    from lightning_scale.pretrained import check_weight_sources, meta_from_pretrained

    warnings.filterwarnings("ignore")
    ids = torch.randint(0, F.VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    bad = {}
    for name in F.FAMILIES:
        torch.manual_seed(0)
        saved = _scaled(F.build(name, "eager", dtype=torch.float32), 4)
        saved.save_pretrained(tmp_path / name)
        try:
            # the experts' implementation the saved model ran (the families set "eager"); a reload otherwise takes
            # transformers' default (grouped_mm), whose float32 sums differ from eager's (DeepSeek-V4: 5e-7)
            impl = getattr(saved.config, "_experts_implementation", None)
            with parameters_on_meta(), meta_from_pretrained():
                model = AutoModelForCausalLM.from_pretrained(tmp_path / name, attn_implementation="eager",
                                                             **({"experts_implementation": impl} if impl else {}))
            assert all(p.is_meta for p in model.parameters())  # recorded, not read
            check_weight_sources(model)  # parallelize's first step, every rank
            materialize_(model, torch.device("cpu"), lambda n, m: True)
            diff = (_logits(model.eval(), ids) - _logits(saved, ids)).abs().max().item()
        except Exception as err:  # noqa: BLE001 - collected: every family is reported
            diff = f"{type(err).__name__}: {err}"[:300]
        if diff != 0:
            bad[name] = diff
    assert not bad, bad


def test_concatenated_file_tensors_are_read_by_region(tmp_path):
    """Kimi Linear keeps ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` in its files and ``conv1d`` (their concatenation
    along dim 0) in the model, and writes its experts' names as escaped literals (``\\.experts.*.w1.weight``): both
    were unresolved ("no tensor for ...") under ZeRO-3 / tp / pp. Every region of the fused tensors (a tp slice
    crossing the parts, a flat shard's rows) equals the model's own tensor's."""
    pytest.importorskip("transformers")
    from lightning_scale.checkpoint.hf import Chunk, HFCheckpoint
    from lightning_scale.checkpoint.hf_conversions import conversions_for
    from lightning_scale.models import hf_families as F

    model = F.build("kimi_linear", "eager", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    conv = conversions_for(model)
    assert any(not stacked for _, _, _, stacked in conv.fused), conv.fused  # the conv concatenation is followed
    source = HFCheckpoint(str(tmp_path), conversions=conv)
    state = model.state_dict()
    for key in ("model.layers.0.self_attn.conv1d.weight", "model.layers.1.mlp.experts.gate_up_proj",
                "model.layers.1.mlp.experts.down_proj"):
        name = source.resolve(key)
        assert name is not None, key
        whole = state[key]
        assert tuple(source.shape(name)) == tuple(whole.shape)
        assert torch.equal(source.read(name), whole), key
        if key.endswith("conv1d.weight"):  # rows 20..52 of 96: across q | k | v
            got = source.read_chunk(name, Chunk(offsets=(20, 0, 1), sizes=(32, 1, 2)))
            assert torch.equal(got, whole[20:52, :, 1:3])
