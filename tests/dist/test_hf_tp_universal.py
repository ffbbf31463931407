"""The layout-free (universal) checkpoint of unchanged Hugging Face models written at tp=2, resumed at dp=2.

GPT-2's ``Conv1D`` ``c_attn`` is a fused ``[in, 3 * out]`` weight, so tp=2 splits its q / k / v sections along dim 1;
the checkpoint mapped fused sections along dim 0 only and refused it at the save (NotImplementedError after the
training it was meant to keep; a resume of a stage-3 checkpoint onto tp=2 failed the same way). The mapping
(``engine_pieces.flat_param_piece``, shared with pretrained reads) now cuts sections along any dim.

One 2-rank launch, float64, AdamW: each family of ``FAMILIES`` (GPT-2's Conv1D, Phi-3's gathered fused projections,
GPT-NeoX's per-head interleaved qkv, Llama's grouped-query heads, Qwen2-MoE's 3-D expert weights split inside every
expert, ``[gate | up]`` in two sections along dim 1 and ``down_proj`` along dim 2; and with its experts placed whole,
``expert_parallel``: 2 of 4 per rank, cut along the expert axis) trains 2 steps at tp=2 (ZeRO-1)
and saves with ``save_engines`` (what ``checkpoint_format="universal"`` writes); the same ranks then load it at dp=2
ZeRO-2 (the flat shards cut the fused weights mid-row) and train step 3. Against one process that trained the same 3
batches: the checkpoint's weights and Adam moments read whole (1e-10), and the resumed step-3 loss (1e-10).
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

# qwen2_moe_ep: the same Qwen2-MoE with its experts placed whole at tp=2 (expert_parallel: 2 of 4 per rank, cut along
# the expert axis), resumed at dp=2 as one whole model
# llama4 / llama4_ep: Llama 4's dense experts routed (tensor_parallel/routed_experts.py), transposed 3-D weights
# (gate_up_proj (E, H, 2I) split along dim 2 in two sections, down_proj (E, I, H) along dim 1), or placed whole; built
# without rotary layers (its complex float32 rotary moves split float64 runs by ~1e-8)
# dbrx: its fused Wqkv split per part and its 2-D experts (E * I, H) cut per expert (E sections along dim 0); gpt_oss:
# its expert biases (the gate / up bias cut with its columns, the down bias whole, added by rank 0)
FAMILIES = ["gpt2", "phi3", "gpt_neox", "llama", "qwen2_moe", "qwen2_moe_ep", "llama4", "llama4_ep", "dbrx", "gpt_oss"]
OVERRIDES = {"llama4": dict(no_rope_layers=[0] * 4, layer_types=["chunked_attention", "full_attention"] * 2)}
STEPS, SAVE_AT, LR = 3, 2, 1e-2


def _batch(step: int):
    from lightning_scale.models import hf_families as F

    return F.batch(4, 12, seed=step)


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _reference(family: str):
    from lightning_scale.models import hf_families as F

    name = family.removesuffix("_ep")
    model = F.build(name, "eager", overrides=OVERRIDES.get(name))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, at_save = [], None
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _loss(model(input_ids=x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step + 1 == SAVE_AT:
            names = {id(p): n for n, p in model.named_parameters()}
            at_save = ({n: p.detach().clone() for n, p in model.named_parameters()},
                       {names[id(p)]: s["exp_avg"].clone() for p, s in opt.state.items()})
    return losses, at_save


def _layout(family: str, layout: dict, rank: int, world_size: int):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models import hf_families as F
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(**layout)
    topo = local_topology(config, world_size, rank)
    name = family.removesuffix("_ep")
    model = F.build(name, "eager", overrides=OVERRIDES.get(name))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    pm = parallelize(model, config, topo, "cpu", optimizers=[opt])
    (engine,) = pm.make_engines()
    return model, opt, engine, topo


def _train(model, opt, topo, steps):
    from lightning_scale.testing import dp_step

    return [dp_step(model, opt, topo, *_batch(step), _loss) for step in steps]


def worker(rank: int, world_size: int, root: str) -> dict:
    import warnings

    from lightning_scale.checkpoint.engine_pieces import load_engines, save_engines

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for family in FAMILIES:
        path = os.path.join(root, family)
        placed = dict(expert_parallel=True) if family.endswith("_ep") else {}
        model, opt, engine, topo = _layout(family, dict(tp=2, stage=1, **placed), rank, world_size)
        saved = _train(model, opt, topo, range(SAVE_AT))
        save_engines(path, model, [engine], tp_rank=topo.tp_rank)
        model, opt, engine, topo = _layout(family, dict(stage=2), rank, world_size)
        load_engines(path, model, [engine], tp_rank=topo.tp_rank)
        out[family] = saved + _train(model, opt, topo, range(SAVE_AT, STEPS))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp("hf_tp_universal"))
    return root, run_distributed(worker, 2, (root,), timeout=300, preload=HF_RANK_PRELOAD)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_checkpoint_is_the_whole_model_and_resumes_at_dp2(results, family):
    from lightning_scale.checkpoint import dcp_format
    from lightning_scale.checkpoint.hf import checkpoint_tensors
    from lightning_scale.checkpoint.layout import tensor_piece

    root, runs = results
    want_losses, (weights, moments) = _reference(family)
    for rank, run in enumerate(runs):
        diff = max(abs(a - b) for a, b in zip(run[family], want_losses))
        assert diff <= 1e-10, (family, rank, run[family], want_losses)
    path = os.path.join(root, family)
    got = dict(checkpoint_tensors(path))
    assert set(weights) <= set(got), set(weights) - set(got)
    for name, want in weights.items():
        assert got[name].shape == want.shape, name
        assert (got[name] - want).abs().max().item() <= 1e-10, name
    ckpt, meta, md = dcp_format.open_checkpoint(path)
    for name, want in moments.items():  # the optimizer state maps like the weights (exp_avg per parameter)
        t = torch.empty(want.shape, dtype=want.dtype)
        dcp_format.read_local(ckpt, meta, md, [tensor_piece(f"optim/{name}/exp_avg", t)])
        assert (t - want).abs().max().item() <= 1e-10, name
