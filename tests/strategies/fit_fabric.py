"""Fabric loops on Zero3DFabricStrategy, launched as a script by tests/strategies/test_fabric.py.

``--suite parity``: for each layout in --layouts, a fresh Fabric trains the project GPT in float64 (3 optimizer steps,
2 micro-batches each, the first under ``fabric.no_backward_sync``, clipping 0.5, AdamW with two groups) from a
meta-device init where the layout allows; every rank records its losses, norms and the consolidated parameters.
For layouts marked ``resume``, the run also saves after step 2 and a fresh model + optimizer loads that folder
and redoes step 3: its parameters must equal the uninterrupted run's bit for bit.

``--suite trainer``: load a Trainer checkpoint (GPTLightningModule, zero2) into Fabric, check the weights against
the checkpoint, and save it again with Fabric (the Lightning loop state passed through) for the Trainer to resume.

``--suite bad``: a setting that must fail on every rank before training.
"""

from __future__ import annotations

import argparse
import ast
import json

import torch

import lightning_scale  # noqa: F401  (registers the strategies)
from lightning.fabric import Fabric

from lightning_scale.models.gpt import GPT, gpt_tiny, make_batch

MODEL = dict(n_layer=2, vocab_size=64, seq_len=16)
STEPS, MICRO, BATCH, CLIP, LR = 3, 2, 4, 0.5, 3e-3


def groups(model: torch.nn.Module):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batches(step: int):
    """The micro-batches of one optimizer step (the global batch of each, before the dp split)."""
    return [make_batch(gpt_tiny(**MODEL), BATCH, seed=10 * step + m) for m in range(MICRO)]


def _fabric(kw: dict, devices: int) -> Fabric:
    from lightning_scale.strategies import Zero3DFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=devices, strategy=Zero3DFabricStrategy(**kw), precision="64-true")
    fabric.launch()
    return fabric


def _setup(fabric: Fabric):
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):  # meta at stage 3 / tp: each rank materializes only its pieces
        model = GPT(gpt_tiny(**MODEL))
    opt = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95))  # built over the original parameters
    model, opt = fabric.setup(model, opt)
    return model, opt


def _loss(model, x, y):
    """Logits through Fabric's forward; under tp the head is split over the vocabulary, so the loss is the
    vocab-parallel cross-entropy of the model's tensor-parallel state (the same on every tp rank)."""
    from lightning_scale.models.gpt import lm_loss
    from lightning_scale.tensor_parallel import tensor_parallel_state

    logits = model(x)
    state = tensor_parallel_state(model.module)
    if state is not None and state.vocab_size is not None:
        return state.cross_entropy(logits, y)
    return lm_loss(logits, y)


def _step(fabric: Fabric, model, opt, step: int):
    dp, r = fabric.strategy.dp_size, fabric.strategy.dp_rank
    total = 0.0
    for m, (x, y) in enumerate(batches(step)):
        with fabric.no_backward_sync(model, enabled=m < MICRO - 1):
            loss = _loss(model, x.chunk(dp)[r], y.chunk(dp)[r]) / MICRO
            fabric.backward(loss)
        total += float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
    norm = float(fabric.clip_gradients(model, opt, max_norm=CLIP))
    opt.step()
    opt.zero_grad()
    return total, norm


def _full(fabric: Fabric) -> dict:
    strategy = fabric.strategy
    pm = strategy._parallel
    if pm.sharded is not None:
        state = pm.sharded.full_state_dict(dtype=None)
        state = pm.consolidate_stage3(state) if pm.model_parallel else state
    elif pm.model_parallel:
        state = pm.full_state_dict()
    else:
        state = pm.module.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def parity(layouts, devices: int, tmp: str) -> dict:
    out = {}
    for name, kw, resume in layouts:
        fabric = _fabric(kw, devices)
        model, opt = _setup(fabric)
        losses, norms = [], []
        for step in range(STEPS):
            if resume and step == STEPS - 1:
                fabric.save(f"{tmp}/{name}.ckpt", {"model": model, "optimizer": opt, "step": step})
            loss, norm = _step(fabric, model, opt, step)
            losses.append(loss)
            norms.append(norm)
        final = _full(fabric)
        from lightning_scale.compile import compiled_units

        row = {"losses": losses, "norms": norms, "engine": type(fabric.strategy.engines[0]).__name__,
               "compiled": len(compiled_units(fabric.strategy._parallel.module))}
        if resume:  # a fresh model and optimizer resume from the folder and redo the last step
            fabric2 = _fabric(kw, devices)
            model2, opt2 = _setup(fabric2)
            state = {"model": model2, "optimizer": opt2, "step": 0}
            fabric2.load(f"{tmp}/{name}.ckpt", state)
            loss, norm = _step(fabric2, model2, opt2, state["step"])
            again = _full(fabric2)
            row["resume"] = {"step": state["step"], "loss": loss, "norm": norm,
                             "max_diff": max((again[k] - final[k]).abs().max().item() for k in final),
                             "same_keys": sorted(again) == sorted(final)}
        if fabric.global_rank == 0:
            torch.save(final, f"{tmp}/{name}.pt")
        out[name] = row
    return out


def from_trainer(ckpt: str, resave: str) -> dict:
    """A zero2 Trainer checkpoint of tests/strategies/fit_gpt.py's GPTLightningModule into Fabric, and back."""
    from lightning_scale.lit import GPTLightningModule

    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero2")
    fabric.launch()
    module = GPTLightningModule(model=gpt_tiny(**MODEL), lr=3e-3, warmup_steps=2, max_steps=4)
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    module, opt = fabric.setup(module, opt)
    state = {"model": module, "optimizer": opt}
    rest = fabric.load(ckpt, state)
    saved = torch.load(f"{ckpt}/checkpoint.pt", map_location="cpu", weights_only=False)["state_dict"]
    mine = fabric.strategy._parallel.module.state_dict()
    worst = max((mine[k].float() - saved[k].float()).abs().max().item() for k in saved)
    inner = fabric.strategy.engines[0].inner
    steps = sorted({int(s["step"]) for s in inner.state.values() if "step" in s})
    fabric.save(resave, {**state, **rest})  # the loop state, lr schedulers, callbacks... passed through
    return {"worst": worst, "keys": sorted(saved) == sorted(mine), "inner_steps": steps,
            "rest": sorted(k for k in rest if k not in ("state_dict",))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", required=True, choices=["parity", "trainer", "bad"])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--layouts", default="[]", help="python literal: [(name, kwargs, resume), ...]")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--resave", default=None)
    ap.add_argument("--tmp", default=".")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_default_dtype(torch.float64)  # every layout and the reference build the GPT the same way
    if args.suite == "parity":
        result = parity(ast.literal_eval(args.layouts), args.devices, args.tmp)
    elif args.suite == "trainer":
        torch.set_default_dtype(torch.float32)
        result = from_trainer(args.ckpt, args.resave)
    else:
        fabric = _fabric(ast.literal_eval(args.layouts), args.devices)
        _setup(fabric)
        result = {"reached": "training"}
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
