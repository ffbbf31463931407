"""Checks a fitting Trainer runs once after a few optimizer steps (1, 10, 100, 1000, 10000): cheap early, rare later."""

from __future__ import annotations

from typing import Any, Dict, List

import lightning.pytorch as pl

CHECKS = (1, 10, 100, 1000, 10000)


class StepChecks(pl.Callback):
    """Runs :meth:`check` once after each optimizer step of ``CHECKS`` (Lightning calls ``on_train_batch_end`` per
    micro-batch: a step is checked once); subclasses keep their records in ``history``."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.history: List[Dict[str, Any]] = []
        self._last = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step not in CHECKS or step == self._last:
            return
        since, self._last = self._last + 1, step
        self.check(step, since)

    def check(self, step: int, since: int) -> None:
        """The check after optimizer step ``step`` (``since``: the first step since the previous check)."""
        raise NotImplementedError
