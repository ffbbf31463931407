"""Tensor-parallel layers: each holds its shard of one dense layer and does the matching communication.

* :class:`ColumnParallelLinear` splits the *output* features (``Y_r = X W_r^T + b_r``); optionally
  all-gathers the output. Fused projections (``[q | k | v]``) are split per section, i.e. per head.
* :class:`RowParallelLinear` splits the *input* features; its input is already split (the output of a
  column-parallel layer), partial sums are all-reduced, then the (replicated) bias is added once.
* :class:`VocabParallelEmbedding` splits the vocabulary; ids outside the own range produce zeros and
  one all-reduce sums the rows. A vocabulary tp does not divide is padded at the end.

With ``sequence_parallel=True`` the activations between layers are split along the sequence dim
(``-2``): a column-parallel layer all-gathers its input, row-parallel and embedding layers
reduce-scatter their output. Parameter names stay ``weight`` / ``bias`` so state_dict keys do not change.
``transposed=True`` keeps GPT-2's ``Conv1D`` layout (weight stored ``(in, out)``). A module whose own
code reads the sequence length from its input (the GPT attention) gathers on entry instead (plan
style ``sequence_gather``) and its column-parallel layers get ``input_gathered=True``.

Under ``torch.compile`` each layer's ``forward`` is a deliberate graph break (run eagerly, like every collective of
:mod:`lightning_scale.comm`): traced, its per-layer constants (the accounting tag, the group) made Dynamo compile
one graph per layer, and past torch's recompile limit (8) the layers beyond it ran eagerly anyway, unreported.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_scale.comm import pairwise
from lightning_scale.comm.collectives import eager_under_compile
from lightning_scale.tensor_parallel.mappings import (
    _gather,
    _reduce_async,
    _reduce_in_place,
    _reduce_scatter_async,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
    tp_rank,
    tp_size,
)
from lightning_scale.tensor_parallel.overlap import row_linear_chunked
from lightning_scale.tensor_parallel.sharding import (
    ShardSpec,
    make_spec,
    mark_partial_grad,
    mark_sharded,
    merge_shards,
    shard_tensor,
)
from lightning_scale.tensor_parallel.vocab_range import check_vocab_range


class _ColumnLinearFn(torch.autograd.Function):
    """Column-parallel ``linear`` with its input communication inside, so the backward overlaps them.

    Forward: (sequence parallel: all-gather the sequence, then) ``x W^T + b``. Backward: the input
    gradient is a partial sum on each rank; its all-reduce (reduce-scatter) is started asynchronously
    and runs while the weight gradient is computed (Megatron-LM's asynchronous tensor-parallel
    all-reduce). Same bytes as ``copy_to_region`` / ``gather_from_sequence_region`` + ``F.linear``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, tag, sequence_parallel, transposed, siblings=None):
        x_full = _gather(x, x.dim() - 2, group, tag) if sequence_parallel else x  # (*, T, in)
        ctx.save_for_backward(x_full, weight)
        ctx.group, ctx.tag, ctx.sequence_parallel, ctx.transposed = group, tag, sequence_parallel, transposed
        ctx.has_bias = bias is not None
        ctx.siblings = siblings
        if siblings is not None:
            siblings.expect()
        return F.linear(x_full, weight.t() if transposed else weight, bias)  # (*, T, out_local)

    @staticmethod
    def backward(ctx, grad):  # grad (*, T, out_local)
        x_full, weight = ctx.saved_tensors
        w = (weight.t() if ctx.transposed else weight).to(grad.dtype)  # (out_local, in)
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(w)  # (*, T, in): this rank's partial sum
            if ctx.siblings is not None:  # summed with the siblings'; the last one reduces the sum (else None)
                grad_x, handle = ctx.siblings.add(grad_x)
            elif ctx.sequence_parallel:
                grad_x, handle = _reduce_scatter_async(grad_x, grad_x.dim() - 2, ctx.group, ctx.tag)
            else:
                handle = _reduce_async(grad_x, ctx.group, ctx.tag)
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out_local)
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            x2 = x_full.reshape(-1, x_full.shape[-1]).to(grad.dtype)  # (N, in)
            grad_w = (x2.t().mm(g2) if ctx.transposed else g2.t().mm(x2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(weight.dtype)
        if handle is not None:
            handle.wait()
            grad_x = grad_x.to(x_full.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class _SiblingGrads:
    """The input-gradient partial sums of the column layers that read one tensor in one forward.

    Each layer's forward ``expect()``s one gradient; its backward ``add()``s its partial sum. The last one starts
    the all-reduce of the sum (asynchronous: it overlaps that layer's weight-gradient matmul, as a lone column
    layer's does) and returns the reduced gradient; the others return None (zero). :class:`_SiblingEntry`, the
    node all of them read from, runs after every one of them: if some layer's backward never ran (its output
    did not reach the loss) it reduces what was summed itself, then re-arms for another backward."""

    def __init__(self, group, tag: str) -> None:
        self.group, self.tag = group, tag
        self.uses = self.pending = 0
        self.buf: Optional[torch.Tensor] = None

    def expect(self) -> None:
        self.uses += 1
        self.pending += 1

    def add(self, partial: torch.Tensor):
        """(reduced sum, its all-reduce handle) from the last sibling; (None, None) before."""
        self.buf = partial if self.buf is None else self.buf.add_(partial)  # partial: a fresh tensor
        self.pending -= 1
        if self.pending > 0:
            return None, None
        buf, self.buf = self.buf, None
        return buf, _reduce_async(buf, self.group, self.tag)

    def finish(self, grad: torch.Tensor) -> torch.Tensor:
        buf, self.buf, self.pending = self.buf, None, self.uses  # re-armed (retain_graph)
        if buf is None:
            return grad
        pairwise.all_reduce(buf, self.group, tag=self.tag)  # the layers whose backward ran, summed
        return grad + buf.to(grad.dtype)


class _SiblingEntry(torch.autograd.Function):
    """Identity forward on the siblings' common input; backward: :meth:`_SiblingGrads.finish`."""

    @staticmethod
    def forward(ctx, x, siblings):
        ctx.siblings = siblings
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.siblings.finish(grad), None


class _ReplicaGradSum(torch.autograd.Function):
    """Identity forward on a column-parallel weight / bias whose spec replicates some parts (kv heads < tp);
    backward: the gradient rows of each replicated piece summed over the ranks that hold it.

    Rank r's kv rows get only the gradient of r's own q heads; the ranks sharing kv head g together hold all
    of g's q heads. One all-reduce over tp of a buffer holding each replicated part whole (this rank's piece
    at its place, zeros elsewhere) sums every piece over exactly its holders: ``G * hs * in`` elements for a
    kv projection, less than ``tp`` local shards. Done inside the backward, before accumulation, ZeRO buckets
    or clipping read the gradient (like ``copy_to_region``).
    """

    @staticmethod
    def forward(ctx, param, spec, rank, group, tag):
        ctx.spec, ctx.rank, ctx.group, ctx.tag = spec, rank, group, tag
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        spec, rank = ctx.spec, ctx.rank
        todo = [(local, n, split) for (local, _, n), split in zip(spec.pieces(rank), spec.part_splits)
                if split < spec.tp]
        grad = grad.contiguous().clone()
        wholes = []
        for local, n, split in todo:  # (split, n, *rest) along spec.dim moved first
            piece = grad.narrow(spec.dim, local, n).movedim(spec.dim, 0)
            whole = piece.new_zeros((split,) + tuple(piece.shape))
            whole[rank * split // spec.tp].copy_(piece)
            wholes.append(whole)
        flat = torch.cat([w.reshape(-1) for w in wholes])
        pairwise.all_reduce(flat, ctx.group, tag=ctx.tag)
        offset = 0
        for (local, n, split), whole in zip(todo, wholes):
            summed = flat[offset:offset + whole.numel()].view_as(whole)[rank * split // spec.tp]
            grad.narrow(spec.dim, local, n).copy_(summed.movedim(0, spec.dim))
            offset += whole.numel()
        return grad, None, None, None, None


def replica_grad_sum(param: torch.Tensor, spec: ShardSpec, rank: int, group, tag: str = "") -> torch.Tensor:
    """``param`` as seen by the forward: its replicated parts' gradients summed over their holders (see
    :class:`_ReplicaGradSum`); ``param`` itself when nothing is replicated or no gradient is needed."""
    if not spec.replicated_parts or not (param.requires_grad and torch.is_grad_enabled()):
        return param
    return _ReplicaGradSum.apply(param, spec, rank, group, tag)


class _RowLinearFn(torch.autograd.Function):
    """Row-parallel ``linear`` + all-reduce + bias in one node, the reduction done in place.

    Forward: ``y = x W_r^T`` (this rank's partial sum, a fresh tensor), all-reduced in place, then the
    replicated bias added in place: no defensive copy of the activation and two fewer autograd nodes
    than ``F.linear`` -> ``reduce_from_region`` -> ``+ bias``; same values, same one all-reduce.
    Backward (identity communication): ``grad_x = grad W_r``, ``grad_W_r = grad^T x``, ``grad_b = sum(grad)``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, tag, transposed, chunks=1, blocking=False):
        ctx.save_for_backward(x, weight)
        ctx.transposed, ctx.has_bias = transposed, bias is not None
        if chunks > 1:  # all-reduce of each row chunk in flight during the next chunk's matmul (overlap.py)
            y = row_linear_chunked(x, weight, group, tag, transposed, chunks, blocking)
        else:
            y = F.linear(x, weight.t() if transposed else weight)  # (*, T, out): partial sums over own inputs
            _reduce_in_place(y, group, tag)
        return y if bias is None else y.add_(bias)

    @staticmethod
    def backward(ctx, grad):  # grad (*, T, out), the same on every rank
        x, weight = ctx.saved_tensors
        w = weight.t() if ctx.transposed else weight  # (out, in_local)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(w.to(grad.dtype)).to(x.dtype)  # (*, T, in_local)
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1]).to(grad.dtype)  # (N, in_local)
            grad_w = (x2.t().mm(g2) if ctx.transposed else g2.t().mm(x2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class _VocabEmbeddingFn(torch.autograd.Function):
    """Vocabulary-parallel lookup + all-reduce in one node: rows of other ranks zeroed, summed in place.

    Same values and the same one all-reduce as ``F.embedding`` -> ``masked_fill`` -> ``reduce_from_region``,
    without the two activation-sized copies; the backward is those ops' backward (identity communication).
    """

    @staticmethod
    def forward(ctx, idx, weight, vocab_start, vocab_end, padding_idx, group, tag):
        outside = (idx < vocab_start) | (idx >= vocab_end)
        local = (idx - vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, weight, padding_idx)  # (B, T, C), a fresh tensor
        out.masked_fill_(outside.unsqueeze(-1), 0.0)  # other ranks own these rows
        _reduce_in_place(out, group, tag)
        ctx.save_for_backward(local, outside)
        ctx.num_weights, ctx.padding_idx = weight.shape[0], -1 if padding_idx is None else padding_idx
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None, None, None
        local, outside = ctx.saved_tensors
        grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)
        grad_w = torch.ops.aten.embedding_dense_backward(grad, local, ctx.num_weights, ctx.padding_idx, False)
        return None, grad_w, None, None, None, None, None


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 ``Conv1D``: a linear layer whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def dense_features(module: nn.Module):
    """(in_features, out_features, transposed) of an ``nn.Linear`` or ``Conv1D``; ValueError otherwise."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if is_conv1d(module):
        return module.nx, module.nf, True
    raise ValueError(f"expected nn.Linear or Conv1D, got {type(module).__name__}")


def _init_linear_(full_weight: torch.Tensor, full_bias: Optional[torch.Tensor], fan_in: int) -> None:
    """nn.Linear's default init on the *full* (out, in) weight, so shards of one rank-consistent tensor."""
    nn.init.kaiming_uniform_(full_weight, a=math.sqrt(5))
    if full_bias is not None:
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        nn.init.uniform_(full_bias, -bound, bound)


class SharedInput:
    """One input-gradient reduction for sibling column-parallel layers that read the same tensor.

    Separate ``q_proj`` / ``k_proj`` / ``v_proj`` (or ``gate_proj`` / ``up_proj``) each hold a partial sum of
    the gradient of their common input; reducing each alone costs one all-reduce per layer (5 per Hugging Face
    Llama block). Megatron's ``f`` operator reduces the *sum* once. The first sibling to see a tensor ``x`` in a
    forward opens an entry for it (:class:`_SiblingEntry`, identity forward); a sibling that receives the very
    same tensor object joins it. In the backward the partial sums are added up and the last sibling all-reduces
    the sum, overlapped with its own weight-gradient matmul (:class:`_SiblingGrads`). Sequence parallel: the entry
    is :func:`gather_from_sequence_region` (one all-gather forward, one reduce-scatter backward, for all
    siblings). A sibling fed another tensor opens its own entry (correct, just not shared). The entry is kept only
    while the siblings' parent module runs (its forward pre/post hooks clear it): no activation outlives it.
    """

    def __init__(self, group, tag: str, sequence_parallel: bool) -> None:
        self.group, self.tag, self.sequence_parallel = group, tag, sequence_parallel
        self.entries = 0  # entries opened (a test hook: how many distinct inputs were reduced)
        self._x = self._entry = None

    def clear(self, *_args, **_kwargs) -> None:
        self._x = self._entry = None

    @torch.compiler.disable
    def enter(self, x: torch.Tensor):
        """(``x`` as the siblings' matmuls read it, its :class:`_SiblingGrads` or None), opened once per tensor."""
        if not self.sequence_parallel and not (x.requires_grad and torch.is_grad_enabled()):
            return x, None  # no input gradient to reduce
        if self._x is not x:
            if self.sequence_parallel:
                entry = (gather_from_sequence_region(x, self.group, dim=x.dim() - 2, tag=self.tag), None)
            else:
                siblings = _SiblingGrads(self.group, self.tag)
                entry = (_SiblingEntry.apply(x, siblings), siblings)
            self._x, self._entry = x, entry
            self.entries += 1
        return self._entry

    def __deepcopy__(self, memo) -> "SharedInput":
        return SharedInput(self.group, self.tag, self.sequence_parallel)  # no cached activation copied


class _ParallelLinearBase(nn.Module):
    """Shared bookkeeping: group, tag, Conv1D layout, full-then-slice init, slicing from a dense layer."""

    weight_spec: ShardSpec
    bias_spec: Optional[ShardSpec]
    splits_output: bool  # column-parallel (output features split) or row-parallel (input features split)

    def _setup(self, in_features: int, out_features: int, group, name: str, transposed: bool) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.group, self.tp, self.rank = group, tp_size(group), tp_rank(group)
        self.transposed = transposed
        self.tp_name = name
        self.tag = f"tp/{name}" if name else "tp"

    def _mark_params(self) -> None:
        mark_sharded(self.weight, self.weight_spec)
        if self.bias is not None:
            if self.bias_spec is not None:
                mark_sharded(self.bias, self.bias_spec)
            elif getattr(self, "sequence_parallel", False):
                mark_partial_grad(self.bias)  # a row-parallel bias added to this rank's tokens only

    def _apply(self, fn, recurse=True):
        # .to() / .to_empty() / .double() may swap in new Parameter objects: mark those again.
        out = super()._apply(fn, recurse)
        self._mark_params()
        return out

    def _weight(self) -> torch.Tensor:
        return self.weight.t() if self.transposed else self.weight  # (out_local, in_local) view

    @property
    def local_features(self) -> Tuple[int, int]:
        """(in, out) features of the matmul this rank runs: its slice of the split side, the other side whole."""
        local = self.weight_spec.local_size
        return (self.in_features, local) if self.splits_output else (local, self.out_features)

    def _make_params(self, weight_shape, bias_shape, device, dtype) -> None:
        self.weight = nn.Parameter(torch.empty(weight_shape, device=device, dtype=dtype))
        if bias_shape:
            self.bias = nn.Parameter(torch.empty(bias_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize like the dense layer would, on the full tensor, and keep this rank's slice.

        Every rank draws the same full tensor (same seed), so the shards fit together; costs one full
        weight transiently. For very large layers build the model on ``meta`` and load a checkpoint.
        """
        if self.weight.is_meta:
            return
        w = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype)
        b = torch.empty(self.out_features, dtype=self.weight.dtype) if self.bias is not None else None
        _init_linear_(w, b, self.in_features)
        self.load_full_(w.t() if self.transposed else w, b)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """Copy this rank's slices of a full weight (in the dense layer's own layout) and bias."""
        self.weight.copy_(shard_tensor(weight, self.weight_spec, self.rank))
        if self.bias is not None:
            if self.bias_spec is None:
                self.bias.copy_(bias)
            else:
                self.bias.copy_(shard_tensor(bias, self.bias_spec, self.rank))

    @classmethod
    def from_dense(cls, module: nn.Module, group, **kwargs) -> "_ParallelLinearBase":
        """Slice an existing ``nn.Linear`` / ``Conv1D`` (meta stays meta) into this rank's parallel layer."""
        in_f, out_f, transposed = dense_features(module)
        w = module.weight
        layer = cls(in_f, out_f, group=group, bias=module.bias is not None, transposed=transposed,
                    device=w.device, dtype=w.dtype, init=False, **kwargs)
        layer.weight.requires_grad_(w.requires_grad)  # a frozen base stays frozen, on meta too
        if module.bias is not None:
            layer.bias.requires_grad_(module.bias.requires_grad)
        if w.is_meta:
            return layer
        layer.load_full_(w.detach(), None if module.bias is None else module.bias.detach())
        return layer


class ColumnParallelLinear(_ParallelLinearBase):
    """Output features split over the tp group: ``(*, in) -> (*, out / tp)`` (or ``(*, out)`` gathered).

    ``sections`` > 1 splits a fused output ``[a | b | ...]`` part by part (whole heads of q, k and v);
    ``parts`` gives their sizes when they differ (grouped-query ``[q | k | v]``: ``n_head * hs, G * hs, G * hs``);
    ``pad=True`` pads ``out_features`` to a multiple of tp (vocabulary heads; see
    :func:`~lightning_scale.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`).
    """

    splits_output = True

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True,
                 gather_output: bool = False, sections: int = 1, pad: bool = False,
                 sequence_parallel: bool = False, input_gathered: bool = False, transposed: bool = False,
                 name: str = "", device=None, dtype=None, init: bool = True, parts=(), splits=()) -> None:
        super().__init__()
        self._setup(in_features, out_features, group, name, transposed)
        self.gather_output, self.sections, self.sequence_parallel = gather_output, sections, sequence_parallel
        # True when an enclosing module already all-gathered the sequence (its backward reduce-scatters)
        self.input_gathered = input_gathered
        # set by apply_tensor_parallel on siblings reading one input (q/k/v, gate/up): one reduction for all
        self.shared_input: Optional[SharedInput] = None
        what = f"{name or 'ColumnParallelLinear'} out_features"
        self.weight_spec = make_spec(1 if transposed else 0, out_features, self.tp, sections=sections, pad=pad,
                                     what=what, parts=parts, splits=splits)
        self.bias_spec = (make_spec(0, out_features, self.tp, sections=sections, pad=pad, what=what, parts=parts,
                                    splits=splits) if bias else None)
        self.sections = self.weight_spec.sections
        n = self.weight_spec.local_size
        self._make_params((in_features, n) if transposed else (n, in_features), (n,) if bias else None, device, dtype)
        self._mark_params()
        if init:
            self.reset_parameters()

    @property
    def local_out_features(self) -> int:
        return self.weight_spec.local_size

    @property
    def vocab_start(self) -> int:
        """First output feature (e.g. vocabulary id) held by this rank, in the padded layout."""
        return self.rank * self.weight_spec.local_size

    def _params_for_forward(self):
        """weight, bias; with replicated parts (kv heads < tp) entering through :func:`replica_grad_sum`."""
        weight, bias = self.weight, self.bias
        if self.weight_spec.replicated_parts:
            weight = replica_grad_sum(weight, self.weight_spec, self.rank, self.group, self.tag + "/replicas")
            if bias is not None:
                bias = replica_grad_sum(bias, self.bias_spec, self.rank, self.group, self.tag + "/replicas")
        return weight, bias

    @eager_under_compile  # a graph break under torch.compile (module docstring)
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (*, T, in) or (*, T/tp, in) -> (*, T, out/tp)
        weight, bias = self._params_for_forward()
        if self.input_gathered or self.tp == 1:  # 'sequence_gather' module hook did the communication
            y = F.linear(x, weight.t() if self.transposed else weight, bias)
        elif self.shared_input is not None:  # siblings' gradients summed, then reduced once (SharedInput)
            x, siblings = self.shared_input.enter(x)
            if siblings is None:  # sequence parallel (gathered once) or no input gradient
                y = F.linear(x, weight.t() if self.transposed else weight, bias)
            else:
                y = _ColumnLinearFn.apply(x, weight, bias, self.group, self.tag, False, self.transposed, siblings)
        else:
            y = _ColumnLinearFn.apply(x, weight, bias, self.group, self.tag, self.sequence_parallel,
                                      self.transposed)
        if not self.gather_output:
            return y
        y = gather_from_region(y, self.group, tag=self.tag)  # (*, tp * out_local), rank-major
        spec = self.weight_spec
        if spec.parts:  # unequal sections: [q0|k0|v0|q1|k1|v1] -> [q0|q1|k0|k1|v0|v1]
            return merge_shards(y.chunk(self.tp, dim=-1), spec, dim=-1)
        if spec.sections > 1:  # [a0|b0|c0|a1|b1|c1] -> [a0|a1|b0|b1|c0|c1]
            y = y.unflatten(-1, (self.tp, spec.sections, spec.section_local)).transpose(-3, -2).flatten(-3)
        return y[..., : self.out_features] if spec.padded != spec.size else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.local_out_features}), tp={self.tp}, "
                f"sections={self.sections}, gather_output={self.gather_output}, sp={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinearBase):
    """Input features split over the tp group: ``(*, in / tp) -> (*, out)`` after one all-reduce.

    The bias is replicated and added after the reduction, so it is counted once. ``overlap_chunks`` > 1
    (:func:`~lightning_scale.tensor_parallel.overlap.set_overlap`) overlaps the forward all-reduce with the
    layer's own matmul, chunk by chunk.
    """

    splits_output = False

    overlap_chunks, overlap_blocking = 1, False

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True,
                 input_is_parallel: bool = True, sections: int = 1, sequence_parallel: bool = False,
                 transposed: bool = False, name: str = "", device=None, dtype=None, init: bool = True) -> None:
        super().__init__()
        self._setup(in_features, out_features, group, name, transposed)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight_spec = make_spec(0 if transposed else 1, in_features, self.tp, sections=sections,
                                     what=f"{name or 'RowParallelLinear'} in_features")
        self.bias_spec = None
        n = self.weight_spec.local_size
        self._make_params((n, out_features) if transposed else (out_features, n), (out_features,) if bias else None,
                          device, dtype)
        self._mark_params()
        if init:
            self.reset_parameters()

    @eager_under_compile  # a graph break under torch.compile (module docstring)
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (*, T, in/tp) -> (*, T, out) or (*, T/tp, out)
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group, tag=self.tag)
        if (not self.sequence_parallel and self.tp > 1 and x.dtype == self.weight.dtype
                and not torch.is_autocast_enabled(x.device.type)):
            return _RowLinearFn.apply(x, self.weight, self.bias, self.group, self.tag, self.transposed,
                                      self.overlap_chunks, self.overlap_blocking)
        y = F.linear(x, self._weight())  # partial sums over this rank's input features
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.group, dim=-2, tag=self.tag)
        else:
            y = reduce_from_region(y, self.group, tag=self.tag)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight_spec.local_size}), out={self.out_features}, "
                f"tp={self.tp}, sp={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding rows (the vocabulary) split over the tp group, padded to a multiple of tp."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group, padding_idx: Optional[int] = None,
                 sequence_parallel: bool = False, name: str = "", device=None, dtype=None,
                 init: bool = True) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.tp, self.rank = group, tp_size(group), tp_rank(group)
        self.padding_idx, self.sequence_parallel = padding_idx, sequence_parallel
        self.tp_name, self.tag = name, f"tp/{name}" if name else "tp"
        self.weight_spec = make_spec(0, num_embeddings, self.tp, pad=True, what=f"{name or 'embedding'} vocab")
        self.vocab_start, self.vocab_end = self.weight_spec.local_range(self.rank)
        self.weight = nn.Parameter(torch.empty(self.weight_spec.local_size, embedding_dim, device=device, dtype=dtype))
        mark_sharded(self.weight, self.weight_spec)
        if init:
            self.reset_parameters()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        mark_sharded(self.weight, self.weight_spec)  # the Parameter may have been replaced
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)
        nn.init.normal_(full)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        self.load_full_(full)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        self.weight.copy_(shard_tensor(weight, self.weight_spec, self.rank))

    @classmethod
    def from_dense(cls, module: nn.Embedding, group, **kwargs) -> "VocabParallelEmbedding":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"expected nn.Embedding, got {type(module).__name__}")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError("VocabParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse")
        w = module.weight
        layer = cls(module.num_embeddings, module.embedding_dim, group=group, padding_idx=module.padding_idx,
                    device=w.device, dtype=w.dtype, init=False, **kwargs)
        if not w.is_meta:
            layer.load_full_(w.detach())
        layer.weight.requires_grad_(w.requires_grad)
        scale = getattr(module, "embed_scale", None)
        if isinstance(scale, torch.Tensor):  # Gemma's ScaledWordEmbedding: lookup * embed_scale (non-persistent)
            layer.register_buffer("embed_scale", scale, persistent="embed_scale" not in
                                  module._non_persistent_buffers_set)
        return layer

    @eager_under_compile  # a graph break under torch.compile (module docstring)
    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, C) or (B, T/tp, C)
        # an id outside the vocabulary: an error, as nn.Embedding's (no rank owns it: a row of zeros otherwise)
        check_vocab_range(idx, self.num_embeddings, f"{self.tp_name or 'VocabParallelEmbedding'}: token id",
                          hint=" (as nn.Embedding, which raises 'index out of range in self')")
        out = self._lookup(idx)
        scale = getattr(self, "embed_scale", None)
        return out if scale is None else out * scale.to(self.weight.dtype)  # as the dense subclass' forward

    def _lookup(self, idx: torch.Tensor) -> torch.Tensor:
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        if not self.sequence_parallel and self.tp > 1:
            return _VocabEmbeddingFn.apply(idx, self.weight, self.vocab_start, self.vocab_end, local_pad, self.group,
                                           self.tag)
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # other ranks own these rows
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(out, self.group, dim=-2, tag=self.tag)
        return reduce_from_region(out, self.group, tag=self.tag)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.tp}, sp={self.sequence_parallel}")
