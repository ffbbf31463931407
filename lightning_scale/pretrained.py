"""Pretrained Hugging Face weights for a model built on ``meta``: each rank reads only what it keeps.

Inside ``configure_model`` (or Fabric's ``init_module(empty_init=True)``) the strategy builds on the meta device,
where ``transformers``' own ``from_pretrained`` refuses to run. Two ways in, with no other change to the module::

    self.model = lightning_scale.from_pretrained(AutoModelForCausalLM, "/models/llama", dtype=torch.bfloat16)
    # or: self.model = AutoModelForCausalLM.from_config(config); lightning_scale.load_pretrained(self.model, dir)

On ``meta`` both build (or keep) the model without weights and *record* the directory on the Hugging Face module
(:class:`WeightSource`); outside a meta context (one process, ``meta_init=False``, ZeRO 0-2 without tp / pp) they are
``cls.from_pretrained(dir, ...)`` / an immediate load, so the same LightningModule runs unchanged on one device.
Inside the strategy's meta context a plain ``AutoModelForCausalLM.from_pretrained(dir)`` takes the first path too
(:func:`meta_from_pretrained` patches transformers for the duration of ``configure_model`` only).

The composition core then reads the weights where it would otherwise initialize (:class:`WeightReader`, used by
:func:`lightning_scale.materialize.materialize_` for tp slices and pipeline stages and by ZeRO-3's unit-by-unit
materialization): a tensor-parallel layer reads its slice (vocabulary padding zeroed, fused sections per part,
GPT-2's ``Conv1D`` layout as stored), a pipeline rank its stage, a ZeRO-3 rank only its dp shard of each flat
bucket, through :func:`lightning_scale.checkpoint.hf.load_hf_pieces_` (``safe_open(...).get_slice``). Non-persistent
buffers (rotary ``inv_freq``) are recomputed by the model's own init; names follow
:meth:`~lightning_scale.checkpoint.hf.HFCheckpoint.resolve` (``model.`` / ``transformer.`` prefixes, tied heads).
:func:`check_weight_sources` (first step of ``parallelize``) rejects a missing directory, a config of another
architecture and missing or mis-shaped tensors on every rank, before anything is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lightning_scale.config import ConfigError

SOURCE_ATTR = "_lightning_scale_weights"
# from_pretrained keywords that only steer downloads / placement: meaningless for a local directory read on meta
_PLACEMENT_KWARGS = ("device_map", "low_cpu_mem_usage", "local_files_only", "use_safetensors", "cache_dir",
                     "force_download", "token", "revision", "weights_only", "offload_folder", "offload_state_dict",
                     "subfolder", "proxies", "resume_download", "code_revision", "user_agent", "variant",
                     "adapter_kwargs")


@dataclass(frozen=True)
class WeightSource:
    """Where a meta-built model's weights come from: a local directory written by ``save_pretrained``."""

    directory: str
    rename: Optional[Dict[str, str]] = None  # model key -> file key, for names the prefix rules do not find
    # transformers' renamings / fused MoE experts for this model (checkpoint.hf_conversions), None when none
    conversions: Any = None


def _meta_active() -> bool:
    """Inside the strategies' configure_model context (materialize.parameters_on_meta) or under
    `with torch.device("meta")`."""
    from lightning_scale.materialize import parameters_on_meta_active

    return parameters_on_meta_active() or torch.empty(0).is_meta


def _check_directory(directory: Any, what: str) -> str:
    if not isinstance(directory, (str, os.PathLike)) or not os.path.isdir(directory):
        raise ConfigError(f"{what}({str(directory)!r}): not a local directory (on the meta device the weights are "
                          "read from a directory written by save_pretrained; download hub models first, e.g. "
                          "huggingface_hub.snapshot_download)")
    return os.fspath(directory)


def _dtype(value: Any, config: Any) -> Optional[torch.dtype]:
    if value is None or value == "auto":  # transformers' default: the dtype the checkpoint's config names
        value = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.replace("torch.", ""), None)
    return value if isinstance(value, torch.dtype) else None


def _file_config(directory: str) -> Dict[str, Any]:
    """The directory's ``config.json`` ({} when there is none)."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _file_dtype(directory: str) -> Optional[str]:
    config = _file_config(directory)
    return config.get("dtype") or config.get("torch_dtype")


def _file_model_types(directory: str) -> Tuple[str, ...]:
    """The ``model_type`` of the directory's ``config.json`` and of its ``text_config`` (a multimodal checkpoint whose
    text model a causal LM loads alone: Llama 4's ``llama4`` holds a ``llama4_text``); () when there is none."""
    config = _file_config(directory)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return tuple(t for t in (config.get("model_type"), text.get("model_type")) if t)


def _build_on_meta(cls: Any, directory: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> nn.Module:
    """``cls.from_pretrained(directory, ...)``'s model without its weights, on the current (meta) device."""
    from transformers import AutoConfig

    if args:
        raise ConfigError(f"from_pretrained({directory!r}, {args!r}): positional model arguments are not supported "
                          "on the meta device; pass configuration overrides as keywords")
    kwargs = dict(kwargs)
    for key in list(kwargs):
        if key in _PLACEMENT_KWARGS or key.startswith("_") or kwargs[key] is None:  # AutoModel's own / defaults
            kwargs.pop(key)
    config = kwargs.pop("config", None)
    dtype = kwargs.pop("dtype", None)
    dtype = dtype if dtype is not None else kwargs.pop("torch_dtype", None)
    kwargs.pop("torch_dtype", None)
    attn = kwargs.pop("attn_implementation", None)
    trust = kwargs.pop("trust_remote_code", None)
    own = None if hasattr(cls, "_model_mapping") else getattr(cls, "config_class", None)
    if config is None and own is not None and getattr(own, "model_type", None) in _file_model_types(directory)[1:]:
        # a multimodal directory whose text model cls is (Llama4ForCausalLM in Llama 4 Scout's): its text config, as
        # transformers' cls.from_pretrained reads it
        config, unused = own.from_pretrained(directory, return_unused_kwargs=True, **kwargs)
    elif config is None:
        extra = {"trust_remote_code": trust} if trust is not None else {}
        config, unused = AutoConfig.from_pretrained(directory, return_unused_kwargs=True, **extra, **kwargs)
    else:
        unused = {k: v for k, v in kwargs.items() if not hasattr(config, k)}
        for k, v in kwargs.items():
            if k not in unused:
                setattr(config, k, v)
    if unused:
        raise ConfigError(f"from_pretrained({directory!r}, {', '.join(f'{k}=' for k in sorted(unused))}): not "
                          f"attributes of {type(config).__name__} (only configuration overrides, dtype, "
                          "attn_implementation and trust_remote_code are meaningful on the meta device)")
    build: Dict[str, Any] = {}
    resolved = _dtype(dtype, config)
    if resolved is None and dtype in (None, "auto"):  # a text config taken from a multimodal checkpoint has none: the
        resolved = _dtype(_file_dtype(directory), config)  # whole checkpoint's, as transformers reads it
    if resolved is not None:
        build["dtype"] = resolved
    if attn is not None:
        build["attn_implementation"] = attn
    if hasattr(cls, "_model_mapping"):  # an Auto class: it picks the architecture from the config
        try:
            return cls.from_config(config, **({"trust_remote_code": trust} if trust else {}), **build)
        except ValueError as err:
            raise ConfigError(f"{cls.__name__}.from_pretrained({directory!r}): {err}") from err
    want = getattr(getattr(cls, "config_class", None), "model_type", None)
    if want and config.model_type != want:
        raise ConfigError(f"{cls.__name__}.from_pretrained({directory!r}): the directory holds a "
                          f"{config.model_type!r} model (config.json), {cls.__name__} is {want!r}")
    return cls._from_config(config, **build)


def record(model: nn.Module, directory: str, rename: Optional[Dict[str, str]] = None) -> nn.Module:
    """Mark ``model`` (on meta) as filled from ``directory`` when the strategy materializes it."""
    from lightning_scale.checkpoint.hf_conversions import conversions_for

    object.__setattr__(model, SOURCE_ATTR, WeightSource(os.path.abspath(directory), dict(rename) if rename else None,
                                                        conversions_for(model)))
    return model


def from_pretrained(cls: Any, directory: Any, *args: Any, **kwargs: Any) -> nn.Module:
    """``cls.from_pretrained(directory, ...)`` that works inside ``configure_model`` under ZeRO-3 / tp / pp.

    On the meta device: the model is built from the directory's ``config.json`` (``cls`` an Auto class or a model
    class; ``dtype`` / ``torch_dtype`` (default ``"auto"``: the config's), ``attn_implementation``, configuration
    overrides as keywords), returned in eval mode as transformers does, and the directory is recorded as its
    weight source. Elsewhere: exactly ``cls.from_pretrained(directory, *args, **kwargs)``."""
    if not _meta_active():
        return cls.from_pretrained(directory, *args, **kwargs)
    directory = _check_directory(directory, f"{getattr(cls, '__name__', cls)}.from_pretrained")
    model = _build_on_meta(cls, directory, args, kwargs)
    return record(model, directory).eval()


def load_pretrained(model: nn.Module, directory: Any, *, rename: Optional[Dict[str, str]] = None) -> nn.Module:
    """The weights of a ``save_pretrained`` directory into ``model``: recorded for the strategy when the model is on
    meta (each rank then reads only its slices / stage / shard), else loaded now (every tensor, strict)."""
    from lightning_scale.materialize import has_meta

    from lightning_scale.checkpoint.hf_conversions import conversions_for

    directory = _check_directory(directory, "load_pretrained")  # (model, dir)
    conversions = conversions_for(model)
    check_source(model, WeightSource(directory, rename, conversions), "load_pretrained")
    if has_meta(model, recurse=True):
        return record(model, directory, rename)
    from lightning_scale.checkpoint.hf import load_hf_weights_

    load_hf_weights_(model, directory, rename=rename, device=next(model.parameters()).device, conversions=conversions)
    return model


# ----------------------------------------------------------------------------------------------- meta context
_DEPTH = [0]  # > 0 while inside meta_from_pretrained()


def _install(modeling_utils: Any) -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` once: a pass-through except inside :func:`meta_from_pretrained` on
    the meta device with a local directory, where it is :func:`from_pretrained`."""
    base = getattr(modeling_utils, "PreTrainedModel", None)
    original = base.__dict__.get("from_pretrained") if base is not None else None
    if not isinstance(original, classmethod) or getattr(original.__func__, "_lightning_scale", False):
        return

    @functools.wraps(original.__func__)
    def patched(cls, pretrained_model_name_or_path, *args, **kwargs):
        if _DEPTH[0] and _meta_active() and isinstance(pretrained_model_name_or_path, (str, os.PathLike)) \
                and os.path.isdir(pretrained_model_name_or_path):
            return from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)
        return original.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)

    patched._lightning_scale = True
    base.from_pretrained = classmethod(patched)


@contextlib.contextmanager
def meta_from_pretrained() -> Iterator[None]:
    """While inside (the strategies' meta-device ``configure_model``): ``from_pretrained`` of a local directory on
    any transformers model class (Auto classes included) builds on meta and records the weights
    (:func:`from_pretrained`). transformers is not imported for this: the wrapper is installed when it is (now, or
    right after its import); outside this context it passes every call through unchanged. A refusal of the meta
    context that still gets through (a hub id, a class with its own ``from_pretrained``) becomes a ConfigError
    naming the helper."""
    from lightning_scale._import_hook import run_after_import

    run_after_import("transformers.modeling_utils", _install)
    _DEPTH[0] += 1
    try:
        yield
    except RuntimeError as err:
        if "from_pretrained" in str(err) and "meta" in str(err):
            raise ConfigError("from_pretrained inside configure_model runs on the meta device here and needs a local "
                              "directory: use lightning_scale.from_pretrained(AutoModelForCausalLM, '/local/dir', "
                              "...) or from_config + lightning_scale.load_pretrained(model, '/local/dir')") from err
        raise
    finally:
        _DEPTH[0] -= 1


# ----------------------------------------------------------------------------------------------- checks
def weight_sources(root: nn.Module) -> List[Tuple[str, nn.Module, WeightSource]]:
    """``(prefix, module, source)`` of every module under ``root`` with a recorded source, deepest first."""
    found = [(name, m, getattr(m, SOURCE_ATTR)) for name, m in root.named_modules()
             if isinstance(getattr(m, SOURCE_ATTR, None), WeightSource)]
    return sorted(found, key=lambda x: -len(x[0]))


def _open(directory: str, conversions: Any = None):
    from lightning_scale.checkpoint.folder import CheckpointError
    from lightning_scale.checkpoint.hf import HFCheckpoint

    try:
        return HFCheckpoint(directory, conversions)
    except CheckpointError as err:
        raise ConfigError(f"pretrained weights: {err}") from err


def check_source(module: nn.Module, source: WeightSource, what: str = "pretrained weights") -> None:
    """Every parameter and persistent buffer of ``module`` (unsplit) is in the directory with its shape, and the
    directory's ``config.json`` names the module's architecture; ConfigError otherwise (reads headers only)."""
    mine = getattr(getattr(module, "config", None), "model_type", None)
    types = _file_model_types(source.directory)
    theirs = types[0] if types else None
    if mine and theirs and mine not in types:
        raise ConfigError(f"{what}: {source.directory} holds a {theirs!r} model (config.json), the module is a "
                          f"{mine!r} model ({type(module).__name__})")
    ckpt = _open(source.directory, source.conversions)
    try:
        missing, wrong = [], []
        state = module.state_dict(keep_vars=True)
        names: Dict[int, List[str]] = {}
        for key, t in state.items():
            names.setdefault(id(t), []).append(key)
        for key, t in state.items():
            # a tied tensor is in the file under one of its names (Falcon's head: transformer.word_embeddings.weight)
            src = next((s for k in [key] + names[id(t)] if (s := ckpt.resolve(k, source.rename)) is not None), None)
            if src is None:
                missing.append(key)
            elif ckpt.shape(src) != tuple(t.shape):
                wrong.append(f"{key}: file {ckpt.shape(src)}, model {tuple(t.shape)}")
    finally:
        ckpt.close()
    if missing or wrong:
        detail = (f"no tensor for {missing[:5]}" + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
                  if missing else "") + ("; " if missing and wrong else "") + (
                      f"shapes differ: {wrong[:3]}" if wrong else "")
        raise ConfigError(f"{what}: {source.directory} does not match {type(module).__name__}: {detail} "
                          "(load_pretrained(..., rename={model_key: file_key}) maps other names)")


def check_weight_sources(root: nn.Module) -> None:
    """:func:`check_source` for every recorded source under ``root`` (``parallelize``'s first step; every rank)."""
    for prefix, module, source in weight_sources(root):
        check_source(module, source, f"pretrained weights of {prefix or type(root).__name__}")


# ----------------------------------------------------------------------------------------------- reading
def tp_flat_piece(key: str, flat: torch.Tensor, local_shape: Sequence[int], start: int, spec=None, tp_rank: int = 0):
    """``flat`` = elements ``[start, start + len)`` (row-major) of a local tensor of ``local_shape``, tp-mapped: the
    layout-free checkpoint's mapping (:func:`lightning_scale.checkpoint.engine_pieces.flat_param_piece`), one for
    both readers."""
    from lightning_scale.checkpoint.engine_pieces import flat_param_piece

    return flat_param_piece(key, flat, local_shape, start, spec, tp_rank)


class WeightReader:
    """Reads the tensors of a root module's modules that lie under a recorded :class:`WeightSource`.

    Keys are root fqns (``model.model.layers.0.mlp.up_proj.weight`` in a LightningModule); each maps to its source
    and the key inside it. File handles are released after every module / unit (:meth:`release`), so the file
    pages a rank mapped never add up to more than one unit's share."""

    def __init__(self, root: nn.Module) -> None:
        self.sources = [(p + "." if p else "", s) for p, _, s in weight_sources(root)]
        self._ckpts: Dict[str, Any] = {}
        # the tp rank of every split tensor: its tp layer's, or its tp-split model's (an experts module's weights)
        self._tp_rank = {id(p): int(state.rank) for m in root.modules()
                         if (state := getattr(m, "_tp_state", None)) is not None for p in m.parameters()}
        self._tp_rank.update({id(p): int(getattr(m, "rank", 0)) for m in root.modules()
                              if getattr(m, "weight_spec", None) is not None for p in m.parameters(recurse=False)})

    def __bool__(self) -> bool:
        return bool(self.sources)

    def _find(self, fqn: str) -> Optional[Tuple[WeightSource, str]]:
        for prefix, source in self.sources:
            if fqn.startswith(prefix):
                return source, fqn[len(prefix):]
        return None

    def covers(self, fqn: str) -> bool:
        return self._find(fqn) is not None

    def _ckpt(self, source: WeightSource):
        if source.directory not in self._ckpts:
            self._ckpts[source.directory] = _open(source.directory, source.conversions)
        return self._ckpts[source.directory]

    def release(self) -> None:
        for ckpt in self._ckpts.values():
            ckpt.close()
        self._ckpts.clear()

    def load_(self, items: Sequence[Tuple[str, Any]]) -> None:
        """Fill ``items`` = ``(root fqn, Piece)`` (from :meth:`tensor_item` / :meth:`flat_item`), per source."""
        from lightning_scale.checkpoint.hf import load_hf_pieces_

        by_source: Dict[int, Tuple[WeightSource, list]] = {}
        for fqn, piece in items:
            source, key = self._find(fqn)
            piece.key = key
            by_source.setdefault(id(source), (source, []))[1].append(piece)
        for source, pieces in by_source.values():
            missing = load_hf_pieces_(self._ckpt(source), pieces, rename=source.rename, strip="")
            if missing:
                raise ConfigError(f"pretrained weights: {source.directory} has no tensor for {missing[:5]}")

    def tensor_item(self, fqn: str, t: torch.Tensor):
        """A whole local tensor (a parameter, a tp slice, a persistent buffer) as a loadable piece."""
        from lightning_scale.tensor_parallel.sharding import tp_spec

        flat = t.detach().view(-1)
        return fqn, tp_flat_piece(fqn, flat, tuple(t.shape), 0, tp_spec(t), self._tp_rank.get(id(t), 0))

    def flat_item(self, fqn: str, param: torch.Tensor, flat: torch.Tensor, start: int):
        """Elements ``[start, start + len(flat))`` of ``param`` (row-major; a ZeRO flat shard's share of it)."""
        from lightning_scale.tensor_parallel.sharding import tp_spec

        return fqn, tp_flat_piece(fqn, flat, tuple(param.shape), start, tp_spec(param),
                                  self._tp_rank.get(id(param), 0))

    @torch.no_grad()
    def fill_module_(self, name: str, module: nn.Module, owners, skip: Sequence[int] = ()) -> None:
        """``module``'s own tensors (already allocated) from the file: non-persistent buffers recomputed by the
        model's own init first, then every parameter and persistent buffer (its tp slice) read; ``skip``: ids of
        tensors filled elsewhere (ZeRO-3 flat shards)."""
        from lightning_scale.materialize import init_one

        if any(module._buffers.get(k) is not None for k in module._non_persistent_buffers_set):
            init_one(name, module, owners)  # rotary inv_freq & co.: derived from the config, not in the file
        prefix = name + "." if name else ""
        items = []
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in skip and p.numel():
                items.append(self.tensor_item(prefix + pname, p))
        for bname, b in module.named_buffers(recurse=False):
            if b is not None and bname not in module._non_persistent_buffers_set and b.numel():
                items.append(self.tensor_item(prefix + bname, b))
        self.load_(items)


def weight_reader(root: nn.Module) -> Optional[WeightReader]:
    """The reader of ``root``'s recorded sources, or None when there are none (then everything is initialized)."""
    reader = WeightReader(root)
    return reader if reader else None


__all__ = ["WeightSource", "WeightReader", "from_pretrained", "load_pretrained", "meta_from_pretrained",
           "check_source", "check_weight_sources", "weight_sources", "weight_reader", "tp_flat_piece", "record"]
