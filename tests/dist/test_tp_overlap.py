"""tp overlap: a row-parallel layer's forward all-reduce is in flight during its next chunk's matmul, and the
overlapped path is bit-identical to the blocking one (float64 GPT at tp=2, 2 AdamW steps).

One spawned 2-rank run trains the same tiny GPT three times: chunks=1 (default), chunks=2 blocking, chunks=2
overlapped (``set_overlap``), the last two under ``trace_overlap()``. Checks per rank: overlapped == blocking bit
for bit (losses and parameters, torch.equal); both within 1e-12 of chunks=1; in the overlapped trace every chunk
but the last is waited only after the next chunk's matmul ended (posted before it started); in the blocking trace
every chunk is waited before the next matmul starts (so the check tells the two apart).

The setting: the same model through ``parallelize()`` with ``tensor.overlap_chunks=2`` (``from_flat_kwargs``, as
``Zero3DStrategy(overlap_chunks=2)`` / Hydra ``strategy.overlap_chunks=2`` build it) and the ZeRO-1 engine, against
``overlap_chunks=1``: every RowParallelLinear carries the chunks, the chunked path ran (trace), losses and
parameters are bit-identical to the hand-applied ``set_overlap`` run and within 1e-12 of chunks=1. A bad value is a
ConfigError naming the setting from ``parallelize()`` on every rank, before any layer is touched.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import run_distributed

STEPS, CHUNKS = 2, 2


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_scale.models import GPT, gpt_tiny, make_batch
    from lightning_scale.tensor_parallel import apply_tensor_parallel, tensor_parallel_state
    from lightning_scale.tensor_parallel.overlap import set_overlap, trace_overlap

    cfg = gpt_tiny(vocab_size=61, n_layer=2, n_head=4, d_model=32, seq_len=16)
    group = dist.new_group(list(range(world_size)))
    out = {}
    for mode in ("off", "blocking", "overlap"):
        torch.manual_seed(0)
        model = GPT(cfg).double()
        apply_tensor_parallel(model, None, group)
        n = set_overlap(model, 1 if mode == "off" else CHUNKS, blocking=mode == "blocking")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)  # the engine's kernel for CPU masters
        losses = []
        with trace_overlap() as events:
            for k in range(STEPS):
                x, y = make_batch(cfg, 4, seed=k)
                loss = tensor_parallel_state(model).cross_entropy(model(x), y)  # vocab-split logits, float64
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach().clone())
        out[mode] = dict(losses=losses, events=list(events), layers=n,
                         params={k: v.detach().clone() for k, v in model.named_parameters()})
    for chunks in (1, CHUNKS):  # the setting, through the composition function every front door calls
        out[f"config{chunks}"] = _through_parallelize(cfg, chunks, rank, world_size)
    out["refused"] = _refused(cfg, rank, world_size)
    return out


def _through_parallelize(cfg, chunks: int, rank: int, world_size: int) -> dict:
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.models import GPT, make_batch
    from lightning_scale.parallelize import local_topology, parallelize
    from lightning_scale.tensor_parallel import tensor_parallel_state
    from lightning_scale.tensor_parallel.layers import RowParallelLinear
    from lightning_scale.tensor_parallel.overlap import trace_overlap

    torch.manual_seed(0)
    model = GPT(cfg).double()
    config = from_flat_kwargs(tp=2, stage=1, overlap_chunks=chunks)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    pm = parallelize(model, config, local_topology(config, world_size, rank), "cpu", optimizers=[opt])
    (engine,) = pm.make_engines()
    losses = []
    with trace_overlap() as events:
        for k in range(STEPS):
            x, y = make_batch(cfg, 4, seed=k)
            loss = tensor_parallel_state(model).cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
    layer_chunks = [m.overlap_chunks for m in model.modules() if isinstance(m, RowParallelLinear)]
    return dict(losses=losses, events=list(events), layer_chunks=layer_chunks,
                params={k: v.detach().clone() for k, v in model.named_parameters()})


def _refused(cfg, rank: int, world_size: int) -> str:
    """parallelize() with a bad overlap_chunks: the ConfigError's text, raised before the model is split."""
    from lightning_scale.config import ConfigError, ParallelConfig, TensorParallelConfig
    from lightning_scale.models import GPT
    from lightning_scale.parallelize import local_topology, parallelize

    model = GPT(cfg).double()
    config = ParallelConfig(tp=2, tensor=TensorParallelConfig(overlap_chunks=0))  # not validated: parallelize must
    try:
        parallelize(model, config, local_topology(ParallelConfig(tp=2), world_size, rank), "cpu")
    except ConfigError as err:
        assert not any(type(m).__name__ == "RowParallelLinear" for m in model.modules())  # refused before the split
        return str(err)
    return "not refused"


def _calls(events):
    """Split the trace into one dict per layer call: {(event, chunk): t}."""
    calls, cur = [], None
    for ev, tag, chunk, t in events:
        if ev == "mm_start" and chunk == 0:
            cur = {}
            calls.append(cur)
        assert (ev, chunk) not in cur, (ev, chunk)  # each event once per chunk
        cur[(ev, chunk)] = t
    return calls


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=300)


def test_overlap_bit_identical_to_blocking_and_close_to_unchunked(results):
    for res in results:
        ov, bl, off = res["overlap"], res["blocking"], res["off"]
        assert ov["layers"] == 4  # attn.proj + mlp.proj per block
        assert all(torch.equal(a, b) for a, b in zip(ov["losses"], bl["losses"]))
        assert ov["params"].keys() == bl["params"].keys()
        assert all(torch.equal(ov["params"][k], bl["params"][k]) for k in ov["params"])
        assert max(abs(float(a - b)) for a, b in zip(ov["losses"], off["losses"])) < 1e-12
        assert max(float((ov["params"][k] - off["params"][k]).abs().max()) for k in off["params"]) < 1e-12
        assert off["events"] == []  # chunks=1 takes the unchunked path


def test_all_reduce_in_flight_during_next_chunk_matmul(results):
    for res in results:
        calls = _calls(res["overlap"]["events"])
        assert len(calls) == STEPS * 4
        for c in calls:
            for i in range(CHUNKS - 1):
                assert c[("post", i)] <= c[("mm_start", i + 1)], c
                assert c[("wait_start", i)] >= c[("mm_end", i + 1)], c  # in flight across the next matmul
        blocking = _calls(res["blocking"]["events"])
        assert len(blocking) == STEPS * 4
        for c in blocking:
            for i in range(CHUNKS - 1):
                assert c[("wait_end", i)] <= c[("mm_start", i + 1)], c


def test_set_overlap_rejects_bad_chunks():
    from lightning_scale.tensor_parallel.overlap import set_overlap

    with pytest.raises(ValueError, match="chunks=0"):
        set_overlap(torch.nn.Linear(2, 2), 0)


def test_overlap_chunks_setting_reaches_layers_and_matches(results):
    for res in results:
        on, off, manual = res[f"config{CHUNKS}"], res["config1"], res["overlap"]
        assert on["layer_chunks"] == [CHUNKS] * 4 and off["layer_chunks"] == [1] * 4
        assert len(_calls(on["events"])) == STEPS * 4 and off["events"] == []  # the chunked path ran, only there
        assert all(torch.equal(a, b) for a, b in zip(on["losses"], manual["losses"]))
        assert all(torch.equal(on["params"][k], manual["params"][k]) for k in manual["params"])
        assert max(abs(float(a - b)) for a, b in zip(on["losses"], off["losses"])) < 1e-12
        assert max(float((on["params"][k] - off["params"][k]).abs().max()) for k in off["params"]) < 1e-12


def test_bad_overlap_chunks_refused_by_parallelize_on_every_rank(results):
    for res in results:
        assert res["refused"].startswith("tensor.overlap_chunks=0 must be an integer >= 1"), res["refused"]
