"""Megatron-style tensor parallelism applied to an unchanged model (pure torch; every call takes ``group``).

Typical use (every rank of the tp group, on an identical model)::

    from lightning_scale.tensor_parallel import apply_tensor_parallel, sync_tp_grads, consolidate_state_dict

    apply_tensor_parallel(model, plan=None, group=tp_group)   # built-in plan for the GPT / HF models
    loss = model.loss(idx, targets); loss.backward()
    sync_tp_grads(model)                                      # only does work with sequence_parallel=True
    optimizer.step()
    full = consolidate_state_dict(model)                      # original keys and shapes

See docs/tensor_parallel.md.
"""

from lightning_scale.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from lightning_scale.tensor_parallel.grads import clip_grad_norm_, grad_norm, sync_tp_grads
from lightning_scale.tensor_parallel.hf import GPT2_BASE_PLAN, GPT_PLAN, default_plan, find_plannable_module
from lightning_scale.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lightning_scale.tensor_parallel.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
    scatter_to_sequence_region,
)
from lightning_scale.tensor_parallel.apply import apply_tensor_parallel
from lightning_scale.tensor_parallel.plan import TensorParallelPlan, plan_tensor_parallel
from lightning_scale.tensor_parallel.sharding import (
    ShardSpec,
    merge_shards,
    shard_tensor,
    tp_partial_grad,
    tp_replicated,
    tp_spec,
)
from lightning_scale.tensor_parallel.state import (
    TensorParallelState,
    consolidate_state_dict,
    load_full_state_dict,
    shard_state_dict,
    tensor_parallel_state,
)
from lightning_scale.tensor_parallel.styles import STYLE_NAMES, Style

__all__ = [
    "ColumnParallelLinear",
    "GPT2_BASE_PLAN",
    "GPT_PLAN",
    "RowParallelLinear",
    "STYLE_NAMES",
    "ShardSpec",
    "Style",
    "TensorParallelPlan",
    "TensorParallelState",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "consolidate_state_dict",
    "copy_to_region",
    "default_plan",
    "find_plannable_module",
    "gather_from_region",
    "gather_from_sequence_region",
    "grad_norm",
    "load_full_state_dict",
    "merge_shards",
    "plan_tensor_parallel",
    "reduce_from_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_region",
    "scatter_to_sequence_region",
    "shard_state_dict",
    "shard_tensor",
    "sync_tp_grads",
    "tensor_parallel_state",
    "tp_partial_grad",
    "tp_replicated",
    "tp_spec",
    "vocab_parallel_cross_entropy",
    # ZeRO engines over tp slices: their norm / overflow agreement is lightning_scale.zero.model_parallel.CrossAxis
]
