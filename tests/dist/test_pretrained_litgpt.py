"""Pretrained litgpt weights (``lit_model.pth``) into litgpt's GPT built on meta, through ``parallelize`` (2 ranks).

litgpt keeps a model's weights as ``lit_model.pth`` (a ``torch.save``d state dict; its fine-tuning scripts save
``{"model": state dict}``) beside ``model_config.yaml``. ``lightning_scale.load_pretrained(model, dir)`` on a model
built on meta records the directory; ``parallelize`` then reads, on each rank, only what the rank keeps: the file is
opened with ``torch.load(mmap=True, weights_only=True)`` and each region read touches only its pages
(``checkpoint.hf._TorchFile``). Two tiny float64 configs, their weights scaled so a fresh init is told apart:

* ``llama``: grouped-query attention (4 heads, 2 kv groups), RMSNorm, gated MLP;
* ``moe``: the same attention with litgpt's ``LLaMAMoE`` (4 experts, 2 per token, a shared expert), saved as
  ``{"model": ...}``.

Under ZeRO-3 (dp=2), tp=2, pp=2 and, for ``moe``, ep=2 and tp=2 with ``expert_parallel=True`` (each rank reads its
two experts whole, under their own names), 3 SGD steps equal one process that loaded the same file with
``load_state_dict`` and summed each step's gradient as the layout does (the whole batch at tp, its two halves
otherwise) (1e-10; ``moe`` 1e-7: litgpt's routing softmax runs in float32, so another reduction order moves
it), and each rank read its share of the file's bytes, not the whole (< 0.62; ep keeps every dense parameter whole:
< 0.8). A directory with neither safetensors nor ``lit_model.pth``, and a ``lit_model.pth`` missing a tensor, are
ConfigErrors naming them on every rank, before anything is allocated.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("litgpt", reason="litgpt is not installed (pip install litgpt==0.5.13 --no-deps)")

from lightning_scale.testing import RANK_PRELOAD, run_distributed  # noqa: E402

PRELOAD = (*RANK_PRELOAD, "litgpt")
STEPS, LR, BATCH, SEQ, VOCAB = 3, 0.5, 4, 12, 64
BASE = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB,
            n_query_groups=2, norm_class_name="RMSNorm", parallel_residual=False, bias=False, rotary_percentage=1.0)
CONFIGS = {"llama": dict(mlp_class_name="LLaMAMLP", intermediate_size=64),
           "moe": dict(mlp_class_name="LLaMAMoE", intermediate_size=64, moe_intermediate_size=32, n_expert=4,
                       n_expert_per_token=2, n_shared_expert=1)}
MODES = {"zero3": dict(stage=3), "tp2": dict(stage=1, tp=2), "pp2": dict(stage=1, pp=2, microbatches=2),
         "ep2": dict(stage=1, ep=2), "tp2_ep": dict(stage=1, tp=2, expert_parallel=True)}
CASES = [("llama", "zero3"), ("llama", "tp2"), ("llama", "pp2"), ("moe", "zero3"), ("moe", "tp2"), ("moe", "pp2"),
         ("moe", "ep2"), ("moe", "tp2_ep")]
TOLERANCE = {"moe": 1e-7}


def _config(name: str):
    from litgpt import Config

    return Config(**{**BASE, **CONFIGS[name]})


def _batches():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(model, halves: bool):
    """3 SGD steps on the batches; ``halves``: each step's gradient summed over the two halves of its rows (what dp=2,
    ep=2 and pp=2's two micro-batches compute: these scaled weights make litgpt's steps sensitive enough that the two
    orders of the sum part by ~1e-8 after a step, in one process too)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        parts = zip(x.chunk(2), y.chunk(2)) if halves else [(x, y)]
        total = 0.0
        for xs, ys in parts:
            loss = _loss(model(xs), ys) / (2 if halves else 1)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.fixture(scope="module")
def lit_dirs(tmp_path_factory):
    from litgpt import GPT

    root = tmp_path_factory.mktemp("litgpt_pretrained")
    refs = {}
    for i, name in enumerate(CONFIGS):
        torch.manual_seed(i)
        model = GPT(_config(name)).double()
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5).add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        os.makedirs(root / name)
        state = model.state_dict()
        torch.save({"model": state} if name == "moe" else state, root / name / "lit_model.pth")
        saved = torch.load(root / name / "lit_model.pth", weights_only=True)
        for halves in (False, True):
            fresh = GPT(_config(name)).double()
            fresh.load_state_dict(saved.get("model", saved))
            refs[name, halves] = _train(fresh, halves)
    # one tensor left out of the file
    holey = dict(torch.load(root / "llama" / "lit_model.pth", weights_only=True))
    del holey["transformer.h.1.mlp.fc_2.weight"]
    os.makedirs(root / "holey")
    torch.save(holey, root / "holey" / "lit_model.pth")
    os.makedirs(root / "empty")
    return {"root": str(root), "refs": refs}


def _on_meta(directory: str, name: str):
    from litgpt import GPT

    import lightning_scale.pretrained as P

    with torch.device("meta"):
        model = GPT(_config(name)).double()
        P.load_pretrained(model, directory)
    return model


def _run_case(rank, world, root, name, mode):
    from test_pretrained import _count_reads, data_mean  # bytes read through HFCheckpoint.read_chunk; the mean loss
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    directory = os.path.join(root, name)
    config = from_flat_kwargs(**MODES[mode])
    topo = local_topology(config, world, rank)
    model = _on_meta(directory, name)
    assert next(model.parameters()).is_meta
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # remapped by name
    counter, restore = _count_reads()
    try:
        pm = parallelize(model, config, topo, "cpu", optimizers=[opt], loss_fn=_loss)
    finally:
        restore()
    (engine,) = pm.make_engines()
    losses = []
    for x, y in _batches():
        xs, ys = x.chunk(topo.data_size)[topo.data_rank], y.chunk(topo.data_size)[topo.data_rank]
        if pm.pipeline is not None:
            with engine.no_sync():
                loss = pm.pipeline.runtime.train_step(xs, ys)
        else:
            loss = _loss(model(xs), ys)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(data_mean(loss, topo))
    return {"losses": losses, "read": counter["bytes"],
            "file": os.path.getsize(os.path.join(directory, "lit_model.pth"))}


def _bad_inputs(root):
    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(stage=3)
    topo = local_topology(config, 2, torch.distributed.get_rank())
    out = {}
    for case, directory in (("no_weights", "empty"), ("missing_tensor", "holey")):
        try:
            parallelize(_on_meta(os.path.join(root, directory), "llama"), config, topo, "cpu")
            out[case] = None
        except Exception as err:  # noqa: BLE001  (the type is the result)
            out[case] = f"{type(err).__name__}: {err}"
    return out


def _fresh_on_meta(rank, world, mode):
    """litgpt's GPT built on meta with no weights to read (a fresh run under ZeRO-3 / tp), materialized by the init
    contract: its rotary cache, norms and linears as a GPT built on the CPU would have them."""
    from litgpt import GPT

    from lightning_scale.config import from_flat_kwargs
    from lightning_scale.parallelize import local_topology, parallelize

    config = from_flat_kwargs(**MODES[mode])
    topo = local_topology(config, world, rank)
    with torch.device("meta"):
        model = GPT(_config("moe"))
    cpu = GPT(_config("moe"))
    pm = parallelize(model, config, topo, "cpu", optimizers=[torch.optim.SGD(model.parameters(), lr=LR)],
                     loss_fn=_loss)
    pm.make_engines()
    x, y = _batches()[0]
    loss = _loss(model(x), y).item()
    norms = [m.weight for n, m in model.named_modules() if type(m).__name__ == "RMSNorm"]
    with pm.sharded.gathered(model) if pm.sharded is not None else torch.no_grad():
        ones = all(torch.equal(w, torch.ones_like(w)) for w in norms)
        std = torch.cat([m.weight.flatten() for m in model.modules() if "Linear" in type(m).__name__]).std().item()
    return {"loss": loss, "cos": (model.cos - cpu.cos).abs().max().item(), "cos_dtype": str(model.cos.dtype),
            "norms_one": ones, "linear_std": std}


def worker(rank, world, root):
    import lightning_scale.models  # noqa: F401  (registers the litgpt adapter; workers skip Lightning's hook)

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {case: _run_case(rank, world, root, *case) for case in CASES}
    out["fresh"] = {mode: _fresh_on_meta(rank, world, mode) for mode in ("zero3", "tp2")}
    out["bad"] = _bad_inputs(root)
    return out


@pytest.fixture(scope="module")
def results(lit_dirs):
    return run_distributed(worker, 2, (lit_dirs["root"],), timeout=300, preload=PRELOAD)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_lit_model_pth_read_per_rank_equals_load_state_dict(lit_dirs, results, name, mode):
    ref = lit_dirs["refs"][name, not mode.startswith("tp")]  # the same sum of gradients as the layout
    for rank, res in enumerate(results):
        got = res[(name, mode)]
        diff = max(abs(a - b) for a, b in zip(got["losses"], ref))
        assert diff <= TOLERANCE.get(name, 1e-10), (rank, name, mode, got["losses"], ref)
        bound = 0.8 if mode == "ep2" else 0.62
        assert 0 < got["read"] < bound * got["file"], (rank, name, mode, got["read"] / got["file"])


@pytest.mark.timeout(400)
def test_bad_litgpt_directories_are_config_errors_naming_them(results):
    for res in results:
        bad = res["bad"]
        assert bad["no_weights"].startswith("ConfigError") and "lit_model.pth" in bad["no_weights"], bad
        assert bad["missing_tensor"].startswith("ConfigError"), bad
        assert "transformer.h.1.mlp.fc_2.weight" in bad["missing_tensor"], bad


@pytest.mark.timeout(400)
def test_fresh_litgpt_built_on_meta_is_initialized_as_on_the_cpu(results):
    """No weights to read (a fresh run): litgpt's GPT built on meta under ZeRO-3 and tp=2 gets its rotary cache
    recomputed (it was left uninitialized: a NaN loss), its RMSNorm weights at one and its linears drawn at litgpt's
    std (0.02, ``_init_weights``): the first loss is that of a random model (ln 64 = 4.16)."""
    import math

    for res in results:
        for mode, got in res["fresh"].items():
            assert got["cos"] == 0.0 and got["cos_dtype"] == "torch.float32", (mode, got)
            assert got["norms_one"], (mode, got)
            assert abs(got["linear_std"] - 0.02) < 0.002, (mode, got)
            assert abs(got["loss"] - math.log(VOCAB)) < 0.05, (mode, got)
