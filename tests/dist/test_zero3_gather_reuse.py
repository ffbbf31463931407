"""ZeRO-3 per-step costs that must stay gone: the gradient reduce-scatter of a unit reads the unit's own full buffer
(no second unit-sized staging buffer allocated and zero-filled per unit per step), and the root unit prefetches the
first block, so that block's gather is already in flight when its forward begins. One process (world 1: the
collectives are local copies, the hooks and buffers are the real ones); parity across ranks is test_zero3.py's."""

import torch

from lightning_scale.comm import collectives as C
from lightning_scale.models.gpt import GPT, GPTConfig, lm_loss, make_batch
from lightning_scale.zero import param_shard
from lightning_scale.zero.param_shard import ShardedParameters
from lightning_scale.zero.stage3_optimizer import Stage3Optimizer


def _setup(prefetch=1, units=None):
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)
    torch.manual_seed(0)
    model = GPT(cfg).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharded = ShardedParameters(model, [g["params"] for g in opt.param_groups], device=torch.device("cpu"),
                                prefetch_depth=prefetch, unit_modules=units)
    sharded.shard_model()
    Stage3Optimizer(opt, sharded)
    return cfg, model, opt, sharded


def _step(cfg, model, opt, seed):
    x, y = make_batch(cfg, 2, seed=seed)
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_reduce_scatter_reads_the_units_full_buffer(monkeypatch):
    cfg, model, opt, sharded = _setup()
    inputs = []
    real = C.reduce_scatter

    def spy(out, inp, *a, **k):
        inputs.append(inp)
        return real(out, inp, *a, **k)

    monkeypatch.setattr(param_shard.C, "reduce_scatter", spy)
    _step(cfg, model, opt, 0)
    by_unit = {u.kind: u for u in sharded.units}
    non_persistent = [b for u in sharded.units if u.kind != "persistent" for b in u.buckets]
    assert len(non_persistent) == 4 and "root" in by_unit  # 3 blocks + the root unit
    staged_in_full = [b for b in non_persistent if any(t is b.full for t in inputs)]
    assert staged_in_full == non_persistent, "a unit's gradients were staged in a separate buffer"
    for u in sharded.units:  # freed once reduced: no storage kept after the step
        if u.kind != "persistent":
            assert not u.gathered and all(b.full.untyped_storage().nbytes() == 0 for b in u.buckets), u.name


def test_root_unit_prefetches_the_first_block():
    cfg, model, opt, sharded = _setup()
    first = next(u for u in sharded.units if u.kind == "unit")
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(first.gathered), prepend=True)
    for seed in range(3):
        _step(cfg, model, opt, seed)
    # step 1 learns the forward order; from step 2 the root's first module starts the first block's gather
    assert seen == [False, True, True], seen


def test_results_equal_a_plain_model():
    cfg, model, opt, sharded = _setup()
    torch.manual_seed(0)
    ref = GPT(cfg).double()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)  # the engine's kernel for CPU masters
    for seed in range(3):
        _step(cfg, model, opt, seed)
        _step(cfg, ref, ref_opt, seed)
    full = sharded.full_state_dict(dtype=None)
    for n, p in ref.named_parameters():
        assert torch.equal(full[n], p.detach()), n


def test_forward_last_unit_is_kept_for_its_backward(monkeypatch):
    """The forward's last unit (here the head, a unit of its own through unit_modules) is not freed after its forward:
    its backward comes next, so it is gathered once per step, the blocks twice (forward and backward), the embedding
    once (nn.Embedding's backward reads no weight: its unit is not gathered again, its gradient still reduced); under
    no_grad nothing is kept; a second forward before the backward (a pipeline's micro-batches) reuses it; a step frees
    it; and the losses equal the default layout's bit for bit."""
    gathers = []
    real = param_shard.pairwise.all_gather

    def spy(full, shard, *a, **k):
        gathers.append(full)
        return real(full, shard, *a, **k)

    monkeypatch.setattr(param_shard.pairwise, "all_gather", spy)
    cfg, model, opt, sharded = _setup(units=("Block", "wte", "lm_head"))
    head = next(u for u in sharded.units if u.name == "lm_head")
    losses = []
    for seed in range(3):
        gathers.clear()
        x, y = make_batch(cfg, 2, seed=seed)
        loss = lm_loss(model(x), y)
        if seed > 0:  # step 1 learns the forward order
            assert head.gathered and head.kept  # still gathered at the loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        per_unit = {u.name: sum(any(t is b.full for b in u.buckets) for t in gathers) for u in sharded.units}
        if seed > 0:
            # the embedding's backward reads the indices only: gathered for its forward alone
            assert per_unit["lm_head"] == 1 and per_unit["wte"] == 1 and per_unit["blocks.0"] == 2, per_unit
        assert not head.gathered and not head.kept  # reduced and freed by the backward
    with torch.no_grad():
        model(x)
    assert not head.gathered and not head.kept  # no backward can come
    model(x)  # a forward with grad whose backward has not come, then another (a pipeline's micro-batches)
    assert head.kept
    gathers.clear()
    lm_loss(model(x), y).backward()
    assert sum(any(t is b.full for b in head.buckets) for t in gathers) == 0  # still current: no step since
    model(x)
    assert head.kept and head.gathered
    sharded.after_step()  # a step frees every gathered unit, the kept one too: the next forward gathers afresh
    assert not head.gathered and not head.kept
    opt.zero_grad()
    after = sharded.full_state_dict(dtype=None)
    _, ref_model, ref_opt, ref_sharded = _setup()
    ref = []
    for seed in range(3):
        x, y = make_batch(cfg, 2, seed=seed)
        loss = lm_loss(ref_model(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref.append(loss.item())
    assert losses == ref
    lm_loss(ref_model(x), y).backward()  # the same fourth backward (and no step) as above
    ref_opt.zero_grad()
    want = ref_sharded.full_state_dict(dtype=None)
    assert all(torch.equal(after[k], want[k]) for k in want)  # every parameter, the embedding's included
