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
