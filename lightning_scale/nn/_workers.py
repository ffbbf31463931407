"""Chunk-level parallelism for the CPU block-gather engine.

Why not torch's intra-op threads: the engine issues many medium-sized ops (a gather, two matmuls,
a softmax per chunk), and every op is a fork/join of the OpenMP team. On a busy machine one
descheduled thread stalls every join. Instead W Python threads (W = ``torch.get_num_threads()``)
each run whole chunks with one intra-op thread (torch ops release the GIL), so threads never wait
for each other until the end of the pass.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import torch

_POOL: Optional[ThreadPoolExecutor] = None
_POOL_KEY = None


def worker_count(device: torch.device, num_tasks: int) -> int:
    """Threads for ``num_tasks`` independent tasks: torch's intra-op thread count on the CPU, 1 elsewhere."""
    return max(1, min(torch.get_num_threads(), num_tasks)) if device.type == "cpu" else 1


def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per process (recreated after a fork) whose threads each use one intra-op thread."""
    global _POOL, _POOL_KEY
    key = (os.getpid(), workers)
    if _POOL is None or _POOL_KEY != key:
        if _POOL is not None and _POOL_KEY[0] == os.getpid():
            _POOL.shutdown(wait=False)
        _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="block-sparse",
                                   initializer=torch.set_num_threads, initargs=(1,))
        _POOL_KEY = key
    return _POOL


def run_tasks(fn: Callable[[int], None], num_tasks: int, device: torch.device) -> None:
    """``fn(i)`` for every ``i < num_tasks``, each exactly once, on :func:`worker_count` threads that
    take the next task as they come free (inline on the caller's thread when one suffices)."""
    counter = itertools.count()  # next() is atomic under the GIL

    def loop() -> None:
        with torch.no_grad():  # grad mode is thread-local: pool threads start with it enabled
            while (i := next(counter)) < num_tasks:
                fn(i)

    workers = worker_count(device, num_tasks)
    if workers == 1:
        loop()
        return
    futures = [_pool(workers).submit(loop) for _ in range(workers)]
    errors = [f.exception() for f in futures]  # waits for all before raising the first error
    for err in errors:
        if err is not None:
            raise err


def static_shares(costs: Sequence[float], workers: int) -> List[List[int]]:
    """Deterministic longest-first assignment of items to ``workers`` shares, balancing the summed cost."""
    shares: List[List[int]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        w = min(range(workers), key=lambda x: (loads[x], x))
        shares[w].append(i)
        loads[w] += costs[i]
    return [sorted(s) for s in shares]
