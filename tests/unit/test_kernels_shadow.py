"""The repository's top-level ``kernels/`` folder ships as ``lightning_scale.kernels``: a bare ``import kernels`` in
the test process (as transformers does when the PyPI package ``kernels`` is installed) must never resolve to it,
whatever the working directory or PYTHONPATH put first on sys.path (tests/conftest.py moves the root last)."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _under_root(spec) -> bool:
    origin = getattr(spec, "origin", None) or ""
    return os.path.abspath(origin).startswith(os.path.join(ROOT, "kernels") + os.sep)


def test_bare_kernels_import_is_not_the_repository_folder():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not _under_root(spec), f"`import kernels` resolves to {spec.origin}"


def test_package_kernels_still_import():
    import lightning_scale.kernels.block_sparse_attention as bsa

    assert os.path.isdir(os.path.dirname(bsa.__file__))


def test_root_first_on_sys_path_shadows_without_the_conftest_fix():
    # Guards the guard: with the root first (what `python -m pytest` does without the conftest), `kernels` is the
    # repository folder; so the first test above would fail if the conftest stopped moving the root.
    code = ("import importlib.util, sys; sys.path.insert(0, %r); s = importlib.util.find_spec('kernels'); "
            "print(s.origin if s else None)") % ROOT
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(os.path.join(ROOT, "kernels")), out.stdout
