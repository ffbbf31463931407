from lightning_scale.models.gpt import GPT, GPTConfig, gpt_small, gpt_tiny, lm_loss, make_batch

__all__ = ["GPT", "GPTConfig", "gpt_small", "gpt_tiny", "lm_loss", "make_batch"]
