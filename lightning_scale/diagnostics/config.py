"""DiagnosticsConfig: the knobs of the watchdog, the stop on signals and the numerics checks.

It lives in :mod:`lightning_scale.config` (torch-free, nested in ``ParallelConfig`` as ``diagnostics=``, so its
keys are flat kwargs and Hydra keys like every other setting); this module re-exports it.
"""

from lightning_scale.config import ON_NONFINITE, DiagnosticsConfig

__all__ = ["ON_NONFINITE", "DiagnosticsConfig"]
