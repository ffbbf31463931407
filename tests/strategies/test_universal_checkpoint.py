"""Zero3DStrategy(checkpoint_format="universal"): save on one layout, resume on another (issue 13, build 1-2).

One saving run (zero.stage=2, dp=2, 6 steps, a checkpoint after every 2-step epoch) is shared by the tests: its
step-2 checkpoint is resumed on the same layout (bit-identical losses), on dp=1 and at stage 3 dp=2; the stage-3
run's own step-4 checkpoint is resumed at stage 1 dp=2. Every resumed loss is compared with the uninterrupted
run's (float32; 1e-5 where the dp size changes the reduction order). The same step-2 checkpoint resumes at tp=2 and
at pp=2, whose step-4 checkpoint resumes on 1 rank. 8 Trainer launches in all (+1 for the slow async test).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightning_scale import ConfigError, Zero3DStrategy
from lightning_scale.checkpoint import dcp_format
from lightning_scale.testing import run_script
from test_zero_trainer import script_ranks

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_universal.py")
ARGS = ["--steps", "6", "--epoch-batches", "2", "--no-predict", "--option", "checkpoint_format=universal"]
TOL = 1e-5


def fit(tmp, name, *args, timeout=240, env=None):
    out = tmp / f"{name}.json"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), *ARGS, *args], timeout=timeout, cwd=tmp,
                      env=None if env is None else dict(os.environ, **env), ranks=script_ranks(args))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted zero.stage=2 dp=2 run and its checkpoint folder (steps 2, 4, 6)."""
    tmp = tmp_path_factory.mktemp("universal")
    run = fit(tmp, "full", "--devices", "2", "--option", "stage=2", "--ckpt-dir", str(tmp / "ckpt"))
    assert len(run["losses"]) == 6
    return tmp, run


def _close(resumed, expected, tol=TOL):
    assert len(resumed) == len(expected), (resumed, expected)
    assert max(abs(a - b) for a, b in zip(resumed, expected)) <= tol, (resumed, expected)


def test_saved_folder_is_the_layout_free_format(saved):
    tmp, _ = saved
    path = tmp / "ckpt" / "epoch=0-step=2.ckpt"
    assert dcp_format.detect_format(str(path)) == "dcp"
    _, meta, md = dcp_format.open_checkpoint(str(path))
    assert meta["step"] == 2 and meta["layout"]["stage"] == 2 and meta["layout"]["dp"] == 2
    keys = set(md.state_dict_metadata)
    # original names and shapes, whole-model optimizer state, Lightning's loop state as an extra
    assert tuple(md.state_dict_metadata["model/model.blocks.0.attn.qkv.weight"].size) == (96, 32)
    assert {"optim/model.wte.weight/exp_avg", "optim/model.wte.weight/exp_avg_sq",
            "optim/model.wte.weight/step", "extra/lightning", "extra/engines"} <= keys
    assert not any(k.startswith("master/") for k in keys)  # 32-true: the masters are the weights


def test_same_layout_resume_is_bit_identical(saved):
    tmp, full = saved
    resumed = fit(tmp, "same", "--devices", "2", "--option", "stage=2",
                  "--resume", str(tmp / "ckpt" / "epoch=0-step=2.ckpt"))
    assert resumed["losses"] == full["losses"][2:]


def test_reshard_dp2_to_dp1(saved):
    tmp, full = saved
    resumed = fit(tmp, "dp1", "--devices", "1", "--option", "stage=2",
                  "--resume", str(tmp / "ckpt" / "epoch=0-step=2.ckpt"))
    assert resumed["world"] == 1
    _close(resumed["losses"], full["losses"][2:])


def test_reshard_stage2_to_stage3_and_stage3_to_stage1(saved):
    tmp, full = saved
    s3 = fit(tmp, "stage3", "--devices", "2", "--option", "stage=3", "--ckpt-dir", str(tmp / "ckpt3"),
             "--resume", str(tmp / "ckpt" / "epoch=0-step=2.ckpt"))
    assert s3["engines"] == ["Stage3Optimizer"]
    _close(s3["losses"], full["losses"][2:])
    step4 = tmp / "ckpt3" / "epoch=1-step=4.ckpt"
    assert dcp_format.open_checkpoint(str(step4))[1]["layout"]["stage"] == 3
    s1 = fit(tmp, "stage1", "--devices", "2", "--option", "stage=1", "--resume", str(step4))
    assert s1["engines"] == ["ZeroOptimizer"]
    _close(s1["losses"], full["losses"][4:])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_reshard_across_tp_and_pp(saved, layout):
    """dp=2's step-2 checkpoint resumed at tp=2 (dp=1, tp slices of every matrix, vocabulary-parallel embedding); and
    at pp=2 (two stages, 2 micro-batches), whose own step-4 checkpoint is then resumed on 1 rank (pp=2 -> 1)."""
    tmp, full = saved
    step2 = str(tmp / "ckpt" / "epoch=0-step=2.ckpt")
    if layout == "tp2":
        run = fit(tmp, "tp2", "--devices", "2", "--option", "stage=1", "--option", "tp=2", "--resume", step2)
        _close(run["losses"], full["losses"][2:])
        return
    run = fit(tmp, "pp2", "--devices", "2", "--option", "stage=1", "--option", "pp=2", "--option", "microbatches=2",
              "--ckpt-dir", str(tmp / "ckpt_pp2"), "--resume", step2)
    _close(run["losses"], full["losses"][2:])
    step4 = tmp / "ckpt_pp2" / "epoch=1-step=4.ckpt"
    assert dcp_format.open_checkpoint(str(step4))[1]["layout"]["pp"] == 2
    one = fit(tmp, "pp2_to_1", "--devices", "1", "--option", "stage=1", "--resume", str(step4))
    assert one["world"] == 1
    _close(one["losses"], full["losses"][4:])


def _val_loss(run):
    (metrics,) = run["val"]
    return metrics["val_loss"]


def test_validate_from_a_fresh_process_on_any_layout(saved):
    """trainer.validate(ckpt_path=...) with no fit before it (no engines: the weights go straight into what each rank
    holds): dp=2's step-6 checkpoint validated under ZeRO-3 (into the parameter shards), tp=2 (slices) and pp=2
    (stages) gives the val loss of the layouts that hold whole parameters (dp=2 stage 2 / 1 rank: both see the same
    16 rows). Before, ZeRO-3 / tp / pp raised a ConfigError here."""
    tmp, _ = saved
    step6 = str(tmp / "ckpt" / "epoch=2-step=6.ckpt")

    def validate(name, devices, *options, ckpt=step6):
        opts = [a for o in options for a in ("--option", o)]
        return fit(tmp, name, "--devices", str(devices), *opts, "--validate-ckpt", ckpt)

    dp2 = _val_loss(validate("val_dp2", 2, "stage=2"))
    one = _val_loss(validate("val_one", 1, "stage=2"))
    z3 = validate("val_z3", 2, "stage=3")
    assert z3["sharded"] and abs(_val_loss(z3) - dp2) <= TOL, (_val_loss(z3), dp2)
    assert abs(_val_loss(validate("val_tp2", 2, "stage=1", "tp=2")) - one) <= TOL
    assert abs(_val_loss(validate("val_z3_tp2", 2, "stage=3", "tp=2")) - one) <= TOL  # shards of tp slices
    assert abs(_val_loss(validate("val_pp2", 2, "stage=1", "pp=2", "microbatches=2")) - one) <= TOL
    fresh = _val_loss(validate("val_fresh", 1, "stage=2", ckpt="none"))
    assert abs(fresh - one) > 100 * TOL, (fresh, one)  # the checkpoint moves the val loss: the checks above can fail


def _tensors(path, tmp):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / (os.path.basename(os.path.dirname(path)) + os.path.basename(path) + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(str(out), weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["True", "overlap"])
def test_async_save_trains_on_during_the_write_and_writes_the_sync_state(saved, mode):
    """checkpoint_async=True / "overlap" (the engines' state copied by the writing thread while the next step
    computes, that step's optimizer step waiting for the copy): every write sleeps 1 s first (LS_TEST_ASYNC_PROBE in
    fit_universal.py). The step after each save starts before its write ends; the losses, and every tensor of the
    three checkpoints, equal the synchronous run's (rank 1's data file byte for byte; rank 0's also holds
    ModelCheckpoint's own dirpath)."""
    tmp, full = saved
    probe = tmp / f"probe_{mode}"
    run = fit(tmp, f"async_{mode}", "--devices", "2", "--option", "stage=2", "--option", f"checkpoint_async={mode}",
              "--ckpt-dir", str(tmp / f"ckpt_async_{mode}"), env={"LS_TEST_ASYNC_PROBE": str(probe)})
    assert run["losses"] == full["losses"]
    record = json.loads((tmp / f"probe_{mode}.0.json").read_text())
    writes = {w["path"]: w for w in record["writes"]}
    names = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"]
    assert sorted(writes) == names and {w["thread"] for w in writes.values()} == {"lightning_scale-async-save"}
    for name in names[:2]:
        step = int(name.split("step=")[1].split(".")[0])
        after = min(b["start"] for b in record["batches"] if b["step"] >= step)  # the next step's first batch
        print(f"{name}: write {writes[name]['end'] - writes[name]['start']:.2f} s; the next step started "
              f"{writes[name]['end'] - after:.2f} s before it ended")
        assert after < writes[name]["end"]
    for name in names:
        sync, asyn = tmp / "ckpt" / name, tmp / f"ckpt_async_{mode}" / name
        assert (sync / "__1_0.distcp").read_bytes() == (asyn / "__1_0.distcp").read_bytes()
        a, b = _tensors(sync, tmp), _tensors(asyn, tmp)
        keys = sorted(k for k, v in a.items() if torch.is_tensor(v))
        assert keys and keys == sorted(k for k, v in b.items() if torch.is_tensor(v))
        assert all(torch.equal(a[k], b[k]) for k in keys)
        assert a["extra/lightning"]["global_step"] == b["extra/lightning"]["global_step"]
    assert not [n for n in os.listdir(tmp / f"ckpt_async_{mode}") if n.startswith(".")]  # no staging left behind


def test_bad_checkpoint_format_is_named():
    with pytest.raises(ConfigError, match="checkpoint_format='dcp'"):
        Zero3DStrategy(checkpoint_format="dcp")
    assert Zero3DStrategy(stage=1, checkpoint_format="universal").restore_checkpoint_after_setup
    assert not Zero3DStrategy(stage=1).restore_checkpoint_after_setup
    with pytest.raises(ConfigError, match="checkpoint_async=True needs checkpoint_format='universal'"):
        Zero3DStrategy(stage=2, checkpoint_async=True)
    with pytest.raises(ConfigError, match="checkpoint_async='overlap' needs checkpoint_format='universal'"):
        Zero3DStrategy(stage=2, checkpoint_async="overlap")
    for bad in ("yes", 1, 0.5):
        with pytest.raises(ConfigError, match=r"checkpoint_async=.* must be True, False or 'overlap'"):
            Zero3DStrategy(stage=2, checkpoint_format="universal", checkpoint_async=bad)
    assert Zero3DStrategy(stage=2, checkpoint_format="universal", checkpoint_async="overlap").config.checkpoint_async


def test_autotune_defaults_to_the_layout_free_format_and_restores_after_its_pick():
    """autotune picks the layout in setup, at every start: its checkpoints default to 'universal' (a format the user
    set is kept), and the checkpoint is restored after setup whatever the pick. Lightning asks
    restore_checkpoint_after_setup before setup and again after: an answer that flipped in between (a ZeRO-2 pick with
    the sharded format) made it restore at neither point, so the resumed run silently trained from scratch."""
    from lightning_scale.config import ParallelConfig, ZeroConfig

    assert Zero3DStrategy(autotune=True).config.checkpoint_format == "universal"
    assert Zero3DStrategy(stage=2, autotune=True).config.checkpoint_format == "universal"
    assert Zero3DStrategy(config=ParallelConfig(zero=ZeroConfig(stage=2)), autotune=True).config.checkpoint_format \
        == "universal"
    kept = Zero3DStrategy(stage=2, checkpoint_format="sharded", autotune=True)
    assert kept.config.checkpoint_format == "sharded"
    assert kept.restore_checkpoint_after_setup  # before the pick
    kept.autotune_result = {"settings": {"stage": 2}}  # what setup sets once the pick is applied
    assert kept.restore_checkpoint_after_setup  # and after it: the same answer
    assert Zero3DStrategy(stage=2).config.checkpoint_format == "sharded"  # no autotune: the default is unchanged


@pytest.mark.parametrize("layout", [["stage=3"], ["stage=1", "tp=2"]], ids=["zero3", "tp2"])
def test_eager_checkpoint_resumes_compiled_on_another_layout(saved, layout):
    """The eager dp=2 ZeRO-2 step-2 checkpoint resumed by a compiled run (every block compiled, aot_eager) at ZeRO-3 and
    at tp=2: the uninterrupted eager run's losses (1e-5); the compiled units keep the eager names, so nothing is
    renamed or lost on the way (issue 17 item 5 with issue 13's format)."""
    tmp, full = saved
    opts = [a for o in [*layout, "compile={'backend': 'aot_eager'}"] for a in ("--option", o)]
    run = fit(tmp, "compiled_" + "_".join(layout), "--devices", "2", *opts,
              "--resume", str(tmp / "ckpt" / "epoch=0-step=2.ckpt"))
    assert run["compile"]["step1"]["graphs"] > 0 and run["compile"]["end"]["eager_fallbacks"] == 0, run["compile"]
    _close(run["losses"], full["losses"][2:])
