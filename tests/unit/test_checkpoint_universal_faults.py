"""Faults on the universal (layout-free DCP) format: a save cut at any point leaves the previous checkpoint loadable.

In one process: the real save (``dcp_format.save``) and the real test hook (``LIGHTNING_SCALE_TEST_SAVE_FAULT``,
parsed and counted by ``folder.fault_point``) with its SIGKILL replaced by an exception, so the disk is exactly what
a kill at that point leaves: for an overwrite of ``last.ckpt`` (the data-loss case of issue 13) and for a new folder,
at every point, on the atomic swap and on the two-rename fallback. Then on 2 gloo ranks with the hook's real SIGKILL
of every rank in the middle of overwriting a checkpoint. A truncated, deleted or foreign file raises a
CheckpointError that names it.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lightning_scale.checkpoint import dcp_format, folder
from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.checkpoint.layout import flat_piece, tensor_piece
from lightning_scale.testing import DistributedTestError, run_distributed

SHAPES = {"w": (6, 4), "b": (4,)}
POINTS = ["after_rank_file", "before_swap", "between_renames", "after_swap"]


class Killed(Exception):
    pass


def _pieces(step, rank=0, world=1):
    """Every tensor holds ``step``: a mix of two saves shows as two values. rank r of ``world``: a flat shard."""
    out = []
    for k, s in SHAPES.items():
        n = torch.Size(s).numel()
        lo, hi = rank * n // world, (rank + 1) * n // world
        out.append(flat_piece(f"model/{k}", torch.full((hi - lo,), float(step)), s, lo))
    out.append(tensor_piece("optim/w/step", torch.tensor(float(step))))
    return out


def _save(path, step, **kw):
    dcp_format.save(str(path), _pieces(step), {"lightning": {"global_step": step}}, meta={"step": step}, **kw)


def _load(path):
    """(step in the manifest, every value read) from a whole-tensor load in this process."""
    dest = [tensor_piece(f"model/{k}", torch.full(s, -1.0)) for k, s in SHAPES.items()]
    dest.append(tensor_piece("optim/w/step", torch.tensor(-1.0)))
    res = dcp_format.load(str(path), dest, extra_keys=["lightning"])
    values = {float(v) for p in dest for t in p.tensors for v in t.reshape(-1)}
    assert res.extras["extra/lightning"]["global_step"] == res.meta["step"]
    return res.meta["step"], values


@pytest.fixture
def hook(monkeypatch):
    """LIGHTNING_SCALE_TEST_SAVE_FAULT=<spec> with the SIGKILL turned into ``Killed``."""
    def arm(spec):
        folder._saves_seen.clear()
        monkeypatch.setenv("LIGHTNING_SCALE_TEST_SAVE_FAULT", spec)
        monkeypatch.setattr(folder.os, "killpg", lambda *a: (_ for _ in ()).throw(Killed(spec)))
    yield arm
    folder._saves_seen.clear()


CUTS = [(p, False) for p in POINTS if p != "between_renames"] + [(p, True) for p in POINTS]  # renameat2 / fallback


@pytest.mark.parametrize("point,fallback", CUTS, ids=[f"{p}-{'two_renames' if f else 'renameat2'}" for p, f in CUTS])
def test_overwrite_cut_at_any_point_loads_one_whole_step(tmp_path, hook, monkeypatch, point, fallback):
    if fallback:
        monkeypatch.setattr(folder, "_exchange", lambda a, b: False)
    last = tmp_path / "last.ckpt"
    hook(f"{point}@2")  # the second save in this process is cut
    _save(last, 2)
    with pytest.raises(Killed):
        _save(last, 4)
    with pytest.warns(UserWarning, match="interrupted while swapping") if point == "between_renames" else \
            _no_warning():
        step, values = _load(last)
    # before the swap: the old checkpoint, whole; after it - or between the fallback's two renames, where the newest
    # complete folder beside the missing target is found by its manifest - the new one, whole; never a mix
    assert (step, values) == ((4, {4.0}) if point in ("after_swap", "between_renames") else (2, {2.0}))
    monkeypatch.delenv("LIGHTNING_SCALE_TEST_SAVE_FAULT")
    _save(last, 6)  # the next save completes and tidies up what the cut one left
    assert _load(last) == (6, {6.0})
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    return ctx()


@pytest.mark.parametrize("point", ["after_rank_file", "before_swap"])
def test_new_folder_cut_before_the_swap_is_absent_and_named(tmp_path, hook, point):
    hook(f"{point}@1")
    path = tmp_path / "epoch=0-step=2.ckpt"
    with pytest.raises(Killed):
        _save(path, 2)
    assert not path.exists() and [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    with pytest.raises(CheckpointError, match="is not a checkpoint folder"):
        _load(path)


def test_truncated_deleted_and_foreign_files_are_named(tmp_path):
    good = tmp_path / "good.ckpt"
    _save(good, 2)
    other = tmp_path / "other.ckpt"
    _save(other, 3)
    cases = {n: tmp_path / n for n in ("data", "metadata", "manifest", "deleted", "foreign")}
    for p in cases.values():
        shutil.copytree(good, p)
    for name, target in (("data", "__0_0.distcp"), ("metadata", ".metadata"), ("manifest", folder.MANIFEST)):
        f = cases[name] / target
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    os.remove(cases["deleted"] / "__0_0.distcp")
    shutil.copy(other / "__0_0.distcp", cases["foreign"] / "__0_0.distcp")  # same size, another save's bytes
    expect = {"data": r"__0_0\.distcp is truncated or corrupt", "metadata": r"\.metadata is truncated or corrupt",
              "manifest": r"meta\.pt is truncated or corrupt", "deleted": r"__0_0\.distcp is missing",
              "foreign": r"__0_0\.distcp is corrupt or from another save"}
    for name, pattern in expect.items():
        with pytest.raises(CheckpointError, match=pattern):
            _load(cases[name])
    assert _load(good) == (2, {2.0})


# ------------------------------------------------------------------------------------------------ 2 ranks, SIGKILL
def _overwrite_worker(rank, world, path):
    """Save step 2, then overwrite it with step 4: the hook SIGKILLs every rank during the second save."""
    dcp_format.save(path, _pieces(2, rank, world), {"lightning": {"global_step": 2}}, meta={"step": 2})
    dcp_format.save(path, _pieces(4, rank, world), {"lightning": {"global_step": 4}}, meta={"step": 4})
    return "the second save was not cut"


@pytest.mark.timeout(120)
def test_every_rank_killed_while_overwriting_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "last.ckpt")
    # rank 0 is killed before the swap (every file and the manifest written), rank 1 while it waits for it
    with pytest.raises(DistributedTestError):
        run_distributed(_overwrite_worker, 2, args=(path,), timeout=90,
                        env={"LIGHTNING_SCALE_TEST_SAVE_FAULT": "before_swap@2:0"})
    staged = [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
    assert len(staged) == 1 and folder.MANIFEST in os.listdir(tmp_path / staged[0])  # the new save was complete
    _, meta, _ = dcp_format.open_checkpoint(path)
    assert meta["world_size"] == 2 and sorted(n for n in meta["files"] if n.endswith(".distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]
    assert _load(path) == (2, {2.0})


def test_a_checkpoint_of_a_newer_format_is_refused_by_name(tmp_path):
    """A folder written by a newer lightning_scale (its manifest's format_version above ours) raises before any read,
    naming both versions, instead of failing somewhere in the read with a misleading 'corrupt'."""
    path = tmp_path / "step=3.ckpt"
    _save(path, 3)
    assert _load(path) == (3, {3.0})
    manifest = path / folder.MANIFEST
    meta = torch.load(manifest, weights_only=False)
    assert meta["format_version"] == dcp_format.FORMAT_VERSION
    meta["format_version"] = dcp_format.FORMAT_VERSION + 1
    torch.save(meta, manifest)
    with pytest.raises(CheckpointError, match=f"checkpoint format {dcp_format.FORMAT_VERSION + 1}, newer than "
                                              f"this lightning_scale reads \\(up to {dcp_format.FORMAT_VERSION}\\)"):
        _load(path)
