"""Pipeline parallelism: schedules as data, partitioners, stages and the runtime that runs them.

Typical use on each rank of a pipeline (see docs/pipeline.md)::

    layers = pipeline_layers(model)                       # or gpt_pipeline_layers(gpt)
    stage = build_stage(layers, pp=topo.pp, pp_rank=topo.pp_rank, virtual_stages=1, partition="parameters")
    runtime = PipelineRuntime(stage, pp_group=topo.pp_group, pp_ranks=topo.axis_ranks("pp"),
                              loss_fn=lm_loss, microbatches=8, schedule="1f1b")
    loss = runtime.train_step(inputs, targets)            # same mean loss on every pp rank
    optimizer.step(); optimizer.zero_grad()               # optimizer over stage.parameters()

With data parallelism and ZeRO-1/2 per stage, :class:`ZeroPipeline` (``with_zero.py``) wraps the
runtime and the stage's ZeRO engines (built with ``cross_axis=pipeline_cross_axis(runtime)``): one
reduce-scatter per step, global-norm clipping across stages, one overflow decision.
"""

from lightning_scale.pipeline.layers import GPTEmbedding, GPTHead, gpt_pipeline_layers, pipeline_layers
from lightning_scale.pipeline.partition import METHODS as PARTITION_METHODS
from lightning_scale.pipeline.partition import describe_partition, partition_layers
from lightning_scale.pipeline.runtime import PipelineRuntime
from lightning_scale.pipeline.schedule import (
    Action,
    Schedule,
    ScheduleError,
    available_schedules,
    build_schedule,
)
from lightning_scale.pipeline.stage import PipelineStage, TiedParameter, build_stage
from lightning_scale.pipeline.validate import ScheduleStats, validate_schedule
from lightning_scale.pipeline.with_zero import ZeroPipeline, pipeline_cross_axis

__all__ = [
    "Action", "GPTEmbedding", "GPTHead", "PARTITION_METHODS", "PipelineRuntime", "PipelineStage", "Schedule",
    "ScheduleError", "ScheduleStats", "TiedParameter", "ZeroPipeline", "available_schedules", "build_schedule",
    "build_stage", "describe_partition", "gpt_pipeline_layers", "partition_layers", "pipeline_cross_axis",
    "pipeline_layers", "validate_schedule",
]
