import pytest
import torch

from lightning_scale.comm import CommCounter, algorithmic_bytes
from lightning_scale.comm import collectives as C
from lightning_scale.comm.accounting import record


def test_ring_formulas():
    assert algorithmic_bytes("all_reduce", 1000, 4) == 1500
    assert algorithmic_bytes("reduce_scatter", 1000, 4) == 750
    assert algorithmic_bytes("all_gather", 1000, 4) == 750
    assert algorithmic_bytes("send", 1000, 4) == 1000
    assert algorithmic_bytes("all_reduce", 1000, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        algorithmic_bytes("gossip", 1, 2)


def test_counters_nest_and_only_count_while_active():
    record("all_reduce", 100, 2)  # nobody listening: dropped
    with CommCounter() as outer:
        record("all_reduce", 100, 2, tag="grad")
        with CommCounter() as inner:
            record("all_gather", 100, 2)
        record("send", 10, 2)
    assert inner.total == 50
    assert outer.total == 100 + 50 + 10
    assert outer.by_tag["grad"] == 100 and outer.calls["all_reduce"] == 1


def test_single_process_collectives_are_copies():
    out = torch.empty(4)
    C.reduce_scatter(out, torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0))
    full = torch.empty(4)
    C.all_gather(full, torch.arange(4.0))
    assert torch.equal(full, torch.arange(4.0))
    with pytest.raises(ValueError, match="numel"):
        C.reduce_scatter(torch.empty(3), torch.empty(4))
