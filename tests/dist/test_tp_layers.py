"""Each tensor-parallel layer against the dense layer it slices: forward and backward, float64, tp=2 and 4.

Every rank builds the same dense layer and inputs (same seed), runs the parallel layer on its share,
and compares outputs, input gradients and (re-assembled) parameter gradients with the dense run.
The loss is a fixed random projection of the output, so every output element gets a distinct
gradient; for split outputs each rank contributes its own slice of that loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lightning_scale.testing import run_distributed

TOL = 1e-12


class Conv1D(nn.Module):
    """Stand-in for Hugging Face's GPT-2 Conv1D (detected by name): weight stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf, dtype=torch.float64) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf, dtype=torch.float64) * 0.3)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).view(*x.shape[:-1], self.nf)


def _gather_full(local: torch.Tensor, spec) -> torch.Tensor:
    from lightning_scale.tensor_parallel import merge_shards

    shards = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, local.contiguous())
    return merge_shards(shards, spec)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _column_case(errs, tp, rank, *, sections=1, pad=False, gather=False, conv=False, sp=False, out=12, tag=""):
    from lightning_scale.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(1)
    dense = Conv1D(out, 8) if conv else nn.Linear(8, out, dtype=torch.float64)
    T = 4
    x = torch.randn(2, T, 8, dtype=torch.float64, requires_grad=True)
    proj = torch.randn(2, T, out, dtype=torch.float64)
    y = dense(x)
    (y * proj).sum().backward()
    layer = ColumnParallelLinear.from_dense(dense, None, sections=sections, pad=pad, gather_output=gather,
                                            sequence_parallel=sp)
    xin = x.detach().chunk(tp, dim=1)[rank].clone() if sp else x.detach().clone()
    xin.requires_grad_(True)
    yl = layer(xin)
    spec = layer.weight_spec
    if gather:
        errs[f"{tag} fwd"] = _err(yl, y)
        (yl * proj).sum().backward()
    else:  # this rank's output columns; padded columns must not exist in the reference
        proj_pad = F.pad(proj, (0, spec.padded - out))
        y_pad = F.pad(y.detach(), (0, spec.padded - out))
        from lightning_scale.tensor_parallel import shard_tensor

        ref = shard_tensor(y_pad.transpose(0, -1), _spec_dim0(spec), rank).transpose(0, -1)
        errs[f"{tag} fwd"] = _err(yl, ref)
        pl = shard_tensor(proj_pad.transpose(0, -1), _spec_dim0(spec), rank).transpose(0, -1)
        (yl * pl).sum().backward()
    x_ref = x.grad.chunk(tp, dim=1)[rank] if sp else x.grad
    errs[f"{tag} dx"] = _err(xin.grad, x_ref)
    errs[f"{tag} dW"] = _err(_gather_full(layer.weight.grad, spec), dense.weight.grad)
    errs[f"{tag} db"] = _err(_gather_full(layer.bias.grad, layer.bias_spec), dense.bias.grad)


def _spec_dim0(spec):
    from lightning_scale.tensor_parallel import ShardSpec

    return ShardSpec(dim=0, size=spec.padded, tp=spec.tp, padded=spec.padded, sections=spec.sections)


def _row_case(errs, tp, rank, *, parallel_input=True, conv=False, sp=False, tag=""):
    from lightning_scale.tensor_parallel import RowParallelLinear, sync_tp_grads

    torch.manual_seed(2)
    dense = Conv1D(6, 16) if conv else nn.Linear(16, 6, dtype=torch.float64)
    T = 4
    x = torch.randn(2, T, 16, dtype=torch.float64, requires_grad=True)
    proj = torch.randn(2, T, 6, dtype=torch.float64)
    y = dense(x)
    (y * proj).sum().backward()
    layer = RowParallelLinear.from_dense(dense, None, input_is_parallel=parallel_input, sequence_parallel=sp)
    xin = (x.detach().chunk(tp, dim=-1)[rank] if parallel_input else x.detach()).clone().requires_grad_(True)
    yl = layer(xin)
    if sp:
        errs[f"{tag} fwd"] = _err(yl, y.chunk(tp, dim=1)[rank])
        (yl * proj.chunk(tp, dim=1)[rank]).sum().backward()
        sync_tp_grads([layer.bias], None)  # the bias saw only this rank's tokens
    else:
        errs[f"{tag} fwd"] = _err(yl, y)
        (yl * proj).sum().backward()
    errs[f"{tag} dx"] = _err(xin.grad, x.grad.chunk(tp, dim=-1)[rank] if parallel_input else x.grad)
    errs[f"{tag} dW"] = _err(_gather_full(layer.weight.grad, layer.weight_spec), dense.weight.grad)
    errs[f"{tag} db"] = _err(layer.bias.grad, dense.bias.grad)


def _embedding_case(errs, tp, rank, *, sp=False, tag=""):
    from lightning_scale.tensor_parallel import VocabParallelEmbedding

    torch.manual_seed(3)
    dense = nn.Embedding(10, 6, padding_idx=7, dtype=torch.float64)  # 10 rows: padded at tp=4
    idx = torch.randint(0, 10, (2, 8))
    idx[0, :3] = torch.tensor([0, 7, 9])
    proj = torch.randn(2, 8, 6, dtype=torch.float64)
    y = dense(idx)
    (y * proj).sum().backward()
    layer = VocabParallelEmbedding.from_dense(dense, None, sequence_parallel=sp)
    yl = layer(idx)
    if sp:
        errs[f"{tag} fwd"] = _err(yl, y.chunk(tp, dim=1)[rank])
        (yl * proj.chunk(tp, dim=1)[rank]).sum().backward()
    else:
        errs[f"{tag} fwd"] = _err(yl, y)
        (yl * proj).sum().backward()
    errs[f"{tag} dW"] = _err(_gather_full(layer.weight.grad, layer.weight_spec), dense.weight.grad)
    for bad in (10, 11, -1):  # past the vocabulary (10, 11: the padded rows at tp=4) or negative: an error, as dense
        try:
            layer(torch.tensor([[1, bad]]))
            errs[f"{tag} id {bad} raises"] = 1.0  # looked up as zeros and trained on
        except IndexError as err:
            errs[f"{tag} id {bad} raises"] = 0.0 if "outside the vocabulary [0, 10)" in str(err) else 1.0


def _cross_entropy_case(errs, tp, rank, *, vocab=10, tag=""):
    from lightning_scale.tensor_parallel import vocab_parallel_cross_entropy

    torch.manual_seed(4)
    logits = torch.randn(3, 5, vocab, dtype=torch.float64, requires_grad=True) * 3
    logits.retain_grad()
    targets = torch.randint(0, vocab, (3, 5))
    targets[0, 0] = -100
    targets[1, 2] = vocab - 1
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ref.backward()
    local_n = -(-vocab // tp)
    padded = torch.cat([logits.detach(), torch.full((3, 5, local_n * tp - vocab), 50.0, dtype=torch.float64)], -1)
    local = padded[..., rank * local_n:(rank + 1) * local_n].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, targets, None, vocab_size=vocab)
    errs[f"{tag} loss"] = abs(loss.item() - ref.item())
    loss.backward()
    grad_full = torch.cat([_all(local.grad, r) for r in range(tp)], -1)
    errs[f"{tag} dlogits"] = _err(grad_full[..., :vocab], logits.grad)
    errs[f"{tag} dpad"] = grad_full[..., vocab:].abs().max().item() if grad_full.shape[-1] > vocab else 0.0
    for bad in (vocab, -1):  # past the vocabulary (a padded column when vocab=10) or negative, not ignore_index
        wrong = targets.clone()
        wrong[2, 4] = bad
        try:
            vocab_parallel_cross_entropy(local, wrong, None, vocab_size=vocab)
            errs[f"{tag} target {bad} raises"] = 1.0  # its logit counted as 0: trained on in silence
        except IndexError as err:
            errs[f"{tag} target {bad} raises"] = 0.0 if f"target {bad} is outside" in str(err) else 1.0


def _all(t, r):
    shards = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, t.contiguous())
    return shards[r]


def _mappings_case(errs, tp, rank):
    """Each public mapping against its definition; every rank's loss weights the output differently."""
    from lightning_scale.tensor_parallel import mappings as m

    torch.manual_seed(5)
    x = torch.randn(2, 4 * tp, 3 * tp, dtype=torch.float64)  # (B, T, C), T and C divisible by tp
    projs = [torch.randn(2, 4 * tp, 3 * tp, dtype=torch.float64) for _ in range(tp)]  # rank r's loss weights
    total = sum(projs)

    def run(fn, inp):
        inp = inp.clone().requires_grad_(True)
        out = fn(inp)
        (out * projs[rank][tuple(slice(0, s) for s in out.shape)]).sum().backward()
        return out, inp.grad

    out, g = run(lambda t: m.copy_to_region(t, None), x)
    errs["copy_to_region fwd"], errs["copy_to_region bwd"] = _err(out, x), _err(g, total)
    out, g = run(lambda t: m.reduce_from_region(t, None), x)
    errs["reduce_from_region fwd"], errs["reduce_from_region bwd"] = _err(out, tp * x), _err(g, projs[rank])
    out, g = run(lambda t: m.scatter_to_region(t, None), x)
    errs["scatter fwd"] = _err(out, x.chunk(tp, -1)[rank])
    errs["scatter bwd"] = _err(g, torch.cat([p[..., : 3] for p in projs], -1))
    xl = x.chunk(tp, dim=1)[rank]
    out, g = run(lambda t: m.gather_from_sequence_region(t, None, grad_reduce_scatter=False), xl)
    errs["seq gather fwd"], errs["seq gather bwd (split)"] = _err(out, x), _err(g, projs[rank].chunk(tp, 1)[rank])
    out, g = run(lambda t: m.gather_from_sequence_region(t, None), xl)
    errs["seq gather bwd (reduce-scatter)"] = _err(g, total.chunk(tp, 1)[rank])
    out, g = run(lambda t: m.reduce_scatter_to_sequence_region(t, None), x)
    errs["seq reduce-scatter fwd"] = _err(out, (tp * x).chunk(tp, 1)[rank])
    errs["seq reduce-scatter bwd"] = _err(g, torch.cat([p[:, : 4] for p in projs], 1))


def _layers_worker(rank: int, world_size: int):
    torch.set_default_dtype(torch.float64)
    errs = {}
    tp = world_size
    _mappings_case(errs, tp, rank)
    _column_case(errs, tp, rank, tag="column")
    _column_case(errs, tp, rank, sections=3, out=24, gather=True, tag="column fused qkv gathered")
    _column_case(errs, tp, rank, sections=3, out=24, tag="column fused qkv")
    _column_case(errs, tp, rank, pad=True, out=10, tag="column padded")
    _column_case(errs, tp, rank, pad=True, out=10, gather=True, tag="column padded gathered")
    _column_case(errs, tp, rank, conv=True, sections=3, out=24, tag="column Conv1D fused")
    _column_case(errs, tp, rank, sp=True, tag="column sequence-parallel")
    _row_case(errs, tp, rank, tag="row")
    _row_case(errs, tp, rank, parallel_input=False, tag="row scatter input")
    _row_case(errs, tp, rank, conv=True, tag="row Conv1D")
    _row_case(errs, tp, rank, sp=True, tag="row sequence-parallel")
    _embedding_case(errs, tp, rank, tag="embedding")
    _embedding_case(errs, tp, rank, sp=True, tag="embedding sequence-parallel")
    _cross_entropy_case(errs, tp, rank, tag="cross-entropy padded")
    _cross_entropy_case(errs, tp, rank, vocab=12, tag="cross-entropy")
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_dense(tp):
    results = run_distributed(_layers_worker, tp, timeout=120)
    for rank, errs in enumerate(results):
        assert len(errs) >= 64
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
