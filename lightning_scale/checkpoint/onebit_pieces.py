"""OneBitAdam's engines in the layout-free checkpoint (:mod:`.engine_pieces` covers the ZeRO engines).

What every layout can read: the weights (``model/``), the fp32 masters (``master/``, where they are a separate copy),
``optim/<fqn>/exp_avg``, ``exp_avg_sq`` and the step counters ``step`` / ``v_step`` (0-d, as Adam's ``step``). What
only the same layout can read: the error-feedback buffers, which compensate *this rank's* compression error of
*this bucketing* - keyed ``onebit/<layout tag>/rank<r>/<bucket>/<buffer>``, the tag a CRC of the engine's layout
(world size, stage, buckets; stage 0: world size and the bucket's parameter indices). On another layout the keys
are absent: the buffers restart from zero, with a warning, once compression has started (1-bit Adam's error
feedback restarts from zero on every DeepSpeed load too). Stage 1/2: :class:`~lightning_scale.zero.onebit.
OneBitZeroOptimizer`; stage 0: :class:`~lightning_scale.zero.engine.SelfReducingEngine` (the optimizer's own
per-parameter state).
"""

from __future__ import annotations

import warnings
import zlib
from typing import Iterator, List, Mapping, Optional, Sequence

import torch

from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.checkpoint.layout import Piece, flat_piece, master_key, model_key, optim_key, tensor_piece

SCALARS = ("step", "v_step")
_RESET = ("OneBitAdam: the checkpoint holds no error-feedback buffers for rank {rank} of {world} at ZeRO stage "
          "{stage} (it was written by another layout): they restart from zero")


def _tag(obj) -> str:
    return f"{zlib.crc32(repr(obj).encode()):08x}"


def _scalar(value) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float64)


def _name(names: Mapping[int, str], p: torch.Tensor) -> str:
    try:
        return names[id(p)]
    except KeyError:
        raise KeyError(f"a parameter of shape {tuple(p.shape)} is not in the names map handed to "
                       "named_pieces") from None


def _check_weights(missing: Sequence[str], fqns) -> None:
    weights = [k for k in missing if k.split("/", 1)[0] in ("model", "master") and k.split("/", 1)[1] in fqns]
    if weights:
        raise CheckpointError(f"the checkpoint has no weights for {weights[:3]} ({len(weights)} missing)")
    gone = sorted({k.split("/", 2)[1] for k in missing if k.startswith("optim/") and k.split("/", 2)[1] in fqns
                   and not k.endswith("/v_step")})
    if gone:
        warnings.warn(f"the checkpoint has no optimizer state for {len(gone)} parameter(s) {gone[:3]}"
                      f"{' ...' if len(gone) > 3 else ''}: they resume with fresh (zero) optimizer state")


# ------------------------------------------------------------------------------------------------ stage 1 / 2
def zero_pieces(engine, names: Mapping[int, str], weights_from: Optional[str] = None) -> Iterator[Piece]:
    """The pieces of a OneBitZeroOptimizer; ``weights_from`` as :func:`.engine_pieces.engine_pieces`."""
    load = weights_from is not None
    tag = _tag({k: v for k, v in engine.layout().items() if k != "rank"})
    engine._ckpt = {"scalars": [], "errors": [], "fqns": set()}
    for i, st in enumerate(engine.states):
        lo, hi = st.shard.start, st.shard.stop
        h = st.helper.state
        param_shard = st.param_buffer[st.shard]
        scalars = {k: _scalar(h[k]) for k in SCALARS}
        engine._ckpt["scalars"].append((st, scalars))
        for slot in st.bucket.slots:
            a, b = slot.shard_overlap(lo, hi)
            if a >= b:
                continue
            fqn = _name(names, slot.param)
            engine._ckpt["fqns"].add(fqn)
            off, n = slot.offset + a - lo, b - a

            def piece(key, t, off=off, n=n, shape=slot.shape, start=a):
                return flat_piece(key, t[off:off + n], shape, start)
            if not load:
                yield piece(model_key(fqn), param_shard)
                if not st.master_aliased:
                    yield piece(master_key(fqn), st.master)
            else:
                yield piece(f"{weights_from}/{fqn}", st.master)
            for sname in ("exp_avg", "exp_avg_sq"):
                yield piece(optim_key(fqn, sname), h[sname])
            for sname, t in scalars.items():
                yield tensor_piece(optim_key(fqn, sname), t)
        key = f"onebit/{tag}/rank{engine.rank}/{i}/worker_error"
        if load:
            buf = torch.zeros(st.bucket.padded_numel, dtype=st.master.dtype, device=st.master.device)
            engine._ckpt["errors"].append((st, key, buf))
            yield tensor_piece(key, buf)
        elif h["worker_error"] is not None:  # allocated at the first compression step
            yield tensor_piece(key, h["worker_error"])


@torch.no_grad()
def zero_after_load(engine, missing: Sequence[str]) -> None:
    """Counters back to ints, error buffers restored (same layout) or reset (warned), masters -> parameters."""
    from lightning_scale.comm import collectives as C

    missing = set(missing)
    freeze = engine.optimizer.freeze_step
    for st, scalars in engine._ckpt["scalars"]:
        st.helper.state["step"] = int(scalars["step"].item())
        v_missing = any(k.endswith("/v_step") for k in missing)  # e.g. an AdamW checkpoint: v follows step
        st.helper.state["v_step"] = min(st.helper.state["step"], freeze) if v_missing else \
            int(scalars["v_step"].item())
    reset = False
    for st, key, buf in engine._ckpt["errors"]:
        if key in missing:
            st.helper.state["worker_error"] = None  # zeros at the next compression step
            reset = reset or st.helper.state["step"] > freeze  # a compressed step ran: buffers existed
        else:
            st.helper.state["worker_error"] = buf
    if reset and engine.world > 1:
        warnings.warn(_RESET.format(rank=engine.rank, world=engine.world, stage=engine.stage))
    _check_weights([k for k in missing if not k.startswith("onebit/")], engine._ckpt["fqns"])
    handles = []
    for st in engine.states:  # as a step ends: the master shard into the parameter buffer, all-gathered
        shard = st.param_buffer[st.shard]
        if not st.master_aliased:
            shard.copy_(st.master)
        handles.append(C.all_gather(st.param_buffer, shard.clone(), engine.group, async_op=True, tag="param"))
    for h in handles:
        h.wait()
    engine._ckpt = None


# ------------------------------------------------------------------------------------------------ stage 0
def _trainable(opt) -> List[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"] if p.requires_grad]


def self_reducing_pieces(engine, names: Mapping[int, str], weights_from: Optional[str] = None) -> Iterator[Piece]:
    """The pieces of OneBitAdam at stage 0: every parameter whole, its state, this rank's error buffers."""
    from lightning_scale.comm.collectives import group_rank, group_size
    from lightning_scale.comm.compressed import error_buffer_numels

    opt, load = engine.optimizer, weights_from is not None
    world, rank = group_size(opt._group), group_rank(opt._group)
    engine._ckpt = {"scalars": [], "errors": [], "fqns": set()}
    for p in _trainable(opt):
        fqn = _name(names, p)
        engine._ckpt["fqns"].add(fqn)
        yield tensor_piece(f"{weights_from}/{fqn}" if load else model_key(fqn), p.detach())
        state = opt._state(p) if load else opt.state.get(p)
        if not state:
            continue  # never stepped: nothing saved, Adam starts fresh
        for sname in ("exp_avg", "exp_avg_sq"):
            yield tensor_piece(optim_key(fqn, sname), state[sname])
        scalars = {k: _scalar(state[k]) for k in SCALARS}
        engine._ckpt["scalars"].append((state, scalars))
        for sname, t in scalars.items():
            yield tensor_piece(optim_key(fqn, sname), t)
    for key, entries in opt._buckets():
        prefix = f"onebit/{_tag((world, key))}/rank{rank}"
        if load:
            n_worker, n_server = error_buffer_numels(sum(p.numel() for p, _ in entries), world)
            ref = entries[0][0]
            bufs = {"worker_error": ref.new_zeros(n_worker), "server_error": ref.new_zeros(n_server)}
            engine._ckpt["errors"].append((key, {n: (f"{prefix}/{n}", b) for n, b in bufs.items()}))
            for n, b in bufs.items():
                yield tensor_piece(f"{prefix}/{n}", b)
        elif key in opt._errors:
            for n, b in opt._errors[key].items():
                yield tensor_piece(f"{prefix}/{n}", b)


@torch.no_grad()
def self_reducing_after_load(engine, missing: Sequence[str]) -> None:
    opt, missing = engine.optimizer, set(missing)
    v_missing = any(k.endswith("/v_step") for k in missing)
    for state, scalars in engine._ckpt["scalars"]:
        state["step"] = int(scalars["step"].item())
        state["v_step"] = min(state["step"], opt.freeze_step) if v_missing else int(scalars["v_step"].item())
    opt._global_step = max((int(s["step"]) for s, _ in engine._ckpt["scalars"]), default=0)
    opt._errors, opt._gathered, opt._loaded = {}, None, None
    lost = False
    for key, bufs in engine._ckpt["errors"]:
        if any(k in missing for k, _ in bufs.values()):
            lost = True
        else:
            opt._errors[key] = {n: b for n, (_, b) in bufs.items()}
    if lost and opt._global_step > opt.freeze_step:
        opt._loaded = (0, {})  # OneBitAdam warns at its first compressed step: the buffers restart from zero
    _check_weights([k for k in missing if not k.startswith("onebit/")], engine._ckpt["fqns"])
    engine._ckpt = None
