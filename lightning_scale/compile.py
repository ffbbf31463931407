"""torch.compile per unit: ``compile_units(module, True | {torch.compile options}, units)``. Torch only.

Each unit (every repeated block by default: the modules ZeRO-3 makes its units and activation checkpointing wraps,
found by the same :func:`~lightning_scale.zero.param_shard.resolve_units`) gets its forward compiled, torchtitan
style, so everything that happens *at* unit boundaries stays eager and outside the graphs:

* ZeRO-3's gathers, frees, prefetches and gradient reduce-scatters are module hooks around the unit's ``forward``
  (``Module.__call__`` runs them, then the compiled forward);
* activation checkpointing wraps the unit's forward: the compiled function is the *inner* forward that the
  checkpoint runs (and runs again in the backward), so the recompute is compiled code too;
* inside a unit, tensor parallelism's collectives (and every collective of :mod:`lightning_scale.comm`) are
  deliberate graph breaks (``torch.compiler.disable``): a tp block compiles to a few graphs between its
  all-reduces, and the collectives' byte accounting and hang watchdog keep working.

All units share one code object (``Block.forward``), and parameters are graph inputs (torch >= 2.5 inlines
``nn.Module`` s), so N identical blocks compile once, not N times. The module tree is unchanged (parameter names,
state-dict keys, checkpoints and plans are the eager run's). In ``parallelize()`` this is the last step.

:func:`compile_stats` reads Dynamo's counters (graphs compiled, graph breaks by reason) for the startup report and
for tests that check no recompilation happens after the first steps.

A user's own ``torch.compile(submodule)`` inside ``configure_model`` (:func:`unwrap_compiled`): the wrapper is removed
(names without ``_orig_mod.``) and the units are compiled with the user's backend and options instead, the same
per-unit placement as ``compile=True``; whatever lies outside the units (embeddings, head, loss) then runs eagerly.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from lightning_scale.config import COMPILE_OPTIONS, ConfigError, _check_compile

CompileSetting = Union[bool, Mapping[str, Any], None]


def compile_options(setting: CompileSetting) -> Optional[Dict[str, Any]]:
    """``False`` / ``None`` -> None (off); ``True`` -> {} (torch.compile's defaults: inductor); a dict -> its
    options (checked as ``ParallelConfig.validate`` does, and the backend against Dynamo's registry)."""
    _check_compile(setting)
    if setting is None or setting is False:
        return None
    if setting is True:
        return {}
    backend = setting.get("backend", "inductor")
    if isinstance(backend, str):
        import torch._dynamo

        known = sorted(set(torch._dynamo.list_backends(exclude_tags=()) + ["inductor", "eager"]))
        if backend not in known:
            raise ConfigError(f"compile: unknown torch.compile backend {backend!r}; known: {', '.join(known)}")
    return dict(setting)


def unwrap_compiled(module: nn.Module) -> Optional[Callable]:
    """A user's own ``torch.compile(submodule)`` (e.g. ``self.model = torch.compile(GPT(...))`` in
    ``configure_model``): each such wrapper is replaced by the module it wraps, so parameter names, plans and
    checkpoints are the plain model's (no ``_orig_mod.``), and its Dynamo context (the backend and options the user
    chose) is returned, for :func:`compile_units` to compile the units with instead. None: nothing was compiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = None
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, OptimizedModule):
                setattr(parent, name, child._orig_mod)
                found = found or getattr(child, "dynamo_ctx", None) or torch.compile
    return found


def compile_units(module: nn.Module, setting: CompileSetting, units: Optional[Sequence[str]] = None,
                  setting_units: str = "zero.unit_modules", compiler: Optional[Callable] = None) -> List[str]:
    """Compile the forward of every unit of ``module`` (``setting``: True or torch.compile options; off: nothing
    happens); returns the units' names. ``units`` as ``zero.unit_modules`` (None: every repeated block).
    ``compiler``: a callable that compiles a function (a user's own torch.compile context, :func:`unwrap_compiled`),
    used when ``setting`` is off."""
    options = compile_options(setting)
    if options is None and compiler is None:
        return []
    from lightning_scale.activation_checkpointing import kv_cache_off
    from lightning_scale.zero.units import resolve_units

    found = resolve_units(module, list(units) if units else None, setting=setting_units)
    if not found:
        raise ConfigError("compile=True: the model has no repeated block to compile per unit (no layer_modules(), "
                          f"no ModuleList of one class); name the units in {setting_units}",
                          settings=("compile", setting_units))
    # A Hugging Face KV cache in a training forward hands each layer its own cache slot (``cache.layers[idx]``):
    # Dynamo guards on it, so every layer compiled its own graph, and past torch's recompile limit (8) the remaining
    # layers ran eagerly (a 12-layer Llama: 8 graphs + 4 eager layers). Training reads no cache: off, as under
    # activation checkpointing.
    kv_cache_off(module)
    if options is not None:
        options = dict(_recompile_limit(len(found)), **options)
    wrap = (lambda fn: torch.compile(fn, **options)) if options is not None else compiler
    for _, unit in found:
        if getattr(unit, "_ls_compiled", False):
            raise ConfigError(f"compile: {type(unit).__name__} is compiled already")
        if getattr(unit, "_activation_checkpointing", None) is not None:
            # The checkpoint stays eager around the compiled inner forward (and its recompute).
            inner = unit.__dict__.get("_ac_inner_forward") or types.MethodType(type(unit).forward, unit)
            unit._ac_inner_forward = wrap(inner)
        else:
            inner = unit.forward
            unit.forward = wrap(inner)  # an instance attribute: the class is untouched
        # The uncompiled forward, for code that runs a unit under a TorchDispatchMode (the memory plan's profile on
        # fake tensors): Dynamo skips a frame it first meets under such a mode, and marks its code object skipped
        # for good, so every later call of the compiled unit ran eagerly, and silently (a Hugging Face layer with
        # activation checkpointing: 0 graphs in the Trainer).
        unit._ls_eager_forward = inner
        unit._ls_compiled = True
    return [name for name, _ in found]


def eager_forward(unit: nn.Module) -> Callable:
    """The forward of ``unit`` without torch.compile and without activation checkpointing: what a profiler calls."""
    fn = unit.__dict__.get("_ls_eager_forward") or unit.__dict__.get("_ac_inner_forward")
    return fn if fn is not None else types.MethodType(type(unit).forward, unit)


def _code_of(fn: Any) -> Optional[types.CodeType]:
    """The code object Dynamo compiles for ``fn`` (a function, bound method or functools.partial of one)."""
    for _ in range(8):
        if isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif hasattr(fn, "func") and callable(fn.func):  # functools.partial
            fn = fn.func
        else:
            break
    return getattr(fn, "__code__", None)


def units_running_eagerly(module: nn.Module) -> Optional[List[str]]:
    """Names of the compiled units of ``module`` whose forward code has no compiled entry in Dynamo's cache (after
    they ran: they ran eagerly, e.g. because Dynamo skipped their code for good). None where this torch cannot tell."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - older torch
        return None
    out = []
    for name, unit in module.named_modules():
        if not getattr(unit, "_ls_compiled", False):
            continue
        code = _code_of(unit.__dict__.get("_ls_eager_forward"))
        if code is not None and not _debug_get_cache_entry_list(code):
            out.append(name)
    return out


def compiled_units(module: nn.Module) -> List[str]:
    return [n for n, m in module.named_modules() if getattr(m, "_ls_compiled", False)]


def _recompile_limit(units: int) -> Dict[str, int]:
    """``recompile_limit`` for ``torch.compile`` of ``units`` units sharing one code object: at least one graph per
    unit, so units that do specialize (a per-layer attribute Dynamo guards on) are all compiled instead of the ones
    past the process default (8) silently running eagerly. {} where torch.compile has no such argument (torch < 2.9:
    :func:`compile_stats` still reports a limit hit)."""
    import inspect

    if "recompile_limit" not in inspect.signature(torch.compile).parameters:
        return {}
    import torch._dynamo.config as dynamo_config

    return {"recompile_limit": max(int(getattr(dynamo_config, "recompile_limit", 8)), units)}


def _limit_hits(counters) -> int:
    """Code objects Dynamo stopped compiling because they hit its recompile (cache size) limit: they run eagerly."""
    marks = ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")
    return int(sum(n for reason, n in counters["unimplemented"].items() if any(m in reason.lower() for m in marks)))


def compile_stats() -> Dict[str, Any]:
    """Dynamo's process-wide counters: graphs compiled so far, graph breaks in total and by (shortened) reason, and
    ``eager_fallbacks``: code objects that hit Dynamo's recompile limit (from then on they run eagerly: a unit of a
    model that specializes per layer, under a user's own ``torch.compile`` whose limit was not raised)."""
    from torch._dynamo.utils import counters

    breaks: Dict[str, int] = {}
    for reason, n in counters["graph_break"].items():  # reasons that differ past their first line are summed
        short = reason.split("\n")[0][:120]
        breaks[short] = breaks.get(short, 0) + int(n)
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())), "break_reasons": breaks,
            "eager_fallbacks": _limit_hits(counters)}


__all__ = ["COMPILE_OPTIONS", "compile_options", "compile_stats", "compile_units", "compiled_units", "eager_forward",
           "units_running_eagerly", "unwrap_compiled"]
