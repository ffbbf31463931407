"""Train an unchanged tiny ``LlamaForCausalLM`` (float64, SGD) and write its consolidated state three ways.

Rank 0 writes to ``--out-dir``: ``full.pt`` (``strategy.full_state_dict()``), ``lm.pt``
(``strategy.lightning_module_state_dict()``, except at ZeRO-3 where it is only the rest beside the shards) and
the sharded checkpoint folder ``ckpt`` (``trainer.save_checkpoint``) for the consolidation CLI. ``--strategy
single`` is the one-process reference (one ``full.pt``). The LightningModule has no model-specific code.
``--lora`` freezes the model and trains hand-written low-rank adapters on every q_proj / v_proj (``LoRALinear``;
the optimizer is given every parameter, frozen ones included, as user code often does); rank 0 then also writes
each step's loss, the engine's ``memory_bytes()`` and the bytes the collectives moved during fit
(``CommCounter``) to ``info.json``. ``--dict`` feeds the batches as Hugging Face datasets give them
(``dict_batches``: ``input_ids``, a right-padding ``attention_mask``, ``labels`` with -100 at the padding) and
the training_step returns ``model(**batch).loss``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import lightning.pytorch as pl
import torch
import torch.nn as nn

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning_scale import Zero3DStrategy
from lightning_scale.models.gpt import lm_loss

VOCAB, SEQ, BATCH, STEPS = 97, 12, 4, 2  # 97: not divisible by tp=2, so a padded vocabulary would show


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + B(A(x)) * alpha / r``."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.lora_A = nn.Linear(base.in_features, r, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, dtype=base.weight.dtype)
        nn.init.normal_(self.lora_A.weight, std=0.2)
        nn.init.normal_(self.lora_B.weight, std=0.2)  # not zero: both factors get gradients from the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def add_lora(model: nn.Module) -> nn.Module:
    """Freeze every parameter of ``model``, then put trainable adapters on each attention's q_proj and v_proj."""
    model.requires_grad_(False)
    torch.manual_seed(1)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj, attn.v_proj = LoRALinear(attn.q_proj), LoRALinear(attn.v_proj)
    return model


# tp=2 with the adapters: the model's own tp_plan no longer fits (q_proj / v_proj are LoRALinear: refused by name), so
# a user plan: the frozen base layers as in Llama's tp_plan, A split and gathered (its input gradient is summed over
# tp), B split like the layer it adds to
LORA_TP_PLAN = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
                "model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise"}
for _p in ("q_proj", "v_proj"):
    LORA_TP_PLAN.update({f"model.layers.*.self_attn.{_p}.base": "colwise",
                         f"model.layers.*.self_attn.{_p}.lora_A": "colwise_gather_output",
                         f"model.layers.*.self_attn.{_p}.lora_B": "colwise"})


def llama(vocab: int = VOCAB, tied: bool = False, attn: str = "eager"):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, attn_implementation=attn)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64).eval()


def batches(vocab: int = VOCAB):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (STEPS * BATCH, SEQ + 1), generator=g)
    return list(zip(ids[:, :-1], ids[:, 1:]))


def dict_batches(vocab: int = VOCAB):
    """The batches of :func:`batches` as dicts, rows padded by different amounts (so the two micro-batches of a
    batch hold different numbers of label tokens), on the left (where the mask changes what real tokens see)
    and on the right."""
    out = []
    pad = [4, 0, -1, 2, 0, -3, 0, 0]  # per row of the STEPS * BATCH rows; > 0: on the left, < 0: on the right
    for i, (x, _) in enumerate(batches(vocab)):
        mask, n = torch.ones_like(x), pad[i % len(pad)]
        if n > 0:
            mask[:n] = 0
        elif n < 0:
            mask[n:] = 0
        out.append({"input_ids": x, "attention_mask": mask, "labels": x.masked_fill(mask == 0, -100)})
    return out


class LlamaModule(pl.LightningModule):
    def __init__(self, tied: bool = False, optimizer: str = "sgd", lora: bool = False, attn: str = "eager") -> None:
        super().__init__()
        self.model = llama(tied=tied, attn=attn)
        if lora:
            add_lora(self.model)
        self.optimizer, self.lora = optimizer, lora

    def training_step(self, batch, batch_idx):  # not called under pp: the strategy runs the schedule
        if isinstance(batch, dict):
            return self.model(**batch).loss
        x, y = batch
        return lm_loss(self.model(input_ids=x).logits, y)

    def configure_optimizers(self):
        params = list(self.parameters()) if self.lora else [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=1e-2)
        return torch.optim.SGD(params, lr=0.5)


class Record(pl.Callback):
    """Each step's loss (mean over ranks) and what the collectives moved from the first step to the last."""

    def __init__(self) -> None:
        from lightning_scale.comm.accounting import CommCounter

        self.losses, self.comm = [], CommCounter()

    def on_train_start(self, trainer, pl_module) -> None:
        self.comm.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.strategy.reduce(loss.detach(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module) -> None:
        self.comm.__exit__(None, None, None)


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--strategy", default="zero3d")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--option", action="append", default=[])
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--precision", default="64-true")
    ap.add_argument("--dict", action="store_true")
    ap.add_argument("--attn", default="eager")
    args = ap.parse_args()
    module = LlamaModule(tied=args.tied, optimizer=args.optimizer, lora=args.lora, attn=args.attn)
    loader = torch.utils.data.DataLoader(dict_batches() if args.dict else batches(), batch_size=BATCH)
    opts = {}
    for o in args.option:
        k, v = o.split("=", 1)
        opts[k] = int(v) if v.isdigit() else v
    if args.lora and opts.get("tp", 1) > 1:
        opts["plan"] = LORA_TP_PLAN
    strategy = "auto" if args.strategy == "single" else Zero3DStrategy(**opts)
    rec = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=STEPS,
                         precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                         callbacks=[rec])
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
            json.dump({"world": trainer.world_size, "stage3": s.sharded is not None, "losses": rec.losses,
                       "memory": [e.memory_bytes() for e in s.engines], "comm": dict(rec.comm.by_op),
                       "comm_by_tag": dict(rec.comm.by_tag)}, f)


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
