"""DiagnosticsConfig.validate(): bad input -> ConfigError naming the key as diagnostics.<key>."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_scale.config import ConfigError
from lightning_scale.diagnostics import DiagnosticsConfig


def test_defaults_validate_and_are_frozen_keyword_only():
    cfg = DiagnosticsConfig().validate()
    assert cfg.hang_timeout == 300.0 and cfg.on_nonfinite == "skip" and cfg.watchdog
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hang_timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        DiagnosticsConfig(5.0)  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    ({"hang_timeout": 0}, "diagnostics.hang_timeout=0 must be a finite number > 0"),
    ({"hang_timeout": -5.0}, "diagnostics.hang_timeout=-5.0 must be"),
    ({"hang_timeout": float("inf")}, "diagnostics.hang_timeout=inf must be"),
    ({"hang_timeout": "10"}, "diagnostics.hang_timeout='10' must be"),
    ({"first_step_grace": -1}, "diagnostics.first_step_grace=-1 must be a finite number >= 0"),
    ({"heartbeat_interval": 0}, "diagnostics.heartbeat_interval=0 must be"),
    ({"hang_timeout": 5, "heartbeat_interval": 10}, "diagnostics.heartbeat_interval=10 must be <= "
                                                   "diagnostics.hang_timeout=5"),
    ({"stop_timeout": 0}, "diagnostics.stop_timeout=0 must be"),
    ({"on_nonfinite": "warn"}, "diagnostics.on_nonfinite='warn': must be one of skip, raise, ignore"),
    ({"max_nonfinite_steps": 0}, "diagnostics.max_nonfinite_steps=0 must be an integer >= 1"),
    ({"max_min_scale_steps": 2.5}, "diagnostics.max_min_scale_steps=2.5 must be an integer >= 1"),
    ({"save_on_preempt": "yes"}, "diagnostics.save_on_preempt='yes' must be True or False"),
])
def test_bad_values_name_the_key(kwargs, message):
    with pytest.raises(ConfigError) as info:
        DiagnosticsConfig(**kwargs).validate()
    assert message in str(info.value)
