import pytest
import torch

from lightning_scale.config import ConfigError, LossScaleConfig
from lightning_scale.zero.precision import DynamicLossScaler, policy_for


def test_policies():
    bf = policy_for("bf16-mixed")
    assert bf.param_dtype == torch.bfloat16 and bf.master_dtype == torch.float32 and not bf.loss_scaling
    fp16 = policy_for("16-mixed")
    assert fp16.loss_scaling and fp16.master_dtype_for(torch.float16) == torch.float32
    assert policy_for("32-true").master_dtype_for(torch.float32) == torch.float32
    assert policy_for("bf16").name == "bf16-mixed"
    with pytest.raises(ConfigError, match="precision='8-mixed'"):
        policy_for("8-mixed")


def test_dynamic_loss_scaler_backoff_growth_hysteresis_and_floor():
    s = DynamicLossScaler(LossScaleConfig(initial_scale=1024, growth_interval=2, hysteresis=2, min_scale=256))
    s.update(True)
    assert s.scale == 1024  # hysteresis: first overflow tolerated
    s.update(True)
    assert s.scale == 512 and s.skipped_steps == 2
    s.update(False)
    s.update(False)
    assert s.scale == 1024  # grew after growth_interval clean steps
    for _ in range(6):
        s.update(True)
    assert s.scale == 256  # never below min_scale
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.scale == 256 and t.skipped_steps == s.skipped_steps
