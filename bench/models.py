"""A real Hugging Face model under lightning_scale vs Lightning's ModelParallelStrategy and torch, 2 CPU ranks.

    python bench/models.py                            # 3 interleaved rounds x 5 timed steps
    python bench/models.py --rounds 1 --steps 3       # quick look (the figures in bench/RESULTS.md)
    python bench/models.py --systems ddp,ls_z3,lightning_fsdp2 --layers 4
    python bench/models.py --model mixtral --layers 4 --hidden 256   # a mixture-of-experts model (below)

The model is an unchanged ``LlamaForCausalLM`` built from ``LlamaConfig`` (no download): hidden 512, 8 layers,
8 query / 4 key-value heads, MLP 1408, vocabulary 32000, untied head, sdpa attention, fp32 = 56.4M parameters
(``--layers`` / ``--hidden`` / ``--vocab`` change it). Every row trains it with AdamW on the same global batch
(``--batch`` sequences of ``--seq`` tokens), the same init (seed 0) and data:

    ddp              torch DistributedDataParallel, each rank half the batch             (baseline of the ratios)
    ls_z2 / ls_z3    lightning_scale parallelize(stage=2 / 3) + make_engines, dp=2 (ZeRO-3: one unit per decoder
                     layer, found automatically)
    ls_tp2           parallelize(tp=2): the model's own tp_plan (transformers' base_model_tp_plan), full logits
    ls_tp2_vp        the same plan with the head ``vocab_colwise``: logits stay split over the vocabulary and the
                     loss is ``tensor_parallel_state(model).cross_entropy`` (what dtensor_tp's Shard(-1) head +
                     loss_parallel does; the README's tp loss recipe)
    ls_tp2_vp_unshared  ls_tp2_vp with every column layer reducing its own input gradient (5 all-reduces per
                     block in the backward instead of 2: q/k/v and gate/up no longer share one, ``SharedInput``)
    ls_pp2           parallelize(pp=2, microbatches=2, 1F1B): the automatic HF pipeline adapter
    fsdp2            torch fully_shard per decoder layer + root (reshard after forward), plain loop
    dtensor_tp       torch parallelize_module: Colwise q/k/v/gate/up, Rowwise o/down, Rowwise embedding,
                     Colwise head with Shard(-1) logits + loss_parallel (torchtitan's setup), plain loop
    lightning_fsdp2  Lightning Trainer + ModelParallelStrategy(data_parallel_size=2): the fsdp2 row's fully_shard
                     in configure_model
    lightning_tp     Lightning Trainer + ModelParallelStrategy(tensor_parallel_size=2): the dtensor_tp plan in
                     configure_model

``--model deepseek_v3``: an unchanged ``DeepseekV3ForCausalLM`` (multi-head latent attention, 8 routed experts of
width ``--hidden``, top-2, a shared expert, the first layer dense): ls_tp2 / ls_tp2_vp split its heads (transformers'
``mla_kv_a_proj`` plan) and every expert's width, ``ls_tp2_own`` its own plan only (attention, dense and shared MLPs;
the routed experts whole); torch's plans have no style for MLA (its shared rotary key needs its gradient summed over
tp), so the dtensor_tp / lightning_tp rows are not run for it.

``--model llama4``: an unchanged ``Llama4ForCausalLM`` (text; Scout's shape in small: every layer a MoE of
``--experts`` experts of width ``--hidden * 2``, top ``--top-k``, a shared expert). transformers runs every expert on
every token (the router's score zeroes the unpicked ones), which the ddp / fsdp2 rows do; lightning_scale routes them
(``tensor_parallel/routed_experts.py``, the same math): ``ddp_routed`` is DDP over the routed model, so ls_z2 vs
ddp_routed shows the engine and ls_z2 vs ddp what a user gets. Use ``--experts 16 --top-k 1`` (Scout's).

``--model litgpt_moe``: litgpt's ``GPT`` with its ``LLaMAMoE`` (Mixtral's shape in litgpt: ``--experts`` experts of
width ``--hidden * 2`` kept as a list of ``LLaMAMLP``, top ``--top-k``, grouped-query attention, RMSNorm, rotary).
Rows ddp, fsdp2 (per block), ls_z2, ls_z3, ls_tp2 (litgpt's built-in plan: every expert's width split), ls_tp2_ep
(``expert_parallel=True``: the list placed by ownership, 2 of 4 experts per rank whole,
``tensor_parallel/expert_lists.py``) and ls_ep2 (the same placement over the data ranks, routes exchanged).

``--model dbrx`` / ``gpt_oss`` / ``nemotron_h`` / ``bamba`` / ``jamba`` / ``qwen3_5``: models whose declared tp plans
split little or run every head on every rank (DBRX's names its head only; GPT-OSS's leaves its biased experts whole;
Nemotron-H's, Bamba's and Jamba's their Mamba mixers; Qwen 3.5's gathers its DeltaNet projections, the core whole): ``ls_tp2`` is the built-in plan (DBRX's fused Wqkv and 2-D experts, GPT-OSS's experts with the down bias on
one rank, Nemotron-H's mixers by heads and groups, 2 groups here; Bamba's with one group, as its releases: B / C
replicated; Jamba's Mamba-1 mixers by channels; Qwen 3.5's DeltaNet layers by key-head groups), ``ls_tp2_own`` the declared plan alone (what transformers' own tp
gives); compare their peak RSS. Rows: ddp, fsdp2, ls_z3, ls_tp2, ls_tp2_own (torch's dtensor plans name Llama's
layers).

``--model mixtral``: an unchanged ``MixtralForCausalLM`` instead (8 experts of MLP width ``--hidden * 2``, top-2,
transformers' default experts implementation), and one more row, ``ls_tp2_own``: tp=2 with the model's own
``tp_plan`` (attention only, the experts whole on every rank: what lightning_scale did before its ``experts`` style
and what transformers' own tp gives). dtensor_tp / lightning_tp then split attention, embedding and head (torch's
plans have no style for 3-D expert weights); ls_tp2 / ls_tp2_vp split every expert's width as well. ``ls_tp2_ep``
(MoE models): ls_tp2_vp with the experts placed whole instead, half of them per rank
(``Zero3DStrategy(tp=2, expert_parallel=True)``; ratios against ls_tp2_vp and ls_tp2_own). ``ls_ep2`` (MoE models):
expert parallelism over the 2 data-parallel ranks (``Zero3DStrategy(ep=2, stage=2)``): each rank its own half of the
batch and half of the experts whole, routes exchanged by all-to-all; ratios against ddp, fsdp2 and ls_z2 / ls_z3
(every expert on every rank, or sharded and gathered before each use).

Peers (targets from issue 14): ls_z3 vs lightning_fsdp2 and fsdp2 (>= 1.05x), ls_tp2 vs lightning_tp and
dtensor_tp (>= 1.3x); ls_z2 and ls_pp2 are compared with ddp. Each (round, system) runs in fresh processes
(peak RSS is per process, max over ranks), in an order rotated every round; tokens/s is the global tokens per
step over the median timed step (max over ranks). Not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import peak_rss_mb, peer_table, ratio_table, round_ratios, write_plot  # noqa: E402

SYSTEMS = ["ddp", "ls_z2", "ls_z3", "ls_tp2", "ls_tp2_vp", "ls_tp2_vp_unshared", "ls_pp2", "fsdp2", "dtensor_tp",
           "lightning_fsdp2", "lightning_tp", "ls_tp2_own", "ls_tp2_ep", "ls_ep2", "ddp_routed"]
PEERS = {"ls_z3": [("lightning_fsdp2", 1.05), ("fsdp2", 1.05)], "ls_tp2": [("lightning_tp", 1.3),
         ("dtensor_tp", 1.3), ("ls_tp2_own", None)], "ls_tp2_vp": [("lightning_tp", 1.3), ("dtensor_tp", 1.3), ("ls_tp2", None),
                                             ("ls_tp2_vp_unshared", None)],
         "ls_tp2_vp_unshared": [("dtensor_tp", 1.3)],
         "ls_z2": [("ddp", None), ("ddp_routed", None)], "ls_pp2": [("ddp", None)], "ls_tp2_own": [("dtensor_tp", None)],
         "ls_tp2_ep": [("ls_tp2_vp", None), ("ls_tp2_own", None), ("ls_tp2", None)],
         "ls_ep2": [("ddp", None), ("ls_z2", None), ("ls_z3", None), ("fsdp2", None)]}
LS = {"ls_z2": dict(stage=2), "ls_z3": dict(stage=3), "ls_tp2": dict(tp=2, stage=1), "ls_tp2_vp": dict(tp=2, stage=1),
      "ls_tp2_vp_unshared": dict(tp=2, stage=1), "ls_pp2": dict(pp=2, stage=1, microbatches=2),
      "ls_tp2_own": dict(tp=2, stage=1), "ls_tp2_ep": dict(tp=2, stage=1), "ls_ep2": dict(ep=2, stage=2)}


def build_llama(kw: dict):
    """The unchanged HF Llama of the module docstring (``kw["model"] == "mixtral"``: the Mixtral), seeded init, fp32,
    sdpa."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if kw.get("model") == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        h = kw["hidden"]
        config = DeepseekV3Config(vocab_size=kw["vocab"], hidden_size=h, intermediate_size=h * 2,
                                  moe_intermediate_size=kw.get("expert_width") or h, num_hidden_layers=kw["layers"],
                                  num_attention_heads=kw["heads"], num_key_value_heads=kw["heads"],
                                  n_routed_experts=kw.get("experts", 8), num_experts_per_tok=kw.get("top_k", 2),
                                  n_shared_experts=1, n_group=1,
                                  topk_group=1, first_k_dense_replace=1, q_lora_rank=h // 2, kv_lora_rank=h // 4,
                                  qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                  max_position_embeddings=kw["seq"], tie_word_embeddings=False,
                                  attn_implementation="sdpa")
        torch.manual_seed(0)
        return DeepseekV3ForCausalLM(config)
    if kw.get("model") == "llama4":  # Scout's shape in small: every layer MoE, top-1, a shared expert
        from transformers import Llama4ForCausalLM, Llama4TextConfig

        width = kw.get("expert_width") or kw["hidden"] * 2
        config = Llama4TextConfig(vocab_size=kw["vocab"], hidden_size=kw["hidden"], intermediate_size=width,
                                  intermediate_size_mlp=width, num_hidden_layers=kw["layers"],
                                  num_attention_heads=kw["heads"], num_key_value_heads=kw["kv_heads"],
                                  head_dim=kw["hidden"] // kw["heads"], max_position_embeddings=kw["seq"],
                                  num_local_experts=kw.get("experts", 16), num_experts_per_tok=kw.get("top_k", 1),
                                  interleave_moe_layer_step=1, tie_word_embeddings=False, attn_implementation="sdpa")
        torch.manual_seed(0)
        return Llama4ForCausalLM(config)
    if kw.get("model") == "dbrx":  # DBRX in small: fused Wqkv with clipping, experts as 2-D w1 / v1 / w2 rows
        from transformers import DbrxConfig, DbrxForCausalLM

        h = kw["hidden"]
        config = DbrxConfig(d_model=h, n_heads=kw["heads"], n_layers=kw["layers"], max_seq_len=kw["seq"],
                            vocab_size=kw["vocab"],
                            attn_config=dict(kv_n_heads=kw["kv_heads"], clip_qkv=8.0, rope_theta=10000.0),
                            ffn_config=dict(hidden_size=h, ffn_hidden_size=kw.get("expert_width") or h * 2,
                                            moe_num_experts=kw.get("experts", 8), moe_top_k=kw.get("top_k", 2)),
                            attn_implementation="sdpa")
        torch.manual_seed(0)
        return DbrxForCausalLM(config)
    if kw.get("model") == "gpt_oss":  # GPT-OSS in small: experts with biases, attention sinks (eager only)
        from transformers import GptOssConfig, GptOssForCausalLM

        h = kw["hidden"]
        config = GptOssConfig(vocab_size=kw["vocab"], hidden_size=h, intermediate_size=kw.get("expert_width") or h * 2,
                              num_hidden_layers=kw["layers"], num_attention_heads=kw["heads"],
                              num_key_value_heads=kw["kv_heads"], head_dim=h // kw["heads"],
                              num_local_experts=kw.get("experts", 8), num_experts_per_tok=kw.get("top_k", 2),
                              max_position_embeddings=kw["seq"], layer_types=["full_attention"] * kw["layers"],
                              attn_implementation="eager")
        torch.manual_seed(0)
        return GptOssForCausalLM(config)
    if kw.get("model") == "deepseek_v4":  # DeepSeek-V4 in small: 2 hyper-connection streams, compressed attention
        # (CSA / HCA alternating) with one shared key / value head, sinks and a grouped low-rank output; hash-routed
        # experts in the first layer, routed after (eager only)
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        from lightning_scale.models.hf_families import _fill_hash_tables

        h, heads = kw["hidden"], kw["heads"]
        config = DeepseekV4Config(
            vocab_size=kw["vocab"], hidden_size=h, num_hidden_layers=kw["layers"], num_attention_heads=heads,
            num_key_value_heads=1, head_dim=2 * h // heads, qk_rope_head_dim=16, q_lora_rank=h // 2, o_groups=4,
            o_lora_rank=h // 2, n_routed_experts=kw.get("experts", 8), num_experts_per_tok=kw.get("top_k", 2),
            moe_intermediate_size=kw.get("expert_width") or h, hc_mult=2, hc_sinkhorn_iters=4, index_n_heads=4,
            index_head_dim=32, index_topk=16, sliding_window=64, pad_token_id=0, max_position_embeddings=kw["seq"],
            compress_rates=dict(compressed_sparse_attention=4, heavily_compressed_attention=16),
            layer_types=(["heavily_compressed_attention", "compressed_sparse_attention"] * kw["layers"])[:kw["layers"]],
            mlp_layer_types=["hash_moe"] + ["moe"] * (kw["layers"] - 1), experts_implementation="eager",
            attn_implementation="eager")
        torch.manual_seed(0)
        model = DeepseekV4ForCausalLM(config)
        _fill_hash_tables(model, 0)
        return model
    if kw.get("model") == "nemotron_h":  # Nemotron-H in small: Mamba-2 (2 groups), attention and MLP layers
        from transformers import NemotronHConfig, NemotronHForCausalLM

        h = kw["hidden"]
        pattern = ("M-M*" * kw["layers"])[:kw["layers"]]
        config = NemotronHConfig(vocab_size=kw["vocab"], hidden_size=h, intermediate_size=h * 2,
                                 num_hidden_layers=kw["layers"], hybrid_override_pattern=pattern,
                                 num_attention_heads=kw["heads"], num_key_value_heads=kw["kv_heads"],
                                 head_dim=h // kw["heads"], mamba_num_heads=8, mamba_head_dim=h // 4, n_groups=2,
                                 ssm_state_size=16, chunk_size=64, max_position_embeddings=kw["seq"],
                                 attn_implementation="sdpa")
        torch.manual_seed(0)
        return NemotronHForCausalLM(config)
    if kw.get("model") == "bamba":  # Bamba in small: Mamba-2 with one group (as its releases), one attention layer
        from transformers import BambaConfig, BambaForCausalLM

        h = kw["hidden"]
        config = BambaConfig(vocab_size=kw["vocab"], hidden_size=h, intermediate_size=h * 2,
                             num_hidden_layers=kw["layers"], num_attention_heads=kw["heads"],
                             num_key_value_heads=kw["kv_heads"], mamba_n_heads=8, mamba_d_head=h // 4,
                             mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=64,
                             attn_layer_indices=[kw["layers"] // 2], max_position_embeddings=kw["seq"],
                             attn_implementation="sdpa")
        torch.manual_seed(0)
        return BambaForCausalLM(config)
    if kw.get("model") == "qwen3_5":  # Qwen 3.5 dense in small: gated DeltaNet layers, full attention every 4th
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        h = kw["hidden"]
        types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        config = Qwen3_5TextConfig(vocab_size=kw["vocab"], hidden_size=h, intermediate_size=h * 2,
                                   num_hidden_layers=kw["layers"], num_attention_heads=kw["heads"],
                                   num_key_value_heads=kw["kv_heads"], head_dim=h // kw["heads"],
                                   linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=h // 8,
                                   linear_value_head_dim=h // 8, layer_types=(types * kw["layers"])[:kw["layers"]],
                                   max_position_embeddings=kw["seq"], attn_implementation="sdpa")
        torch.manual_seed(0)
        return Qwen3_5ForCausalLM(config)
    if kw.get("model") == "jamba":  # Jamba in small: Mamba-1 layers, attention every 4th, experts every other layer
        from transformers import JambaConfig, JambaForCausalLM

        h = kw["hidden"]
        config = JambaConfig(vocab_size=kw["vocab"], hidden_size=h, intermediate_size=h * 2,
                             num_hidden_layers=kw["layers"], num_attention_heads=kw["heads"],
                             num_key_value_heads=kw["kv_heads"], num_experts=kw.get("experts", 8),
                             num_experts_per_tok=kw.get("top_k", 2), expert_layer_period=2, expert_layer_offset=1,
                             attn_layer_period=4, attn_layer_offset=2, mamba_d_state=16, mamba_expand=2,
                             mamba_dt_rank=max(1, h // 16), use_mamba_kernels=False,
                             max_position_embeddings=kw["seq"], attn_implementation="sdpa")
        torch.manual_seed(0)
        return JambaForCausalLM(config)
    if kw.get("model") == "litgpt_moe":  # litgpt's GPT, Mixtral-style LLaMAMoE (a list of experts)
        from litgpt import GPT, Config

        width = kw.get("expert_width") or kw["hidden"] * 2
        config = Config(n_layer=kw["layers"], n_embd=kw["hidden"], n_head=kw["heads"], n_query_groups=kw["kv_heads"],
                        vocab_size=kw["vocab"], padded_vocab_size=kw["vocab"], block_size=kw["seq"],
                        norm_class_name="RMSNorm", mlp_class_name="LLaMAMoE", intermediate_size=width,
                        moe_intermediate_size=width, n_expert=kw.get("experts", 8),
                        n_expert_per_token=kw.get("top_k", 2), parallel_residual=False, bias=False,
                        rotary_percentage=1.0)
        torch.manual_seed(0)
        model = GPT(config)
        model.apply(model._init_weights)
        return model
    if kw.get("model") == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=kw["vocab"], hidden_size=kw["hidden"],
                               intermediate_size=kw.get("expert_width") or kw["hidden"] * 2,
                               num_hidden_layers=kw["layers"], num_attention_heads=kw["heads"],
                               num_key_value_heads=kw["kv_heads"], max_position_embeddings=kw["seq"],
                               num_local_experts=kw.get("experts", 8), num_experts_per_tok=kw.get("top_k", 2),
                               tie_word_embeddings=False,
                               attn_implementation="sdpa")
        torch.manual_seed(0)
        return MixtralForCausalLM(config)
    config = LlamaConfig(vocab_size=kw["vocab"], hidden_size=kw["hidden"], intermediate_size=kw["mlp"],
                         num_hidden_layers=kw["layers"], num_attention_heads=kw["heads"],
                         num_key_value_heads=kw["kv_heads"], max_position_embeddings=kw["seq"],
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _is_litgpt(model) -> bool:
    """litgpt's GPT (also wrapped by DDP, or fully_shard's subclass of it)."""
    return any(c.__module__.startswith("litgpt") for c in type(getattr(model, "module", model)).__mro__)


def _logits(model, x):
    """A Hugging Face model's logits (``model(input_ids=x).logits``), or litgpt's (its forward returns them)."""
    if _is_litgpt(model):
        return model(x)
    return model(input_ids=x).logits


def _loss(logits, targets):  # (B, T, V), (B, T) -> mean next-token cross-entropy
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _dtensor_plan(model, mesh) -> None:
    """torchtitan's Llama plan on the HF module names (HF's attention views with -1 heads: nothing to patch)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        plan.update({p + n: ColwiseParallel() for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")})
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        if hasattr(layer.mlp, "gate_proj"):  # a dense MLP (Mixtral's experts stay whole: no 3-D style in torch)
            plan.update({p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                         p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)


# models whose built-in plan here splits what their declared plan leaves whole (DBRX: its head only; GPT-OSS: its
# biased experts; Nemotron-H: its Mamba-2 mixers and head): ls_tp2_own is their declared plan
NEW_PLANS = ("dbrx", "gpt_oss", "nemotron_h", "bamba", "jamba", "qwen3_5", "deepseek_v4")


def _own_plan(model) -> dict:
    """The model's own tp_plan, as the built-in path applies it: patterns that match no module dropped (DeepSeek-V3's
    declares q_proj, which it does not build with q_lora_rank set); a plan passed by the user must match."""
    from lightning_scale.tensor_parallel.hf import _matches, hf_plan

    names = [n for n, _ in model.named_modules() if n]
    plan = hf_plan(model)
    if model.config.model_type in NEW_PLANS:  # what transformers declares, not the built-in plan that replaces it
        plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    return {p: s for p, s in plan.items() if any(_matches(p, n) for n in names)}


def _fsdp2(model, mesh=None) -> None:
    from torch.distributed.fsdp import fully_shard

    base = getattr(model, "transformer", None)  # litgpt / DBRX, else HF
    layers = (base.h if hasattr(base, "h") else base.blocks) if base is not None else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def _plain_step(system: str, model, rank: int, world: int):
    """step(x, y) -> loss of the global batch for the systems driven by a plain loop."""
    import torch
    import torch.distributed as dist

    if system in LS:
        import lightning_scale.models  # noqa: F401  (registers the HF pipeline adapter; workers skip Lightning)
        from lightning_scale.config import from_flat_kwargs
        from lightning_scale.parallelize import local_topology, parallelize

        kwargs, loss_fn = dict(LS[system]), _loss
        if system == "ls_tp2_own":  # the model's own tp_plan only (a Mixtral's experts whole on every rank)
            kwargs["plan"] = _own_plan(model)
        if system == "ls_tp2_ep" and _is_litgpt(model):  # litgpt's built-in plan, its experts list placed
            kwargs["expert_parallel"] = True
        elif system.startswith("ls_tp2_vp") or system == "ls_tp2_ep":  # the model's own plan, the head's logits
            # left split over the vocabulary; ls_tp2_ep: the experts placed whole (style expert_parallel)
            from lightning_scale.tensor_parallel import tensor_parallel_state
            from lightning_scale.tensor_parallel.experts import expert_plan_entries
            from lightning_scale.tensor_parallel.hf import _matches

            plan = _own_plan(model)
            plan.update(expert_plan_entries(model, lambda n: any(_matches(p, n) for p in plan), 2,
                                            placed=system == "ls_tp2_ep")[0])  # as built in
            kwargs["plan"] = {**plan, "lm_head": "vocab_colwise"}

            def loss_fn(logits, targets):
                return tensor_parallel_state(model).cross_entropy(logits, targets)
        config = from_flat_kwargs(**kwargs)
        topo = local_topology(config, world, rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pm = parallelize(model, config, topo, "cpu", optimizers=[opt], loss_fn=loss_fn)
        (engine,) = pm.make_engines()
        if system == "ls_tp2_vp_unshared":  # every column layer reduces its own input gradient (5 per block)
            from lightning_scale.tensor_parallel import ColumnParallelLinear

            for m in model.modules():
                if isinstance(m, ColumnParallelLinear):
                    m.shared_input = None

        def step(x, y):
            if pm.pipeline is not None:
                with engine.no_sync():
                    loss = pm.pipeline.runtime.train_step(x, y)
            else:  # this rank's rows: 1 / dp of them (1 / (dp x ep) with ep: its ranks read their own rows too)
                n = topo.data_size
                x, y = x.chunk(n)[topo.data_rank], y.chunk(n)[topo.data_rank]
                loss = loss_fn(_logits(model, x), y)
                loss.backward()
                loss = loss.detach().clone()
                if topo.dp > 1:  # the global batch's loss, as every row reports
                    dist.all_reduce(loss, group=topo.dp_group)
                if n > topo.dp:
                    dist.all_reduce(loss, group=topo.tp_group)
                loss /= n
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step
    if system == "dtensor_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        _dtensor_plan(model, init_device_mesh("cpu", (world,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x, y):
            with loss_parallel():
                loss = _loss(model(input_ids=x).logits, y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.full_tensor().detach()
        return step
    if system in ("ddp", "ddp_routed"):
        if system == "ddp_routed":  # Llama 4's experts routed as lightning_scale routes them, then plain DDP
            from lightning_scale.tensor_parallel.routed_experts import route_experts

            route_experts(model)
        # DeepSeek-V4's indexers pick positions (top-k): their weights get no gradient, which DDP must be told of
        unused = getattr(getattr(model, "config", None), "model_type", None) == "deepseek_v4"
        module = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    elif system == "fsdp2":
        _fsdp2(model)
        module = model
    else:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = _loss(_logits(module, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)  # the global batch's loss, as the other rows report
        return loss / world
    return step


def _lightning_run(system: str, kw: dict, batches, rank: int, world: int):
    """Lightning Trainer + ModelParallelStrategy inside the already initialized process group -> (step times, losses)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    times, losses = [], []
    tp = system == "lightning_tp"

    class Module(pl.LightningModule):
        def configure_model(self):
            self.model = build_llama(kw)
            if tp:
                _dtensor_plan(self.model, self.device_mesh["tensor_parallel"])
            else:
                _fsdp2(self.model, self.device_mesh["data_parallel"])

        def training_step(self, batch, _):
            from torch.distributed.tensor.parallel import loss_parallel

            x, y = batch
            if not tp:  # data parallel: this rank's half of the global batch
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            with loss_parallel() if tp else torch.enable_grad():
                return _loss(self.model(input_ids=x).logits, y)

        def backward(self, loss, *args, **kwargs):
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel() if tp else torch.enable_grad():
                loss.backward()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            loss = outputs["loss"].detach()
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss.clone()
            if not tp:
                torch.distributed.all_reduce(loss)
                loss /= world
            losses.append(float(loss))
            times.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    strategy = ModelParallelStrategy(data_parallel_size=1 if tp else world, tensor_parallel_size=world if tp else 1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=len(batches), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False)  # every rank: the global batch
    times.append(time.perf_counter())
    trainer.fit(Module(), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return [b - a for a, b in zip(times, times[1:])], losses


def worker(rank: int, world: int, system: str, kw: dict, batch: int, warmup: int, steps: int) -> dict:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(warmup + steps):
        ids = torch.randint(0, kw["vocab"], (batch, kw["seq"] + 1), generator=g)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    if system.startswith("lightning_"):
        step_times, losses = _lightning_run(system, kw, batches, rank, world)
    else:
        step = _plain_step(system, build_llama(kw), rank, world)
        step_times, losses = [], []
        for x, y in batches:
            t0 = time.perf_counter()
            losses.append(float(step(x, y)))
            step_times.append(time.perf_counter() - t0)
    timed = step_times[warmup:] or step_times[-1:]
    return {"step_s": statistics.median(timed), "peak_rss_mb": peak_rss_mb(), "loss0": losses[0],
            "loss": losses[-1]}


def _params_m(kw: dict) -> float:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_llama(kw).parameters()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4, help="global sequences per step")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--model", choices=["llama", "mixtral", "deepseek_v3", "llama4", "litgpt_moe", *NEW_PLANS],
                    default="llama")
    ap.add_argument("--experts", type=int, default=8, help="MoE models: routed experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="MoE models: experts per token")
    ap.add_argument("--expert-width", type=int, default=None,
                    help="MoE models: each expert's intermediate width (default: Mixtral 2 x hidden, DeepSeek-V3 hidden)")
    ap.add_argument("--systems", default=",".join(s for s in SYSTEMS if s != "ddp_routed"),
                    help="comma-separated rows; ddp is always added (ddp_routed: --model llama4 only)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per (round, system) run")
    ap.add_argument("--plot", default=None, metavar="PATH", help="also write the ratios vs DDP as a bar chart (PNG)")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; known: {', '.join(SYSTEMS)}")
    if "ddp" not in systems:
        systems.insert(0, "ddp")
    kw = dict(vocab=args.vocab, hidden=args.hidden, mlp=args.hidden * 11 // 4, layers=args.layers,
              heads=8, kv_heads=4, seq=args.seq, model=args.model, experts=args.experts, top_k=args.top_k,
              expert_width=args.expert_width)
    kw["mlp"] = -(-kw["mlp"] // 64) * 64  # 512 -> 1408, Llama's rounding
    from lightning_scale.testing import run_distributed

    rounds, failed = [], {}
    tokens = args.batch * args.seq
    for r in range(args.rounds):
        results = {}
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for name in order:
            if name in failed:
                continue
            try:
                out = run_distributed(worker, 2, (name, kw, args.batch, args.warmup, args.steps),
                                      timeout=args.timeout)
            except Exception as err:  # noqa: BLE001 - report why, keep going with the other rows
                failed[name] = " | ".join([t.strip() for t in str(err).splitlines() if t.strip()][-3:])
                print(f"round {r} {name:16s} FAILED: {failed[name]}", flush=True)
                continue
            results[name] = {"tokens_per_s": tokens / max(o["step_s"] for o in out),
                             "peak_rss_mb": max(o["peak_rss_mb"] for o in out),
                             "loss0": out[0]["loss0"], "loss": out[0]["loss"]}
            print(f"round {r} {name:16s} {results[name]['tokens_per_s']:8.1f} tok/s  "
                  f"rss {results[name]['peak_rss_mb']:6.0f} MB  loss {results[name]['loss0']:.4f} -> "
                  f"{results[name]['loss']:.4f}", flush=True)
        rounds.append(results)
    if "ddp" in failed or not any(rounds):
        raise SystemExit(f"the baseline failed: {failed.get('ddp')}")
    ok = [s for s in systems if s not in failed]
    rounds = [{k: r[k] for k in ok if k in r} for r in rounds]
    label = "litgpt GPT (LLaMAMoE)" if args.model == "litgpt_moe" else f"HF {args.model.capitalize()}"
    name = f"{label} {_params_m(kw):.1f}M"
    if args.model not in ("llama", "nemotron_h", "bamba", "qwen3_5"):
        width = args.expert_width or (args.hidden if args.model == "deepseek_v3" else args.hidden * 2)
        name += f" ({args.experts} experts of width {width}, top-{args.top_k})"
    print(f"\n## {name} ({datetime.date.today()}, 2 CPU ranks, {tokens} tokens/step, "
          f"{args.rounds} rounds x {args.steps} timed steps)\n")
    print(ratio_table(rounds, "ddp", extra=("peak_rss_mb",)))
    print("\nfirst / last loss (round 0; same init and data for every row): "
          + ", ".join(f"{k} {v['loss0']:.4f}/{v['loss']:.4f}" for k, v in rounds[0].items()))
    pairs = [(ls, peer, target) for ls, peers in PEERS.items() if ls in ok for peer, target in peers]
    print("\n### lightning_scale rows vs their named peer (same rounds)\n")
    print(peer_table(rounds, pairs, failed))
    for name, why in failed.items():
        print(f"- {name} failed: {why}")
    if args.plot:
        write_plot(args.plot, round_ratios(rounds, "ddp"), baseline="ddp",
                   title=f"{name}, tokens/s (2 CPU ranks, {datetime.date.today()})")


if __name__ == "__main__":
    main()
