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
    assert saver.buffer_bytes == sum(t.numel() * t.element_size() for p in pieces for t in p.tensors)  # one copy


def test_overlapped_snapshot_copies_during_the_next_forward_and_the_step_waits_for_it(tmp_path, monkeypatch):
    """later= / fence_on=: save returns before the optimizer-owned tensors are copied (a slowed copy in the writing
    thread); a buffer changed right after save is saved as it was (copied in save); the optimizer's next step()
    waits for the copy (its pre-hook), so the folder holds the pre-step parameters, byte for byte the sync save's.
    Mutation check: without the fence the step overwrites the parameter mid-copy and the bytes differ."""
    flat, pieces = _state()
    param = torch.nn.Parameter(flat[:120].view(10, 12))  # the engine's master: only opt.step() writes it
    buffer = flat[120:]  # a module buffer: the next forward may write it
    opt = torch.optim.SGD([param], lr=1.0)
    sync = str(tmp_path / "sync")
    dcp_format.save(sync, pieces, None, meta={"step": 5})
    saver = AsyncSaver()
    real, marks = saver._snapshot, {}

    def slow_snapshot(ps):
        if threading.current_thread() is not threading.main_thread():
            marks["copy_start"] = time.perf_counter()
            time.sleep(0.4)  # the copy of the overlapped pieces takes a while
            out = real(ps)
            marks["copy_end"] = time.perf_counter()
            return out
        return real(ps)

    monkeypatch.setattr(saver, "_snapshot", slow_snapshot)
    saver.save(str(tmp_path / "overlap"), pieces, None, meta={"step": 5}, later=[0, 2], fence_on=[opt])
    marks["returned"] = time.perf_counter()
    buffer.add_(1.0)  # the "forward" writes the buffer: copied in save already
    param.grad = torch.ones_like(param)
    with torch.no_grad():
        opt.step()  # waits for the overlapped copy first
    marks["stepped"] = time.perf_counter()
    saver.wait()
    assert marks["returned"] < marks["copy_end"] <= marks["stepped"], marks
    assert saver.fence_wait_s > 0.1  # the step did wait
    assert _data_files(str(tmp_path / "overlap")) == _data_files(sync)
    assert not saver._hooks  # the one-shot fence is gone after the save
    before = param.detach().clone()
    with torch.no_grad():
        opt.step()  # no save in flight: no wait, no hook left
    assert not torch.equal(param, before)


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


# ------------------------------------------------------------------ save_last="link" and failed writes (strategy glue)
class _Strategy:
    """What strategies.checkpoint's async glue reads of a Zero3DStrategy."""

    is_global_zero = True

    def __init__(self, save_fn) -> None:
        self._async = AsyncSaver(save_fn)
        self._deferred_removals = []

    def barrier(self) -> None:
        pass


def _start(strategy, path, pieces):
    """save_universal's async branch without engines: the links to ``path`` wait for its write."""
    from lightning_scale.strategies.checkpoint import track_links

    track_links(strategy, strategy._async, path).save(path, pieces)
    strategy._async_path = path


def test_last_link_moves_only_once_the_folder_is_written(tmp_path):
    """ModelCheckpoint(save_last="link") links last.ckpt right after the save starts: the link must keep naming the
    previous complete folder while the new one is written, then name the new one (one rename: never dangling)."""
    from lightning_scale.strategies.checkpoint import _link_when_written, link_atomically, wait_async_save

    _, pieces = _state()
    prev, new, last = str(tmp_path / "step=2.ckpt"), str(tmp_path / "step=4.ckpt"), str(tmp_path / "last.ckpt")
    dcp_format.save(prev, pieces)
    link_atomically(prev, last)
    go = threading.Event()

    def held(path, *a, **kw):
        go.wait(30)
        dcp_format.save(path, *a, **kw)

    strategy = _Strategy(held)
    trainer = type("T", (), {"is_global_zero": True, "strategy": strategy})()
    _start(strategy, new, pieces)
    _link_when_written(strategy, trainer, new, last)  # what Lightning calls right after save_checkpoint returns
    assert os.readlink(last) == "step=2.ckpt" and not os.path.exists(new)
    assert dcp_format.open_checkpoint(last)[1]  # loadable while the write is in flight
    go.set()
    wait_async_save(strategy)
    assert os.readlink(last) == "step=4.ckpt" and dcp_format.open_checkpoint(last)[1]
    _link_when_written(strategy, trainer, new, last)  # written already: linked at once
    assert os.readlink(last) == "step=4.ckpt"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]  # no temporary link left


def test_a_failed_write_keeps_the_previous_folder_and_link(tmp_path):
    """The write of step=4 fails while save_top_k's removal of step=2 and the link to step=4 wait for it: the error
    is raised once, and neither the removal nor the link happens then or at a later wait (teardown's)."""
    from lightning_scale.strategies.checkpoint import (_link_when_written, defer_removal, link_atomically,
                                                       wait_async_save)

    _, pieces = _state()
    prev, new, last = str(tmp_path / "step=2.ckpt"), str(tmp_path / "step=4.ckpt"), str(tmp_path / "last.ckpt")
    dcp_format.save(prev, pieces, meta={"step": 2})
    link_atomically(prev, last)

    def failing(*a, **kw):
        time.sleep(0.1)
        raise OSError("disk full (test)")

    strategy = _Strategy(failing)
    trainer = type("T", (), {"is_global_zero": True, "strategy": strategy})()
    _start(strategy, new, pieces)
    assert defer_removal(strategy, prev)  # queued while the write is unconfirmed
    _link_when_written(strategy, trainer, new, last)
    with pytest.raises(OSError, match="disk full"):
        wait_async_save(strategy)
    wait_async_save(strategy)  # teardown's wait: nothing left to do
    assert os.readlink(last) == "step=2.ckpt" and dcp_format.open_checkpoint(last)[1]["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt"]
