"""tp overlap: a row-parallel layer's forward all-reduce is in flight during its next chunk's matmul, and the
overlapped path is bit-identical to the blocking one (float64 GPT at tp=2, 2 AdamW steps).

One spawned 2-rank run trains the same tiny GPT three times: chunks=1 (default), chunks=2 blocking, chunks=2
overlapped (``set_overlap``), the last two under ``trace_overlap()``. Checks per rank: overlapped == blocking bit
for bit (losses and parameters, torch.equal); both within 1e-12 of chunks=1; in the overlapped trace every chunk
but the last is waited only after the next chunk's matmul ended (posted before it started); in the blocking trace
every chunk is waited before the next matmul starts (so the check tells the two apart).
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
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
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
    return out


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
