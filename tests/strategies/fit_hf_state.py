"""Train an unchanged tiny ``LlamaForCausalLM`` (float64, SGD) and write its consolidated state three ways.

Rank 0 writes to ``--out-dir``: ``full.pt`` (``strategy.full_state_dict()``), ``lm.pt``
(``strategy.lightning_module_state_dict()``, except at ZeRO-3 where it is only the rest beside the shards) and
the sharded checkpoint folder ``ckpt`` (``trainer.save_checkpoint``) for the consolidation CLI. ``--strategy
single`` is the one-process reference (one ``full.pt``). The LightningModule has no model-specific code.
``--frozen`` trains hand-written low-rank adapters on q/v with the base frozen (see ``lora.py``).
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
from lightning_scale.models.gpt import lm_loss

VOCAB, SEQ, BATCH, STEPS = 97, 12, 4, 2  # 97: not divisible by tp=2, so a padded vocabulary would show


def llama(vocab: int = VOCAB, tied: bool = False):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def batches(vocab: int = VOCAB):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (STEPS * BATCH, SEQ + 1), generator=g)
    return list(zip(ids[:, :-1], ids[:, 1:]))


class LlamaModule(pl.LightningModule):
    def __init__(self, tied: bool = False, optimizer: str = "sgd") -> None:
        super().__init__()
        self.model = llama(tied=tied)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):  # not called under pp: the strategy runs the schedule
        x, y = batch
        return lm_loss(self.model(input_ids=x).logits, y)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-2)
        return torch.optim.SGD(params, lr=0.5)


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--strategy", default="zero3d")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--option", action="append", default=[])
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--optimizer", default="sgd")
    args = ap.parse_args()
    module = LlamaModule(tied=args.tied, optimizer=args.optimizer)
    loader = torch.utils.data.DataLoader(batches(), batch_size=BATCH)
    opts = {}
    for o in args.option:
        k, v = o.split("=", 1)
        opts[k] = int(v) if v.isdigit() else v
    strategy = "auto" if args.strategy == "single" else Zero3DStrategy(**opts)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=STEPS,
                         precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=loader)  # dp=1 in every layout used: every rank reads every batch
    out = args.out_dir
    if args.strategy == "single":
        torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, os.path.join(out, "full.pt"))
        return
    s = trainer.strategy
    full = s.full_state_dict()
    lm = s.lightning_module_state_dict()
    trainer.save_checkpoint(os.path.join(out, "ckpt"))
    if trainer.is_global_zero:
        torch.save(full, os.path.join(out, "full.pt"))
        torch.save(lm, os.path.join(out, "lm.pt"))
        with open(os.path.join(out, "info.json"), "w") as f:
            json.dump({"world": trainer.world_size, "stage3": s.sharded is not None}, f)


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
