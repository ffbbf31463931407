"""compile=... on deep models (2 gloo ranks, ``aot_eager``, float64): the graphs do not grow with depth, no unit is
left eager, and the compiled run equals the eager one.

For the package GPT and an unchanged Hugging Face Llama (built from its config class), at tp=2, tp=2 + sequence
parallel (GPT), ZeRO-3 and (Llama) head-tiled attention under full activation checkpointing: the same layout with 2 and with 10 layers compiles the same number of graphs, Dynamo never
hits its recompile limit (``compile_stats()["eager_fallbacks"]``), and 2 AdamW steps give the eager losses (1e-12).

What failed before: the tensor-parallel layers and region mappings were traced and Dynamo guarded on each layer's
accounting tag (one graph per parallel linear: 18 graphs and 2 limit hits for a 10-layer GPT at tp=2, the layers
past the limit eager), and a Hugging Face model's training forward kept a KV cache whose per-layer slot made every
decoder layer its own graph (a 10-layer Llama at ZeRO-3: 8 graphs, 2 layers eager).
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

AOT = {"backend": "aot_eager"}
STEPS, BATCH, SEQ = 2, 4, 16
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True, overlap_comm=False, stage=1),
    "z3": dict(stage=3),
    "tiled_attention": dict(stage=2, tiled_attention=2, activation_checkpointing="full"),
}


def _model(kind: str, layers: int):
    from lightning_scale.models import hf_families as F

    if kind == "gpt":
        from lightning_scale.models.gpt import GPT, gpt_tiny

        return GPT(gpt_tiny(n_layer=layers, vocab_size=F.VOCAB, seq_len=SEQ)).double()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **dict(F._COMMON, num_hidden_layers=layers, num_key_value_heads=2))
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)


def _train(rank: int, world_size: int, kind: str, layers: int, options: dict):
    from lightning_scale.compile import compile_stats
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models import hf_families as F
    from lightning_scale.models.gpt import lm_loss
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(**options)
    topo = local_topology(config, world_size, rank)
    torch.manual_seed(0)
    model = _model(kind, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pm = parallelize(model, config, topo, "cpu", optimizers=[opt], loss_fn=lm_loss)
    (engine,) = pm.make_engines()
    before = compile_stats()
    losses = []
    for step in range(STEPS):
        x, y = F.batch(BATCH, SEQ, seed=step)
        x, y = x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank]
        loss = model.loss(x, y) if kind == "gpt" else lm_loss(model(input_ids=x).logits, y)
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    after = compile_stats()
    return losses, after["graphs"] - before["graphs"], after["eager_fallbacks"] - before["eager_fallbacks"]


def _worker(rank: int, world_size: int, cases):
    out = {}
    for kind, layout in cases:
        for layers in (2, 10):
            options = LAYOUTS[layout]
            eager, _, _ = _train(rank, world_size, kind, layers, options)
            torch._dynamo.reset()
            compiled, graphs, fallbacks = _train(rank, world_size, kind, layers, dict(options, compile=AOT))
            out[(kind, layout, layers)] = (eager, compiled, graphs, fallbacks)
    return out


@pytest.mark.timeout(400)
def test_compiled_graphs_do_not_grow_with_depth():
    pytest.importorskip("transformers")
    cases = [("gpt", "tp2"), ("gpt", "tp2_sp"), ("llama", "tp2"), ("llama", "z3"), ("llama", "tiled_attention")]
    results = run_distributed(_worker, 2, (cases,), timeout=360, preload=HF_RANK_PRELOAD)
    for rank, res in enumerate(results):
        for kind, layout in cases:
            shallow, deep = res[(kind, layout, 2)], res[(kind, layout, 10)]
            for eager, compiled, graphs, fallbacks in (shallow, deep):
                assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 1e-12, (kind, layout, eager, compiled)
                assert fallbacks == 0, (kind, layout, "units left eager: Dynamo hit its recompile limit")
                assert graphs > 0, (kind, layout, "nothing compiled")
            assert deep[2] == shallow[2], (kind, layout, rank, "graphs for 2 vs 10 layers", shallow[2], deep[2])
