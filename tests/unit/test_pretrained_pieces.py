"""lightning_scale.pretrained in one process: the tp-slice geometry of a read, and the one-device behaviour.

* ``tp_flat_piece``: any flat range of any tp rank's local tensor (fused sections along dim 0 or 1 as in GPT-2's
  ``Conv1D`` ``c_attn``, vocabulary padding) maps to rectangles of the full tensor whose values, copied in, give
  exactly ``shard_tensor``'s slice (padding zeroed);
* outside a meta context ``from_pretrained`` is transformers' own (real weights, same logits) and
  ``load_pretrained`` fills a real model at once; inside the strategies' meta context a plain
  ``AutoModelForCausalLM.from_pretrained`` builds on meta and records the directory, and outside it the wrapper
  passes through (transformers' own refusal of the meta device is unchanged);
* ``rename=``: a file whose tensor names differ loads into a meta model through ``materialize_``.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("dim,sections,size,tp", [(0, 1, 10, 2), (1, 1, 12, 3), (0, 3, 12, 2), (1, 3, 12, 2),
                                                  (0, 1, 7, 2), (1, 2, 8, 4)])
def test_tp_flat_piece_reads_exactly_the_shard(dim, sections, size, tp):
    from lightning_scale.pretrained import tp_flat_piece
    from lightning_scale.tensor_parallel.sharding import make_spec, shard_tensor

    spec = make_spec(dim, size, tp, sections=sections, pad=sections == 1)
    shape = [5, 5]
    shape[dim] = size
    full = torch.arange(float(torch.Size(shape).numel())).view(shape) + 1.0
    for rank in range(tp):
        want = shard_tensor(full, spec, rank).reshape(-1)  # padded rows are zeros
        local_shape = list(shape)
        local_shape[dim] = spec.local_size
        n = want.numel()
        for start, end in [(0, n), (3, n - 2), (n // 2, n // 2 + 1), (1, 6)]:
            flat = torch.full((end - start,), float("nan"))
            piece = tp_flat_piece("w", flat, local_shape, start, spec, rank)
            assert piece.global_shape == tuple(shape)
            for chunk, view in zip(piece.chunks, piece.tensors):
                view.copy_(full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))])
            piece.zero_padding_()
            assert torch.equal(flat, want[start:end]), (rank, start, end)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    d = tmp_path_factory.mktemp("pretrained_unit") / "llama"
    model.save_pretrained(d)
    return str(d)


def test_one_device_path_is_transformers_own(llama_dir):
    import transformers

    import lightning_scale

    ids = torch.arange(8).view(1, 8)
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    got = lightning_scale.from_pretrained(transformers.AutoModelForCausalLM, llama_dir)
    assert not got.training and not hasattr(got, "_lightning_scale_weights")
    assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits)
    torch.manual_seed(1)
    real = transformers.AutoModelForCausalLM.from_config(ref.config)
    assert lightning_scale.load_pretrained(real, llama_dir) is real
    assert torch.equal(real.eval()(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_plain_from_pretrained_in_the_meta_context_records_and_passes_through_outside(llama_dir):
    import transformers

    from lightning_scale.pretrained import SOURCE_ATTR, WeightSource, meta_from_pretrained

    with torch.device("meta"), meta_from_pretrained():
        model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
        concrete = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    for m in (model, concrete):
        assert next(m.parameters()).is_meta and not m.training
        source = getattr(m, SOURCE_ATTR)
        assert (source.directory, source.rename) == (os.path.abspath(llama_dir), None)
        assert isinstance(source, WeightSource) and not source.conversions.fused  # a Llama fuses nothing
    with pytest.raises(RuntimeError, match="meta"):  # outside the context: transformers' own behaviour
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_pretrained(llama_dir)


def test_rename_maps_model_keys_to_file_keys(llama_dir, tmp_path):
    import transformers
    from safetensors.torch import load_file, save_file

    import lightning_scale
    from lightning_scale.config import ConfigError
    from lightning_scale.materialize import materialize_
    from lightning_scale.pretrained import check_weight_sources

    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    tensors["emb"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    ref.config.save_pretrained(tmp_path)
    for rename in (None, {"model.embed_tokens.weight": "emb"}):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(ref.config)
            if rename is None:
                with pytest.raises(ConfigError, match="model.embed_tokens.weight"):
                    lightning_scale.load_pretrained(model, tmp_path)
                continue
            lightning_scale.load_pretrained(model, tmp_path, rename=rename)
        check_weight_sources(model)
        materialize_(model, torch.device("cpu"), lambda name, m: True)
        ids = torch.arange(8).view(1, 8)
        assert torch.equal(model.eval()(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_multimodal_checkpoint_gives_its_text_model(tmp_path):
    """Llama 4 Scout / Maverick ship as a multimodal checkpoint (a vision tower; the text model's tensors under
    ``language_model.``, config.json a 'llama4' with a 'llama4_text' text_config). transformers loads its text model
    alone as a Llama4ForCausalLM (the whole checkpoint's dtype); on meta, by class or by Auto, the same model is built
    and recorded, its every tensor found in the files, and materialized to transformers' own values."""
    transformers = pytest.importorskip("transformers")
    from lightning_scale.materialize import materialize_
    from lightning_scale.pretrained import check_weight_sources, meta_from_pretrained

    text = dict(vocab_size=32, hidden_size=16, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                max_position_embeddings=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
    torch.manual_seed(0)
    whole = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                                  vision_config=vision)).double()
    whole.save_pretrained(tmp_path / "scout")
    d = str(tmp_path / "scout")
    ref = transformers.Llama4ForCausalLM.from_pretrained(d)
    ids = torch.arange(8).view(1, 8)
    for cls in (transformers.Llama4ForCausalLM, transformers.AutoModelForCausalLM):
        with torch.device("meta"), meta_from_pretrained():
            model = cls.from_pretrained(d)
        assert type(model).__name__ == "Llama4ForCausalLM" and model.config.model_type == "llama4_text"
        assert model.dtype == torch.float64, cls  # the checkpoint's, as transformers reads it
        check_weight_sources(model)  # every tensor found (the text model's, under language_model.)
        materialize_(model, torch.device("cpu"), lambda name, m: True)
        assert torch.equal(model.eval()(input_ids=ids).logits, ref(input_ids=ids).logits)
    with torch.device("meta"), meta_from_pretrained(), pytest.raises(Exception, match="'llama4' model"):
        transformers.LlamaForCausalLM.from_pretrained(d)  # another architecture: refused by name
