import os
import sys

import torch

# Triton kernels run in the interpreter on machines without CUDA; it must be set before triton is
# imported, and `import lightning_scale` imports triton through Lightning.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests import helpers that sit next to them (tests/dist/zero_workers.py ...); spawned ranks inherit sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("dist", "strategies", "unit", "kernels"):
    path = os.path.join(HERE, sub)
    if path not in sys.path:
        sys.path.insert(0, path)


# --- cleanup (issue 18): no rank or launched script outlives its test ------------------------------------------
# run_distributed / run_script kill their process groups themselves on timeout, failure, Ctrl-C and on
# pytest-timeout's exception (the default "signal" method raises inside the test). The hooks below are the
# backstop: a test that leaked a group, and pytest itself being terminated. pytest killed outright, or
# pytest-timeout's "thread" method (os._exit), is covered by the parent-death signal of each rank / script.
import signal  # noqa: E402

from lightning_scale import testing as _testing  # noqa: E402


def _terminate(signum, frame):  # noqa: ARG001
    _testing.kill_live_groups()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


signal.signal(signal.SIGTERM, _terminate)
signal.signal(signal.SIGHUP, _terminate)


def pytest_runtest_teardown(item, nextitem):  # noqa: ARG001
    _testing.kill_live_groups()


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    _testing.kill_live_groups()
    _testing.testing_zygote.close_all()
