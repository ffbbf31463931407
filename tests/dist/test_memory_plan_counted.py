"""The memory plan of Hugging Face models the one-unit profile cannot run as they are, on 2 ranks: a mixture of
experts (Mixtral, Qwen2-MoE from transformers' config classes) and any model split by tp.

An MoE layer's routing has data-dependent shapes, so it cannot be profiled on fake tensors; the plan counted its
activations from its Linear layers alone, missing the stacked expert weights ``(experts, out, in)`` that every
token passes ``top_k`` times: the step-1 plan of this Mixtral was 2.59x under the measured peak (Qwen2-MoE 1.61x),
so the autotuner and the estimator would pick layouts that do not fit. The count now includes the experts
(``activation_count._counted_profile``). At tp > 1 the live units are split and run collectives: they were counted
from their ``nn.Linear`` layers, which the tensor-parallel layers are not (an HF Llama's plan at tp=2 was 2.98x
under, Gemma3's 10.5x); now each unit is profiled with its parallel layers swapped for local-sized ``nn.Linear`` on
meta (``tensor_parallel.local_view.local_linears``), so sliding-window attention's per-head scores are seen too (Mistral, Gemma3), and a
unit that still cannot run (an MoE) is counted with the parallel layers at their local widths. Each case: one Trainer
fit, float32, 2 x 1024 tokens per rank, the measured step-1 peak (the engines' bytes + ``LiveTensorBytes``)
within 15% of the plan on every rank, no warning. The fits run GROUP at a time in one 2-rank launch, one Trainer after
the other (a launch per case took 3-6 s each, most of it interpreters, imports and the process group; 48 cases now
take about 70 s, the ratios the same to 0.01). Run as a script, this file is one rank of that launch.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest

CASES = {  # name: (family, Zero3DStrategy kwargs)
    "mixtral_zero2": ("mixtral", {"stage": 2}),
    "mixtral_zero2_ac": ("mixtral", {"stage": 2, "activation_checkpointing": "full"}),
    "qwen2_moe_zero2": ("qwen2_moe", {"stage": 2}),
    "llama_tp2": ("llama", {"tp": 2}),
    "mixtral_tp2": ("mixtral", {"tp": 2}),
    "mixtral_tp2_ac": ("mixtral", {"tp": 2, "activation_checkpointing": "full"}),  # experts split, recomputed
    "qwen2_moe_tp2_ep": ("qwen2_moe", {"tp": 2, "expert_parallel": True}),  # 2 whole experts per rank, ~1/2 the routes
    # ep=2: each rank its own rows, 2 whole experts, the routes to them from both ranks (all-to-all)
    "qwen2_moe_ep2": ("qwen2_moe", {"ep": 2}),
    "mixtral_ep2": ("mixtral", {"ep": 2}),
    "mistral_tp2": ("mistral", {"tp": 2}),  # sliding window: sdpa keeps per-head scores with the explicit mask
    "gemma3_tp2": ("gemma3", {"tp": 2}),
    # litgpt's LLaMAMoE: a block holding its router and a list of nn.Linear experts (4, 2 per token, a shared one)
    "litgpt_moe_zero2": ("litgpt_moe", {"stage": 2}),
    "litgpt_moe_tp2": ("litgpt_moe", {"tp": 2}),
    # its experts list placed by ownership (tensor_parallel/expert_lists.py): 2 whole experts per rank
    "litgpt_moe_ep2": ("litgpt_moe", {"ep": 2}),
    "litgpt_moe_tp2_ep": ("litgpt_moe", {"tp": 2, "expert_parallel": True}),
    "litgpt_moe_ep2_zero3": ("litgpt_moe", {"ep": 2, "stage": 3}),
    # Llama 4: its dense experts routed (tensor_parallel/routed_experts.py), top-1, a shared expert, MoE every 2nd
    # layer, chunked attention on 3 of 4 (an explicit mask: the MoE units profiled with their experts stubbed, each
    # kind of unit profiled; counted as before: 1.53-1.88x under, the largest unit for all: 1.28x over)
    "llama4_zero2": ("llama4", {"stage": 2}),
    "llama4_ep2": ("llama4", {"ep": 2}),
    "llama4_tp2": ("llama4", {"tp": 2}),
    # ZeRO-3 and Ulysses sp: the Hugging Face model rebuilt on meta from its config and profiled (the live units hold
    # flat shards / attend through the exchange); under sp each attention runs over the whole sequence with its heads
    # / sp under the whole sequence's mask. Counted before: Llama 4 ZeRO-3 2.46x under, Mistral sp=2 2.21x under
    "llama4_zero3": ("llama4", {"stage": 3}),
    "mixtral_zero3": ("mixtral", {"stage": 3}),
    "llama4_sp2": ("llama4", {"sp": 2}),
    "mistral_sp2": ("mistral", {"sp": 2}),
    # tp x ZeRO-3: rebuilt on meta as one tp rank holds it (tensor_parallel.local_view.local_on_meta); counted before:
    # Llama 4 2.58x under, Mistral 2.84x under
    "llama4_tp2_zero3": ("llama4", {"tp": 2, "stage": 3}),
    "mistral_tp2_zero3": ("mistral", {"tp": 2, "stage": 3}),
    # ep x ZeRO-3: the same rebuilt model in the ep layout (2 whole experts per rank, every rank's routes to them);
    # counted before: Llama 4 2.50x under (its chunk masks); Mixtral (no mask) 1.00 / 0.94 either way
    "llama4_ep2_zero3": ("llama4", {"ep": 2, "stage": 3}),
    # DBRX: its experts as 2-D (E * I, H) rows, not 3-D stacks: counted from its Linear layers alone, 2.04x under (tp=2:
    # 2.16x); GPT-OSS at tp=2: its biased experts split (the down bias added by rank 0)
    "dbrx_zero2": ("dbrx", {"stage": 2}),
    "dbrx_tp2": ("dbrx", {"tp": 2}),
    "gpt_oss_tp2": ("gpt_oss", {"tp": 2}),
    "gpt_oss_zero2": ("gpt_oss", {"stage": 2}),
    # Nemotron-H at tp=2: its Mamba-2 mixers split (style mamba2: a region with its own all-reduces); with ZeRO-3 the
    # model rebuilt on meta as one tp rank holds it (tensor_parallel.local_view.local_on_meta)
    "nemotron_h_zero2": ("nemotron_h", {"stage": 2}),
    "bamba_zero2": ("bamba", {"stage": 2}),
    # hybrids: a Mamba mixer's 3-D conv1d weight was taken for stacked experts (Nemotron-H counted as a mixture of
    # experts: 3.4x under), a block's Mamba and attention kinds profiled as the largest (1.7x over), Falcon-H1's
    # profile failed on the Mamba mixer's head_dim taken for the rotary width (counted: 5.1x under), Jamba / Granite 4
    # hybrid counted with their experts from Linear sizes (1.46x under)
    "jamba_zero2": ("jamba", {"stage": 2}),
    "lfm2_zero2": ("lfm2", {"stage": 2}),
    "falcon_h1_zero2": ("falcon_h1", {"stage": 2}),
    "granitemoehybrid_zero2": ("granitemoehybrid", {"stage": 2}),
    "nemotron_h_tp2": ("nemotron_h", {"tp": 2}),
    "nemotron_h_tp2_zero3": ("nemotron_h", {"tp": 2, "stage": 3}),
    # one group over both ranks (the released layout): B / C rows replicated, the norm's statistics summed over tp
    "bamba_tp2": ("bamba", {"tp": 2}),
    "falcon_h1_tp2": ("falcon_h1", {"tp": 2}),
    # Jamba's Mamba-1 mixers split by channels (style mamba1)
    "jamba_tp2": ("jamba", {"tp": 2}),
    # Ulysses through Mamba mixers: each gathers the sequence and runs 1 / sp of its heads on all of it (predicted 1.85x
    # over at first: the scan's (chunk x chunk) segment sums taken for attention scores, scaled by sp)
    "bamba_sp2": ("bamba", {"sp": 2}),
    "falcon_h1_sp2": ("falcon_h1", {"sp": 2}),
    # Qwen 3.5: its gated DeltaNet layers take position embeddings they do not use (their profile failed, counted: 2.17x
    # under); under sp they run cut by key-head groups
    "qwen3_5_zero2": ("qwen3_5", {"stage": 2}),
    "qwen3_5_sp2": ("qwen3_5", {"sp": 2}),
    "lfm2_sp2": ("lfm2", {"sp": 2}),
    # their DeltaNet / convolution layers cut by heads / channels at tp (one region each)
    "qwen3_5_tp2": ("qwen3_5", {"tp": 2}),
    "lfm2_tp2": ("lfm2", {"tp": 2}),
    # Qwen3-Next: a mixture of experts beside its DeltaNet: profiled with its experts stubbed (counted: 2.0x under)
    "qwen3_next_sp2": ("qwen3_next", {"sp": 2}),
    # DeepSeek-V4: its layers take hc_mult residual streams, rotary tables per kind and the token ids; counted from
    # its Linear sizes (they did not run alone on fake tensors) the plan was 9.9x / 6.7x under (its eager attention's
    # scores); profiled with those inputs (activation_profile._stream_inputs): 1.005 / 1.015
    "deepseek_v4_zero2": ("deepseek_v4", {"stage": 2}),
    "deepseek_v4_tp2": ("deepseek_v4", {"tp": 2}),
    # ... and at pp=2, where each of its 4 layers is a kind of its own: a kind found only on the other stage (no
    # storage on this rank) was counted, 1.45x under; the model is rebuilt on meta for its profile (memory_plan.py)
    "deepseek_v4_pp2": ("deepseek_v4", {"pp": 2}),
    # OLMo hybrid at pp=2: two layer classes (gated DeltaNet, attention); each stage counted the largest class's units
    # only and took the model's mean of the kinds (1.73 / 1.81 under); now its own units with their own profiles
    "olmo_hybrid_pp2": ("olmo_hybrid", {"pp": 2}),
    # ... with its two DeltaNet layers on stage 0 and its two attention layers on stage 1 (OVERRIDES): the model's mean
    # of the kinds would be over on one stage and under on the other
    "olmo_hybrid_pp2_split": ("olmo_hybrid", {"pp": 2}),
    # units of several kinds, their backward working sets in the order they run (activation_plan.ordered_backward):
    # kept (all units) + the largest working set was 1.2x over Jamba's pp=2 stage [Mamba, attention] (0.83 / 0.91);
    # under full checkpointing the mean unit's recompute stood for the heaviest kind's: Bamba 1.43x under, Nemotron-H
    # 1.48x, OLMo hybrid at pp=2 1.53x, Llama 4 1.17x (selective: OLMo hybrid 1.11x)
    "jamba_pp2": ("jamba", {"pp": 2}),
    "bamba_zero2_ac": ("bamba", {"stage": 2, "activation_checkpointing": "full"}),
    "nemotron_h_zero2_ac": ("nemotron_h", {"stage": 2, "activation_checkpointing": "full"}),
    "llama4_zero2_ac": ("llama4", {"stage": 2, "activation_checkpointing": "full"}),
    "olmo_hybrid_pp2_ac": ("olmo_hybrid", {"pp": 2, "activation_checkpointing": "full"}),
    "olmo_hybrid_zero2_selective": ("olmo_hybrid", {"stage": 2, "activation_checkpointing": "selective"}),
    # selective checkpointing keeps matmul outputs autograd does not save (an eager attention's scores: its softmax is
    # what autograd saves), so a unit's recompute regenerates all of its saved set beside them, not the saved set less
    # the kept outputs (activation_profile's ``selective_saved``): DeepSeek-V4 and GPT-OSS (eager attention with
    # sinks) were 1.20x under at ZeRO-2, 1.30-1.34x at pp=2
    "deepseek_v4_zero2_selective": ("deepseek_v4", {"stage": 2, "activation_checkpointing": "selective"}),
    "gpt_oss_zero2_selective": ("gpt_oss", {"stage": 2, "activation_checkpointing": "selective"}),
    # Gemma 4 interleaves sliding-window and full layers: its MLP holds the config too, whose window made every layer
    # "masked" (one kind, the sliding layer's bytes for all: 1.46x over); the model's one mask was averaged over the
    # kinds (full AC 1.17x under); its MoE layers beside full attention were counted from their Linear sizes (1.27x
    # under): every transformers experts module is now profiled with its experts stubbed and counted on top
    "gemma4_zero2": ("gemma4", {"stage": 2}),
    "gemma4_zero2_ac": ("gemma4", {"stage": 2, "activation_checkpointing": "full"}),
    "gemma4_moe_zero2": ("gemma4_moe", {"stage": 2}),
}
SEQ, BATCH = 1024, 2
# config overrides of a case (hf_families.build)
OVERRIDES = {"olmo_hybrid_pp2_split": {"layer_types": ["linear_attention"] * 2 + ["full_attention"] * 2}}
# Jamba's Mamba-1 scan loops over the positions in Python (no mamba kernels on CPU): its measured step at 1024 ran ~67k
# ops through the live-bytes dispatch mode (~25 s a case); at 256 its activations are still over a quarter of the
# plan (launch_and_check's activation_share; ratios 0.954 / 1.03 on 2026-12-07)
SEQ_OF = {"jamba": 256}
# families of CASES without experts (the hybrids' Mamba / convolution / DeltaNet layers beside attention)
DENSE = ("bamba", "lfm2", "falcon_h1", "nemotron_h", "qwen3_5", "olmo_hybrid", "gemma4")


def _litgpt_moe():
    import torch
    from litgpt import GPT, Config

    from lightning_scale.models import hf_families as F

    config = Config(n_layer=4, n_head=4, n_embd=32, block_size=SEQ, vocab_size=F.VOCAB, padded_vocab_size=F.VOCAB,
                    n_query_groups=2, norm_class_name="RMSNorm", mlp_class_name="LLaMAMoE", intermediate_size=64,
                    moe_intermediate_size=32, n_expert=4, n_expert_per_token=2, n_shared_expert=1,
                    parallel_residual=False, bias=False, rotary_percentage=1.0)
    torch.manual_seed(0)
    return GPT(config)


def _fit(name: str) -> dict:
    import lightning.pytorch as pl
    import torch

    import lightning_scale  # noqa: F401
    from lightning_scale import Zero3DStrategy
    from lightning_scale.models import hf_families as F
    from lightning_scale.models.gpt import lm_loss

    family, kwargs = CASES[name]
    seq = SEQ_OF.get(family, SEQ)
    F._COMMON["max_position_embeddings"] = seq

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            attn = "eager" if family in F.NO_SDPA else "sdpa"  # GPT-OSS: transformers has no sdpa for it
            self.model = (_litgpt_moe() if family == "litgpt_moe" else
                          F.build(family, attn, dtype=torch.float32, overrides=OVERRIDES.get(name)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.model(x) if family == "litgpt_moe" else self.model(input_ids=x).logits
            return lm_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    x, y = F.batch(2 * BATCH, seq, seed=0)
    loader = torch.utils.data.DataLoader(list(zip(x, y)), batch_size=BATCH)
    strategy = Zero3DStrategy(**kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), train_dataloaders=loader)
    plan = strategy.memory_plan
    return {"ratio": plan["ratio"], "predicted": plan["predicted"], "activations": plan["estimate"].activations.peak,
            "notes": list(plan["estimate"].activations.notes),
            "warned": [str(w.message) for w in caught if "[lightning_scale memory]" in str(w.message)]}


# Jamba: ~6 s a case at 256 positions (SEQ_OF)
SLOW = ("jamba_zero2", "jamba_tp2", "jamba_pp2")


GROUP = 9  # cases per launch: each one Trainer after the other in the same 2 processes


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """The fast cases, GROUP per 2-rank launch (a launch per case paid ~2 s of interpreters and imports each)."""
    pytest.importorskip("transformers")
    from test_memory_plan_dist import launch_many

    names = [n for n in CASES if n not in SLOW and not (n.startswith("litgpt") and not _has_litgpt())]
    out = {}
    for i in range(0, len(names), GROUP):
        group = names[i:i + GROUP]
        out.update(launch_many(__file__, tmp_path_factory.mktemp(f"counted{i}"), group, timeout=600))
    return out


def _has_litgpt() -> bool:
    import importlib.util

    return importlib.util.find_spec("litgpt") is not None


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_counted_step1_peak_within_15_percent(tmp_path, request, name):
    pytest.importorskip("transformers")
    if name.startswith("litgpt"):
        pytest.importorskip("litgpt", reason="litgpt is not installed (pip install litgpt==0.5.13 --no-deps)")
    from test_memory_plan_dist import check_plan, launch_and_check

    if name in SLOW:
        results = launch_and_check(__file__, tmp_path, name, timeout=300)
    else:
        results = request.getfixturevalue("counted")[name]
        assert not isinstance(results, str), results  # the launch failed: its output
        check_plan(name, results)
    for r in results:
        if "tp" not in CASES[name][1] and CASES[name][0] not in ("litgpt_moe", "mistral", *DENSE):  # the unit profile's
            # note (at tp the live split unit is counted; litgpt's experts are nn.Linear layers, no stacked weights)
            assert any("stacked expert weights" in n for n in r["notes"]), r["notes"]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_memory_plan_dist import main

    main(_fit)
