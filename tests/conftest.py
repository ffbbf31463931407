import os
import sys

import torch

# Triton kernels run in the interpreter on machines without CUDA; it must be set before triton is
# imported, and `import lightning_scale` imports triton through Lightning.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the test process, as in every rank (run_distributed / run_script set one per rank): a
# reference computed here then reduces in the same order as the ranks (float64 parity at 1e-12). Before this, the
# in-process references ran at 2 threads until the first in-process Trainer (Lightning's
# _set_num_threads_if_needed) dropped it to 1: test_frozen_base and test_hf_strict_load passed in the full run and
# failed alone (1.9e-10 / 9.7e-8 off). Under pytest-xdist (-n 2) it is also one core per worker.
torch.set_num_threads(1)

# Tests import helpers that sit next to them (tests/dist/zero_workers.py ...); spawned ranks inherit sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The repository root holds `kernels/` (installed as `lightning_scale.kernels`). `python -m pytest` puts the root
# first on sys.path, where that folder shadows the unrelated PyPI package `kernels`, which transformers (>= 5)
# imports when it is installed: every Hugging Face model would then fail to import. Keep the root on sys.path (a
# checkout used through PYTHONPATH still imports lightning_scale from it), but after site-packages.
_at_root = [p for p in sys.path if os.path.abspath(p or os.getcwd()) == ROOT]
if _at_root:
    sys.path[:] = [p for p in sys.path if p not in _at_root] + [ROOT]
_shadow = sys.modules.get("kernels")
if _shadow is not None and os.path.abspath(getattr(_shadow, "__file__", None) or "").startswith(ROOT + os.sep):
    del sys.modules["kernels"]
for sub in ("dist", "strategies", "unit", "kernels"):
    path = os.path.join(HERE, sub)
    if path not in sys.path:
        sys.path.insert(0, path)


# --- cleanup (issue 18): no rank or launched script outlives its test ------------------------------------------
# run_distributed / run_script kill their process groups themselves on timeout, failure, Ctrl-C and on
# pytest-timeout's exception (the default "signal" method raises inside the test). The hooks below are the
# backstop: a test that leaked a group, and pytest itself being terminated. pytest killed outright, or
# pytest-timeout's "thread" method (os._exit), is covered by the parent-death signal of each rank / script.
import signal  # noqa: E402

from lightning_scale import testing as _testing  # noqa: E402


def _terminate(signum, frame):  # noqa: ARG001
    _testing.kill_live_groups()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


signal.signal(signal.SIGTERM, _terminate)
signal.signal(signal.SIGHUP, _terminate)


def pytest_runtest_teardown(item, nextitem):  # noqa: ARG001
    _testing.kill_live_groups()
    # Lightning's in-process KeyboardInterrupt path sets SIGINT to SIG_IGN and leaves it: every process started
    # afterwards would inherit it and ignore Ctrl-C (test_ctrl_c_leaves_no_orphan's inner pytest hung 120 s in a
    # full run), and so would this pytest. Give Python's handler back.
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    _testing.kill_live_groups()
    _testing.testing_zygote.close_all()


# --- the inner loop (issue 18): `python -m pytest -q -m "not slow"` in a few minutes ------------------------------
# Tests marked slow where they are defined, plus these: the longest of the rest in a full run on the 2-core box
# (pytest --durations=0, 2026-12-02: 8-40 s each; 4- and 8-rank variants whose 2-rank twin stays in the inner loop,
# memory-ceiling runs, hang / signal / kill scenarios, the README's main job). CI runs all of them. A node id ending
# in "[" matches every parametrization of that test.
SLOW = (
    # zero-bubble + full AC against 1F1B + AC, forward counts and float64 gradients (pp=2, 2 schedules x 2 steps)
    "tests/dist/test_pipeline_zero_bubble_ac.py::test_zero_bubble_with_full_checkpointing_recomputes_once_and_matches_1f1b",
    "tests/dist/test_ulysses.py::test_sp4_and_dp2_sp2_match_one_process",  # 4 ranks, 7 layouts x 3 steps
    # the tiled-MLP plan checks (one Trainer per shape, 2 x 2048 positions): the 4-shape check stays in the inner loop
    "tests/unit/test_memory_plan.py::test_tiled_mlp_step1_peak_within_15_percent_of_the_plan",
    "tests/unit/test_memory_plan.py::test_tiled_mlp_modules_on_some_units_within_15_percent_of_the_plan",
    "tests/unit/test_memory_plan.py::test_tiled_attention_step1_peak_within_15_percent_of_the_plan",
    "tests/dist/test_ulysses.py::test_sp2_sparse_gpt2_eager_match_one_process",  # 5 layouts x 3 steps + references
    "tests/dist/test_ulysses_compose.py::test_tp2_sp2_match_one_process",  # 4 ranks, 5 layouts (11-20 s)
    "tests/dist/test_ulysses_compose.py::test_pp2_sp2_match_one_process",  # 4 ranks, 8 layouts (9-16 s)
    "tests/dist/test_ulysses_masks.py::test_padding_and_sliding_window_masks_under_pp2_sp2_match_one_process",  # 4-rank
    "tests/strategies/test_sp_trainer.py::test_trainer_sp2_with_tp2_or_pp2_matches_single_process[",  # 4-rank Trainers
    "tests/strategies/test_sp_trainer.py::test_fabric_sp2_tp2_matches_one_process",  # 4 ranks, 2 Fabric layouts
    "tests/dist/test_pretrained.py::",  # one module fixture: 7 layouts x 2 models + the memory runs (25-61 s)
    "tests/dist/test_compile.py::test_compile_aot_eager_equals_eager_at_every_layout_without_recompiles",
    "tests/dist/test_compile.py::test_compile_inductor_float32_zero3_within_1e_5",  # inductor's C++ build
    "tests/strategies/test_compile_trainer.py::",  # 2 x 2 Trainer runs with Dynamo
    "tests/dist/test_zero3.py::test_configure_model_1gb_on_4_ranks_never_holds_the_whole_model",
    "tests/dist/test_zero3.py::test_parity_float64_stage3_and_offload[4]",
    "tests/dist/test_zero3.py::test_comm_bytes_and_gathered_peak[2]",
    "tests/dist/test_zero3.py::test_model_state_bytes_bf16_mixed_is_16_psi_over_n",
    "tests/dist/test_zero3.py::test_tied_embeddings[units1]",
    "tests/dist/test_zero.py::test_parity_float64_two_groups_clip_accumulation[4]",
    "tests/dist/test_zero.py::test_model_state_bytes_match_zero_formula[32-true-4]",
    "tests/dist/test_pipeline_meta.py::test_pipeline_stage_is_materialized_alone_from_meta",
    "tests/dist/test_pipeline_parity.py::test_pipeline_matches_single_process[4]",
    "tests/dist/test_hf_matrix.py::test_matrix_fast_families",
    "tests/dist/test_litgpt.py::test_losses_equal_one_process[neox-tp2-float64]",
    "tests/dist/test_litgpt.py::test_gqa_dp2_tp2_equals_one_process",  # 4 ranks
    "tests/dist/test_slow_network.py::",
    "tests/dist/test_tp_model.py::test_meta_build_and_sharded_resume",
    "tests/dist/test_tp_model.py::test_gpt_matches_single_process[tp4]",
    "tests/dist/test_tp_meta.py::test_tensor_parallel_model_materialized_from_meta_equals_plain_init",
    "tests/dist/test_parallelize.py::test_cross_axis_norm_and_overflow_vote_at_dp2_pp2_tp2",
    "tests/strategies/test_checkpoint_faults.py::",
    "tests/strategies/test_failures.py::test_hang_in_training_step[",
    "tests/strategies/test_failures.py::test_sigterm_stops_every_rank[",
    "tests/strategies/test_zero_trainer.py::test_errors_reach_every_rank_without_hang[args2-",
    "tests/unit/test_readme_snippets.py::test_main_job_prints_where_everything_is",
    "tests/unit/test_readme_snippets.py::test_plot_command_draws_the_logged_values",
    "tests/unit/test_readme_snippets.py::test_validation_rows_are_not_duplicated",
    "tests/unit/test_readme_snippets.py::test_estimate_commands_in_the_docs_run",
    "tests/unit/test_cleanup.py::test_pytest_timeout_leaves_no_orphan[test_ranks-signal]",
    "tests/unit/test_cleanup.py::test_pytest_timeout_leaves_no_orphan[test_forked-signal]",
    "tests/unit/test_cli_startup.py::test_import_lightning_scale_then_lightning_registers_strategies",
    # a second pass, from the inner loop's own --durations (4-40 s each on the loaded box)
    "tests/dist/test_onebit_zero.py::",
    "tests/dist/test_tp_model.py::test_gpt_matches_single_process[tp4-sp]",
    "tests/dist/test_zero.py::test_model_state_bytes_match_zero_formula[bf16-mixed-4]",
    "tests/strategies/test_fabric.py::test_fabric_dp2_every_stage_and_offload_match_one_process",
    "tests/strategies/test_zero_trainer.py::test_bf16_mixed_within_2_percent_of_fp32",
    "tests/unit/test_report.py::",
    "tests/unit/test_readme_snippets.py::test_readme_python_snippets_run",
    "tests/unit/test_hydra_combinations.py::test_every_combination_trains_or_is_refused_before_training",
    "tests/unit/test_sparse_attention.py::test_cpu_engine_gradcheck_fp64",
    "tests/unit/test_sparsity_configs.py::test_random_layouts_identical_across_processes",
    "tests/unit/test_checkpoint_cli.py::test_fresh_interpreter_imports_neither_lightning_nor_triton",
    "tests/unit/test_cleanup.py::test_pytest_timeout_leaves_no_orphan[test_script-signal]",
    "tests/unit/test_cleanup.py::test_pytest_timeout_leaves_no_orphan[test_forked-thread]",
    "tests/unit/test_cleanup.py::test_ctrl_c_leaves_no_orphan",
    # a third pass (full run of 2026-12-06, --durations=0: 8-28 s each; the inner loop had grown to 8:14)
    "tests/dist/test_compile_depth.py::test_compiled_graphs_do_not_grow_with_depth",
    "tests/dist/test_tune_probe.py::test_python_dash_m_probes_a_module",  # the CLI as a fresh `python -m`
    "tests/dist/test_tune_probe.py::test_long_sequence_relief_winner_memory_within_15_percent_of_measured",
    "tests/dist/test_memory_plan_counted.py::test_counted_step1_peak_within_15_percent[mixtral_zero2]",
    # a fourth pass (the inner loop's --durations, 2026-12-07: 7:50 for 1270 tests; 5-14 s each): a memory-ceiling run,
    # fresh interpreters, hang / linger scenarios whose twins stay, one more counted plan case
    "tests/dist/test_checkpoint_memory.py::",
    "tests/unit/test_expert_lists.py::test_routed_model_pickles_into_a_fresh_process",
    "tests/unit/test_routed_experts.py::test_routed_model_unpickles_in_a_fresh_process",
    "tests/dist/test_pipeline_failure.py::test_stage_error_makes_all_ranks_exit[failing-rank-lingers]",
    "tests/dist/test_pipeline_nccl_semantics.py::test_without_direction_groups_the_emulated_nccl_run_hangs[untied]",
    "tests/dist/test_memory_plan_counted.py::test_counted_step1_peak_within_15_percent[mixtral_zero2_ac]",
)


def pytest_collection_modifyitems(config, items):
    import pytest

    used = set()
    for item in items:
        for s in SLOW:
            if item.nodeid == s or (s.endswith(("[", "::", "-")) and item.nodeid.startswith(s)):
                item.add_marker(pytest.mark.slow)
                used.add(s)
    files = {item.nodeid.split("::")[0] for item in items}
    whole_files = not config.getoption("-k") and all("::" not in a for a in config.args)
    stale = [s for s in SLOW if whole_files and s not in used and s.split("::")[0] in files]
    if stale:  # a renamed test: keep the list true rather than silently moving a long test into the inner loop
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
