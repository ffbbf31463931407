"""Sharded checkpoints: one folder per checkpoint, one optimizer-shard file per rank, complete or absent.

Layout of ``<path>/`` (``<path>`` is what Lightning calls the checkpoint file, e.g. ``epoch=0-step=8.ckpt``)::

    checkpoint.pt          rank 0: everything Lightning saves except the optimizer states
    optim_rank{r}.pt       rank r: its optimizer shards (state, fp32 masters, loss scaler, layout) and, at
                           ZeRO stage 3, its parameter shards (``zero3_model_shard``)
    meta.pt                the manifest, written last: world size, format version, the save's token and
                           every file's size and CRC32

Every rank writes into a fresh staging folder and rank 0 swaps it into place only once the manifest is
written (:mod:`lightning_scale.checkpoint.folder`), so overwriting ``last.ckpt`` can never leave a folder
that mixes two steps, and a crash at any moment leaves the previous good checkpoint loadable.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from lightning_scale.checkpoint import folder
from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.config import ConfigError

FORMAT_VERSION = folder.FORMAT_VERSION


def save_sharded(checkpoint: Dict[str, Any], path: str, rank: int, world_size: int,
                 broadcast: Callable[[Any], Any], gather: Callable[[Any], List[Any]],
                 per_rank_keys: Sequence[str] = ("optimizer_states",)) -> None:
    """Collective. ``broadcast(obj)`` returns rank 0's object on every rank; ``gather(obj)`` returns every
    rank's object (a list in rank order) at least on rank 0."""
    token = broadcast(folder.new_token() if rank == 0 else None)
    staging = folder.staging_path(path, token)
    mine = {k: checkpoint[k] for k in per_rank_keys if k in checkpoint}
    mine.setdefault("optimizer_states", [])
    records = {f"optim_rank{rank}.pt": folder.write_file(staging, f"optim_rank{rank}.pt", mine)}
    if rank == 0:
        rest = {k: v for k, v in checkpoint.items() if k not in per_rank_keys}
        records["checkpoint.pt"] = folder.write_file(staging, "checkpoint.pt", rest)
    folder.fault_point("after_rank_file", rank)
    every = gather(records)  # also the barrier: every rank's files are written and fsync'ed
    if rank == 0:
        files: Dict[str, Dict[str, int]] = {}
        for rec in every:
            files.update(rec)
        folder.commit(path, token, files, world_size=world_size)
    broadcast(None)  # nobody returns (and, e.g., loads or removes it) before the folder is in place


LAYOUT_KEY = "lightning_scale_grid"  # in a sharded checkpoint's checkpoint.pt: the layout of its per-rank files
_GRID = ("dp", "tp", "ep", "pp", "sp")


def grid(strategy) -> Dict[str, int]:
    """The axes a sharded checkpoint's per-rank files are cut for (every one but the world size too)."""
    cfg = strategy.config
    return {"dp": int(cfg.resolved_dp(strategy.world_size)), "tp": int(cfg.tp), "ep": int(cfg.ep), "pp": int(cfg.pp),
            "sp": int(cfg.sp)}


def sharded_layout(strategy) -> Dict[str, int]:
    """What a sharded checkpoint records and a resume must match: the grid and the ZeRO stage (stage 1 / 2 optimizer
    shards, stage 3 parameter shards: the per-rank files differ; the offload setting does not change them). The
    Trainer's and Fabric's strategies alike."""
    return dict(grid(strategy), stage=int(strategy.config.zero.stage))


def _axes(g: Dict[str, int]) -> str:
    text = " x ".join(f"{k}={g.get(k, 1)}" for k in _GRID if g.get(k, 1) > 1 or k == "dp")
    return text + (f", stage={g['stage']}" if "stage" in g else "")


def check_sharded_layout(path: str, saved: Optional[Dict[str, int]], expect: Optional[Dict[str, int]],
                         world_size: int, fitting: bool = True, hint: str = "") -> None:
    """Refuse, by name, a sharded checkpoint whose per-rank files were cut for another layout than ``expect``.

    Checked: the grid always; the ZeRO stage when fitting (the optimizer shards are read), and between stage 3 and
    the others when not (stage 3 keeps the parameters in the per-rank shards, stages 0-2 in ``checkpoint.pt``).
    A key the checkpoint did not record (written by an older version) is not compared. ``hint``: a line added to the
    message (the autotuner's pick)."""
    if expect is None or saved is None:
        return
    diff = [k for k in _GRID if k in saved and saved.get(k, 1) != expect.get(k, 1)]
    if "stage" in saved and "stage" in expect and saved["stage"] != expect["stage"]:
        if fitting or 3 in (saved["stage"], expect["stage"]):
            diff.append("stage")
    if not diff:
        return
    shown_saved = {k: v for k, v in saved.items() if k in _GRID or (k == "stage" and "stage" in expect)}
    shown_expect = {k: v for k, v in expect.items() if k in _GRID or (k == "stage" and "stage" in saved)}
    raise CheckpointError(
        f"checkpoint {path} was cut for {_axes(shown_saved)}; this run is {_axes(shown_expect)} (the same {world_size} "
        f"ranks, another layout: {', '.join(f'{k} {saved[k]} -> {expect.get(k, 1)}' for k in diff)}). "
        + (hint + " " if hint else "")
        + "A checkpoint of the default checkpoint_format='sharded' resumes on its own layout only: resume with "
        f"{_axes(shown_saved)} (and save from there with Zero3DStrategy(checkpoint_format='universal'), which resumes "
        "on any layout), or take its weights with `python -m lightning_scale.checkpoint consolidate`")


def load_sharded(path: str, rank: int, world_size: int, expect: Optional[Dict[str, int]] = None,
                 fitting: bool = True, hint: str = "") -> Dict[str, Any]:
    path = folder.resolve(path)
    meta = folder.read_manifest(path)
    folder.verify(path, meta)  # every listed file present, with its size: names a missing / truncated shard
    folder.warn_unverified(path, meta)
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {meta['world_size']} ranks; this run has {world_size}. A checkpoint "
            "of the default checkpoint_format='sharded' resumes on the same number of devices x nodes only: resume "
            f"on {meta['world_size']} ranks (and save from there with Zero3DStrategy(checkpoint_format='universal'), "
            "which resumes on any layout), or take its weights with `python -m lightning_scale.checkpoint "
            "consolidate` (optimizer state is not carried over)"
        )
    checkpoint = folder.load_file(path, "checkpoint.pt", meta)
    check_sharded_layout(path, checkpoint.pop(LAYOUT_KEY, None), expect, world_size, fitting, hint)
    shard = folder.load_file(path, f"optim_rank{rank}.pt", meta)
    checkpoint.update(shard)  # optimizer_states (+ zero3_model_shard at stage 3)
    return checkpoint


def remove_sharded(path: str) -> None:
    folder.remove(path)


# ---------------------------------------------------------------------------------------------- universal format
# checkpoint_format="universal": the layout-free DCP format (lightning_scale.checkpoint.dcp_format). Each rank
# writes its engines' pieces (model / master / optimizer shards) and the module tensors the engines do not own
# (persistent buffers, frozen parameters); rank 0 adds Lightning's loop state as an extra. Loading on any layout
# fills the new layout's pieces in place; Lightning's own model / optimizer restore calls are then no-ops.
UNIVERSAL_KEY = "lightning_scale_universal"  # in the dict load_universal returns: where the state went
_SKIP = ("state_dict", "optimizer_states")


def param_names(module) -> Dict[int, str]:
    from lightning_scale.checkpoint.engine_pieces import param_names as names

    return names(module)


def module_pieces(module, engines, tp_rank: int, names_only=None) -> List[Any]:
    from lightning_scale.checkpoint.engine_pieces import module_pieces as pieces

    return pieces(module, engines, tp_rank, names_only)


def _layout(strategy) -> Dict[str, Any]:
    """The universal checkpoint's record of the layout that wrote it: the sharded one's and the rest."""
    return {"world_size": strategy.world_size, **sharded_layout(strategy),
            "offload": strategy.config.offload.optimizer,
            "precision": getattr(strategy.precision_plugin, "precision", None)}


def _tp_rank(strategy) -> int:
    return strategy.topology.tp_rank if strategy.topology is not None and strategy.config.tp_axis > 1 else 0


def _check_engines(strategy) -> None:
    if not strategy.engines:
        raise ConfigError("checkpoint_format='universal': the checkpoint is written and read through the ZeRO "
                          "engines, which exist while fitting (call trainer.fit first)")


def save_universal(strategy, checkpoint: Dict[str, Any], path: str) -> None:
    """Collective: Lightning's ``checkpoint`` (its state_dict / optimizer_states are not used: the engines' pieces
    replace them) to the layout-free folder ``path``. ``checkpoint_async=True``: returns after the snapshot."""
    from lightning_scale.checkpoint.engine_pieces import save_engines

    _check_engines(strategy)
    weights_only = "optimizer_states" not in checkpoint  # ModelCheckpoint(save_weights_only=True)
    saver = _async_saver(strategy) if strategy.config.checkpoint_async else None
    if saver is not None:  # the save in flight is written first, then the removals it held back (defer_removal)
        strategy._deferred_removals = [p for p in getattr(strategy, "_deferred_removals", []) if p != str(path)]
        wait_async_save(strategy)
        _guard_links(strategy)
        saver = track_links(strategy, saver, path)
    save_engines(path, strategy.lightning_module, strategy.engines, tp_rank=_tp_rank(strategy),
                 extras={"lightning": {k: v for k, v in checkpoint.items() if k not in _SKIP}},
                 meta={"step": checkpoint.get("global_step"), "layout": _layout(strategy),
                       "weights_only": weights_only}, with_optimizer=not weights_only, saver=saver,
                 overlap=strategy.config.checkpoint_async == "overlap")
    if saver is not None:
        strategy._async_path = path


def _async_saver(strategy):
    """The strategy's AsyncSaver, made at the first save (collective: its own gloo group, on every rank)."""
    saver = getattr(strategy, "_async", None)
    if saver is None:
        import torch.distributed as dist

        from lightning_scale.checkpoint.async_save import AsyncSaver

        group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        saver = strategy._async = AsyncSaver(group=group)  # never the training group (async_save's docstring)
    return saver


def wait_async_save(strategy, path: Any = None) -> None:
    """Block until the save in flight is written (raising its error); with ``path``: only if it writes there. Once
    it is written, the removals deferred while it was in flight (:func:`defer_removal`) are done."""
    saver = getattr(strategy, "_async", None)
    if saver is None or (path is not None and str(path) != getattr(strategy, "_async_path", None)):
        return
    try:
        saver.wait()
    except BaseException:
        # The folder it wrote is absent: keep every folder a removal was queued for (else a later wait, e.g. at
        # teardown, would remove the previous checkpoint too, leaving none) and leave last.ckpt where it points.
        strategy._deferred_removals = []
        if getattr(strategy, "_async_links", None) is not None:
            strategy._async_links["pending"] = []
        raise
    pending, strategy._deferred_removals = getattr(strategy, "_deferred_removals", []), []
    if strategy.is_global_zero:
        for old in pending:
            if os.path.lexists(old):  # Lightning may ask for a folder a crashed run already removed
                folder.remove(old)


class _LinkOnWrite:
    """The AsyncSaver as save_engines sees it, with ``on_written`` bound."""

    def __init__(self, saver, on_written) -> None:
        self.saver, self.on_written = saver, on_written

    def save(self, *args, **kw) -> None:
        self.saver.save(*args, on_written=self.on_written, **kw)


def track_links(strategy, saver, path: str) -> "_LinkOnWrite":
    """The save about to start writes ``path``: links to it asked for meanwhile wait until it is written."""
    links = strategy._async_links = {"path": str(path), "written": False, "pending": []}
    return _LinkOnWrite(saver, functools.partial(_links_written, strategy, links))


def _guard_links(strategy) -> None:
    """checkpoint_async with ``ModelCheckpoint(save_last="link")``: Lightning links last.ckpt to the checkpoint it
    just saved, right after the save *starts*. With the write in flight that folder does not exist yet: the link
    dangles until it is written, and a crash meanwhile leaves a last.ckpt that loads nothing (measured: the first
    link failed outright, FileNotFoundError, the checkpoint directory not created yet). So the callbacks' link step
    goes through :func:`_link_when_written`: the link moves (atomically) only once the folder it names is complete."""
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    for cb in getattr(trainer, "checkpoint_callbacks", None) or []:
        if getattr(cb, "save_last", None) == "link" and not getattr(cb, "_lightning_scale_links", False):
            cb._link_checkpoint = functools.partial(_link_when_written, strategy)  # shadows the staticmethod
            cb._lightning_scale_links = True


def _link_when_written(strategy, trainer, filepath: str, linkpath: str) -> None:
    """ModelCheckpoint._link_checkpoint's replacement: link now when ``filepath`` is complete, else queue the link
    for the writing thread (:func:`_links_written`); the previous link stays until then."""
    links = getattr(strategy, "_async_links", None)
    if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
        with _LINKS_LOCK:
            queued = links is not None and links["path"] == str(filepath) and not links["written"]
            if queued:
                links["pending"] = [q for q in links["pending"] if q[1] != linkpath] + [(filepath, linkpath)]
        if not queued:
            link_atomically(filepath, linkpath)
    trainer.strategy.barrier()


def _links_written(strategy, links) -> None:
    """In the writing thread, once ``links["path"]`` is in place on every rank: make the links queued for it."""
    with _LINKS_LOCK:
        links["written"] = True
        pending, links["pending"] = links["pending"], []
        for filepath, linkpath in pending:
            link_atomically(filepath, linkpath)


_LINKS_LOCK = threading.Lock()


def link_atomically(filepath: str, linkpath: str) -> None:
    """``linkpath`` -> ``filepath`` (relative), replacing a previous link in one rename: at every moment the name
    resolves to the old target or the new one. A real folder or file there (an earlier save_last=True) is removed
    first, as Lightning does."""
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        folder.remove(linkpath)
    tmp = os.path.join(os.path.dirname(linkpath), f".link-{os.getpid()}.tmp")  # hidden, not matched as a "last"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
    os.replace(tmp, linkpath)


def defer_removal(strategy, path: Any) -> bool:
    """checkpoint_async: ``save_top_k`` removes the previous folder right after the next save *starts*. Removed then,
    a crash before that save is written would leave no complete checkpoint (measured: save_top_k=1 without
    save_last, rank 1 killed mid-write: only two staging folders left). So while a save is unconfirmed (writing, or
    failed and not yet raised) the removal is queued and done by the next :func:`wait_async_save` (the next save,
    a load, teardown); returns True when queued. A queued path that a new save writes again is dropped from it."""
    saver = getattr(strategy, "_async", None)
    if saver is None or not saver.unconfirmed or str(path) == getattr(strategy, "_async_path", None):
        return False
    strategy._deferred_removals = getattr(strategy, "_deferred_removals", []) + [str(path)]
    return True


def read_lightning_state(path: str) -> Dict[str, Any]:
    """Collective: the Lightning dict of a universal checkpoint, no tensor read (the pieces load later)."""
    from lightning_scale.checkpoint import dcp_format

    res = dcp_format.load(path, [], extra_keys=["lightning"])
    return dict(res.extras["extra/lightning"], state_dict={}, optimizer_states=[])


def load_universal(strategy, path: str) -> Dict[str, Any]:
    """Collective: fill this layout's engines (weights into the masters, optimizer state, loss scaler, param-group
    hyperparameters) and module tensors from the universal checkpoint ``path`` (any layout wrote it); returns the
    Lightning dict (loops, callbacks, lr schedulers...) with ``UNIVERSAL_KEY`` set."""
    from lightning_scale.checkpoint.engine_pieces import load_engines

    _check_engines(strategy)
    res = load_engines(path, strategy.lightning_module, strategy.engines, tp_rank=_tp_rank(strategy),
                       extra_keys=["lightning"])
    return dict(res.extras["extra/lightning"], state_dict={}, optimizer_states=[], **{UNIVERSAL_KEY: res.meta})


def load_universal_weights(strategy, path: str) -> None:
    """Collective, no engines (validate / test / predict with ``ckpt_path``, any layout): the weights (fp32 masters
    where the checkpoint kept them) into what this rank holds of the model: its ZeRO-3 parameter shards, its tp
    slices, its pipeline stage's tensors, persistent buffers. Each rank reads only the saved chunks that overlap."""
    from lightning_scale.checkpoint import dcp_format
    from lightning_scale.checkpoint.engine_pieces import sharded_pieces, tensor_pieces

    path, _, md = dcp_format.open_checkpoint(path)
    have = md.state_dict_metadata

    def weights(name: str) -> str:
        return f"master/{name}" if f"master/{name}" in have else f"model/{name}"

    module, tp_rank, sharded = strategy.lightning_module, _tp_rank(strategy), strategy.sharded
    pieces, owned = [], set()
    if sharded is not None:  # ZeRO-3: into the flat shards (the parameters themselves are freed views)
        pieces += sharded_pieces(sharded, param_names(module), weights, tp_rank)
        owned = {id(s.param) for b in sharded.buckets() for s in b.bucket.slots}
    params = {id(p) for p in module.parameters()}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in owned or not torch.is_tensor(t) or t.numel() == 0 or t.is_meta:
            continue  # a 0-element tensor: another pipeline stage's, which that stage loads
        pieces.append(tensor_pieces(weights(name) if id(t) in params else f"model/{name}", t, tp_rank))
    with torch.no_grad():
        dcp_format.load(path, pieces, strict=True)
    if sharded is not None:
        sharded.after_step()  # shards changed: refresh the persistent unit, drop stale gathered copies


# ------------------------------------------------------------------------------------ resuming at an epoch's end
def resume_epoch_end_as_last_batch(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """Rewrite the loop state of a checkpoint saved in ``on_train_epoch_end`` into the state the same boundary has in
    ``on_train_batch_end`` of the epoch's last batch; every other checkpoint is returned as it is.

    Why: Lightning 2.x restarts an iteration-based run (``Trainer(max_steps=...)``) from an epoch-end checkpoint
    (``ModelCheckpoint(every_n_epochs=..., save_on_train_epoch_end=True)``, or any end-of-epoch save without
    validation) as a restart *inside* that epoch: it trains one batch past the epoch's end (batch_idx ==
    num_training_batches) on the first batch of a fresh iterator, so every later step sees the batch the
    uninterrupted run saw one step earlier (Lightning issue #19403; measured: the resumed losses differed from step
    5 on). A checkpoint written at the last batch's end restarts correctly in both epoch- and iteration-based runs:
    Lightning finishes that epoch's bookkeeping and starts the next epoch on a fresh iterator. The two states differ
    only in counters that the batch-end save has not advanced yet: the batch's ``completed``, the epoch's
    ``processed`` and ``_batches_that_stepped`` (Lightning adds the 1 back on restart).

    Epoch-interval lr schedulers step after ``on_train_epoch_end`` and so after the save: neither form holds that
    step (unchanged by this rewrite)."""
    try:
        fit = checkpoint["loops"]["fit_loop"]
        epoch, batch = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
        stepped = fit["epoch_loop.state_dict"]["_batches_that_stepped"]
        tot, cur, btot, bcur = epoch["total"], epoch["current"], batch["total"], batch["current"]
        at_epoch_end = (
            tot["ready"] == tot["started"] == tot["processed"] == tot["completed"] + 1
            and cur["ready"] == cur["started"] == cur["processed"] == cur["completed"] + 1
            and btot["ready"] == btot["started"] == btot["processed"] == btot["completed"] > 0
            and bcur["ready"] == bcur["started"] == bcur["processed"] == bcur["completed"] > 0
            and isinstance(stepped, int) and stepped > 0)
    except (KeyError, TypeError):
        return checkpoint  # not a Lightning fit checkpoint of the layout above: leave it to Lightning
    if not at_epoch_end:
        return checkpoint
    for progress in (tot, cur):
        progress["processed"] -= 1
    for progress in (btot, bcur):
        progress["completed"] -= 1
    batch["is_last_batch"] = True
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = stepped - 1
    return checkpoint
