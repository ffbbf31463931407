"""The documented first hour runs (issue 18): docs/first_hour.md's commands, README.md's Python snippets and
estimate commands, each logger writing its files, and plots drawn from the logged values.

One main-job run (the doc's smoke command, 2 ranks) is shared by the tests of this module. Not run: pip
installs, the full 2-minute job, the test suite itself and the benchmarks (listed in SKIP).
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import sys

import pytest
from omegaconf import OmegaConf

from lightning_scale.testing import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "first_hour.md")
README = os.path.join(ROOT, "README.md")
SKIP = ("pip install", "python -m pytest", "python bench/")  # and the full job: `python examples/train.py` alone
# Names README's "Plain torch.distributed" fragment assumes: a model, its batches, one process group.
PRELUDE = """
import contextlib, os, tempfile, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
batches, accum, loss_fn = [(torch.randn(3, 4), torch.randn(3, 2))] * 2, 2, torch.nn.functional.mse_loss
"""


def _blocks(path, lang):
    return re.findall(rf"```{lang}\n(.*?)```", open(path).read(), re.S)


def _commands(path):
    lines = [ln.split("  #")[0].strip() for b in _blocks(path, "bash") for ln in b.splitlines()]
    return [ln for ln in lines if ln and ln != "python examples/train.py" and not any(s in ln for s in SKIP)]


@pytest.fixture(scope="module")
def first_hour(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("first_hour"))
    (train,) = [c for c in _commands(DOC) if c.startswith("python examples/train.py")]
    cmd = [sys.executable if a == "python" else a for a in shlex.split(train.replace("runs/first_hour", run_dir))]
    proc = run_script(cmd, timeout=600, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir, proc.stdout


def _csv_rows(run_dir):
    with open(os.path.join(run_dir, "logs", "version_0", "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_main_job_prints_where_everything_is(first_hour):
    run_dir, out = first_hour
    assert re.search(r"final val_loss \d+\.\d+ \| train tokens/s [\d,]+ \| steps 20 \| checkpoint .*last\.ckpt",
                     out), out
    assert f"logs {run_dir}/logs/version_0" in out, out
    assert f"plots {run_dir}/plots/loss.png" in out, out
    assert re.search(r"precision\s+32-true", out) and re.search(r"attention\s+dense", out), out


def test_validation_rows_are_not_duplicated(first_hour):
    steps = [r["step"] for r in _csv_rows(first_hour[0]) if r.get("val_loss")]
    assert steps and len(steps) == len(set(steps)), steps  # one row per validation (smoke: steps 9, 19)


def test_plot_command_draws_the_logged_values(first_hour):
    run_dir, _ = first_hour
    (plot,) = [c for c in _commands(DOC) if "lightning_scale.plot" in c]
    proc = run_script([sys.executable, *shlex.split(plot.replace("runs/first_hour", run_dir))[1:]], timeout=120)
    assert proc.returncode == 0, proc.stderr
    from lightning_scale.plot import plot_run

    drawn = plot_run(run_dir)
    names = {os.path.basename(p) for p in drawn}
    assert {"loss.png", "throughput.png", "memory.png"} <= names, names  # fp32: no loss-scale figure
    assert all(os.path.getsize(p) > 5000 for p in drawn), {p: os.path.getsize(p) for p in drawn}
    rows = _csv_rows(run_dir)
    for png, curves in drawn.items():
        for name, (steps, values) in curves.items():
            logged = [(float(r["step"]), float(r[name])) for r in rows if r.get(name)]
            assert list(zip(steps, values)) == logged, (png, name)
    memory = drawn[os.path.join(run_dir, "plots", "memory.png")]
    assert sorted(memory) == ["memory/rank0_MiB", "memory/rank1_MiB"]  # every rank, gathered to rank 0


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_logger_option_writes_its_files(tmp_path, name):
    pytest.importorskip(name)
    from hydra.utils import instantiate

    cfg = OmegaConf.load(os.path.join(ROOT, "conf", "logger", f"{name}.yaml"))
    cfg.save_dir = str(tmp_path)  # Hydra fills ${hydra:runtime.output_dir} in a real run
    logger = instantiate(cfg)
    logged = {"train_loss": [(s, 5.0 - 0.25 * s) for s in range(0, 8)]}
    for step, value in logged["train_loss"]:
        logger.log_metrics({"train_loss": value}, step=step)
    logger.finalize("success")
    if name == "wandb":
        import wandb

        wandb.finish()
        runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
        assert runs and any(f.endswith(".wandb") for f in os.listdir(tmp_path / "wandb" / runs[0])), runs
        return
    from lightning_scale.plot import plot_run, read_run

    assert read_run(str(tmp_path))["train_loss"] == [(float(s), v) for s, v in logged["train_loss"]]
    drawn = plot_run(str(tmp_path))
    (curves,) = drawn.values()
    assert curves["train_loss"] == ([float(s) for s, _ in logged["train_loss"]], [v for _, v in logged["train_loss"]])


def test_estimate_commands_in_the_docs_run():
    commands = [c for path in (README, DOC) for c in _commands(path)
                if c.startswith("python -m lightning_scale.estimate")]
    assert len(commands) >= 3, commands
    for command in commands:
        proc = run_script([sys.executable, *shlex.split(command)[1:]], timeout=120)
        assert proc.returncode == 0 and "| * |" in proc.stdout, (command, proc.stderr)


def test_readme_python_snippets_run():
    """README's Python blocks, in order, in one process (later blocks use the names of earlier ones)."""
    code = PRELUDE + "\n".join(_blocks(README, "python"))
    proc = run_script([sys.executable, "-c", code], timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
