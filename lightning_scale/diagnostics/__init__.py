"""No silent failure: the watchdog (hangs), first error wins, a bounded stop on signals (docs/failures.md).

Pure torch + stdlib; the Lightning side is ``lightning_scale.strategies.diagnostics_glue``.
"""

from lightning_scale.diagnostics.batch_check import BatchMismatchError, check_same_batch
from lightning_scale.diagnostics.config import ON_NONFINITE, DiagnosticsConfig
from lightning_scale.diagnostics.trace import CollectiveMismatchError
from lightning_scale.diagnostics.watchdog import (
    EXIT_HANG,
    EXIT_PEER_FAILED,
    EXIT_STOP_TIMEOUT,
    PeerFailedError,
    Watchdog,
    default_store,
    start_watchdog,
)

__all__ = [
    "BatchMismatchError", "check_same_batch", "ON_NONFINITE", "DiagnosticsConfig", "CollectiveMismatchError",
    "EXIT_HANG", "EXIT_PEER_FAILED", "EXIT_STOP_TIMEOUT", "PeerFailedError", "Watchdog", "default_store",
    "start_watchdog",
]
