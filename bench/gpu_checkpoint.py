"""Checkpoint save / load on GPUs: lightning_scale universal / sharded vs torch DCP and DeepSpeed, 1.1B Llama + AdamW.

    python bench/gpu_checkpoint.py --dry-run          # the plan (no GPU needed)
    python bench/gpu_checkpoint.py                    # every visible GPU, 1 round
    python bench/gpu_checkpoint.py --layers 4 --rounds 2 --dir /local/nvme --out /tmp/gc

The GPU counterpart of ``bench/checkpoint.py`` (the same workers, rows and columns, one rank per GPU on NCCL; the
Lightning Trainer row is left to the CPU script). The model is bench/gpu_models.py's unchanged ``LlamaForCausalLM``
(hidden 2048, 16 layers, 32 / 8 heads, MLP 8192, vocabulary 32000: 1.10B parameters, fp32, AdamW: ~13 GiB of state
in all). With N >= 2 GPUs the resharded load is a second launch on N/2 GPUs (dp=N -> dp=N/2: lightning_scale ZeRO-2,
DCP FSDP2, DeepSpeed ds_to_universal + load_universal, as in the CPU script; ``--reshard-world 0``: dp=N -> tp=N in
the same processes, lightning_scale's tp_plan vs DTensor tp, no DeepSpeed reshard); on one GPU it is ZeRO-2 ->
ZeRO-3 for lightning_scale and FSDP2 -> an unsharded module for DCP (DeepSpeed: save and same-layout load only). The
async column is ``AsyncSaver`` (pinned host snapshot, background write): how long the save blocks the training
thread. Checkpoints go to ``--dir`` (a temporary folder there, removed after each row): put it on the fastest local
disk, the write speed bounds every row. ``$OUT/gpu_checkpoint.{json,md}`` get the tables. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SYSTEMS = ["ls_universal", "ls_sharded", "dcp_fsdp2", "deepspeed"]
MODEL = dict(vocab=32000, hidden=2048, mlp=8192, layers=16, heads=32, kv_heads=8)


def gpu_worker(rank: int, world: int, system: str, kw: dict, batch: int, root: str, device: str, reshard: str,
               phase: str = "save", expected=None) -> dict:
    import torch
    from checkpoint import worker

    torch.cuda.set_device(rank)
    return worker(rank, world, system, kw, batch, root, f"cuda:{rank}", reshard, phase, expected)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch", type=int, default=None, help="global sequences per step (default max(4, GPUs))")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=MODEL["layers"])
    ap.add_argument("--world", type=int, default=0, help="GPUs to use (0: all visible)")
    ap.add_argument("--reshard-world", type=int, default=None,
                    help="GPUs of the resharded load (dp; default half of --world, or 0 on one GPU: ZeRO-2 -> ZeRO-3 "
                         "in the same process, no DeepSpeed reshard); 0 with 2+ GPUs: dp -> tp in the same processes")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: the system's temp dir)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per (round, system) run")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_checkpoint_out"))
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if [s for s in systems if s not in SYSTEMS]:
        print(f"error: --systems: known rows are {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    import torch
    from checkpoint import _ratios, _table, reshard_label, run_row
    from gpu_models import n_params

    kw = dict(MODEL, layers=args.layers, seq=args.seq)
    world = args.world or max(torch.cuda.device_count(), 1)
    reshard_world = world // 2 if args.reshard_world is None else args.reshard_world
    reshard = reshard_label(world, reshard_world)
    args.batch = args.batch or max(4, world)
    if args.batch % world or (reshard_world and args.batch % reshard_world):
        print(f"error: --batch {args.batch} must be divisible by {world} and {reshard_world} GPUs", file=sys.stderr)
        return 2
    state_gib = n_params(kw) * 4 * 3 / 2**30
    print(f"gpu_checkpoint plan: LlamaForCausalLM {n_params(kw) / 1e9:.2f}B params, fp32 + AdamW = {state_gib:.1f} "
          f"GiB per checkpoint; {world} GPU(s), NCCL; rows {', '.join(systems)}; {args.rounds} round(s); resharded "
          f"load: dp={world} -> {reshard}; "
          f"checkpoints under {args.dir or tempfile.gettempdir()}; output {args.out}/gpu_checkpoint.json, .md",
          flush=True)
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("error: bench/gpu_checkpoint.py needs a CUDA GPU; use --dry-run, or bench/checkpoint.py on CPU",
              file=sys.stderr)
        return 2
    from lightning_scale.testing import run_distributed

    base = tempfile.mkdtemp(prefix="gpu_ckpt_", dir=args.dir)
    launch = lambda n, a: run_distributed(gpu_worker, n, a, timeout=args.timeout, backend="nccl",  # noqa: E731
                                          threads=4)
    rounds, failed = [], {}
    if "deepspeed" in systems:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            failed["deepspeed"] = "not run: deepspeed is not installed (pip install deepspeed)"
    try:
        for r in range(args.rounds):
            results = {}
            for name in systems[r % len(systems):] + systems[:r % len(systems)]:
                if name in failed:
                    continue
                try:
                    results[name] = run_row(launch, name, os.path.join(base, f"{r}_{name}"), world, reshard_world,
                                            (kw, args.batch, "cuda"))
                except Exception as err:  # noqa: BLE001 - report and continue
                    failed[name] = " | ".join([t.strip() for t in str(err).splitlines() if t.strip()][-3:])
                    print(f"round {r} {name:14s} FAILED: {failed[name]}", flush=True)
                    continue
                print(f"round {r} {name:14s} " + "  ".join(f"{k} {v:.3g}" for k, v in results[name].items()),
                      flush=True)
            rounds.append(results)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = (f"## gpu_checkpoint ({datetime.date.today()}): Llama {n_params(kw) / 1e9:.2f}B + AdamW, {world} GPU(s), "
            f"resharded load {reshard}, {args.rounds} round(s)\n\n" + _table(rounds, systems, failed)
            + "\n\n" + _ratios(rounds, failed))
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_checkpoint.json"), "w") as f:
        json.dump({"rounds": rounds, "failed": failed, "model": kw, "world": world, "reshard": reshard}, f, indent=1)
    with open(os.path.join(args.out, "gpu_checkpoint.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
