"""The project GPT's configuration and its parameter counts, in pure Python (no torch).

Split from :mod:`lightning_scale.models.gpt` so the command-line tools (``python -m lightning_scale.estimate
--model gpt_small``) count a model without importing torch (~2 s of start-up on a 2-core machine): the counts
are arithmetic on the config and equal ``sum(p.numel())`` over the real model's unique parameters
(``tests/unit/test_cli_startup.py`` checks every shipped model name and the ``tie_weights`` / ``bias`` variants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = False
    # loss() runs the head + cross-entropy in chunks of this many positions when the sequence is longer (the full
    # (B, T, vocab) logits never exist; lightning_scale.nn.chunked_loss, docs/long_sequences.md). 0: never.
    loss_chunk: int = 512
    # Positions: "learned" (GPT-2's table wpe, seq_len x d_model parameters that grow with the length) or "rotary"
    # (RoPE on q and k in every attention, base rope_theta; no parameters: nothing grows with seq_len).
    position: str = "learned"
    rope_theta: float = 10000.0

    def validate(self) -> "GPTConfig":
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"model.loss_chunk={self.loss_chunk!r} must be an integer >= 0 (0: never chunk)")
        if self.d_model % self.n_head:
            raise ValueError(f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}")
        if self.position not in ("learned", "rotary"):
            raise ValueError(f"model.position={self.position!r} must be 'learned' or 'rotary'")
        if self.position == "rotary" and (self.d_model // self.n_head) % 2:
            raise ValueError(f"model.position='rotary' needs an even head size (d_model / n_head = "
                              f"{self.d_model // self.n_head})")
        if not self.rope_theta > 0:
            raise ValueError(f"model.rope_theta={self.rope_theta} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        return self

    def num_params(self) -> int:
        """Trainable parameters of ``GPT(self)``, a tied head counted once."""
        return sum(n for _, n in parameter_numels(self))


def _block_numels(cfg: GPTConfig, prefix: str) -> List[Tuple[str, int]]:
    """One ``Block``'s parameters in its ``named_parameters()`` order: ln1, attn.qkv, attn.proj, ln2, mlp."""
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    out: List[Tuple[str, int]] = []

    def linear(name: str, fan_in: int, fan_out: int) -> None:
        out.append((f"{prefix}{name}.weight", fan_out * fan_in))
        if cfg.bias:
            out.append((f"{prefix}{name}.bias", fan_out))

    def norm(name: str) -> None:  # nn.LayerNorm(d, bias=cfg.bias): weight always, bias only with cfg.bias
        out.append((f"{prefix}{name}.weight", d))
        if cfg.bias:
            out.append((f"{prefix}{name}.bias", d))

    norm("ln1")
    linear("attn.qkv", d, 3 * d)
    linear("attn.proj", d, d)
    norm("ln2")
    linear("mlp.fc", d, h)
    linear("mlp.proj", h, d)
    return out


def parameter_numels(cfg: GPTConfig) -> List[Tuple[str, int]]:
    """``(name, numel)`` of every unique parameter of ``GPT(cfg)``, in ``named_parameters()`` order (the tied head
    is the embedding: listed once, as ``wte.weight``)."""
    d = cfg.d_model
    out = [("wte.weight", cfg.vocab_size * d)]
    if cfg.position == "learned":
        out.append(("wpe.weight", cfg.seq_len * d))
    for i in range(cfg.n_layer):
        out += _block_numels(cfg, f"blocks.{i}.")
    out.append(("ln_f.weight", d))
    if cfg.bias:
        out.append(("ln_f.bias", d))
    if not cfg.tie_weights:
        out.append(("lm_head.weight", cfg.vocab_size * d))
    return out


def param_counts(cfg: GPTConfig, persistent_threshold: int = 0) -> Dict[str, int]:
    """What :func:`lightning_scale.estimate.model_counts` returns for ``GPT(cfg)``, without building it: trainable
    parameters (tied once), the largest unit's (one block: the units are ``layer_modules()``), the parameters
    with fewer than ``persistent_threshold`` elements (kept whole at ZeRO-3) and the ZeRO-3 root unit's (those
    outside the blocks: embeddings, final norm, head), and the largest two neighbouring units' (two blocks)."""
    numels = parameter_numels(cfg)
    block = sum(n for _, n in _block_numels(cfg, "")) if cfg.n_layer else 0
    return {"params": sum(n for _, n in numels), "largest_unit_params": block,
            "unit_pair_params": block * min(2, cfg.n_layer),
            "persistent_params": sum(n for _, n in numels if n < persistent_threshold),
            "root_params": sum(n for name, n in numels if not name.startswith("blocks.") and n >= persistent_threshold)}


def gpt_small(**overrides) -> GPTConfig:
    """The benchmark GPT of ../shared/PEERS.md: 4 layers, d 256, 4 heads, vocab 8192, seq 128 (7.4M)."""
    base = dict(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256)
    base.update(overrides)
    return GPTConfig(**base)


def gpt_tiny(**overrides) -> GPTConfig:
    base = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
    base.update(overrides)
    return GPTConfig(**base)


# The model names the command-line tools accept (``--model NAME[:key=value,...]``).
MODELS = {"gpt_tiny": gpt_tiny, "gpt_small": gpt_small}
