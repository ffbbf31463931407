"""LightningDataModule over the offline stdlib corpus (or deterministic random tokens)."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler

from lightning_scale.data.corpus import RandomTokens, TokenWindows, split, stdlib_corpus


class ByteCorpusDataModule(pl.LightningDataModule):
    def __init__(self, seq_len: int = 128, batch_size: int = 8, max_bytes: int = 4 * 2**20,
                 val_fraction: float = 0.05, num_workers: int = 0, shuffle: bool = True,
                 source: str = "stdlib", vocab_size: int = 256, random_length: int = 512,
                 max_val_batches: Optional[int] = None) -> None:
        super().__init__()
        if source not in ("stdlib", "random"):
            raise ValueError(f"data.source={source!r}: use 'stdlib' or 'random'")
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        self.seq_len, self.batch_size, self.max_bytes = seq_len, batch_size, max_bytes
        self.val_fraction, self.num_workers, self.shuffle = val_fraction, num_workers, shuffle
        self.source, self.vocab_size, self.random_length = source, vocab_size, random_length
        self.train_set = self.val_set = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self.source == "random":
            self.train_set = RandomTokens(self.vocab_size, self.seq_len, self.random_length, seed=0)
            self.val_set = RandomTokens(self.vocab_size, self.seq_len, max(8, self.random_length // 8), seed=1)
            return
        if self.vocab_size < 256:
            raise ValueError(f"model.vocab_size={self.vocab_size} must be >= 256 for byte-level text")
        train, val = split(stdlib_corpus(self.max_bytes), self.val_fraction)
        self.train_set, self.val_set = TokenWindows(train, self.seq_len), TokenWindows(val, self.seq_len)

    def train_dataloader(self) -> DataLoader:
        sampler = None
        trainer = getattr(self, "trainer", None)
        if not self.shuffle and trainer is not None and trainer.world_size > 1:
            # Lightning always shuffles the sampler it inserts for training; an unshuffled run (parity
            # tests) brings its own, split over the strategy's data-parallel axis.
            sampler = DistributedSampler(self.train_set, shuffle=False, **trainer.distributed_sampler_kwargs)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle and sampler is None,
                          sampler=sampler, drop_last=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
