"""Neural-network building blocks: block-sparse attention (DeepSpeed's sparsity configs, fused Triton
kernels on GPU, a chunked block-gather engine on CPU), modules and swap helpers, and the experts list a
mixture-of-experts block calls on routes (placed by expert parallelism)."""

from lightning_scale.nn.flex import block_mask_to_layout, layout_mask_mod, layout_to_block_mask
from lightning_scale.nn.padding import pad_inputs_to_block_size, pad_to_block_size, unpad_sequence_output
from lightning_scale.nn.sparse_attention import SparseSelfAttention, block_sparse_attention
from lightning_scale.nn.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    layout_density,
)
from lightning_scale.nn.swap import (
    SparseMultiheadAttention,
    apply_sparse_attention,
    swap_gpt_attention,
    swap_hf_attention,
)
from lightning_scale.tensor_parallel.expert_lists import ExpertList  # a MoE block's experts, called on routes

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "ExpertList",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseMultiheadAttention",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "apply_sparse_attention",
    "block_mask_to_layout",
    "block_sparse_attention",
    "layout_density",
    "layout_mask_mod",
    "layout_to_block_mask",
    "pad_inputs_to_block_size",
    "pad_to_block_size",
    "swap_gpt_attention",
    "swap_hf_attention",
    "unpad_sequence_output",
]
