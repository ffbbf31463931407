"""AsyncSaver: training continues during a save, the saved state is the snapshot, errors surface, one in flight.

A slow writer hook (sleep, then the real save) records when the write ends; the "next step" (an in-place update of
the live tensors) is timestamped after ``save`` returns: it starts before the write ends. The async folder's data
files equal a synchronous save's of the same state byte for byte, and load to the pre-step values.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from lightning_scale.checkpoint import CheckpointError, dcp_format
from lightning_scale.checkpoint.async_save import AsyncSaver
from lightning_scale.checkpoint.layout import flat_piece, tensor_piece


def _state():
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(300, dtype=torch.float64, generator=g)
    pieces = [flat_piece("model/a", flat[:120], (10, 12), 0), flat_piece("model/b", flat[120:], (20, 9), 0),
              tensor_piece("optim/a/step", torch.tensor(5.0))]
    return flat, pieces


def _data_files(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.endswith(".distcp")}


def test_step_runs_during_the_write_and_bytes_equal_the_sync_save(tmp_path):
    flat, pieces = _state()
    before = flat.clone()
    marks = {}

    def slow_save(path, pieces, extras, **kw):
        marks["write_start"] = time.perf_counter()
        time.sleep(0.5)
        dcp_format.save(path, pieces, extras, **kw)
        marks["write_end"] = time.perf_counter()

    sync = str(tmp_path / "sync")
    dcp_format.save(sync, pieces, {"loops": {"step": 5}}, meta={"step": 5})
    saver = AsyncSaver(slow_save)
    extras = {"loops": {"step": 5}}
    saver.save(str(tmp_path / "async"), pieces, extras, meta={"step": 5})
    marks["step_start"] = time.perf_counter()
    flat.add_(1.0)  # the next training step updates the live tensors in place
    extras["loops"]["step"] = 6
    assert saver.in_flight
    saver.wait()
    print(f"snapshot blocked {saver.last_snapshot_s * 1e3:.2f} ms; step started "
          f"{(marks['write_end'] - marks['step_start']) * 1e3:.0f} ms before the write ended")
    assert marks["step_start"] < marks["write_end"]
    assert _data_files(str(tmp_path / "async")) == _data_files(sync)  # the snapshot, not the updated tensors
    dest = torch.zeros(300, dtype=torch.float64)
    res = dcp_format.load(str(tmp_path / "async"), [flat_piece("model/a", dest[:120], (10, 12), 0),
                                                    flat_piece("model/b", dest[120:], (20, 9), 0)],
                          extra_keys=["loops"])
    assert torch.equal(dest, before) and res.extras["extra/loops"] == {"step": 5}
    # buffers are reused by the next save (same shapes)
    bufs = dict(saver._buffers)
    saver.save(str(tmp_path / "async2"), pieces)
    saver.wait()
    assert all(saver._buffers[k] is v for k, v in bufs.items())


def test_one_save_in_flight_and_errors_surface(tmp_path, monkeypatch):
    _, pieces = _state()
    active, peak = [0], [0]
    lock = threading.Lock()

    def counting(path, pieces, extras, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        dcp_format.save(path, pieces, extras, **kw)
        with lock:
            active[0] -= 1

    saver = AsyncSaver(counting)
    for i in range(3):
        saver.save(str(tmp_path / f"c{i}"), pieces)
    saver.wait()
    assert peak[0] == 1
    # a failed write: the previous checkpoint at the same path stays loadable, the error comes on the next call
    path = str(tmp_path / "c0")

    def boom(*a, **k):
        raise OSError("disk full (test)")

    monkeypatch.setattr(dcp_format.folder, "commit", boom)  # dies after the data files, before the swap
    saver = AsyncSaver()
    saver.save(path, pieces)
    with pytest.raises(OSError, match="disk full"):
        saver.save(path, pieces)
    monkeypatch.undo()
    saver.save(path, pieces)  # the error was handed over once; this one works
    saver.wait()
    dest = torch.zeros(120, dtype=torch.float64)
    dcp_format.load(path, [flat_piece("model/a", dest, (10, 12), 0)])
    assert torch.equal(dest, _state()[0][:120])
    with pytest.raises(CheckpointError):
        dcp_format.load(str(tmp_path / "never"), [])
