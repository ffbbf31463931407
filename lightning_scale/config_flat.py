"""The flat schema and the user's words (split from :mod:`lightning_scale.config`, which re-exports every name here).

``flat_schema()`` derives from ``ParallelConfig`` the flat keyword of every field (``Zero3DStrategy(stage=3)``,
Hydra ``strategy.stage``), ``speaking(FLAT | HYDRA)`` renames the internal paths in a ``ConfigError`` to what the user
typed, ``PRESETS`` are the registered strategy names, and ``check_trainer_flags`` the checks of Trainer flags made
before training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from lightning_scale.config import ConfigError, OffloadConfig, ParallelConfig


# ---------------------------------------------------------------------------------------------- the flat schema
@dataclass(frozen=True)
class FlatKey:
    """One flat keyword / Hydra ``strategy.<name>`` key: the ParallelConfig path(s) it sets."""

    paths: Tuple[str, ...]  # ("zero.stage",); a composite sets several
    type: Any  # the resolved annotation of the field
    default: Any

    def expand(self, value: Any) -> Dict[str, Any]:
        """``{path: value}`` this key sets (a composite turns its shorthand into field values)."""
        if self.paths == ("offload.optimizer", "offload.params"):
            off = _offload_from(value)
            # only what the value spells out: a shorthand leaves pin_memory to its own key
            named = ({f.name for f in fields(off)} if isinstance(value, OffloadConfig)
                     else set(value) if isinstance(value, dict) else {"optimizer", "params"})
            return {f"offload.{name}": getattr(off, name) for name in sorted(named)}
        return {self.paths[0]: value}


# Flat names that are not the field's own name: set one here when two sections get a field of the same name
# (flat_schema refuses a silent collision). None today.
FLAT_NAMES: Dict[str, str] = {}
# Composite flat keys: the offload choice is one word in the presets, the kwargs and Hydra ("optimizer",
# "params", "all"); OffloadConfig's own field names would be ambiguous next to the Hydra optimizer group.
COMPOSITES: Dict[str, FlatKey] = {"offload": FlatKey(("offload.optimizer", "offload.params"), str, "none")}
# Keywords the front doors take besides the schema: Zero3DStrategy(config=, precision=), Hydra strategy.name.
RESERVED = ("config", "precision", "name")
# Trainer flags that pre-training checks name: internal path "trainer.<flag>"; a bare flag in a message too.
TRAINER_FLAGS = ("gradient_clip_val", "gradient_clip_algorithm", "accumulate_grad_batches")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def sections(root: type = None) -> Dict[str, type]:
    """ParallelConfig's nested dataclass fields: {"zero": ZeroConfig, ...}."""
    root = root or ParallelConfig
    hints = typing.get_type_hints(root)
    return {f.name: hints[f.name] for f in fields(root) if dataclasses.is_dataclass(hints[f.name])}


def flat_schema(root: type = None, renames: Mapping[str, str] = FLAT_NAMES,
                composites: Mapping[str, FlatKey] = COMPOSITES) -> Dict[str, FlatKey]:
    """{flat name: FlatKey} for every field of ``root`` (top-level fields by name, nested ones by their field name
    or ``renames[path]``). Two paths on one flat name, or a flat name equal to a section / reserved name, raise
    ``TypeError`` unless declared (a composite or a rename)."""
    root = root or ParallelConfig
    secs, hints = sections(root), typing.get_type_hints(root)
    covered = {p for c in composites.values() for p in c.paths}
    keys: Dict[str, FlatKey] = {}

    def add(flat: str, key: FlatKey) -> None:
        clash = keys[flat].paths if flat in keys else ("a section" if flat in secs else
                                                     "a reserved keyword" if flat in RESERVED else None)
        if clash:
            raise TypeError(f"flat name {flat!r} of {key.paths} collides with {clash}; declare a distinct name "
                            "in lightning_scale.config.FLAT_NAMES")
        keys[flat] = key

    for f in fields(root):
        if f.name not in secs:
            add(renames.get(f.name, f.name), FlatKey((f.name,), hints[f.name], _default(f)))
            continue
        sub_hints = typing.get_type_hints(secs[f.name])
        for sf in fields(secs[f.name]):
            path = f"{f.name}.{sf.name}"
            if path not in covered:
                add(renames.get(path, sf.name), FlatKey((path,), sub_hints[sf.name], _default(sf)))
    for name, key in composites.items():
        if name in secs and all(p.startswith(name + ".") for p in key.paths):
            secs = {k: v for k, v in secs.items() if k != name}  # a section's own shorthand may take its name
        add(name, key)
    return keys


# ---------------------------------------------------------------------------------------------- the user's words
def flat_name(path: str) -> str:
    """Internal path -> the Python keyword (``zero.stage`` -> ``stage``, ``trainer.gradient_clip_val`` ->
    ``gradient_clip_val``)."""
    if path in _FLAT_OF:
        return _FLAT_OF[path]
    return path[len("trainer."):] if path.startswith("trainer.") else path


def hydra_key(path: str) -> str:
    """Internal path -> the Hydra key (``zero.stage`` -> ``strategy.stage``; ``sparsity_config.block`` ->
    ``attention.block``; ``trainer.*``, ``model.*`` and ``optimizer.*`` are Hydra keys already)."""
    if path in _FLAT_OF:
        return "strategy." + _FLAT_OF[path]
    if path.startswith("sparsity_config."):
        return "attention." + path[len("sparsity_config."):]
    return path


FLAT: Callable[[str], str] = flat_name
HYDRA: Callable[[str], str] = hydra_key


def _token_pattern(settings: Sequence[str]) -> "re.Pattern[str]":
    dotted = sorted((p for p in _FLAT_OF if "." in p), key=len, reverse=True)
    bare = sorted({p for p in _FLAT_OF if "." not in p} | set(TRAINER_FLAGS), key=len, reverse=True)
    anywhere = [re.escape(p) for p in dotted] + [r"trainer\.\w+", r"sparsity_config\.\w+"]
    anywhere += [re.escape(s) for s in settings if s not in dotted]
    # bare names (tp, offload, gradient_clip_val) are settings only where written name=value
    return re.compile(r"(?<![\w.])(?:(%s)(?!\w)|(%s)(?==(?!=)))" % ("|".join(anywhere), "|".join(bare)))


def _rename(message: str, namer: Callable[[str], str], settings: Sequence[str] = ()) -> str:
    def sub(m: "re.Match[str]") -> str:
        token = m.group(0)
        return namer(f"trainer.{token}" if token in TRAINER_FLAGS else token)

    return _token_pattern(settings).sub(sub, message)


@contextlib.contextmanager
def speaking(namer: Callable[[str], str]) -> Iterator[None]:
    """Re-raise a ConfigError from the body with its settings renamed by ``namer`` (``FLAT`` or ``HYDRA``);
    the innermost door wins, so an error is renamed once."""
    try:
        yield
    except ConfigError as err:
        if err.spoken:
            raise
        raise err.renamed(namer).with_traceback(err.__traceback__) from None


SCHEMA: Dict[str, FlatKey] = flat_schema()
_FLAT_OF: Dict[str, str] = {p: flat for flat, key in SCHEMA.items() for p in key.paths}
_FLAT_OF.update({name: name for name in COMPOSITES})  # the shorthand itself, e.g. "offload='gpu'"


# The registered strategy names (Lightning's StrategyRegistry; Fabric's too): flat keyword arguments on top of
# ParallelConfig's defaults, and the one-line description Lightning lists. conf/strategy/<name>.yaml agree.
PRESETS: Dict[str, tuple] = {
    "zero3d": ({}, "ZeRO data parallelism (stage 2 by default); tp/pp/offload by options"),
    "zero0": ({"stage": 0}, "ZeRO stage 0: bucketed all-reduce overlapped with backward (DDP)"),
    "zero1": ({"stage": 1}, "ZeRO stage 1: optimizer state and fp32 master weights sharded"),
    "zero2": ({"stage": 2}, "ZeRO stage 2: stage 1 + gradients reduce-scattered during backward"),
    "zero3": ({"stage": 3}, "ZeRO stage 3: stage 2 + parameters sharded, gathered per unit just in time"),
    "zero2_offload": ({"stage": 2, "offload": "optimizer"},
                      "ZeRO-Offload: stage 2 with fp32 masters, optimizer state and step on the CPU"),
    "zero3_offload": ({"stage": 3, "offload": "all"},
                      "ZeRO-Offload stage 3: optimizer on the CPU and parameter shards resting on the CPU"),
}


def from_flat_kwargs(**kwargs: Any) -> ParallelConfig:
    """A validated ParallelConfig from Zero3DStrategy-style flat keyword arguments (``stage=1, microbatches=4,
    offload="optimizer"``; ``SCHEMA`` lists them). Errors name the keyword as typed (``stage=5``); an unknown
    one lists the known options, close matches first."""
    with speaking(FLAT):
        return config_from_flat(kwargs).validate()


def config_from_flat(kwargs: Mapping[str, Any]) -> ParallelConfig:
    """The one builder behind every front door (kwargs, Hydra, presets); not validated, errors name paths."""
    secs = sections()
    top: Dict[str, Any] = {}
    nested: Dict[str, Dict[str, Any]] = {sec: {} for sec in secs}
    given: Dict[str, str] = {}  # path -> the key that set it
    for key, value in kwargs.items():
        if key in secs and key not in SCHEMA:  # a whole section: zero=ZeroConfig(...)
            top[key] = value
            continue
        if key not in SCHEMA:
            known = sorted(set(SCHEMA) | set(secs))
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            raise ConfigError(f"unknown option {key!r}; known options, close matches first: "
                              f"{', '.join(close + [k for k in known if k not in close])}")
        for path, v in SCHEMA[key].expand(value).items():
            if path in given:
                raise ConfigError(f"{given[path]}=... and {key}=... both set {path}; pass one of them")
            given[path] = key
            sec, _, name = path.partition(".")
            if name:
                nested[sec][name] = v
            else:
                top[sec] = v
    for sec, cls in secs.items():
        if nested[sec]:
            if sec in top:
                raise ConfigError(f"pass either {sec}=... or its fields ({', '.join(nested[sec])}), not both")
            top[sec] = cls(**nested[sec])
    return ParallelConfig(**top)


def _offload_from(value: Any) -> OffloadConfig:
    if isinstance(value, OffloadConfig):
        return value
    if value in (None, False, "none"):
        return OffloadConfig()
    if value == "optimizer":
        return OffloadConfig(optimizer="cpu")
    if value == "params":
        return OffloadConfig(params="cpu")
    if value in ("all", True):
        return OffloadConfig(optimizer="cpu", params="cpu")
    if isinstance(value, dict):
        return OffloadConfig(**value)
    raise ConfigError(f"offload={value!r}: use 'none', 'optimizer', 'params', 'all' or an OffloadConfig")


# ---------------------------------------------------------------------------------------------- pre-training checks
ONEBIT_NAMES = ("onebit_adam", "OneBitAdam")


def check_trainer_flags(config: ParallelConfig, *, optimizer: Optional[str] = None,
                        gradient_clip_val: Optional[float] = None) -> None:
    """What the layout cannot run with these Trainer flags / this optimizer, before training starts.

    ``optimizer``: the Hydra optimizer name or the optimizer's class name (``"onebit_adam"`` / ``"OneBitAdam"``).
    Raises ConfigError naming internal paths and ``trainer.<flag>``; the front door renames them.
    """
    if optimizer not in ONEBIT_NAMES:
        return
    stage = config.zero.stage
    if stage == 3:
        raise ConfigError("zero.stage=3: OneBitAdam supports ZeRO stages 0, 1, 2 (stage 3 keeps no full local "
                          "gradient to compress); use zero.stage <= 2, or another optimizer with stage 3")
    if config.ep > 1:
        raise ConfigError(f"ep={config.ep}: OneBitAdam reduces its own gradients over dp only (the experts' and the "
                          "whole parameters' gradients need their ep sums first); use an optimizer the ZeRO engine "
                          "wraps (e.g. AdamW)", settings=("ep",))
    if config.tp > 1 or config.pp > 1:
        raise ConfigError(f"tp={config.tp}, pp={config.pp}: OneBitAdam reduces its own gradients over dp only; "
                          "with tensor / pipeline parallelism use an optimizer the ZeRO engine wraps (e.g. AdamW)")
    if config.offload.enabled:
        raise ConfigError("offload.optimizer: OneBitAdam keeps its state and its step on the device (its engine "
                          "has no CPU offload); drop the offload or use AdamW", settings=("offload.optimizer",))
    if stage in (1, 2) and gradient_clip_val:
        raise ConfigError(
            f"trainer.gradient_clip_val={gradient_clip_val}: OneBitAdam with zero.stage={stage} cannot clip: after "
            "freeze_step the averaged gradient never exists (ranks exchange 1-bit momentum increments), and "
            "clipping each rank's local gradient is not clipping their mean. Unset trainer.gradient_clip_val "
            "(None; Hydra's optimizer=onebit_adam does), or use zero.stage=0 (each rank clips its local gradient)")
