"""Formatting of what the watchdog prints, and the facts it reads about processes (pids, stacks)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import tempfile
import time
from typing import Dict, List, Optional

from lightning_scale.diagnostics import trace

PREFIX = "[lightning_scale]"


def heartbeat(rank: int, hang_budget: float) -> Dict:
    """This rank's state now, as stored under hb/<rank> (JSON)."""
    r, now = trace.RECORD, time.monotonic()
    hb = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "t": time.time(), "step": r.step,
          "seq": r.seq, "done": r.done, "last": trace.describe(r.op, r.tag, r.nbytes, r.group, r.seq) if r.seq else "",
          "wait_seq": r.wait_seq, "budget": hang_budget}
    if r.wait_seq:
        hb["wait"] = trace.describe(r.wait_op, r.wait_tag, r.wait_nbytes, r.wait_group, r.wait_seq)
        hb["wait_for"] = round(now - r.wait_since, 2)
    return hb


def dump_stack() -> str:
    """Every thread's Python stack of this process (faulthandler: works while the main thread is blocked)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def pid_state(pid: int, host: str) -> Optional[str]:
    """'gone' / 'zombie' / 'alive' for a process on this host; None when it runs elsewhere."""
    if host != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return "zombie" if state in ("Z", "X") else "alive"
    except FileNotFoundError:
        return "gone"
    except OSError:
        try:
            os.kill(pid, 0)
            return "alive"
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "alive"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def killed_text(rank: int, pid: int, returncode: Optional[int]) -> str:
    if returncode is not None and returncode < 0:
        return f"rank {rank} (pid {pid}) was killed by signal {-returncode} ({signal_name(-returncode)})"
    if returncode is not None:
        return f"rank {rank} (pid {pid}) exited with code {returncode} without reporting an error"
    return (f"rank {rank} (pid {pid}) was killed by a signal: its process is gone without reporting an error "
            "(SIGKILL, e.g. the OOM killer or a scheduler)")


def behind(hbs: Dict[int, Dict]) -> List[int]:
    """Ranks the others wait for: not blocked in a collective while some rank is; else the fewest entered."""
    if not hbs:
        return []
    waiting = [r for r, h in hbs.items() if h.get("wait_seq")]
    if waiting and len(waiting) < len(hbs):
        return sorted(r for r in hbs if r not in waiting)
    low = min(h["seq"] for h in hbs.values())
    out = sorted(r for r, h in hbs.items() if h["seq"] == low)
    return out if len(out) < len(hbs) else []


def rank_line(rank: int, hb: Optional[Dict], now: float, interval: float) -> str:
    if hb is None:
        return f"  rank {rank}: no heartbeat ever (did not start the watchdog, or died early)"
    age = now - hb["t"]
    head = f"  rank {rank} (pid {hb['pid']} on {hb['host']}, step {hb['step']}, {hb['seq']} collectives entered):"
    if hb.get("wait_seq"):
        body = f" blocked {hb['wait_for']:.1f} s in {hb['wait']}"
    else:
        body = " not in a collective"
        if hb.get("last"):
            body += f"; last entered {hb['last']}" + (" (completed)" if hb["done"] >= hb["seq"] else "")
    if age > 3 * interval + 1:
        body += f"; last heartbeat {age:.1f} s ago"
    return head + body


def hang_report(cause: Dict, hbs: Dict[int, Dict], world: int, stacks: Dict[int, str], interval: float) -> str:
    now = time.time()
    late = behind(hbs)
    lines = [f"{PREFIX} HANG: {cause['text']}", f"{PREFIX} last collective of each rank:"]
    lines += [rank_line(r, hbs.get(r), now, interval) for r in range(world)]
    if late:
        lines.append(f"{PREFIX} ranks behind (the others wait for them): {late}")
    for r in late or sorted(stacks):
        if r in stacks:
            lines.append(f"{PREFIX} Python stack of rank {r} (faulthandler):")
            lines += ["    " + ln for ln in stacks[r].rstrip().splitlines()]
    lines.append(f"{PREFIX} HANG: every rank exits now (stuck rank(s): {late or 'unknown'})")
    return "\n".join(lines)


def loads(raw: bytes) -> Optional[Dict]:
    try:
        return json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None
