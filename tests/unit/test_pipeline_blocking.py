"""The blocking reference runtime refuses interleaved schedules (it would deadlock there), before any process
group is needed."""

import pytest
import torch.nn as nn

from lightning_scale.config import ConfigError
from lightning_scale.pipeline import PipelineRuntime, build_stage


def test_blocking_refuses_virtual_stages_before_any_communication():
    stage = build_stage([nn.Linear(4, 4) for _ in range(4)], pp=2, pp_rank=0, virtual_stages=2, partition="uniform")
    with pytest.raises(ConfigError, match=r"blocking=True.*interleaved_1f1b.*virtual_stages=2"):
        PipelineRuntime(stage, loss_fn=lambda o, t: o.sum(), microbatches=4, schedule="interleaved_1f1b",
                        blocking=True)
    # the same runtime, asynchronous, gets as far as the process-group check
    with pytest.raises(ConfigError, match="needs torch.distributed initialized"):
        PipelineRuntime(stage, loss_fn=lambda o, t: o.sum(), microbatches=4, schedule="interleaved_1f1b")
