"""Tiny Hugging Face causal LMs of each supported family, built from transformers' config classes (no downloads).

The test matrix (``tests/dist/test_hf_matrix.py``, ``tests/unit/test_hf_pipeline.py``), the families table
(``scripts/models_table.py`` -> ``docs/models.md``) and the benchmarks share these definitions, so the table
lists exactly what was run. Shapes: hidden 32, 4 query heads of 8, 2 key/value heads (grouped-query where the
family has it), 4 layers (so pp=2 puts 2 layers on each stage), vocabulary 96, float64 by default.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               max_position_embeddings=64)

# name -> (model_type, config overrides, what the family exercises)
FAMILIES: Dict[str, Tuple[str, dict, str]] = {
    "llama": ("llama", dict(num_key_value_heads=2), "rotary, grouped-query attention, gated MLP"),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=5), "sliding-window mask on every layer"),
    "qwen2": ("qwen2", dict(num_key_value_heads=2), "q/k/v biases"),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=8), "per-head q/k RMSNorm"),
    "gemma": ("gemma", dict(num_key_value_heads=2, head_dim=8), "scaled embedding, tied head"),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=8, sliding_window=5, final_logit_softcapping=30.0,
                              attn_logit_softcapping=50.0), "alternating sliding/full layers, logit soft-capping"),
    "gemma3": ("gemma3_text", dict(num_key_value_heads=2, head_dim=8, sliding_window=5),
               "per-head q/k norms, per-layer-type rotary, sliding/full layers"),
    "phi3": ("phi3", dict(num_key_value_heads=2, pad_token_id=0), "fused qkv and gate_up (tp: split by parts)"),
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5), "fused per-head qkv, partial rotary, parallel residual"),
    "gpt2": ("gpt2", dict(n_inner=64), "learned positions, fused Conv1D c_attn, tied head"),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
                "mixture of experts: top-2 router over 4 experts (fused expert weights)"),
    "qwen2_moe": ("qwen2_moe", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, experts_implementation="eager"),
                  "experts + a gated shared expert, q/k/v biases"),
    "deepseek_v3": ("deepseek_v3", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=8, experts_implementation="eager"),
                    "multi-head latent attention (tp: style mla_kv_a_proj), grouped sigmoid router, shared expert, a "
                    "dense first layer"),
    # scalings in the forward that the pipeline adapter applies (hf_pipeline._SCALES)
    "granite": ("granite", dict(num_key_value_heads=2, embedding_multiplier=4.0, logits_scaling=2.0,
                                residual_multiplier=0.5, attention_multiplier=0.3), "embedding / logit / residual "
                                "multipliers (pp: the head and the embedding apply them)"),
    "granitemoe": ("granitemoe", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                      embedding_multiplier=4.0, logits_scaling=2.0, experts_implementation="eager"),
                   "mixture of experts with Granite's multipliers (pp: no pipeline plan, the Llama pattern)"),
    "cohere": ("cohere", dict(num_key_value_heads=2, logit_scale=0.25), "LayerNorm, parallel attention / MLP, "
                                                                         "logits * logit_scale"),
    "cohere2": ("cohere2", dict(num_key_value_heads=2, head_dim=8, sliding_window=5, logit_scale=0.25),
                "sliding / full layers, logits * logit_scale"),
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, experts_implementation="eager"),
                  "mixture of experts, per-head q/k RMSNorm"),
    "glm4_moe": ("glm4_moe", dict(num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                  experts_implementation="eager"),
                 "partial rotary, grouped sigmoid router, shared expert, a dense first layer"),
    "ernie4_5_moe": ("ernie4_5_moe", dict(num_key_value_heads=2, head_dim=8, moe_num_experts=4, moe_k=2,
                                          moe_intermediate_size=32, experts_implementation="eager"),
                     "mixture of experts with shared experts, interleaved rotary"),
    "gpt_oss": ("gpt_oss", dict(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                experts_implementation="eager", layer_types=["full_attention"] * 4),
                "attention sinks, experts with biases (split: the down bias added by tp rank 0; placed: whole per "
                "rank), no sdpa in transformers"),
    "exaone4": ("exaone4", dict(num_key_value_heads=2, head_dim=8), "post-norms, per-head q/k norms"),
    "olmo3": ("olmo3", dict(num_key_value_heads=2, sliding_window=5), "sliding / full layers, q/k norms over all heads"),
    "seed_oss": ("seed_oss", dict(num_key_value_heads=2, head_dim=8), "q/k/v biases, rotary"),
    # no base_model_pp_plan in their configs: pp uses the Llama pattern (hf_pipeline._LLAMA_PATTERN), checked here
    "olmoe": ("olmoe", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
              "mixture of experts, q/k RMSNorm over all heads (pp: the Llama pattern)"),
    "phimoe": ("phimoe", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              experts_implementation="eager"), "mixture of experts, LayerNorm (pp: the Llama pattern)"),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", dict(num_key_value_heads=2, head_dim=8),
                         "q/k norms after rotary (pp: the Llama pattern; tp: the Llama plan)"),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(num_key_value_heads=2, head_dim=8, num_experts=4, moe_topk=2,
                                              experts_implementation="eager"),
                       "mixture of experts, q/k norms after rotary (pp: the Llama pattern)"),
    "nemotron": ("nemotron", dict(num_key_value_heads=2, head_dim=8),
                 "LayerNorm1P, squared-ReLU MLP without gate, partial rotary (pp: the Llama pattern)"),
    "llama4": ("llama4_text", dict(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
                                   intermediate_size_mlp=64, interleave_moe_layer_step=2, attention_chunk_size=8),
               "Llama 4: dense experts module of its own, top-1 sigmoid router, shared expert, MoE every 2nd layer, "
               "chunked attention and layers without rotary"),
    "stablelm": ("stablelm", dict(num_key_value_heads=2), "partial rotary, LayerNorm (pp: the Llama pattern; tp: "
                                                          "no plan of its own, the Llama one)"),
    "bitnet": ("bitnet", dict(num_key_value_heads=2), "sub-layer norms, ReLU^2 (pp: the Llama pattern; tp: no plan of "
                                                      "its own, the Llama one, its sub-layer RMSNorms split)"),
    # 2025-era dense families (added 2026-12-06)
    "olmo2": ("olmo2", dict(num_key_value_heads=2), "post-norms, q/k RMSNorm over all heads"),
    "smollm3": ("smollm3", dict(num_key_value_heads=2, pad_token_id=0, no_rope_layer_interval=2),
                "no rotary on every 2nd layer (NoPE layers)"),
    "starcoder2": ("starcoder2", dict(num_key_value_heads=2, sliding_window=5),
                   "LayerNorm, biases everywhere, GELU MLP without gate, sliding window"),
    "glm4": ("glm4", dict(num_key_value_heads=2, head_dim=8, pad_token_id=0),
             "post-norms, partial interleaved rotary, fused gate_up, q/k/v biases"),
    "phi": ("phi", dict(num_key_value_heads=2), "parallel attention / MLP, partial rotary, dense layers with biases"),
    "apertus": ("apertus", dict(num_key_value_heads=2), "xIELU activation (trainable), q/k norms, llama3 rotary"),
    "nanochat": ("nanochat", dict(num_key_value_heads=2), "ReLU^2 MLP, q/k norms without weights, untied head"),
    "qwen3_next": ("qwen3_next", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                      linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                      linear_value_head_dim=8, experts_implementation="eager",
                                      layer_types=["linear_attention", "full_attention"] * 2),
                   "hybrid: gated DeltaNet (linear attention) and gated full attention layers, experts + shared expert"),
    "deepseek_v2": ("deepseek_v2", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=8, experts_implementation="eager"),
                    "multi-head latent attention, shared experts, a dense first layer"),
    "ministral3": ("ministral3", dict(num_key_value_heads=2, head_dim=8), "Mistral 3: rotary with YaRN-style scaling"),
    "ernie4_5": ("ernie4_5", dict(num_key_value_heads=2, head_dim=8), "ERNIE 4.5 dense: interleaved rotary"),
    "olmo": ("olmo", dict(num_key_value_heads=2), "non-parametric LayerNorm (no weights)"),
    "helium": ("helium", dict(num_key_value_heads=2, head_dim=8), "Kyutai Helium: the Llama layout, own RMSNorm"),
    "arcee": ("arcee", dict(num_key_value_heads=2, head_dim=8), "ReLU^2 MLP without a gate"),
    "vaultgemma": ("vaultgemma", dict(num_key_value_heads=2, head_dim=8), "Gemma 2 layout without post-norms"),
    "doge": ("doge", dict(num_key_value_heads=2, head_dim=8), "dynamic mask attention, residual scaling"),
    "jais2": ("jais2", dict(num_key_value_heads=2, head_dim=8), "LayerNorm, ReLU^2 MLP, biases"),
    "hyperclovax": ("hyperclovax", dict(num_key_value_heads=2, head_dim=8), "Peri-LN (norms after each sub-layer too), "
                    "scaled residuals and logits"),
    "qwen3_5": ("qwen3_5_text", dict(num_key_value_heads=2, head_dim=8, linear_num_value_heads=4,
                                     linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                     layer_types=["linear_attention", "full_attention"] * 2),
                "Qwen 3.5 dense: gated DeltaNet (linear attention) and gated full attention layers"),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                                             linear_value_head_dim=8, experts_implementation="eager",
                                             layer_types=["linear_attention", "full_attention"] * 2),
                    "Qwen 3.5 MoE: gated DeltaNet and full attention layers, experts + shared expert"),
    "cohere2_moe": ("cohere2_moe", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_local_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        experts_implementation="eager"),
                    "Cohere 2 MoE: parallel attention / experts, sliding layers"),
    "minimax_m2": ("minimax_m2", dict(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                      experts_implementation="eager"),
                   "MiniMax-M2: sigmoid routing with a bias, q/k norms over all heads"),
    "afmoe": ("afmoe", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, experts_implementation="eager"),
              "Arcee Trinity (AFMoE): gated attention, dense first layer, shared expert, sliding layers"),
    "solar_open": ("solar_open", dict(num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, experts_implementation="eager"),
                   "Solar Open: grouped sigmoid routing, shared expert"),
    "exaone_moe": ("exaone_moe", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, experts_implementation="eager"),
                   "EXAONE MoE: dense first layer, shared expert, sliding layers"),
    "glm": ("glm", dict(num_key_value_heads=2, head_dim=8, pad_token_id=0), "GLM-4 (first release): partial rotary, "
            "fused gate_up"),
    "gptj": ("gptj", dict(n_embd=32, n_head=4, n_layer=4, n_positions=64, rotary_dim=4),
             "GPT-J: parallel attention / MLP, interleaved partial rotary, untied head with bias"),
    "codegen": ("codegen", dict(n_embd=32, n_head=4, n_layer=4, n_positions=64, n_ctx=64, rotary_dim=4),
                "CodeGen: fused qkv in model-parallel blocks, parallel attention / MLP"),
    "minicpm3": ("minicpm3", dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8), "MiniCPM3: multi-head latent attention, "
                 "scaled embeddings / residuals / logits"),
    "flex_olmo": ("flex_olmo", dict(num_key_value_heads=2, head_dim=8, pad_token_id=0, num_experts=4,
                                    num_experts_per_tok=2, experts_implementation="eager"),
                  "FlexOlmo: OLMo 2 layout with experts"),
    "dots1": ("dots1", dict(num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                            n_shared_experts=1, routed_scaling_factor=1.0, experts_implementation="eager"),
              "dots.llm1: DeepSeek-V3 routing with a dense first layer"),
    "glm4_moe_lite": ("glm4_moe_lite", dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                                            first_k_dense_replace=1, experts_implementation="eager"),
                      "GLM-4.7-Flash: multi-head latent attention, grouped routing, shared expert"),
    "deepseek_v32": ("deepseek_v32", dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                          qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                          index_n_heads=2, index_head_dim=16, index_topk=8,
                                          experts_implementation="eager"),
                     "DeepSeek-V3.2: multi-head latent attention with the sparse-attention indexer"),
    "glm_moe_dsa": ("glm_moe_dsa", dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                        index_n_heads=2, index_head_dim=16, index_topk=8,
                                        mlp_layer_types=["dense"] + ["sparse"] * 3, experts_implementation="eager"),
                    "GLM-5 (GLM-MoE-DSA): multi-head latent attention with the sparse-attention indexer, MoE"),
    "kimi_linear": ("kimi_linear", dict(num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                        num_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
                                        linear_head_dim=8, linear_num_heads=4, experts_implementation="eager",
                                        layer_types=["linear_attention", "full_attention"] * 2,
                                        mlp_layer_types=["dense"] + ["sparse"] * 3),
                    "Kimi Linear: Kimi delta attention (linear, a state per head) and latent attention, MoE"),
    "jamba": ("jamba", dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            mamba_d_state=4, mamba_expand=2, use_mamba_kernels=False, experts_implementation="eager"),
              "Jamba: Mamba and attention layers, experts on every other layer"),
    "bamba": ("bamba", dict(num_key_value_heads=2, head_dim=8, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                            mamba_d_state=4, attn_layer_indices=[1, 3]), "Bamba: Mamba-2 and attention layers"),
    "nemotron_h": ("nemotron_h", dict(num_key_value_heads=2, head_dim=8, hybrid_override_pattern="M*M*",
                                      mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=4),
                   "Nemotron-H: Mamba-2 and attention blocks (2 groups, as its releases have 8: tp splits the "
                   "mixers; the other Mamba-2 families keep 1 group, their mixers whole at tp)"),
    "falcon_h1": ("falcon_h1", dict(num_key_value_heads=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=4,
                                    mamba_d_head=16, mamba_n_groups=1, mamba_d_state=4),
                  "Falcon-H1: attention and Mamba-2 side by side in every layer, muP multipliers"),
    "falcon": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False, bias=False),
               "Falcon (new decoder architecture): fused qkv grouped by key / value head, parallel attention / MLP, "
               "no pipeline or tp plan in its config"),
    "lfm2": ("lfm2", dict(num_key_value_heads=2, head_dim=8, layer_types=["conv", "full_attention"] * 2),
             "LFM2: short gated convolutions and attention layers"),
    "dbrx": ("dbrx", dict(d_model=32, attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                          ffn_config=dict(hidden_size=32, ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)),
             "DBRX: fused Wqkv with clipping, experts as 2-D w1 / v1 / w2 rows (tp: each expert split; never "
             "placed), no pipeline or tp plan in its config"),
    "granitemoehybrid": ("granitemoehybrid", dict(num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                                  num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=16,
                                                  mamba_n_groups=1, mamba_d_state=4, experts_implementation="eager",
                                                  layer_types=["mamba", "attention"] * 2),
                         "Granite 4 (MoE hybrid): Mamba-2 and attention layers, experts"),
    "gemma4": ("gemma4_text", dict(num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=5,
                                   hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"] * 2),
               "Gemma 4 (text): sliding / full layers of two head widths and rotary kinds, q / k / v norms"),
    "gemma4_moe": ("gemma4_text", dict(num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=5,
                                       hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                                       top_k_experts=2, moe_intermediate_size=16, experts_implementation="eager",
                                       layer_types=["sliding_attention", "full_attention"] * 2),
                   "Gemma 4 MoE: a mixture of experts beside each layer's dense MLP"),
    "gemma4_ple": ("gemma4_text", dict(num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=5,
                                       vocab_size_per_layer_input=96, hidden_size_per_layer_input=8,
                                       layer_types=["sliding_attention", "full_attention"] * 2),
                   "Gemma 4 E2B / E4B: per-layer input embeddings (pp refused by name)"),
    "mimo_v2_flash": ("mimo_v2_flash", dict(num_key_value_heads=2, head_dim=12, v_head_dim=8, sliding_window=5,
                                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                             experts_implementation="eager", mlp_layer_types=["dense"] + ["sparse"] * 3,
                                             layer_types=["sliding_attention", "full_attention"] * 2),
                      "MiMo-V2-Flash: attention sinks, sliding / full layers, q / k wider than v, MoE"),
    "deepseek_v4": ("deepseek_v4", dict(num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8, q_lora_rank=16,
                                        o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
                                        intermediate_size=16, hc_mult=2, hc_sinkhorn_iters=4, index_n_heads=2,
                                        index_head_dim=16, index_topk=4, sliding_window=4, pad_token_id=0,
                                        experts_implementation="eager",
                                        compress_rates=dict(compressed_sparse_attention=2,
                                                            heavily_compressed_attention=4),
                                        layer_types=["heavily_compressed_attention",
                                                     "compressed_sparse_attention"] * 2,
                                        mlp_layer_types=["hash_moe", "moe", "moe", "moe"]),
                    "DeepSeek-V4: hyper-connections (2 residual streams), compressed / sparse attention, hash-routed "
                    "and routed experts"),
    "mamba": ("mamba", dict(state_size=4, expand=2, time_step_rank=4, pad_token_id=0, residual_in_fp32=False),
              "Mamba (Mamba-1 blocks only, no attention; the residual kept in the model's dtype here, float64: its "
              "releases keep it in float32)"),
    "olmo_hybrid": ("olmo_hybrid", dict(num_key_value_heads=2, pad_token_id=0, linear_num_key_heads=4,
                                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                                        layer_types=["linear_attention", "full_attention"] * 2),
                    "OLMo hybrid: gated DeltaNet and attention layers"),
    "lfm3": ("lfm3", dict(num_key_value_heads=2, head_dim=8, sliding_window=5, pad_token_id=0,
                          layer_types=["conv", "full_attention", "conv", "sliding_attention"]),
             "LFM3: short convolutions, full and sliding-window attention layers"),
    "laguna": ("laguna", dict(num_key_value_heads=2, head_dim=8, sliding_window=5, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                              num_attention_heads_per_layer=[4, 2, 4, 2], pad_token_id=0,
                              experts_implementation="eager", mlp_layer_types=["dense"] + ["sparse"] * 3,
                              layer_types=["full_attention", "sliding_attention"] * 2),
               "Laguna: query heads per layer, sliding / full layers, MoE"),
    "minicpm5_moe": ("minicpm5_moe", dict(num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=16, pad_token_id=0, experts_implementation="eager",
                                          mlp_layer_types=["dense"] + ["sparse"] * 3),
                     "MiniCPM 5 MoE: its plan's unit_colwise key / value projections, a gated query"),
    "hy_v4": ("hy_v4", dict(num_key_value_heads=4, head_dim=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=8, v_head_dim=8, qk_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, index_n_heads=2, index_head_dim=16, index_topk=8, pad_token_id=0,
                            experts_implementation="eager", mlp_layer_types=["dense"] + ["sparse"] * 3,
                            layer_types=["indexed_attention"] * 4),
              "Hunyuan 4: hyper-connection streams, latent attention with the sparse-attention indexer, MoE"),
    "jetmoe": ("jetmoe", dict(num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                              tie_word_embeddings=False),
               "JetMoE: mixture of attention heads (routed q / o experts) and MoE MLP"),
}


# families pp refuses by name -> what the refusal says (the matrix checks the refusal). None now: LFM2 and Falcon-H1
# were ("declares no pipeline structure") until 2026-12-07; hf_pipeline._NAMED_STRUCTURE / _LAYER_MASKS run them
NO_PP: Dict[str, str] = {"gemma4_ple": "hidden_size_per_layer_input=8"}
# families whose forward upcasts the logits to float32 (Nemotron-H): a float64 run's loss is a float32 number, so
# another split of the batch or of the layers moves it by float32 rounding (one ulp of the loss: 4.8e-7 seen); the
# matrix's tolerance for them
FLOAT32_LOGITS_TOL = {"nemotron_h": 1e-6,
                      # Gemma 4 casts its q / k / v projections and norms to float32 inside the layer: a data-parallel
                      # split of the batch changes those gradients by float32 rounding (8.7e-8 relative in one
                      # process: the full batch's against the mean of its halves), 1.6e-6 on the loss after 3 steps
                      "gemma4": 5e-6, "gemma4_moe": 5e-6, "gemma4_ple": 5e-6,
                      # Mamba: its selective scan (transformers' reference path) runs in float32 (A_log.float(), dt.float()
                      # ...) and its logits are float32 (as Nemotron-H's): 4.8e-7 on the loss after 3 steps at dp2
                      "mamba": 2e-6,
                      # Hunyuan 4 adds each layer's residual streams in float32 (post.float() * ... + residual.float(),
                      # then back to the model's dtype): 4.8e-7 on the loss at dp2
                      "hy_v4": 2e-6}
# families transformers runs with eager attention only (it refuses sdpa for them)
NO_SDPA = ("gemma2", "gpt_oss", "vaultgemma", "mimo_v2_flash", "deepseek_v4", "hy_v4", "mamba")
# families whose layers hold transformers experts modules (3-D expert weights): the matrix also runs them with the
# experts placed whole at tp=2 (expert_parallel); tests/unit/test_hf_pipeline.py checks the list against the models
MOE = ("mixtral", "qwen2_moe", "deepseek_v3", "granitemoe", "qwen3_moe", "glm4_moe", "ernie4_5_moe", "gpt_oss",
       "olmoe", "phimoe", "hunyuan_v1_moe", "llama4", "qwen3_next", "deepseek_v2", "qwen3_5_moe", "cohere2_moe",
       "minimax_m2", "afmoe", "solar_open", "exaone_moe", "flex_olmo", "dots1", "glm4_moe_lite", "deepseek_v32",
       "jamba", "granitemoehybrid", "gemma4_moe", "mimo_v2_flash", "glm_moe_dsa", "kimi_linear", "deepseek_v4", "laguna", "minicpm5_moe", "hy_v4")


def build(name: str, attn: str = "eager", dtype: torch.dtype = torch.float64, seed: int = 0,
          overrides: Optional[Dict[str, Any]] = None) -> nn.Module:
    """A fresh tiny ``AutoModelForCausalLM`` of family ``name`` with ``attn`` attention, seeded init; ``overrides``:
    config values that replace the family's."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra, _ = FAMILIES[name]
    kwargs = dict(_COMMON, **extra)
    kwargs.update(overrides or {})
    if model_type == "gpt_neox":
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # no GQA in NeoX
    if model_type == "gpt2":  # GPT2Config maps hidden_size / num_* / max_position_embeddings, not the MLP width
        kwargs.pop("intermediate_size")
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if model_type == "gpt_neox":
        model.config.use_parallel_residual = True
    _fill_hash_tables(model, seed)
    return model.eval()  # dropout off: the matrix compares exact numerics


@torch.no_grad()
def _fill_hash_tables(model: nn.Module, seed: int) -> None:
    """DeepSeek-V4's hash-routed layers pick each token's experts from a fixed table (``tid2eid``, a buffer its
    checkpoints ship); the fresh model's is all zeros (every token to expert 0, twice). A seeded table of distinct
    experts per token instead, so the matrix routes tokens to every expert as a released model does."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor):
            experts = getattr(module, "num_experts", None) or int(table.max()) + 1
            rows = [torch.randperm(experts, generator=g)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows))


def batch(n: int, seq: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of next-token prediction: ids (n, seq) and the ids shifted by one."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
