"""Zero3DStrategy(autotune=...) through the Trainer (issue 17 item 4; docs/tune.md "autotune=True"): inside the
launched ranks, before parallelize(), the layouts of the world size are pruned by the memory plan and the survivors
timed on the real model and the first real batch; the winner is applied and training goes on."""

import json
import math
import os
import sys

import pytest

from lightning_scale.testing import run_script

SCRIPT = os.path.join(os.path.dirname(__file__), "fit_autotune.py")
# the bench GPT's shape (vocab 8192, d 256, 4 layers, seq 128): with 4 sequences per rank and a budget of 88e6
# bytes per device only ZeRO-3 + offload (optimizer / all, with full recompute) fits the memory plan
SHAPE = ["--layers", "4", "--vocab", "8192", "--seq-len", "128", "--batch", "4"]
ONLY_Z3_OFFLOAD = "autotune={'memory': 88e6, 'tp': 1, 'pp': 1, 'budget_s': 120}"


def _fit(tmp_path, name, *args, expect_ok=True, timeout=300, shape=SHAPE):
    out = tmp_path / f"{name}.json"
    proc = run_script([sys.executable, SCRIPT, "--out", str(out), *shape, *args], timeout=timeout, cwd=tmp_path,
                      ranks=2)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return json.loads(out.read_text()), proc
    return out, proc


@pytest.mark.slow  # two Trainer runs of the bench GPT: ~70 s on the loaded 2-core box
def test_autotune_picks_stage3_offload_and_trains_like_the_hand_set_layout(tmp_path):
    tuned, proc = _fit(tmp_path, "tuned", "--option", ONLY_Z3_OFFLOAD)
    result = tuned["autotune"]
    s = result["settings"]
    assert s["stage"] == 3 and s["offload"] in ("optimizer", "params", "all"), result["winner"]
    assert tuned["layout"]["stage"] == 3 and tuned["layout"]["ac"] == s["activation_checkpointing"]  # applied
    assert tuned["layout"]["offload"] != ["none", "none"]
    assert all(k.startswith("z3/") and "/none/" not in k for k, _ in [(t["key"], 0) for t in result["table"]])
    assert any(k.startswith("z0/") and "> budget" in why for k, why in result["rejected"])
    assert "[lightning_scale autotune] winner: strategy.autotune=null strategy=zero3d strategy.stage=3" in proc.stdout
    assert proc.stdout.count("| 1 | z3/") == 1  # the ranked table, rank 0 only
    # the in-process probe's live bytes vs the memory plan on one memory (a CPU: the offloaded states counted once)
    rel = abs(result["predicted_all_bytes"] - result["measured_bytes"]) / result["measured_bytes"]
    assert rel < 0.15, (result["winner"], result["predicted_all_bytes"], result["measured_bytes"])
    hand_opts = [f"{k}={v!r}" for k, v in s.items() if k != "dp"]
    hand, _ = _fit(tmp_path, "hand", *[a for o in hand_opts for a in ("--option", o)])
    assert hand["autotune"] is None and hand["layout"] == tuned["layout"]
    assert len(tuned["losses"]) == len(hand["losses"]) == 4
    diff = max(abs(a - b) for a, b in zip(tuned["losses"], hand["losses"]))
    assert diff < 1e-5, (tuned["losses"], hand["losses"])


def test_autotune_nothing_fits_is_a_config_error_on_every_rank_before_training(tmp_path):
    out, proc = _fit(tmp_path, "nofit", "--option", "autotune={'memory': '1MiB'}", expect_ok=False, timeout=240)
    assert proc.returncode != 0 and not out.exists()  # no training step ran (rank 0 writes after fit)
    for rank in (0, 1):
        err = json.loads((tmp_path / f"nofit.json.rank{rank}").read_text())["error"]
        assert "no layout fits autotune.memory=1.0 MiB per device" in err, err
        assert "stage 3 offload=all dp2 tp1 pp1: predicted" in err and "stage 0 offload=none dp1 tp2 pp1" in err
    assert "measuring" not in proc.stdout  # pruned before any probe


@pytest.mark.slow  # two Trainer runs of the small GPT (the bench GPT's bf16 autocast steps took 67 s on this CPU)
def test_autotune_tp_winner_at_bf16_trains_like_the_hand_set_layout(tmp_path):
    """The winner's split differs from the topology setup_environment built (dp2 -> dp1 x tp2): the strategy goes on
    with the probe's topology (the sampler splits over dp=1); the probes ran at the Trainer's bf16-mixed."""
    auto = "autotune={'tp': 2, 'stages': [1, 2], 'offloads': ['none'], 'ac': ['none'], 'buckets': [25]}"
    tuned, _ = _fit(tmp_path, "tuned", "--precision", "bf16-mixed", "--option", auto, shape=SMALL)
    result = tuned["autotune"]
    assert result["precision"] == "bf16-mixed" and result["settings"]["tp"] == 2, result["winner"]
    assert tuned["layout"]["dp"] == 1 and tuned["layout"]["tp"] == 2
    hand_opts = [f"{k}={v!r}" for k, v in result["settings"].items() if k != "dp"]
    hand, _ = _fit(tmp_path, "hand", "--precision", "bf16-mixed", *[a for o in hand_opts for a in ("--option", o)],
                   shape=SMALL)
    assert hand["layout"] == tuned["layout"] and len(hand["losses"]) == len(tuned["losses"]) == 4
    diff = max(abs(a - b) for a, b in zip(tuned["losses"], hand["losses"]))
    assert diff < 1e-5, (tuned["losses"], hand["losses"])


@pytest.mark.slow  # one Trainer run with 3 probes of a Hugging Face Llama: ~60 s here
def test_autotune_takes_a_hugging_face_llama_module(tmp_path):
    """A LightningModule whose configure_model builds transformers' LlamaForCausalLM (no package GPT): the memory plan
    counts it (heads / key-value heads / layers from its config, decoder layers as units), the probes run its own
    training_step, the winner is applied and training goes on."""
    auto = ("autotune={'stages': [2, 3], 'offloads': ['none', 'all'], 'tp': [1, 2], 'pp': 1, 'ac': ['none'], "
            "'buckets': [25], 'max_probes': 3, 'budget_s': 200}")
    tuned, proc = _fit(tmp_path, "llama", "--llama", "--vocab", "2048", "--d-model", "128", "--seq-len", "32",
                       "--option", auto, timeout=400)
    result = tuned["autotune"]
    assert len(result["table"]) == 3, result["table"]
    s = result["settings"]
    assert tuned["layout"]["stage"] == s["stage"] and tuned["layout"]["tp"] == s["tp"], (result["winner"], tuned)
    assert len(tuned["losses"]) == 4 and all(math.isfinite(v) for v in tuned["losses"]), tuned["losses"]
    for row in result["table"]:
        print(f"{row['key']}: predicted one memory {row['predicted_all_bytes'] / 2**20:.1f} MiB, measured "
              f"{row['measured_bytes'] / 2**20:.1f} MiB, {row['tokens_per_s']:,.0f} tokens/s")


@pytest.mark.slow  # two Trainer runs of a Hugging Face Mixtral, 2 probes: ~40 s here
def test_autotune_searches_expert_parallelism_over_the_data_ranks(tmp_path):
    """A Mixtral LightningModule (4 experts): at tp = 1 the search tries ep=1 (every expert on both ranks) and ep=2
    (2 experts whole per rank, routes exchanged); the probe's tokens/s counts both data ranks at either; the winner is
    applied (the sampler splits over dp x ep = 2 either way) and trains like the layout set by hand."""
    auto = "autotune={'stages': [2], 'offloads': ['none'], 'tp': 1, 'pp': 1, 'ac': ['none'], 'buckets': [25]}"
    shape = ["--mixtral", "--vocab", "512", "--d-model", "64", "--seq-len", "16", "--batch", "4", "--layers", "2"]
    tuned, proc = _fit(tmp_path, "moe", "--option", auto, shape=shape)
    result = tuned["autotune"]
    keys = sorted(row["key"] for row in result["table"])
    assert len(keys) == 2 and sum("ep2" in k for k in keys) == 1, keys
    s = result["settings"]
    assert tuned["layout"]["ep"] == s["ep"] and tuned["layout"]["dp"] * s["ep"] == 2, (result["winner"], tuned)
    if s["ep"] == 2:
        assert "strategy.ep=2" in result["overrides"], result["overrides"]
    hand_opts = [f"{k}={v!r}" for k, v in s.items() if k != "dp"]
    hand, _ = _fit(tmp_path, "hand", *[a for o in hand_opts for a in ("--option", o)], shape=shape)
    assert hand["layout"] == tuned["layout"] and len(hand["losses"]) == len(tuned["losses"]) == 4
    diff = max(abs(a - b) for a, b in zip(tuned["losses"], hand["losses"]))
    assert diff < 1e-5, (tuned["losses"], hand["losses"])
    for row in result["table"]:
        print(f"{row['key']}: {row['tokens_per_s']:,.0f} tokens/s")
    # ep set by the user (it was refused with autotune before): kept, the rest searched, the winner trains at ep=2
    fixed, proc = _fit(tmp_path, "fixed", "--option", "ep=2", "--option", auto, shape=shape)
    assert [row["key"] for row in fixed["autotune"]["table"]] == [k for k in keys if "ep2" in k]
    assert fixed["layout"]["ep"] == 2 and fixed["layout"]["dp"] == 1, fixed["layout"]
    assert "strategy.ep=2" in fixed["autotune"]["overrides"] and len(fixed["losses"]) == 4


SMALL = ["--layers", "2", "--vocab", "512", "--d-model", "64", "--seq-len", "16", "--batch", "4"]
TWO_STAGES = "'stages': [2, 3], 'offloads': ['none'], 'tp': 1, 'pp': 1, 'ac': ['none'], 'buckets': [25]"


@pytest.mark.slow  # one Trainer run, 2 probes: ~30 s here
def test_autotune_a_probe_failing_on_one_rank_is_agreed_at_once_and_the_search_goes_on(tmp_path):
    """The first probe (z2, best by the prior) raises on rank 1 only, 2 s into its first step, while rank 0 is inside
    the step's gradient collective: both ranks record it as failed with rank 1's error right away (the probe groups'
    timeout is 900 s, the default group's 1800 s: neither is waited for), z3 is measured, wins and trains."""
    auto = f"autotune={{{TWO_STAGES}, 'probe_timeout_s': 900}}"
    tuned, proc = _fit(tmp_path, "fail1", "--fail-rank", "1", "--option", auto, shape=SMALL, timeout=300)
    result = tuned["autotune"]
    rows = {r["key"].split("/")[0]: r for r in result["table"]}
    assert set(rows) == {"z2", "z3"}, result["table"]
    err = rows["z2"]["error"]
    assert err.startswith("rank 1: RuntimeError: injected failure on rank 1"), err
    assert rows["z2"]["probe_s"] < 60, rows["z2"]  # the failure agreed in seconds, not at a timeout
    assert "tokens_per_s" in rows["z3"] and result["winner"].startswith("z3/"), result
    assert tuned["layout"]["stage"] == 3 and len(tuned["losses"]) == 4
    assert all(math.isfinite(v) for v in tuned["losses"]), tuned["losses"]
    assert "| - | z2/none/dp2tp1pp1/mb4x1/b25/ac-none/eager | failed: rank 1: RuntimeError: injected" in proc.stdout
    print(f"failed probe {rows['z2']['probe_s']:.1f} s, search {result['seconds']:.1f} s")


@pytest.mark.slow  # one Trainer run, 2 failing probes: ~50 s here (load ~19)
def test_autotune_every_probe_failing_is_a_config_error_listing_why(tmp_path):
    auto = f"autotune={{{TWO_STAGES}}}"
    out, proc = _fit(tmp_path, "failall", "--fail-rank", "1", "--fail-probes", "all", "--option", auto, shape=SMALL,
                     expect_ok=False, timeout=240)
    assert proc.returncode != 0 and not out.exists()
    for rank in (0, 1):
        err = json.loads((tmp_path / f"failall.json.rank{rank}").read_text())["error"]
        assert "autotune: every probed layout failed: z2/none/dp2tp1pp1" in err, err
        assert err.count("rank 1: RuntimeError: injected failure on rank 1") == 2, err


@pytest.mark.slow  # one Trainer run, 2 probes, one compiling (aot_eager): ~60 s here
def test_autotune_searches_compile_in_process_and_reports_compile_seconds_apart(tmp_path):
    """``autotune={'compile': [False, {'backend': 'aot_eager'}]}``: the eager and the compiled layout are both probed
    in the launched ranks; the compiled one compiled its units (Dynamo graphs > 0, none for the eager probe) and its
    warm-up's compile seconds are reported apart from its steady tokens/s; the winner trains."""
    auto = ("autotune={'compile': [False, {'backend': 'aot_eager'}], 'stages': [2], 'offloads': ['none'], 'tp': 1, "
            "'pp': 1, 'ac': ['none'], 'buckets': [25], 'warmup': 1, 'steps': 2}")
    tuned, proc = _fit(tmp_path, "compile", "--option", auto, shape=SMALL, timeout=400)
    result = tuned["autotune"]
    rows = {r["key"].rsplit("/", 1)[1]: r for r in result["table"]}
    assert set(rows) == {"eager", "compile"}, result["table"]
    eager, compiled = rows["eager"], rows["compile"]
    assert eager["graphs"] == 0 and eager["compiled_units"] == 0, eager
    assert compiled["graphs"] >= 1 and compiled["compiled_units"] >= 1, compiled
    # compile seconds are apart from the steady step: the compiling warm-up's excess over the median step (not a
    # wall-time bound: a loaded CI machine compiled these graphs in 0.98 s once)
    assert compiled["compile_s"] > compiled["step_s"] > 0, compiled
    assert compiled["tokens_per_s"] > 0 and eager["tokens_per_s"] > 0
    assert compiled["warmup"] == 2 and eager["warmup"] == 1  # a compiled probe warms up past its recompile
    s = result["settings"]
    assert s["compile"] in (False, {"backend": "aot_eager"}), s
    assert len(tuned["losses"]) == 4 and all(math.isfinite(v) for v in tuned["losses"]), tuned["losses"]
    print(f"eager {eager['tokens_per_s']:,.0f} tokens/s; compiled {compiled['tokens_per_s']:,.0f} tokens/s, compile "
          f"{compiled['compile_s']:.1f} s, {compiled['graphs']:.0f} graphs; winner {result['winner']}")


def _long_budget(layers: int, seq_len: int, vocab: int, d_model: int) -> float:
    """A budget per device between the smallest layout at sp=2 and the smallest with whole sequences (every relief
    rung climbed): only Ulysses fits. The plan is the one autotune makes (plan_rows, 1 sequence per rank)."""
    import torch

    from lightning_scale.models.gpt import GPT, gpt_tiny
    from lightning_scale.strategies.autotune import options, plan_rows

    cfg = gpt_tiny(n_layer=layers, vocab_size=vocab, seq_len=seq_len, d_model=d_model)
    with torch.device("meta"):
        model = GPT(cfg)
    rows = plan_rows(model, cfg, options({"sp": [1, 2], "tp": 1, "pp": 1}), {}, 2, 1, "32-true", 0.0, 1)
    whole = min(r.predicted for r in rows if r.candidate.sp == 1 and r.predicted)
    split = min(r.predicted for r in rows if r.candidate.sp == 2 and r.predicted)
    assert split < whole * 0.95, (split, whole)
    return (split + whole) / 2


@pytest.mark.slow  # two Trainer runs at 2048 positions: ~40 s on the quiet 2-core box
def test_autotune_long_sequence_goes_to_ulysses_and_trains_like_the_hand_set_layout(tmp_path):
    """No layout with whole sequences per rank fits (relief ladder included): autotune searches sp too, picks an sp=2
    layout (dp 2 -> 1: both ranks read the same batch, each keeps half of every sequence), applies it, and the run
    equals the same layout set by hand."""
    long = ["--layers", "2", "--vocab", "4096", "--seq-len", "2048", "--d-model", "128", "--batch", "1"]
    budget = _long_budget(2, 2048, 4096, 128)
    auto = f"autotune={{'memory': {budget!r}, 'tp': 1, 'pp': 1, 'budget_s': 60, 'max_probes': 3}}"
    tuned, proc = _fit(tmp_path, "tuned", "--option", auto, shape=long)
    result = tuned["autotune"]
    s = result["settings"]
    assert s["sp"] == 2 and tuned["layout"]["sp"] == 2 and tuned["layout"]["dp"] == 1, result["winner"]
    assert all("sp2" in t["key"] for t in result["table"]), result["table"]
    assert any("sp2" not in k and "> budget" in why for k, why in result["rejected"])
    assert "strategy.sp=2" in proc.stdout and proc.stdout.count("Ulysses (sp) searched too") == 1  # rank 0 says so
    print(result["winner"], [t["key"] for t in result["table"]], result["predicted_all_bytes"], result["measured_bytes"])
    rel = abs(result["predicted_all_bytes"] - result["measured_bytes"]) / result["measured_bytes"]
    assert rel < 0.15, (result["winner"], result["predicted_all_bytes"], result["measured_bytes"])
    hand_opts = [f"{k}={v!r}" for k, v in s.items() if k != "dp"]
    hand, _ = _fit(tmp_path, "hand", *[a for o in hand_opts for a in ("--option", o)], shape=long)
    assert hand["autotune"] is None and hand["layout"] == tuned["layout"]
    assert len(tuned["losses"]) == len(hand["losses"]) == 4
    diff = max(abs(a - b) for a, b in zip(tuned["losses"], hand["losses"]))
    assert diff < 1e-5, (tuned["losses"], hand["losses"])


def test_autotune_checkpoints_resume_on_whatever_layout_the_next_start_picks(tmp_path):
    """autotune picks the layout again at every start (probe timings vary), so its checkpoints default to the
    layout-free format: a run tuned to ZeRO-2 saves at step 2, a restart whose search allows ZeRO-3 only resumes it,
    and its steps 3-4 equal the uninterrupted run's. (A sharded checkpoint resumed on another layout is refused by
    name: tests/unit/test_checkpoint_folder.py.)"""
    common = "'offloads': ['none'], 'tp': 1, 'pp': 1, 'ac': ['none'], 'buckets': [25], 'max_probes': 1"
    ckpt = tmp_path / "ckpt"
    first, _ = _fit(tmp_path, "first", "--option", f"autotune={{'stages': [2], {common}}}", "--ckpt-dir", str(ckpt),
                    "--epoch-batches", "2", shape=SMALL)
    assert first["layout"]["stage"] == 2 and first["checkpoint_format"] == "universal"
    (saved,) = [p for p in ckpt.iterdir() if "step=2" in p.name]
    from lightning_scale.checkpoint.dcp_format import detect_format

    assert detect_format(str(saved)) == "dcp"  # the layout-free folder
    again, _ = _fit(tmp_path, "again", "--option", f"autotune={{'stages': [3], {common}}}", "--resume", str(saved),
                    "--epoch-batches", "2", shape=SMALL)
    assert again["layout"]["stage"] == 3 and again["global_step"] == 4
    assert len(again["losses"]) == 2, again["losses"]  # steps 3-4 only: the checkpoint was loaded
    diff = max(abs(a - b) for a, b in zip(again["losses"], first["losses"][2:]))
    assert diff < 1e-5, (again["losses"], first["losses"])
