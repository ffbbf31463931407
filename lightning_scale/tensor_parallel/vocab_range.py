"""The vocabulary range check of the vocabulary-parallel embedding and cross-entropy.

A dense ``nn.Embedding`` raises on a token id outside its rows and ``F.cross_entropy`` on a target outside its
classes; split over tp ranks, no rank owns such an id, so the lookup would make it a row of zeros and the loss
count its logit as 0, and training would go on in silence. :func:`check_vocab_range` raises instead: on a CPU an
``IndexError`` naming the value, on a GPU an asynchronous device-side assert (no host sync). Tensors without values
(empty, meta, the memory plan's FakeTensors) are not checked.
"""

from __future__ import annotations

from typing import Optional

import torch


def check_vocab_range(t: torch.Tensor, size: int, what: str, *, allowed: Optional[int] = None,
                      hint: str = "") -> None:
    """Every value of ``t`` in ``[0, size)`` (or equal to ``allowed``: an ignore_index); else an error that reads
    ``"{what} {value} is outside the vocabulary [0, size){hint}"``."""
    from torch._subclasses.fake_tensor import is_fake

    if t.numel() == 0 or t.device.type == "meta" or is_fake(t):
        return
    bad = (t < 0) | (t >= size)
    if allowed is not None:
        bad &= t != allowed
    if t.device.type == "cpu":
        if bool(bad.any()):
            raise IndexError(f"{what} {int(t[bad][0])} is outside the vocabulary [0, {size}){hint}")
    else:
        torch._assert_async(~bad.any(), f"{what}: a value is outside the vocabulary [0, {size}){hint}")


__all__ = ["check_vocab_range"]
