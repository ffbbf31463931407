"""Zero3DStrategy glue for ZeRO stage 3 and offload: the meta-device init context and the sharded checkpoints.

``configure_model`` runs under :func:`meta_init_context` (the meta device, rank 0's RNG state on every rank);
the sharding itself is a step of :func:`lightning_scale.parallelize.parallelize` (``apply_zero3``) and the
engines come from :func:`lightning_scale.zero.engine.make_engine`.

Checkpoints are sharded: each rank's file holds its parameter shards (+ fp32 masters) next to its
optimizer shards; :func:`lightning_scale.zero.state_dict.consolidate_checkpoint` turns a checkpoint
folder into one plain ``state_dict``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Generator

import torch
import torch.distributed as dist

from lightning_scale.config import ConfigError
from lightning_scale.zero.param_shard import ShardedParameters

from lightning_scale.zero.state_dict import SHARD_KEY  # noqa: E402


@torch.no_grad()
def sync_rng_from_rank0(device: torch.device) -> None:
    """Every rank continues from rank 0's CPU (and current accelerator) random state."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    state = torch.get_rng_state().to(comm_device)
    dist.broadcast(state, src=0)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(comm_device)
        dist.broadcast(cuda_state, src=0)
        torch.cuda.set_rng_state(cuda_state.cpu(), device)


@contextlib.contextmanager
def meta_init_context(device: torch.device) -> Generator[None, None, None]:
    from lightning_scale.pretrained import meta_from_pretrained

    from lightning_scale.materialize import parameters_on_meta

    sync_rng_from_rank0(device)
    # parameters on meta, buffers computed (materialize.parameters_on_meta); from_pretrained(dir) records the weights
    with parameters_on_meta(), meta_from_pretrained():
        yield


def check_offload(strategy: Any) -> None:
    cfg = strategy.config
    if cfg.offload.params != "none" and strategy.root_device.type == "cpu":
        # Valid (the accounting treats the shards as host memory) but a no-op in placement: say so once.
        pass
    if cfg.offload.optimizer != "none" or cfg.offload.params != "none":
        for dev in (cfg.offload.optimizer, cfg.offload.params):
            if dev not in ("none", "cpu"):
                raise ConfigError(f"offload device {dev!r}: this machine offloads to 'cpu' only")


def shard_checkpoint(pm: Any) -> Dict[str, Any]:
    """What each rank's file holds at stage 3 (``pm``: the ParallelModel): its parameter shards, their layout, and
    under tp the rank's tp coordinate and each split parameter's ShardSpec, so a folder consolidates offline too."""
    out = pm.sharded.shard_state_dict()
    out["pp"] = {"size": pm.topology.pp, "rank": pm.topology.pp_rank}
    if pm.tp_model is not None:
        from lightning_scale.tensor_parallel.sharding import tp_spec

        names = pm.sharded.names
        out["tp"] = {"size": pm.topology.tp, "rank": pm.topology.tp_rank,
                     "specs": {names[id(p)]: tp_spec(p) for p in pm.module.parameters()
                               if tp_spec(p) is not None and id(p) in names}}
    return out


def small_state_dict(pm: Any) -> Dict[str, Any]:
    """What the rank-0 checkpoint file holds at stage 3: buffers and frozen parameters (shards go per rank)."""
    sharded: ShardedParameters = pm.sharded
    out: Dict[str, Any] = {}
    for p in sharded.frozen:
        if p.numel() > 0 or pm.pipeline is None:  # another pipeline stage's parameter: its own file
            out[sharded.names[id(p)]] = p.detach().cpu()
    persistent = set(pm.module.state_dict(keep_vars=True))  # non-persistent buffers (rotary inv_freq) stay out
    for name, buf in pm.module.named_buffers():
        if name in persistent:
            out[name] = buf.detach().cpu()
    return out


def load_stage3(pm: Any, checkpoint: Dict[str, Any], strict: bool = True) -> None:
    sharded: ShardedParameters = pm.sharded
    if SHARD_KEY not in checkpoint:
        raise ValueError("zero.stage=3: this checkpoint holds no parameter shards (it was not written by a "
                         "zero.stage=3 run); consolidate it and load the weights in configure_model instead")
    sharded.load_shard_state_dict(checkpoint[SHARD_KEY])
    small = checkpoint.get("state_dict", {})
    with torch.no_grad():
        for p in sharded.frozen:
            name = sharded.names[id(p)]
            if p.numel() == 0 and pm.pipeline is not None:
                continue  # another pipeline stage's parameter (freed here)
            if name in small:
                p.copy_(small[name])
            elif strict:
                raise KeyError(f"frozen parameter {name!r} missing from the checkpoint")
        for name, buf in pm.module.named_buffers():
            if name in small:
                buf.copy_(small[name])
