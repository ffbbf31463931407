"""The peer rows of bench/checkpoint.py: torch DCP with FSDP2, DeepSpeed ZeRO-2 (and its offline ds_to_universal
conversion), Lightning's ModelParallelStrategy; and the measurement helpers every row shares (``_timed``,
``_folder_bytes``). bench/checkpoint.py (the driver and the lightning_scale rows) documents the rows and columns;
each function here runs inside one rank of a ``run_distributed`` launch. Not a test.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import _dtensor_plan, _fsdp2, _loss, build_llama  # noqa: E402

AFTER = 2  # steps taken after a save / each load
RESHARD_DCP = {"tp": "tp", "stage3": "plain", "world": "fsdp2"}  # bench/checkpoint.py's reshard kinds, for DCP


# ------------------------------------------------------------------------------------------------ measurement
def _live_rss() -> int:
    from lightning_scale.testing import live_rss_bytes

    return live_rss_bytes()


_PEAK = [0]  # the process's high-water mark before the last reset (each _timed call resets the kernel's)


def _vmhwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def process_peak_mb() -> float:
    """The process's peak RSS so far, across the resets of ``_timed`` (getrusage's maxrss is reset with them)."""
    return max(_PEAK[0], _vmhwm()) / 2**20


def _timed(fn):
    """(result, seconds, peak RSS growth in MiB over the live RSS just before): the kernel's high-water mark is
    reset right before the call (the peak before it is kept for ``process_peak_mb``)."""
    import gc

    import torch.distributed as dist

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    gc.collect()
    sync()
    dist.barrier()
    base = _live_rss()
    _PEAK[0] = max(_PEAK[0], _vmhwm())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    out = fn()
    sync()
    dist.barrier()
    dt = time.perf_counter() - t0
    hwm = _vmhwm()
    return out, dt, (hwm - base) / 2**20


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# ------------------------------------------------------------------------------------------------ torch DCP
def _dcp_build(kw, mode: str, device="cpu"):
    """mode: "fsdp2" (the saving layout), "tp" (DTensor tp over every rank) or "plain" (an unsharded module)."""
    import torch
    import torch.distributed as dist

    device = torch.device(device)
    model = build_llama(kw).to(device)
    tp = mode == "tp"
    if tp:
        from torch.distributed.device_mesh import init_device_mesh

        _dtensor_plan(model, init_device_mesh(device.type, (dist.get_world_size(),)))
    elif mode == "fsdp2":
        _fsdp2(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(x, y):
        x, y = x.to(device), y.to(device)
        if tp:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss = _loss(model(input_ids=x).logits, y)
                loss.backward()
            loss = loss.full_tensor().detach()
        else:
            loss = _loss(model(input_ids=x.chunk(world)[rank]).logits, y.chunk(world)[rank])
            loss.backward()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        opt.step()
        opt.zero_grad()
        return float(loss)

    return model, opt, step


def _dcp_run(kw, batches, root, device="cpu", reshard="tp"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, step = _dcp_build(kw, "fsdp2", device)
    step(*batches[0])
    path = os.path.join(root, "ckpt")
    out = {}

    def save():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    _, out["save_s"], out["save_mb"] = _timed(save)
    out["bytes"] = _folder_bytes(path)
    out["expected"] = expected = [step(*b) for b in batches[1:1 + AFTER]]
    del model, opt, step
    model, opt, step = _dcp_build(kw, "fsdp2", device)
    _, out["load_s"], out["load_mb"] = _timed(_dcp_load_into(model, opt, path))
    out["dloss"] = max(abs(a - b) for a, b in zip(expected, [step(*b) for b in batches[1:1 + AFTER]]))
    if reshard != "world":
        del model, opt, step
        out.update(_dcp_reshard(kw, batches, root, device, reshard, expected))
    return out


def _dcp_load_into(m, o, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def load():
        msd, osd = get_state_dict(m, o)  # allocates the optimizer state (a zero-lr step), DTensor-shaped
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return load


def _dcp_reshard(kw, batches, root, device, reshard, expected):
    out = {}
    model, opt, step = _dcp_build(kw, RESHARD_DCP[reshard], device)
    _, out["reshard_s"], out["reshard_mb"] = _timed(_dcp_load_into(model, opt, os.path.join(root, "ckpt")))
    out["reshard_dloss"] = max(abs(a - b) for a, b in zip(expected, [step(*b) for b in batches[1:1 + AFTER]]))
    return out


# ------------------------------------------------------------------------------------------------ DeepSpeed
def _ds_build(kw, world, batch, universal=False, device="cpu"):
    """The same Llama under DeepSpeed ZeRO-2 (fp32, torch AdamW as the client optimizer, no clipping), CPU + gloo."""
    import deepspeed
    import torch
    import torch.distributed as dist

    model = build_llama(kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": batch // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": universal},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    rank = dist.get_rank()

    def step(x, y):
        x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
        loss = _loss(engine(input_ids=x).logits, y)
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return float(loss / world)

    return engine, step


def _ds_convert(path: str, tag: str, out_tag: str, workers: int) -> None:
    """deepspeed.checkpoint.ds_to_universal on path/tag -> path/out_tag (what its CLI does, in this process)."""
    import argparse as _argparse
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = _argparse.Namespace(input_folder=os.path.join(path, tag), output_folder=os.path.join(path, out_tag),
                               num_extract_workers=workers, num_merge_workers=workers, keep_temp_folder=False,
                               strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its tqdm bars
        ds_to_universal(args)


def _ds_run(kw, batches, rank, world, root, batch, device="cpu"):
    import torch.distributed as dist

    engine, step = _ds_build(kw, world, batch, device=device)
    step(*batches[0])
    path = os.path.join(root, "ckpt")
    out = {}
    _, out["save_s"], out["save_mb"] = _timed(lambda: engine.save_checkpoint(path, tag="t"))
    out["bytes"] = _folder_bytes(path)
    out["expected"] = [step(*b) for b in batches[1:1 + AFTER]]
    del engine, step
    engine, step = _ds_build(kw, world, batch, device=device)
    _, out["load_s"], out["load_mb"] = _timed(lambda: engine.load_checkpoint(path, tag="t"))
    out["dloss"] = max(abs(a - b) for a, b in zip(out["expected"], [step(*b) for b in batches[1:1 + AFTER]]))
    dist.barrier()
    return out


def _ds_reshard(kw, batches, rank, world, root, batch, expected, device="cpu"):
    """On the new world size: ds_to_universal (rank 0, 2 worker processes) then load_universal, timed as one."""
    import resource

    import torch.distributed as dist

    path = os.path.join(root, "ckpt")
    engine, step = _ds_build(kw, world, batch, universal=True, device=device)
    out = {}

    def convert_and_load():
        if rank == 0:
            _ds_convert(path, "t", "t_universal", workers=2)
        dist.barrier()
        engine.load_checkpoint(path, tag="t_universal")

    _, out["reshard_s"], out["reshard_mb"] = _timed(convert_and_load)
    # the conversion's worker processes: their largest peak RSS (not in this process's high-water mark)
    out["convert_child_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if rank == 0 else 0.0
    out["reshard_dloss"] = max(abs(a - b) for a, b in zip(expected, [step(*b) for b in batches[1:1 + AFTER]]))
    return out


# ------------------------------------------------------------------------------------------------ Lightning
def _lightning_run(kw, batches, rank, world, root):
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))

    class Module(pl.LightningModule):
        def configure_model(self):
            self.model = build_llama(kw)
            _fsdp2(self.model, self.device_mesh["data_parallel"])

        def training_step(self, batch, _):
            x, y = batch
            return _loss(self.model(input_ids=x.chunk(world)[rank]).logits, y.chunk(world)[rank])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(data_parallel_size=world,
                         tensor_parallel_size=1),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    module = Module()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches[:1], batch_size=None))
    path = os.path.join(root, "ckpt")
    out = {}
    _, out["save_s"], out["save_mb"] = _timed(lambda: trainer.save_checkpoint(path))
    out["bytes"] = _folder_bytes(path)

    def local_sum():
        vals = [p.to_local().double().sum() for p in module.model.parameters()]
        vals += [v.to_local().double().sum() for s in trainer.optimizers[0].state.values() for v in s.values()
                 if hasattr(v, "to_local")]
        return float(sum(vals))

    before = local_sum()
    with torch.no_grad():  # the load must bring the values back
        for p in module.model.parameters():
            p.to_local().zero_()
        for s in trainer.optimizers[0].state.values():
            for v in s.values():
                if hasattr(v, "to_local"):
                    v.to_local().zero_()
    _, out["load_s"], out["load_mb"] = _timed(lambda: trainer.strategy.load_checkpoint(path))
    out["dloss"] = abs(local_sum() - before)  # a checksum difference for this row (see the docstring)
    return out
