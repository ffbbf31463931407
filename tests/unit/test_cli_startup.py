"""The command-line tools start fast (issue 18): importing them pulls in neither Lightning nor triton, runpy
does not warn, and ``import lightning_scale`` still registers the strategies for Trainer users.

The start times are printed (``-s`` shows them), never asserted: the machine may be loaded.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

HEAVY = ("lightning", "lightning_fabric", "pytorch_lightning", "triton")


def _run(*args, timeout=120):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_cli_modules_do_not_import_lightning_or_triton():
    code = ("import sys, lightning_scale, lightning_scale.estimate, lightning_scale.zero.state_dict, "
            "lightning_scale.checkpoint.cli; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    proc, _ = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_hydra_config_imports_no_torch():
    """The Hydra schema (lightning_scale.hydra_config) takes GPTConfig from the torch-free models.gpt_config: composing
    and checking a config (``--cfg job``, a ConfigError for a misspelled key) does not wait for torch."""
    proc, _ = _run("-c", "import sys, lightning_scale.hydra_config; "
                         f"print(sorted(m for m in sys.modules if m.split('.')[0] in {('torch', *HEAVY)!r}))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.parametrize("cli", [["lightning_scale.estimate", "--params", "13e9", "--dp", "8"],
                                 ["lightning_scale.zero.state_dict", "--help"]])
def test_cli_start_time_and_no_runpy_warning(cli):
    proc, seconds = _run("-m", *cli)
    print(f"\npython -m {' '.join(cli)}: {seconds:.2f} s wall (target <= 2 s on a quiet machine)")
    assert proc.returncode == 0, proc.stderr
    assert "found in sys.modules" not in proc.stderr, proc.stderr
    assert proc.stdout.strip(), "printed nothing"


def test_state_dict_cli_bad_folder_is_one_error_line(tmp_path):
    """A folder that is not a checkpoint gives the CLI's own one-line error and exit code 2, no traceback, no runpy
    warning, before torch is imported (the ``lightning_scale.zero`` package is lazy too)."""
    proc, seconds = _run("-X", "importtime", "-m", "lightning_scale.zero.state_dict", str(tmp_path / "missing"),
                         str(tmp_path / "o.pt"))
    print(f"\npython -m lightning_scale.zero.state_dict MISSING OUT: {seconds:.2f} s wall (with -X importtime)")
    assert proc.returncode == 2, proc.stderr[-3000:]
    heavy = _imported(proc.stderr) & {"torch", *HEAVY}
    assert not heavy, f"imported {sorted(heavy)}"
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert errors == [f"error: {tmp_path / 'missing'} is not a sharded checkpoint folder"], errors


def test_state_dict_cli_help_imports_no_torch():
    proc, _ = _run("-X", "importtime", "-m", "lightning_scale.zero.state_dict", "--help")
    assert proc.returncode == 0 and "--strip-prefix" in proc.stdout, proc.stderr[-3000:]
    heavy = _imported(proc.stderr) & {"torch", *HEAVY}
    assert not heavy, f"imported {sorted(heavy)}"


def _shipped_gpt_configs():
    """Every model name the CLIs accept, the Hydra model group's YAMLs, and the bias / tied-head variants."""
    import pathlib

    import yaml

    from lightning_scale.models.gpt_config import MODELS, GPTConfig

    out = {name: make() for name, make in MODELS.items()}
    for path in sorted((pathlib.Path(__file__).parents[2] / "conf" / "model").glob("*.yaml")):
        out[f"conf/model/{path.name}"] = GPTConfig(**(yaml.safe_load(path.read_text()) or {}))
    out["gpt_tiny:bias=false"] = MODELS["gpt_tiny"](bias=False)
    out["gpt_tiny:tie_weights=true"] = MODELS["gpt_tiny"](tie_weights=True)
    out["gpt_tiny:mlp_ratio=3,n_layer=1"] = MODELS["gpt_tiny"](mlp_ratio=3, n_layer=1)
    return out


def test_a_model_name_means_one_model():
    """A name the CLIs accept (models.gpt_config.MODELS: the Python gpt_small() / gpt_tiny()) is not also the name of
    a different Hydra model (conf/model/NAME.yaml): ``model=NAME`` and ``--model NAME`` count the same parameters."""
    import pathlib

    import yaml

    from lightning_scale.estimate import _config_from_spec
    from lightning_scale.models.gpt_config import MODELS, GPTConfig

    for path in sorted((pathlib.Path(__file__).parents[2] / "conf" / "model").glob("*.yaml")):
        hydra = GPTConfig(**(yaml.safe_load(path.read_text()) or {}))
        if path.stem in MODELS:
            assert MODELS[path.stem]() == hydra, f"{path.stem}: the CLI's model is not conf/model/{path.name}"
        assert _config_from_spec(path.stem) == hydra, path.stem


def test_torch_free_gpt_counts_equal_the_real_model():
    """models.gpt_config counts parameters from the config alone; they equal estimate.model_counts of the built GPT
    (unique parameters, the largest unit, the persistent ones below a threshold) and the parameter names/sizes."""
    import torch

    from lightning_scale.estimate import model_counts
    from lightning_scale.models.gpt import GPT
    from lightning_scale.models.gpt_config import param_counts, parameter_numels

    for name, cfg in _shipped_gpt_configs().items():
        with torch.device("meta"):
            model = GPT(cfg)
        real = [(n, p.numel()) for n, p in model.named_parameters()]
        assert parameter_numels(cfg) == real, name
        for threshold in (0, 100, 10**5):
            assert param_counts(cfg, threshold) == model_counts(model, threshold), (name, threshold)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters()), name


def _imported(stderr: str):
    """Top-level package names from ``python -X importtime`` output."""
    return {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in stderr.splitlines() if ln.startswith("import time:")}


@pytest.mark.parametrize("args", [["--help"], ["inspect", "MISSING"], ["consolidate", "MISSING", "OUT.pt"]])
def test_checkpoint_cli_help_and_missing_folder_import_no_torch(tmp_path, args):
    """``--help`` and a folder that is not there answer before torch is imported (package and CLI imports are
    lazy); the missing folder gets folder.read_manifest's message and exit code 2."""
    args = [str(tmp_path / a) if a == "MISSING" else a for a in args]
    proc, seconds = _run("-X", "importtime", "-m", "lightning_scale.checkpoint", *args)
    print(f"\npython -m lightning_scale.checkpoint {' '.join(args)}: {seconds:.2f} s wall (with -X importtime)")
    heavy = _imported(proc.stderr) & {"torch", *HEAVY}
    assert not heavy, f"imported {sorted(heavy)}"
    assert "found in sys.modules" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if args == ["--help"]:
        assert proc.returncode == 0 and "inspect" in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 2
        errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
        assert errors == [f"error: {args[1]} is not a checkpoint folder"], errors


def _real_folders(root):
    """A layout-free (DCP) folder and a format-2 sharded folder, both saved through folder.commit."""
    import torch

    from lightning_scale.checkpoint import dcp_format, folder
    from lightning_scale.checkpoint.layout import tensor_piece

    dcp_path, sharded = str(root / "c.ckpt"), str(root / "s.ckpt")
    dcp_format.save(dcp_path, [tensor_piece("model/w", torch.zeros(4, 4))], {"loops": {"global_step": 1}},
                    meta={"step": 1, "layout": {"dp": 1, "stage": 2, "offload": False, "precision": None}})
    token = folder.new_token()
    staging = folder.staging_path(sharded, token)
    files = {"optim_rank0.pt": folder.write_file(staging, "optim_rank0.pt", {"optimizer_states": []}),
             "checkpoint.pt": folder.write_file(staging, "checkpoint.pt",
                                                {"state_dict": {"model/w": torch.ones(3, 2)}, "global_step": 7})}
    folder.commit(sharded, token, files, world_size=1)
    return {"dcp": dcp_path, "sharded": sharded}


@pytest.mark.parametrize("kind", ["dcp", "sharded"])
def test_checkpoint_cli_inspect_real_folder_imports_no_torch(tmp_path, kind):
    """``inspect`` of a real folder reads the summary.json written at save time: no torch, Lightning or triton (the
    manifest meta.pt is a torch.save pickle and DCP's .metadata pickles torch classes); it prints what reading the
    folder with torch prints. Its time is printed next to ``import torch`` alone (not asserted)."""
    import contextlib
    import io

    from lightning_scale.checkpoint import cli

    path = _real_folders(tmp_path)[kind]
    proc, seconds = _run("-X", "importtime", "-m", "lightning_scale.checkpoint", "inspect", path)
    assert proc.returncode == 0 and "model/w" in proc.stdout, proc.stderr[-3000:]
    heavy = _imported(proc.stderr) & {"torch", *HEAVY}
    assert not heavy, f"imported {sorted(heavy)}"
    expected = io.StringIO()
    with contextlib.redirect_stdout(expected):
        cli._print_inspect(cli._describe_with_torch(path))
    assert proc.stdout == expected.getvalue(), (proc.stdout, expected.getvalue())
    _, plain = _run("-m", "lightning_scale.checkpoint", "inspect", path)
    _, bare = _run("-c", "import torch")
    print(f"\ninspect {kind} DIR {plain:.2f} s wall (target <= 2 s on this machine); import torch alone {bare:.2f} s")


def test_import_lightning_scale_then_lightning_registers_strategies():
    """The lazy path: lightning_scale first (no Lightning yet), then Lightning; Trainer resolves the name."""
    code = "\n".join([
        "import sys, lightning_scale",
        "assert 'lightning' not in sys.modules",
        "import lightning.pytorch as pl",
        "from lightning.pytorch.strategies import StrategyRegistry",
        "t = pl.Trainer(strategy='zero2', accelerator='cpu', devices=1, logger=False, enable_progress_bar=False)",
        "print(type(t.strategy).__name__, t.strategy.config.zero.stage, 'zero3_offload' in StrategyRegistry)",
    ])
    proc, _ = _run("-c", code, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-3:] == ["Zero3DStrategy", "2", "True"], proc.stdout


def test_import_after_lightning_registers_strategies():
    """The eager path, in this process: Lightning is imported (conftest / other tests), then the package."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_scale

    assert "zero1" in StrategyRegistry and StrategyRegistry["zero1"]["init_params"] == {"stage": 1}
    trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, lightning_scale.Zero3DStrategy)


@pytest.mark.parametrize("spec", ["gpt_tiny", "gpt_small", "gpt_small:n_layer=48,d_model=1600,tie_weights=true",
                                  "gpt_mini", "gpt_smoke:n_layer=3"])
def test_estimate_model_imports_no_torch_and_prints_the_real_models_table(spec):
    """``estimate --model`` counts from the config (no torch) and prints what counting the built meta model does."""
    import io
    from contextlib import redirect_stdout

    from lightning_scale import estimate as E

    proc, seconds = _run("-X", "importtime", "-m", "lightning_scale.estimate", "--model", spec, "--dp", "8")
    print(f"\npython -m lightning_scale.estimate --model {spec} --dp 8: {seconds:.2f} s wall (with -X importtime)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    heavy = _imported(proc.stderr) & {"torch", *HEAVY}
    assert not heavy, f"imported {sorted(heavy)}"
    counts = E.model_counts(E._model_from_spec(spec))  # the built model (torch, meta device)
    units = dict(largest_unit_params=counts["largest_unit_params"], root_params=counts["root_params"])
    rows = E.estimate_all(counts["params"], dp=8, **units)
    expected = io.StringIO()
    with redirect_stdout(expected):
        print(E.describe(E.estimate(counts["params"], dp=8, stage=3, **units), counts["largest_unit_params"]))
        print(E.format_table(rows, selected=(3, "none")))
    got = proc.stdout.splitlines()
    assert got[0].endswith(expected.getvalue().splitlines()[0]), (got[0], expected.getvalue())
    assert got[1:1 + len(rows) + 2] == expected.getvalue().splitlines()[1:], proc.stdout
