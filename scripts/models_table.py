"""Write docs/models.md: the supported Hugging Face families, from a run of the test matrix (not by hand).

    python scripts/models_table.py [--out docs/models.md]

Runs ``tests/dist/test_hf_matrix.py``'s full matrix (every family of ``lightning_scale.models.hf_families``
x {ZeRO-3 at dp=2, tp=2, pp=2, pp=2 with a padding mask} x {eager, sdpa}, 2 ranks, float64, 3 SGD steps) and records per
case the largest per-step loss difference to one process, or the error that refused it; then
``tests/dist/test_litgpt.py``'s cases (litgpt's GPT, tp=2 / pp=2 / ZeRO-3 at dp=2, AdamW) for the litgpt rows.
Everything of ``--out`` from the ``## Beyond the matrix`` heading on is hand-written and kept as it is.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "dist"))

TOL = 1e-7
HAND = "\n## Beyond the matrix\n"  # the hand-written part of docs/models.md, kept across regenerations


def _hand_written(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    return ("## Beyond the matrix\n" + text.split(HAND, 1)[1]).rstrip("\n").split("\n") if HAND in text else []


PRETRAINED = ("Pretrained weights: `AutoModelForCausalLM.from_pretrained(dir)` inside `configure_model` (or "
              "`lightning_scale.from_pretrained` / `load_pretrained`) under zero3, tp=2 and pp=2 reads each rank's "
              "shard / slices / stage from the safetensors files; tested on Llama (zero3, tp2, pp2) and GPT-2 (zero3, "
              "tp2, pp2), Phi3 with one kv head at tp2 (fused projections read by parts), Mixtral (tp2, zero3, "
              "experts placed at tp2, ep2) and Qwen2-MoE (tp2, placed at tp2, ep2), whose files keep each expert's own "
              "tensors (read through transformers' conversion mapping; Mixtral 1e-8: its float32 routing weights), "
              "Llama 4 (tp2, ep2: its fused experts as on disk, run routed; and its text model out of a multimodal "
              "checkpoint as Scout / Maverick ship, tp2, ep2, pp2), and Llama / GPT-2 at dp2 x tp2 "
              "(ZeRO-3, 4 ranks), Llama at dp2 x pp2 (ZeRO-3, 4 ranks) and both at dp2 x tp2 x pp2 (8 ranks), each "
              "rank reading 25-26% of the file, against one process's `from_pretrained`, float64 1e-10 "
              "(`tests/dist/test_pretrained.py`); under Fabric (`init_module(empty_init=True)`, zero3 and tp2; "
              "`tests/strategies/test_pretrained_trainer.py`, float64 1e-10); recipe "
              "in the README, details in [checkpoints.md](checkpoints.md#hugging-face-in-and-out). The other "
              "families of the table were not tested with pretrained weights.")


def _cell(r, tol: float = TOL) -> str:
    if r is None:
        return "n/a"
    if r["err"] is not None:
        return "refused: " + r["err"].split("\n")[0][:80].replace("|", "/")
    diff = max(abs(a - b) for a, b in zip(r["ref"], r["got"]))
    return f"{'ok' if diff <= tol else 'FAIL'} ({diff:.0e})"


def _litgpt_lines() -> list:
    """The litgpt rows, from a run of tests/dist/test_litgpt.py's worker (or why they are missing)."""
    try:
        import test_litgpt as L  # skips at import when litgpt is not installed
    except BaseException as err:  # noqa: BLE001 - pytest's Skipped is a BaseException
        return ["", f"litgpt: not run ({type(err).__name__}: {str(err).splitlines()[0][:100]})"]
    from lightning_scale.testing import run_distributed

    res = run_distributed(L.litgpt_worker, 2, timeout=600)[0]
    layouts = ["tp2", "pp2", "zero3", "ep2", "tp2_placed"]
    lines = ["", "## litgpt", "", "litgpt's `GPT` (`lightning_scale.models.litgpt_adapter`: automatic pipeline adapter, built-in "
             "tp plan), tiny `Config`s of `tests/dist/test_litgpt.py`, 2 ranks, 3 AdamW steps; tolerance 1e-10 "
             "(float64) / 1e-5 (float32).", "",
             "| config | what it exercises | " + " | ".join(layouts) + " |", "|---|---|" + "---|" * len(layouts)]
    what = {"neox": "MHA, parallel residual, partial rotary, per-head q/k norms (tp: heads split)",
            "llama": "GQA 4/2, RMSNorm, gated MLP, scaled embedding, sliding window, soft-capping (tp: q heads and "
                     "kv groups split)",
            "mqa": "one kv group (tp2: replicated, each rank 2 of 4 q heads and the kv group; a user plan gathering "
                   "qkv also works)",
            "moe": "the llama attention with LLaMAMoE: 4 experts, 2 per token, a shared expert (tp: every expert's "
                   "width split, gate whole; ep2 / tp2_placed: 2 whole experts per rank, placed by ownership; "
                   "tolerance 1e-7: litgpt routes in float32)"}
    for name in L.CONFIGS:
        cells = []
        for layout in layouts:
            case = next(((n, lay, d) for n, lay, d in L.CASES if n == name and lay == layout), None) or next(
                ((n, lay, d) for n, lay, d in L.CASES if n == name and lay.startswith(layout)
                 and lay not in L.PLACED), None)
            if case is None:
                cells.append("n/a")
                continue
            ref, got = L._reference(name, case[2])[0], res[case[:2] + (str(case[2]),)]["losses"]
            diff, tol = max(abs(a - b) for a, b in zip(ref, got)), 1e-10 if case[2] == torch.float64 else 1e-5
            tol = L.TOLS.get(name, (tol,))[0]
            cells.append(f"{'ok' if diff <= tol else 'FAIL'} ({diff:.0e}, {str(case[2])[6:]})")
        lines.append(f"| {name} | {what.get(name, '')} | " + " | ".join(cells) + " |")
    lines += ["", f"Refused by name: {res['heads']!r}; {res['kv_groups']!r}; {res['sequence_parallel']!r}.",
              "", "At tp the consolidated parameters after the 3 steps equal one process's within 1e-10 (float64). "
              "dp2 x tp2 (4 ranks, llama, `test_gqa_dp2_tp2_equals_one_process`, slow): losses within 1e-10, "
              "parameters within 1e-8 (8.8e-9 seen, as at dp2 x tp1: Adam on near-zero gradients). moe: litgpt's "
              "`LLaMAMoE` computes its routing softmax in float32, so any other reduction order (micro-batches, dp "
              "halves, tp partial sums) moves its losses by ~1e-8 over the 3 steps (parameters within 1e-6); with the "
              "routing in float64 one forward / backward at tp=2 gives every gradient within 1e-12 relative "
              "(`test_moe_tp2_gradients_equal_one_process`), and ep2 gives plain dp2's losses bit for bit "
              "(`test_moe_ep2_exchange_equals_data_parallel_exactly`). ep2 / tp2_placed: litgpt's experts list "
              "placed by ownership, each rank 2 of the 4 experts whole under their own names "
              "([tensor_parallel.md](tensor_parallel.md#expert-parallelism))."]
    return lines


MOE = 'Mixtral and Qwen2-MoE (`experts_implementation="eager"` in these configs: transformers\' default grouped matmul has no float64): their own `tp_plan` (transformers 5) covers attention, embedding and head only; the built-in plan adds their experts (style `experts`: every expert\'s intermediate width split over tp, Qwen2-MoE\'s shared expert column / row-wise), so at tp=2 99% of their parameters are split (16% of this Mixtral\'s with its own plan). Mixtral\'s router keeps its routing weights in float32, so its tp2 rows differ from one process by float32 rounding (~1e-9 over 3 steps), not 1e-16 ([tensor_parallel.md](tensor_parallel.md#mixture-of-experts)); so does DeepSeek-V3\'s (its sigmoid router scores in float32), whose multi-head latent attention tp splits by heads with transformers\' own plan (`mla_kv_a_proj`: the shared rotary key\'s gradient summed over tp). OLMoE, PhiMoE, HunYuan dense and MoE, Nemotron, StableLM, BitNet, GraniteMoE, JetMoE and Llama 4 declare no pipeline plan in their configs; their base models are the Llama pattern, which pp uses for them (`hf_pipeline._LLAMA_PATTERN`; Llama 4 with its chunked-attention masks per layer); Llama 4\'s experts, which transformers runs densely (every expert on every token), are made routed first (`tensor_parallel/routed_experts.py`, same math, k / E of the expert work), so tp splits or places them like Mixtral\'s; its rotary runs in complex float32 (its tp rows: ~1e-8); StableLM brings no tp plan but has the Llama layout: transformers\' Llama plan (`tensor_parallel.hf.LLAMA_LAYOUT_PLAN`; `qk_layernorm=True` refused by name); BitNet brings none either: the same plan, its sub-layer RMSNorms over the split features kept split (style `rmsnorm_split`, the mean square summed over tp; its RMSNorm computes in float32: tp2 ~2e-8). Granite\'s embedding / logit multipliers and Cohere\'s logit scale are applied by the adapter\'s embedding and head (`hf_pipeline._SCALES`). Apertus\' MLP activation (xIELU) holds trainable scalars on the split features, which its own tp plan leaves out: the built-in plan sums their gradients over tp (`replicated_with_grad_allreduce`; without it its tp2 rows were 9.4e-7 off, silently). NanoChat norms the embeddings before its layers with the module that norms the last layer\'s output and declares no pipeline plan: that norm has no weights, so pp runs it on the first stage (after the embedding) and on the last (before the head) (`hf_pipeline._NORM_BEFORE_LAYERS`; refused by name were it to hold weights). Doge adds a dynamic mask onto a causal mask its base model always materializes (`allow_is_causal_skip=False`), and so does DeepSeek-V3.2 for its indexer: the pp stages now materialize it too (under sdpa Doge\'s pp2 rows were 9.5e-3 off, silently: the mask came back None). Declared tp plans that cannot run split are refused by name (`tensor_parallel.hf.BROKEN_PLANS`): CodeGen\'s fused qkv in fixed model-parallel blocks (split as declared: 1.1e-2 off, silently) and Doge\'s dynamic mask (a shape error before); so is tp on JetMoE (2026-12-07: no plan of its own; its attention is a mixture of attention heads, each expert\'s query and output projections stacked in a `JetMoeParallelExperts`, and its MLP a mixture of experts of the same kind: no layout here splits them; `ep` names them too), which trains at ZeRO-3, pp (the Llama pattern) and Ulysses sp (the Trainer, float32, 4 SGD steps: identical losses to one device). Gemma 4 (2026-12-07, `gemma4_text`: the dense layout, the MoE one with a mixture of experts beside each layer\'s dense MLP, and E2B / E4B with per-layer input embeddings) trains at ZeRO-3, tp (its own plan), pp and, for the MoE, with its experts split, placed (`expert_parallel`) or over `ep`: its layers record their key / value states for later layers to share, which the adapter gives a fresh record per call (none shares: `num_kv_shared_layers > 0` and the per-layer input embeddings, made by the base model from the ids, are refused by name under pp). It casts its q / k / v projections and its norms to float32 inside the layer, so a data-parallel split changes its gradients by float32 rounding (8.7e-8 relative in one process), and at the matrix\'s learning rate its tiny config turns a 1e-8 perturbation of the weights into 4.1e-5 of the loss by step 3 (Gemma 3 and Llama: 1e-8): its rows are within 1.7e-6 (tolerance 5e-6, `hf_families.FLOAT32_LOGITS_TOL`); through the Trainer (float32, by hand) sp=2 1.9e-5 and the MoE at ep=2 2.2e-5 for the same reason. MiMo-V2-Flash (2026-12-07; transformers runs it eager only): its declared tp plan marks the attention `local_params` with its sinks `colwise`, which the built-in style `head_params` takes (each rank\'s heads\' sinks; [tensor_parallel.md](tensor_parallel.md#built-in-plans-and-hugging-face-models)); ZeRO-3, pp, tp, experts placed and `ep` equal one process, and Ulysses sp runs each rank\'s heads with their sinks (GPT-OSS too; a shape error before). GLM-5 (`glm_moe_dsa`, 2026-12-07: multi-head latent attention with DeepSeek-V3.2\'s sparse-attention indexer, MoE) runs as DeepSeek-V3.2 does: ZeRO-3, tp, pp, experts placed and `ep` equal one process with no change here (tp 4e-9: its router computes in float32); Ulysses sp refused by name (its indexer). Kimi Linear (2026-12-07: Kimi delta attention, a linear attention with a state per head, beside latent attention; MoE): ZeRO-3, tp, pp (its linear-attention layers get the recurrent padding mask), experts placed and `ep` equal one process; its declared tp plan splits the MLPs and experts only: on the evening of 2026-12-07 its latent attention got DeepSeek-V3\'s plan for such layers (`hf_rules.mla_left_out`) and its delta attention style `kimi_delta` (`tensor_parallel/kda.py`: cut by heads as one region, the low-rank gates\' first halves and the gated norm whole with their gradients summed over tp): 96% of this tiny config split at tp=2 (62% before), every gradient equal to one process\'s (`tests/dist/test_tp_mamba.py`, 1e-5: its decay computes in float32); Ulysses sp runs it too (its delta attention cut by heads on the whole sequence, `tests/dist/test_sp_mamba.py`; refused by name before). Its files keep `q_conv1d` / `k_conv1d` / `v_conv1d` and write the experts\' patterns as escaped literals: both are followed now (`checkpoint.hf_conversions`), so a pretrained Kimi Linear (and MiMo-V2-Flash) fine-tunes at ZeRO-3, pp=2, tp=2 and ep=2 with the one-device losses (float32, by hand; "no tensor for ...conv1d.weight" before). MiniCPM3 divides the hidden states by `logits_scaling` before its head and Cohere 2 MoE scales its logits: both applied by the adapter\'s head. Ulysses sp (by hand, the Trainer, `tests/strategies/fit_hf.py --option sp=2`, float32, 4 SGD steps against one device): the 24 families added on 2026-12-06 within 1e-6 (MiniCPM3 3.8e-6; 0.0 in float64), except Qwen 3.5 dense / MoE (recurrent layers: run under sp since the evening of 2026-12-07, see below), DeepSeek-V3.2 (its indexer) and Doge (its dynamic mask), refused by name. Hybrid Mamba + attention families: Jamba, Bamba, Nemotron-H and Granite 4 (MoE hybrid) declare no pipeline plan; their base models are the Llama pattern under other names, which pp uses (`hf_pipeline._NAMED_STRUCTURE`; their Mamba layers get the recurrent padding mask per stage); ZeRO-3 takes a hybrid\'s decoder layers of two classes (Mamba and attention) as units when the model names both in `_no_split_modules` (Jamba: no unit was found before, the whole model one root unit); Nemotron-H upcasts its logits to float32, so its rows are within one float32 ulp of the loss (4.8e-7; tolerance 1e-6, `hf_families.FLOAT32_LOGITS_TOL`). LFM2 (short convolution layers; its final norm named `embedding_norm`) and Falcon-H1 (attention and Mamba side by side in every layer, muP multipliers) declare no pipeline plan either: pp uses their structure (`hf_pipeline._NAMED_STRUCTURE`), LFM2\'s convolution layers get the recurrent padding mask, Falcon-H1\'s layers the causal mask and the recurrent one (`mamba_attention_mask`, `hf_pipeline._LAYER_MASKS`), its embedding and logit multipliers applied by the adapter (pp refused them by name before 2026-12-07). Falcon-H1\'s `mup_vector` (a non-persistent buffer) and Apertus\' xIELU `beta` / `eps` were uninitialized memory in a model built on meta (ZeRO-3, tp, pp through the strategy) until configure_model\'s context kept buffers real (`materialize.parameters_on_meta`; the matrix builds its models for real, so it did not see it); and a pretrained Apertus under ZeRO-3 / tp / pp failed reading those 0-dim scalars from its safetensors (IndexError); both fine-tune from `from_pretrained(dir)` in `configure_model` equal to one device (3 SGD steps, float32, ZeRO-3, tp=2, pp=2: identical losses, checked by hand on 2026-12-07; `tests/unit/test_checkpoint_hf.py` reads them into the strategies\' meta build). Every family of the table loads `from_pretrained(dir)` in that context with the saved model\'s logits bit for bit (`test_every_family_from_pretrained_in_the_strategies_context_gives_the_saved_models_logits`); GPT-NeoX (its file names the head `embed_out`) and GraniteMoE / Granite 4 (`router.layer.weight`) failed with "no tensor for ..." until transformers\' escaped-literal renamings were followed (`checkpoint.hf_conversions`); a pretrained GPT-NeoX and GraniteMoE fine-tune at ZeRO-3, pp=2 and tp=2 equal to one device (GPT-NeoX tp=2: 4.8e-7; checked by hand). Falcon (rotary; new decoder layout with its query_key_value grouped by key / value head, or the old one interleaved per head) declares neither a pipeline nor a tp plan: pp uses its structure (`word_embeddings`, `h`, `ln_f`; `hf_pipeline._NAMED_STRUCTURE`) with the causal mask materialized as its base model does, tp the built-in `tensor_parallel.hf.FALCON_PLAN` (query_key_value split by rows: whole groups or heads); refused by name: ALiBi (pp and tp: every head\'s bias is added onto the mask) and multi-query with the old layout (tp); Ulysses sp=2 runs it too (its base model materializes the causal mask from the slice it gets: under sp it is given the whole sequence\'s, eager and sdpa equal one process within 1e-10 in float64, `tests/dist/test_ulysses.py`; it was refused with "an attention mask over 6 keys"; ALiBi refused by name); a pretrained Falcon\'s tied head is found under the embedding\'s name in its files (the source check said "no tensor for [\'lm_head.weight\']" before). Before 2026-12-07 a config flag set to True in the adapter\'s refusal list (Falcon\'s `alibi`, `use_bidirectional_attention`) passed as the neutral scale 1 (`True in (1, 1.0)`) and ran causal math, silently. Qwen3-Next\'s gated DeltaNet (linear-attention) layers get their padding mask per stage under pp (transformers\' `create_recurrent_attention_mask`); under Ulysses sp they run cut by key-head groups on the whole sequence (`sequence_parallel/mamba.py`, `tensor_parallel/deltanet.py`; refused by name before 2026-12-07: a recurrent layer\'s state runs along the whole sequence), as do the Mamba mixers of the hybrid families and LFM2\'s short convolutions (by channels). Its and DeepSeek-V2\'s float32 internals (routing, gated DeltaNet) put their rows at 1e-10 - 3e-9. DBRX declares neither a pipeline nor a tp plan (its class names the head only: at tp=2 7% of its parameters were split, the rest whole on every rank, with the startup table\'s warning): pp uses its structure (`wte`, `blocks`, `norm_f`; `hf_pipeline._NAMED_STRUCTURE`), tp the built-in `tensor_parallel.hf.DBRX_PLAN` (the fused `Wqkv` split per part by whole heads, `out_proj` by rows) and style `experts` on its experts, which it keeps as 2-D `w1` / `v1` / `w2` of (experts x ffn_hidden_size, hidden) rows: each expert\'s rows are cut over tp (98% split at tp=2); they cannot be placed whole (`expert_parallel`: its forward indexes them by the global expert id; refused by name). GPT-OSS\'s experts carry biases: style `experts` left them whole until 2026-12-07 (5% of the model split at tp=2); now the gate / up bias is cut with its columns and the down projection\'s bias is added by tp rank 0 only (the other ranks read `b - b.detach()`: zero, with the whole gradient), 89% split; a rank adding it too is 1.2e-3 off one process in the matrix (tests/dist/test_tp_experts_dist.py checks it with random biases). Declared tp plans that split no layer, and MLPs plans leave out (2026-12-07): HunYuan dense\'s config plan names its embedding only (14% split at tp=2): it gets the Llama plan with its q / k norms\' gradients summed over tp (6.7e-6 off without); the hybrid families\' plans cover attention only: Jamba\'s, Falcon-H1\'s and LFM2\'s dense MLPs and Granite 4\'s shared MLP are now split the Megatron way by a built-in rule (`hf_rules.mlps_left_out`; Granite 4 21% -> 97% split, LFM2 3% -> 87%, Falcon-H1 9% -> 43%, Jamba 69% -> 82%); `tests/unit/test_tp_hf_coverage.py` requires 85% split of every family. Mamba mixers at tp (2026-12-07, `tensor_parallel/mamba.py`, [tensor_parallel.md](tensor_parallel.md#mamba-2-mixers-hybrid-models)): style `mamba2` splits a Mamba-2 mixer\'s heads over tp, whole groups per rank when tp divides them (Megatron\'s rule; the Nemotron-H row is built with 2 groups, its releases have 8), else each rank\'s group\'s B / C rows replicated with their gradients summed over the ranks sharing it and the gated norm\'s statistics summed over them (Bamba, Falcon-H1 and Granite 4 hybrid keep one group, as their releases); style `mamba1` splits Jamba\'s Mamba-1 mixers by channels, `x_proj`\'s output all-reduced; Falcon-H1\'s attention gets the Llama plan (its config\'s plan names the embedding only). Qwen3-Next\'s and Qwen 3.5\'s declared plans gather their gated DeltaNet projections and run every head on every rank: the built-in plan cuts those layers by key-head groups as one region (style `gated_deltanet`), and LFM2\'s short convolutions by channels (`short_conv`; LFM2 87% -> 94% split). Split at tp=2: Nemotron-H 35% -> 99%, Bamba 72% -> 99%, Falcon-H1 43% -> 100%, Jamba 82% -> 99%, Granite 4 hybrid 100%; their tp2 rows within 4e-9 of one process, not 1e-15 as when the mixers stayed whole (the Mamba-2 gated norm and Jamba\'s dt / B / C norms compute in float32, as transformers casts, over sums now added rank by rank). Added on the evening of 2026-12-07: DeepSeek-V4 (hyper-connections: its residual is `hc_mult` streams between layers; compressed (CSA / HCA) attention with a sliding window, attention sinks, one key / value head; hash-routed experts that pick by token id in its first layers): ZeRO-3, tp, pp, experts placed and `ep` equal one process; under pp its stages carry the streams flattened and the token ids as three base-256 digit channels (exact in bfloat16 / float16: `hf_pipeline._Carry`), its `hc_head` collapses the streams before the final norm (its declared pipeline plan leaves it out) and every layer gets both rotary tables; at tp its experts and shared expert are split and its attention is cut by heads (`tensor_parallel/grouped_attention.py`: the query and the sinks by heads, the grouped output projection by whole groups, the shared key / value path whole with its gradient summed over tp; 93% of this config split, 52% with its declared plan); Ulysses sp refused by name (its compressor pools the whole sequence). Its hash table `tid2eid` (a buffer its checkpoints ship) was re-zeroed by the module\'s init when a strategy materialized the model from meta: buffers set after construction are kept now (`materialize.materialize_`). Its and Hunyuan 4\'s files rename tensors through chains of transformers renamings (`attn.wq_b` -> `self_attn.wq_b` -> `self_attn.q_b_proj`; `.hc_pre.hc_` -> `.hc_`): pretrained reads undo them last first, one occurrence at a time ("no tensor for" before). Hunyuan 4 (hyper-connection streams, latent attention with the sparse indexer whose top-k picks pass from layer to layer: its "shared" layers reuse the previous layer\'s, MoE): ZeRO-3, tp and pp equal one process, its stages carrying the streams and each token\'s picks as base-256 digits (a stage boundary before a shared layer: dropping them is 9e-3 off), its head kept in float32 as its forward does; Ulysses sp refused by its indexer; `config.hc_mult` on a family the adapter does not carry streams for is refused by name; its layers add the residual streams in float32 (rows 4.8e-7, tolerance 2e-6). Mamba (Mamba-1 blocks only, no attention, no tp or pp plan of its own): pp uses its structure (`embeddings`, `layers`, `norm_f`; the 2-D padding mask; its float32 logits), tp a built-in plan (the embedding; its mixers by style `mamba1`), Ulysses sp cuts only its mixers (no attention to wrap; the padding gathered over sp); its scan and logits run in float32 (rows 4.8e-7, tolerance 2e-6; the row is built with `residual_in_fp32=False`). OLMo hybrid\'s gated DeltaNet (a projection per part, `o_proj` / `o_norm`) is cut by heads at tp and under sp like Qwen 3.5\'s (67% split before). LFM3 (convolution, full and sliding-window attention layers: its convolution layers get no rotary table, a KeyError under pp before). MiniCPM 5 MoE\'s plan names its key / value projections `unit_colwise`, which is colwise here (whole heads, replicated where fewer than the tp ranks; refused before). Laguna (query heads per layer, sliding / full layers, MoE) runs everywhere with no change. Hunyuan 3 and Apertus 1.5 ran the matrix clean too (not kept in it, for the suite\'s time).'


def main() -> None:
    from test_hf_matrix import GRID, MODES, run_matrix

    from lightning_scale.models import hf_families as F

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "models.md"))
    ap.add_argument("--litgpt-only", action="store_true",
                    help="rerun only the litgpt cases and replace the litgpt section of --out (HF rows kept)")
    args = ap.parse_args()
    hand = _hand_written(args.out)
    tail = ([""] + hand if hand else []) + [""]
    if args.litgpt_only:
        with open(args.out) as f:
            kept = f.read().split("\n## litgpt\n")[0].rstrip("\n").split("\n")
        with open(args.out, "w") as f:
            f.write("\n".join(kept + _litgpt_lines() + tail))
        print(f"wrote {args.out} (litgpt section)")
        return
    result = run_matrix(list(F.FAMILIES), timeout=900)
    modes = list(MODES)
    lines = ["# Supported model families", "",
             f"Generated by `python scripts/models_table.py` on {datetime.date.today()} from the test matrix "
             "(`tests/dist/test_hf_matrix.py`): tiny configs from transformers' config classes, 2 ranks, float64, "
             f"3 SGD steps; a cell is `ok` when every per-step loss is within {TOL:g} of one process (the largest "
             "difference in brackets). The model is unchanged: zero3 shards it over dp=2 with one unit per decoder "
             "layer (found automatically, each rank half of every batch), tp uses its own `tp_plan` (and splits a "
             "mixture of experts' experts, style `experts`; tp2_ep places them whole instead, half of them per rank, "
             "`expert_parallel=True`, mixture-of-experts families only), pp the "
             "automatic adapter (`lightning_scale.models.hf_pipeline`).", "",
             "| family | model_type | exercises | attention | " + " | ".join(modes) + " |",
             "|---|---|---|---|" + "---|" * len(modes)]
    for name, (model_type, _, what) in F.FAMILIES.items():
        for attn in ("eager", "sdpa"):
            cells = [_cell(result.get((name, attn, m)), F.FLOAT32_LOGITS_TOL.get(name, TOL)) for m in modes]
            if all(c == "n/a" for c in cells):
                cells = ["transformers has no sdpa for this family"] + [""] * (len(modes) - 1)
            lines.append(f"| {name} | `{model_type}` | {what} | {attn} | " + " | ".join(cells) + " |")
    lines += ["", "GPT-2 declares no `base_model_pp_plan`: its pipeline layers come from its fixed structure (learned "
              "positions `wte + wpe`, `transformer.h`, `ln_f`, tied `lm_head`); its tp plan is built in. Not "
              "supported by the automatic pipeline adapter: OPT -> `ConfigError` asking for "
              "`pipeline_layers()`; it declares no `tp_plan` -> `ConfigError` asking for `tensor.plan`.",
              "", "dp2 x tp2 x pp2 (8 ranks, eager, ZeRO-1 over dp, 3 SGD steps, float64; "
              "`test_families_at_dp2_tp2_pp2_match_one_process`, slow): " + ", ".join(GRID) + " - per-step losses "
              "within 1e-7 of one process (at most 8.9e-16 seen on 2026-12-02).", "", MOE]
    lines += ["", PRETRAINED]
    lines += _litgpt_lines() + tail
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
