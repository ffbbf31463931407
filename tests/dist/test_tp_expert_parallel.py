"""Expert parallelism over the tp group (``Zero3DStrategy(tp=2, expert_parallel=True)``): each rank holds half of
the experts of every mixture-of-experts layer, whole, and the model equals one process.

One 2-rank launch, float64. (1) Forward and backward of unchanged Hugging Face MoE models built from their config
classes (Mixtral, Qwen2-MoE with its shared expert through transformers' ``batched_mm`` experts, DeepSeek-V3 with
multi-head latent attention, GPT-OSS with per-expert biases, each living on the rank of its expert): every expert
weight keeps its full shape but for the expert axis (E / 2 per rank), the loss and every consolidated gradient equal
one process's within 1e-12 relative (top-2 routing: each token's two expert outputs meet once, so the all-reduce
adds what one process adds; measured ~1e-15). A rank that picked its routes before entering the region (the
routing weights' gradient summed after the pick) gives the router half its gradient; one that ran other ranks'
routes on its own experts is off by 1e-3: both fail here. (2) Training and the universal checkpoint: Qwen2-MoE trains 2
AdamW steps at tp=2 with every expert split (style ``experts``, ZeRO-1), saves the layout-free checkpoint, and the
same ranks load it at tp=2 with the experts placed (``expert_parallel``) and train step 3: the resumed losses equal
one process's (1e-10), so a run can switch between the two layouts. Bad input: tests/unit/test_tp_expert_parallel_plan.py.
"""

from __future__ import annotations

import pytest
import torch

from lightning_scale.testing import HF_RANK_PRELOAD, run_distributed

# mixtral_idle: Mixtral with its routers zeroed (GPT-OSS initializes its routers so): every token picks the same two
# experts (torch.topk's tie order), both on one rank, so the other rank gets no route at all; its experts' output
# was outside autograd and its backward skipped the all-reduces the busy rank ran (a hang, seen in a Trainer run of
# GPT-OSS)
# llama4: its dense experts routed (tensor_parallel/routed_experts.py), the routing weight scaling each route's input
FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4", "mixtral_idle")
# Llama 4's rotary runs in complex float32 (and its q/k norms on rotary layers): any last-bit difference of a split
# float64 run moves the loss by ~1e-10 there; without rotary layers everything is float64, as the 1e-12 checks need
# (the rotary layers and chunked attention run in the Trainer and matrix tests, within 1e-7)
OVERRIDES = {"llama4": dict(no_rope_layers=[0] * 4, layer_types=["chunked_attention", "full_attention"] * 2)}
IMPLEMENTATION = {"qwen2_moe": "batched_mm"}  # transformers' batched_mm experts for one family (the others: eager)
STEPS, SAVE_AT, LR = 3, 2, 1e-2
# the resume: Qwen2-MoE (its router's softmax in float64: the split layout is exact too; Mixtral's float32 router
# moves the split layout's losses by ~1e-8, tests/dist/test_tp_experts_dist.py)
RESUME = "qwen2_moe"


def _build(family: str):
    from lightning_scale.models import hf_families as F

    model = F.build(family.replace("_idle", ""), "eager", overrides=OVERRIDES.get(family))
    if family.endswith("_idle"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.zero_()
    impl = IMPLEMENTATION.get(family)
    if impl:
        for m in model.modules():
            if hasattr(getattr(m, "config", None), "_experts_implementation"):
                m.config._experts_implementation = impl
    return model


def _batch(step: int = 0):
    from lightning_scale.models import hf_families as F

    return F.batch(4, 12, seed=step)


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _grads(model) -> dict:
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def _layout(layout: dict, rank: int, world_size: int):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(**layout)
    topo = local_topology(config, world_size, rank)
    model = _build(RESUME)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    pm = parallelize(model, config, topo, "cpu", optimizers=[opt])
    (engine,) = pm.make_engines()
    return model, opt, engine, topo


def worker(rank: int, world_size: int, root: str) -> dict:
    import warnings

    import torch.distributed as dist

    from lightning_scale.checkpoint.engine_pieces import load_engines, save_engines
    from lightning_scale.comm.accounting import CommCounter
    from lightning_scale.tensor_parallel import apply_tensor_parallel, consolidate_state_dict
    from lightning_scale.tensor_parallel.state import split_summary
    from lightning_scale.testing import dp_step

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for family in FAMILIES:
        whole = _build(family)
        shapes = {n: tuple(p.shape) for n, p in whole.named_parameters() if ".experts." in n}
        model = apply_tensor_parallel(whole, None, dist.group.WORLD, expert_parallel=True)
        x, y = _batch()
        with CommCounter() as counter:
            loss = _loss(model(input_ids=x).logits, y)
            loss.backward()
        experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
        summary = split_summary(model, 2)
        out[family] = dict(loss=loss.item(), grads=consolidate_state_dict(model, values=_grads(model)),
                           full_shapes=shapes, fraction=summary["fraction"], placed=summary["experts_placed"],
                           local_shapes={n: tuple(p.shape) for n, p in model.named_parameters() if n in shapes},
                           num_experts=sorted({m.num_experts for m in experts}),
                           experts_tags=sorted(t for t in counter.by_tag if t.endswith(".experts")))
    # split at tp=2 -> checkpoint -> placed at tp=2
    model, opt, engine, topo = _layout(dict(tp=2, stage=1), rank, world_size)
    losses = [dp_step(model, opt, topo, *_batch(step), _loss) for step in range(SAVE_AT)]
    save_engines(root, model, [engine], tp_rank=topo.tp_rank)
    model, opt, engine, topo = _layout(dict(tp=2, stage=1, expert_parallel=True), rank, world_size)
    load_engines(root, model, [engine], tp_rank=topo.tp_rank)
    losses += [dp_step(model, opt, topo, *_batch(step), _loss) for step in range(SAVE_AT, STEPS)]
    placed = model.get_submodule("model.layers.0.mlp.experts")
    out["resume"] = dict(losses=losses, local=tuple(placed.gate_up_proj.shape))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    root = str(tmp_path_factory.mktemp("tp_expert_parallel"))
    return run_distributed(worker, 2, (root,), timeout=300, preload=HF_RANK_PRELOAD)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_placed_at_tp2_equal_one_process(runs, family):
    ref = _build(family)
    x, y = _batch()
    loss = _loss(ref(input_ids=x).logits, y)
    loss.backward()
    grads = _grads(ref)
    if family.endswith("_idle"):  # the case it stands for: every route goes to one rank's experts, none to the other
        idx = ref.model.layers[0].mlp.gate(ref.model.embed_tokens(x))[2]
        assert set(idx.flatten().tolist()) in ({0, 1}, {2, 3}), idx
    for rank, run in enumerate(runs):
        r = run[family]
        assert r["full_shapes"], "no expert weights found"
        for name, full in r["full_shapes"].items():  # (E, ...) -> (E / 2, ...): whole experts, half of them
            assert r["local_shapes"][name] == (full[0] // 2, *full[1:]), (name, r["local_shapes"][name], full)
        assert r["num_experts"] == [2], r["num_experts"]  # 4 experts, 2 per rank: the forward's local count
        moe_layers = {"deepseek_v3": ref.config.num_hidden_layers - 1, "llama4": 2}  # llama4: layers 1 and 3
        assert r["fraction"] > (0.5 if family == "llama4" else 0.85), r["fraction"]  # llama4: a dense MLP every 2nd
        assert r["placed"] == (moe_layers.get(family, ref.config.num_hidden_layers), 2, 4), r["placed"]
        assert r["experts_tags"], "no all-reduce tagged by an experts module"
        assert abs(r["loss"] - loss.item()) <= 1e-12 * abs(loss.item()), (rank, r["loss"], loss.item())
        worst = {n: ((r["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-300)).item()
                 for n, g in grads.items()}
        bad = {n: w for n, w in worst.items() if not w <= 1e-12}
        assert not bad, (family, rank, bad)


@pytest.mark.timeout(400)
def test_split_experts_checkpoint_resumes_with_experts_placed(runs):
    model = _build(RESUME)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    want = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _loss(model(input_ids=x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    full = tuple(model.get_submodule("model.layers.0.mlp.experts").gate_up_proj.shape)
    for rank, run in enumerate(runs):
        r = run["resume"]
        assert r["local"] == (full[0] // 2, *full[1:]), (r["local"], full)
        diff = max(abs(a - b) for a, b in zip(r["losses"], want))
        assert diff <= 1e-10, (rank, r["losses"], want)
