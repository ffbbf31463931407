"""Hugging Face safetensors in and out, streaming: no rank ever holds the whole model.

In: a local directory with ``model.safetensors`` or a sharded ``model.safetensors.index.json``, or a litgpt checkpoint
directory (``lit_model.pth``: a ``torch.save``d state dict, or ``{"model": state dict}`` as litgpt's fine-tuning
scripts save it). :class:`HFCheckpoint` maps each tensor to its file and reads rectangular regions with
``safe_open(...).get_slice`` (a tp slice, the chunks of a ZeRO flat shard, one pipeline stage's tensors: only those
bytes are read); ``lit_model.pth`` is opened with ``torch.load(mmap=True, weights_only=True)``, so its tensors are
views of the mapped file and a region read touches only that region's pages.
:func:`load_hf_weights_` fills a module's parameters and persistent buffers in place, tensor by tensor (meta tensors
are allocated first; non-persistent meta buffers such as ``rotary_emb.inv_freq`` are recomputed by the model's own
init); :func:`load_hf_pieces_` fills :class:`~.layout.Piece` destinations (what a parallelized rank holds) region by
region; :func:`read_region` is the low-level read.

Names: a model key is looked up as given, then through ``rename``, then with the usual prefixes added or removed
(``transformer.`` for GPT-2 checkpoints saved from ``GPT2Model``, ``model.``, ``language_model.`` for the text
model inside a multimodal checkpoint, e.g. Llama 4's), and a tied output head
(``lm_head.weight``) absent from the file is read from the input embedding. Values are converted to the
destination's dtype.

Out: :func:`export_hf` writes ``(name, tensor)`` pairs as sharded safetensors (``model-0000i-of-0000N``) + the index +
``config.json``, holding at most one shard's tensors; :func:`export_hf_from_checkpoint` streams a layout-free
checkpoint folder (:mod:`.dcp_format`) into it, one tensor at a time, and with several ranks each rank writes its
share of the shards (no gather). The output directory appears complete or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
)

import torch
from torch import nn

from lightning_scale.checkpoint.folder import CheckpointError
from lightning_scale.checkpoint.hf_conversions import fuse, renamed
from lightning_scale.checkpoint.layout import Chunk, Piece

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
LITGPT = "lit_model.pth"  # litgpt's checkpoint (litgpt download / convert_hf_checkpoint / finetune)
# added to or removed from a model key: GPT-2 saved from GPT2Model, a base model saved alone, and the text model of a
# multimodal checkpoint (Llama 4 Scout / Maverick: language_model.model.layers..., language_model.lm_head)
PREFIXES = ("transformer.", "model.", "language_model.")
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
TIED_HEADS = {"lm_head.weight": ("model.embed_tokens.weight", "transformer.wte.weight", "wte.weight",
                                 "embed_tokens.weight")}


# ----------------------------------------------------------------------------------------------- reading
class HFCheckpoint:
    """A local HF checkpoint directory: names, shapes, dtypes; whole tensors or regions read on demand."""

    def __init__(self, directory: str, conversions: Optional[Any] = None) -> None:
        from safetensors import safe_open

        self.directory = directory
        self.conversions = conversions  # hf_conversions.Conversions: transformers' renamings / fused experts
        self._fused: Dict[str, Any] = {}
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: Dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.exists(os.path.join(directory, SAFETENSORS)):
            with safe_open(os.path.join(directory, SAFETENSORS), "pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), SAFETENSORS)
        elif os.path.exists(os.path.join(directory, LITGPT)):
            safe_open = _TorchFile
            self.weight_map = dict.fromkeys(_TorchFile(os.path.join(directory, LITGPT), "pt").keys(), LITGPT)
        else:
            raise CheckpointError(f"{directory} has neither {SAFETENSORS} nor {INDEX} (a Hugging Face checkpoint "
                                  f"saved with save_pretrained(..., safe_serialization=True)) nor {LITGPT} (litgpt's)")
        self._open = safe_open
        self._handles: Dict[str, Any] = {}

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            path = os.path.join(self.directory, file)
            if not os.path.exists(path):
                raise CheckpointError(f"{path} is missing (listed in {os.path.join(self.directory, INDEX)})")
            self._handles[file] = self._open(path, "pt")
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()  # safe_open handles unmap when collected

    def shape(self, name: str) -> Tuple[int, ...]:
        if name in self._fused:
            return self._fused[name].shape
        return tuple(self._handle(name).get_slice(name).get_shape())

    def file_of(self, name: str) -> str:
        """The file holding ``name`` (a fused tensor: its first source's)."""
        return self.weight_map[self._fused[name].sources()[0] if name in self._fused else name]

    def sources_of(self, name: str) -> List[str]:
        """The file tensors ``name`` is read from (itself, or a fused tensor's sources)."""
        return self._fused[name].sources() if name in self._fused else [name]

    def _find(self, key: str) -> Optional[str]:
        for c in renamed(key, self.conversions):
            for cand in [c] + [c[len(p):] if c.startswith(p) else p + c for p in PREFIXES]:
                if cand in self.weight_map:
                    return cand
        return None

    def resolve(self, key: str, rename: Optional[Dict[str, str]] = None) -> Optional[str]:
        """The file's name for a model key (see the module docstring), or None. A model tensor transformers builds from
        several file tensors (fused MoE experts, :mod:`.hf_conversions`) resolves to its own key, read through them."""
        if rename and key in rename and rename[key] in self.weight_map:
            return rename[key]
        found = self._find(key) or next((c for c in TIED_HEADS.get(key, ()) if c in self.weight_map), None)
        if found is not None or key in self._fused:
            return found or key
        fused = fuse(key, self.conversions, self._find, self.shape)
        if fused is None:
            return None
        self._fused[key] = fused
        return key

    def read(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if name in self._fused:
            shape = self._fused[name].shape
            return self.read_chunk(name, Chunk(offsets=(0,) * len(shape), sizes=shape), dtype)
        t = self._handle(name).get_tensor(name)
        return t if dtype is None else t.to(dtype)

    def read_chunk(self, name: str, chunk: Chunk, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if name in self._fused:
            fused = self._fused[name]
            if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, fused.shape)):
                raise CheckpointError(f"{self.directory}: {name} (fused from {fused.parts[0][0]} ...) has shape "
                                      f"{fused.shape}; region {chunk} is outside it")
            if dtype is None:  # the files' own dtype
                first = fused.parts[0][0]
                dtype = _SAFETENSORS_DTYPES.get(self._handle(first).get_slice(first).get_dtype())
                if dtype is None:  # another dtype name: read one element to learn it
                    dtype = self._file_chunk(first, Chunk(offsets=(0,) * len(fused.part_shapes[0]),
                                                          sizes=(1,) * len(fused.part_shapes[0]))).dtype
            return fused.read_chunk(chunk.offsets, chunk.sizes, lambda n, o, s: self._file_chunk(
                n, Chunk(offsets=tuple(o), sizes=tuple(s)), dtype), dtype)
        return self._file_chunk(name, chunk, dtype)

    def _file_chunk(self, name: str, chunk: Chunk, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        sl = self._handle(name).get_slice(name)
        shape = tuple(sl.get_shape())
        if len(shape) != len(chunk.sizes) or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)):
            raise CheckpointError(f"{os.path.join(self.directory, self.weight_map[name])}: {name} has shape {shape}; "
                                  f"region {chunk} is outside it")
        # a 0-dim tensor (Apertus' xIELU beta / eps) is read with the empty index `sl[()]`: `sl[:]` raised IndexError
        t = sl[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
        return t if dtype is None else t.to(dtype)


class _TorchSlice:
    """``safe_open(...).get_slice(name)``'s interface over one tensor of a memory-mapped ``torch.load``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> List[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        names = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
        return names.get(self.tensor.dtype, str(self.tensor.dtype))

    def __getitem__(self, index) -> torch.Tensor:
        if self.tensor.dim() == 0:
            return self.tensor.clone()
        return self.tensor[index].clone()  # the region's bytes only, copied out of the mapping


class _TorchFile:
    """``safe_open``'s interface (``keys``, ``get_slice``, ``get_tensor``) over a ``torch.save``d state dict, loaded
    with ``mmap=True, weights_only=True``: nothing is read until a region is."""

    def __init__(self, path: str, framework: str = "pt") -> None:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # noqa: BLE001 -- an unreadable file is named with its reason
            raise CheckpointError(f"{path}: not a torch.save'd state dict readable with mmap=True, weights_only=True "
                                  f"({type(err).__name__}: {err})") from err
        if isinstance(state, dict) and set(state) == {"model"} and isinstance(state["model"], dict):
            state = state["model"]  # litgpt's fine-tuning scripts save {"model": state_dict}
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path}: expected a state dict of tensors (or {{'model': state dict}})")
        self.state = state

    def __enter__(self) -> "_TorchFile":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> List[str]:
        return list(self.state)

    def get_slice(self, name: str) -> _TorchSlice:
        return _TorchSlice(self.state[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.state[name].clone()


def read_region(directory: str, name: str, chunks: Sequence[Chunk], dtype: Optional[torch.dtype] = None
                ) -> List[torch.Tensor]:
    """The rectangles ``chunks`` of tensor ``name`` of an HF directory (only their bytes are read)."""
    ckpt = HFCheckpoint(directory)
    try:
        return [ckpt.read_chunk(name, c, dtype) for c in chunks]
    finally:
        ckpt.close()


def _allocate_meta_(module: nn.Module, device: torch.device) -> None:
    """Allocate meta parameters / persistent buffers (values come from the file); modules whose non-persistent
    buffers are on meta (rotary ``inv_freq``) are initialized by the model's own init to recompute them."""
    from lightning_scale.materialize import allocate_, init_one, init_owners

    owners = None
    for name, m in module.named_modules():
        derived = [k for k in m._non_persistent_buffers_set if m._buffers.get(k) is not None and m._buffers[k].is_meta]
        if not (any(t.is_meta for t in m.parameters(recurse=False)) or any(
                b is not None and b.is_meta for b in m._buffers.values())):
            continue
        allocate_(m, device)
        if derived:
            owners = owners if owners is not None else init_owners(module)
            init_one(name, m, owners)


@torch.no_grad()
def load_hf_weights_(module: nn.Module, directory: str, *, rename: Optional[Dict[str, str]] = None,
                     device: Optional[torch.device] = None, strict: bool = True,
                     conversions: Optional[Any] = None) -> Dict[str, List[str]]:
    """Fill ``module``'s parameters and persistent buffers from an HF directory, each tensor read once (tied
    tensors once). Returns ``{"loaded": [...], "missing": [...], "unexpected": [...]}``; ``strict`` raises when a
    model tensor is not in the file."""
    device = torch.device(device or "cpu")
    _allocate_meta_(module, device)
    ckpt = HFCheckpoint(directory, conversions)
    seen: Dict[int, str] = {}
    loaded, missing, used = [], [], set()
    try:
        for key, t in module.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue  # a tied alias: filled through its first name
            src = ckpt.resolve(key, rename)
            aliases = [k for k, v in module.state_dict(keep_vars=True).items() if v is t] if src is None else []
            src = src or next((ckpt.resolve(a, rename) for a in aliases if ckpt.resolve(a, rename)), None)
            if src is None:
                missing.append(key)
                continue
            value = ckpt.read(src, t.dtype)
            if tuple(value.shape) != tuple(t.shape):
                raise CheckpointError(f"{os.path.join(directory, ckpt.file_of(src))}: {src} has shape "
                                      f"{tuple(value.shape)}, the model's {key} is {tuple(t.shape)}")
            t.copy_(value)
            del value
            seen[id(t)] = key
            loaded.append(key)
            used.update(ckpt.sources_of(src))
    finally:
        ckpt.close()
    if strict and missing:
        raise CheckpointError(f"{directory} has no tensor for {missing} (rename= maps model keys to file keys)")
    return {"loaded": loaded, "missing": missing, "unexpected": sorted(set(ckpt.weight_map) - used)}


@torch.no_grad()
def load_hf_pieces_(directory, pieces: Iterable[Piece], *, rename: Optional[Dict[str, str]] = None,
                    strip: str = "model/") -> List[str]:
    """Fill each destination piece (key ``model/<fqn>``; ``strip`` removed) region by region from an HF directory
    (or an open :class:`HFCheckpoint`, left open): a rank reads only the rectangles it holds. Padding rows are
    zeroed. Returns the keys not found."""
    owned = not isinstance(directory, HFCheckpoint)
    ckpt = HFCheckpoint(directory) if owned else directory
    directory = ckpt.directory
    missing = []
    try:
        for p in pieces:
            fqn = p.key[len(strip):] if strip and p.key.startswith(strip) else p.key
            src = ckpt.resolve(fqn, rename)
            if src is None:
                missing.append(p.key)
                continue
            if ckpt.shape(src) != p.global_shape:
                raise CheckpointError(f"{directory}: {src} has shape {ckpt.shape(src)}, {p.key} needs {p.global_shape}")
            for chunk, view in zip(p.chunks, p.tensors):
                view.copy_(ckpt.read_chunk(src, chunk, view.dtype))
            p.zero_padding_()
    finally:
        if owned:
            ckpt.close()
    return missing


# ----------------------------------------------------------------------------------------------- writing
def plan_shards(sizes: Sequence[Tuple[str, int]], max_shard_bytes: int) -> List[List[str]]:
    """Greedy in order: a new shard starts when the next tensor would pass ``max_shard_bytes`` (as HF does)."""
    shards: List[List[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards if shards[0] else []


def shard_file(i: int, n: int) -> str:
    return SAFETENSORS if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_shard(path: str, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def _write_config(staging: str, config: Any = None, config_dir: Optional[str] = None) -> None:
    if config is not None:
        config.save_pretrained(staging)
        return
    if config_dir is None:
        raise CheckpointError("export_hf needs config= (a PretrainedConfig) or config_dir= (an HF directory with "
                              "config.json) so that from_pretrained can build the model")
    if not os.path.exists(os.path.join(config_dir, "config.json")):
        raise CheckpointError(f"{os.path.join(config_dir, 'config.json')} is missing")
    for name in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(config_dir, name)):
            shutil.copy(os.path.join(config_dir, name), os.path.join(staging, name))


def _finish(staging: str, out_dir: str, shards: List[List[str]], total: int, **config) -> None:
    """Index + config into the staging folder, then swap it in place of ``out_dir``."""
    n = len(shards)
    if n > 1:
        weight_map = {name: shard_file(i, n) for i, names in enumerate(shards) for name in names}
        with open(os.path.join(staging, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    _write_config(staging, **config)
    old = None
    if os.path.exists(out_dir):
        old = staging + ".old"
        os.rename(out_dir, old)
    os.rename(staging, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _staging(out_dir: str, token: str = "export") -> str:
    head, name = os.path.split(os.path.normpath(out_dir))
    return os.path.join(head, f".{name}.{token}.partial")


def export_hf(tensors: Iterable[Tuple[str, torch.Tensor]], out_dir: str, *, config: Any = None,
              config_dir: Optional[str] = None, max_shard_bytes: int = 5 << 30,
              dtype: Optional[torch.dtype] = None) -> Dict[str, str]:
    """Write ``(name, tensor)`` pairs (HF state_dict keys, full tensors, streamed) as an HF directory. Holds at most
    one shard's tensors. Returns ``{name: file}``."""
    staging = _staging(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    shards: List[List[str]] = []
    current: Dict[str, torch.Tensor] = {}
    used = total = 0
    tmp_names: List[str] = []

    def flush() -> None:
        nonlocal current, used
        if current:
            tmp = os.path.join(staging, f"shard{len(shards)}.tmp")
            _write_shard(tmp, current)
            tmp_names.append(tmp)
            shards.append(list(current))
            current, used = {}, 0

    for name, t in tensors:
        t = t.detach().cpu() if dtype is None or not t.is_floating_point() else t.detach().cpu().to(dtype)
        if current and used + t.nbytes > max_shard_bytes:
            flush()
        current[name] = t
        used += t.nbytes
        total += t.nbytes
    flush()
    for i, tmp in enumerate(tmp_names):
        os.rename(tmp, os.path.join(staging, shard_file(i, len(shards))))
    _finish(staging, out_dir, shards, total, config=config, config_dir=config_dir)
    return {name: shard_file(i, len(shards)) for i, names in enumerate(shards) for name in names}


def checkpoint_tensors(ckpt_dir: str, names: Optional[Sequence[str]] = None, *, prefer_master: bool = True,
                       ) -> Iterator[Tuple[str, torch.Tensor]]:
    """Stream ``(fqn, full tensor)`` of a layout-free checkpoint's model (fp32 masters where saved and
    ``prefer_master``), one tensor at a time; the metadata is read once."""
    from lightning_scale.checkpoint import dcp_format
    from lightning_scale.checkpoint.layout import tensor_piece

    path, meta, md = dcp_format.open_checkpoint(ckpt_dir)
    sd = md.state_dict_metadata
    fqns = names if names is not None else [k[len("model/"):] for k in sorted(sd) if k.startswith("model/")]
    for fqn in fqns:
        key = f"master/{fqn}" if prefer_master and f"master/{fqn}" in sd else f"model/{fqn}"
        tmd = sd[key]
        t = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
        dcp_format.read_local(path, meta, md, [tensor_piece(key, t)])
        yield fqn, t


def export_hf_from_checkpoint(ckpt_dir: str, out_dir: str, *, config: Any = None, config_dir: Optional[str] = None,
                              strip_prefix: str = "", rename: Optional[Callable[[str], Optional[str]]] = None,
                              dtype: Optional[torch.dtype] = None, max_shard_bytes: int = 5 << 30,
                              prefer_master: bool = True, group=None) -> List[str]:
    """A layout-free checkpoint folder -> an HF directory. Collective over ``group`` when given: shard ``i`` is
    written by rank ``i % world`` (each reads only its shards' tensors); rank 0 writes the index and config.
    ``strip_prefix`` removes e.g. a LightningModule's ``model.``; ``rename(fqn)`` returns the HF name or None to
    skip a tensor. Returns the shard files this rank wrote."""
    import torch.distributed as dist

    from lightning_scale.checkpoint import dcp_format

    rank, world = dcp_format._rank_world(group)
    _, _, md = dcp_format.open_checkpoint(ckpt_dir)
    sd = md.state_dict_metadata
    names: Dict[str, str] = {}  # hf name -> checkpoint fqn
    for key in sorted(sd):
        if not key.startswith("model/"):
            continue
        fqn = key[len("model/"):]
        if strip_prefix and not fqn.startswith(strip_prefix):
            continue
        hf = fqn[len(strip_prefix):]
        hf = rename(hf) if rename else hf
        if hf is not None:
            names[hf] = fqn

    def nbytes(hf: str) -> int:
        tmd = sd[f"model/{names[hf]}"]
        elem = (dtype or tmd.properties.dtype).itemsize
        return int(torch.Size(tmd.size).numel()) * elem

    shards = plan_shards([(hf, nbytes(hf)) for hf in names], max_shard_bytes)
    token = dcp_format._broadcast(os.urandom(8).hex() if rank == 0 else None, group)
    staging = _staging(out_dir, token)
    if rank == 0:
        os.makedirs(staging, exist_ok=True)
    dcp_format._broadcast(None, group)
    written = []
    for i in range(rank, len(shards), world):
        fqn_to_hf = {names[hf]: hf for hf in shards[i]}
        current = {}
        for fqn, t in checkpoint_tensors(ckpt_dir, list(fqn_to_hf), prefer_master=prefer_master):
            current[fqn_to_hf[fqn]] = t if dtype is None or not t.is_floating_point() else t.to(dtype)
        _write_shard(os.path.join(staging, shard_file(i, len(shards))), current)
        written.append(shard_file(i, len(shards)))
        del current
    dcp_format._all_gather(None, group)  # every shard written
    if rank == 0:
        total = sum(nbytes(hf) for hf in names)
        _finish(staging, out_dir, shards, total, config=config, config_dir=config_dir)
    if world > 1:
        dist.barrier(group=group)
    return written
