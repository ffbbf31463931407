"""DiagnosticsConfig: the knobs of the watchdog, the stop on signals and the numerics checks.

Self-contained (only ``lightning_scale.config.ConfigError``) so it can be nested in ``ParallelConfig`` as
``diagnostics=DiagnosticsConfig(...)``; every message names the key as ``diagnostics.<key>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_scale.config import ConfigError

ON_NONFINITE = ("skip", "raise", "ignore")


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value < 0 if allow_zero else value <= 0):
        raise ConfigError(f"diagnostics.{name}={value!r} must be a finite number {'>= 0' if allow_zero else '> 0'}")


def _count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"diagnostics.{name}={value!r} must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class DiagnosticsConfig:
    """What happens when a run goes wrong (see docs/failures.md).

    watchdog: heartbeats through the c10d store (not the training process group).
    hang_timeout: seconds a rank may wait inside one collective before every rank prints the diagnosis and exits.
    first_step_grace: extra seconds allowed until the first optimizer step (compile, warm-up, first gather).
    heartbeat_interval: seconds between heartbeats / checks of the store by the monitor thread.
    debug_collectives: fingerprint every collective (op, bytes, per-group sequence number) and compare it
        across the group; also turned on by ``LIGHTNING_SCALE_DEBUG_COLLECTIVES=1``. Slow: debugging only.
    stop_timeout: seconds from a SIGTERM/SIGINT (or a peer's failure) until a rank that has not stopped
        cleanly is ended anyway.
    save_on_preempt: on SIGTERM/SIGINT, write a checkpoint at the step where every rank stops.
    on_nonfinite: a non-finite loss or gradient norm: "skip" the step (logged), "raise" at once, or "ignore".
    max_nonfinite_steps: this many skipped steps in a row (non-finite, or fp16 overflow) stop the run.
    max_min_scale_steps: fp16: this many steps in a row at the minimum loss scale stop the run.
    """

    watchdog: bool = True
    hang_timeout: float = 300.0
    first_step_grace: float = 300.0
    heartbeat_interval: float = 2.0
    debug_collectives: bool = False
    stop_timeout: float = 25.0
    save_on_preempt: bool = False
    on_nonfinite: str = "skip"
    max_nonfinite_steps: int = 10
    max_min_scale_steps: int = 20

    def validate(self) -> "DiagnosticsConfig":
        for name in ("watchdog", "debug_collectives", "save_on_preempt"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"diagnostics.{name}={getattr(self, name)!r} must be True or False")
        _positive("hang_timeout", self.hang_timeout)
        _positive("first_step_grace", self.first_step_grace, allow_zero=True)
        _positive("heartbeat_interval", self.heartbeat_interval)
        if self.heartbeat_interval > self.hang_timeout:
            raise ConfigError(f"diagnostics.heartbeat_interval={self.heartbeat_interval} must be <= "
                              f"diagnostics.hang_timeout={self.hang_timeout}")
        _positive("stop_timeout", self.stop_timeout)
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError(f"diagnostics.on_nonfinite={self.on_nonfinite!r}: must be one of "
                              f"{', '.join(ON_NONFINITE)}")
        _count("max_nonfinite_steps", self.max_nonfinite_steps)
        _count("max_min_scale_steps", self.max_min_scale_steps)
        return self
