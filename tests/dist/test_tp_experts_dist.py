"""Mixture-of-experts models at tp=2 split their experts (the built-in plan's ``experts`` style) and equal one process.

Mixtral's and Qwen2-MoE's own ``tp_plan`` (transformers 5) covers attention only: at tp=2 the 3-D expert weights,
most of the model, stayed whole on every rank (16% of this Mixtral's parameters split). The built-in plan now cuts
every expert's intermediate width over tp (and Qwen2-MoE's shared expert column / row-wise). One 2-rank launch,
float64, one forward and backward of each family: every rank holds half of each expert weight, the loss and every
consolidated gradient equal one process's. Qwen2-MoE to 1e-12 relative; Mixtral's router keeps its routing weights
in float32 (``softmax(logits.float())``, not cast back), so the gradients reaching the router are float32 partial
sums on each rank, summed by the all-reduce: its router and the layers below it agree to 1e-6 relative (the float32
rounding of the router itself; the unsplit model's tp=2 run differs from one process the same way in the matrix).
A rank that did not all-reduce the routing weights' gradient would be off by half. GPT-OSS's experts carry biases
(every bias drawn at random here: transformers initializes them to zero) and DBRX keeps its experts as 2-D rows. The training side (ZeRO-1 at
tp=2, a universal checkpoint of the split experts resumed at dp=2) is tests/dist/test_hf_tp_universal.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, random_biases, run_distributed, tp_step, worst_grad_errors

# DeepSeek-V3: its router scores in float32 like Mixtral's; its attention is multi-head latent attention (the shared
# k_rot of kv_a_proj_with_mqa feeds this rank's heads only: style mla_kv_a_proj all-reduces its gradient)
# Llama 4: its dense experts routed (tensor_parallel/routed_experts.py; transposed layout, gate_up_proj (E, H, 2I)), the
# router score scaling each route's input; built without rotary layers (its rotary runs in complex float32)
# GPT-OSS: biases on every expert (the gate / up bias cut with its columns, the down bias added by rank 0 only; a rank
# adding it too would be off by one bias); DBRX: its experts as 2-D (E * I, H) w1 / v1 / w2, each expert's rows cut
FAMILIES = {"mixtral": 1e-6, "qwen2_moe": 1e-12, "deepseek_v3": 1e-6, "llama4": 1e-12, "gpt_oss": 1e-12,
            "dbrx": 1e-12}
OVERRIDES = {"llama4": dict(no_rope_layers=[0] * 4, layer_types=["chunked_attention", "full_attention"] * 2)}
# the share of parameters split at tp=2 (DeepSeek-V3: the latent projections kv_a / q_a and the routers stay whole)
SPLIT = {"mixtral": 0.95, "qwen2_moe": 0.95, "deepseek_v3": 0.9, "llama4": 0.95, "gpt_oss": 0.85, "dbrx": 0.95}
# the dimension each expert parameter is cut along (by its name's end); None: whole on every rank
SPLIT_DIM = {"gate_up_proj": 1, "down_proj": 2}
SPLIT_DIMS = {"llama4": {"gate_up_proj": 2, "down_proj": 1},  # transposed: (E, H, 2I) and (E, I, H)
              "gpt_oss": {"gate_up_proj": 2, "down_proj": 1, "gate_up_proj_bias": 1, "down_proj_bias": None},
              "dbrx": {"w1": 0, "v1": 0, "w2": 0}}  # (E * I, H): each expert's I rows


def _build(family: str):
    """The family's tiny model with every bias drawn at random (transformers initializes biases to zero: a bias added
    once per tp rank would go unseen)."""
    from lightning_scale.models import hf_families as F

    return random_biases(F.build(family, "eager", overrides=OVERRIDES.get(family)))


def _batch():
    from lightning_scale.models import hf_families as F

    return F.batch(4, 12, seed=0)


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def worker(rank: int, world_size: int) -> dict:
    import warnings

    import torch.distributed as dist

    from lightning_scale.comm.accounting import CommCounter
    from lightning_scale.tensor_parallel import apply_tensor_parallel

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for family in FAMILIES:
        whole = _build(family)
        shapes = {n: tuple(p.shape) for n, p in whole.named_parameters() if ".experts." in n}
        model = apply_tensor_parallel(whole, None, dist.group.WORLD)
        x, y = _batch()
        with CommCounter() as counter:
            out[family] = tp_step(model, _loss, y, shapes.__contains__, input_ids=x)
        out[family].update(full_shapes=shapes, experts_tags=sorted(t for t in counter.by_tag if t.endswith(".experts")))
    return out


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("transformers")
    return run_distributed(worker, 2, (), timeout=300, preload=HF_RANK_PRELOAD)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_at_tp2_splits_the_experts_and_equals_one_process(runs, family):
    ref = _build(family)
    x, y = _batch()
    loss = _loss(ref(input_ids=x).logits, y)
    loss.backward()
    tol = FAMILIES[family]
    for rank, run in enumerate(runs):
        r = run[family]
        assert r["full_shapes"], "no expert weights found"
        for name, full in r["full_shapes"].items():  # (E, 2I, H) -> (E, I, H); (E, H, I) -> (E, H, I / 2)
            dim = SPLIT_DIMS.get(family, SPLIT_DIM)[name.rsplit(".", 1)[1]]
            want = tuple(n // 2 if d == dim else n for d, n in enumerate(full))
            assert r["local_shapes"][name] == want, (name, r["local_shapes"][name], want)
        assert r["fraction"] > SPLIT[family], r["fraction"]  # was 0.16 for this Mixtral with its own plan
        assert r["experts_tags"], "no all-reduce tagged by an experts module"
        assert abs(r["loss"] - loss.item()) <= 1e-12 * abs(loss.item()), (rank, r["loss"], loss.item())
        bad = worst_grad_errors(ref, r["grads"], tol)
        assert not bad, (family, rank, bad)


# --- a MoE block that holds its router (a gate + an experts list of MLPs): litgpt's LLaMAMoE layout, and a user's own
# block with Hugging Face-style or older Mixtral-style expert MLPs. litgpt's own is tests/dist/test_litgpt.py.
H, I, E, K = 16, 24, 4, 2
MLP_NAMES = {"hf": ("gate_proj", "up_proj", "down_proj"), "mixtral_v4": ("w1", "w3", "w2"),
             "litgpt": ("fc_1", "fc_2", "proj")}


class _MLP(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names
        for n, (i, o) in zip(names, ((H, I), (H, I), (I, H))):
            setattr(self, n, torch.nn.Linear(i, o, bias=False))

    def forward(self, x):
        up1, up2, down = (getattr(self, n) for n in self.names)
        return down(torch.nn.functional.silu(up1(x)) * up2(x))


class _Block(torch.nn.Module):
    def __init__(self, names, shared):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(_MLP(names) for _ in range(E))
        self.shared_experts = _MLP(names) if shared else None

    def forward(self, x):
        weights, idx = torch.topk(self.gate(x).softmax(-1), K)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            y = y.index_add(0, tok, weights[tok, slot, None] * expert(x[tok]))
        return y + self.shared_experts(x) if self.shared_experts is not None else y


def _block_model(names, shared):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(H, H), _Block(names, shared), torch.nn.Linear(H, 3)).double()


def _block_grads(model):
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss = model(x).square().mean()
    loss.backward()
    return loss.item()


def block_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_scale.tensor_parallel import apply_tensor_parallel, consolidate_state_dict

    out = {}
    for kind, names in MLP_NAMES.items():
        model = apply_tensor_parallel(_block_model(names, kind == "litgpt"), {"1": "experts"}, dist.group.WORLD)
        loss = _block_grads(model)
        out[kind] = dict(loss=loss, local={n: tuple(p.shape) for n, p in model.named_parameters()},
                         grads=consolidate_state_dict(model, values={n: p.grad for n, p in model.named_parameters()}))
    return out


@pytest.mark.timeout(200)
def test_moe_block_holding_its_router_at_tp2_equals_one_process():
    """Style ``experts`` on a block with a gate and a list of MLP experts (Hugging Face-style, Mixtral's old
    ``w1 / w3 / w2`` and litgpt's ``fc_1 / fc_2 / proj`` names; a shared expert in the last): every expert's width
    halved, the gate whole, loss and every consolidated gradient = one process within 1e-12 relative (float64)."""
    runs = run_distributed(block_worker, 2, (), timeout=150)
    for kind, names in MLP_NAMES.items():
        ref = _block_model(names, kind == "litgpt")
        loss = _block_grads(ref)
        for run in runs:
            r = run[kind]
            assert abs(r["loss"] - loss) <= 1e-12 * abs(loss), (kind, r["loss"], loss)
            for n, p in ref.named_parameters():
                want = tuple(p.shape)
                if ".experts." in n or ".shared_experts." in n:
                    want = (want[0] // 2, want[1]) if not n.endswith(f"{names[2]}.weight") else (want[0], want[1] // 2)
                assert r["local"][n] == want, (kind, n, r["local"][n], want)
                err = (r["grads"][n] - p.grad).abs().max() / p.grad.abs().max()
                assert err <= 1e-12, (kind, n, err.item())
