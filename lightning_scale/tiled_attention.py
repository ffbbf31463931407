"""Head-tiled attention: a block's attention run and recomputed a few heads at a time. Torch only.

At long lengths, once the MLP is tiled (:mod:`lightning_scale.tiled_mlp`) and the loss chunked, the largest tensors of
a checkpointed block's backward are its attention's: the fused ``q | k | v`` projection (``3 x L x d``), the core's
output, and the core's gradients ``dq, dk, dv`` (another ``3 x L x d``) -- about eight ``L x d`` tensors at once.
Every head's attention is independent of the others' until the output projection, so ``tile_attention(module, n)``
runs the projection to ``q, k, v`` and the core for ``n`` heads at a time under no_grad, keeping only the block's
input (or, when the norm before it is tiled, that norm's input: the norm is recomputed); the backward recomputes one
group of heads at a time and takes its gradients. Those eight tensors then exist for ``n / H`` of the heads.

The output projection runs whole, outside the tiled region (it mixes the heads). The result is exact: each head's
output and gradient are those of the untiled attention (its rows of the fused projection on the same input; float64
parity in ``tests/unit/test_tiled_attention.py``). Parameter gradients are summed over the groups inside one autograd
node and reach each parameter once per backward, so ZeRO's gradient-ready hooks fire once (the parameters are read at
backward time: the ZeRO-3 gathered ones). Each group's RNG and autocast state are restored for its recompute.

Which attention modules: those with ``heads(x, first, last)`` -- the output of heads ``[first, last)`` before the
output projection -- and ``n_head``: the project GPT's :class:`~lightning_scale.models.gpt.CausalSelfAttention`; and
unchanged Hugging Face attentions with separate ``q_proj / k_proj / v_proj / o_proj`` Linear layers (Llama, Mistral,
Qwen2/3, Gemma, ...): their own forward runs once per group with the projections restricted to the group's rows
(whole key/value heads per group under grouped-query attention: the group size rounds up to a multiple of the query
heads per key/value head) and ``o_proj`` passing its input through; ``o_proj`` then runs once on the concatenation.
Their KV cache is turned off (``use_cache=False``), as for activation checkpointing. Composes with activation checkpointing (a recompute runs the tiled forward again), ZeRO 0-3, pipeline stages and
Ulysses sequence parallelism (each group's core does its own all-to-alls, ``n`` -- for a Hugging Face GQA attention the
group after its round-up -- a multiple of sp; the Ulysses attention function repeats a group's key/value heads as it
does the whole layer's when sp does not divide them), and with a block-sparse core (each group runs the layout of its own heads). Not with tensor parallelism: the tp projection
carries its own collectives, which the sliced projection would skip (a ``ConfigError``). In
:func:`~lightning_scale.parallelize.parallelize` it is part of the activation-checkpointing step
(``tiled_attention=HEADS``), after sp, before ZeRO-3.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import types
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.tiled_mlp import _SOURCE, _restored, _rng_state


class _HeadTiled(torch.autograd.Function):
    """``y = cat(heads(x, a, b) for each group (a, b))`` on the last dim; backward recomputes group by group."""

    @staticmethod
    def forward(ctx, heads, groups, params: Sequence[nn.Parameter], source, x: torch.Tensor, *flat_params):
        ctx.heads, ctx.groups, ctx.params = heads, list(groups), list(params)  # read at backward time (ZeRO-3)
        dev = x.device
        ctx.autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        ctx.states, outs = [], []
        for first, last in ctx.groups:
            ctx.states.append(_rng_state(dev))
            outs.append(heads(x, first, last))
        # a tiled norm made x (source = its function and input h): keep h, kept by the norm anyway, not x = norm(h)
        ctx.norm = source[0] if source is not None else None
        ctx.save_for_backward(source[1] if source is not None else x)
        return torch.cat(outs, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        if ctx.norm is not None:
            with _restored(ctx.states[0], x.device, ctx.autocast), torch.no_grad():
                x = ctx.norm(x)  # once for all groups (position-wise: no RNG)
        trainable = [p for p in ctx.params if p.requires_grad]
        need_x = ctx.needs_input_grad[4]
        x = x.detach().requires_grad_(need_x)
        grad_x: Optional[torch.Tensor] = None
        grads: List[Optional[torch.Tensor]] = [None] * len(trainable)
        col = 0
        for (first, last), state in zip(ctx.groups, ctx.states):
            with _restored(state, x.device, ctx.autocast):
                out = ctx.heads(x, first, last)
            g = grad.narrow(-1, col, out.shape[-1])
            col += out.shape[-1]
            got = torch.autograd.grad(out, ([x] if need_x else []) + trainable, g, allow_unused=True)
            if need_x:
                grad_x = got[0] if grad_x is None else grad_x.add_(got[0])
                got = got[1:]
            for i, gi in enumerate(got):
                if gi is not None:
                    grads[i] = gi if grads[i] is None else grads[i].add_(gi)
            del out, got
        by_id = {id(p): gi for p, gi in zip(trainable, grads)}
        param_grads = [by_id.get(id(p)) if p.requires_grad else None for p in ctx.params]
        return (None, None, None, None, grad_x, *param_grads)


def _tiled_heads(self: nn.Module, x: torch.Tensor, first: int = 0, last: Optional[int] = None) -> torch.Tensor:
    inner = type(self).heads.__get__(self)
    n_head = self.n_head
    per = self._tiled_heads_per
    whole = first == 0 and last in (None, n_head)
    if not whole or n_head <= per or not torch.is_grad_enabled() or not torch.is_tensor(x):
        return inner(x, first, last)
    groups = [(a, min(a + per, n_head)) for a in range(0, n_head, per)]
    params = [p for n, p in self.named_parameters() if not n.startswith(self._tiled_skip)]
    apply = self.__dict__.get("_tiled_apply") or _HeadTiled.apply
    eager = "_tiled_apply" not in self.__dict__
    source = x.__dict__.get(_SOURCE) if eager else None
    if source is not None and source[1].shape != x.shape:
        source = None
    return apply(inner, groups, params, source, x, *params)


# ------------------------------------------------------------------ Hugging Face attentions (q/k/v/o projections)
_HF_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def _hf_layout(m: nn.Module) -> Optional[Tuple[int, int, int]]:
    """(query heads, key/value heads, head size) of a Hugging Face attention with separate ``q/k/v/o_proj`` Linear
    layers whose only other parameters are per-head norms (``q_norm`` / ``k_norm``); None for anything else."""
    cfg = getattr(m, "config", None)
    if cfg is None or not all(type(getattr(m, n, None)) is nn.Linear for n in _HF_PROJ):
        return None
    if any(not (n.split(".")[0] in _HF_PROJ or "norm" in n.split(".")[0]) for n, _ in m.named_parameters()):
        return None  # e.g. attention sinks: a parameter per head that slicing the projections would not follow
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(m, "head_dim", None) or getattr(cfg, "head_dim", None)
    if not heads or not dim or m.q_proj.out_features != heads * dim or m.k_proj.out_features != kv * dim:
        return None
    return heads, kv, dim


def _rows(linear: nn.Linear, first: int, last: int):
    """``linear`` restricted to its output rows ``[first, last)``, reading the weight at call time (ZeRO-3)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = linear.bias[first:last] if linear.bias is not None else None
        return torch.nn.functional.linear(x, linear.weight[first:last], bias)
    return forward


@contextlib.contextmanager
def _hf_heads_only(m: nn.Module, first: int, last: int, kv_first: int, kv_last: int, dim: int):
    """Inside: ``m``'s projections give heads ``[first, last)`` (and their key/value heads) only, and ``o_proj``
    passes its input through, so ``m``'s own forward returns those heads' attention before the output projection."""
    saved = {n: getattr(m, n).__dict__.get("forward") for n in _HF_PROJ}
    m.q_proj.forward = _rows(m.q_proj, first * dim, last * dim)
    m.k_proj.forward = _rows(m.k_proj, kv_first * dim, kv_last * dim)
    m.v_proj.forward = _rows(m.v_proj, kv_first * dim, kv_last * dim)
    m.o_proj.forward = lambda x: x
    try:
        yield
    finally:
        for n, f in saved.items():
            del getattr(m, n).forward
            if f is not None:
                getattr(m, n).forward = f


def _hf_tiled_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    inner = self.__dict__.get("_tiled_inner_forward") or type(self).forward.__get__(self)
    heads, kv, dim = self._tiled_layout
    per = self._tiled_heads_per
    if heads <= per or not torch.is_grad_enabled() or not torch.is_tensor(hidden_states) or \
            kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return inner(hidden_states, *args, **kwargs)
    group = heads // kv  # query heads per key/value head: a group of heads takes whole key/value heads

    def run(x: torch.Tensor, first: int, last: int) -> torch.Tensor:
        with _hf_heads_only(self, first, last, first // group, last // group, dim):
            out = inner(x, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    groups = [(a, min(a + per, heads)) for a in range(0, heads, per)]
    params = [p for n, p in self.named_parameters() if not n.startswith("o_proj.")]
    apply = self.__dict__.get("_tiled_apply") or _HeadTiled.apply
    source = hidden_states.__dict__.get(_SOURCE) if "_tiled_apply" not in self.__dict__ else None
    if source is not None and source[1].shape != hidden_states.shape:
        source = None
    y = apply(run, groups, params, source, hidden_states, *params)
    return self.o_proj(y), None


def _wrap(name: str, m: nn.Module, heads: int, setting: str, compiled: bool) -> None:
    """Tile ``m``: the project GPT's attention through its ``heads`` method, a Hugging Face one through its forward
    with sliced projections; anything else is a ConfigError naming ``setting``."""
    # Compiled: the whole tiled entry is a graph break, not only the autograd node. Traced, Dynamo rebuilt the
    # per-group closure with the module's own forward looked up as ``self.forward`` -- the tiled one: the backward's
    # recompute of a Hugging Face attention tiled itself again and returned every head ("start (32) + length (32)
    # exceeds dimension size (32)").
    eager = torch.compiler.disable if compiled else (lambda fn: fn)
    if callable(getattr(type(m), "heads", None)) and isinstance(getattr(m, "n_head", None), int):
        m._tiled_heads_per = heads
        m._tiled_skip = getattr(m, "tiled_skip", "proj.")  # parameters outside the tiled region (output projection)
        m.heads = eager(types.MethodType(_tiled_heads, m))
    elif _hf_layout(m) is not None:
        layout = _hf_layout(m)
        group = layout[0] // layout[1]
        m._tiled_heads_per = -(-heads // group) * group  # whole key/value heads per group of query heads
        m._tiled_layout = layout
        m._tiled_inner_forward = m.__dict__.get("forward")
        m.forward = eager(types.MethodType(_hf_tiled_forward, m))
    else:
        raise ConfigError(f"{setting}={heads}: {name} ({type(m).__name__}) has no head-tiled path (the project GPT's "
                          "attention, or a Hugging Face attention with separate q_proj / k_proj / v_proj / o_proj "
                          "Linear layers); leave tiled_attention at 0 for this model", settings=(setting,))
    if compiled:
        m._tiled_apply = torch.compiler.disable(_HeadTiled.apply)


def _unwrap(m: nn.Module) -> None:
    inner = m.__dict__.pop("_tiled_inner_forward", None)
    if "_tiled_layout" in m.__dict__:
        del m.forward
        if inner is not None:
            m.forward = inner
    for attr in ("heads", "_tiled_heads_per", "_tiled_skip", "_tiled_apply", "_tiled_layout"):
        m.__dict__.pop(attr, None)


def _default_attention(unit: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in unit.named_children() if n in ("attn", "attention", "self_attn")]


def tile_attention(module: nn.Module, heads: int, modules: Optional[Sequence[str]] = None,
                   setting: str = "tiled_attention", compiled: bool = False) -> List[str]:
    """Run the attention of every unit of ``module`` ``heads`` heads at a time (0 / None: nothing); returns the names.

    ``modules``: class names or fnmatch patterns on qualified names; None: the child named ``attn`` (``attention``,
    ``self_attn``) of each repeated block. An attention without the head-tiled path (``heads(x, first, last)``), one
    whose projection is tensor-parallel, a head count the groups cannot split evenly under sequence parallelism, or a
    model where nothing matches, is a ``ConfigError`` naming ``setting``. ``compiled``: the tiled region is a
    deliberate graph break (``torch.compiler.disable``)."""
    if not heads:
        return []
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ConfigError(f"{setting}={heads!r} must be a positive number of heads per group (0: off)",
                          settings=(setting,))
    if modules:
        found = [(n, m) for n, m in module.named_modules()
                 if any(type(m).__name__ == p or fnmatch.fnmatchcase(n, p) for p in modules)]
    else:
        from lightning_scale.zero.units import resolve_units

        units = resolve_units(module, None, setting=setting)
        found = [(f"{un}.{n}" if un else n, m) for un, unit in units for n, m in _default_attention(unit)]
    if not found:
        raise ConfigError(f"{setting}={heads}: no attention found to tile (a child named 'attn', 'attention' or "
                          "'self_attn' of each repeated block)", settings=(setting,))
    sp = max([getattr(m, "_lightning_scale_sp", 1) for m in module.modules()] + [1])
    from lightning_scale.activation_checkpointing import kv_cache_off

    kv_cache_off(module)  # a Hugging Face model: no KV cache in training (a cache passed in runs untiled)
    for name, m in found:
        qkv = getattr(m, "qkv", None)
        if qkv is not None and type(qkv) is not nn.Linear:
            raise ConfigError(f"{setting}={heads}: {name}.qkv is a {type(qkv).__name__} (tensor parallelism?); "
                              "head tiling slices a plain Linear projection and would skip the tp collectives",
                              settings=(setting, "tp"))
        from lightning_scale.nn.sparse_attention import SparseSelfAttention

        if sp > 1 and isinstance(getattr(m, "core", None), SparseSelfAttention):
            raise ConfigError(f"{setting}={heads}: {name} has a block-sparse core inside the sequence-parallel "
                              "all-to-alls, which head tiling does not split; use one of them",
                              settings=(setting, "sp"))
        if getattr(m, "_tiled_heads_per", None) is not None:
            raise ConfigError(f"{setting}={heads}: {name} is tiled already", settings=(setting,))
        _wrap(name, m, heads, setting, compiled)
        per = m._tiled_heads_per  # a Hugging Face GQA group rounds up to whole key/value heads
        if sp > 1 and per % sp:  # each group goes through the sequence-parallel all-to-all
            _unwrap(m)
            if per == heads:
                raise ConfigError(f"{setting}={heads} is not a multiple of sp={sp}: each group of heads goes through "
                                  "the sequence-parallel all-to-all, which splits its heads over the sp ranks",
                                  settings=(setting, "sp"))
            raise ConfigError(f"{setting}={heads}: {name}'s groups take whole key/value heads, {per} query heads "
                              f"each, not a multiple of sp={sp} (each group goes through the sequence-parallel "
                              f"all-to-all); use a multiple of {math.lcm(per, sp)}", settings=(setting, "sp"))
    return [name for name, _ in found]


def tiled_attentions(module: nn.Module) -> List[str]:
    """Names of the attention modules :func:`tile_attention` wrapped (for reports and tests)."""
    return [n for n, m in module.named_modules() if getattr(m, "_tiled_heads_per", None) is not None]


@contextlib.contextmanager
def tiled_attention_unit(unit: nn.Module, heads: int):
    """``unit`` (one block) with its attention child tiled ``heads`` heads at a time, restored on exit -- for the
    memory plan's profile of one unit. A unit tiled already, ``heads`` 0, or a unit whose attention has no head-tiled
    path (the plan then profiles it as it runs: untiled) is used as it is."""
    wrapped: List[nn.Module] = []
    if heads and not any(getattr(m, "_tiled_heads_per", None) is not None for m in unit.modules()):
        for name, m in _default_attention(unit):
            try:
                _wrap(name, m, heads, "tiled_attention", False)
            except ConfigError:
                continue  # no head-tiled path: profiled as it runs, untiled
            wrapped.append(m)
    try:
        yield unit
    finally:
        for m in wrapped:
            _unwrap(m)


__all__ = ["tile_attention", "tiled_attention_unit", "tiled_attentions"]
