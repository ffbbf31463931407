import os
import sys

# Tests import helpers that sit next to them (tests/dist/zero_workers.py ...); spawned ranks inherit sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("dist", "strategies", "unit", "kernels"):
    path = os.path.join(HERE, sub)
    if path not in sys.path:
        sys.path.insert(0, path)
