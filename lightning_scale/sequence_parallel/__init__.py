"""Ulysses sequence parallelism (``Zero3DStrategy(sp=2)``; docs/long_sequences.md).

* :mod:`~lightning_scale.sequence_parallel.ulysses` — the all-to-alls (autograd functions), the whole-sequence mean
  of the loss, the next-token labels across slice boundaries, and :func:`shard_sequence` (a batch -> this rank's
  slice);
* :mod:`~lightning_scale.sequence_parallel.models` — :func:`apply_sequence_parallel` on the project GPT and on
  Hugging Face models (through ``transformers.AttentionInterface``; no model edits);
* :mod:`~lightning_scale.sequence_parallel.mamba` — a hybrid model's Mamba mixers under sp: the sequence gathered,
  1/sp of the heads run on all of it, the output reduce-scattered back.

``lightning_scale.parallelize.apply_sp`` is the step of the composition order that calls it.
"""

from lightning_scale.sequence_parallel.models import HeadRange, apply_sequence_parallel
from lightning_scale.sequence_parallel.ulysses import (all_to_all, heads_to_sequence, next_token_labels,
                                                        sequence_mean, sequence_to_heads, shard_sequence)

__all__ = ["apply_sequence_parallel", "HeadRange", "all_to_all", "heads_to_sequence", "sequence_to_heads",
           "sequence_mean", "next_token_labels", "shard_sequence"]
