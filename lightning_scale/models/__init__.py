"""Models: the project GPT (:mod:`.gpt`), its torch-free config and counts (:mod:`.gpt_config`), and the adapters
that let Hugging Face and litgpt models be pipelined / tensor-parallel unchanged.

Importing this package imports no torch (the command-line tools count a model from its config alone): ``GPT``,
``lm_loss``, ``make_batch`` and the submodules load on first access. The adapters register their layer
providers (and litgpt's tp plan) as soon as torch is in the process: at once when it is already imported, else
right after its import finishes -- before any model they could apply to exists.
"""

from __future__ import annotations

import importlib
import sys

from lightning_scale._import_hook import run_after_import
from lightning_scale.models.gpt_config import GPTConfig, gpt_small, gpt_tiny

_LAZY = {"GPT": "gpt", "lm_loss": "gpt", "make_batch": "gpt"}
_SUBMODULES = ("gpt", "hf_families", "hf_pipeline", "litgpt_adapter")

__all__ = ["GPT", "GPTConfig", "gpt_small", "gpt_tiny", "lm_loss", "make_batch"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


def _register_adapters(_torch=None) -> None:
    importlib.import_module(f"{__name__}.hf_pipeline")  # registers the Hugging Face pipeline adapter
    importlib.import_module(f"{__name__}.litgpt_adapter")  # registers litgpt's pipeline adapter and tp plan


if "torch" in sys.modules:
    _register_adapters()
else:
    run_after_import("torch", _register_adapters)
