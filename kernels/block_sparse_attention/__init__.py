"""Fused block-sparse attention (Triton), its index lists and a dense torch reference.

``kernel`` (``@triton.jit``) and ``launch`` (autograd.Function) import triton; import them
explicitly (``from lightning_scale.kernels.block_sparse_attention.launch import ...``) so that this
package, the index builder and the reference stay importable where triton is absent, and so tests
can set ``TRITON_INTERPRET=1`` before the kernels are defined.
"""

from .index import BlockIndex, build_block_index, causal_layout, index_to
from .reference import dense_reference, expand_layout

__all__ = ["BlockIndex", "build_block_index", "causal_layout", "dense_reference", "expand_layout", "index_to"]
