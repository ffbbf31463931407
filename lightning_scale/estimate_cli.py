"""The command line of the memory estimator, ``python -m lightning_scale.estimate`` (:mod:`lightning_scale.estimate`
holds the formulas, the model counts and the table; this module parses the options and prints). With ``--model``
it counts parameters from the config alone and imports no torch unless ``--seq-len`` asks for the activations.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from lightning_scale import estimate as E
from lightning_scale.config import ConfigError
from lightning_scale.estimate import (
    _PRECISION_BYTES,
    AC_POLICIES,
    GiB,
    OFFLOADS,
    STATE_PER_ELEMENT,
    _config_from_spec,
    _model_from_spec,
    _unique_trainable,
    activations_for_model,
    describe,
    estimate,
    estimate_all,
    format_table,
    with_activations,
)


def _count(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 13e9)") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_scale.estimate", description=E.__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_count, help="trainable parameters, e.g. 13e9")
    src.add_argument("--model", help="gpt_tiny | gpt_small | a conf/model name (gpt_mini, ...)[:key=value,...] "
                     "(counted from the config)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks N")
    ap.add_argument("--stage", type=int, default=3, help="the ZeRO stage you plan to use (marked with *)")
    ap.add_argument("--offload", default="none", help=f"the offload you plan to use: {', '.join(OFFLOADS)}")
    ap.add_argument("--precision", default="bf16-mixed", help=", ".join(_PRECISION_BYTES))
    ap.add_argument("--optimizer", default="adam", help=", ".join(STATE_PER_ELEMENT))
    ap.add_argument("--largest-unit", type=_count, default=None,
                    help="params of the largest unit (one block); default: from --model, else 0")
    ap.add_argument("--persistent", type=_count, default=0, help="stage-3 persistent params")
    ap.add_argument("--root", type=_count, default=None, help="stage-3 root unit params (embeddings, head: outside "
                    "the repeated units); default: from --model, else 0")
    ap.add_argument("--persistent-threshold", type=int, default=0, help="with --model: params below this stay whole")
    ap.add_argument("--prefetch-depth", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--offload-grads", action="store_true", default=None,
                    help="(default, as the engine does) under optimizer offload stages 2-3 keep no gradient shard "
                         "on the device")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="ranks sharing one host's memory")
    ap.add_argument("--unit", default="GiB", choices=("GiB", "MiB"))
    plan = ap.add_argument_group("the memory plan (activations; needs --model)")
    plan.add_argument("--seq-len", type=int, default=None, help="tokens per sequence: adds activations + the peak (profiles one unit "
                      "on fake tensors: imports torch, ~2 s more)")
    plan.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    plan.add_argument("--ac", default="none", choices=AC_POLICIES, help="activation checkpointing per unit")
    plan.add_argument("--offload-activations", action="store_true", help="checkpointed units' inputs on the host")
    plan.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks (each holds seq_len/sp tokens)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (activations only)")
    plan.add_argument("--loss-chunk", type=int, default=None,
                      help="chunked loss: positions per chunk, 0 = off (default: the model's loss_chunk)")
    plan.add_argument("--tiled-mlp", type=int, default=0, help="positions per tile of the tiled MLP (0: off)")
    plan.add_argument("--tiled-attention", type=int, default=0, help="heads per group of the head-tiled attention "
                      "(0: off)")
    args = ap.parse_args(argv)
    try:
        if args.model:
            from lightning_scale.models.gpt_config import param_counts  # from the config: no torch

            counts = param_counts(_config_from_spec(args.model), args.persistent_threshold)
            params = counts["params"]
            unit = counts["largest_unit_params"] if args.largest_unit is None else args.largest_unit
            persistent = counts["persistent_params"] or args.persistent
            root = counts["root_params"] if args.root is None else args.root
        else:
            params, unit, persistent, root = args.params, args.largest_unit or 0, args.persistent, args.root or 0
        common = dict(largest_unit_params=unit, persistent_params=persistent, prefetch_depth=args.prefetch_depth,
                      root_params=root,
                      optimizer=args.optimizer, bucket_mb=args.bucket_mb, offload_grads=args.offload_grads)
        mine = estimate(params, dp=args.dp, stage=args.stage, offload=args.offload, precision=args.precision,
                        **common)
        if args.seq_len is not None:
            if not args.model:
                raise ConfigError("--seq-len needs --model (the activations come from the model's shapes)")
            model = _model_from_spec(args.model)
            acts = activations_for_model(model, seq_len=args.seq_len, micro_batch=args.micro_batch,
                                         precision=args.precision, activation_checkpointing=args.ac,
                                         offload_activations=args.offload_activations, sp=args.sp, tp=args.tp,
                                         chunked_loss=args.loss_chunk, tiled_mlp=args.tiled_mlp,
                                         tiled_attention=args.tiled_attention)
            largest = max(p.numel() for p in _unique_trainable(model.parameters())) / (1 if args.stage == 0 else args.dp)
            mine = with_activations(mine, acts, step_tensor_numel=largest)
            built = getattr(getattr(model, "cfg", None), "seq_len", None)
            if built and args.seq_len > built:
                print(f"note: --seq-len {args.seq_len} exceeds the model's seq_len={built} (its position table); "
                      f"the activations are for {args.seq_len}", file=sys.stderr)
        rows = estimate_all(params, dp=args.dp, precision=args.precision, **common)
        table = format_table(rows, selected=(args.stage, args.offload), ranks_per_host=args.ranks_per_host,
                             unit=args.unit)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("lightning_scale memory estimate (model states per rank): "
          + describe(mine, unit, args.prefetch_depth))
    print(table)
    scale = GiB if args.unit == "GiB" else 2**20
    print(f"* = --stage {args.stage} --offload {args.offload}: "
          f"{mine.device.total / scale:,.2f} {args.unit} per device, "
          f"{mine.host.total / scale:,.2f} {args.unit} host per rank (model states). "
          + ("Activations: below." if mine.activations is not None else
             "Activations (--seq-len), buffers and the framework are not included."))
    a = mine.activations
    if a is not None:
        print(f"activations ({a.source}, {args.precision}): {a.tokens:,} tokens/rank ({args.micro_batch} x "
              f"{args.seq_len:,}/sp={args.sp}, tp={args.tp}) x {a.layers} units, checkpointing {a.policy}: "
              f"{a.per_token_layer:,.0f} bytes/token/unit without checkpointing; kept {a.kept / scale:,.2f}, "
              f"one unit's backward {a.recompute / scale:,.2f}, head {a.head / scale:,.2f}, loss {a.loss / scale:,.2f}"
              f" -> peak {a.peak / scale:,.2f} {args.unit}" + (f"; host {a.host / scale:,.2f} {args.unit}" if a.host else ""))
        if mine.stage == 3:
            resident, compute, step = mine.stage3_phases(a.steady_peak)
            how = (f"ZeRO-3 in phases: resident states {resident / scale:,.2f} + the largest of activations + the "
                   f"gathered units / the backward's end (root, its gradients, every gradient shard) "
                   f"{compute / scale:,.2f} and the optimizer step {step / scale:,.2f}")
        else:
            how = (f"model states {mine.device.total / scale:,.2f} + the larger of activations {a.peak / scale:,.2f} "
                   f"and the optimizer step's scratch {mine.step_scratch / scale:,.2f}")
        print(f"predicted peak per device: {mine.predicted_peak / scale:,.2f} {args.unit} ({how}); step 1: "
              f"{mine.first_step_peak / scale:,.2f} {args.unit} (no optimizer state yet during its backward)")
        for note in a.notes:
            print(f"note: {note}")
    for note in mine.notes:
        print(f"note: {note}")
    return 0

