"""This rank's part of a pipeline: the chunks (virtual stages) it runs, and the tied parameters it shares.

:func:`build_stage` partitions the full layer sequence (every rank sees the same sequence, e.g. a
model built on ``meta`` or a small model built everywhere) into ``pp * virtual_stages`` stages and
keeps the ones this rank runs: stage ``s`` belongs to pipeline rank ``s % pp``. Parameters used by
layers on two ranks (a tied embedding / LM head) are recorded so the runtime can sum their
gradients across those ranks; because every rank derives this from the same layer list, both
holders agree on the order of the exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.pipeline.partition import describe_partition, partition_layers


@dataclass(frozen=True)
class TiedParameter:
    """A parameter used by layers on several pipeline ranks; ``ranks`` are pipeline ranks, ascending."""

    name: str
    param: nn.Parameter
    ranks: Tuple[int, ...]


class PipelineStage(nn.Module):
    """The chunks of one pipeline rank; ``parameters()`` is what this rank's optimizer updates."""

    def __init__(self, chunks: Sequence[nn.Module], *, stage_ids: Sequence[int], pp: int, pp_rank: int,
                 bounds: Sequence[int], tied: Sequence[TiedParameter] = (), summary: str = "") -> None:
        super().__init__()
        if len(chunks) != len(stage_ids):
            raise ValueError("one chunk per stage id")
        self.chunks = nn.ModuleList(chunks)
        self.stage_ids = list(stage_ids)
        self.pp, self.pp_rank = pp, pp_rank
        self.virtual_stages = len(stage_ids)
        self.num_stages = pp * self.virtual_stages
        self.bounds = list(bounds)
        self.tied = list(tied)
        self.summary = summary
        self._index = {s: k for k, s in enumerate(self.stage_ids)}

    def chunk(self, stage: int) -> nn.Module:
        return self.chunks[self._index[stage]]

    @property
    def is_first(self) -> bool:
        return 0 in self._index

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self._index

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - the runtime drives chunks
        raise RuntimeError("a PipelineStage is run by PipelineRuntime.train_step / eval_step, not called directly")

    def extra_repr(self) -> str:
        return f"pp_rank={self.pp_rank}/{self.pp}, stages={self.stage_ids}"


def build_stage(layers: Sequence[nn.Module], *, pp: int, pp_rank: int, virtual_stages: int = 1,
                partition: str = "parameters") -> PipelineStage:
    """Partition ``layers`` into ``pp * virtual_stages`` stages and keep those of ``pp_rank``."""
    layers = list(layers)
    for name, value in (("pp", pp), ("pipeline.virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if not 0 <= pp_rank < pp:
        raise ConfigError(f"pp_rank={pp_rank} is outside pp={pp}")
    num_stages = pp * virtual_stages
    if num_stages > len(layers):
        detail = f"pp={pp}" if virtual_stages == 1 else f"pp={pp} x pipeline.virtual_stages={virtual_stages}"
        raise ConfigError(f"{detail} = {num_stages} stages but the model exposes only {len(layers)} layers "
                          f"(each stage needs at least one)")
    bounds = partition_layers(layers, num_stages, partition)
    stage_ids = [pp_rank + c * pp for c in range(virtual_stages)]
    chunks = [nn.Sequential(*layers[bounds[s]:bounds[s + 1]]) for s in stage_ids]
    tied = find_tied_parameters(layers, bounds, pp, pp_rank)
    return PipelineStage(chunks, stage_ids=stage_ids, pp=pp, pp_rank=pp_rank, bounds=bounds, tied=tied,
                         summary=describe_partition(layers, bounds))


def find_tied_parameters(layers: Sequence[nn.Module], bounds: Sequence[int], pp: int,
                         pp_rank: int) -> List[TiedParameter]:
    """Parameters that layers on more than one pipeline rank use, among those this rank holds."""
    owners: Dict[int, List[int]] = {}  # id(param) -> pipeline ranks using it
    names: Dict[int, str] = {}
    params: Dict[int, nn.Parameter] = {}
    for s in range(len(bounds) - 1):
        for k in range(bounds[s], bounds[s + 1]):
            for pname, p in layers[k].named_parameters():
                key = id(p)
                names.setdefault(key, f"layer{k}.{pname}")
                params[key] = p
                ranks = owners.setdefault(key, [])
                if s % pp not in ranks:
                    ranks.append(s % pp)
    tied = []
    for key, ranks in owners.items():
        if len(ranks) > 1 and pp_rank in ranks:
            if len(ranks) > 2:
                raise ConfigError(f"parameter {names[key]} is shared by layers on pipeline ranks {sorted(ranks)}; "
                                  "tying across more than two pipeline ranks is not supported")
            tied.append(TiedParameter(names[key], params[key], tuple(sorted(ranks))))
    tied.sort(key=lambda t: t.name)  # same order on every holder
    return tied
