"""The layout-free checkpoint format: :class:`~.layout.Piece` objects saved and loaded with torch.distributed.checkpoint.

Every rank writes only its own chunks, keyed by the original model's names and global shapes (:mod:`.layout`),
and on load every rank asks for the chunks of *its* new layout; DCP's resharding works out, for any overlap
pattern, which saved chunks (storage items) each request needs, and each rank reads only those items.

Keys: ``model/<fqn>``, ``optim/<fqn>/<state>`` (``exp_avg``, ``exp_avg_sq``, any state tensor with the parameter's
shape), ``optim/<fqn>/step`` (0-d), ``master/<fqn>`` (fp32 masters where they exist) and ``extra/<name>`` (small
python objects - loop state, loss scaler, lr schedulers - written by rank 0 as DCP byte items).

How the chunks reach DCP: a custom :class:`SavePlanner` / :class:`LoadPlanner` pair (subclasses of DCP's default
ones) that emit one ``WriteItem`` / ``ReadItem`` per chunk with its ``ChunkStorageMetadata``; DCP's own storage
(FileSystemWriter / Reader), metadata, plan dedup (replicated chunks are written once), global-plan validation
(chunks in bounds, not overlapping, covering every tensor) and resharding (``create_read_items_for_chunk_list``)
do the rest. Not ShardedTensor local shards: building one ShardedTensor per key runs a collective per tensor to
agree on the global shard metadata (``init_from_local_shards``; ~3k collectives for a 24-layer model's parameters
and Adam states) and ShardedTensor is deprecated in favour of DTensor, while DTensor can only express even
(``Shard``) placements on a mesh, not the ragged flat ranges of a ZeRO shard. The planners need no collective
beyond DCP's own plan gather/scatter. ``dcp_to_torch_save`` reads the result like any DCP checkpoint.

Granularity of reads: DCP reads a whole storage item (one saved chunk) per request and narrows it, so a rank reads
the saved chunks that overlap its own (never a whole file) and holds at most one of them beyond its own pieces.

On top of DCP, the folder is made complete-or-absent as :mod:`.folder` does: written into a hidden staging sibling,
then rank 0 writes the manifest ``meta.pt`` last - every file's size and CRC32 plus a CRC32 of every storage item -
and swaps the folder into place. Loading checks every file's size, the ``.metadata`` checksum and, before it is
deserialized, each item's checksum: a truncated, deleted or foreign file raises a CheckpointError naming it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import os
import warnings
import zlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)
from torch.futures import Future

from lightning_scale.checkpoint import folder
from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.checkpoint.layout import Chunk, Piece

FORMAT = "lightning_scale.dcp"
FORMAT_VERSION = 3
DCP_METADATA = ".metadata"
_BLOCK = 1 << 20


# ----------------------------------------------------------------------------------------------- planners
def _chunk_md(chunk: Chunk) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))


class PieceSavePlanner(DefaultSavePlanner):
    """One SHARD write item per chunk of every piece; ``extras`` as byte items (pass them on one rank only)."""

    def __init__(self, pieces: Iterable[Piece], extras: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = list(pieces)
        self.extras = dict(extras or {})
        self._data: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.pieces:
            props = TensorProperties(dtype=p.dtype)
            for chunk, t in zip(p.chunks, p.tensors):
                if chunk.numel == 0:
                    continue
                self._data[(p.key, chunk.offsets)] = t
                items.append(WriteItem(index=MetadataIndex(p.key, chunk.offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=_chunk_md(chunk), properties=props,
                                                                   size=torch.Size(p.global_shape))))
        for key in self.extras:
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: List[SavePlan]):
        seen: Dict[MetadataIndex, Tuple[int, Any]] = {}
        for rank, plan in enumerate(all_plans):  # dedup keeps one of equal (key, offsets): they must be equal chunks
            for item in plan.items:
                sizes = item.tensor_data.chunk.sizes if item.tensor_data else None
                other = seen.setdefault(item.index, (rank, sizes))
                if other[1] != sizes:
                    raise CheckpointError(f"{item.index.fqn}: ranks {other[0]} and {rank} hold different chunks at "
                                          f"offset {tuple(item.index.offset or ())} ({other[1]} vs {sizes})")
        return super().create_global_plan(all_plans)

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return self.transform_object(write_item, self.extras[write_item.index.fqn])
        return _exact_storage(self._data[(write_item.index.fqn, tuple(write_item.index.offset))])


def _exact_storage(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor whose storage is exactly its bytes. DCP's writer clones a view of a larger
    storage (a chunk of a flat ZeRO buffer) and keeps every clone of a file alive until the file is written (its
    ``tensor_dict``, kept for the safetensors format): measured, a rank's whole shard again (35.8 MiB for a 35.9 MiB
    shard). An alias needs no clone; the pieces outlive the save."""
    if not (t.is_cpu and t.is_contiguous() and t.numel()) or t.untyped_storage().nbytes() == t.nbytes:
        return t
    buf = (ctypes.c_byte * t.nbytes).from_address(t.data_ptr())
    return torch.frombuffer(buf, dtype=t.dtype).view(t.shape)


class PieceLoadPlanner(DefaultLoadPlanner):
    """Read items for every chunk of every destination piece (DCP's resharding), byte items for ``extra_keys``."""

    def __init__(self, pieces: Iterable[Piece], extra_keys: Iterable[str] = ()) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = [p for p in pieces]
        self.extra_keys = list(extra_keys)
        self.extras: Dict[str, Any] = {}
        self._dest: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items: List[ReadItem] = []
        for p in self.pieces:
            chunks = [(c, t) for c, t in zip(p.chunks, p.tensors) if c.numel]
            for c, t in chunks:
                self._dest[(p.key, c.offsets)] = t
            if chunks:
                items += create_read_items_for_chunk_list(p.key, md[p.key], [_chunk_md(c) for c, _ in chunks])
        for key in self.extra_keys:
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        self.extras[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self._dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)  # the overlap of one saved chunk with this destination chunk
        return t


class VerifiedReader(FileSystemReader):
    """DCP's FileSystemReader with its ``read_data`` rewritten for bounded memory and verified bytes.

    Each storage item's CRC32 (from the manifest) is checked before it is deserialized; items are read in file
    order, one at a time, and the one loaded is reused by the following requests for the same item. Measured on a
    row-sliced load of 8 MiB saved chunks, DCP's own loop peaks at 3 chunks (its load stream is not seekable, so it
    copies the item into a BytesIO, and the previous item is still referenced while the next loads); this one at 1.
    """

    def __init__(self, path: str, items: Dict[str, Dict[int, Tuple[int, int]]]) -> None:
        super().__init__(path)
        self._items = items
        self._root = path

    def _check(self, f, sinfo) -> None:
        full = os.path.join(self._root, sinfo.relative_path)
        rec = self._items.get(sinfo.relative_path, {}).get(int(sinfo.offset))
        if rec is None or rec[0] != sinfo.length:
            raise CheckpointError(f"{full}: bytes [{sinfo.offset}, {sinfo.offset + sinfo.length}) are not recorded "
                                  f"in {os.path.join(self._root, folder.MANIFEST)} (a file from another save?)")
        if getattr(sinfo, "transform_descriptors", None):
            raise CheckpointError(f"{full}: stream transforms {sinfo.transform_descriptors} are not supported")
        f.seek(sinfo.offset)
        if _crc_stream(f, sinfo.length) != rec[1]:
            raise CheckpointError(f"{full} is corrupt or from another save: bytes [{sinfo.offset}, "
                                  f"{sinfo.offset + sinfo.length}) do not match the checksum in "
                                  f"{os.path.join(self._root, folder.MANIFEST)}")

    def _copy(self, req: ReadItem, item: torch.Tensor, planner, name: str) -> None:
        src = item  # locals of a call: nothing refers to the item once the next one loads
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            src = src.narrow(dim, start, length)
        dst = planner.resolve_tensor(req).detach()
        if dst.shape != src.shape:
            raise CheckpointError(f"{os.path.join(self._root, name)}: item {req.storage_index.fqn} gives "
                                  f"{tuple(src.shape)} for a request of {tuple(dst.shape)}")
        dst.copy_(src)
        planner.commit_tensor(req, dst)

    def read_data(self, plan: LoadPlan, planner) -> Future:
        per_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, reqs in sorted(per_file.items()):
            with open(os.path.join(self._root, name), "rb") as f:
                cached: Tuple[Any, Optional[torch.Tensor]] = (None, None)
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    sinfo = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO:
                        self._check(f, sinfo)
                        f.seek(sinfo.offset)
                        planner.load_bytes(req, io.BytesIO(f.read(sinfo.length)))
                        continue
                    if cached[0] != req.storage_index:
                        cached = (None, None)  # drop the previous item before loading the next
                        self._check(f, sinfo)
                        cached = (req.storage_index, torch.load(_Window(f, sinfo.offset, sinfo.length),
                                                                map_location="cpu", weights_only=True))
                    self._copy(req, cached[1], planner, name)
        fut: Future = Future()
        fut.set_result(None)
        return fut


class _Window(io.IOBase):
    """The bytes ``[offset, offset + length)`` of an open file as a seekable stream (what torch.load needs); reads
    go straight to the file (no intermediate buffer: a RawIOBase would copy each record once more)."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length = f, offset, length
        f.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        target = {0: self.offset + pos, 1: self.f.tell() + pos, 2: self.offset + self.length + pos}[whence]
        return self.f.seek(target) - self.offset

    def tell(self) -> int:
        return self.f.tell() - self.offset

    def _left(self) -> int:
        return max(0, self.length - self.tell())

    def readinto(self, b) -> int:
        n = min(len(b), self._left())
        return self.f.readinto(memoryview(b)[:n]) if n else 0

    def read(self, size: int = -1) -> bytes:
        n = self._left() if size is None or size < 0 else min(size, self._left())
        return self.f.read(n)


def _crc_stream(f, length: int) -> int:
    """CRC32 of the next ``length`` bytes of ``f`` through one reused 1 MiB buffer (-1 when the file is shorter)."""
    crc, left = 0, length
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    while left > 0:
        n = f.readinto(view[:min(_BLOCK, left)])
        if not n:
            return -1
        crc = zlib.crc32(view[:n], crc)
        left -= n
    return crc


# ----------------------------------------------------------------------------------------------- collectives
def _rank_world(group) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process call that it assumes one process: that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _broadcast(obj: Any, group) -> Any:
    if _rank_world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _all_gather(obj: Any, group) -> List[Any]:
    world = _rank_world(group)[1]
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _unwrap(exc: CheckpointException) -> BaseException:
    """DCP gathers every rank's exception into one; re-raise ours (it names the file) when there is one."""
    for err, _ in exc.failures.values():
        if isinstance(err, CheckpointError):
            return err
    return exc


# ----------------------------------------------------------------------------------------------- save
def _file_records(staging: str, md: Metadata, rank: int, with_metadata: bool):
    """Size + CRC32 of this rank's files and a CRC32 of each of its storage items (read back from the page cache)."""
    prefix = f"__{rank}_"
    spans: Dict[str, List[Tuple[int, int]]] = {}
    for info in md.storage_data.values():
        if info.relative_path.startswith(prefix):
            spans.setdefault(info.relative_path, []).append((int(info.offset), int(info.length)))
    names = {n for n in os.listdir(staging) if n.startswith(prefix)} | set(spans)
    if with_metadata:
        names.add(DCP_METADATA)
    files, items = {}, {}
    for name in sorted(names):
        full = os.path.join(staging, name)
        with open(full, "rb") as f:
            files[name] = {"size": os.path.getsize(full), "crc32": _crc_stream(f, os.path.getsize(full))}
            items[name] = {}
            for offset, length in sorted(spans.get(name, ())):
                f.seek(offset)
                items[name][offset] = (length, _crc_stream(f, length))
    return files, items


def save(path: str, pieces: Iterable[Piece], extras: Optional[Dict[str, Any]] = None, *, group=None,
         meta: Optional[Dict[str, Any]] = None, thread_count: int = 1) -> None:
    """Collective over ``group``: write every rank's pieces (and rank 0's ``extras``) to the folder ``path``.

    ``path`` appears complete or not at all: ranks write into a hidden staging sibling, rank 0 writes the manifest
    last and swaps the folder in (the folder it replaces stays loadable until then). ``meta`` (step, layout, ...)
    is recorded in the manifest for ``inspect``."""
    rank, world = _rank_world(group)
    token = _broadcast(folder.new_token() if rank == 0 else None, group)
    staging = folder.staging_path(path, token)
    extras = {(k if k.startswith("extra/") else f"extra/{k}"): v for k, v in (extras or {}).items()} if rank == 0 else {}
    planner = PieceSavePlanner(pieces, extras)
    try:
        with _single_process_quiet():
            md = dcp.save({}, storage_writer=FileSystemWriter(staging, thread_count=thread_count), planner=planner,
                          process_group=group, no_dist=_no_dist())
    except CheckpointException as exc:
        raise _unwrap(exc) from exc
    folder.fault_point("after_rank_file", rank)
    every = _all_gather(_file_records(staging, md, rank, with_metadata=rank == 0), group)
    if rank == 0:
        files, items = {}, {}
        for f, i in every:
            files.update(f)
            items.update(i)
        folder.commit(path, token, files, **{**(meta or {}), "world_size": world, "format": FORMAT,
                                             "format_version": FORMAT_VERSION, "items": items})
    _broadcast(None, group)  # nobody returns (and loads or removes it) before the folder is in place


# ----------------------------------------------------------------------------------------------- load
def detect_format(path: str) -> str:
    """``"dcp"`` (this module), ``"sharded"`` (folder.py format 2 / 1: per-rank files of one layout); raises a
    CheckpointError for anything else (a partial folder, a file, a foreign manifest)."""
    meta = folder.read_manifest(path)
    if meta.get("format") == FORMAT:
        return "dcp"
    if os.path.exists(os.path.join(path, DCP_METADATA)):
        raise CheckpointError(f"{os.path.join(path, folder.MANIFEST)} is not the manifest of the DCP checkpoint "
                              f"beside it (format {meta.get('format')!r}; expected {FORMAT!r})")
    return "sharded"


def open_checkpoint(path: str) -> Tuple[str, Dict[str, Any], Metadata]:
    """Resolve, check (every file's size, the ``.metadata`` checksum) and read a DCP checkpoint folder."""
    path = folder.resolve(path)
    if detect_format(path) != "dcp":
        raise CheckpointError(
            f"{path} is a lightning_scale sharded checkpoint of checkpoint format "
            f"{folder.read_manifest(path).get('version', 1)} (per-rank files of one fixed layout), not the "
            f"layout-free format: load it with lightning_scale.strategies.checkpoint.load_sharded on the layout "
            f"that wrote it, or consolidate it (python -m lightning_scale.checkpoint consolidate {path} OUT.pt)")
    meta = folder.read_manifest(path)
    folder.verify(path, meta, checksum=(DCP_METADATA,))
    return path, meta, FileSystemReader(path).read_metadata()


def check_pieces(path: str, md: Metadata, pieces: Sequence[Piece], extra_keys: Sequence[str], strict: bool):
    """The keys this rank asks for that the checkpoint lacks; errors for shape mismatches / uncovered chunks."""
    missing = []
    sd = md.state_dict_metadata
    for p in pieces:
        tmd = sd.get(p.key)
        if tmd is None:
            missing.append(p.key)
            continue
        if not isinstance(tmd, TensorStorageMetadata) or tuple(tmd.size) != p.global_shape:
            got = tuple(tmd.size) if isinstance(tmd, TensorStorageMetadata) else "an object"
            raise CheckpointError(f"{path}: {p.key} has shape {got} in the checkpoint, this model needs "
                                  f"{p.global_shape}")
        for c in p.chunks:
            covered = sum(_overlap(c, s) for s in tmd.chunks)
            if covered != c.numel:
                raise CheckpointError(f"{path}: {p.key} region {c} is only {covered}/{c.numel} covered by the "
                                      "saved chunks")
    missing += [k for k in extra_keys if not isinstance(sd.get(k), BytesStorageMetadata)]
    if strict and missing:
        raise CheckpointError(f"{path} has no {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                              f"({len(missing)} keys missing; it holds {len(sd)})")
    return missing


def _overlap(c: Chunk, s: ChunkStorageMetadata) -> int:
    vol = 1
    for o, n, so, sn in zip(c.offsets, c.sizes, s.offsets, s.sizes):
        vol *= max(0, min(o + n, so + sn) - max(o, so))
    return vol


@dataclasses.dataclass
class LoadResult:
    extras: Dict[str, Any]
    missing: List[str]
    meta: Dict[str, Any]


def load(path: str, pieces: Iterable[Piece], *, extra_keys: Iterable[str] = (), group=None,
         strict: bool = True) -> LoadResult:
    """Collective over ``group``: fill every rank's destination pieces in place from the checkpoint at ``path``
    (any layout wrote it). ``strict=False`` skips keys the checkpoint lacks and returns them in ``missing`` (the
    caller decides: e.g. masters re-derived from the weights). Padding rows are zero-filled. Bad checkpoints raise a
    CheckpointError naming the file, on every rank."""
    pieces = list(pieces)
    extra_keys = [k if k.startswith("extra/") else f"extra/{k}" for k in extra_keys]
    error = None
    try:
        path, meta, md = open_checkpoint(path)
        missing = check_pieces(path, md, pieces, extra_keys, strict)
    except CheckpointError as exc:
        error = exc
    errors = [e for e in _all_gather(None if error is None else str(error), group) if e]
    if errors:  # every rank raises, none waits in DCP's collectives for a rank that already failed
        raise error if error is not None else CheckpointError(errors[0])
    have = set(md.state_dict_metadata)
    planner = PieceLoadPlanner([p for p in pieces if p.key in have], [k for k in extra_keys if k in have])
    try:
        with _single_process_quiet():
            dcp.load({}, storage_reader=VerifiedReader(path, meta["items"]), planner=planner, process_group=group,
                     no_dist=_no_dist())
    except CheckpointException as exc:
        raise _unwrap(exc) from exc
    for p in pieces:
        if p.key in have:
            p.zero_padding_()
    return LoadResult(planner.extras, missing, meta)


def read_local(path: str, meta: Dict[str, Any], md: Metadata, pieces: Sequence[Piece],
               extra_keys: Sequence[str] = ()) -> Dict[str, Any]:
    """One process, no collectives: fill ``pieces`` (checked against ``md``) through DCP's planner / storage API.
    For streaming tools (consolidate, export-hf) that read one tensor at a time with the metadata read once."""
    planner = PieceLoadPlanner(pieces, extra_keys)
    reader = VerifiedReader(path, meta["items"])
    reader.set_up_storage_reader(md, is_coordinator=True)
    planner.set_up_planner({}, md, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    reader.read_data(plan, planner).wait()
    for p in pieces:
        p.zero_padding_()
    return planner.extras
