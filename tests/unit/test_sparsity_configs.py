"""Sparsity configs: each layout against DeepSpeed's documented semantics on small hand-checked cases."""

import os
import subprocess
import sys

import pytest
import torch

from lightning_scale.config import ConfigError
from lightning_scale.nn import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    layout_density,
)


def grid(rows):
    """'1..1' strings -> (NB, NB) int64 tensor (hand-written expected layouts)."""
    return torch.tensor([[int(c == "1") for c in row] for row in rows], dtype=torch.int64)


def test_dense_is_all_ones():
    layout = DenseSparsityConfig(num_heads=2, block=16).make_layout(64)
    assert layout.shape == (2, 4, 4) and layout.dtype == torch.int64 and bool((layout == 1).all())


def test_fixed_bidirectional():
    # 8 blocks, windows [0-3] [4-7]; the last block of each window (3, 7) is global for every row.
    layout = FixedSparsityConfig(num_heads=2, block=16).make_layout(128)
    expected = grid(["11110001", "11110001", "11110001", "11110001",
                     "00011111", "00011111", "00011111", "00011111"])
    assert torch.equal(layout[0], expected) and torch.equal(layout[1], expected)


def test_fixed_unidirectional_and_short_last_window():
    # 7 blocks: windows [0-3] [4-6]; global 3 (rows >= 3); the short last window's global block is
    # clamped to the last block (6), attended from row 6 only.
    layout = FixedSparsityConfig(num_heads=1, block=16, attention="unidirectional").make_layout(7 * 16)
    expected = grid(["1000000", "1100000", "1110000", "1111000", "0001100", "0001110", "0001111"])
    assert torch.equal(layout[0], expected)


def test_fixed_horizontal_and_different_global_patterns():
    layout = FixedSparsityConfig(num_heads=2, block=16, horizontal_global_attention=True).make_layout(128)
    # global blocks 3 and 7 attend to everything (rows) and are attended by everything (columns).
    assert bool((layout[:, [3, 7]] == 1).all()) and bool((layout[:, :, [3, 7]] == 1).all())
    assert layout[0, 0, 4] == 0 and layout[0, 4, 0] == 0
    cfg = FixedSparsityConfig(num_heads=2, block=16, different_layout_per_head=True, num_local_blocks=4,
                              num_global_blocks=1, num_different_global_patterns=2)
    layout = cfg.make_layout(128)
    # head 0: global blocks 3, 7; head 1: 2, 6.
    assert layout[0, 0, 3] == 1 and layout[0, 0, 7] == 1 and layout[0, 0, 6] == 0
    assert layout[1, 0, 2] == 1 and layout[1, 0, 6] == 1 and layout[1, 0, 7] == 0


def test_variable_windows_and_globals():
    cfg = VariableSparsityConfig(num_heads=1, block=16, local_window_blocks=[1, 2], global_block_indices=[0])
    # windows [0] [1-2], then size 2 repeats: [3-4] [5]; block 0 global (column only, bidirectional).
    expected = grid(["100000", "111000", "111000", "100110", "100110", "100001"])
    assert torch.equal(cfg.make_layout(96)[0], expected)
    uni = VariableSparsityConfig(num_heads=1, block=16, local_window_blocks=[2], global_block_indices=[1],
                                 global_block_end_indices=[3], attention="unidirectional").make_layout(64)
    # windows [0-1] [2-3] lower-triangular; global columns 1..2 from row 1 (their first row) down,
    # so row 1 lists block 2 as DeepSpeed does (the causal attention drops it).
    assert torch.equal(uni[0], grid(["1000", "1110", "0110", "0111"]))
    horizontal = VariableSparsityConfig(num_heads=1, block=16, local_window_blocks=[4], global_block_indices=[2],
                                        horizontal_global_attention=True).make_layout(128)
    assert bool((horizontal[0, 2] == 1).all()) and bool((horizontal[0, :, 2] == 1).all())


def test_variable_random_blocks_are_seeded_and_causal():
    cfg = VariableSparsityConfig(num_heads=2, block=16, num_random_blocks=2, local_window_blocks=[1],
                                 global_block_indices=[100], attention="unidirectional", different_layout_per_head=True)
    layout = cfg.make_layout(256)
    assert torch.equal(layout, cfg.make_layout(256))
    assert torch.equal(torch.tril(layout), layout)  # random blocks never point to the future
    extra = layout.sum(-1) - 1  # minus the diagonal (window of one block)
    assert bool((extra <= 2).all()) and bool((extra[:, 4:] >= 1).all())
    assert not torch.equal(layout[0], layout[1])  # per-head random draws
    other = VariableSparsityConfig(num_heads=2, block=16, num_random_blocks=2, local_window_blocks=[1],
                                   global_block_indices=[100], attention="unidirectional",
                                   different_layout_per_head=True, seed=1).make_layout(256)
    assert not torch.equal(layout, other)


def test_bigbird_window_and_global():
    layout = BigBirdSparsityConfig(num_heads=1, block=16, num_random_blocks=0).make_layout(96)
    expected = grid(["111111", "111000", "111100", "101110", "100111", "100011"])
    assert torch.equal(layout[0], expected)
    uni = BigBirdSparsityConfig(num_heads=1, block=16, num_random_blocks=0, attention="unidirectional")
    assert torch.equal(uni.make_layout(96)[0], torch.tril(expected))


def test_bigbird_random_blocks():
    base = BigBirdSparsityConfig(num_heads=1, block=16, num_random_blocks=0).make_layout(256)
    layout = BigBirdSparsityConfig(num_heads=1, block=16, num_random_blocks=2).make_layout(256)
    assert bool((layout >= base).all())
    added = (layout - base).sum(-1)
    assert bool((added <= 2).all()) and int(added.sum()) > 0


def test_longformer():
    cfg = BSLongformerSparsityConfig(num_heads=1, block=16, num_sliding_window_blocks=3, global_block_indices=[2])
    expected = grid(["11100", "11100", "11111", "00111", "00111"])
    assert torch.equal(cfg.make_layout(80)[0], expected)
    ranged = BSLongformerSparsityConfig(num_heads=1, block=16, num_sliding_window_blocks=1,
                                        global_block_indices=[0], global_block_end_indices=[2],
                                        attention="unidirectional").make_layout(64)
    assert torch.equal(ranged[0], grid(["1000", "1100", "1110", "1101"]))


def test_local_sliding_window():
    uni = LocalSlidingWindowSparsityConfig(num_heads=1, block=16, num_sliding_window_blocks=3).make_layout(80)
    assert torch.equal(uni[0], grid(["10000", "11000", "01100", "00110", "00011"]))
    bi = LocalSlidingWindowSparsityConfig(num_heads=1, block=16, num_sliding_window_blocks=3,
                                          attention="bidirectional").make_layout(80)
    assert torch.equal(bi[0], grid(["11000", "11100", "01110", "00111", "00011"]))


def test_same_layout_on_every_head_unless_asked():
    layout = BigBirdSparsityConfig(num_heads=3, block=16, num_random_blocks=2).make_layout(256)
    assert torch.equal(layout[0], layout[1]) and torch.equal(layout[0], layout[2])


def test_shorter_sequences_slice_the_layout():
    cfg = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=6)
    attn = SparseSelfAttention(cfg, max_seq_length=256)
    assert torch.equal(attn.get_layout(128).long(), cfg.make_layout(256)[:, :8, :8])
    assert not torch.equal(cfg.make_layout(128), cfg.make_layout(256)[:, :8, :8])  # slicing != rebuilding


def test_density():
    layout = LocalSlidingWindowSparsityConfig(num_heads=1, block=16, num_sliding_window_blocks=1).make_layout(64)
    assert layout_density(layout) == pytest.approx(0.25)
    assert layout_density(layout, causal=True) == pytest.approx(0.4)


_LAYOUT_SCRIPT = """
import random, sys, torch
random.seed(int(sys.argv[1])); torch.manual_seed(int(sys.argv[1]))
from lightning_scale.nn import BigBirdSparsityConfig, VariableSparsityConfig
a = BigBirdSparsityConfig(num_heads=4, block=16, num_random_blocks=3, different_layout_per_head=True).make_layout(512)
b = VariableSparsityConfig(num_heads=4, block=16, num_random_blocks=3, different_layout_per_head=True).make_layout(512)
print("".join(map(str, torch.cat([a.flatten(), b.flatten()]).tolist())))
"""


def test_random_layouts_identical_across_processes():
    """Two processes with different global RNG states and hash seeds build the same random layouts."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _LAYOUT_SCRIPT, str(seed)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, LIGHTNING_SCALE_SKIP_REGISTER="1", PYTHONHASHSEED=str(seed)))
        for seed in (1, 2)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs.append(out.strip())
    assert outs[0] == outs[1] and "1" in outs[0]


@pytest.mark.parametrize("make", [
    lambda: FixedSparsityConfig(num_heads=2, block=24),
    lambda: FixedSparsityConfig(num_heads=2, block=8),
    lambda: FixedSparsityConfig(num_heads=0),
    lambda: FixedSparsityConfig(num_heads=2, attention="sideways"),
    lambda: BigBirdSparsityConfig(num_heads=2, attention="causal"),
    lambda: FixedSparsityConfig(num_heads=2, num_local_blocks=4, num_global_blocks=3),
    lambda: FixedSparsityConfig(num_heads=2, attention="unidirectional", horizontal_global_attention=True),
    lambda: FixedSparsityConfig(num_heads=2, num_different_global_patterns=2),
    lambda: FixedSparsityConfig(num_heads=2, different_layout_per_head=True, num_different_global_patterns=5),
    lambda: VariableSparsityConfig(num_heads=2, global_block_indices=[0, 4], global_block_end_indices=[2]),
    lambda: VariableSparsityConfig(num_heads=2, global_block_indices=[3], global_block_end_indices=[3]),
    lambda: BSLongformerSparsityConfig(num_heads=2, global_block_indices=[2], global_block_end_indices=[1]),
    lambda: LocalSlidingWindowSparsityConfig(num_heads=2, attention="both"),
])
def test_invalid_configs_raise_naming_the_setting(make):
    with pytest.raises(ConfigError, match="sparsity_config|num_heads"):
        make()


def test_layout_errors():
    with pytest.raises(ConfigError, match="not a multiple of sparsity_config.block=16"):
        FixedSparsityConfig(num_heads=1).make_layout(100)
    with pytest.raises(ConfigError, match="num_random_blocks=5"):
        BigBirdSparsityConfig(num_heads=1, num_random_blocks=5).make_layout(64)
    with pytest.raises(ConfigError, match="num_sliding_window_blocks=7"):
        BSLongformerSparsityConfig(num_heads=1, num_sliding_window_blocks=7).make_layout(64)
