"""The layout-free format on torch.distributed.checkpoint: save on one layout, load on another, bit for bit.

Two ranks save ZeRO-style flat shards (dp=2: one flat buffer over all parameters cut in two, so a parameter can be
split mid-row) of weights, Adam states, masters and a replicated 0-d step, plus rank 0's extras. Then two ranks load
tp-style row slices (uneven split) and one process loads whole tensors: float64 values bit-equal; torch's own
``dcp_to_torch_save`` reads the folder. A truncated file, a deleted file and a manifest from another save raise a
CheckpointError naming the file. Memory: a 72 MiB float64 model on 2 ranks; each rank's peak RSS growth during load
(own pieces allocated and touched beforehand) and during save is measured with the kernel's high-water mark reset
just before: load <= the largest tensor + 8 MiB, save <= 8 MiB.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, live_rss_bytes, run_distributed

# the ranks fork from the zygote that imported torch._dynamo (torch.optim's first optimizer imports it: ~3 s of
# CPU per rank here), the one the HF tests start anyway (a zygote of its own costs more than it saves)
CKPT_PRELOAD = HF_RANK_PRELOAD

SHAPES = {"emb.weight": (13, 6), "blocks.0.w": (6, 6), "blocks.0.b": (6,), "blocks.1.w": (9, 6), "head.w": (5, 6)}


def _values(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, dtype=torch.float64, generator=g) for k, s in shapes.items()}


def _keys(fqn):
    return {"model": f"model/{fqn}", "exp_avg": f"optim/{fqn}/exp_avg", "exp_avg_sq": f"optim/{fqn}/exp_avg_sq",
            "master": f"master/{fqn}"}


def _full_state(shapes, seed=0):
    """What the checkpoint should hold: every key's global tensor."""
    out = {}
    for kind_i, kind in enumerate(("model", "exp_avg", "exp_avg_sq", "master")):
        for k, v in _values(shapes, seed + kind_i).items():
            out[_keys(k)[kind]] = v
    return out


def _flat_shard_pieces(shapes, rank, world, seed=0):
    """dp=`world` ZeRO layout: all parameters in one flat buffer per kind, rank r holds [r*n/world, (r+1)*n/world)."""
    from lightning_scale.checkpoint.layout import flat_piece, tensor_piece

    full = _full_state(shapes, seed)
    pieces, buffers = [], []
    for kind in ("model", "exp_avg", "exp_avg_sq", "master"):
        flat = torch.cat([full[_keys(k)[kind]].reshape(-1) for k in shapes])
        n = flat.numel()
        lo, hi = rank * n // world, (rank + 1) * n // world
        mine = flat[lo:hi].clone()  # the rank's shard: the only copy of the data it keeps
        buffers.append(mine)
        pos = 0
        for k, s in shapes.items():
            numel = math.prod(s)
            a, b = max(lo, pos), min(hi, pos + numel)
            if a < b:
                pieces.append(flat_piece(_keys(k)[kind], mine[a - lo:b - lo], s, a - pos))
            pos += numel
    for k in shapes:  # Adam's step: replicated on every rank (DCP's dedup writes it once)
        pieces.append(tensor_piece(f"optim/{k}/step", torch.tensor(7.0)))
    return pieces, buffers


def _row_slice_pieces(shapes, rank, world, dtype=torch.float64):
    """A tp-style layout: rank r holds rows [r*rows/world, ...) of every tensor (uneven splits)."""
    from lightning_scale.checkpoint.layout import TPSlice, tensor_piece

    pieces, dest = [], {}
    for k, s in shapes.items():
        for kind, key in _keys(k).items():
            lo, hi = rank * s[0] // world, (rank + 1) * s[0] // world
            t = torch.full((hi - lo,) + tuple(s[1:]), float("nan"), dtype=dtype)
            dest[key] = (lo, hi, t)
            pieces.append(tensor_piece(key, t, tp=TPSlice(0, lo), global_shape=s))
        step = torch.tensor(0.0)
        dest[f"optim/{k}/step"] = (0, 1, step)
        pieces.append(tensor_piece(f"optim/{k}/step", step))
    return pieces, dest


def _save_worker(rank, world, path, shapes, seed=0):
    from lightning_scale.checkpoint import dcp_format

    pieces, _ = _flat_shard_pieces(shapes, rank, world, seed)
    dcp_format.save(path, pieces, {"loops": {"global_step": 2, "epoch": 0}, "scaler": {"scale": 1024.0}},
                    meta={"step": 2, "layout": {"dp": world}})
    return sorted(os.listdir(path))


def _load_rows_worker(rank, world, path, shapes):
    from lightning_scale.checkpoint import dcp_format

    pieces, dest = _row_slice_pieces(shapes, rank, world)
    res = dcp_format.load(path, pieces, extra_keys=["loops"])
    full = _full_state(shapes)
    bad = []
    for key, (lo, hi, t) in dest.items():
        want = full[key][lo:hi] if key in full else torch.tensor(7.0)
        if not torch.equal(t, want):
            bad.append(key)
    return {"bad": bad, "extras": res.extras, "step": res.meta["step"]}


def _all_worker(rank, world, root):
    """One launch for the whole module (process start-up dominates): the two saves, the 2-rank reload on the
    row-slice layout, the memory measurement."""
    path, other = os.path.join(root, "epoch=0-step=2.ckpt"), os.path.join(root, "other")
    out = {"files": _save_worker(rank, world, path, SHAPES)}
    _save_worker(rank, world, other, SHAPES, 1)  # same shapes, other values: the "foreign" files
    out["rows"] = _load_rows_worker(rank, world, path, SHAPES)
    from lightning_scale.checkpoint.hf import export_hf_from_checkpoint

    # multi-rank export: shard i written by rank i % 2, no gather (masters preferred: fp64 here)
    out["export"] = export_hf_from_checkpoint(path, os.path.join(root, "hf"), config_dir=root, max_shard_bytes=600)
    out["memory"] = _memory_worker(rank, world, os.path.join(root, "big"))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({"model_type": "toy"}, f)
    # a fixed mmap threshold: glibc then maps every >= 1 MiB block and unmaps it on free, so RSS is live memory
    # (with its default dynamic threshold freed 8 MiB blocks stay in the heap and the peak reads 1-3 chunks)
    results = run_distributed(_all_worker, 2, args=(root,), timeout=240, preload=CKPT_PRELOAD,
                              env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    return os.path.join(root, "epoch=0-step=2.ckpt"), results


@pytest.mark.timeout(300)
def test_flat_shards_of_dp2_load_as_row_slices_and_whole(saved):
    path, results = saved
    files = [r["files"] for r in results]
    assert files[0] == files[1] and ".metadata" in files[0] and "meta.pt" in files[0]
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")]  # no staging left behind
    for r in results:
        r = r["rows"]
        assert r["bad"] == [] and r["extras"] == {"extra/loops": {"global_step": 2, "epoch": 0}} and r["step"] == 2
    # one process, whole tensors (the 2 -> 1 resume), float32 destination for the masters' dtype conversion
    from lightning_scale.checkpoint import dcp_format

    pieces, dest = _row_slice_pieces(SHAPES, 0, 1)
    dcp_format.load(path, pieces)
    full = _full_state(SHAPES)
    assert all(torch.equal(t, full[k]) for k, (_, _, t) in dest.items() if k in full)
    pieces32, dest32 = _row_slice_pieces(SHAPES, 0, 1, dtype=torch.float32)
    dcp_format.load(path, [p for p in pieces32 if p.key.startswith("master/")])
    assert all(torch.equal(t, full[k].float()) for k, (_, _, t) in dest32.items() if k.startswith("master/"))


def test_multi_rank_export_each_rank_writes_its_shards(saved):
    from safetensors.torch import load_file

    path, results = saved
    out = os.path.join(os.path.dirname(path), "hf")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    mine = [r["export"] for r in results]
    assert mine[0] and mine[1] and sorted(mine[0] + mine[1]) == files and not set(mine[0]) & set(mine[1])
    full = _full_state(SHAPES)
    got = {}
    for f in files:
        got.update(load_file(os.path.join(out, f)))
    assert sorted(got) == sorted(SHAPES) and all(torch.equal(got[k], full[f"master/{k}"]) for k in SHAPES)


def test_dcp_to_torch_save_reads_it(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, _ = saved
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    sd = torch.load(str(tmp_path / "full.pt"), weights_only=False)
    full = _full_state(SHAPES)
    assert all(torch.equal(sd[k], v) for k, v in full.items())
    assert sd["extra/scaler"] == {"scale": 1024.0} and float(sd["optim/head.w/step"]) == 7.0


def _load_whole(path):
    from lightning_scale.checkpoint import dcp_format

    pieces, _ = _row_slice_pieces(SHAPES, 0, 1)
    return dcp_format.load(path, pieces)


def test_bad_folders_raise_errors_that_name_the_file(saved, tmp_path):
    from lightning_scale.checkpoint import CheckpointError, folder

    path, _ = saved
    cases = {}
    for case in ("truncated", "deleted", "foreign", "flipped"):
        cases[case] = str(tmp_path / case)
        shutil.copytree(path, cases[case])
    data = os.path.join(cases["truncated"], "__1_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 100)
    os.remove(os.path.join(cases["deleted"], "__0_0.distcp"))
    with open(os.path.join(cases["flipped"], "__1_0.distcp"), "r+b") as f:  # same size, one byte altered
        f.seek(700)
        b = f.read(1)
        f.seek(700)
        f.write(bytes([b[0] ^ 0xFF]))
    # a manifest from another save of the same model (same file names and sizes, other values)
    other = os.path.join(os.path.dirname(path), "other")  # saved by the fixture: same shapes, other values
    shutil.copy(os.path.join(other, "__0_0.distcp"), os.path.join(cases["foreign"], "__0_0.distcp"))
    expect = {"truncated": r"__1_0\.distcp is truncated or corrupt", "deleted": r"__0_0\.distcp is missing",
              "flipped": r"__1_0\.distcp is corrupt or from another save",
              "foreign": r"__0_0\.distcp is corrupt or from another save"}  # a data file of the other save
    for case, pattern in expect.items():
        with pytest.raises(CheckpointError, match=pattern):
            _load_whole(cases[case])
    shutil.copytree(path, cases["foreign"], dirs_exist_ok=True)  # the original files again, the other manifest
    shutil.copy(os.path.join(other, folder.MANIFEST), os.path.join(cases["foreign"], folder.MANIFEST))
    with pytest.raises(CheckpointError, match=r"\.metadata is (truncated or corrupt|corrupt or from another save)"):
        _load_whole(cases["foreign"])
    with pytest.raises(CheckpointError, match="not a complete lightning_scale sharded checkpoint"):
        _load_whole(str(tmp_path))


def test_missing_keys_and_shape_mismatch(saved):
    from lightning_scale.checkpoint import CheckpointError, dcp_format
    from lightning_scale.checkpoint.layout import tensor_piece

    path, _ = saved
    absent = tensor_piece("optim/head.w/momentum_buffer", torch.zeros(5, 6))
    with pytest.raises(CheckpointError, match=r"has no \['optim/head.w/momentum_buffer'\]"):
        dcp_format.load(path, [absent])
    head = torch.zeros(5, 6, dtype=torch.float64)
    res = dcp_format.load(path, [absent, tensor_piece("model/head.w", head)], strict=False)
    assert res.missing == ["optim/head.w/momentum_buffer"] and torch.equal(head, _full_state(SHAPES)["model/head.w"])
    assert (absent.tensors[0] == 0).all()  # left as it was: the caller decides (e.g. a fresh state)
    with pytest.raises(CheckpointError, match=r"model/head.w has shape \(5, 6\) in the checkpoint, this model needs "
                                              r"\(6, 6\)"):
        dcp_format.load(path, [tensor_piece("model/head.w", torch.zeros(6, 6))])


def _old_format_folder(path, checkpoint):
    """A folder as lightning_scale.strategies.checkpoint.save_sharded writes it on 1 rank (format 2), built from the
    same folder.py calls (importing the strategies module would import Lightning: 10 s on this machine)."""
    from lightning_scale.checkpoint import folder

    token = folder.new_token()
    staging = folder.staging_path(path, token)
    files = {"optim_rank0.pt": folder.write_file(staging, "optim_rank0.pt", {"optimizer_states": []}),
             "checkpoint.pt": folder.write_file(staging, "checkpoint.pt", checkpoint)}
    folder.commit(path, token, files, world_size=1)


def test_old_sharded_format_is_recognised_not_misread(tmp_path):
    from lightning_scale.checkpoint import CheckpointError
    from lightning_scale.checkpoint.dcp_format import detect_format

    path = str(tmp_path / "old.ckpt")
    _old_format_folder(path, {"state_dict": {"w": torch.ones(2)}})
    assert detect_format(path) == "sharded"
    with pytest.raises(CheckpointError, match="checkpoint format 2 .*load_sharded"):
        _load_whole(path)


# ----------------------------------------------------------------------------------------------- memory
BIG = {f"layer{i}.w": (1024, 1024) for i in range(8)}  # 8 x 8 MiB float64
BIG["odd.w"] = (1000, 1024)  # ~7.8 MiB: the flat split falls mid-tensor


def _peak_growth(fn):
    """Run fn; return (its result, peak RSS growth over the live RSS just before, in bytes)."""
    base = live_rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the kernel's high-water mark (VmHWM) to the current RSS
    out = fn()
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    return out, hwm - base


def _pin_malloc_mmap_threshold() -> None:
    """Large blocks always from mmap, returned to the OS when freed. glibc otherwise raises its mmap threshold to
    the size of each large block freed (up to 32 MiB), so later 8 MiB tensors come from the heap and freed ones stay
    resident: the high-water mark then depends on what the process did before (8-32 MiB seen for the same load)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: 128 KiB, glibc's default, fixed
    except (OSError, AttributeError):  # not glibc
        pass


def _memory_worker(rank, world, path):
    _pin_malloc_mmap_threshold()
    from lightning_scale.checkpoint import dcp_format
    from lightning_scale.checkpoint.layout import flat_piece

    def shard_pieces(fill):
        n = sum(math.prod(s) for s in BIG.values())
        lo, hi = rank * n // world, (rank + 1) * n // world
        buf = torch.full((hi - lo,), fill, dtype=torch.float64)
        pieces, pos = [], 0
        for k, s in BIG.items():
            a, b = max(lo, pos), min(hi, pos + math.prod(s))
            if a < b:
                pieces.append(flat_piece(f"model/{k}", buf[a - lo:b - lo], s, a - pos))
            pos += math.prod(s)
        return pieces, buf

    pieces, buf = shard_pieces(float(rank + 1))
    _, save_growth = _peak_growth(functools.partial(dcp_format.save, path, pieces))
    own_save = buf.numel() * 8
    del pieces, buf
    # the new layout: row slices (tp=2 style) of every tensor, allocated before the measurement
    from lightning_scale.checkpoint.layout import TPSlice, tensor_piece

    dest = []
    for k, s in BIG.items():
        lo, hi = rank * s[0] // world, (rank + 1) * s[0] // world
        dest.append(tensor_piece(f"model/{k}", torch.full((hi - lo,) + s[1:], -1.0, dtype=torch.float64),
                                 tp=TPSlice(0, lo), global_shape=s))
    own_load = sum(p.tensors[0].numel() * 8 for p in dest)
    _, load_growth = _peak_growth(lambda: dcp_format.load(path, dest))
    ok = all(bool((p.tensors[0] > 0).all()) for p in dest)
    return {"save": save_growth, "load": load_growth, "own_save": own_save, "own_load": own_load, "ok": ok}


def test_peak_memory_during_load_is_one_tensor_not_the_model(saved):
    largest = max(math.prod(s) for s in BIG.values()) * 8
    model = sum(math.prod(s) for s in BIG.values()) * 8
    for rank, r in enumerate(r["memory"] for r in saved[1]):
        print(f"rank {rank}: model {model / 2**20:.1f} MiB, largest tensor {largest / 2**20:.1f} MiB; "
              f"own pieces save {r['own_save'] / 2**20:.1f} MiB load {r['own_load'] / 2**20:.1f} MiB (allocated "
              f"before); peak growth save {r['save'] / 2**20:.1f} MiB, load {r['load'] / 2**20:.1f} MiB")
        assert r["ok"]
        # own pieces exist before the call; what a load may add is one saved chunk (<= the largest tensor) being
        # deserialized, plus a constant (1 MiB checksum buffer, DCP plans and metadata, gloo buffers); a save adds
        # only the constant (measured: load 7.9 MiB, save 5.2 MiB with 2 ranks; save 1 MiB in one process)
        assert r["load"] <= largest + (8 << 20), r
        assert r["save"] <= 8 << 20, r


def test_vocab_padded_tp_slices_load_true_rows_and_zero_padding(saved):
    from lightning_scale.checkpoint import dcp_format
    from lightning_scale.checkpoint.layout import TPSlice, flat_piece

    path, _ = saved
    true = _full_state(SHAPES)["model/emb.weight"]  # (13, 6), saved by dp=2 flat shards
    for r in range(2):  # tp=2 of a vocabulary padded to 16 rows, each tp slice ZeRO-sharded over dp=2
        local = torch.full((8, 6), float("nan"), dtype=torch.float64)
        flat = local.reshape(-1)
        pieces = [flat_piece("model/emb.weight", flat[a:b], (8, 6), a, tp=TPSlice(0, 8 * r), global_shape=(16, 6),
                             true_shape=(13, 6)) for a, b in ((0, 19), (19, 48))]
        dcp_format.load(path, pieces)
        rows = min(8, 13 - 8 * r)
        assert torch.equal(local[:rows], true[8 * r:8 * r + rows]) and (local[rows:] == 0).all()


class _CountingFile:
    def __init__(self, f, counter) -> None:
        self.f, self.counter = f, counter

    def readinto(self, b):
        n = self.f.readinto(b)
        self.counter[0] += n or 0
        return n

    def read(self, *a):
        data = self.f.read(*a)
        self.counter[0] += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_each_storage_item_is_read_from_disk_once(saved, monkeypatch):
    """The reader reads an item's bytes once (CRC and deserialization from that one buffer), not once per pass."""
    from lightning_scale.checkpoint import dcp_format, dcp_planners

    path, _ = saved
    counter = [0]
    monkeypatch.setattr(dcp_planners, "open", lambda *a, **k: _CountingFile(open(*a, **k), counter), raising=False)
    pieces, dest = _row_slice_pieces(SHAPES, 0, 1)
    dcp_format.load(path, pieces)
    full = _full_state(SHAPES)
    assert all(torch.equal(t, full[k]) for k, (_, _, t) in dest.items() if k in full)
    _, meta, _ = dcp_format.open_checkpoint(path)
    items = sum(length for spans in meta["items"].values() for length, _ in spans.values())
    assert 0 < counter[0] <= items, (counter[0], items)


def test_a_resharded_load_reads_only_the_blocks_of_its_share(tmp_path, monkeypatch):
    """Raw tensor items are read block by block where a rank's requests fall: 4 row-slice ranks of a 1-process save
    read about a quarter of the bytes each (not every saved chunk whole), exact; a flipped byte in a block a rank
    reads, or in an item's head, is named."""
    from lightning_scale.checkpoint import CheckpointError, dcp_format, dcp_planners, folder

    monkeypatch.setattr(dcp_format, "BLOCK", 1024)  # small blocks: each tensor spans many
    shapes = {"emb.weight": (256, 32), "head.w": (160, 32)}  # float64: 64 KiB and 40 KiB per kind
    path = str(tmp_path / "one")
    pieces, _ = _flat_shard_pieces(shapes, 0, 1)
    dcp_format.save(path, pieces)
    meta = folder.read_manifest(path)
    assert meta["block"] == 1024 and sum(len(b) for b in meta["blocks"].values()) == 5 * len(shapes)  # 4 kinds + step
    data = sum(v[1] for b in meta["blocks"].values() for v in b.values())
    counter = [0]
    monkeypatch.setattr(dcp_planners, "open", lambda *a, **k: _CountingFile(open(*a, **k), counter), raising=False)
    full = _full_state(shapes)
    reads = []
    for rank in range(4):
        counter[0] = 0
        ps, dest = _row_slice_pieces(shapes, rank, 4)
        dcp_format.load(path, ps)
        assert all(torch.equal(t, full[k][lo:hi]) for k, (lo, hi, t) in dest.items() if k in full)
        reads.append(counter[0])
    # a quarter of the tensor bytes + up to 2 partial blocks and a head / tail (~1 KiB) per item
    items = sum(len(b) for b in meta["blocks"].values())
    assert max(reads) <= data / 4 + items * (2 * 1024 + 1500), (reads, data)
    assert max(reads) < 0.45 * data, (reads, data)
    # damage: one byte inside the first item's tensor bytes (read by rank 0), then one in its head
    name, spans = next(iter(meta["blocks"].items()))
    off, (start, *_rest) = min(spans.items())
    for where in (off + start + 10, off + 5):
        bad = str(tmp_path / f"bad{where}")
        shutil.copytree(path, bad)
        with open(os.path.join(bad, name), "r+b") as f:
            f.seek(where)
            b = f.read(1)
            f.seek(where)
            f.write(bytes([b[0] ^ 0xFF]))
        ps, _ = _row_slice_pieces(shapes, 0, 4)
        with pytest.raises(CheckpointError, match=rf"{name} is corrupt or from another save"):
            dcp_format.load(bad, ps)
