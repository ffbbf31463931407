"""A real text corpus present offline on every machine: the Python standard library's own sources.

Byte-level (vocab 256, no tokenizer download). The file order is sorted, so every machine with the same
Python version builds the same corpus.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Optional, Tuple

import torch
from torch.utils.data import Dataset


def stdlib_corpus(max_bytes: int = 4 * 2**20, root: Optional[str] = None) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the sorted stdlib ``*.py`` files, as a uint8 tensor."""
    root = root or sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "dist-packages"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(f"no Python source files found under {root}")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


def split(data: torch.Tensor, val_fraction: float = 0.05) -> Tuple[torch.Tensor, torch.Tensor]:
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")
    n_val = max(1, int(len(data) * val_fraction))
    return data[:-n_val], data[-n_val:]


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens -> (input, target) pairs shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"data has {len(data)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len: i * self.seq_len + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class RandomTokens(Dataset):
    """Deterministic random tokens (tests and benchmarks that need exact, cheap batches)."""

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (length, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]
