"""Activation checkpointing units and policies in one process (parity: tests/dist/test_activation_checkpointing.py;
this file has another basename because the test folders share one module namespace).

* What the backward recomputes: "full" runs every block op again, matrix multiplies included; "selective" runs the
  cheap ops again but keeps the matmul outputs (no matmul of the forward is repeated); both give the same gradients.
* An unchanged Hugging Face Llama: selective checkpointing of its decoder layers gives the same gradients.
* Bad settings are ConfigErrors naming the option as typed (keyword and Hydra), before any model exists.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_scale.activation_checkpointing import SAVED_OPS, checkpoint_units, checkpointed_units
from lightning_scale.config import HYDRA, ConfigError, from_flat_kwargs, speaking, config_from_flat
from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode):
    torch.manual_seed(0)
    cfg = gpt_tiny(n_layer=2)
    model = GPT(cfg).double()
    if mode is not None:
        assert checkpoint_units(model, mode) == ["blocks.0", "blocks.1"]
    x, y = make_batch(cfg, 2, seed=0)
    loss = model.loss(x, y)
    with _OpCounter() as counter:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    matmuls = sum(n for op, n in counter.ops.items() if op in SAVED_OPS)
    return matmuls, counter.ops[torch.ops.aten.gelu.default], grads


def test_full_recomputes_matmuls_selective_keeps_them():
    plain_mm, plain_gelu, plain = _backward_ops(None)
    full_mm, full_gelu, full = _backward_ops("full")
    sel_mm, sel_gelu, sel = _backward_ops("selective")
    per_block_forward_mm = 4  # qkv, proj, fc, proj (attention's own matmuls on CPU float64 go through SDPA's math)
    assert full_mm >= plain_mm + 2 * per_block_forward_mm, (plain_mm, full_mm)
    assert sel_mm == plain_mm, (plain_mm, sel_mm)  # matmul outputs kept, not recomputed
    assert plain_gelu == 0 and full_gelu == 2 and sel_gelu == 2  # the cheap ops run again in both
    for grads in (full, sel):
        assert max((grads[n] - plain[n]).abs().max().item() for n in plain) == 0.0


def test_units_by_name_deepcopy_and_evaluation():
    torch.manual_seed(0)
    model = GPT(gpt_tiny()).double()
    assert checkpoint_units(model, "full", ["blocks.1"]) == ["blocks.1"]
    twin = copy.deepcopy(model)
    assert checkpointed_units(twin) == ["blocks.1"]
    assert twin.blocks[1].forward.__self__ is twin.blocks[1]  # the copy checkpoints its own block
    x, _ = make_batch(gpt_tiny(), 2, seed=1)
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))
    with pytest.raises(ConfigError, match="checkpointed already"):
        checkpoint_units(model, "selective", ["Block"])


def test_bad_settings_name_the_option():
    with pytest.raises(ConfigError, match=r"activation_checkpointing='ful': must be 'full', 'selective' or None"):
        from_flat_kwargs(activation_checkpointing="ful")
    with pytest.raises(ConfigError, match=r"activation_checkpointing_units=\('Block',\) needs activation_"):
        from_flat_kwargs(activation_checkpointing_units=("Block",))
    with pytest.raises(ConfigError, match=r"strategy\.activation_checkpointing='x'"):
        with speaking(HYDRA):
            config_from_flat({"activation_checkpointing": "x"}).validate()
    with pytest.raises(ConfigError, match=r"activation_checkpointing_units entry 'Blok' matches no module"):
        checkpoint_units(GPT(gpt_tiny()), "full", ["Blok"])
    with pytest.raises(ConfigError, match=r"strategy\.activation_checkpointing_units entry 'Blok'"):
        with speaking(HYDRA):
            checkpoint_units(GPT(gpt_tiny()), "full", ["Blok"])
    with pytest.raises(ConfigError, match="no repeated block"):
        checkpoint_units(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), "full")


def test_hugging_face_llama_selective_equals_plain():
    """An unchanged HF model: its decoder layers are the units; its KV cache is turned off (it would grow again in
    the recompute, which selective checkpointing detects as a different op sequence)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    plain = transformers.LlamaForCausalLM(cfg).double()
    model = copy.deepcopy(plain)
    assert checkpoint_units(model, "selective") == ["model.layers.0", "model.layers.1"]
    assert model.config.use_cache is False
    x = torch.randint(0, 64, (2, 12))
    for m in (plain, model):
        m(input_ids=x, labels=x).loss.backward()
    assert max((a.grad - b.grad).abs().max().item() for a, b in zip(plain.parameters(), model.parameters())) < 1e-12


def _block_inputs_alive_after_forward(offload):
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    cfg = gpt_tiny(n_layer=3)
    model = GPT(cfg).double()
    checkpoint_units(model, "full", offload=offload)
    refs = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: refs.append(StorageWeakRef(a[0].untyped_storage())))
    x, y = make_batch(cfg, 2, seed=0)
    loss = model.loss(x, y)
    alive = sum(not r.expired() for r in refs)
    loss.backward()
    return alive, {n: p.grad for n, p in model.named_parameters()}


def test_activation_offload_moves_the_unit_inputs_and_fetches_one_ahead():
    from lightning_scale.activation_offload import ActivationOffloader

    kept, plain = _block_inputs_alive_after_forward(False)
    offloader = ActivationOffloader(force=True)  # on the CPU nothing has to move: force the copies
    freed, grads = _block_inputs_alive_after_forward(offloader)
    assert kept == 3 and freed == 0  # without offload the checkpoint holds each block input; with it, the host does
    assert offloader.events == [("fetch", 2), ("prefetch", 1), ("use_prefetched", 1), ("prefetch", 0),
                                ("use_prefetched", 0)]
    assert offloader.host == {} and offloader.grads == {} and offloader.prefetched == {}
    assert max((grads[n] - plain[n]).abs().max().item() for n in plain) == 0.0
    with pytest.raises(ConfigError, match=r"offload_activations=True needs activation_checkpointing="):
        from_flat_kwargs(offload_activations=True)
    with pytest.raises(ConfigError, match=r"strategy\.offload_activations=True needs strategy\.activation_checkpoint"):
        with speaking(HYDRA):
            config_from_flat({"offload_activations": True}).validate()
