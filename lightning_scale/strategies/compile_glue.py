"""The Lightning side of ``compile=`` (issue 17 item 1): the compile report ``Zero3DStrategy`` logs.

``install`` appends a :class:`CompileReport` callback when the run compiles (``compile=`` set, or a user's own
``torch.compile`` found by :func:`lightning_scale.compile.unwrap_compiled`). Rank 0 prints one line after the
first optimizer step (what that step compiled: graphs, graph breaks and their reasons) and one at the end of
``fit`` with the graphs compiled after step 2: the recompiles, which should be 0. Both lines end in a warning when
Dynamo hit its recompile limit on a unit (the units past it run eagerly: never silent), and the first one when a
compiled unit has no compiled code after step 1 (it ran eagerly: Dynamo skipped its code; every rank warns).
Validation under ``no_grad`` compiles its own graphs once (Dynamo guards on grad mode), so the baseline is taken
after step 2's validation: at the start of step 3. Steps are this fit's: a run resumed from a checkpoint counts
from its first step (the report says which global step that was), so its first compile is not taken for
recompiles. ``strategy.compile_report`` holds the numbers (tests read it).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl

PREFIX = "[lightning_scale compile]"


def _stats() -> Dict[str, Any]:
    from lightning_scale.compile import compile_stats

    return compile_stats()


def _fallbacks(stats: Dict[str, Any]) -> str:
    """The report's warning when Dynamo gave up on a unit's code (its recompile limit): those units run eagerly."""
    n = stats.get("eager_fallbacks", 0)
    if not n:
        return ""
    return (f"; WARNING: {n} compiled code object(s) hit Dynamo's recompile limit, the units past it run EAGERLY "
            "(each compiled its own graph: TORCH_LOGS=recompiles names the guard; compile=... raises the limit to "
            "the number of units, a torch.compile of your own keeps torch's)")


def _eager_units(names: Optional[list]) -> str:
    """The report's warning when compiled units have no compiled code after step 1: they ran eagerly."""
    if not names:
        return ""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"; WARNING: {len(names)} compiled unit(s) ran EAGERLY in step 1 ({shown}): Dynamo compiled nothing for "
            "their forward (it skips, for good, code it first meets under a TorchDispatchMode or in its skip "
            "list; TORCH_LOGS=+dynamo says why)")


class CompileReport(pl.Callback):
    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.start: Optional[int] = None  # the global step this fit started at (> 0 when resumed from a checkpoint)
        self.baseline: Optional[int] = None  # graphs compiled when this run's step 3 starts
        self.report: Dict[str, Any] = {}
        strategy.compile_report = self.report

    def _print(self, trainer: "pl.Trainer", line: str) -> None:
        if trainer.is_global_zero:
            print(f"{PREFIX} {line}", flush=True)

    def _run_steps(self, trainer: "pl.Trainer") -> int:
        """Optimizer steps of this fit (a resumed run starts at the checkpoint's global step: its own steps count)."""
        if self.start is None:
            self.start = trainer.global_step
        return trainer.global_step - self.start

    def _where(self, trainer: "pl.Trainer") -> str:
        return "" if not self.start else f" of this run (global step {trainer.global_step})"

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._run_steps(trainer) >= 1 and "step1" not in self.report:
            from lightning_scale.compile import units_running_eagerly

            s = self.report["step1"] = _stats()
            eager = self.report["eager_units"] = units_running_eagerly(self.strategy.model)
            reasons = "; ".join(f"{n}x {r}" for r, n in s["break_reasons"].items()) or "none"
            self._print(trainer, f"after step 1{self._where(trainer)}: {s['graphs']} graphs compiled, "
                                 f"{s['graph_breaks']} graph breaks ({reasons}){_fallbacks(s)}{_eager_units(eager)}")
            if eager:
                import warnings

                warnings.warn(f"{PREFIX}{_eager_units(eager)[1:]}", stacklevel=2)

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._run_steps(trainer) >= 2 and self.baseline is None:
            self.baseline = _stats()["graphs"]

    def on_train_end(self, trainer: "pl.Trainer", pl_module: Any) -> None:
        s = _stats()
        recompiles = None if self.baseline is None else s["graphs"] - self.baseline
        run = self._run_steps(trainer)
        self.report.update(end=s, recompiles=recompiles, steps=trainer.global_step, run_steps=run)
        after = "n/a (fewer than 3 steps)" if recompiles is None else recompiles
        self._print(trainer, f"after {run} steps{self._where(trainer)}: {s['graphs']} graphs compiled, "
                             f"{s['graph_breaks']} graph breaks, graphs compiled after step 2 (recompiles): {after}"
                             f"{_fallbacks(s)}")


def install(strategy: Any, trainer: "pl.Trainer") -> None:
    from lightning_scale.compile import compiled_units

    module = getattr(strategy, "model", None)
    if module is None or not compiled_units(module):
        return
    if not any(isinstance(cb, CompileReport) for cb in trainer.callbacks):
        trainer.callbacks.append(CompileReport(strategy))


__all__ = ["CompileReport", "install"]
