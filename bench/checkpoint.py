"""Checkpoint save / load: lightning_scale's universal and sharded formats vs torch DCP, DeepSpeed and Lightning, CPU.

    python bench/checkpoint.py                       # 2 interleaved rounds, 2 ranks -> 4 ranks, HF Llama 102M
    python bench/checkpoint.py --world 4             # 4 ranks -> 2 ranks
    python bench/checkpoint.py --rounds 1 --layers 1 --hidden 64 --vocab 512   # quick look (seconds)
    python bench/checkpoint.py --systems ls_universal,dcp_fsdp2,deepspeed
    python bench/checkpoint.py --reshard-world 0     # the resharded load is dp -> tp=2 in the same processes

Every row trains the same unchanged ``LlamaForCausalLM`` (bench/models.py's builder: hidden 768, 8 layers, 8 / 4
heads, MLP 2112, vocabulary 32000, untied head: 102M parameters, fp32, AdamW) one step on ``--world`` ranks (dp),
then, in the same fresh processes:

    save            the whole training state (weights, Adam exp_avg / exp_avg_sq / step) to a new folder
    load            into a fresh model + optimizer of the same layout

and, in a second launch of ``--reshard-world`` fresh processes (default: 4 when --world is 2, else 2):

    reshard load    into a fresh model + optimizer of the same kind on the new number of ranks (dp=2 -> dp=4 ...)

ls_universal also saves the loaded state through ``AsyncSaver``, after everything else (twice: the first allocates
the host buffers; the second is timed): "async save blocks" is how long ``save`` held the training thread (the
snapshot), "async save total" until the folder was in place, "async host buffers" the snapshot buffers it keeps
between saves (the rank's own shards once more: not in the "peak RSS" column, which is the synchronous run's, as
the peers'). After each load the run takes 2 more steps, and their losses are compared
with the 2 steps the saving model took right after the save (same global batches): "resume dloss" is the largest
difference (0 = bit for bit; another dp size changes the reduction order, so ~1e-6 there). The loads into a fresh
optimizer (every row but lightning_fsdp2) allocate its Adam state inside the timed call: the rank's own shards of it
are part of their peak growth; lightning_fsdp2 loads into the live model and optimizer.

    ls_universal     lightning_scale parallelize(stage=2) + make_engines; checkpoint.engine_pieces.save_engines /
                     load_engines (the layout-free DCP format of checkpoint_format="universal"); reshard: stage 2 on
                     the new dp (or, with --reshard-world 0, tp=2 stage 1: the model's own tp_plan)
    ls_universal_z3  the same at stage=3 (parameters, gradients and optimizer state sharded, as FSDP2 shards them:
                     the like-for-like peak RSS row against dcp_fsdp2); reshard: stage 3 on the new dp
    ls_sharded       the same engines, checkpoint_format="sharded" (format 2: rank 0 the module state_dict, each
                     rank its engine.state_dict(); strategies.checkpoint.save_sharded / load_sharded); cannot
                     reshard (it refuses another layout)
    dcp_fsdp2        torch fully_shard per decoder layer + root; torch.distributed.checkpoint.state_dict
                     get_state_dict -> dcp.save; dcp.load -> set_state_dict; reshard: fully_shard on the new dp (or
                     DTensor parallelize_module tp=2, bench/models.py's torchtitan plan)
    deepspeed        deepspeed.initialize ZeRO-2, fp32, the torch AdamW as client optimizer, gradient_clipping 0,
                     DS_ACCELERATOR=cpu, gloo; engine.save_checkpoint / engine.load_checkpoint; reshard (one timed
                     call): rank 0 runs deepspeed.checkpoint.ds_to_universal (its CLI's main, --inject_missing_state,
                     2 extract + 2 merge worker processes: the box's cores) while the others wait, then every rank
                     load_checkpoint with "checkpoint": {"load_universal": true} on the new dp. "converter workers
                     peak RSS" is the largest of those worker processes (RUSAGE_CHILDREN, not in the rank's own)
    lightning_fsdp2  Lightning Trainer + ModelParallelStrategy(data_parallel_size=N) with the fsdp2 row's
                     fully_shard: trainer.save_checkpoint / strategy.load_checkpoint (Lightning's DCP save);
                     checked by the restored local shards' checksum, no reshard row

The peer rows (dcp_fsdp2, deepspeed, lightning_fsdp2) and the timers live in bench/checkpoint_peers.py; this file
holds the driver and the lightning_scale rows.

DeepSpeed needs ``pip install deepspeed torch==<this torch>`` (../shared/PEERS.md); without it its row reads
"not run" and says why. Times are seconds of the slower rank; bytes are the folder's size on disk; peak growth is
each rank's RSS high-water mark above its live RSS just before the call (max over ranks); "peak RSS" is the
process's (max over ranks, across the high-water mark resets of the timed calls), of the saving launch and of the
resharding launch. Each (round, system) runs in fresh
processes, the order rotated every round. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_peers import (AFTER, _dcp_reshard, _dcp_run, _ds_reshard, _ds_run,  # noqa: E402
                              _folder_bytes, _lightning_run, _timed, process_peak_mb)
from models import _loss, build_llama  # noqa: E402

SYSTEMS = ["ls_universal", "ls_universal_z3", "ls_sharded", "dcp_fsdp2", "deepspeed", "lightning_fsdp2"]
# ls_universal_z3: the same at ZeRO-3 (parameters and gradients sharded as FSDP2's: the like-for-like peak RSS row)
PEERS = {"ls_universal": ["dcp_fsdp2", "deepspeed", "lightning_fsdp2", "ls_sharded"],
         "ls_universal_z3": ["dcp_fsdp2", "deepspeed"]}
RESHARDS = {"ls_universal", "ls_universal_z3", "dcp_fsdp2", "deepspeed"}  # the rows with a resharded load
# the resharded load's layout: "world" (the same kind of layout on another number of ranks: a second launch, see
# worker's phase), "tp" (dp=N -> tp=N in the same processes) or "stage3" (one rank: ZeRO-2 -> ZeRO-3 / FSDP2 -> a
# plain module), for lightning_scale and for torch DCP; DeepSpeed reshards only in "world"
RESHARD_LS = {"tp": lambda world: dict(tp=world, stage=1), "stage3": lambda world: dict(stage=3),
              "world": lambda world: dict(stage=2)}


# ------------------------------------------------------------------------------------------------ lightning_scale
def _ls_build(kw, rank, world, device="cpu", **layout):
    import torch

    import lightning_scale.models  # noqa: F401  (registers the HF adapters; no Lightning import)
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(**layout)
    topo = local_topology(config, world, rank)
    model = build_llama(kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pm = parallelize(model, config, topo, device, optimizers=[opt], loss_fn=_loss)
    (engine,) = pm.make_engines()
    tp_rank = topo.tp_rank if config.tp > 1 else 0

    def step(x, y):
        from lightning_scale.testing import dp_step

        return dp_step(model, opt, topo, x, y, _loss, device=device)

    return model, engine, tp_rank, step


def _ls_run(system, kw, batches, rank, world, root, device="cpu", reshard=None):
    import torch
    import torch.distributed as dist

    from lightning_scale.checkpoint import dcp_format  # noqa: F401  (imported before the timers, as the peers')
    from lightning_scale.checkpoint.engine_pieces import load_engines, save_engines

    stage = 3 if system == "ls_universal_z3" else 2
    universal = system.startswith("ls_universal")
    model, engine, tp_rank, step = _ls_build(kw, rank, world, device, stage=stage)
    step(*batches[0])
    path = os.path.join(root, "ckpt")
    out = {}
    if universal:
        save = lambda: save_engines(path, model, [engine], tp_rank=tp_rank)  # noqa: E731
    else:
        from lightning_scale.strategies.checkpoint import load_sharded, save_sharded

        def bcast(obj):
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        def gather(obj):
            box = [None] * world
            dist.all_gather_object(box, obj)
            return box

        def save():
            ck = {"state_dict": model.state_dict(), "optimizer_states": [engine.state_dict()]}
            save_sharded(ck, path, rank, world, bcast, gather)
    _, out["save_s"], out["save_mb"] = _timed(save)
    out["bytes"] = _folder_bytes(path)
    out["expected"] = expected = [step(*b) for b in batches[1:1 + AFTER]]
    del model, engine, step
    model, engine, tp_rank, step = _ls_build(kw, rank, world, device, stage=stage)
    if universal:
        load = lambda: load_engines(path, model, [engine], tp_rank=tp_rank)  # noqa: E731
    else:
        def load():
            ck = load_sharded(path, rank, world)
            with torch.no_grad():
                model.load_state_dict(ck["state_dict"])
            engine.load_state_dict(ck["optimizer_states"][0])
    _, out["load_s"], out["load_mb"] = _timed(load)
    out["dloss"] = max(abs(a - b) for a, b in zip(expected, [step(*b) for b in batches[1:1 + AFTER]]))
    if universal:  # the same save through AsyncSaver, last: its host buffers stay allocated
        out["peak_rss_mb"] = process_peak_mb()  # the synchronous save / load run's peak, as the peers'
        _ls_async(out, model, engine, tp_rank, root, step, batches[1])
    if universal and reshard != "world":
        del model, engine, step
        out.update(_ls_reshard(kw, batches, rank, world, root, device, reshard, expected, stage))
    return out


def _ls_async(out, model, engine, tp_rank, root, step, batch):
    """How long an AsyncSaver save blocks the caller (the snapshot) and how long until it is written, of the
    loaded state (the same tensors as the synchronous save's); the host buffers it keeps between saves. Then the
    overlapped snapshot (``checkpoint_async="overlap"``): the save call, then one training step, whose optimizer
    step waits for the copy if it is not done: blocked = the call + that wait (max over ranks), beside the step's
    time with and without the save in flight."""
    import time

    import torch
    import torch.distributed as dist

    from lightning_scale.checkpoint.async_save import AsyncSaver
    from lightning_scale.checkpoint.engine_pieces import save_engines

    saver = AsyncSaver(group=dist.new_group(backend="gloo"))  # a group of its own (async_save's docstring)
    apath = os.path.join(root, "async")
    save_engines(apath, model, [engine], tp_rank=tp_rank, saver=saver)  # the first save allocates the buffers
    saver.wait()
    _, out["async_block_s"], out["async_mb"] = _timed(lambda: save_engines(apath, model, [engine], tp_rank=tp_rank,
                                                                           saver=saver))
    _, wait_s, _ = _timed(saver.wait)
    out["async_total_s"] = out["async_block_s"] + wait_s
    out["async_buffers_mb"] = saver.buffer_bytes / 2**20
    times, sync = [], (torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
    for overlap in (False, True):  # a step alone, then a step with an overlapped save in flight
        saver.fence_wait_s = 0.0
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        if overlap:
            save_engines(apath, model, [engine], tp_rank=tp_rank, saver=saver, overlap=True)
        t1 = time.perf_counter()
        step(*batch)
        sync()
        t2 = time.perf_counter()
        saver.wait()
        times.append([t1 - t0 + saver.fence_wait_s, t2 - t1])
    worst = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out["overlap_block_s"], out["step_alone_s"], out["step_overlap_s"] = (worst[1, 0].item(), worst[0, 1].item(),
                                                                           worst[1, 1].item())
    if dist.get_rank() == 0:
        shutil.rmtree(apath, ignore_errors=True)


def _ls_reshard(kw, batches, rank, world, root, device, reshard, expected, stage=2):
    from lightning_scale.checkpoint.engine_pieces import load_engines

    path, out = os.path.join(root, "ckpt"), {}
    layout = RESHARD_LS[reshard](world)
    if reshard == "world":  # the same stage on the new number of ranks
        layout = dict(stage=stage)
    model, engine, tp_rank, step = _ls_build(kw, rank, world, device, **layout)
    _, out["reshard_s"], out["reshard_mb"] = _timed(lambda: load_engines(path, model, [engine], tp_rank=tp_rank))
    out["reshard_dloss"] = max(abs(a - b) for a, b in zip(expected, [step(*b) for b in batches[1:1 + AFTER]]))
    return out


# ------------------------------------------------------------------------------------------------ driver
def worker(rank: int, world: int, system: str, kw: dict, batch: int, root: str, device: str = "cpu",
           reshard: str = "tp", phase: str = "save", expected=None) -> dict:
    """phase "save": train a step, save, load on the same layout (and, unless reshard == "world", the resharded
    load in the same processes); phase "reshard": a second launch on another number of ranks that loads the
    checkpoint the save phase left in root and checks its 2 steps against the save phase's ``expected`` losses."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    if system == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.startswith("cuda") else "cpu")
        os.environ.update(LOCAL_RANK=str(rank))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(1 + AFTER):
        ids = torch.randint(0, kw["vocab"], (batch, kw["seq"] + 1), generator=g)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    if phase == "reshard":
        if system.startswith("ls_universal"):
            out = _ls_reshard(kw, batches, rank, world, root, device, reshard, expected,
                              3 if system == "ls_universal_z3" else 2)
        elif system == "dcp_fsdp2":
            out = _dcp_reshard(kw, batches, root, device, reshard, expected)
        elif system == "deepspeed":
            out = _ds_reshard(kw, batches, rank, world, root, batch, expected, device)
        else:
            raise ValueError(f"{system!r} has no resharded load")
    elif system.startswith("ls_"):
        out = _ls_run(system, kw, batches, rank, world, root, device, reshard)
    elif system == "dcp_fsdp2":
        out = _dcp_run(kw, batches, root, device, reshard)
    elif system == "deepspeed":
        out = _ds_run(kw, batches, rank, world, root, batch, device)
    elif system == "lightning_fsdp2":
        out = _lightning_run(kw, batches, rank, world, root)
    else:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    out.setdefault("peak_rss_mb", process_peak_mb())  # ls_universal: before its async save (_ls_async)
    return out


def _merge(outs):
    """Slower rank's time, larger rank's memory, rank 0's folder size and expected losses."""
    res = {k: outs[0][k] for k in ("bytes", "expected") if k in outs[0]}
    for k in outs[0]:
        if k.endswith("_s") or k.endswith("_mb") or k.endswith("dloss"):
            res[k] = max(o[k] for o in outs)
    return res


def _med(rounds, name, key):
    vals = [r[name][key] for r in rounds if name in r and key in r[name]]
    return statistics.median(vals) if vals else None


def _table(rounds, systems, failed) -> str:
    cols = [("save_s", "save s", "{:.2f}"), ("load_s", "load s", "{:.2f}"), ("reshard_s", "reshard load s", "{:.2f}"),
            ("bytes", "MiB on disk", None), ("save_mb", "save peak +MiB", "{:.0f}"),
            ("load_mb", "load peak +MiB", "{:.0f}"), ("reshard_mb", "reshard peak +MiB", "{:.0f}"),
            ("dloss", "resume dloss", "{:.1e}"), ("reshard_dloss", "reshard dloss", "{:.1e}"),
            ("async_block_s", "async save blocks s", "{:.3f}"), ("async_total_s", "async save total s", "{:.2f}"),
            ("async_buffers_mb", "async host buffers MiB", "{:.0f}"),
            ("overlap_block_s", "overlapped async blocks s", "{:.3f}"), ("step_alone_s", "step s", "{:.2f}"),
            ("step_overlap_s", "step s, overlapped save in flight", "{:.2f}"),
            ("peak_rss_mb", "peak RSS MB", "{:.0f}"), ("reshard_peak_rss_mb", "reshard run peak RSS MB", "{:.0f}"),
            ("convert_child_rss_mb", "converter workers peak RSS MB", "{:.0f}")]
    lines = ["| system | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in systems:
        if name in failed:
            lines.append(f"| {name} | failed: {failed[name][:100]} |")
            continue
        cells = []
        for key, _, fmt in cols:
            v = _med(rounds, name, key)
            cells.append("n/a" if v is None else (f"{v / 2**20:,.1f}" if fmt is None else fmt.format(v)))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratios(rounds, failed) -> str:
    lines = ["| system | peer | save time ratio | load time ratio | reshard load time ratio | bytes ratio | "
             "peak RSS ratio | reshard run peak RSS ratio |", "|---" * 8 + "|"]
    for name, peers in PEERS.items():
        for peer in peers:
            both = [r for r in rounds if name in r and peer in r]
            if not both:
                lines.append(f"| {name} | {peer} | n/a ({'failed' if peer in failed else 'not run'}) | | | | | |")
                continue
            cells = []
            for key in ("save_s", "load_s", "reshard_s", "bytes", "peak_rss_mb", "reshard_peak_rss_mb"):
                rs = [r[name][key] / r[peer][key] for r in both if key in r[name] and key in r[peer]]
                cells.append(f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})" if rs else "n/a")
            lines.append(f"| {name} | {peer} | " + " | ".join(cells) + " |")
    blocks = [r["ls_universal"]["async_block_s"] / r["ls_universal"]["save_s"] for r in rounds
              if "async_block_s" in r.get("ls_universal", {})]
    tail = (f"\n\nasync save: blocks {statistics.median(blocks):.1%} of the synchronous save's time (median; "
            "target <= 10%)") if blocks else ""
    over = [r["ls_universal"] for r in rounds if "overlap_block_s" in r.get("ls_universal", {})]
    if over:
        tail += (f"\nasync save, overlapped snapshot (checkpoint_async='overlap'): blocks "
                 f"{statistics.median(o['overlap_block_s'] / o['save_s'] for o in over):.1%} of the synchronous save's "
                 f"time (the call + the next optimizer step's wait); the next step took "
                 f"{statistics.median(o['step_overlap_s'] / o['step_alone_s'] for o in over):.2f}x a step without a "
                 "save in flight (median)")
    return "\n".join(lines) + "\n\n(ratio = lightning_scale / peer in the same round: < 1 is faster / smaller)" + tail


def run_row(launch, name, root, world, reshard_world, args_tail):
    """One (round, system): launch(world, worker_args) -> per-rank results; the save phase on ``world`` ranks, then
    (reshard_world > 0, a row with a resharded load) the reshard phase on ``reshard_world`` ranks. ``args_tail``:
    (kw, batch, device). Removes ``root`` (where the checkpoint lives between the two) at the end."""
    kw, batch, device = args_tail
    reshard = "world" if reshard_world else ("tp" if world >= 2 else "stage3")
    os.makedirs(root)
    try:
        res = _merge(launch(world, (name, kw, batch, root, device, reshard)))
        if reshard_world and name in RESHARDS:
            more = _merge(launch(reshard_world, (name, kw, batch, root, device, reshard, "reshard", res["expected"])))
            more["reshard_peak_rss_mb"] = more.pop("peak_rss_mb")
            res.update(more)
        res.pop("expected", None)
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def reshard_label(world, reshard_world) -> str:
    return f"dp={reshard_world}" if reshard_world else ("tp=%d" % world if world >= 2 else "ZeRO-3 / unsharded")


def prebuild_deepspeed_ops(timeout: float) -> str:
    """Build DeepSpeed's CPU shared-memory comm op once, outside the timed ranks; '' when it loads. On first use
    ``deepspeed.initialize`` JIT-compiles it (4 min on this 2-core box under load) inside every rank: that ran past
    the ranks' timeout, and the killed build left torch_extensions' ``lock`` file behind, so every later run waited
    on it forever (both ranks in ``file_baton.wait``). Returns why it could not be built."""
    import subprocess

    code = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"
    print("deepspeed: building / loading its shm_comm op once (minutes on first use) ...", flush=True)
    try:
        done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, DS_ACCELERATOR="cpu"),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return (f"not run: building DeepSpeed's shm_comm op took over {timeout:.0f}s (a stale "
                "~/.cache/torch_extensions/*/deepspeed_shm_comm/lock left by a killed build blocks it forever)")
    if done.returncode:
        return "not run: DeepSpeed's shm_comm op does not build: " + " | ".join(done.stderr.strip().splitlines()[-2:])
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--world", type=int, default=2, help="ranks of the saving layout (dp)")
    ap.add_argument("--reshard-world", type=int, default=None,
                    help="ranks of the resharded load (dp; default 4 if --world is 2, else 2); 0: dp -> tp in the "
                         "same processes (no DeepSpeed reshard)")
    ap.add_argument("--batch", type=int, default=4, help="global sequences per step (divisible by both worlds)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    if args.reshard_world is None:
        args.reshard_world = 4 if args.world == 2 else 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; known: {', '.join(SYSTEMS)}")
    for flag, w in (("--world", args.world), ("--reshard-world", args.reshard_world)):
        if w and args.batch % w:
            raise SystemExit(f"--batch {args.batch} must be divisible by {flag} {w}")
    kw = dict(vocab=args.vocab, hidden=args.hidden, mlp=-(-(args.hidden * 11 // 4) // 64) * 64, layers=args.layers,
              heads=8, kv_heads=4, seq=args.seq)
    from lightning_scale.testing import run_distributed

    failed = {}
    if "deepspeed" in systems:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            failed["deepspeed"] = "not run: deepspeed is not installed (pip install deepspeed torch==<this torch>)"
        else:
            why = prebuild_deepspeed_ops(args.timeout)
            if why:
                failed["deepspeed"] = why
    base = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    launch = lambda world, a: run_distributed(worker, world, a, timeout=args.timeout)  # noqa: E731
    rounds = []
    try:
        for r in range(args.rounds):
            results = {}
            for name in systems[r % len(systems):] + systems[:r % len(systems)]:
                if name in failed:
                    continue
                try:
                    results[name] = run_row(launch, name, os.path.join(base, f"{r}_{name}"), args.world,
                                            args.reshard_world, (kw, args.batch, "cpu"))
                except Exception as err:  # noqa: BLE001 - report why, keep going with the other rows
                    failed[name] = " | ".join([t.strip() for t in str(err).splitlines() if t.strip()][-3:])
                    print(f"round {r} {name:16s} FAILED: {failed[name]}", flush=True)
                    continue
                print(f"round {r} {name:16s} " + "  ".join(
                    f"{k} {v:.3g}" for k, v in results[name].items()), flush=True)
            rounds.append(results)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    from models import _params_m

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    target = reshard_label(args.world, args.reshard_world)
    print(f"\n## checkpoint save / load, HF Llama {_params_m(kw):.1f}M + AdamW state ({datetime.date.today()}, "
          f"{args.world} CPU ranks, dp={args.world} -> dp={args.world} / {target}, {args.rounds} rounds, medians; "
          f"load average at the end {load})\n")
    print(_table(rounds, systems, failed))
    print("\n### lightning_scale universal vs peers (same rounds)\n")
    print(_ratios(rounds, failed))


if __name__ == "__main__":
    main()
