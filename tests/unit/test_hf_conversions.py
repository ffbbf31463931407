"""Pretrained mixture-of-experts files through transformers' conversion mapping (``checkpoint.hf_conversions``).

``save_pretrained`` of a transformers-5 Mixtral writes each expert's ``block_sparse_moe.experts.{e}.w1 / w3 / w2``
(Qwen2-MoE: ``mlp.experts.{e}.gate_proj / up_proj / down_proj``); the model holds ``mlp.experts.gate_up_proj``
``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``. Before, these keys did not resolve (``no tensor for ...``). Checked
here, one process, float64: every model key resolves, whole reads and random regions equal the model's tensors, a
region touches only the experts and rows it covers, ``load_pretrained`` of a built model fills it exactly with
nothing left unexpected. The distributed reads (tp=2, zero3) are in tests/dist/test_pretrained.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.checkpoint.layout import Chunk

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import warnings

    from lightning_scale.models import hf_families as F

    warnings.filterwarnings("ignore")
    out = {}
    for family in ("mixtral", "qwen2_moe"):
        model = F.build(family, "eager")
        directory = tmp_path_factory.mktemp(family)
        model.save_pretrained(directory)
        out[family] = (model, str(directory))
    return out


def _ckpt(model, directory):
    from lightning_scale.checkpoint.hf import HFCheckpoint
    from lightning_scale.checkpoint.hf_conversions import conversions_for

    return HFCheckpoint(directory, conversions_for(model))


def test_mixtral_mapping_is_transformers_own(saved):
    from lightning_scale.checkpoint.hf_conversions import conversions_for

    conv = conversions_for(saved["mixtral"][0])
    assert (".block_sparse_moe.", ".mlp.", False) in conv.renames
    # (model suffix, file suffixes, concatenation dim, stacked over the experts)
    assert (".experts.gate_up_proj", (".experts.*.w1.weight", ".experts.*.w3.weight"), 1, True) in conv.fused
    assert (".experts.down_proj", (".experts.*.w2.weight",), None, True) in conv.fused
    assert conversions_for(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_every_key_resolves_and_reads_the_model(saved, family):
    from lightning_scale.checkpoint.hf import HFCheckpoint

    model, directory = saved[family]
    plain = HFCheckpoint(directory)  # without the mapping: the fused experts are not in the files
    assert plain.resolve("model.layers.0.mlp.experts.gate_up_proj") is None
    ckpt = _ckpt(model, directory)
    g = torch.Generator().manual_seed(0)
    for key, t in model.state_dict().items():
        src = ckpt.resolve(key)
        assert src is not None, key
        assert ckpt.shape(src) == tuple(t.shape), key
        assert torch.equal(ckpt.read(src, t.dtype), t), key
        if t.dim() == 3:  # a fused expert tensor: random regions
            for _ in range(5):
                offsets = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in t.shape)
                sizes = tuple(int(torch.randint(1, n - o + 1, (1,), generator=g)) for o, n in zip(offsets, t.shape))
                got = ckpt.read_chunk(src, Chunk(offsets=offsets, sizes=sizes))
                want = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                assert got.dtype == t.dtype and torch.equal(got, want), (key, offsets, sizes)


def test_a_region_reads_only_its_experts_and_rows(saved):
    """A tp=2 rank's slice of every expert: half the rows of each of w1 and w3, nothing of the other half."""
    model, directory = saved["mixtral"]
    ckpt = _ckpt(model, directory)
    src = ckpt.resolve("model.layers.1.mlp.experts.gate_up_proj")
    E, two_i, H = ckpt.shape(src)
    reads = []
    original = ckpt._file_chunk
    ckpt._file_chunk = lambda n, c, d=None: reads.append((n, c)) or original(n, c, d)
    ckpt.read_chunk(src, Chunk(offsets=(2, 0, 0), sizes=(1, two_i // 4, H)))  # expert 2, first half of w1
    assert [(n, c.offsets, c.sizes) for n, c in reads] == [
        ("model.layers.1.block_sparse_moe.experts.2.w1.weight", (0, 0), (two_i // 4, H))]
    reads.clear()
    ckpt.read_chunk(src, Chunk(offsets=(0, two_i // 4, 0), sizes=(E, two_i // 2, H)))  # w1 second half, w3 first
    names = sorted({n.rsplit(".", 1)[0] for n, _ in reads})
    assert names == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}" for e in range(E) for w in ("w1", "w3")]
    assert sum(c.sizes[0] * c.sizes[1] for _, c in reads) == E * (two_i // 2) * H  # exactly the region's elements


def test_load_pretrained_fills_a_built_moe(saved):
    import lightning_scale.pretrained as P
    from lightning_scale.models import hf_families as F

    for family, (model, directory) in saved.items():
        fresh = F.build(family, "eager", seed=7)
        assert not torch.equal(fresh.state_dict()["model.layers.0.mlp.experts.down_proj"],
                               model.state_dict()["model.layers.0.mlp.experts.down_proj"])
        P.load_pretrained(fresh, directory)
        for key, t in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], t), (family, key)


def test_renamings_are_undone_in_reverse_order_and_one_occurrence_at_a_time():
    """transformers renames a file key by each renaming in turn, every one replacing its first match. DeepSeek-V4's
    ``attn.wq_b`` -> ``self_attn.wq_b`` -> ``self_attn.q_b_proj`` is undone last renaming first; Hunyuan 4's
    ``.hc_pre.hc_`` -> ``.hc_`` then ``.hc_attn_layer.hc_fn`` -> ``.attn_hc.fn``: undoing every ``.hc_`` of
    ``hc_attn_layer.hc_fn`` would add ``hc_pre`` twice."""
    from lightning_scale.checkpoint.hf_conversions import Conversions, renamed

    v4 = Conversions(renames=((".attn.", ".self_attn.", False), (".self_attn.wq_b.", ".self_attn.q_b_proj.", False)))
    assert "model.layers.0.attn.wq_b.weight" in renamed("model.layers.0.self_attn.q_b_proj.weight", v4)
    hy = Conversions(renames=((".hc_pre.hc_", ".hc_", False), (".hc_attn_layer.hc_fn", ".attn_hc.fn", False)))
    names = renamed("model.layers.0.attn_hc.fn", hy)
    assert "model.layers.0.hc_pre.hc_attn_layer.hc_fn" in names
    assert names[0] == "model.layers.0.attn_hc.fn"  # the key itself first
