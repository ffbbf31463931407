"""The autotuner's probes (issue 17 item 4; docs/tune.md "Measuring"): one candidate layout measured in a fresh
process group (:func:`measure`, through ``lightning_scale.testing.run_distributed``), each rank running
:func:`probe_worker` (the package GPT on random tokens) or :func:`module_worker` (a ``--module`` LightningModule built
in the rank, its own ``training_step``). :mod:`lightning_scale.tune` keeps the candidates, the memory plan, the
search and the CLI, and re-exports these names.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Dict

from lightning_scale.config import ConfigError


def _probe_config(c, compile_setting):
    from lightning_scale.config import from_flat_kwargs

    kw = c.strategy_kwargs()
    if c.compile and compile_setting not in (None, True):
        kw["compile"] = compile_setting  # e.g. {"backend": "aot_eager"}: the capture path without inductor's C++ build
    return from_flat_kwargs(**kw)


def _rank_device(rank: int, device: str):
    """This probe rank's device: ``cpu``, or its own GPU (``cuda:rank`` on one machine, set as the current one)."""
    import torch

    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _space(dev) -> "str | None":
    """The device type whose bytes a probe measures: an accelerator's own (host tensors are not its memory), or
    every tensor on a CPU (host and device are one memory there)."""
    return None if dev.type == "cpu" else dev.type


def probe_worker(rank: int, world_size: int, gpt_fields: Dict, cand: Dict, steps: int, warmup: int,
                 precision: str, compile_setting=True, device: str = "cpu") -> Dict:
    """One rank of a probe: the layout through parallelize() + the engines, ``warmup + steps`` optimizer steps on
    random tokens; then one more step under LiveTensorBytes for the measured peak (on a GPU its bytes only)."""
    import contextlib

    import torch

    from lightning_scale.memory import LiveTensorBytes
    from lightning_scale.models.gpt import GPT, GPTConfig, lm_loss, make_batch
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.sequence_parallel import shard_sequence
    from lightning_scale.tune import Candidate
    from lightning_scale.zero.precision import make_loss_scaler, policy_for

    c = Candidate(**cand)
    gpt = GPTConfig(**gpt_fields)
    # the Trainer's precision: params cast, autocast, the fp16 loss scale (32-true: the engines' defaults)
    policy = policy_for(precision) if precision != "32-true" else None
    scaler = make_loss_scaler(policy) if policy is not None else None
    config = _probe_config(c, compile_setting)
    topo = local_topology(config, world_size, rank)
    torch.manual_seed(0)
    dev = _rank_device(rank, device)
    on_meta = c.stage == 3 or c.tp > 1 or c.pp > 1
    from lightning_scale.materialize import parameters_on_meta

    with parameters_on_meta() if on_meta else torch.device(dev):  # as the strategy's configure_model context
        model = GPT(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pm = parallelize(model, config, topo, dev, optimizers=[opt], loss_fn=lm_loss,
                     param_dtype=policy.param_dtype if policy is not None and c.stage == 3 else None)
    (engine,) = pm.make_engines(precision=policy, loss_scaler=scaler)
    if policy is not None and c.stage != 3:
        model.to(policy.param_dtype)  # what the engines did not own (the precision plugin's convert_module)
    autocast = (lambda: torch.autocast(dev.type, dtype=policy.autocast_dtype)) if policy and policy.autocast_dtype \
        else contextlib.nullcontext
    local = c.micro_batch * c.accum

    def step(i: int) -> None:
        x, y = make_batch(gpt, local * topo.data_size, seed=i)  # data_size: dp (x ep, whose ranks read their own rows)
        x, y = x.chunk(topo.data_size)[topo.data_rank].to(dev), y.chunk(topo.data_size)[topo.data_rank].to(dev)
        if topo.sp > 1:  # this rank's L / sp positions of every sequence (the Trainer's batch_to_device)
            x, y = shard_sequence((x, y), topo.sp_rank, topo.sp)
        scale = float(scaler.scale) if policy is not None and policy.loss_scaling else 1.0
        if c.pp > 1:
            with engine.no_sync(), autocast():
                pm.pipeline.runtime.train_step(x, y, grad_scale=scale)
        else:
            for j, (xm, ym) in enumerate(zip(x.chunk(c.accum), y.chunk(c.accum))):
                with engine.no_sync() if j < c.accum - 1 else contextlib.nullcontext():
                    with autocast():
                        loss = model.loss(xm, ym)
                    (loss.float() * (scale / c.accum)).backward()
        engine.reduce_gradients()
        engine.step()
        engine.zero_grad()

    times = []
    for i in range(warmup + steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    baseline = _live_bytes(_space(dev))
    # ZeRO-3's units grow by storage resize, which no aten op shows: sampled at every op
    with LiveTensorBytes(device=_space(dev), extra=getattr(pm.sharded, "unit_buffer_bytes", None)) as mem:
        step(warmup + steps)
    median = statistics.median(times[warmup:])
    from lightning_scale.compile import compile_stats, compiled_units

    return {"step_s": median, "measured_bytes": baseline + mem.peak, "baseline_bytes": baseline,
            "space": "device" if _space(dev) else "one memory",
            "compile_s": max(0.0, sum(times[:warmup]) - warmup * median), "compiled_units": len(compiled_units(model)),
            "graphs": compile_stats()["graphs"]}


def build_module(path: str, meta: bool = False, setting: str = "--module"):
    """``pkg.mod:Class`` -> the LightningModule built with no arguments, ``configure_model()`` run (on ``meta``)."""
    import contextlib
    import importlib

    mod, _, cls = path.partition(":")
    try:
        lm = getattr(importlib.import_module(mod), cls)()
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{setting}={path!r}: {type(err).__name__}: {err} (use pkg.module:LightningModuleClass)") \
            from None
    from lightning_scale.materialize import parameters_on_meta

    with parameters_on_meta() if meta else contextlib.nullcontext():  # as the strategy's configure_model context
        if callable(getattr(lm, "configure_model", None)):
            lm.configure_model()
    return lm


def module_worker(rank: int, world_size: int, shape: Dict, cand: Dict, steps: int, warmup: int,
                  precision: str, compile_setting=True, device: str = "cpu") -> Dict:
    """One rank of a ``--module`` probe: the LightningModule built here (``configure_model`` on meta where the strategy
    would: ZeRO-3, tp, pp), its ``configure_optimizers``, ``training_step((tokens, targets), 0)`` on random tokens
    (:func:`lightning_scale.strategies.autotune.measure_module`, the in-process probe's body)."""
    for entry in shape.get("sys_path") or ():
        if entry not in sys.path:
            sys.path.append(entry)
    import torch

    from lightning_scale.parallelize import local_topology
    from lightning_scale.strategies.autotune import measure_module
    from lightning_scale.tune import Candidate

    c = Candidate(**cand)
    config = _probe_config(c, compile_setting)
    topo = local_topology(config, world_size, rank)
    torch.manual_seed(0)
    dev = _rank_device(rank, device)
    base = _live_bytes(_space(dev))
    lm = build_module(shape["module"], meta=config.meta_init and (c.stage == 3 or c.tp > 1 or c.pp > 1 or c.ep > 1))
    from lightning_scale.materialize import has_meta

    if dev.type != "cpu" and not has_meta(lm, recurse=True) and not (c.stage == 3 and c.tp == 1 and c.pp == 1):
        lm.to(dev)  # as the strategy places it (ZeRO-3 alone places its shards itself)
    g = torch.Generator().manual_seed(1)
    local = c.micro_batch * c.accum
    ids = torch.randint(0, shape["vocab_size"], (local * topo.data_size, shape["seq_len"] + 1), generator=g)
    ids = ids.chunk(topo.data_size)[topo.data_rank]  # this data-parallel rank's rows (dp, x ep)
    batch = (ids[:, :-1].contiguous().to(dev), ids[:, 1:].contiguous().to(dev))
    if topo.sp > 1:  # this rank's L / sp positions of every sequence (the Trainer's batch_to_device)
        from lightning_scale.sequence_parallel import shard_sequence

        batch = shard_sequence(batch, topo.sp_rank, topo.sp)
    torch.distributed.barrier()
    res = measure_module(lm, config, topo, dev, batch, steps, warmup, precision, accum=c.accum if c.pp == 1 else 1,
                         base_bytes=base)
    return dict(res, baseline_bytes=res["states_bytes"])


def _live_bytes(device: "str | None" = None) -> int:
    """Bytes of distinct non-meta storages reachable from Python (model states between steps); ``device``: only
    storages on that device type."""
    import gc

    import torch

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): isinstance reads obj.__class__, and torch.distributed's deprecated
            # reduce_op warns on every attribute read (a FutureWarning per probe rank)
            ts = [obj] + ([obj.grad] if obj.grad is not None else []) if issubclass(type(obj), torch.Tensor) else []
        except Exception:  # noqa: BLE001
            continue
        for t in ts:
            try:
                s = t.untyped_storage()
                key = (s.data_ptr(), s.nbytes())
            except Exception:  # noqa: BLE001 - meta / wrapper tensors
                continue
            if key in seen or s.device.type == "meta" or (device is not None and s.device.type != device):
                continue
            seen.add(key)
            total += s.nbytes()
    return total


def measure(gpt, c: "Candidate", *, steps: int = 4, warmup: int = 2, precision: str = "32-true",
            timeout: float = 300.0, compile_setting=True, device: str = "cpu") -> Dict:
    """Probe one candidate in a fresh process group; tokens/s of the slowest rank, the largest rank's bytes.
    ``device``: ``cpu`` (gloo; every live tensor counted: one memory) or ``cuda`` (nccl, one GPU per rank on this
    machine; the GPU's tensor bytes counted: compare with the device prediction)."""
    from lightning_scale.testing import run_distributed
    from lightning_scale.tune import Shape

    t0 = time.perf_counter()
    worker = module_worker if isinstance(gpt, Shape) else probe_worker
    if isinstance(gpt, Shape) and not gpt.module:
        raise ConfigError("the CLI probes of a model that is not the package GPT need its LightningModule: --module")
    ranks = run_distributed(worker, c.world, args=(dataclasses.asdict(gpt), dataclasses.asdict(c),
                            steps, warmup, precision, compile_setting, device), timeout=timeout,
                            backend="nccl" if device == "cuda" else "gloo")
    step_s = max(r["step_s"] for r in ranks)
    tokens = c.data_ranks * c.micro_batch * c.accum * gpt.seq_len
    return {"tokens_per_s": tokens / step_s, "step_s": step_s,
            "measured_bytes": max(r["measured_bytes"] for r in ranks),
            "compile_s": max(r.get("compile_s", 0.0) for r in ranks),
            "compiled_units": min(r.get("compiled_units", 0) for r in ranks),
            "graphs": max(r.get("graphs", 0) for r in ranks), "probe_s": time.perf_counter() - t0,
            "space": "device" if device == "cuda" else "one memory"}
