"""Checkpoint folders that are complete or absent: staged writes, a checksummed manifest, an atomic swap.

A save never writes into the folder it replaces. Every rank writes its files into a fresh staging
folder beside the target (``.<name>.<token>.partial``: hidden, so Lightning's ``last`` lookup and
``save_top_k`` bookkeeping never see it). Rank 0 then writes the manifest ``meta.pt`` last (each file's
size and CRC32, the save's token, the world size) and swaps the staging folder into place:

- Linux: one ``renameat2(RENAME_EXCHANGE)``, atomic, so the target is always either the old complete
  folder or the new complete folder;
- elsewhere (or a file system without it): ``target -> .<name>.<token>.old``, ``staging -> target``;
  a crash between the two renames leaves no target, and :func:`resolve` then finds the complete
  staging (or ``.old``) folder by its manifest.

Loading checks the manifest before anything is read: a missing, truncated or altered file raises a
:class:`CheckpointError` that names it. A crash at any moment of a save therefore leaves the previous
good checkpoint loadable, never a mix of two steps (a folder overwritten in place, file by file, could
hold rank 0's new shard next to rank 1's old one and load silently).

Folders of format 1 (``meta.pt`` without a manifest: written by lightning_scale 0.1 before this module)
still load, unverified, with a warning.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import signal
import time
import uuid
import warnings
import zlib
from typing import Any, Dict, Iterable, Optional

import torch

FORMAT_VERSION = 2
MANIFEST = "meta.pt"
_CHUNK = 8 << 20
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class CheckpointError(RuntimeError):
    """A checkpoint folder that is incomplete, truncated, altered or from another save; names the file."""


# ----------------------------------------------------------------------------------------------- names
def new_token() -> str:
    return uuid.uuid4().hex


def staging_path(path: str, token: str) -> str:
    head, name = os.path.split(os.path.normpath(path))
    return os.path.join(head, f".{name}.{token[:16]}.partial")


def _old_path(path: str, token: str) -> str:
    head, name = os.path.split(os.path.normpath(path))
    return os.path.join(head, f".{name}.{token[:16]}.old")


def _siblings(path: str, kind: str) -> Iterable[str]:
    head, name = os.path.split(os.path.normpath(path))
    return glob.glob(os.path.join(glob.escape(head or "."), f".{glob.escape(name)}.*.{kind}"))


# ----------------------------------------------------------------------------------------------- write
class _ChecksumWriter:
    """A file object that counts bytes and CRC32 as torch.save writes them (no second read)."""

    def __init__(self, f) -> None:
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_file(folder: str, name: str, obj: Any) -> Dict[str, int]:
    """torch.save ``obj`` to ``folder/name``, fsync'ed; returns its manifest record ``{size, crc32}``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        writer = _ChecksumWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    return {"size": writer.size, "crc32": writer.crc}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two existing paths (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def commit(path: str, token: str, files: Dict[str, Dict[str, int]], **meta: Any) -> None:
    """Rank 0, after every rank wrote its files into ``staging_path(path, token)``: write the manifest last,
    then swap the staging folder into place and remove the replaced one and stale partial saves."""
    staging = staging_path(path, token)
    manifest = {"version": FORMAT_VERSION, "token": token, "files": dict(files), "created": time.time(), **meta}
    record = write_file(staging, MANIFEST, manifest)
    _write_summary(staging, record)
    _fsync_dir(staging)
    fault_point("before_swap")
    replaced = None
    if os.path.lexists(path):
        if _exchange(staging, path):
            replaced = staging  # now holds the old folder
        else:
            replaced = _old_path(path, token)
            os.rename(path, replaced)
            fault_point("between_renames")
            os.rename(staging, path)
    else:
        os.rename(staging, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    fault_point("after_swap")
    if replaced is not None:
        _remove(replaced)
    for stale in list(_siblings(path, "partial")) + list(_siblings(path, "old")):
        _remove(stale)  # left by a save killed earlier (this one is committed, so they are not needed)


def _write_summary(staging: str, manifest_record: Dict[str, int]) -> None:
    """``summary.json``: what ``python -m lightning_scale.checkpoint inspect`` prints, read later without torch. Not
    part of the save's contract: a failure here warns, and ``inspect`` falls back to reading the folder with torch."""
    from lightning_scale.checkpoint import cli

    try:
        cli.write_summary(staging, manifest_record)
    except Exception as exc:  # noqa: BLE001 - never fail a save over the CLI's cache
        warnings.warn(f"{staging}: {cli.SUMMARY} not written ({type(exc).__name__}: {exc}); inspect will read the "
                      "checkpoint with torch")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def remove(path: str) -> None:
    """Delete a checkpoint folder (``save_top_k`` removal) and any staging left beside it."""
    _remove(path)
    for stale in list(_siblings(path, "partial")) + list(_siblings(path, "old")):
        _remove(stale)


# ----------------------------------------------------------------------------------------------- read
def read_manifest(path: str) -> Dict[str, Any]:
    """The manifest of a complete folder; raises CheckpointError naming what is missing or unreadable."""
    meta_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint folder")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{path} is not a complete lightning_scale sharded checkpoint (no {MANIFEST}: "
                              "the save that wrote it did not finish)")
    try:
        meta = torch.load(meta_path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad manifest
        raise CheckpointError(f"{meta_path} is truncated or corrupt ({type(exc).__name__}: {exc})") from exc
    if not isinstance(meta, dict) or "world_size" not in meta:
        raise CheckpointError(f"{meta_path} is not a lightning_scale checkpoint manifest")
    return meta


def verify(path: str, meta: Dict[str, Any], checksum: Iterable[str] = ()) -> None:
    """Every file the manifest lists exists with its recorded size; files in ``checksum`` match their CRC32."""
    files = meta.get("files")
    if files is None:
        return  # format 1: nothing recorded
    for name, rec in sorted(files.items()):
        full = os.path.join(path, name)
        if not os.path.exists(full):
            raise CheckpointError(f"{full} is missing (listed in {os.path.join(path, MANIFEST)})")
        size = os.path.getsize(full)
        if size != rec["size"]:
            raise CheckpointError(f"{full} is truncated or corrupt: {size} bytes, the manifest records {rec['size']}")
    for name in checksum:
        if name not in files:
            raise CheckpointError(f"{os.path.join(path, name)} is not part of this checkpoint "
                                  f"(not in {os.path.join(path, MANIFEST)}; the manifest lists {sorted(files)})")
        if _crc32(os.path.join(path, name)) != files[name]["crc32"]:
            raise CheckpointError(f"{os.path.join(path, name)} is corrupt or from another save: its checksum does "
                                  f"not match {os.path.join(path, MANIFEST)}")


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def load_file(path: str, name: str, meta: Dict[str, Any]) -> Any:
    """torch.load ``path/name`` after checking its size and checksum against the manifest."""
    files = meta.get("files")
    full = os.path.join(path, name)
    if files is not None:
        if name not in files:
            raise CheckpointError(f"{full} is not part of this checkpoint (not in {os.path.join(path, MANIFEST)}, "
                                  f"which lists {sorted(files)})")
        verify(path, {"files": {name: files[name]}}, checksum=(name,))
    elif not os.path.exists(full):
        raise CheckpointError(f"{full} is missing")
    try:
        return torch.load(full, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{full} is truncated or corrupt ({type(exc).__name__}: {exc})") from exc


def resolve(path: str) -> str:
    """The folder to load for ``path``: itself when it exists, else the complete save that a crash between
    the two renames of a non-atomic swap left beside it (newest manifest first). Read-only: the next
    save's commit tidies up."""
    if os.path.lexists(path) or not list(_siblings(path, "old")):
        return path  # no ".old": no swap was under way (a new folder that never got into place is absent)
    found = []
    for cand in list(_siblings(path, "partial")) + list(_siblings(path, "old")):
        try:
            meta = read_manifest(cand)
            verify(cand, meta)
        except CheckpointError:
            continue
        found.append((meta.get("created", 0.0), cand))
    if found:
        chosen = max(found)[1]
        warnings.warn(f"{path} is missing: a save was interrupted while swapping folders; loading the complete "
                      f"save {chosen}")
        return chosen
    return path


def warn_unverified(path: str, meta: Dict[str, Any]) -> None:
    if "files" not in meta:
        warnings.warn(f"{path} was written by checkpoint format {meta.get('version', 1)} (no manifest): "
                      "its completeness cannot be verified")


# ----------------------------------------------------------------------------------------------- test hook
_saves_seen: Dict[str, int] = {}


def fault_point(point: str, rank: Optional[int] = None) -> None:
    """Test hook: ``LIGHTNING_SCALE_TEST_SAVE_FAULT=POINT@N[:RANK]`` SIGKILLs this process's whole process
    group at ``POINT`` of the N-th save in this process (on RANK only, when given): the fault-injection
    tests use it to kill every rank mid-save. Points: ``after_rank_file``, ``before_swap``,
    ``between_renames`` (the non-atomic fallback only), ``after_swap``. Start the job in its own session."""
    spec = os.environ.get("LIGHTNING_SCALE_TEST_SAVE_FAULT")
    if not spec:
        return
    where, _, rest = spec.partition("@")
    count, _, only_rank = rest.partition(":")
    if point == "after_rank_file":  # every save passes it first: counted once per save, whatever POINT is armed
        _saves_seen[point] = _saves_seen.get(point, 0) + 1
    if where != point:
        return
    seen = _saves_seen.get("after_rank_file", 0)
    if seen != int(count or 1) or (only_rank and rank is not None and int(only_rank) != rank):
        return
    os.killpg(os.getpgrp(), signal.SIGKILL)
