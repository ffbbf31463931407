"""The autotuner: the fastest layout that fits, chosen by measurement (issue 17 item 4; docs/tune.md).

    python -m lightning_scale.tune --model gpt_small --devices 2 --memory-budget 2GiB --global-batch 8 --budget-s 120
    python -m lightning_scale.tune --config-name config model=gpt_smoke --devices 2 --memory-budget 512MiB
    python -m lightning_scale.tune --model gpt_tiny --devices 2 --memory-budget 64MiB --resume tune.jsonl

1. **Candidates**: ZeRO stage x offload (``estimate.CHOICES``) x dp/tp/pp/sp split of ``--devices`` (tp where it
   divides the heads, pp where it divides the layers) x micro-batch size and count (``--global-batch`` sequences per optimizer
   step, the same work for every row) x bucket size (stages 0-2) x activation checkpointing x compile.
2. **Prune** with the memory plan (:mod:`lightning_scale.estimate`: model states + activations + the step's scratch)
   against ``--memory-budget`` per device, a layout over it climbing the memory relief ladder; every rejected
   candidate keeps its reason. Steps 1-2 live in :mod:`lightning_scale.tune_plan` (re-exported here).
3. **Measure** the survivors best-first by a cheap prior (:func:`prior`), each in a fresh process group
   (``lightning_scale.testing.run_distributed``: :func:`parallelize` + the engines, a few steps), until ``--budget-s``
   or ``--max-probes``; each result is appended to a JSON-lines file, and ``--resume FILE`` skips what it holds.
4. **Output**: a ranked table (tokens/s, predicted vs measured memory per rank) and the winner as a Hydra override line
   for ``examples/train.py``, checked with :func:`lightning_scale.hydra_config.check_before_training`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lightning_scale.config import ConfigError
# the probes live in lightning_scale/tune_probe.py; re-exported here (callers and tests import them from tune)
from lightning_scale.tune_probe import (_live_bytes, _probe_config, build_module, measure,  # noqa: F401
                                        module_worker, probe_worker)

# the layouts and their memory plan live in lightning_scale/tune_plan.py; re-exported here
from lightning_scale.tune_plan import (AC_CHOICES, RELIEF, Candidate, Row, Shape, _divisors,  # noqa: F401
                                       enumerate_candidates, module_prefix, no_fit_message, one_memory_bytes, plan,
                                       predict_bytes, prior, relief_ladder, relief_steps, relief_support,
                                       root_split_units)

MiB, GiB = 2**20, 2**30


def find_model(root, setting: str = "--module"):
    """(model, Shape or the GPT's config) inside a LightningModule (or a model): the package GPT, else a Hugging Face
    ``PreTrainedModel`` (its config gives heads, layers, vocabulary), else ``root`` itself if the estimator finds
    repeated units in it (a ModuleList of one class, or ``layer_modules()``). Llama 4's dense experts are made routed
    first, as :func:`~lightning_scale.parallelize.parallelize` will (:mod:`.tensor_parallel.routed_experts`)."""
    from lightning_scale.estimate import _units
    from lightning_scale.tensor_parallel.routed_experts import route_experts

    route_experts(root)

    gpts = [m for m in root.modules() if type(m).__name__ == "GPT" and hasattr(m, "cfg")]
    if gpts:
        return gpts[0], gpts[0].cfg
    for m in root.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "num_hidden_layers") and callable(getattr(m, "get_input_embeddings", None)):
            emb, head = m.get_input_embeddings(), m.get_output_embeddings()
            embed = sum(p.numel() for p in emb.parameters()) if emb is not None else 0
            tied = bool(getattr(cfg, "tie_word_embeddings", False))
            out = 0 if (head is None or tied) else sum(p.numel() for p in head.parameters())
            heads = getattr(cfg, "num_attention_heads", None)
            from lightning_scale.tensor_parallel.experts import is_experts

            experts = [e.num_experts for e in m.modules() if is_experts(e) and isinstance(getattr(e, "num_experts",
                                                                                                  None), int)]
            return m, Shape(n_head=heads, n_layer=int(cfg.num_hidden_layers), n_experts=min(experts, default=0),
                            seq_len=int(getattr(cfg, "max_position_embeddings", 128) or 128),
                            vocab_size=int(cfg.vocab_size), d_model=int(getattr(cfg, "hidden_size", 0) or 0),
                            n_kv_head=getattr(cfg, "num_key_value_heads", heads), embed_params=embed,
                            head_params=out, tie_weights=tied, name=type(m).__name__,
                            unit_prefix=module_prefix(root, m))
    units = [u for u in _units(root) if any(True for _ in u.parameters())]
    embeds = [m for m in root.modules() if type(m).__name__ == "Embedding"]
    if len(units) < 2 or not embeds:
        raise ConfigError(f"{setting}: the tuner needs a model the estimator can count: the package GPT, a Hugging Face "
                          f"PreTrainedModel, or repeated units (a ModuleList of one block class) with a token "
                          f"nn.Embedding; none found in {type(root).__name__} after configure_model()")
    return root, Shape(n_head=None, n_layer=len(units), seq_len=128, vocab_size=int(embeds[0].num_embeddings),
                       embed_params=sum(e.weight.numel() for e in embeds), name=type(root).__name__)


def parse_bytes(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5e9`` -> bytes."""
    units = {"kib": 2**10, "mib": MiB, "gib": GiB, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    low = str(text).strip().lower()
    for suffix, scale in units.items():
        if low.endswith(suffix):
            try:
                return int(float(low[: -len(suffix)]) * scale)
            except ValueError:
                break
    try:
        return int(float(low))
    except ValueError:
        raise ConfigError(f"--memory-budget={text!r}: use a size like 2GiB, 512MiB or 1e9") from None


def resolve_device(requested: str, devices: int) -> str:
    """``--device``: ``cpu``, ``cuda`` (one GPU per probe rank on this machine), or ``auto`` (cuda when this machine
    has a GPU). Never a silent fall-back: a GPU machine with fewer GPUs than ``--devices`` is an error, not a CPU
    measurement of a GPU layout."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device={requested!r}: choose auto, cpu or cuda")
    has = torch.cuda.is_available()
    if requested == "cpu" or (requested == "auto" and not has):
        return "cpu"
    if not has:
        raise ConfigError("--device=cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if devices > count:
        raise ConfigError(f"--devices={devices}: this machine has {count} GPU(s) and the CLI's probes run on one "
                          f"machine, one GPU per rank; tune the layout of a larger job with Zero3DStrategy("
                          f"autotune=True) inside its own launch, or pass --device=cpu for a CPU estimate")
    return "cuda"


def _ints(name: str, text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{name}={text!r}: use sizes like 1,2") from None


# ------------------------------------------------------------------------------------------------ the loop
def load_results(path: Optional[str]) -> Dict[str, Dict]:
    done: Dict[str, Dict] = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    done[rec["key"]] = rec
    return done


def tune(rows: List[Row], gpt, *, budget_s: float = 300.0, max_probes: Optional[int] = None,
         results_path: Optional[str] = None, measure_fn: Callable = measure, log: Callable = print,
         confirm: int = 3, **probe) -> List[Row]:
    """Measure the survivors best-first until the time budget or ``max_probes``, then the ``confirm`` fastest once
    more (ranked by the mean of their probes); returns the measured rows ranked."""
    survivors = [r for r in rows if not r.reason]
    done = load_results(results_path)
    start, probes = time.perf_counter(), 0
    for i, row in enumerate(survivors):
        key = row.candidate.key
        if key in done:
            row.result = done[key]
            log(f"[{i + 1}/{len(survivors)}] {key}: from {results_path} (skipped)")
            continue
        if (max_probes is not None and probes >= max_probes) or time.perf_counter() - start > budget_s:
            break
        try:
            row.result = measure_fn(gpt, row.candidate, **probe)
        except Exception as err:  # noqa: BLE001 - a failed layout is a result, not the end of the search
            row.result = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200]}"}
        probes += 1
        row.result.update(key=key, predicted_bytes=row.predicted, predicted_all_bytes=row.predicted_all)
        if results_path:
            with open(results_path, "a") as f:
                f.write(json.dumps(row.result) + "\n")
        speed = (f"{row.result['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row.result
                 else row.result["error"])
        log(f"[{i + 1}/{len(survivors)}] {key}: {speed} ({time.perf_counter() - start:,.0f}/{budget_s:g} s)")
    measured = sorted((r for r in survivors if r.result and "tokens_per_s" in r.result),
                      key=lambda r: -r.result["tokens_per_s"])
    for row in measured[:confirm] if confirm and len(measured) > 1 else ():
        # one probe is noisy (a shared CPU: +-10-30%): the leaders are measured again, ranked by the mean
        if len(row.result.get("repeats", [])) >= 2:
            continue
        try:
            again = measure_fn(gpt, row.candidate, **probe)["tokens_per_s"]
        except Exception:  # noqa: BLE001
            continue
        runs = row.result.get("repeats", [row.result["tokens_per_s"]]) + [again]
        row.result.update(repeats=runs, tokens_per_s=statistics.mean(runs))
        if results_path:
            with open(results_path, "a") as f:
                f.write(json.dumps(row.result) + "\n")
        log(f"confirm {row.candidate.key}: {again:,.0f} tokens/s (mean {row.result['tokens_per_s']:,.0f})")
    return sorted(measured, key=lambda r: -r.result["tokens_per_s"])


def format_ranked(ranked: Sequence[Row], limit: int = 15, failed: Sequence[Row] = ()) -> str:
    """tokens/s are the steady steps' (after the warm-up); ``compile s``: the warm-up's seconds above that pace (the
    inductor compile of a compiled layout, ~0 for eager), not in tokens/s. ``failed``: probed rows that raised, listed
    after the ranked ones as ``failed: <error>``."""
    lines = ["| # | layout | tokens/s | compile s | predicted device MiB/rank | predicted one memory (CPU) | "
             "measured MiB/rank |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(ranked[:limit]):
        m = r.result.get("measured_bytes")
        lines.append(f"| {i + 1} | {r.candidate.key} | {r.result['tokens_per_s']:,.0f} | "
                     f"{r.result.get('compile_s', 0.0):,.1f} | {r.predicted / MiB:,.1f} | {r.predicted_all / MiB:,.1f} | "
                     f"{'-' if m is None else f'{m / MiB:,.1f}'} |")
    for r in failed:
        lines.append(f"| - | {r.candidate.key} | failed: {r.result['error']} | - | {r.predicted / MiB:,.1f} | "
                     f"{r.predicted_all / MiB:,.1f} | - |")
    return "\n".join(lines)


def check_overrides(line: Sequence[str], base: Sequence[str] = ()) -> None:
    """Compose conf/ with the override line and run the pre-training checks (ConfigError names the Hydra key)."""
    from hydra import compose, initialize_config_dir

    from lightning_scale.hydra_config import check_before_training, register_configs

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    register_configs()
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(base) + ["trainer.accelerator=cpu"] + list(line))
    check_before_training(cfg)


# ------------------------------------------------------------------------------------------------ CLI
_SHAPE = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model")


def _model(args):
    """(meta module, GPTConfig, Hydra overrides that select it) from --model / --config-name overrides / --module."""
    from lightning_scale.estimate import _model_from_spec

    if args.module:
        lm = build_module(args.module, meta=True)
        model, shape = find_model(lm)
        if not isinstance(shape, Shape):  # the package GPT: its Hydra keys
            return model, shape, [f"model.{k}={getattr(shape, k)}" for k in _SHAPE]
        shape = dataclasses.replace(shape, module=args.module, sys_path=tuple(p for p in sys.path if p))
        return model, shape, None
    if args.config_name or args.overrides:
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        from lightning_scale.hydra_config import register_configs
        from lightning_scale.models.gpt import GPTConfig

        register_configs()
        conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose(config_name=args.config_name or "config", overrides=args.overrides)
        gpt = GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True))
        spec = "gpt_small:" + ",".join(f"{k}={getattr(gpt, k)}" for k in _SHAPE)
        return _model_from_spec(spec), gpt, [o for o in args.overrides if o.startswith("model")]
    model = _model_from_spec(args.model)
    return model, model.cfg, [f"model.{k}={getattr(model.cfg, k)}" for k in _SHAPE]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lightning_scale.tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/ (with --config-name)")
    ap.add_argument("--config-name", default=None)
    ap.add_argument("--model", default="gpt_small", help="gpt_tiny / gpt_small[:key=value,...]")
    ap.add_argument("--module", default=None, help="pkg.mod:LightningModule (built with no arguments; configure_model "
                    "builds the package GPT, a Hugging Face model, or repeated blocks; training_step takes (tokens, targets))")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--memory-budget", default="2GiB", help="per device")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--max-probes", type=int, default=None)
    ap.add_argument("--confirm", type=int, default=3, help="the fastest N are measured twice (mean)")
    ap.add_argument("--seq-len", type=int, default=None, help="overrides the model's seq_len")
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (all ranks)")
    ap.add_argument("--precision", default="32-true", help="the probes' precision: 32-true, bf16-mixed, 16-mixed, ...")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="auto", help="where the probes run: auto (a GPU per rank when this machine "
                    "has them), cpu (gloo), cuda (nccl)")
    ap.add_argument("--compile", action="store_true", help="also probe compile=True (per-unit inductor; its compile "
                    "seconds are reported apart from the steady tokens/s; ~1 min per compiled probe on a loaded 2-core CPU)")
    ap.add_argument("--compile-backend", default="inductor", help="the compiled probes' torch.compile backend "
                    "(aot_eager: Dynamo + AOTAutograd without inductor's C++ build, for a quick check of the path)")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--offloads", default=None, help="e.g. none,optimizer")
    ap.add_argument("--tp", default=None, help="tp sizes to try, e.g. 1,2")
    ap.add_argument("--pp", default=None, help="pp sizes to try")
    ap.add_argument("--ac", default="none,full", help="none,full,selective")
    ap.add_argument("--sp", default="auto", help="Ulysses sizes to try, e.g. 1,2; 'all': every divisor of --devices; "
                    "'auto' (default): 1, and every divisor when no layout fits at 1")
    ap.add_argument("--relief", default=",".join(RELIEF), help="memory relief a layout that does not fit may climb "
                    f"to, cheapest first (default {','.join(RELIEF)}; 'none': off)")
    ap.add_argument("--estimate-only", action="store_true", help="prune and rank by the prior; measure nothing")
    ap.add_argument("--results", default="tune_results.jsonl", help="JSON-lines file the probes append to")
    ap.add_argument("--resume", default=None, help="a results file: its candidates are not measured again")
    args = ap.parse_args(argv)
    try:
        model, gpt, base = _model(args)
        if args.seq_len and isinstance(gpt, Shape):
            gpt = dataclasses.replace(gpt, seq_len=args.seq_len)
        elif args.seq_len:
            from lightning_scale.estimate import _model_from_spec

            gpt = dataclasses.replace(gpt, seq_len=args.seq_len)
            model = _model_from_spec("gpt_small:" + ",".join(f"{k}={getattr(gpt, k)}" for k in _SHAPE))
            base = [b for b in base if not b.startswith("model.seq_len")] + [f"model.seq_len={args.seq_len}"]
        ints = lambda s: tuple(int(v) for v in s.split(",")) if s else None  # noqa: E731
        budget = parse_bytes(args.memory_budget)

        def planned(sps):
            return plan(model, gpt, args.devices, args.global_batch, budget, precision=args.precision,
                        allow_compile=args.compile, stages=ints(args.stages),
                        offloads=tuple(args.offloads.split(",")) if args.offloads else None, tps=ints(args.tp),
                        pps=ints(args.pp), acs=tuple(None if a == "none" else a for a in args.ac.split(",")),
                        compile_options=(False, True), sps=sps,
                        relief=() if args.relief in ("", "none") else tuple(args.relief.split(",")))

        auto = args.sp == "auto"
        rows = planned((1,) if auto else None if args.sp == "all" else _ints("--sp", args.sp))
        survivors = [r for r in rows if not r.reason]
        if auto and not survivors and args.devices > 1:  # nothing fits whole sequences: split them too
            rows = planned(None)
            survivors = [r for r in rows if not r.reason]
            print("no layout fits with whole sequences per rank: Ulysses (sp) searched too")
        device = resolve_device(args.device, args.devices) if not args.estimate_only else None
        print(f"{len(rows)} candidates, {len(survivors)} fit {budget / MiB:,.1f} MiB/device" + (
            "" if device is None else f"; probes on {device} ({'nccl' if device == 'cuda' else 'gloo'}): measured = "
            + ("the GPU's tensor bytes, vs the predicted device column" if device == "cuda"
               else "every live tensor, vs the predicted one-memory column (a CPU)")))
        if not survivors:
            raise ConfigError(no_fit_message(rows, budget))
        if args.estimate_only:
            ranked = survivors
            print("\n".join(f"{r.prior:.3f}  {r.candidate.key}  {r.predicted / MiB:,.1f} MiB" for r in ranked[:15]))
        else:
            path = args.resume or args.results
            ranked = tune(rows, gpt, budget_s=args.budget_s, max_probes=args.max_probes, results_path=path,
                          confirm=args.confirm, steps=args.steps, precision=args.precision, device=device,
                          compile_setting=True if args.compile_backend == "inductor" else {"backend": args.compile_backend})
            failed = [r for r in rows if r.result and "error" in r.result]
            if not ranked:
                raise ConfigError("every probed layout failed: " + "; ".join(
                    f"{r.candidate.key}: {r.result['error']}" for r in failed) + f" (the results file: {path})")
            print(format_ranked(ranked, failed=failed))
        line = ranked[0].candidate.overrides(args.precision)
        if base is None:  # a LightningModule of its own: the strategy's settings, not examples/train.py's config
            kw = ", ".join(f"{k}={v!r}" for k, v in ranked[0].candidate.strategy_kwargs().items())
            print(f"\nwinner: Zero3DStrategy({kw}) on {ranked[0].candidate.world}"
                  f" devices, {ranked[0].candidate.micro_batch} sequences per micro-batch x {ranked[0].candidate.accum}")
        else:
            check_overrides(line, base)
            print("\nwinner: python examples/train.py " + " ".join(base + line))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # ``python -m lightning_scale.tune`` runs this file as __main__: run the package module's main, so that its
    # Candidate / Shape are the classes the probes (lightning_scale.tune_probe) check against (a __main__.Shape was
    # not a lightning_scale.tune.Shape: --module probes ran the GPT worker and failed)
    from lightning_scale.tune import main as _main

    sys.exit(_main())
