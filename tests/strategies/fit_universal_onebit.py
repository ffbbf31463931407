"""fit_universal.py (fit_gpt.py, same data order on any number of devices) with a full-state probe for OneBitAdam.

LS_TEST_FULL_STATE=FILE (a ``torch.save`` of the checkpoint's full tensors, as torch's ``dcp_to_torch_save`` writes
them: ``model/<fqn>``, ``optim/<fqn>/exp_avg`` ...): at ``on_train_start`` (after Lightning restored the checkpoint)
every rank compares its OneBitZeroOptimizer's shards (weights, exp_avg, exp_avg_sq, step, v_step) with the same
ranges cut by hand from the full tensors, and writes the largest differences to FILE.<rank>.json.
LS_TEST_FULL_STATE_MODE=overwrite: it then puts the full state into the shards and drops the error-feedback buffers
- the reference "run started from the same full state on this layout", which does not go through the checkpoint
loader for any tensor (only Lightning's loop state, the lr scheduler and the hyperparameters come from it).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fit_gpt  # noqa: E402
import fit_universal  # noqa: E402,F401  (the unshuffled sampler on one device)


def _cut(full, key_of, st):
    """The bucket's flat vector of ``key_of(fqn)`` from the full tensors (zero padding), and this rank's range."""
    flat = torch.zeros(st.bucket.padded_numel, dtype=st.master.dtype)
    for slot, fqn in st.fqns:
        flat[slot.offset:slot.offset + slot.numel].copy_(full[key_of(fqn)].reshape(-1))
    return flat, flat[st.shard]


@torch.no_grad()
def _probe(trainer, pl_module) -> None:
    from lightning_scale.checkpoint.engine_pieces import param_names

    full = torch.load(os.environ["LS_TEST_FULL_STATE"], weights_only=False)
    overwrite = os.environ.get("LS_TEST_FULL_STATE_MODE") == "overwrite"
    (engine,) = trainer.strategy.engines
    names = param_names(trainer.strategy.lightning_module)
    diffs = {"weights": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "step": 0.0, "v_step": 0.0}
    for st in engine.states:
        st.fqns = [(slot, names[id(slot.param)]) for slot in st.bucket.slots]
        h = st.helper.state
        weights, mine = _cut(full, lambda f: f"model/{f}", st)
        diffs["weights"] = max(diffs["weights"], (st.master - mine).abs().max().item())
        for sname in ("exp_avg", "exp_avg_sq"):
            _, want = _cut(full, lambda f, s=sname: f"optim/{f}/{s}", st)
            diffs[sname] = max(diffs[sname], (h[sname] - want).abs().max().item())
            if overwrite:
                h[sname].copy_(want)
        for sname in ("step", "v_step"):
            want = {float(full[f"optim/{fqn}/{sname}"]) for _, fqn in st.fqns}
            assert len(want) == 1, (sname, want)
            diffs[sname] = max(diffs[sname], abs(h[sname] - want.pop()))
            if overwrite:
                h[sname] = int(float(full[f"optim/{st.fqns[0][1]}/{sname}"]))
        if overwrite:
            st.param_buffer.copy_(weights.to(st.param_buffer.dtype))  # every rank holds the whole bucket
            if not st.master_aliased:
                st.master.copy_(mine)
            h["worker_error"] = None  # zeros at the next compressed step
    with open(f"{os.environ['LS_TEST_FULL_STATE']}.{trainer.global_rank}.json", "w") as f:
        json.dump({"diffs": diffs, "mode": "overwrite" if overwrite else "compare", "world": trainer.world_size,
                   "stage": engine.stage, "global_step": trainer.global_step}, f)


if os.environ.get("LS_TEST_FULL_STATE"):
    fit_gpt.LossRecorder.on_train_start = lambda self, trainer, pl_module: _probe(trainer, pl_module)

if __name__ == "__main__":
    fit_gpt.main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
