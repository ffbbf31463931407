from lightning_scale.models.gpt import GPT, GPTConfig, gpt_small, gpt_tiny, lm_loss, make_batch
from lightning_scale.models import hf_pipeline  # noqa: F401  (registers the Hugging Face pipeline adapter)
from lightning_scale.models import litgpt_adapter  # noqa: F401  (registers litgpt's pipeline adapter and tp plan)

__all__ = ["GPT", "GPTConfig", "gpt_small", "gpt_tiny", "lm_loss", "make_batch"]
