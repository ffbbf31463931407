"""Callbacks shared by the example and the benchmarks."""

from __future__ import annotations

import time

import lightning.pytorch as pl


class TokenThroughput(pl.Callback):
    """Tokens/s of training (all ranks together), timed from the end of the first step (warm-up excluded).

    Validation time is not counted. ``tokens_per_sec`` is available on every rank after fit.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self._t0 = None
        self._steps = 0
        self.tokens_per_sec = float("nan")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._t0 is None:
            return
        self._steps += 1
        if self._steps > 1:  # the first step pays for lazy state allocation
            x = batch[0]
            dp = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1) \
                if hasattr(trainer.strategy, "distributed_sampler_kwargs") else 1
            self.tokens += x.numel() * dp
            self.seconds += time.perf_counter() - self._t0
        self._t0 = None

    def on_train_end(self, trainer, pl_module) -> None:
        if self.seconds > 0:
            self.tokens_per_sec = self.tokens / self.seconds
