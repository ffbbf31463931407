"""Split a sequence of layers into contiguous pipeline stages.

Methods (DeepSpeed's names):

* ``"uniform"``: the same number of layers per stage (the first ``n % S`` stages get one more);
* ``"parameters"``: balance the parameter count, so the embedding and the head (often the largest
  layers of a language model) weigh what they hold. A parameter shared by two layers (a tied
  embedding / head) counts in both, because both stages store and update a copy;
* ``"compute"``: balance an estimate of the compute per token: the parameters of every module
  except embedding tables (``nn.Embedding`` / ``nn.EmbeddingBag``). A dense layer's forward and
  backward cost is proportional to the weights it multiplies by, while an embedding is a lookup
  whose cost does not grow with its table. For a GPT this is what balances stage *time*:
  ``"parameters"`` counts the embedding table like the LM head, so at pp=2 it gives the same
  split as ``"type:Block"`` (embedding + half the blocks | half the blocks + head), which leaves
  the head's d x vocab matmul and cross-entropy as extra work on the last stage;
* ``"type:REGEX"``: balance the number of layers whose class name matches ``REGEX``
  (case-insensitive, e.g. ``"type:Block"``); other layers ride with the matching layer before
  them (leading ones with the first stage), so the embedding lands on the first stage and the
  head on the last.

The result is a list of ``S + 1`` boundaries: stage ``s`` holds ``layers[bounds[s]:bounds[s + 1]]``.
Every stage gets at least one layer; impossible requests raise :class:`ConfigError`.
"""

from __future__ import annotations

import re
from typing import List, Sequence

import torch.nn as nn

from lightning_scale.config import ConfigError

METHODS = ("uniform", "parameters", "compute", "type:REGEX")
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def partition_layers(layers: Sequence[nn.Module], num_stages: int, method: str = "parameters") -> List[int]:
    """Boundaries of ``num_stages`` contiguous stages over ``layers`` by ``method``."""
    n = len(layers)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"number of pipeline stages {num_stages!r} must be a positive integer")
    if num_stages > n:
        raise ConfigError(
            f"{num_stages} pipeline stages (pp x pipeline.virtual_stages) need at least {num_stages} layers; "
            f"the model exposes {n}"
        )
    if method == "uniform":
        return uniform_bounds(n, num_stages)
    if method == "parameters":
        return balanced_bounds([float(layer_numel(layer)) for layer in layers], num_stages)
    if method == "compute":
        return balanced_bounds([float(layer_compute(layer)) for layer in layers], num_stages)
    if isinstance(method, str) and method.startswith("type:"):
        return _type_bounds(layers, num_stages, method[len("type:"):])
    raise ConfigError(f"pipeline.partition={method!r} is unknown; use one of {', '.join(METHODS)}")


def layer_numel(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def layer_compute(layer: nn.Module) -> int:
    """Compute weight of ``layer`` for ``"compute"``: parameters outside embedding tables (each counted once)."""
    seen, total = set(), 0
    for module in layer.modules():
        if isinstance(module, _LOOKUPS):
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def uniform_bounds(n: int, num_stages: int) -> List[int]:
    size, extra = divmod(n, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + size + (1 if s < extra else 0))
    return bounds


def balanced_bounds(weights: Sequence[float], num_stages: int) -> List[int]:
    """Contiguous split minimizing the heaviest stage (exact dynamic program, O(n^2 S)).

    Ties between optimal splits go to the earliest boundary, so every rank computes the same split.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-stage weight splitting layers[:i] into k stages (each non-empty).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _type_bounds(layers: Sequence[nn.Module], num_stages: int, pattern: str) -> List[int]:
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise ConfigError(f"pipeline.partition='type:{pattern}': invalid regular expression ({err})") from None
    hits = [i for i, layer in enumerate(layers) if regex.search(type(layer).__name__)]
    if len(hits) < num_stages:
        names = sorted({type(layer).__name__ for layer in layers})
        raise ConfigError(
            f"pipeline.partition='type:{pattern}' matches {len(hits)} layers, fewer than the {num_stages} "
            f"pipeline stages; layer classes are: {', '.join(names)}"
        )
    per_stage = uniform_bounds(len(hits), num_stages)
    # Stage s starts at its first matching layer; the first stage also takes any leading layers.
    bounds = [0] + [hits[per_stage[s]] for s in range(1, num_stages)] + [len(layers)]
    return bounds


def describe_partition(layers: Sequence[nn.Module], bounds: Sequence[int]) -> str:
    """One line per stage: layer range, class names and parameter count (for logs and errors)."""
    lines = []
    for s in range(len(bounds) - 1):
        part = layers[bounds[s]:bounds[s + 1]]
        kinds = ", ".join(sorted({type(layer).__name__ for layer in part}))
        numel = sum(layer_numel(layer) for layer in part)
        lines.append(f"stage {s}: layers {bounds[s]}..{bounds[s + 1] - 1} ({kinds}), {numel:,} parameters")
    return "\n".join(lines)
