"""``python -m lightning_scale.checkpoint``: inspect, consolidate and export checkpoint folders.

    inspect DIR                          layout, step, world size, tensors (shape, dtype, bytes), files (size, CRC32)
    consolidate DIR OUT.pt               one plain state_dict (format 2 folders: lightning_scale.zero.state_dict;
                                         layout-free folders: streamed tensor by tensor)
    export-hf DIR OUT_DIR --config HF    a Hugging Face directory (sharded safetensors + index + config.json)

Works on both the layout-free format (:mod:`.dcp_format`) and folder.py's per-rank format. Imports are lazy: this
module imports only the standard library, so the commands start fast and never pull in Lightning or Triton.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from typing import Any, Dict, List, Optional

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def describe(path: str) -> Dict[str, Any]:
    """What ``inspect`` prints, as data: format, step, world size, layout, tensors, extras, files.

    From the folder's ``summary.json`` (written at save time, see :func:`write_summary`) without importing torch,
    after checking what loading checks first (the manifest's and every listed file's size, the manifest's and DCP
    ``.metadata``'s CRC32); from the manifest and the DCP metadata / ``checkpoint.pt`` (torch) for folders saved
    before the summary existed, or when the summary is missing or does not match."""
    info = _read_summary(path)
    return info if info is not None else _describe_with_torch(path)


def _describe_with_torch(path: str) -> Dict[str, Any]:
    from lightning_scale.checkpoint import dcp_format, folder

    path = folder.resolve(path)
    kind = dcp_format.detect_format(path)
    meta = folder.read_manifest(path)
    out: Dict[str, Any] = {"path": path, "format": kind, "version": meta.get("format_version", meta.get("version", 1)),
                           "step": meta.get("step"), "world_size": meta.get("world_size"),
                           "layout": meta.get("layout"), "files": meta.get("files") or {}, "tensors": {},
                           "extras": []}
    if kind == "dcp":
        _, _, md = dcp_format.open_checkpoint(path)
        for key, tmd in sorted(md.state_dict_metadata.items()):
            if hasattr(tmd, "size"):
                numel = 1
                for s in tmd.size:
                    numel *= int(s)
                out["tensors"][key] = {"shape": tuple(tmd.size), "dtype": str(tmd.properties.dtype).replace("torch.", ""),
                                       "bytes": numel * tmd.properties.dtype.itemsize, "chunks": len(tmd.chunks)}
            else:
                out["extras"].append(key)
        return out
    import torch

    folder.verify(path, meta)
    base = torch.load(os.path.join(path, "checkpoint.pt"), map_location="cpu", weights_only=False, mmap=True)
    for key, t in base.get("state_dict", {}).items():
        out["tensors"][key] = {"shape": tuple(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                               "bytes": t.numel() * t.element_size(), "chunks": 1}
    out["step"] = out["step"] if out["step"] is not None else base.get("global_step")
    out["extras"] = sorted(k for k in base if k != "state_dict")
    return out


# ----------------------------------------------------------------------------------------------- summary.json
SUMMARY = "summary.json"  # beside the manifest; not listed in it (it is written after it, and records it)
_SUMMARY_VERSION = 1


def write_summary(staging: str, manifest_record: Dict[str, int]) -> None:
    """At save time (rank 0, torch loaded, after the manifest, before the swap): record what ``inspect`` prints,
    and the manifest's size and CRC32, so that ``inspect`` later reads it without torch."""
    import json

    info = _describe_with_torch(staging)
    info.pop("path")
    info["summary_version"], info["manifest"] = _SUMMARY_VERSION, dict(manifest_record)
    with open(os.path.join(staging, SUMMARY), "w") as f:
        json.dump(info, f, default=str)
        f.flush()
        os.fsync(f.fileno())


def _read_summary(path: str) -> Optional[Dict[str, Any]]:
    """describe() from ``summary.json``, or None (no usable summary: the torch path decides, and names any fault).
    The checks are those loading makes before it reads anything, done here on the summary's copy of the records."""
    import json
    import zlib

    if not os.path.isdir(path):
        return None  # resolve() (torch) finds a save interrupted while swapping folders
    try:
        with open(os.path.join(path, SUMMARY)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("summary_version") != _SUMMARY_VERSION:
        return None
    checks = dict(info["files"])
    checks["meta.pt"] = info["manifest"]
    crc = {"meta.pt"} | ({".metadata"} if info["format"] == "dcp" else set())
    for name, rec in checks.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full) or os.path.getsize(full) != rec["size"]:
            return None
        if name in crc:
            value = 0
            with open(full, "rb") as f:
                for block in iter(lambda: f.read(8 << 20), b""):
                    value = zlib.crc32(block, value)
            if value != rec["crc32"]:
                return None
    info.pop("summary_version")
    info.pop("manifest")
    info["path"] = path
    info["tensors"] = {k: {**t, "shape": tuple(t["shape"])} for k, t in info["tensors"].items()}
    return info


def _print_inspect(info: Dict[str, Any]) -> None:
    print(f"{info['path']}: format {info['format']} (version {info['version']}), step {info['step']}, "
          f"world size {info['world_size']}, layout {info['layout']}")
    total = sum(t["bytes"] for t in info["tensors"].values())
    print(f"tensors: {len(info['tensors'])}, {_mib(total)}")
    for key, t in info["tensors"].items():
        print(f"  {key:60s} {str(list(t['shape'])):20s} {t['dtype']:9s} {t['bytes']:>12,d} B  {t['chunks']} chunk(s)")
    if info["extras"]:
        print(f"extras: {', '.join(info['extras'])}")
    print(f"files: {len(info['files'])}")
    for name, rec in sorted(info["files"].items()):
        print(f"  {name:30s} {rec['size']:>12,d} B  crc32 {rec['crc32']:08x}")


def consolidate(path: str, out: str, *, strip_prefix: str = "", dtype: Optional[str] = "float32",
                prefer_master: bool = True) -> int:
    """Write one plain ``{name: tensor}`` state_dict; returns the number of tensors."""
    import torch

    from lightning_scale.checkpoint import dcp_format, folder

    torch_dtype = None if dtype in (None, "keep") else getattr(torch, dtype)
    path = folder.resolve(path)
    if dcp_format.detect_format(path) == "sharded":
        from lightning_scale.zero.state_dict import consolidate_checkpoint

        return len(consolidate_checkpoint(path, strip_prefix=strip_prefix, dtype=torch_dtype, out=out))
    from lightning_scale.checkpoint.hf import checkpoint_tensors

    state = {}
    for fqn, t in checkpoint_tensors(path, prefer_master=prefer_master):
        if strip_prefix and not fqn.startswith(strip_prefix):
            continue
        state[fqn[len(strip_prefix):]] = t.to(torch_dtype) if torch_dtype and t.is_floating_point() else t
    torch.save(state, out)
    return len(state)


def export(path: str, out_dir: str, config_dir: str, *, strip_prefix: str = "", dtype: Optional[str] = None,
           max_shard_bytes: int = 5 << 30) -> None:
    import torch

    from lightning_scale.checkpoint import dcp_format, folder
    from lightning_scale.checkpoint.hf import export_hf, export_hf_from_checkpoint

    torch_dtype = getattr(torch, dtype) if dtype else None
    path = folder.resolve(path)
    if dcp_format.detect_format(path) == "dcp":
        export_hf_from_checkpoint(path, out_dir, config_dir=config_dir, strip_prefix=strip_prefix, dtype=torch_dtype,
                                  max_shard_bytes=max_shard_bytes)
        return
    from lightning_scale.zero.state_dict import (
        consolidate_checkpoint,  # format 2: one layout, consolidated first
    )

    state = consolidate_checkpoint(path, strip_prefix=strip_prefix, dtype=None)
    export_hf(state.items(), out_dir, config_dir=config_dir, max_shard_bytes=max_shard_bytes, dtype=torch_dtype)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lightning_scale.checkpoint", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="layout, step, tensors, files and checksums")
    p.add_argument("dir")
    p = sub.add_parser("consolidate", help="one plain state_dict file")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--strip-prefix", default="")
    p.add_argument("--dtype", default="float32", choices=_DTYPES + ("keep",))
    p = sub.add_parser("export-hf", help="a Hugging Face safetensors directory")
    p.add_argument("dir")
    p.add_argument("out_dir")
    p.add_argument("--config", required=True, help="an HF directory holding config.json")
    p.add_argument("--strip-prefix", default="", help="e.g. 'model.' for a LightningModule holding the HF model")
    p.add_argument("--dtype", default=None, choices=_DTYPES)
    p.add_argument("--max-shard-size", type=int, default=5 << 30, help="bytes per safetensors file")
    return ap


def _not_a_folder(path: str) -> bool:
    """What ``folder.resolve`` + ``folder.read_manifest`` reject first, checked without importing torch: not a
    directory, and no ``.<name>.*.old`` left beside it by an interrupted swap (then ``resolve`` may find a save)."""
    if os.path.isdir(path):
        return False
    head, name = os.path.split(os.path.normpath(path))
    return os.path.lexists(path) or not glob.glob(os.path.join(glob.escape(head or "."), f".{glob.escape(name)}.*.old"))


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    if _not_a_folder(args.dir):  # the same message as folder.read_manifest's, before torch is imported
        print(f"error: {args.dir} is not a checkpoint folder", file=sys.stderr)
        return 2
    summary = _read_summary(args.dir) if args.command == "inspect" else None
    if summary is not None:  # no torch: the folder's summary.json, checked against its files
        _print_inspect(summary)
        print(f"({time.perf_counter() - start:.2f} s)", file=sys.stderr)
        return 0
    from lightning_scale.checkpoint.folder import CheckpointError

    try:
        if args.command == "inspect":
            _print_inspect(_describe_with_torch(args.dir))
        elif args.command == "consolidate":
            n = consolidate(args.dir, args.out, strip_prefix=args.strip_prefix, dtype=args.dtype)
            print(f"wrote {args.out}: {n} tensors")
        else:
            export(args.dir, args.out_dir, args.config, strip_prefix=args.strip_prefix, dtype=args.dtype,
                   max_shard_bytes=args.max_shard_size)
            print(f"wrote {args.out_dir}")
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"({time.perf_counter() - start:.2f} s)", file=sys.stderr)
    return 0
