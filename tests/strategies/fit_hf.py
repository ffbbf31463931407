"""Train a tiny, unchanged Hugging Face causal LM with a real Trainer; write the per-step losses as JSON.

The LightningModule has no ``pipeline_layers`` and no model-specific code: it holds
``AutoModelForCausalLM.from_config(...)`` (``lightning_scale.models.hf_families``) and a plain training_step.
``--option pp=2`` / ``tp=2`` / ``stage=3`` go to ``Zero3DStrategy``; ``--strategy single`` is the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import lightning.pytorch as pl
import torch

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale import Zero3DStrategy
from lightning_scale.models import hf_families as F
from lightning_scale.models.gpt import lm_loss


def _litgpt_moe() -> torch.nn.Module:
    """litgpt's GPT with its mixture-of-experts MLP (``LLaMAMoE``: 4 experts, 2 per token, a shared expert)."""
    from litgpt import GPT, Config

    config = Config(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=F.VOCAB, padded_vocab_size=F.VOCAB,
                    n_query_groups=2, norm_class_name="RMSNorm", mlp_class_name="LLaMAMoE", intermediate_size=128,
                    moe_intermediate_size=64, n_expert=4, n_expert_per_token=2, n_shared_expert=1,
                    parallel_residual=False, bias=False, rotary_percentage=1.0)
    model = GPT(config)
    model.apply(model._init_weights)
    return model


class HFModule(pl.LightningModule):
    def __init__(self, family: str, attn: str) -> None:
        super().__init__()
        self.litgpt = family == "litgpt_moe"  # litgpt's GPT (returns the logits) instead of a transformers model
        self.model = _litgpt_moe() if self.litgpt else F.build(family, attn, dtype=torch.float32)

    def training_step(self, batch, batch_idx):  # not called under pp: the strategy runs the schedule
        x, y = batch
        loss = lm_loss(self.model(x) if self.litgpt else self.model(input_ids=x).logits, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="llama")
    ap.add_argument("--attn", default="eager")
    ap.add_argument("--strategy", default="zero3d")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--option", action="append", default=[])
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--own-plan", action="store_true", help="tp: the model's own tp_plan as a user's plan (as "
                    "transformers declares it: no module added by the built-in plan)")
    args = ap.parse_args()
    torch.manual_seed(0)
    module = HFModule(args.family, args.attn)
    batches = [F.batch(4, 12, seed=s) for s in range(args.steps)]
    import yaml  # "stage=3" -> 3, "compile=true" -> True, "compile={backend: aot_eager}" -> a dict

    opts = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.option)}
    # with ep, the dp x ep ranks are data-parallel (devices / (pp x sp) of them): rank r reads rows r, r + dp x ep, ...
    # of every step's 4 (r: its index among them; pipeline stages and sp peers read the same rows), the one-device batch
    # (Lightning's own DistributedSampler would shuffle); every other layout here has dp=1, its peers read every batch
    ep, sp, pp = opts.get("ep", 1), opts.get("sp", 1), opts.get("pp", 1)
    split = args.devices // (pp * sp) if ep > 1 else 1
    rank = int(os.environ.get("LOCAL_RANK", 0))  # ((pp_i x dp + dp_i) x sp + sp_i) x ep + ep_i (topology.py)
    rank = (rank // (ep * sp)) % (split // ep) * ep + rank % ep if ep > 1 else 0  # dp_i x ep + ep_i
    rows = [(x[i], y[i]) for x, y in batches for i in range(rank, 4, split)]
    data = torch.utils.data.DataLoader(rows, batch_size=4 // split)
    if args.own_plan:
        from lightning_scale.tensor_parallel.hf import _matches, hf_plan

        names = [n for n, _ in module.model.named_modules() if n]
        opts["plan"] = {p: s for p, s in hf_plan(module.model).items() if any(_matches(p, n) for n in names)}
    strategy = "auto" if args.strategy == "single" else Zero3DStrategy(**opts)
    rec = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         precision=args.precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[rec], num_sanity_val_steps=0,
                         use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=data)
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            report = getattr(trainer.strategy, "compile_report", {})  # compile=...: Dynamo's counters at the end
            json.dump({"losses": rec.losses, "world": trainer.world_size, "compile": report.get("end"),
                       "eager_units": report.get("eager_units"),
                       "expert_load": getattr(trainer.strategy, "expert_load", None),
                       "tp_replicas": getattr(trainer.strategy, "tp_replicas", None)}, f)


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
