"""What one unit (transformer block) keeps for its backward, measured by running it on fake tensors.

:func:`profile_unit` runs the unit's own forward (the original one, also when it is checkpointed) on
``FakeTensorMode`` CPU tensors of shape ``(1, tokens, hidden)``: no memory, no compute, the real kernels'
choices (e.g. CPU flash attention saves ``out`` and the log-sum-exp, not the ``T x T`` scores). A
``saved_tensors_hooks`` pair records every storage autograd saves (parameters excluded: they are model states);
a dispatch mode records which op made each storage and whether it was made inside a tensor-parallel region.
Then ``autograd.grad`` w.r.t. the unit's input runs under a live-storage counter that starts from the saved set and
sees it shrink as the backward frees it: the most bytes alive above the full saved set is the unit's backward
working set (activation gradients, temporaries).

Tensor-parallel regions (a heuristic; the plan's formulas are in :mod:`lightning_scale.activation_plan`): a storage made inside a
direct child of the unit that owns ``nn.Linear`` layers (``attn`` / ``mlp``; HF ``self_attn`` / ``mlp``) is
split over tp ranks; what the norms and the residual stream make is replicated. Pass ``tp=1`` for a unit that
is already tp-sliced (its shapes are local).

Everything is per token (bytes / tokens), in the dtype the unit is profiled in (float32).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _norm_size(m: nn.Module) -> Optional[int]:
    shape = getattr(m, "normalized_shape", None)
    if shape is None and "norm" in type(m).__name__.lower():
        weight = getattr(m, "weight", None)
        shape = tuple(weight.shape) if weight is not None else None
    return int(shape[-1]) if shape else None


def hidden_size(unit: nn.Module) -> Optional[int]:
    """The unit's input width: the normalized size of its first own norm (a child: the block's input norm, not a
    per-head q/k norm inside its attention as in Qwen3 / Gemma3), else of the first norm inside it, else the first
    Linear's in_features."""
    for m in list(unit.children()) + list(unit.modules()):
        size = _norm_size(m)
        if size:
            return size
    for m in unit.modules():
        if isinstance(m, nn.Linear):
            return int(m.in_features)
    return None


class _Tracker(TorchDispatchMode):
    """Storage -> (bytes, producing op, made inside a tp region); and live bytes above a base while counting."""

    def __init__(self, saved_ops: frozenset) -> None:
        super().__init__()
        self.saved_ops = saved_ops
        self.made: Dict[int, tuple] = {}  # key -> (nbytes, op is a selective-checkpoint saved op, in tp region)
        # every output storage of a selective-checkpoint saved op (bytes, in a tp region): selective checkpointing
        # keeps them all alive, while here some die at once and their keys get reused, so they are listed as made
        self.selected: list = []
        self._selected_live: Dict[int, Any] = {}
        self.selecting = True
        self.region = 0
        self.counting = False
        self.live: Dict[int, tuple] = {}
        self.current = self.peak = 0

    def _sweep(self) -> None:
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(k)[1]

    def track(self, tensors) -> None:
        for t in tensors:
            s = t.untyped_storage()
            if s._cdata not in self.live:
                self.live[s._cdata] = (StorageWeakRef(s), s.nbytes())
                self.current += s.nbytes()
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outs:
            key = t.untyped_storage()._cdata
            if key not in inputs and key not in self.made:
                # the selective policy keeps a saved op's outputs only with grad mode on (activation_checkpointing)
                kept = func in self.saved_ops and torch.is_grad_enabled()
                self.made[key] = (t.untyped_storage().nbytes(), kept, self.region > 0)
            if self.selecting and func in self.saved_ops and torch.is_grad_enabled() and key not in inputs:
                ref = self._selected_live.get(key)
                if ref is None or ref.expired():  # a new storage (not another view of a listed one)
                    self._selected_live[key] = StorageWeakRef(t.untyped_storage())
                    self.selected.append((t.untyped_storage().nbytes(), self.region > 0, key,
                                          self._selected_live[key]))
        if self.counting:
            self._sweep()
            self.track([t for t in outs if t.untyped_storage()._cdata not in inputs])
        return out


def _rotary_inputs(unit: nn.Module, tokens: int) -> Dict[str, Any]:
    """``position_embeddings=(cos, sin)`` of shape ``(1, tokens, head_dim)`` for a unit whose forward takes them
    (Hugging Face decoder layers: the model computes them once and hands them to every layer), else nothing.
    Called inside the fake mode; the attention mask stays None (causal sdpa, as the model's own mask for a
    full-length batch)."""
    import inspect

    def takes(m: nn.Module) -> bool:
        try:
            return "position_embeddings" in inspect.signature(type(m).forward).parameters
        except (TypeError, ValueError):
            return False

    # the layer's own signature, or (GPT-NeoX: the layer passes **kwargs on) its attention's
    if not takes(unit) and not any(takes(c) for c in unit.children()):
        return {}
    # the rotary width: the attention's rotary_ndims under partial rotary (GPT-NeoX), else its head_dim; the attention's
    # first (Falcon-H1's layer holds a Mamba mixer with a head_dim of its own before its attention)
    modules = sorted(unit.modules(), key=lambda m: "Attention" not in type(m).__name__)
    dims = [getattr(m, "rotary_ndims", None) or getattr(m, "head_dim", None) for m in modules]
    dim = next((int(d) for d in dims if isinstance(d, int)), None)
    if dim is None and not any("Attention" in type(m).__name__ for m in modules):
        dim = 2  # a layer without attention that takes them anyway (Qwen 3.5's gated DeltaNet layers): unused
    if dim is None:
        return {}
    types = {getattr(getattr(m, "config", None), "model_type", None) for m in unit.modules()}
    if types & set(_COMPLEX_ROTARY):  # Llama 4: one complex table (1, tokens, head_dim / 2), not (cos, sin)
        return {"position_embeddings": torch.empty(1, tokens, dim // 2, dtype=torch.complex64)}
    if types & set(_HALF_ROTARY):
        dim //= 2
    return {"position_embeddings": (torch.empty(1, tokens, dim), torch.empty(1, tokens, dim))}


def _stream_inputs(unit: nn.Module, tokens: int, hidden: int):
    """(input, keyword inputs) for a DeepSeek-V4 / Hunyuan 4 decoder layer, else None: its input is the residual's
    ``hc_mult`` streams ``(1, tokens, hc, hidden)``; DeepSeek-V4's base model hands every layer a rotary table per kind
    (``main`` / ``compress``: ``qk_rope_head_dim / 2`` entries per position, its interleaved pairs), the positions and
    the token ids (its hash-routed layers pick experts by id), Hunyuan 4's its causal mask (its indexer reads it) and the
    previous layer's top-k picks (its shared layers reuse them). Called inside the fake mode."""
    carry = getattr(unit, "carry", None)  # a pipeline stage's layer (hf_pipeline.HFDecoderLayer): what its stages
    if carry is not None and not getattr(carry, "plain", True):  # carry, from which it builds the rest itself
        return torch.empty(1, tokens, carry.channels, requires_grad=True), {}
    from lightning_scale.models.hf_pipeline import _STREAMS  # the families whose layers take several streams

    config = next((c for m in unit.modules() if getattr(c := getattr(m, "config", None), "model_type", None)
                   in _STREAMS), None)
    if config is None or not isinstance(getattr(config, "hc_mult", None), int):
        return None
    x = torch.empty(1, tokens, config.hc_mult, hidden, requires_grad=True)
    positions = torch.arange(tokens).unsqueeze(0)
    if config.model_type == "hy_v4":  # its streams, its rotary table (the family's own module, on fake tensors: its
        # interleaved layout) and the previous layer's top-k picks (its shared layers read them)
        import sys

        family = vars(sys.modules[type(unit).__module__])
        rotary = next(v for k, v in family.items() if k.endswith("RotaryEmbedding") and isinstance(v, type))(config)
        picks = torch.zeros(1, tokens, min(config.index_topk, tokens), dtype=torch.int32)
        table = rotary(torch.empty(1, tokens, hidden), positions)
        causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]  # its base model always builds it
        return x, dict(prev_topk_indices=picks, position_ids=positions, position_embeddings=table,
                       attention_mask=causal)
    half = config.qk_rope_head_dim // 2
    tables = {kind: (torch.empty(1, tokens, half), torch.empty(1, tokens, half)) for kind in ("main", "compress")}
    return x, dict(position_embeddings=tables, position_ids=positions, input_ids=torch.zeros(1, tokens, dtype=torch.long))


# families whose rotary embedding is one complex tensor (freqs_cis), not a (cos, sin) pair
_COMPLEX_ROTARY = ("llama4_text",)
# families whose (cos, sin) cover half the head (the rotation applied to its two halves): GPT-OSS
_HALF_ROTARY = ("gpt_oss",)


def _mask_inputs(unit: nn.Module, tokens: int) -> Dict[str, Any]:
    """``attention_mask``: a whole ``(1, 1, tokens, tokens)`` boolean mask for a Hugging Face layer whose attention has a
    sliding window (or Llama 4's attention chunk) shorter than ``tokens`` -- the model then builds one explicit mask
    (the window) instead of plain
    causal attention, and sdpa runs with it (on a CPU its math path: a score matrix per head); else nothing. Called
    inside the fake mode."""
    def window(m: nn.Module):
        own = getattr(m, "sliding_window", None)
        cfg = getattr(m, "config", None)
        if own is not None or cfg is None or getattr(cfg, "use_sliding_window", True) is False:
            return own
        if "Attention" not in type(m).__name__:  # another module holding the config (Gemma 4's MLP): no window of its
            return None  # own; taking the config's made every layer of a sliding / full mix masked (Gemma 4 1.46x over)
        types, idx = getattr(cfg, "layer_types", None), getattr(m, "layer_idx", None)
        if types is not None and isinstance(idx, int) and idx < len(types):  # mixed layers: this one's type
            if types[idx] == "chunked_attention":  # Llama 4: attention within chunks, an explicit mask too
                return getattr(cfg, "attention_chunk_size", None)
            return getattr(cfg, "sliding_window", None) if types[idx] == "sliding_attention" else None
        return getattr(cfg, "sliding_window", None)  # Mistral: every layer

    windows = [window(m) for m in unit.modules()]
    if not any(isinstance(w, int) and not isinstance(w, bool) and 0 < w < tokens for w in windows):
        return {}
    return {"attention_mask": torch.empty(1, 1, tokens, tokens, dtype=torch.bool)}


def profile_unit(unit: nn.Module, tokens: int, tp: int = 1, hidden: Optional[int] = None, sp: int = 1,
                 mask: bool = True) -> Dict[str, float]:
    """Per-token bytes of one unit at ``tokens`` positions (batch 1), float32: ``saved`` (all autograd keeps),
    ``input`` (the unit's input, what full checkpointing keeps), ``selective`` (input + every output of the
    ops selective checkpointing keeps, whether autograd saves it or not; ``selective_saved`` the part of it autograd
    saves too), ``backward`` (the backward's working
    set above the saved set), ``recorded`` (outputs of the parameter-owning modules that autograd does not save:
    what a split backward's records keep in addition). ``tp`` > 1 divides what tensor-parallel regions make. Raises if the unit's forward cannot run on one tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    from lightning_scale.activation_checkpointing import SAVED_OPS

    hidden = hidden or hidden_size(unit)
    if hidden is None:
        raise ValueError(f"{type(unit).__name__}: cannot tell its hidden size")
    from lightning_scale.compile import eager_forward

    inner = eager_forward(unit)  # never the compiled one: see lightning_scale.compile.compile_units
    regions = [c for c in unit.children() if any(isinstance(m, nn.Linear) for m in c.modules())]
    tracker = _Tracker(SAVED_OPS)
    handles = []

    def enter(*_a: Any) -> None:
        tracker.region += 1

    def leave(*_a: Any) -> None:
        tracker.region -= 1

    for c in regions:
        handles += [c.register_forward_pre_hook(enter), c.register_forward_hook(leave)]
    # score matrices are an attention's: a Mamba-2 scan's (chunk x chunk) segment sums are not, and under Ulysses they
    # stay per chunk (its heads split over sp, the sequence gathered), not (L x L)
    attending = [0]

    def enter_attention(*_a: Any) -> None:
        attending[0] += 1

    def leave_attention(*_a: Any) -> None:
        attending[0] -= 1

    from lightning_scale.sequence_parallel.mamba import mixer_kind

    # a unit with no module named *Attention* (the project GPT's core, a user's block) keeps every square; one with a
    # Mamba mixer counts those of its attention modules only
    attention_squares_only = False
    for m in unit.modules():
        if "Attention" in type(m).__name__ or mixer_kind(m):
            attention_squares_only = True
        if "Attention" in type(m).__name__:
            handles += [m.register_forward_pre_hook(enter_attention), m.register_forward_hook(leave_attention)]
    # the outputs of the parameter-owning modules, as a split (zero-bubble) backward records them
    outputs: Dict[int, tuple] = {}

    def record(module: nn.Module, _inputs: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            outputs.setdefault(out.untyped_storage()._cdata, (out.untyped_storage().nbytes(), tracker.region > 0))

    handles += [m.register_forward_hook(record) for m in unit.modules()
                if any(p.requires_grad for p in m.parameters(recurse=False))]
    saved: Dict[int, int] = {}
    refs: Dict[int, Any] = {}
    squares: Dict[int, str] = {}  # saved (tokens x tokens) storages: a mask's shape, or one per head
    try:
        with FakeTensorMode(allow_non_fake_inputs=False):
            params = {n: nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
                      for n, p in unit.named_parameters()}
            buffers = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in unit.named_buffers()}
            own = {p.untyped_storage()._cdata for p in params.values()}
            x = torch.empty(1, tokens, hidden, requires_grad=True)
            kwargs = _rotary_inputs(unit, tokens)  # HF decoder layers: the model's cos / sin, shared by all units
            own |= {t.untyped_storage()._cdata for t in kwargs.get("position_embeddings", ())}
            streams = _stream_inputs(unit, tokens, hidden)
            if streams is not None:  # DeepSeek-V4: its residual streams in, its tables and token ids beside
                x, more = streams
                kwargs.update(more)
                tables = more.get("position_embeddings")  # DeepSeek-V4: a (cos, sin) pair per kind
                pairs = tables.values() if isinstance(tables, dict) else [tables] if tables is not None else []
                own |= {t.untyped_storage()._cdata for pair in pairs for t in pair}
            if mask:  # a sliding window: the model's one mask, shared by all units
                kwargs.update(_mask_inputs(unit, tokens))
            mask_b = kwargs["attention_mask"].untyped_storage().nbytes() if "attention_mask" in kwargs else 0
            own |= {kwargs["attention_mask"].untyped_storage()._cdata} if mask_b else set()

            def pack(t: torch.Tensor) -> torch.Tensor:
                key = t.untyped_storage()._cdata
                if key not in own:
                    saved[key] = t.untyped_storage().nbytes()
                    refs[key] = StorageWeakRef(t.untyped_storage())
                    if t.dim() >= 2 and t.shape[-1] == t.shape[-2] == tokens and (
                            attending[0] or not attention_squares_only):  # position x position
                        squares[key] = "mask" if t.dim() < 3 or t.shape[-3] == 1 else "heads"
                return t

            with _reparametrize_module(unit, {**params, **buffers}), tracker:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = inner(x, **kwargs)
                y = y[0] if isinstance(y, (tuple, list)) else y
                tracker.selecting = False  # the forward's saved-op outputs are listed; the backward's are not kept
                # the listed outputs autograd saves too (alive after the forward, among the saved storages): a recompute
                # under selective checkpointing regenerates the rest of the saved set (an eager attention's softmax is
                # saved, its score matmul's output is listed: both are held then)
                also_saved = [(n, region) for n, region, key, ref in tracker.selected
                              if not ref.expired() and key in saved]
                if x.untyped_storage()._cdata in saved:
                    also_saved.append((x.untyped_storage().nbytes(), False))
                grad_out = torch.empty(y.shape, dtype=y.dtype)
                del params
                # the backward: saved set + new storages (activation grads, temporaries), live bytes over time
                base = sum(saved.values())
                # the saved set is live at the start and shrinks as the backward's nodes free their tensors: the
                # working set is the absolute peak of (saved still alive + new storages) above the full saved set
                for key, ref in refs.items():
                    tracker.live[key] = (ref, saved[key])
                tracker.current = tracker.peak = base
                tracker.counting = True
                tracker.track([grad_out])  # the incoming gradient is alive through the unit's backward
                torch.autograd.grad(y, x, grad_out)
                tracker.counting = False
    finally:
        for h in handles:
            h.remove()
    made = tracker.made
    split = lambda key, n: n / tp if made.get(key, (0, False, False))[2] else n  # noqa: E731
    saved_b = sum(split(k, n) for k, n in saved.items())
    input_b = x.untyped_storage().nbytes()
    # selective checkpointing caches every output of a saved op for the recompute, also those autograd itself does
    # not save (an output projection feeding the residual add): all of them count, not only the saved ones
    selective_b = input_b + sum(n / tp if in_region else n for n, in_region, _, _ in tracker.selected)
    overlap_b = sum(n / tp if in_region else n for n, in_region in also_saved)
    ratio = saved_b / base if base else 1.0
    backward_b = max(tracker.peak - base, 0) * ratio  # above the full saved set, which shrinks meanwhile
    # what a split backward's records keep beyond the saved set: module outputs no op saves (an output projection
    # feeding the residual add)
    recorded_b = sum(n / tp if in_region else n for key, (n, in_region) in outputs.items() if key not in saved)
    out = {"saved": saved_b / tokens, "input": input_b / tokens, "selective": selective_b / tokens,
           "selective_saved": overlap_b / tokens,
           "backward": backward_b / tokens, "hidden": float(hidden), "recorded": recorded_b / tokens,
           "mask": mask_b / tokens}
    if sp > 1 and (mask_b or squares):  # a mask, or an attention that makes its score matrices (eager)
        # Ulysses: after the all-to-all a rank attends with H / sp heads over all L = sp x tokens positions, under
        # the whole sequence's mask, where this run had H heads over ``tokens``: a saved score matrix per head is
        # sp times larger in all, one of the mask's shape (1, 1, L, L) sp^2 times, the mask itself sp^2 times; the
        # other terms take what the mask adds to them (a second run without it) sp times
        extra = sum(n * ((sp * sp if squares[k] == "mask" else sp) - 1) for k, n in saved.items() if k in squares)
        out["saved"] += extra / tokens
        if mask_b:
            flat = profile_unit(unit, tokens, tp, hidden, mask=False)
            for key in ("selective", "selective_saved", "backward", "recorded"):
                out[key] = flat[key] + (out[key] - flat[key]) * sp
        out["mask"] *= sp * sp
    if sp > 1:  # a Mamba mixer / DeltaNet under sp keeps its input gathered over the sequence (sequence_parallel/mamba.py)
        mixers = sum(1 for m in unit.modules() if mixer_kind(m))
        out["saved"] += mixers * (sp - 1) * input_b / tokens
    return out


__all__ = ["hidden_size", "profile_unit"]
