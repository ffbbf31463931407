"""Run a function right after a module finishes importing, without importing it: :func:`run_after_import`.

Used where importing the other package up front would cost every caller its import time (Lightning: ~5 s for
every CLI) or a dependency they do not have (litgpt). A one-shot ``MetaPathFinder`` first in ``sys.meta_path``
asks the finders behind it for the real spec and wraps only that spec's loader, once; if the module is already
imported the function runs at once. Pure Python (no torch).
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, List, Tuple

_PENDING: List[Tuple[str, Callable]] = []  # (module name, fn) still waiting; for tests and idempotence


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, fn: Callable) -> None:
        self.target, self.fn = target, fn

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding this finder
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, fn = spec.loader.exec_module, self.fn

        def exec_then_run(module):
            exec_module(module)
            if (self.target, fn) in _PENDING:
                _PENDING.remove((self.target, fn))
            fn(module)

        spec.loader.exec_module = exec_then_run  # this spec's own loader instance
        return spec


def run_after_import(target: str, fn: Callable) -> None:
    """``fn(module)`` once ``target`` is imported: now if it already is, else right after its import executes.
    Calling it again with the same ``(target, fn)`` while it is still waiting installs nothing more."""
    if target in sys.modules:
        fn(sys.modules[target])
        return
    if (target, fn) in _PENDING:
        return
    _PENDING.append((target, fn))
    sys.meta_path.insert(0, _AfterImport(target, fn))
