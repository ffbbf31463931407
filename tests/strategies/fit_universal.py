"""fit_gpt.py with the training data in the same order on one device as on several.

ByteCorpusDataModule(shuffle=False) inserts an unshuffled DistributedSampler only when world_size > 1; on one
device under a distributed strategy Lightning then inserts its own, shuffled, one. A checkpoint resharded from dp=2
to dp=1 must see the batches the uninterrupted dp=2 run saw, so this wrapper inserts the unshuffled sampler at
world size 1 too (drop it once the data module does this itself).
"""

from __future__ import annotations

import os
import sys

from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fit_gpt  # noqa: E402
from lightning_scale.lit import ByteCorpusDataModule  # noqa: E402

_original = ByteCorpusDataModule.train_dataloader


def _train_dataloader(self) -> DataLoader:
    trainer = self.trainer
    if not self.shuffle and trainer is not None and trainer.world_size == 1 and \
            type(trainer.strategy).__name__ != "SingleDeviceStrategy":
        sampler = DistributedSampler(self.train_set, shuffle=False, **trainer.distributed_sampler_kwargs)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)
    return _original(self)


ByteCorpusDataModule.train_dataloader = _train_dataloader


def _probe_async_saves(out: str) -> None:
    """LS_TEST_ASYNC_PROBE=FILE: every write of the layout-free format sleeps 1 s (LS_TEST_ASYNC_SLEEP) first and
    records when it started and ended; every training batch records when it started, every checkpoint-folder removal
    (save_top_k) when it happened. Rank r writes them to FILE.r.json at exit."""
    import atexit
    import json
    import threading
    import time

    import lightning.pytorch as pl

    from lightning_scale.checkpoint import dcp_format

    from lightning_scale.checkpoint import folder

    record = {"writes": [], "batches": [], "removals": []}
    real_save, real_remove = dcp_format.save, folder.remove

    def slow_save(path, *args, **kw):
        start = time.time()
        time.sleep(float(os.environ.get("LS_TEST_ASYNC_SLEEP", "1.0")))
        real_save(path, *args, **kw)
        record["writes"].append({"path": os.path.basename(path), "start": start, "end": time.time(),
                                 "thread": threading.current_thread().name})

    def on_train_batch_start(self, batch, batch_idx):
        record["batches"].append({"step": self.trainer.global_step, "start": time.time()})

    def remove(path):
        record["removals"].append({"path": os.path.basename(path), "time": time.time()})
        real_remove(path)

    dcp_format.save = slow_save
    folder.remove = remove
    pl.LightningModule.on_train_batch_start = on_train_batch_start

    def dump():
        with open(f"{out}.{os.environ.get('LOCAL_RANK', '0')}.json", "w") as f:
            json.dump(record, f)
    atexit.register(dump)


if os.environ.get("LS_TEST_ASYNC_PROBE"):
    _probe_async_saves(os.environ["LS_TEST_ASYNC_PROBE"])

if __name__ == "__main__":
    fit_gpt.main()
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
