"""What a ZeRO engine (stages 0-3, offload, under tp / pp) holds, as layout-free :class:`~.layout.Piece` objects.

:class:`~lightning_scale.zero.optimizer.ShardEngine` (``ZeroOptimizer`` and ``Stage3Optimizer``) delegates here.
Every engine keeps per bucket state ``st``: the bucket's slots (param, offset, numel, shape), this rank's range
``[lo, hi)`` of the bucket (``model_parallel.shard_slice``), the parameter shard (stages 0-2: a slice of the full
``param_buffer``; stage 3: ``st.shard``), the master shard (fp32 under mixed precision, else an alias of the
parameter shard) and the inner optimizer's state for that master. A slot overlapping ``[lo, hi)`` becomes one
:func:`flat_param_piece` per key (views of the shard tensors: saving reads them, loading writes them in place):

- ``model/<fqn>`` (parameter shard, training dtype), ``master/<fqn>`` (only where the master is a separate copy),
- ``optim/<fqn>/<state>`` for every state tensor shaped like the master (``exp_avg``, ``exp_avg_sq``, ...) and
  every 0-d state (``step``: one value per bucket, yielded for each of its fqns - replicated, written once).

tp slices are mapped back through the parameter's ``ShardSpec`` (``tp_spec``): a slice at ``tp_rank * local``
along ``spec.dim`` of the padded global shape, the true (unpadded) size stored; fused sections (a qkv weight
split per section, along dim 0, or GPT-2's ``Conv1D`` along dim 1) are cut per section. At stage 0 every dp rank holds the whole bucket and
yields the same chunks: DCP's plan dedup writes them once.

Loading reads the trainable weights into the *masters* only (``weights_from="master"`` when the checkpoint kept
fp32 masters, ``"model"`` when it did not, e.g. it was 32-true), then :func:`after_load_` writes the masters into
the parameters exactly as a step does (cast, all-gather at stages 1-2, the persistent units at stage 3): the
resumed parameters are bit-for-bit what the saving run's step wrote.
"""

from __future__ import annotations

import functools
import warnings
from typing import Dict, Iterator, Mapping, Optional, Sequence, Set

import torch

from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.checkpoint.layout import (Chunk, Piece, TPSlice, flat_piece, flat_range_to_chunks, master_key,
                                              model_key, optim_key, tensor_piece)

WEIGHT_SOURCES = ("model", "master")


def _tp_spec(t: torch.Tensor):
    return getattr(t, "tp_spec", None)  # tensor_parallel.sharding.tp_spec, without importing the package


def flat_param_piece(key: str, flat: torch.Tensor, local_shape: Sequence[int], start: int, spec=None,
                     tp_rank: int = 0) -> Piece:
    """``flat`` = elements ``[start, start + len)`` (row-major) of a local tensor of ``local_shape``: the whole tensor
    (``spec=None``) or tp rank ``tp_rank``'s slice described by its ``ShardSpec``, vocabulary padding included and
    fused sections along any dim (a qkv weight split per section along dim 0; GPT-2's ``Conv1D`` ``c_attn``,
    ``[in, 3 * out]``, along dim 1). Used for the layout-free checkpoint and for pretrained weights
    (:func:`lightning_scale.pretrained.tp_flat_piece`)."""
    local = tuple(int(s) for s in local_shape)
    if spec is None:
        return flat_piece(key, flat, local, start)
    padded, true = list(local), list(local)
    padded[spec.dim], true[spec.dim] = spec.padded, spec.size
    if spec.sections == 1:
        return flat_piece(key, flat, local, start, tp=TPSlice(spec.dim, spec.local_range(tp_rank)[0]),
                          global_shape=padded, true_shape=true)
    # Each rectangle of the flat range (contiguous) is cut per section along spec.dim: local positions
    # [loc, loc + sl) are global [glob, glob + sl) (sections may differ in size). Along dim 0 the cuts stay
    # contiguous; along a later dim they are strided views (saving copies them, loading writes through them).
    d = spec.dim
    piece = Piece(key, tuple(true), flat.dtype)
    for chunk, pos in flat_range_to_chunks(local, start, start + flat.numel()):
        view = flat[pos:pos + chunk.numel].view(chunk.sizes)
        a, n = chunk.offsets[d], chunk.sizes[d]
        for loc, glob, sl in spec.pieces(tp_rank):
            lo, hi = max(a, loc), min(a + n, loc + sl)
            if lo >= hi:
                continue
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            offsets[d], sizes[d] = glob + lo - loc, hi - lo
            piece.chunks.append(Chunk(tuple(offsets), tuple(sizes)))
            piece.tensors.append(view.narrow(d, lo - a, hi - lo))
    return piece


def tensor_pieces(key: str, t: torch.Tensor, tp_rank: int = 0) -> Piece:
    """A whole local tensor (a buffer, a frozen parameter), tp-mapped when it carries a ``ShardSpec``."""
    flat = t.detach().reshape(-1)
    if t.numel() and flat.data_ptr() != t.data_ptr():  # reshape copied: write into the real tensor instead
        raise ValueError(f"{key}: a non-contiguous tensor cannot be checkpointed in place")
    return flat_param_piece(key, flat, tuple(t.shape), 0, _tp_spec(t), tp_rank)


def _param_shard(engine, st) -> torch.Tensor:
    return st.shard if engine.stage == 3 else st.param_buffer[st.shard]


def _bounds(st):
    from lightning_scale.zero.model_parallel import shard_slice

    sl = shard_slice(st)
    return sl.start, sl.stop


def engine_pieces(engine, names: Mapping[int, str], weights_from: Optional[str] = None) -> Iterator[Piece]:
    """The pieces of ``engine`` (a ShardEngine), keyed by ``names`` (id(param) -> fqn in the unsplit model).

    ``weights_from=None``: what a save writes. ``"master"`` / ``"model"``: what a load fills - the weights go into
    the master shards from that key (no ``model/`` piece for a trainable parameter), the optimizer state as saved.
    """
    if weights_from not in (None,) + WEIGHT_SOURCES:
        raise ValueError(f"weights_from={weights_from!r}: one of None, {WEIGHT_SOURCES}")
    tp_rank = engine.cross.tp_rank
    for st, master, aliased in zip(engine.reducer.states, engine.masters, engine._aliased):
        param_shard = _param_shard(engine, st)
        state = engine.inner.state.get(master, {})
        for slot, off, n, a in _shard_slots(st.bucket, *_bounds(st)):
            fqn, spec = _name(names, slot.param), _tp_spec(slot.param)
            # the slot's elements [a, a + n) sit at [off, off + n) of every shard-sized tensor of this bucket
            piece = functools.partial(_slot_piece, off=off, n=n, shape=slot.shape, start=a, spec=spec,
                                      tp_rank=tp_rank)
            if weights_from is None:
                yield piece(model_key(fqn), param_shard)
                if not aliased:
                    yield piece(master_key(fqn), master)
            else:
                yield piece(f"{weights_from}/{fqn}", master)
            for sname, value in state.items():
                if not torch.is_tensor(value):
                    continue
                if value.shape == master.shape:
                    yield piece(optim_key(fqn, sname), value)
                elif value.dim() == 0:
                    yield tensor_piece(optim_key(fqn, sname), value)


def sharded_pieces(sharded, names: Mapping[int, str], key_of, tp_rank: int = 0) -> Iterator[Piece]:
    """The parameter shards of a ZeRO-3 ``ShardedParameters`` without an engine (evaluation: nothing to step):
    ``key_of(fqn)`` names the checkpoint key each slot's elements are read from / written to."""
    for b in sharded.buckets():
        for slot, off, n, a in _shard_slots(b.bucket, *b.bucket.shard_range(b.rank)):
            yield _slot_piece(key_of(_name(names, slot.param)), b.shard, off=off, n=n, shape=slot.shape, start=a,
                              spec=_tp_spec(slot.param), tp_rank=tp_rank)


def _shard_slots(bucket, lo: int, hi: int):
    """(slot, offset in the shard, length, first element of the slot) of each slot overlapping shard [lo, hi)."""
    for slot in bucket.slots:
        a, b = slot.shard_overlap(lo, hi)
        if a < b:
            yield slot, slot.offset + a - lo, b - a, a


def _slot_piece(key: str, shard: torch.Tensor, *, off: int, n: int, shape, start: int, spec, tp_rank: int) -> Piece:
    return flat_param_piece(key, shard[off:off + n], shape, start, spec, tp_rank)


def _name(names: Mapping[int, str], param: torch.Tensor) -> str:
    try:
        return names[id(param)]
    except KeyError:
        raise KeyError(f"a parameter of shape {tuple(param.shape)} is not in the names map handed to "
                       "named_pieces (id(param) -> fqn of the module being checkpointed)") from None


def engine_fqns(engine, names: Mapping[int, str]) -> Set[str]:
    return {_name(names, slot.param) for st in engine.reducer.states for slot in st.bucket.slots}


@torch.no_grad()
def allocate_state_(engine, states: Mapping[str, "tuple[torch.dtype, bool]"]) -> None:
    """Create the optimizer state a load will fill, where the optimizer allocates it lazily (Adam's ``exp_avg``,
    ``exp_avg_sq``, ``step`` at the first step). ``states``: state name -> (dtype, is_scalar) as the checkpoint
    holds them. Masters whose state already exists are left alone."""
    group_of = {id(p): g for g in engine.inner.param_groups for p in g["params"]}
    for master in engine.masters:
        if engine.inner.state.get(master):
            continue
        group = group_of[id(master)]
        on_device = bool(group.get("fused") or group.get("capturable"))  # torch keeps `step` on the host otherwise
        slot: Dict[str, torch.Tensor] = {}
        for sname, (dtype, scalar) in states.items():
            if scalar:
                slot[sname] = torch.zeros((), dtype=dtype, device=master.device if on_device else "cpu")
            else:
                slot[sname] = torch.zeros_like(master)
        if slot:
            engine.inner.state[master] = slot


@torch.no_grad()
def after_load_(engine, missing: Sequence[str], names: Mapping[int, str]) -> None:
    """The masters were loaded: write them into the parameters as a step does; warn for missing state."""
    engine._write_back_and_gather()
    mine = engine_fqns(engine, names)
    gone = sorted({k.split("/", 2)[1] for k in missing if k.startswith("optim/") and k.split("/", 2)[1] in mine})
    if gone:
        warnings.warn(f"the checkpoint has no optimizer state for {len(gone)} parameter(s) {gone[:3]}"
                      f"{' ...' if len(gone) > 3 else ''}: they resume with fresh (zero) optimizer state")
    weights = [k for k in missing if k.split("/", 1)[0] in WEIGHT_SOURCES and k.split("/", 1)[1] in mine]
    if weights:
        raise CheckpointError(f"the checkpoint has no weights for {weights[:3]} ({len(weights)} missing)")


# ------------------------------------------------------------------------------------------ whole-model save / load
# What the Trainer strategy (checkpoint_format="universal"), the Fabric strategy and a plain torch.distributed script
# (parallelize + make_engines) all write: the engines' pieces, the module tensors no engine owns, and per engine its
# loss scaler and param-group hyperparameters as ``extra/engines``. torch only.
def param_names(module) -> Dict[int, str]:
    """id(param) -> its first name in ``module`` (a tied parameter is checkpointed once, under that name)."""
    names: Dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def owned_ids(engines) -> Set[int]:
    from lightning_scale.zero.engine import SelfReducingEngine
    from lightning_scale.zero.onebit import OneBitZeroOptimizer

    out: Set[int] = set()
    for e in engines:
        if isinstance(e, SelfReducingEngine):  # OneBitAdam at stage 0: the optimizer's trainable parameters
            out |= {id(p) for g in e.optimizer.param_groups for p in g["params"] if p.requires_grad}
        else:
            states = e.states if isinstance(e, OneBitZeroOptimizer) else e.reducer.states
            out |= {id(slot.param) for st in states for slot in st.bucket.slots}
    return out


def module_pieces(module, engines, tp_rank: int = 0, names_only=None) -> list:
    """``model/<name>`` pieces of what the engines do not hold: persistent buffers, frozen parameters. Another
    pipeline stage's freed parameters (0 elements) are skipped: their owner writes them."""
    owned = owned_ids(engines)
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in owned or not torch.is_tensor(t) or t.numel() == 0 or t.is_meta:
            continue
        if names_only is None or name in names_only:
            out.append(tensor_pieces(f"model/{name}", t, tp_rank))
    return out


def checkpoint_states(md) -> Dict[str, "tuple[torch.dtype, bool]"]:
    """Optimizer state names a checkpoint's DCP metadata holds -> (dtype, is 0-d), for the engines to allocate."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    states: Dict[str, tuple] = {}
    for key, tmd in md.state_dict_metadata.items():
        if key.startswith("optim/") and isinstance(tmd, TensorStorageMetadata):
            states.setdefault(key.rsplit("/", 1)[1], (tmd.properties.dtype, len(tmd.size) == 0))
    return states


def step_writer(engine) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer whose ``step()`` is the only writer of ``engine``'s saved pieces (parameter shards,
    masters, optimizer state), or None when there is no such single point (the 1-bit ZeRO engine)."""
    from lightning_scale.zero.engine import SelfReducingEngine

    writer = engine.optimizer if isinstance(engine, SelfReducingEngine) else getattr(engine, "inner", None)
    return writer if isinstance(writer, torch.optim.Optimizer) else None


def save_engines(path: str, module, engines, *, tp_rank: int = 0, extras: Optional[Mapping] = None,
                 meta: Optional[Mapping] = None, with_optimizer: bool = True, group=None, saver=None,
                 overlap: bool = False) -> None:
    """Collective: ``module``'s engines and unowned tensors (and rank 0's ``extras``) to the layout-free folder
    ``path``. ``saver``: an :class:`~.async_save.AsyncSaver` (returns after the snapshot) instead of a blocking
    write; ``overlap=True``: the engines' pieces are copied by the saver's thread while training goes on, and each
    engine's next optimizer step waits for that copy (:func:`step_writer`; engines without one are copied now)."""
    from lightning_scale.checkpoint import dcp_format

    names = param_names(module)
    pieces, later, fence_on = [], [], []
    for e in engines:
        writer = step_writer(e) if overlap and saver is not None else None
        own = [p for p in e.named_pieces(names) if with_optimizer or not p.key.startswith("optim/")]
        if writer is not None:
            later += range(len(pieces), len(pieces) + len(own))
            fence_on.append(writer)
        pieces += own
    pieces += module_pieces(module, engines, tp_rank)  # buffers may change in the next forward: copied now
    extras = dict(extras or {})
    extras["engines"] = [{"loss_scaler": e.loss_scaler.state_dict(),
                          "user_param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                for g in e.optimizer.param_groups]} for e in engines]
    if saver is not None:
        saver.save(path, pieces, extras, meta=dict(meta or {}), later=later, fence_on=fence_on)
    else:
        dcp_format.save(path, pieces, extras, meta=dict(meta or {}), group=group)


def load_engines(path: str, module, engines, *, tp_rank: int = 0, extra_keys: Sequence[str] = (), group=None):
    """Collective: fill this layout's engines (weights into the masters, optimizer state, loss scaler, param-group
    hyperparameters) and ``module``'s unowned tensors from the layout-free checkpoint ``path`` (any layout wrote
    it). Returns the :class:`~.dcp_format.LoadResult` (``extras`` holds ``extra/<k>`` for ``extra_keys``)."""
    from lightning_scale.checkpoint import dcp_format

    path, _, md = dcp_format.open_checkpoint(path)
    names = param_names(module)
    weights_from = "master" if any(k.startswith("master/") for k in md.state_dict_metadata) else "model"
    for e in engines:
        e.allocate_state_(checkpoint_states(md))
    pieces = [p for e in engines for p in e.named_pieces(names, weights_from)]
    pieces += module_pieces(module, engines, tp_rank)
    res = dcp_format.load(path, pieces, extra_keys=list(extra_keys) + ["engines"], strict=False, group=group)
    trainable = {names[i] for i in owned_ids(engines)}
    buffers = [k for k in res.missing if k.startswith("model/") and k[len("model/"):] not in trainable]
    if buffers:
        raise CheckpointError(f"{path} has no {buffers[:5]} ({len(buffers)} module tensors missing)")
    for e in engines:
        e.after_load_(res.missing, names)
    saved = res.extras["extra/engines"]
    if len(saved) != len(engines):
        raise CheckpointError(f"{path} was written with {len(saved)} optimizer(s); this run has {len(engines)}")
    for e, s in zip(engines, saved):
        e.loss_scaler.load_state_dict(s["loss_scaler"])
        for g, hyper in zip(e.optimizer.param_groups, s["user_param_groups"]):
            g.update(hyper)
    return res
