"""The Lightning side of the diagnostics (issue 15): what ``Zero3DStrategy`` calls, and the callback it adds.

Wiring (three calls in the strategy; see docs/failures.md)::

    setup(trainer)        ... at the end:  diagnostics_glue.install(self, trainer)
    teardown()            ... at the end:  diagnostics_glue.teardown(self)
    (everything else runs in the DiagnosticsCallback that install() appends to trainer.callbacks)

The callback: replaces Lightning's SIGTERM handler (which broadcasts inside the signal handler and blocks when
a peer is busy) with the watchdog's, so SIGTERM / SIGINT on any rank stops every rank at one agreed step
(``save_on_preempt`` writes a checkpoint there, then every rank exits with 128 + signal); marks step
boundaries for the watchdog's first-step grace; logs ``loss_scale`` / ``skipped_steps`` / ``nonfinite_steps``;
and on an exception publishes it (first error wins) or, on a rank that fails because of another one, raises
:class:`~lightning_scale.diagnostics.PeerFailedError` naming that rank instead of gloo's transport error.

Secondary errors never replace the first: while an error propagates out of ``fit``, an error raised by another
callback's ``on_exception``, the datamodule's ``on_exception``, a logger's ``finalize`` or a strategy teardown step
(:func:`run_teardown`; e.g. a collective on a peer that is gone) is printed as secondary and not raised, so the
process ends on the first error. install() publishes that first error before any other ``on_exception`` runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_scale.diagnostics import DiagnosticsConfig, PeerFailedError, Watchdog, default_store, trace
from lightning_scale.diagnostics.report import PREFIX, signal_name

PREEMPT_CKPT = "last-preempt.ckpt"  # matches ModelCheckpoint's "last" pattern: fit(ckpt_path="last") resumes it


class Preempted(SystemExit):
    """Every rank stopped at the same step on SIGTERM / SIGINT; exits with 128 + signal (no traceback)."""


def _config(strategy: Any, config: Optional[DiagnosticsConfig]) -> DiagnosticsConfig:
    if config is None:
        config = getattr(getattr(strategy, "config", None), "diagnostics", None) or DiagnosticsConfig()
    return config.validate()


def _children(strategy: Any) -> Dict[int, Any]:
    """Lightning's script launcher: rank 0 started local ranks 1..N-1 and sees their exact exit signals."""
    procs = getattr(getattr(strategy, "launcher", None), "procs", None) or []
    base = strategy.node_rank * strategy.num_processes
    return {base + i + 1: p for i, p in enumerate(procs)}


def _child_observer(procs: list) -> Optional[threading.Thread]:
    """Lightning's ``_ChildProcessObserver`` of this launcher's children, if it runs here."""
    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:  # pragma: no cover - a Lightning without it
        return None
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and getattr(thread, "_child_processes", None) is procs:
            return thread
    return None


def _pause_child_observer(strategy: Any) -> None:
    """While the watchdog runs it watches the launched ranks itself (``Watchdog._check_children``), naming a rank
    that died; Lightning's observer instead SIGKILLs this process within 5 s of any child's non-zero exit, which
    cut off rank 0's own first error (its traceback, exit 1 -> 137) when rank 1 had been ended on it with
    EXIT_PEER_FAILED: the CI failure of test_secondary_errors_in_teardown_never_replace_the_first. The observer
    keeps polling but acts on nothing until :func:`_resume_child_observer` (a normal end of the run)."""
    procs = getattr(getattr(strategy, "launcher", None), "procs", None)
    observer = _child_observer(procs) if procs else None
    if observer is not None and hasattr(observer, "_run"):
        observer._run = lambda: False  # an instance attribute over the method: "still running, nothing to do"
        strategy._ls_observer = observer


def _resume_child_observer(strategy: Any) -> None:
    observer = getattr(strategy, "_ls_observer", None)
    if observer is not None:
        observer.__dict__.pop("_run", None)
        strategy._ls_observer = None


def _name_groups(strategy: Any) -> None:
    topo = getattr(strategy, "topology", None)
    for axis, group in (getattr(topo, "_groups", None) or {}).items():
        trace.name_group(group, axis)


_LAST: Optional[Watchdog] = None  # the watchdog of the latest run in this process


def install(strategy: Any, trainer: "pl.Trainer", config: Optional[DiagnosticsConfig] = None) -> Optional[Watchdog]:
    """After the process group and the engines exist (end of ``Strategy.setup``); every rank calls it."""
    cfg = _config(strategy, config)
    plugin = strategy.precision_plugin
    if hasattr(plugin, "configure_numerics"):
        plugin.configure_numerics(on_nonfinite=cfg.on_nonfinite, max_nonfinite_steps=cfg.max_nonfinite_steps,
                                  max_min_scale_steps=cfg.max_min_scale_steps)
    global _LAST
    for old in {id(w): w for w in (getattr(strategy, "_ls_watchdog", None), _LAST) if w is not None}.values():
        old.close()  # this strategy's, or a kept one of an earlier run in this process (the script went on)
    wd = None
    if cfg.watchdog and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _name_groups(strategy)
        wd = Watchdog(default_store(), dist.get_rank(), dist.get_world_size(), cfg,
                      children=_children(strategy)).start()
        if wd.children:
            _pause_child_observer(strategy)
    strategy._ls_watchdog = _LAST = wd
    existing = [cb for cb in trainer.callbacks if isinstance(cb, DiagnosticsCallback)]
    if existing:  # installed again (validate after fit, or a subclass with its own config): the latest config wins
        existing[0].strategy, existing[0].config = strategy, cfg
    else:
        trainer.callbacks.append(DiagnosticsCallback(strategy, cfg))
    strategy._ls_first_error = strategy._ls_replacement = None
    _guard_teardown_hooks(strategy, trainer)
    return wd


# ---------------------------------------------------------------------- the first error wins over teardown errors
def _rank(strategy: Any) -> int:
    return getattr(strategy, "global_rank", 0)


def note_first_error(strategy: Any, exception: BaseException) -> None:
    """The error that interrupted ``fit`` (idempotent: the first call wins). Publishes it to the other ranks (or, on
    a rank failing because of another one, prepares the :class:`PeerFailedError` that :class:`DiagnosticsCallback`
    raises instead) before any ``on_exception`` hook can block or fail."""
    if _propagating(strategy) is not None:  # noted already (a first error left from an earlier fit does not count)
        return
    strategy._ls_first_error, strategy._ls_replacement = exception, None
    wd = getattr(strategy, "_ls_watchdog", None)
    if wd is not None and not isinstance(exception, (Preempted, PeerFailedError)):
        strategy._ls_replacement = wd.handle_exception(exception)


def _propagating(strategy: Any) -> Optional[BaseException]:
    """The first error, when it (or the PeerFailedError raised for it) is the exception being handled now."""
    first, current = getattr(strategy, "_ls_first_error", None), sys.exc_info()[1]
    while current is not None:
        if current is first:
            return first
        current = current.__cause__ or current.__context__
    return None


def log_secondary(strategy: Any, where: str, err: BaseException, first: BaseException) -> None:
    """Print a secondary error (one line naming the first error, then its traceback, indented): logged, not raised."""
    head = (f"{PREFIX} rank {_rank(strategy)}: secondary error in {where}, ignored (the first error "
            f"{type(first).__name__}: {str(first).strip()[:300]} is the one raised): {type(err).__name__}: {err}")
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__, chain=False))
    sys.stderr.write(head + "\n" + "".join("    " + ln + "\n" for ln in tb.rstrip().splitlines()))
    sys.stderr.flush()


class _TeardownGuard:
    """Wraps a callback's / datamodule's ``on_exception`` or a logger's ``finalize`` (an instance attribute in
    front of the class's method): while the first error propagates, an error inside is logged as secondary."""

    def __init__(self, fn: Callable, strategy: Any, where: str, notes_first: bool) -> None:
        self.fn, self.strategy, self.where, self.notes_first = fn, strategy, where, notes_first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.notes_first:  # on_exception(trainer, pl_module, exception) / on_exception(exception)
            note_first_error(self.strategy, args[-1] if args else kwargs["exception"])
        try:
            return self.fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - a secondary error must not replace the first
            first = _propagating(self.strategy)
            if first is None or err is first:
                raise
            log_secondary(self.strategy, self.where, err, first)
            return None


def _guard(obj: Any, name: str, strategy: Any, where: str, notes_first: bool) -> None:
    current = getattr(obj, name, None)
    if isinstance(current, _TeardownGuard):  # installed again (validate after fit): the latest strategy
        current.strategy = strategy
    elif callable(current):
        setattr(obj, name, _TeardownGuard(current, strategy, where, notes_first))


def _guard_teardown_hooks(strategy: Any, trainer: "pl.Trainer") -> None:
    """What Lightning calls between the error and the re-raise (trainer.call._interrupt) besides the strategy."""
    for cb in trainer.callbacks:
        if not isinstance(cb, DiagnosticsCallback):
            _guard(cb, "on_exception", strategy, f"{type(cb).__name__}.on_exception", True)
    if getattr(trainer, "datamodule", None) is not None:
        _guard(trainer.datamodule, "on_exception", strategy, f"{type(trainer.datamodule).__name__}.on_exception",
               True)
    for logger in trainer.loggers:
        _guard(logger, "finalize", strategy, f"{type(logger).__name__}.finalize", False)


def run_teardown(strategy: Any, *steps: Tuple[str, Callable[[], Any]]) -> None:
    """``Strategy.teardown``'s steps, each run even when an earlier one failed, then :func:`teardown`. While the first
    error propagates, a failing step is logged as secondary; otherwise the first failing step's error is raised
    (the later ones' are logged as secondary to it)."""
    failed: Optional[BaseException] = None
    try:
        for where, step in steps:
            try:
                step()
            except Exception as err:  # noqa: BLE001
                first = _propagating(strategy) or failed
                if first is None:
                    failed = err
                else:
                    log_secondary(strategy, where, err, first)
    finally:
        teardown(strategy)
    if failed is not None:
        raise failed


def teardown(strategy: Any) -> None:
    """End of ``Strategy.teardown``. A rank that is failing or stopping keeps its watchdog: it bounds the exit."""
    wd = getattr(strategy, "_ls_watchdog", None)
    if wd is not None and not wd.stopping:
        wd.close()
        if sys.exc_info()[1] is None:  # a normal end (not a teardown while an error or a stop propagates)
            wd.finish()  # the store's host leaves only after every rank's last use of it
        strategy._ls_watchdog = None
        _resume_child_observer(strategy)


@contextlib.contextmanager
def gathered(strategy: Any, module: Optional[torch.nn.Module] = None) -> Iterator[None]:
    """Full parameter values inside the block at any ZeRO stage (a collective at stage 3: every rank enters)."""
    sharded = getattr(strategy, "sharded", None)
    if sharded is None:
        yield
        return
    with sharded.gathered(module):
        yield


class DiagnosticsCallback(pl.Callback):
    def __init__(self, strategy: Any, config: DiagnosticsConfig) -> None:
        self.strategy, self.config = strategy, config
        self.batches = 0

    @property
    def watchdog(self) -> Optional[Watchdog]:
        return getattr(self.strategy, "_ls_watchdog", None)

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning's _SignalConnector registered its handlers (trainer._run): replace them.
        if self.watchdog is not None:
            self.watchdog.install_signal_handlers()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        trace.step_done(trainer.global_step)
        self._log_numerics(pl_module)
        wd = self.watchdog
        if wd is not None and wd.should_stop(self.batches):
            self._stop(trainer, wd)

    def _log_numerics(self, pl_module) -> None:
        plugin = self.strategy.precision_plugin
        stats = plugin.numerics_stats() if hasattr(plugin, "numerics_stats") else {}
        for key, value in stats.items():
            pl_module.log(key, float(value), on_step=True, prog_bar=key != "nonfinite_steps", rank_zero_only=True)

    def _stop(self, trainer, wd: Watchdog) -> None:
        signum = wd.requested_signal()
        where = ""
        if self.config.save_on_preempt:
            path = os.path.join(self._ckpt_dir(trainer), PREEMPT_CKPT)
            trainer.save_checkpoint(path)  # every rank is at this boundary: the collective save is safe
            where = f"; checkpoint saved to {path}"
        if trainer.is_global_zero:
            print(f"{PREFIX} every rank stopped after batch {self.batches} (global step {trainer.global_step}) "
                  f"on {signal_name(signum)}{where}", flush=True)
        raise Preempted(128 + signum)  # the watchdog stays: it ends this rank at stop_timeout if teardown hangs

    @staticmethod
    def _ckpt_dir(trainer) -> str:
        cb = trainer.checkpoint_callback
        if cb is not None and getattr(cb, "dirpath", None):
            return str(cb.dirpath)
        return os.path.join(trainer.default_root_dir, "checkpoints")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        note_first_error(self.strategy, exception)  # done already when another callback's on_exception ran first
        replacement, self.strategy._ls_replacement = getattr(self.strategy, "_ls_replacement", None), None
        if replacement is not None:
            Watchdog._print(f"{PREFIX} {replacement}")
            raise replacement from exception


__all__ = ["DiagnosticsCallback", "PREEMPT_CKPT", "Preempted", "gathered", "install", "log_secondary",
           "note_first_error", "run_teardown", "teardown"]
