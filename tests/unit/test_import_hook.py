"""lightning_scale._import_hook.run_after_import: the one-shot hook that registers the strategies after Lightning's
import and installs litgpt's tp plan after litgpt's, without importing either up front."""

import importlib
import sys

from lightning_scale._import_hook import _PENDING, run_after_import


def _make_module(tmp_path, name):
    (tmp_path / f"{name}.py").write_text("VALUE = 41\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()


def test_runs_once_right_after_the_import_and_not_before(tmp_path):
    name = "ls_hook_target_a"
    _make_module(tmp_path, name)
    seen = []

    def fn(module):
        seen.append(module.VALUE)  # the module has executed when fn runs
        module.VALUE += 1

    try:
        run_after_import(name, fn)
        run_after_import(name, fn)  # still waiting: no second finder
        assert seen == [] and name not in sys.modules
        assert sum(1 for f in sys.meta_path if getattr(f, "target", None) == name) == 1
        mod = importlib.import_module(name)
        assert seen == [41] and mod.VALUE == 42
        assert (name, fn) not in _PENDING
        assert not any(getattr(f, "target", None) == name for f in sys.meta_path)  # one shot: removed
        importlib.reload(mod)
        assert seen == [41]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_already_imported_runs_at_once(tmp_path):
    name = "ls_hook_target_b"
    _make_module(tmp_path, name)
    try:
        mod = importlib.import_module(name)
        seen = []
        run_after_import(name, lambda m: seen.append(m))
        assert seen == [mod]
        assert not any(getattr(f, "target", None) == name for f in sys.meta_path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
