"""Sibling column-parallel layers reading one input share one input-gradient reduction (Megatron's ``f``).

HF Llama's q/k/v and gate/up (litgpt's fc_1/fc_2) are separate column-parallel layers on the same tensor; each
used to all-reduce its own partial input gradient (5 all-reduces per Llama block in the backward). With
``SharedInput`` (``apply_tensor_parallel(share_inputs=True)``, the default) the partial gradients are summed by
autograd first and reduced once: 2 per block, like the fused qkv / fc of the project GPT.

2 ranks, float64, one process as reference (every rank computes it):

* HF Llama, Qwen2 (q/k/v biases) and litgpt (gated MLP, fused qkv) at tp=2: 3 AdamW steps, per-step losses and
  the consolidated parameters within 1e-10; also HF Llama under HF's gradient checkpointing;
* the backward's all-reduces counted (``CommCounter``): per Llama block 2 (shared) vs 5 (``share_inputs=False``),
  bytes of one (B, T, C) activation each; litgpt 2 vs 3;
* sequence parallelism on a small custom model with two sibling column layers: one all-gather forward and one
  reduce-scatter backward per block instead of two each, one SGD step equal to one process within 1e-10; the
  same model without sequence parallelism where one sibling's output never reaches the loss (its backward does
  not run: the shared entry reduces the others' sum itself).

4 ranks (slow): HF Llama through ``parallelize()`` at tp2 x pp2 (ZeRO-1, 1F1B) and dp2 x tp2 at ZeRO-3, SGD,
per-step losses within 1e-10 of one process.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

# the ranks build HF models and litgpt (which imports Lightning): imported once, in the ranks' zygote
PRELOAD = (*HF_RANK_PRELOAD, "litgpt")

TOL, STEPS = 1e-10, 3
pytest.importorskip("transformers")


def _hf(name: str):
    from lightning_scale.models import hf_families as F

    return F.build(name, "eager")


def _litgpt():
    from litgpt import GPT, Config

    config = Config(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=96, padded_vocab_size=96,
                    n_query_groups=2, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128,
                    parallel_residual=False, bias=False, rotary_percentage=1.0)
    torch.manual_seed(0)
    model = GPT(config)
    model.apply(model._init_weights)
    return model.double()


def _build(kind: str):
    return _litgpt() if kind == "litgpt" else _hf(kind)


def _logits(model, kind, x):
    return model(x) if kind == "litgpt" else model(input_ids=x).logits


def _loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batch(step: int, n: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 96, (n, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _parity(kind: str, checkpointing: bool = False):
    from lightning_scale.tensor_parallel import apply_tensor_parallel, consolidate_state_dict, tensor_parallel_state

    ref = _build(kind)
    model = copy.deepcopy(ref)
    if checkpointing:
        for m in (ref, model):
            m.train()
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_tensor_parallel(model, None, None)
    state = tensor_parallel_state(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in (ref, model)]
    errs = {}
    for step in range(STEPS):
        x, y = _batch(step)
        losses = []
        for m, opt in zip((ref, model), opts):
            loss = _loss(_logits(m, kind, x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        errs[f"loss {step}"] = abs(losses[0] - losses[1])
    full, expected = consolidate_state_dict(model), ref.state_dict()
    assert set(full) == set(expected), set(full) ^ set(expected)
    for key, value in expected.items():
        errs[key] = (full[key] - value).abs().max().item()
    entries = sum(s.entries for s in state.shared_inputs.values())
    return errs, sorted(state.shared_inputs), entries


def _comm(kind: str, share: bool):
    """All-reduces of one backward (after a warm-up step): calls, and bytes per block tag prefix."""
    from lightning_scale.comm import CommCounter
    from lightning_scale.tensor_parallel import apply_tensor_parallel

    model = apply_tensor_parallel(_build(kind), None, None, share_inputs=share)
    x, y = _batch(0, n=2)
    _loss(_logits(model, kind, x), y).backward()
    model.zero_grad()
    loss = _loss(_logits(model, kind, x), y)
    with CommCounter() as counter:
        loss.backward()
    return dict(counter.calls), dict(counter.by_tag)


class _Mlp(nn.Module):
    def __init__(self, c: int, drop_a: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.a, self.b, self.proj = nn.Linear(c, 2 * c), nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.drop_a = drop_a

    def forward(self, x):
        h = self.norm(x)
        a, b = self.a(h), self.b(h)  # backward: b first, then a (the last), which drop_a leaves out of the loss
        if self.drop_a:  # a sibling whose output never reaches the loss: its backward does not run
            return x + self.proj(b * b)
        return x + self.proj(torch.nn.functional.silu(a) * b)


class _Tiny(nn.Module):
    """Embedding + 2 blocks whose MLP has two sibling column layers on one normed input + a replicated head."""

    def __init__(self, v: int = 40, c: int = 16, drop_a: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(v, c)
        self.blocks = nn.ModuleList(_Mlp(c, drop_a) for _ in range(2))
        self.head = nn.Linear(c, 1)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)  # (B, T, 1); under sequence parallelism (B, T/tp, 1)


SP_PLAN = {"emb": "vocab", "blocks.*.a": "colwise", "blocks.*.b": "colwise", "blocks.*.proj": "rowwise"}


def _tiny(share: bool, sp: bool = True, drop: bool = False):
    """One SGD step of sum(head(x)^2) over all tokens; consolidated parameters vs one process."""
    from lightning_scale.comm import CommCounter
    from lightning_scale.tensor_parallel import apply_tensor_parallel, consolidate_state_dict, sync_tp_grads

    torch.manual_seed(0)
    ref = _Tiny(drop_a=drop).double()
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, SP_PLAN, None, sequence_parallel=sp, share_inputs=share)
    idx = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(3))
    (ref(idx) ** 2).sum().backward()
    with CommCounter() as fwd:
        out = model(idx)  # this rank's half of the sequence
    with CommCounter() as bwd:
        (out ** 2).sum().backward()
    sync_tp_grads(model)
    for m in (ref, model):
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:  # drop: the unused layer 'a' has none, in both
                    p -= 0.1 * p.grad
    full = consolidate_state_dict(model)
    errs = {k: (full[k] - v).abs().max().item() for k, v in ref.state_dict().items()}
    return errs, dict(fwd.calls), dict(bwd.calls)


def worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = {}
    for kind in ("llama", "qwen2", "litgpt"):
        out[("parity", kind)] = _parity(kind)
        dist.barrier()
    out[("parity", "llama-ckpt")] = _parity("llama", checkpointing=True)
    for kind in ("llama", "litgpt"):
        for share in (True, False):
            out[("comm", kind, share)] = _comm(kind, share)
    for share in (True, False):
        out[("sp", share)] = _tiny(share)
    out[("drop",)] = _tiny(True, sp=False, drop=True)
    return out


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("litgpt")
    return run_distributed(worker, 2, timeout=400, preload=PRELOAD)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "litgpt", "llama-ckpt"])
def test_shared_input_matches_one_process(results, kind):
    for rank, res in enumerate(results):
        errs, parents, entries = res[("parity", kind)]
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, (rank, kind, bad)
        if kind == "litgpt":  # fused qkv: only the gated MLP's fc_1 / fc_2 share
            assert parents == ["transformer.h.0.mlp", "transformer.h.1.mlp"], parents
        else:
            layers = 4
            assert len(parents) == 2 * layers and all(p.endswith((".self_attn", ".mlp")) for p in parents), parents
            # one entry per (parent, training step); HF's checkpointing re-runs the forward (up to twice as many)
            want = 2 * layers * STEPS
            assert (want < entries <= 2 * want) if kind == "llama-ckpt" else entries == want, entries


def _block_bytes(by_tag, prefix):
    return sum(v for k, v in by_tag.items() if k.startswith(prefix))


@pytest.mark.timeout(500)
@pytest.mark.parametrize("kind,layers,blocks,shared,unshared", [
    ("llama", 4, "tp/model.layers.", 2, 5), ("litgpt", 2, "tp/transformer.h.", 2, 3)])
def test_backward_all_reduces_per_block(results, kind, layers, blocks, shared, unshared):
    B, T, C, esize, tp = 2, 12, 32 if kind == "llama" else 64, 8, 2
    act = 2 * (tp - 1) / tp * B * T * C * esize  # one all-reduce of a (B, T, C) float64 activation
    for rank, res in enumerate(results):
        for share, per_block in ((True, shared), (False, unshared)):
            calls, by_tag = res[("comm", kind, share)]
            # + one for the head's input (lm_head colwise_gather, alone at the root)
            assert calls.get("all_reduce") == layers * per_block + 1, (rank, share, calls)
            got = _block_bytes(by_tag, blocks + "0.")
            assert abs(got - per_block * act) <= 1e-6 * act, (rank, share, got / act)


@pytest.mark.timeout(500)
def test_sequence_parallel_siblings_share_one_gather(results):
    for rank, res in enumerate(results):
        for share in (True, False):
            errs, fwd, bwd = res[("sp", share)]
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, (rank, share, bad)
            per_block = 1 if share else 2  # all-gathers of the normed input (forward) / reduce-scatters (backward)
            assert fwd.get("all_gather") == 2 * per_block, (share, fwd)
            # backward: the gathers' reduce-scatters + the row layers' and the embedding's all-gathers
            assert bwd.get("reduce_scatter") == 2 * per_block, (share, bwd)


@pytest.mark.timeout(500)
def test_sibling_outside_the_loss_still_reduced(results):
    """A sibling whose output never reaches the loss runs no backward: the entry reduces what the others summed."""
    for rank, res in enumerate(results):
        errs, _, bwd = res[("drop",)]
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, (rank, bad)
        assert bwd.get("all_reduce") == 2, bwd  # one per block: the entry's, of b's partial gradient alone


def grid_worker(rank: int, world_size: int, layout: str) -> list:
    import torch.distributed as dist

    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = dict(tp2_pp2=dict(stage=1, tp=2, pp=2, microbatches=2, overlap_comm=False),
                  dp2_tp2_z3=dict(stage=3, tp=2))[layout]
    config = from_flat_kwargs(**kwargs)
    topo = local_topology(config, world_size, rank)
    model = _hf("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pm = parallelize(model, config, topo, "cpu", optimizers=[opt], loss_fn=_loss)
    (engine,) = pm.make_engines()
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        if pm.pipeline is not None:
            with engine.no_sync():
                loss = pm.pipeline.runtime.train_step(x, y)
        else:
            x, y = x.chunk(topo.dp)[topo.dp_rank], y.chunk(topo.dp)[topo.dp_rank]
            loss = _loss(model(input_ids=x).logits, y)
            loss.backward()
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=topo.dp_group)
            loss /= topo.dp
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    from lightning_scale.tensor_parallel import tensor_parallel_state

    state = tensor_parallel_state(pm.tp_model)
    return losses, len(state.shared_inputs)


def _reference_losses():
    model = _hf("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _loss(model(input_ids=x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["tp2_pp2", "dp2_tp2_z3"])
def test_shared_input_under_pp_and_zero3(layout):
    ref = _reference_losses()
    for rank, (losses, n_shared) in enumerate(run_distributed(grid_worker, 4, (layout,), timeout=500, preload=PRELOAD)):
        assert max(abs(a - b) for a, b in zip(losses, ref)) <= TOL, (rank, layout, losses, ref)
        assert n_shared == 8, n_shared  # attention + MLP of each of the 4 layers (tp splits the whole model)
