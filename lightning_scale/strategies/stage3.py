"""Zero3DStrategy glue for ZeRO stage 3 and offload: deferred init, sharding, engines, checkpoints.

Order on every rank (``Zero3DStrategy.setup`` at ``zero.stage=3``)::

    configure_model (under model_sharded_context: the meta device, rank 0's RNG state on every rank)
    -> configure_optimizers (the optimizer sees the parameters; nothing is allocated yet)
    (tp > 1: configure_model builds real weights instead; rank 0's are broadcast and the tp plan keeps each
    rank's slices, which ZeRO-3 then shards over dp)
    -> ShardedParameters over all optimizers' param groups: units chosen, each unit materialized,
       initialized and cut to its shard one at a time
    -> one Stage3Optimizer per optimizer (fp32 masters and state on the host under optimizer offload)

Checkpoints are sharded: each rank's file holds its parameter shards (+ fp32 masters) next to its
optimizer shards; :func:`lightning_scale.zero.state_dict.consolidate_checkpoint` turns a checkpoint
folder into one plain ``state_dict``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Generator, List

import torch
import torch.distributed as dist

from lightning_scale.config import ConfigError
from lightning_scale.zero.param_shard import ShardedParameters
from lightning_scale.zero.stage3_optimizer import Stage3Optimizer

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
    sync_rng_from_rank0(device)
    with torch.device("meta"):
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


def setup_stage3(strategy: Any, trainer: Any, fitting: bool) -> None:
    """Shard the (meta or real) model and wrap the optimizers. Idempotent across fit -> validate."""
    cfg = strategy.config
    module = strategy.model
    plugin = strategy.precision_plugin
    policy = plugin.policy
    already = getattr(strategy, "sharded", None)
    if already is not None and already.root is module:
        if fitting:
            raise ConfigError("zero.stage=3: fit() twice with the same strategy object is not supported; "
                              "create a new Trainer/strategy")
        return
    if fitting:
        strategy.setup_optimizers(trainer)
        groups: List[List[torch.nn.Parameter]] = [list(g["params"]) for opt in strategy.optimizers
                                                  for g in opt.param_groups]
        owned = {id(p) for g in groups for p in g}
        missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise ConfigError(
                f"trainable parameter(s) {missing[:5]} are in no optimizer param group returned by "
                "configure_optimizers; add them or set requires_grad=False"
            )
        for opt in strategy.optimizers:
            if getattr(opt, "handles_gradient_reduction", False) and hasattr(opt, "check_zero_stage"):
                opt.check_zero_stage(3)
    else:
        groups = [[p for p in module.parameters() if p.requires_grad]]
    sharded = ShardedParameters(
        module, groups, group=strategy.topology.dp_group, device=strategy.root_device,
        param_dtype=policy.param_dtype, unit_modules=cfg.zero.unit_modules, prefetch_depth=cfg.zero.prefetch_depth,
        persistent_threshold=cfg.zero.persistent_threshold,
        param_device=torch.device("cpu") if cfg.offload.params != "none" else None,
        pin_memory=cfg.offload.pin_memory)
    sharded.shard_model()
    if policy.param_dtype is not None:  # what the engine does not own: frozen params and floating buffers
        for t in list(sharded.frozen) + list(module.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(policy.param_dtype)
    strategy.sharded = sharded
    strategy.engines = []
    if not fitting:
        return
    offset = 0
    mp = getattr(strategy, "_model_parallel", None)
    engine_cls, mp_kwargs = mp.stage3_engine_factory() if mp is not None else (Stage3Optimizer, {})
    for opt in strategy.optimizers:
        if mp is not None:
            mp.check_optimizer(opt)
        engine = engine_cls(
            opt, sharded, group_offset=offset, precision=policy,
            loss_scaler=getattr(plugin, "loss_scaler", None), offload_optimizer=cfg.offload.optimizer != "none",
            pin_memory=cfg.offload.pin_memory, **mp_kwargs)
        offset += len(opt.param_groups)
        strategy.engines.append(engine)
        plugin.register_engine(opt, engine)


def shard_checkpoint(strategy: Any) -> Dict[str, Any]:
    """What each rank's file holds at stage 3: its parameter shards, their layout, and under tp the rank's tp
    coordinate and each split parameter's ShardSpec, so a checkpoint folder consolidates offline too."""
    out = strategy.sharded.shard_state_dict()
    out["pp"] = {"size": strategy.topology.pp, "rank": strategy.topology.pp_rank}
    mp = getattr(strategy, "_model_parallel", None)
    if mp is not None and mp.tp_model is not None:
        from lightning_scale.tensor_parallel.sharding import tp_spec

        names = strategy.sharded.names
        out["tp"] = {"size": strategy.topology.tp, "rank": strategy.topology.tp_rank,
                     "specs": {names[id(p)]: tp_spec(p) for p in strategy.lightning_module.parameters()
                               if tp_spec(p) is not None and id(p) in names}}
    return out


def _pipeline_freed(strategy: Any) -> bool:
    mp = getattr(strategy, "_model_parallel", None)
    return mp is not None and mp.pipeline is not None


def small_state_dict(strategy: Any) -> Dict[str, Any]:
    """What the rank-0 checkpoint file holds at stage 3: buffers and frozen parameters (shards go per rank)."""
    sharded: ShardedParameters = strategy.sharded
    out: Dict[str, Any] = {}
    for p in sharded.frozen:
        if p.numel() > 0 or not _pipeline_freed(strategy):  # another pipeline stage's parameter: its own file
            out[sharded.names[id(p)]] = p.detach().cpu()
    for name, buf in strategy.lightning_module.named_buffers():
        out[name] = buf.detach().cpu()
    return out


def load_stage3(strategy: Any, checkpoint: Dict[str, Any], strict: bool = True) -> None:
    sharded: ShardedParameters = strategy.sharded
    if SHARD_KEY not in checkpoint:
        raise ValueError("zero.stage=3: this checkpoint holds no parameter shards (it was not written by a "
                         "zero.stage=3 run); consolidate it and load the weights in configure_model instead")
    sharded.load_shard_state_dict(checkpoint[SHARD_KEY])
    small = checkpoint.get("state_dict", {})
    with torch.no_grad():
        for p in sharded.frozen:
            name = sharded.names[id(p)]
            if p.numel() == 0 and _pipeline_freed(strategy):
                continue  # another pipeline stage's parameter (freed here)
            if name in small:
                p.copy_(small[name])
            elif strict:
                raise KeyError(f"frozen parameter {name!r} missing from the checkpoint")
        for name, buf in strategy.lightning_module.named_buffers():
            if name in small:
                buf.copy_(small[name])
