"""The watchdog: heartbeats, hang detection, "first error wins" and the bounded stop, over the c10d store.

One daemon thread per rank talks to a side channel that is not the training process group (the default
group's c10d store, or a TCPStore / FileStore handed in), so it keeps working while the main thread is
blocked inside a collective. Keys (under the ``ls_diag/`` prefix):

==============  =====================================================================================
hb/<rank>       heartbeat JSON every ``heartbeat_interval``: step, collectives entered, the one blocked in
abort           the first fatal event, set once (``compare_set``): a hang, or ``rank R failed: ...``
stack/<rank>    a rank's faulthandler dump, written when it sees ``abort``
ack/<rank>      the rank has printed the diagnosis and is exiting
stop_at         the step after which every rank stops (SIGTERM / SIGINT); first proposal wins
==============  =====================================================================================

A rank blocked in one collective for longer than ``hang_timeout`` (plus ``first_step_grace`` before the first
step) sets ``abort``; every rank's thread then prints the same diagnosis (each rank's last collective, the
ranks behind, their Python stacks) and ends its process with :data:`EXIT_HANG`, and ranks on this host that
did not acknowledge are killed, so no process is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional

from lightning_scale.diagnostics import report, trace
from lightning_scale.diagnostics.config import DiagnosticsConfig
from lightning_scale.diagnostics.elastic import shared_attempt

EXIT_HANG = 70  # a hang was detected (by any rank)
EXIT_PEER_FAILED = 71  # another rank failed first; this one was ended by the watchdog
EXIT_STOP_TIMEOUT = 72  # a stop (signal / failure) did not complete within stop_timeout
_ACK_WAIT_S = 5.0
_FINISHES: Dict[int, int] = {}  # rank -> normal ends so far in this process: ranks end their fits in step


class PeerFailedError(RuntimeError):
    """Raised on a surviving rank instead of the transport error: names the rank that failed first and why."""


class Watchdog:
    def __init__(self, store: Any, rank: int, world_size: int, config: Optional[DiagnosticsConfig] = None, *,
                 children: Optional[Dict[int, Any]] = None, prefix: str = "ls_diag/",
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        import torch.distributed as dist

        self.config = (config or DiagnosticsConfig()).validate()
        # torchrun's agent store outlives a restart on one host: each attempt gets its own keys (no stale "abort").
        # Not the restart count across hosts: there the agents' counts differ, and the ranks of one attempt would
        # not see each other's heartbeats, failures or ends (the two-node restart test's rank 0 waited stop_timeout
        # at the end for a rank 1 that had finished under another count).
        attempt = shared_attempt()
        self.store = dist.PrefixStore(prefix if attempt is None else f"{prefix}{attempt}/", store)
        self.rank, self.world = rank, world_size
        self.children = children or {}  # rank -> Popen of ranks this process launched (exact exit signals)
        self._exit = exit_fn
        self._stop_thread = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.stop_signal = 0  # set when this process received SIGTERM / SIGINT
        self._stop_deadline: Optional[float] = None
        self._stop_at: Optional[int] = None
        self._own_failure = False
        self._wakeup_r: Optional[int] = None  # the signal wakeup pipe the monitor thread selects on
        self._wakeup_w: Optional[int] = None
        self.fingerprinter = None
        self._exiting: Optional[int] = None  # the exit code once this rank is leaving
        self._child_gone: Dict[int, float] = {}  # rank -> when its process was first seen ended with a failure

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Watchdog":
        self.store.set(f"hb/{self.rank}", json.dumps(report.heartbeat(self.rank, self._budget())))
        if self.config.debug_collectives or trace.debug_env():
            from lightning_scale.diagnostics.fingerprint import Fingerprinter

            self.fingerprinter = Fingerprinter(self.store, self.rank, timeout=self.config.hang_timeout)
            trace.set_fingerprinter(self.fingerprinter)
        self._thread = threading.Thread(target=self._run, name="lightning_scale-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Normal end: stop the thread (no diagnosis). Safe to call twice."""
        self._stop_thread.set()
        self._wake()  # a thread waiting in select() on the signal pipe would otherwise sleep out its interval
        if self.fingerprinter is not None:
            trace.set_fingerprinter(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.config.heartbeat_interval + 1)
            if not self._thread.is_alive():
                self._release_wakeup()
        self._thread = None

    def _wake(self) -> None:
        if self._wakeup_w is not None:
            try:
                os.write(self._wakeup_w, b"\0")  # not a signal number: _wait reads it and ignores it
            except OSError:
                pass

    def _release_wakeup(self) -> None:
        """Give the process its signal wakeup fd back (none) and close the pipe: a later run in this process (fit
        after fit) installs its own."""
        if self._wakeup_w is None:
            return
        try:
            current = signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread: leave it set; the pipe stays open
            return
        if current != self._wakeup_w:  # someone replaced ours since: theirs stays
            signal.set_wakeup_fd(current)
        os.close(self._wakeup_r), os.close(self._wakeup_w)
        self._wakeup_r = self._wakeup_w = None

    def finish(self) -> None:
        """Normal end, after :meth:`close`: this rank's last use of the store. The rank whose process hosts the c10d
        store (rank 0, under Lightning's launcher and a torchrun without an agent store) waits, at most
        ``stop_timeout``, until every rank got here: otherwise a rank 0 done first exits while a peer still checks
        the store at the end of its last step, and that peer fails a finished run ("Failed to recv, got 0 bytes",
        seen at the end of a 1-step fit)."""
        gen = _FINISHES[self.rank] = _FINISHES.get(self.rank, -1) + 1
        key = f"done/{gen}/"
        try:
            self.store.set(f"{key}{self.rank}", "1")
            if self.rank != 0:
                return
            keys = [f"{key}{r}" for r in range(self.world)]
            deadline = time.monotonic() + self.config.stop_timeout
            while not self.store.check(keys):
                if self.store.check(["stop_req"]) or self.store.check(["abort"]):
                    return  # not a normal end on some rank: it bounds its own exit; do not hold this one
                if time.monotonic() > deadline:
                    raise TimeoutError("done keys missing")
                time.sleep(0.05)
        except Exception as err:  # noqa: BLE001 - the run is over: a peer gone or late is not this rank's failure
            if self.rank == 0:
                self._print(f"{report.PREFIX} rank 0: not every rank reached the end of the run within "
                            f"{self.config.stop_timeout:g} s ({type(err).__name__}); exiting anyway")

    def _budget(self) -> float:
        grace = self.config.first_step_grace if trace.RECORD.step == 0 else 0.0
        return self.config.hang_timeout + grace

    # ------------------------------------------------------------------ the monitor thread
    def _run(self) -> None:
        interval = self.config.heartbeat_interval
        while not self._stop_thread.is_set():
            try:
                self._tick()
            except Exception as err:  # noqa: BLE001 - the store is gone: its host (rank 0's process) died
                if self._stop_thread.is_set():
                    return
                if self._exiting is not None:  # already reporting: the host left first
                    self._exit(self._exiting)
                    return
                if self._stop_deadline is not None:  # stopping already (an agreed error, a signal): rank 0 may
                    self._bound_exit()  # just have finished first; keep only the bound on this rank's exit
                    return
                self._print(f"{report.PREFIX} rank {self.rank}: lost the c10d store ({type(err).__name__}: "
                            f"{err}); the rank hosting it (rank 0) is gone. Exiting.")
                self._exit(EXIT_PEER_FAILED)
                return
            self._wait(interval)

    def _bound_exit(self) -> None:
        """Without the store: exit with EXIT_STOP_TIMEOUT if this process is still alive at the stop deadline."""
        while not self._stop_thread.is_set() and time.monotonic() < self._stop_deadline:
            self._stop_thread.wait(0.2)
        if not self._stop_thread.is_set():
            self._exit(EXIT_STOP_TIMEOUT)

    def _wait(self, seconds: float) -> None:
        if self._wakeup_r is None:
            self._stop_thread.wait(seconds)
            return
        ready, _, _ = select.select([self._wakeup_r], [], [], seconds)
        if ready:  # a signal arrived at the C level: seen even while the main thread is blocked
            data = os.read(self._wakeup_r, 64)
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    self._note_signal(signum)

    def _tick(self) -> None:
        budget = self._budget()
        self.store.set(f"hb/{self.rank}", json.dumps(report.heartbeat(self.rank, budget)))
        if self.store.check(["abort"]):
            self._on_abort(report.loads(self.store.get("abort")) or {"kind": "unknown", "text": "?"})
            return
        r = trace.RECORD
        if r.wait_seq and time.monotonic() - r.wait_since > budget:
            what = trace.describe(r.wait_op, r.wait_tag, r.wait_nbytes, r.wait_group, r.wait_seq)
            self.publish("hang", f"rank {self.rank} has waited {time.monotonic() - r.wait_since:.1f} s "
                                 f"(hang_timeout {budget:.0f} s) in {what}")
            return
        if self.children and self._check_children():
            return
        if self.stop_signal and not self.store.check(["stop_req"]):
            self.store.compare_set("stop_req", "", json.dumps({"rank": self.rank, "signal": self.stop_signal}))
        if self._stop_deadline is None and self.store.check(["stop_req"]):
            self._stop_deadline = time.monotonic() + self.config.stop_timeout
        if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
            req = report.loads(self.store.get("stop_req")) or {}
            self._print(f"{report.PREFIX} rank {self.rank}: the stop requested by rank {req.get('rank')} "
                        f"({report.signal_name(int(req.get('signal', 15)))}) did not complete within "
                        f"stop_timeout={self.config.stop_timeout:.0f} s (the ranks could not agree); exiting now. "
                        "The last complete checkpoint stays.")
            self._exit(128 + (self.stop_signal or int(req.get("signal", 15))))

    def _check_children(self) -> bool:
        """The ranks this process launched (Lightning's script launcher): one that ended with a failure without
        publishing an error (SIGKILL, the OOM killer, a crash in C) is published in its name, after two heartbeats
        (this rank's main thread may be naming it already, from the transport error it got), so every rank stops
        naming it instead of waiting in a collective for ``hang_timeout``. Returns True when it published."""
        if self.stopping or self.store.check(["stop_req"]):
            return False  # an agreed stop or this rank's own failure: its bound holds
        now = time.monotonic()
        for r, child in self.children.items():
            code = child.poll()
            if code in (None, 0):
                continue
            since = self._child_gone.setdefault(r, now)
            if now - since >= 2 * self.config.heartbeat_interval and not self.store.check(["abort"]):
                self.publish("error", report.killed_text(r, child.pid, code), rank=r)
                return True
        return False

    def _on_abort(self, cause: Dict) -> None:
        if cause.get("kind") == "error" and cause.get("rank") == self.rank:
            # This rank failed: its main thread reports it; exit anyway if teardown hangs.
            if self._stop_deadline is None:
                self.store.set(f"ack/{self.rank}", "1")
                self._stop_deadline = time.monotonic() + self.config.stop_timeout
            if time.monotonic() > self._stop_deadline:
                self._exit(EXIT_STOP_TIMEOUT)
            return
        if cause.get("kind") != "hang":  # another rank failed first: say so, and end (the main thread may be blocked)
            self._print(f"{report.PREFIX} rank {self.rank}: stopping because {cause.get('text')}")
            self._leave(EXIT_PEER_FAILED)
            return
        self.store.set(f"stack/{self.rank}", report.dump_stack())
        self.store.set(f"ack/{self.rank}", "1")
        deadline = time.monotonic() + _ACK_WAIT_S
        others = [r for r in range(self.world) if r != self.rank]
        while time.monotonic() < deadline and not self.store.check([f"ack/{r}" for r in others] or ["abort"]):
            time.sleep(0.05)
        hbs = self._heartbeats()
        stacks = {r: self.store.get(f"stack/{r}").decode() for r in range(self.world) if self.store.check([f"stack/{r}"])}
        self._print(report.hang_report(cause, hbs, self.world, stacks, self.config.heartbeat_interval))
        self._kill_unresponsive(hbs)
        self._leave(EXIT_HANG)

    def _leave(self, code: int) -> None:
        """Exit; the store's host (rank 0) waits a moment for the others first, so they do not lose the store
        half-way through their own report."""
        self._exiting = code
        try:
            self.store.set(f"bye/{self.rank}", "1")
            deadline = time.monotonic() + _ACK_WAIT_S
            if self.rank == 0:
                keys = [f"bye/{r}" for r in range(1, self.world)  # not the launched ranks that are gone
                        if r not in self.children or self.children[r].poll() is None]
                while keys and time.monotonic() < deadline and not self.store.check(keys):
                    time.sleep(0.05)
            if code == EXIT_HANG and not trace.RECORD.wait_seq:
                self._let_blocked_ranks_leave_first(deadline)
        except Exception:  # noqa: BLE001 - the store is gone: nothing left to wait for
            pass
        self._exit(code)

    def _let_blocked_ranks_leave_first(self, deadline: float) -> None:
        """A rank that is not inside a collective waits (until ``deadline``) for the ranks on this host that are
        blocked in one to exit: its own exit would close their connections, and their main threads would then
        fail with a transport error before their watchdogs exit with EXIT_HANG."""
        blocked = [hb for r, hb in self._heartbeats().items() if r != self.rank and hb.get("wait_seq")]
        for hb in blocked:
            while time.monotonic() < deadline and report.pid_state(hb["pid"], hb["host"]) == "alive":
                time.sleep(0.02)

    def _kill_unresponsive(self, hbs: Dict[int, Dict]) -> None:
        """Ranks on this host that never acknowledged (a frozen interpreter): SIGKILL, so nothing is left."""
        for r, hb in hbs.items():
            if r == self.rank or self.store.check([f"ack/{r}"]) or hb.get("pid") == os.getpid():
                continue
            if report.pid_state(hb["pid"], hb["host"]) == "alive":
                try:
                    os.kill(hb["pid"], signal.SIGKILL)
                    self._print(f"{report.PREFIX} rank {self.rank}: killed unresponsive rank {r} (pid {hb['pid']})")
                except OSError:
                    pass

    # ------------------------------------------------------------------ shared facts
    def _heartbeats(self) -> Dict[int, Dict]:
        out = {}
        for r in range(self.world):
            if self.store.check([f"hb/{r}"]):
                hb = report.loads(self.store.get(f"hb/{r}"))
                if hb is not None:
                    out[r] = hb
        return out

    def publish(self, kind: str, text: str, rank: Optional[int] = None) -> bool:
        """Record the first fatal event (``rank``: the rank it happened on, this one by default: another for a
        launched rank that died without a word); returns True when this call was first."""
        mine = json.dumps({"kind": kind, "rank": self.rank if rank is None else rank, "text": text, "t": time.time()})
        return self.store.compare_set("abort", "", mine).decode() == mine

    def report_failure(self, exc: BaseException) -> bool:
        self._own_failure = True
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return self.publish("error", f"rank {self.rank} failed: {type(exc).__name__}: {msg}"[:2000])

    def first_failure(self, wait_s: float = 0.0) -> Optional[str]:
        """Another rank's failure (published, or its process gone), waiting up to ``wait_s`` for one to show."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.store.check(["abort"]):
                cause = report.loads(self.store.get("abort")) or {}
                if cause.get("rank") != self.rank:
                    return cause.get("text")
            for r, hb in self._heartbeats().items():
                if r == self.rank:
                    continue
                child = self.children.get(r)
                code = child.poll() if child is not None else None
                state = report.pid_state(hb["pid"], hb["host"])
                if code is not None or state in ("gone", "zombie"):
                    return report.killed_text(r, hb["pid"], code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def handle_exception(self, exc: BaseException, wait_s: float = 5.0) -> Optional[BaseException]:
        """The main thread is failing with ``exc``: publish it if it is the first error, else return the
        :class:`PeerFailedError` to raise instead (the survivors name the root cause, not the transport)."""
        if isinstance(exc, (PeerFailedError, KeyboardInterrupt, SystemExit)):
            return None
        if self._hang_declared():
            self._await_own_exit()  # a hang is being reported: this error is its consequence, the watchdog exits
        if getattr(exc, "raised_on_every_rank", False):  # an agreed decision (NumericsError): each rank reports it
            self._stop_deadline = time.monotonic() + self.config.stop_timeout
            return None
        earlier = self.first_failure(0.0)
        if earlier is None and _transport_error(exc):
            earlier = self.first_failure(wait_s)
        if earlier is None:
            self.report_failure(exc)
            return None
        self._stop_deadline = time.monotonic() + self.config.stop_timeout  # bounded teardown
        return PeerFailedError(f"{earlier} (rank {self.rank} stopped because of it)")

    def _hang_declared(self) -> bool:
        if self._exiting is not None:
            return True
        try:
            return self.store.check(["abort"]) and (report.loads(self.store.get("abort")) or {}).get("kind") == "hang"
        except Exception:  # noqa: BLE001 - the store is gone
            return False

    def _await_own_exit(self) -> None:
        """Block the main thread while the monitor thread reports the hang and exits the process (bounded)."""
        deadline = time.monotonic() + 3 * _ACK_WAIT_S + 2 * self.config.heartbeat_interval
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.05)

    @contextlib.contextmanager
    def guard(self) -> Iterator["Watchdog"]:
        """For plain torch loops: ``with wd.guard(): train()``. The first error is published; a rank failing
        because another one did prints and raises :class:`PeerFailedError` naming that rank instead."""
        try:
            yield self
        except BaseException as exc:
            replacement = self.handle_exception(exc)
            if replacement is None:
                raise
            self._print(f"{report.PREFIX} {replacement}")
            raise replacement from exc

    # ------------------------------------------------------------------ stop on signals
    def install_signal_handlers(self, signums=(signal.SIGTERM, signal.SIGINT)) -> None:
        """SIGTERM / SIGINT request a stop of every rank (see :meth:`should_stop`); main thread only."""
        for signum in signums:
            signal.signal(signum, self._handler)
        if self._wakeup_r is None:
            r, w = os.pipe()
            os.set_blocking(w, False)
            try:
                old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            except ValueError:  # not the main thread
                os.close(r), os.close(w)
                return
            if old != -1:  # someone else's (asyncio's, a library's): theirs stays; the thread waits on its event
                signal.set_wakeup_fd(old)
                os.close(r), os.close(w)
                return
            self._wakeup_r, self._wakeup_w = r, w

    def _handler(self, signum, frame) -> None:
        if self.stop_signal and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user insists
        self._note_signal(signum)

    def _note_signal(self, signum: int) -> None:
        if not self.stop_signal:
            self.stop_signal = int(signum)
            self._print(f"{report.PREFIX} rank {self.rank}: received {report.signal_name(signum)}; every rank "
                        f"stops within stop_timeout={self.config.stop_timeout:.0f} s")

    def should_stop(self, step: int) -> bool:
        """Call at every step boundary (after ``step`` steps): True when every rank stops after this step.

        The first rank to learn of a stop request (its own signal, or ``stop_req`` in the store) proposes
        ``step + 2``; ranks of a synchronous job are less than two steps apart, so every rank reaches that
        boundary and stops there, together (a collective such as a checkpoint save is safe). One store check
        per step while no stop is requested."""
        if self._stop_at is None:
            if not (self.stop_signal or self.store.check(["stop_req"])):
                return False
            if not self.store.check(["stop_at"]):
                self.store.compare_set("stop_at", "", str(step + 2))
            if self.stop_signal:  # after stop_at: a peer that sees stop_req finds stop_at too
                self.store.compare_set("stop_req", "", json.dumps({"rank": self.rank, "signal": self.stop_signal}))
            self._stop_at = int(self.store.get("stop_at").decode())
        return step >= self._stop_at

    @property
    def stopping(self) -> bool:
        """This rank is failing or stopping: keep the thread, it bounds the exit."""
        return self._own_failure or self._stop_deadline is not None or bool(self.stop_signal)

    def requested_signal(self) -> int:
        if self.stop_signal:
            return self.stop_signal
        if self.store.check(["stop_req"]):
            return int((report.loads(self.store.get("stop_req")) or {}).get("signal", signal.SIGTERM))
        return signal.SIGTERM

    @staticmethod
    def _print(text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _transport_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return any(k in text for k in ("connection", "gloo", "nccl", "distbackend", "peer", "socket", "timed out",
                                   "timeout", "broken pipe"))


def default_store():
    """The c10d store of the default process group (Lightning's / torchrun's TCPStore, or the file store)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def start_watchdog(config: Optional[DiagnosticsConfig] = None, store: Any = None, **kwargs: Any) -> Watchdog:
    """A started :class:`Watchdog` for this rank of the default process group."""
    import torch.distributed as dist

    return Watchdog(store if store is not None else default_store(), dist.get_rank(), dist.get_world_size(),
                    config, **kwargs).start()


