"""fit_universal.py with ModelCheckpoint(save_last="link") and a probe of where last.ckpt points.

With ``--ckpt-dir DIR --save-last``, fit_gpt.py's ModelCheckpoint becomes ``save_last="link"``, ``save_top_k`` =
LS_TEST_TOP_K (default 1). LS_TEST_LINK_PROBE=FILE: at the start of every training batch, when each checkpoint
write starts and ends (LS_TEST_ASYNC_PROBE's slowed writes) and at the end of training, rank 0 records where
DIR/last.ckpt points and whether that folder is a complete checkpoint (its manifest read and every file's size
checked), one JSON line each, appended to FILE.
"""

from __future__ import annotations

import json
import os
import sys
import time

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fit_gpt  # noqa: E402
import fit_universal  # noqa: E402,F401  (same data order on any device count; LS_TEST_ASYNC_PROBE)

_Base = pl.callbacks.ModelCheckpoint


class LinkCheckpoint(_Base):
    def __init__(self, *args, **kw) -> None:
        kw.update(save_last="link", save_top_k=int(os.environ.get("LS_TEST_TOP_K", "1")))
        super().__init__(*args, **kw)


def _link_state(ckpt_dir: str) -> dict:
    from lightning_scale.checkpoint import CheckpointError, folder

    link = os.path.join(ckpt_dir, "last.ckpt")
    if not os.path.lexists(link):
        return {"link": None, "complete": None}
    target = os.readlink(link) if os.path.islink(link) else "<not a link>"
    try:
        full = os.path.join(ckpt_dir, target)
        folder.verify(full, folder.read_manifest(full))
        complete = True
    except (CheckpointError, OSError):
        complete = False
    return {"link": target, "complete": complete}


def _probe(out: str, ckpt_dir: str) -> None:
    from lightning_scale.checkpoint import dcp_format

    def observe(when: str, step=None) -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one JSON line each, appended: a killed run keeps them
            with open(out, "a") as f:
                f.write(json.dumps({"when": when, "step": step, "time": time.time(), **_link_state(ckpt_dir)}) + "\n")

    inner = dcp_format.save  # fit_universal's slowed save, when LS_TEST_ASYNC_PROBE is set

    def save(path, *args, **kw):
        observe(f"write start {os.path.basename(path)}")
        inner(path, *args, **kw)
        observe(f"write end {os.path.basename(path)}")

    dcp_format.save = save
    fit_gpt.LossRecorder.on_train_batch_start = \
        lambda self, trainer, pl_module, batch, batch_idx: observe("batch", trainer.global_step)
    fit_gpt.LossRecorder.on_train_end = lambda self, trainer, pl_module: observe("train end", trainer.global_step)


pl.callbacks.ModelCheckpoint = LinkCheckpoint
if os.environ.get("LS_TEST_LINK_PROBE"):
    _probe(os.environ["LS_TEST_LINK_PROBE"], sys.argv[sys.argv.index("--ckpt-dir") + 1])

if __name__ == "__main__":
    fit_gpt.main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
