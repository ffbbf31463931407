"""Split one stage's backward into I (input gradient) and W (weight gradients) for zero-bubble schedules.

During the forward, hooks record the output of every module that owns parameters. ``I`` runs
autograd from the stage output to the stage input *and* to those recorded outputs, keeping the
graph; autograd skips the weight-gradient kernels because no parameter is asked for. ``W`` later
runs, per recorded module, autograd from its output to its own parameters only: the path is the
module's internal ops, so each weight gradient is computed once, with the gradient ``I`` captured.

That is exact when each parameter is owned by one module and used only in that module's forward,
once per micro-batch. When a chunk breaks this (a parameter owned by two modules, as a tied
embedding / head on one rank, or a module called twice), the chunk falls back to a full backward
in ``I`` and an empty ``W``; the result is still exact, only the overlap is lost.

A chunk holding an activation-checkpointed unit (``activation_checkpointing``, any unit with
``_activation_checkpointing`` set) is not split either: each per-module ``W`` call is a new autograd
task that re-runs the unit's recompute (2 GPT blocks, one micro-batch: 16 block forwards instead of
4), and the records keep the units' outputs the checkpoint dropped (step 1 at pp=2 measured 107 /
133 MiB per stage against 58 / 88 MiB without checkpointing). Its backward runs whole in ``I``
(one recompute per unit, as 1F1B), its ``W`` is empty: such chunks lose the ``W`` overlap only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

WeightWork = List[Tuple[torch.Tensor, torch.Tensor, List[nn.Parameter]]]


class WeightGradSplitter:
    """Forward hooks on the parameter-owning modules of one chunk."""

    def __init__(self, chunk: nn.Module) -> None:
        self.chunk = chunk
        self.modules = [m for m in chunk.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        owner = {}
        self._shared = False
        for m in self.modules:
            for p in m.parameters(recurse=False):
                if id(p) in owner and owner[id(p)] is not m:
                    self._shared = True  # e.g. tied embedding and head in the same chunk
                owner[id(p)] = m
        self._records: Optional[List[Tuple[nn.Module, object]]] = None
        self._handles = [] if self._shared else [m.register_forward_hook(self._hook) for m in self.modules]

    @property
    def checkpointed(self) -> bool:
        """The chunk holds an activation-checkpointed unit. Read at every forward: ``parallelize`` checkpoints the
        units (apply_ac) after the pipeline runtime, and so this splitter, is built (apply_pp)."""
        return any(getattr(m, "_activation_checkpointing", None) is not None for m in self.chunk.modules())

    @property
    def splittable(self) -> bool:
        # checkpointed units: W's per-module autograd calls would each re-run the unit's recompute (module docstring)
        return not self._shared and not self.checkpointed

    def _hook(self, module: nn.Module, _inputs, output) -> None:
        if self._records is not None:
            self._records.append((module, output))

    @contextmanager
    def capture(self) -> Iterator[List[Tuple[nn.Module, object]]]:
        """The records of one forward; none when the chunk is not split (nothing kept beyond what autograd keeps)."""
        records: List[Tuple[nn.Module, object]] = []
        self._records = records if self.splittable else None
        try:
            yield records
        finally:
            self._records = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _usable(records: Sequence[Tuple[nn.Module, object]], splittable: bool) -> bool:
    if not splittable:
        return False
    seen = set()
    for module, out in records:
        if id(module) in seen or not isinstance(out, torch.Tensor):
            return False  # called twice, or an output autograd cannot be asked about
        seen.add(id(module))
    return True


def backward_input(out: torch.Tensor, grad: Optional[torch.Tensor], x: torch.Tensor,
                   records: Sequence[Tuple[nn.Module, object]], splittable: bool
                   ) -> Tuple[Optional[torch.Tensor], WeightWork]:
    """``I``: return (gradient w.r.t. ``x`` or None, the work ``W`` needs)."""
    wants_x = x.requires_grad
    if not _usable(records, splittable):
        torch.autograd.backward(out, grad)  # full backward now, nothing left for W
        return (x.grad if wants_x else None), []
    targets = [(m, t) for m, t in records if t.requires_grad]
    inputs = ([x] if wants_x else []) + [t for _, t in targets]
    if not inputs:
        return None, []
    grads = torch.autograd.grad(out, inputs, grad_outputs=grad, retain_graph=True, allow_unused=True)
    gx = grads[0] if wants_x else None
    tail = grads[1:] if wants_x else grads
    work: WeightWork = []
    for (module, t), g in zip(targets, tail):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if g is not None and params:
            work.append((t, g, params))
    return gx, work


def backward_weight(work: WeightWork) -> None:
    """``W``: accumulate each recorded module's weight gradients into ``.grad``."""
    for t, g, params in work:
        torch.autograd.backward(t, g, inputs=params)
