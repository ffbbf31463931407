"""Checkpoint folders are complete or absent: a save cut at any point never loads as a mix of two steps.

Two ranks run the real collective save in two threads (broadcast / gather through a barrier). A crash is a
test hook that raises at one of the save's fault points; the disk is then exactly what a kill there leaves.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings

import pytest
import torch

from lightning_scale.checkpoint import folder
from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.strategies.checkpoint import load_sharded, remove_sharded, save_sharded

WORLD = 2


class Crash(Exception):
    pass


def _save(path, step, *, crash_at=None, crash_rank=0, monkeypatch=None, extra=None):
    """Every rank saves a checkpoint whose every tensor holds `step`; `crash_at` stops rank `crash_rank` there."""
    barrier = threading.Barrier(WORLD, timeout=20)
    box = {}
    errors = []

    def broadcast_for(rank):
        def broadcast(obj):
            if rank == 0:
                box["b"] = obj
            barrier.wait()
            value = box["b"]
            barrier.wait()
            return value
        return broadcast

    def gather_for(rank):
        def gather(obj):
            box[rank] = obj
            barrier.wait()
            every = [box[r] for r in range(WORLD)]
            barrier.wait()
            return every
        return gather

    if crash_at is not None:
        real = folder.fault_point

        def fault(point, rank=None):
            me = rank if rank is not None else 0  # commit's points run on rank 0
            if point == crash_at and me == crash_rank:
                barrier.abort()
                raise Crash(point)
            real(point, rank)
        monkeypatch.setattr(folder, "fault_point", fault)

    def run(rank):
        ckpt = {"global_step": step, "state_dict": {"w": torch.full((64,), float(step))},
                "optimizer_states": [{"shard": torch.full((1000 + rank,), float(step))}], **(extra or {})}
        try:
            save_sharded(ckpt, str(path), rank, WORLD, broadcast_for(rank), gather_for(rank))
        except (Crash, threading.BrokenBarrierError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if crash_at is not None:
        monkeypatch.setattr(folder, "fault_point", real)
        assert any(isinstance(e, Crash) for e in errors), f"the save never reached {crash_at}"
    else:
        assert not errors, errors


def _steps(path):
    """The step every loaded piece came from, per rank: a mix of two saves shows as two different numbers."""
    seen = set()
    for rank in range(WORLD):
        ckpt = load_sharded(str(path), rank, WORLD)
        seen |= {ckpt["global_step"], float(ckpt["state_dict"]["w"][0]),
                 float(ckpt["optimizer_states"][0]["shard"][0])}
        assert ckpt["optimizer_states"][0]["shard"].numel() == 1000 + rank
    return seen


def test_save_load_roundtrip_and_layout(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    assert sorted(os.listdir(path)) == ["checkpoint.pt", "meta.pt", "optim_rank0.pt", "optim_rank1.pt",
                                     "summary.json"]
    assert _steps(path) == {1}
    meta = folder.read_manifest(str(path))
    assert meta["version"] == 2 and meta["world_size"] == WORLD and set(meta["files"]) == {
        "checkpoint.pt", "optim_rank0.pt", "optim_rank1.pt"}
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no staging left behind


@pytest.mark.parametrize("crash_at,crash_rank", [
    ("after_rank_file", 0),  # rank 0 wrote its new shard and checkpoint.pt; rank 1 may or may not have
    ("after_rank_file", 1),
    ("before_swap", 0),      # every file and the manifest written, not yet in place
])
def test_overwrite_cut_before_swap_keeps_previous(tmp_path, monkeypatch, crash_at, crash_rank):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    _save(path, 2, crash_at=crash_at, crash_rank=crash_rank, monkeypatch=monkeypatch)
    assert _steps(path) == {1}  # the old in-place overwrite gave {1, 2} here, loaded without a word
    _save(path, 3)  # the next save completes and removes what the killed one left
    assert _steps(path) == {3} and os.listdir(tmp_path) == ["last.ckpt"]


def test_overwrite_cut_after_swap_is_new(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    _save(path, 2, crash_at="after_swap", monkeypatch=monkeypatch)
    assert _steps(path) == {2}


def test_non_atomic_fallback_cut_between_renames(tmp_path, monkeypatch):
    """Without renameat2 the swap is two renames; a crash between them leaves no target: resolve() finds the
    complete save beside it, and a later save tidies up."""
    monkeypatch.setattr(folder, "_exchange", lambda a, b: False)
    path = tmp_path / "last.ckpt"
    _save(path, 1)
    _save(path, 2, crash_at="between_renames", monkeypatch=monkeypatch)
    assert not path.exists()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert _steps(path) in ({1}, {2})  # one whole save, never a mix
    _save(path, 3)
    assert _steps(path) == {3} and os.listdir(tmp_path) == ["last.ckpt"]


def test_new_folder_cut_is_not_loadable(tmp_path, monkeypatch):
    _save(tmp_path / "epoch=0-step=1.ckpt", 1)
    _save(tmp_path / "epoch=0-step=2.ckpt", 2, crash_at="before_swap", monkeypatch=monkeypatch)
    assert not (tmp_path / "epoch=0-step=2.ckpt").exists()  # only a hidden staging folder
    with pytest.raises(CheckpointError, match="epoch=0-step=2.ckpt is not a checkpoint folder"):
        load_sharded(str(tmp_path / "epoch=0-step=2.ckpt"), 0, WORLD)
    assert _steps(tmp_path / "epoch=0-step=1.ckpt") == {1}


def test_lightning_last_lookup_ignores_staging(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint

    _save(tmp_path / "last.ckpt", 1)
    _save(tmp_path / "last.ckpt", 2, crash_at="before_swap", monkeypatch=monkeypatch)
    assert any(name.endswith(".partial") for name in os.listdir(tmp_path))

    class T:
        default_root_dir = str(tmp_path)
        loggers = []
    cb = ModelCheckpoint(dirpath=str(tmp_path))
    assert cb._find_last_checkpoints(T()) == {os.path.normpath(str(tmp_path / "last.ckpt"))}


def test_truncated_deleted_and_foreign_files_are_named(tmp_path):
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    _save(a, 1)
    _save(b, 2)
    bad = tmp_path / "bad.ckpt"
    shutil.copytree(a, bad)
    with open(bad / "optim_rank1.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"optim_rank1.pt is truncated or corrupt: 100 bytes"):
        load_sharded(str(bad), 0, WORLD)  # every rank checks every file's size, not only its own
    os.remove(bad / "optim_rank1.pt")
    with pytest.raises(CheckpointError, match=r"optim_rank1.pt is missing"):
        load_sharded(str(bad), 0, WORLD)
    shutil.rmtree(bad)
    shutil.copytree(a, bad)
    shutil.copy(b / "meta.pt", bad / "meta.pt")  # a manifest from another save (same sizes: tensors of equal shape)
    with pytest.raises(CheckpointError, match=r"checkpoint.pt is corrupt or from another save"):
        load_sharded(str(bad), 0, WORLD)
    shutil.rmtree(bad)
    shutil.copytree(a, bad)
    with open(bad / "optim_rank0.pt", "r+b") as f:  # same size, flipped bytes
        f.seek(-20, 2)
        f.write(b"\xff" * 8)
    with pytest.raises(CheckpointError, match=r"optim_rank0.pt is corrupt or from another save"):
        load_sharded(str(bad), 0, WORLD)
    load_sharded(str(bad), 1, WORLD)  # rank 1 reads only checkpoint.pt and its own shard
    os.remove(bad / "meta.pt")
    with pytest.raises(CheckpointError, match="no meta.pt"):
        load_sharded(str(bad), 0, WORLD)
    with pytest.raises(CheckpointError, match="written by 2 ranks; this run has 4") as err:
        load_sharded(str(a), 0, 4)
    assert "checkpoint_format='universal'" in str(err.value) and "consolidate" in str(err.value)  # how to go on


def test_format_1_folder_still_loads_with_a_warning(tmp_path):
    """What lightning_scale 0.1 wrote: files then meta.pt {world_size, version: 1}, no manifest."""
    path = tmp_path / "old.ckpt"
    path.mkdir()
    torch.save({"global_step": 5, "state_dict": {}}, path / "checkpoint.pt")
    for r in range(WORLD):
        torch.save({"optimizer_states": [{"r": r}]}, path / f"optim_rank{r}.pt")
    torch.save({"world_size": WORLD, "version": 1}, path / "meta.pt")
    with pytest.warns(UserWarning, match="format 1"):
        ckpt = load_sharded(str(path), 1, WORLD)
    assert ckpt["global_step"] == 5 and ckpt["optimizer_states"] == [{"r": 1}]


def test_remove_takes_staging_along(tmp_path, monkeypatch):
    path = tmp_path / "x.ckpt"
    _save(path, 1)
    _save(path, 2, crash_at="before_swap", monkeypatch=monkeypatch)
    remove_sharded(str(path))
    assert os.listdir(tmp_path) == []


def test_a_sharded_checkpoint_resumed_on_another_layout_of_the_same_world_size_is_refused(tmp_path):
    """Same world size, another grid (ep=2 vs dp=2, tp=2 vs dp=2): the per-rank files are cut for the grid they were
    written by; loading them elsewhere is refused by name, not left to a shape error deep in a load_state_dict."""
    from lightning_scale.strategies.checkpoint import LAYOUT_KEY

    path = tmp_path / "last.ckpt"
    _save(path, 1, extra={LAYOUT_KEY: {"dp": 1, "tp": 1, "ep": 2, "pp": 1, "sp": 1}})
    same = load_sharded(str(path), 0, WORLD, expect={"dp": 1, "tp": 1, "ep": 2, "pp": 1, "sp": 1})
    assert same["global_step"] == 1 and LAYOUT_KEY not in same
    with pytest.raises(CheckpointError, match=r"was cut for dp=1 x ep=2; this run is dp=2 \(the same 2 ranks"):
        load_sharded(str(path), 0, WORLD, expect={"dp": 2, "tp": 1, "ep": 1, "pp": 1, "sp": 1})
    old = tmp_path / "old.ckpt"  # written before the grid was recorded: loads as before
    _save(old, 1)
    assert load_sharded(str(old), 0, WORLD, expect={"dp": 2, "tp": 1, "ep": 1, "pp": 1, "sp": 1})["global_step"] == 1


def test_a_sharded_checkpoint_of_another_zero_stage_is_refused_by_name(tmp_path):
    """Stage 1 / 2 keep optimizer shards per rank, stage 3 the parameters too: a fit on another stage is refused by
    name before anything is loaded (it was a raw missing-keys RuntimeError from load_state_dict for 3 -> 2). Outside
    fit (validate / test) only the optimizer shards differ between stages 0-2, so only a change to or from stage 3 is
    refused there."""
    from lightning_scale.strategies.checkpoint import LAYOUT_KEY

    dp2 = {"dp": 2, "tp": 1, "ep": 1, "pp": 1, "sp": 1}
    path = tmp_path / "z2.ckpt"
    _save(path, 1, extra={LAYOUT_KEY: dict(dp2, stage=2)})
    assert load_sharded(str(path), 0, WORLD, expect=dict(dp2, stage=2))["global_step"] == 1
    for stage in (1, 3):
        with pytest.raises(CheckpointError, match=rf"was cut for dp=2, stage=2; this run is dp=2, stage={stage} "
                                                  rf"\(the same 2 ranks, another layout: stage 2 -> {stage}\)"):
            load_sharded(str(path), 0, WORLD, expect=dict(dp2, stage=stage))
    assert load_sharded(str(path), 0, WORLD, expect=dict(dp2, stage=1), fitting=False)["global_step"] == 1
    with pytest.raises(CheckpointError, match="stage 2 -> 3"):
        load_sharded(str(path), 0, WORLD, expect=dict(dp2, stage=3), fitting=False)
    with pytest.raises(CheckpointError, match=r"autotune=...\) picked this layout"):
        load_sharded(str(path), 0, WORLD, expect=dict(dp2, stage=3),
                     hint="Zero3DStrategy(autotune=...) picked this layout at this start")
    grid_only = tmp_path / "grid.ckpt"  # written before the stage was recorded: its stage is not compared
    _save(grid_only, 1, extra={LAYOUT_KEY: dp2})
    assert load_sharded(str(grid_only), 0, WORLD, expect=dict(dp2, stage=3))["global_step"] == 1


def test_a_stage3_checkpoint_cut_for_other_units_names_them():
    """The per-rank stage-3 shards are cut unit by unit: a resume with other `unit_modules` is refused with both unit
    lists (it said only "different model, units, param groups or data-parallel size"); the same units load."""
    from lightning_scale.models.gpt import GPT, gpt_tiny
    from lightning_scale.zero.param_shard import ShardedParameters

    def built(units=None):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(vocab_size=256, n_layer=2))
        sharded = ShardedParameters(model, [list(model.parameters())], device=torch.device("cpu"), unit_modules=units)
        sharded.shard_model()
        return sharded

    saved = built().shard_state_dict()
    built().load_shard_state_dict(saved)
    with pytest.raises(ValueError, match=r"its units are \[blocks\.0, blocks\.1, <root>\], this run's \[blocks\.0, "
                                         r"blocks\.1, lm_head, <root>\]; resume with the same configuration "
                                         r"\(zero\.unit_modules"):
        built(["Block", "lm_head"]).load_shard_state_dict(saved)


def test_a_zero2_optimizer_checkpoint_of_other_buckets_or_a_stage3_one_of_another_precision_says_which():
    """ZeRO 1 / 2 optimizer shards are cut bucket by bucket: another zero.bucket_mb is refused with both bucket lists
    and the setting to change (it said "stage=2, world_size=2 does not match this run (stage=2, world_size=2)"); a
    stage-3 checkpoint of another precision names the shard dtypes (it said "other buckets")."""
    from lightning_scale.models.gpt import GPT, gpt_tiny
    from lightning_scale.zero.optimizer import ZeroOptimizer
    from lightning_scale.zero.param_shard import ShardedParameters

    def engine(bucket_mb):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(vocab_size=256, n_layer=2))
        return ZeroOptimizer(torch.optim.AdamW(model.parameters()), stage=2, bucket_mb=bucket_mb,
                             route_user_calls=False)

    saved = engine(25.0).state_dict()
    engine(25.0).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"its flat buffers are 1 bucket of \[\d+\] elements \(torch.float32\), this "
                                         r"run's \d+ buckets of .*: resume with the same zero.bucket_mb"):
        engine(0.02).load_state_dict(saved)

    def sharded(dtype):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(vocab_size=256, n_layer=2))
        sp = ShardedParameters(model, [list(model.parameters())], device=torch.device("cpu"), param_dtype=dtype)
        sp.shard_model()
        return sp

    with pytest.raises(ValueError, match=r"its parameter shards are torch.bfloat16, this run's torch.float32 \(another "
                                         r"precision"):
        sharded(None).load_shard_state_dict(sharded(torch.bfloat16).shard_state_dict())
