"""Tiled MLP (ALST's "TiledMLP"): a position-wise feed-forward run over the sequence in tiles. Torch only.

``tile_mlps(module, tokens)`` replaces the forward of every unit's MLP (the child named ``mlp``, or the modules
``units`` names) with one that runs ``tokens`` positions at a time under no_grad and keeps only its input; the
backward recomputes one tile at a time and takes that tile's gradients. The MLP's ``4d``-wide hidden activations
then exist for one tile, never for the whole sequence: at long lengths they are the largest tensors of a block (two
of ``L x 4d`` plus their gradient, against ``L x d`` for its input), which activation checkpointing alone keeps for
the whole sequence while the unit's backward runs.

The result is exact: the MLP is position-wise, so each position's output and gradient are those of the untiled
MLP (the same ops on fewer rows; float64 parity in ``tests/unit/test_tiled_mlp.py``). Parameter gradients are
summed over the tiles inside one autograd node and reach each parameter **once** per backward, so ZeRO's
gradient-ready hooks (``register_post_accumulate_grad_hook``: buckets, ZeRO-3 reduce-scatter) fire once, as
without tiling (per-tile ``torch.utils.checkpoint`` calls would accumulate, and fire the hooks, once per tile).
Each tile's forward RNG state (dropout) and autocast state are restored for its recompute.

Composes with activation checkpointing (the unit's recompute runs the tiled forward again, which keeps only its
input), ZeRO-3 (the parameters are the gathered ones during the unit's forward and backward; read at backward
time, not saved), tensor parallelism (a tile repeats the MLP's tp collectives, in the same order on every tp rank)
and sequence parallelism (tiles of this rank's L / sp positions). In :func:`~lightning_scale.parallelize.parallelize`
it is part of the activation-checkpointing step (``tiled_mlp=TOKENS``), after tp and the pipeline cut, before ZeRO-3.
"""

from __future__ import annotations

import contextlib
import fnmatch
import types
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError

SEQ_DIM = -2  # (..., L, C): the MLP input's sequence dimension


def _rng_state(device: torch.device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    accel = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), accel


@contextlib.contextmanager
def _restored(state, device: torch.device, autocast: Tuple[bool, Any]):
    cpu, accel = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=True, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(cpu)
        if accel is not None:
            torch.cuda.set_rng_state(accel, device)
        enabled, dtype = autocast
        with torch.autocast(device.type, dtype=dtype, enabled=enabled), torch.enable_grad():
            yield


class _Tiled(torch.autograd.Function):
    """``y = cat(fn(x_tile) for each tile)``; backward recomputes tile by tile, parameter gradients summed."""

    @staticmethod
    def forward(ctx, fn, tokens: int, params: Sequence[nn.Parameter], source, x: torch.Tensor, *flat_params):
        ctx.fn, ctx.tokens, ctx.params = fn, tokens, list(params)  # read at backward time (ZeRO-3 swaps .data)
        dev = x.device
        ctx.autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        ctx.states, outs = [], []
        for tile in x.split(tokens, dim=SEQ_DIM):
            ctx.states.append(_rng_state(dev))
            outs.append(fn(tile))
        # ``source`` (a tiled norm's function, its input h): keep h, which the norm's node keeps anyway, instead of
        # x = norm(h); the backward recomputes each tile of x from h. Saved through save_for_backward, so that
        # activation checkpointing's hooks see it like any saved tensor.
        ctx.norm = source[0] if source is not None else None
        ctx.save_for_backward(source[1] if source is not None else x)
        return torch.cat(outs, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors  # the input, or the input of the tiled norm that made it (ctx.norm)
        params = ctx.params
        trainable = [p for p in params if p.requires_grad]
        grad_x = None
        grads: List[Optional[torch.Tensor]] = [None] * len(trainable)
        start = 0
        for tile, g, state in zip(x.split(ctx.tokens, dim=SEQ_DIM), grad.split(ctx.tokens, dim=SEQ_DIM), ctx.states):
            with _restored(state, x.device, ctx.autocast):
                if ctx.norm is not None:
                    with torch.no_grad():
                        tile = ctx.norm(tile)
                if grad_x is None and ctx.needs_input_grad[4]:  # the MLP input's shape / dtype (norm: its output)
                    grad_x = tile.new_empty(x.shape)
                tile = tile.detach().requires_grad_(grad_x is not None)
                out = ctx.fn(tile)
            inputs = ([tile] if grad_x is not None else []) + trainable
            got = torch.autograd.grad(out, inputs, g, allow_unused=True)
            if grad_x is not None:
                grad_x.narrow(SEQ_DIM, start, tile.shape[SEQ_DIM]).copy_(got[0])
                got = got[1:]
            for i, gi in enumerate(got):
                if gi is not None:
                    grads[i] = gi if grads[i] is None else grads[i].add_(gi)
            start += tile.shape[SEQ_DIM]
            del out, got
        by_id = {id(p): gi for p, gi in zip(trainable, grads)}
        param_grads = [by_id.get(id(p)) if p.requires_grad else None for p in params]
        return (None, None, None, None, grad_x, *param_grads)


def _tiled_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    inner = self.__dict__.get("_tiled_inner_forward") or type(self).forward.__get__(self)
    tokens = self._tiled_tokens
    if args or kwargs or not torch.is_tensor(x) or x.dim() < 2 or x.shape[SEQ_DIM] <= tokens or \
            not torch.is_grad_enabled():
        return inner(x, *args, **kwargs)  # short sequences / evaluation: nothing to save anyway
    params = [p for p in self.parameters()]
    apply = self.__dict__.get("_tiled_apply") or _Tiled.apply  # under compile: a deliberate graph break
    eager = "_tiled_apply" not in self.__dict__  # compiled units: no norm tiling, no tensor attributes
    source = x.__dict__.get(_SOURCE) if eager and getattr(self, "_tiled_mlp", None) is not None else None
    if source is not None and source[1].shape != x.shape:
        source = None
    out = apply(inner, tokens, params, source, x, *params)
    if eager and getattr(self, "_tiled_norm", None) is not None:
        out.__dict__[_SOURCE] = (inner, x)  # for the MLP this output feeds (if any): keep x, recompute the norm
    return out


_SOURCE = "_ls_tiled_norm_source"  # attribute of a tiled norm's output: (the norm's function, its input)
TILE_NORMS = True  # tile_mlps' default for ``norms`` (bench/long_sequence.py A/B-tests it)


def _is_norm(m: nn.Module) -> bool:
    """A position-wise normalization (LayerNorm, RMSNorm, HF's LlamaRMSNorm, ...): no Linear inside."""
    return "norm" in type(m).__name__.lower() and not any(isinstance(c, nn.Linear) for c in m.modules())


def _default_mlps(unit: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in unit.named_children() if n in ("mlp", "feed_forward", "ffn")]


def tile_mlps(module: nn.Module, tokens: int, mlps: Optional[Sequence[str]] = None,
              setting: str = "tiled_mlp", compiled: bool = False, norms: Optional[bool] = None) -> List[str]:
    """Tile the MLP of every unit of ``module`` over ``tokens`` positions (0 / None: nothing); returns their names.

    ``mlps``: module class names or fnmatch patterns on qualified names; None: the child named ``mlp`` (also
    ``feed_forward`` / ``ffn``) of each repeated block (the units of
    :func:`~lightning_scale.zero.param_shard.resolve_units`). A model where nothing matches, or a mixture-of-experts
    MLP (routing is position-wise, but its auxiliary load-balancing loss is not a per-position sum), is a
    ``ConfigError`` naming ``setting``. ``compiled``: the units will be compiled; the tiled region is then a
    deliberate graph break (``torch.compiler.disable``), the MLP's tiles run eager.

    ``norms`` (default :data:`TILE_NORMS`, True; not with ``compiled``): the normalization layers that are direct
    children of the tiled MLPs' parents (``ln1`` / ``ln2``; HF ``input_layernorm`` / ``post_attention_layernorm``)
    run tiled too: each keeps only its input (HF's RMSNorm would keep its float32 ``x * rsqrt`` as well), and an MLP
    fed by such a norm keeps the norm's input instead of its output, recomputing the norm per tile in its backward.
    Exact like the MLP's tiles (the norm is position-wise)."""
    if not tokens:
        return []
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"{setting}={tokens!r} must be a positive number of positions per tile (0: off)",
                          settings=(setting,))
    if mlps:
        found = [(n, m) for n, m in module.named_modules()
                 if any(type(m).__name__ == p or fnmatch.fnmatchcase(n, p) for p in mlps)]
    else:
        from lightning_scale.zero.units import resolve_units

        units = resolve_units(module, None, setting=setting)
        found = [(f"{un}.{n}" if un else n, m) for un, unit in units for n, m in _default_mlps(unit)]
    if not found:
        raise ConfigError(f"{setting}={tokens}: no MLP found to tile (a child named 'mlp', 'feed_forward' or 'ffn' "
                          "of each repeated block); name them in tiled_mlp_modules", settings=(setting,))
    for name, m in found:
        if any(hasattr(sub, "experts") or hasattr(sub, "gate") and hasattr(sub, "num_experts")
               for sub in m.modules()):
            raise ConfigError(f"{setting}={tokens}: {name} ({type(m).__name__}) is a mixture of experts, which "
                              "tiling does not support (its load-balancing loss spans the sequence)",
                              settings=(setting,))
        if getattr(m, "_tiled_mlp", None) is not None:
            raise ConfigError(f"{setting}={tokens}: {name} is tiled already", settings=(setting,))
        _wrap(m, tokens, "_tiled_mlp", compiled)
    if (TILE_NORMS if norms is None else norms) and not compiled:
        named = dict(module.named_modules())
        parents = {name.rpartition(".")[0] for name, _ in found}
        for parent in parents:
            for child in named[parent].children() if parent in named else ():
                if _is_norm(child) and getattr(child, "_tiled_tokens", None) is None:
                    _wrap(child, tokens, "_tiled_norm", compiled)
    return [name for name, _ in found]


def _wrap(m: nn.Module, tokens: int, kind: str, compiled: bool) -> None:
    setattr(m, kind, tokens)
    m._tiled_tokens = tokens
    m._tiled_inner_forward = m.__dict__.get("forward")  # None: the class' forward
    if compiled:
        m._tiled_apply = torch.compiler.disable(_Tiled.apply)
    m.forward = types.MethodType(_tiled_forward, m)


def tiled_mlps(module: nn.Module) -> List[str]:
    """Names of the submodules :func:`tile_mlps` wrapped (for reports and tests)."""
    return [n for n, m in module.named_modules() if getattr(m, "_tiled_mlp", None) is not None]


@contextlib.contextmanager
def tiled_unit(unit: nn.Module, tokens: int, norms: Optional[bool] = None):
    """``unit`` (one block) with its MLP children (``mlp`` / ``feed_forward`` / ``ffn``) and, with ``norms``
    (default :data:`TILE_NORMS`), its norm children tiled as :func:`tile_mlps` tiles them, restored on exit -- for
    the memory plan's profile of one unit (:mod:`lightning_scale.activation_profile`). A unit tiled already, or
    ``tokens`` 0, is used as it is."""
    wrapped: List[nn.Module] = []
    if tokens and not any(getattr(m, "_tiled_tokens", None) is not None for m in unit.modules()):
        for _, m in _default_mlps(unit):
            _wrap(m, tokens, "_tiled_mlp", False)
            wrapped.append(m)
        if wrapped and (TILE_NORMS if norms is None else norms):
            for child in unit.children():
                if _is_norm(child):
                    _wrap(child, tokens, "_tiled_norm", False)
                    wrapped.append(child)
    try:
        yield unit
    finally:
        for m in wrapped:
            inner = m.__dict__.pop("_tiled_inner_forward", None)
            del m.forward
            if inner is not None:
                m.forward = inner
            for attr in ("_tiled_mlp", "_tiled_norm", "_tiled_tokens"):
                m.__dict__.pop(attr, None)


def tiled_norms(module: nn.Module) -> List[str]:
    """Names of the normalization layers :func:`tile_mlps` tiled alongside the MLPs."""
    return [n for n, m in module.named_modules() if getattr(m, "_tiled_norm", None) is not None]


__all__ = ["TILE_NORMS", "tile_mlps", "tiled_mlps", "tiled_norms", "tiled_unit"]
