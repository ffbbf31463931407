"""Secondary errors during teardown never replace the first (issue 15 item 7), in one process (inner loop).

A 1-rank ``Trainer(strategy=Zero3DStrategy(stage=2))`` whose training_step raises at step 1; then everything Lightning
runs before it re-raises fails too: a callback's ``on_exception``, a logger's ``finalize("failed")`` and the strategy's
own teardown. ``fit`` must raise the first error, and each secondary one is printed as such. Without a first error, a
failing teardown step still raises (and the later steps still run). The 2-rank twin with a collective on a peer that
is gone is tests/strategies/test_failures.py::test_secondary_errors_in_teardown_never_replace_the_first.
"""

from __future__ import annotations

import json
import sys

from lightning_scale.testing import run_script


def main(out: str, raise_in_step: bool) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_scale import Zero3DStrategy

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            if raise_in_step and batch_idx == 1:
                raise RuntimeError("boom: the first error")
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class FailingOnException(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            def broken():
                raise OSError("secondary: remove_hooks failed")

            trainer.strategy.engines[0].remove_hooks = broken

        def on_exception(self, trainer, pl_module, exception) -> None:
            raise ValueError("secondary: on_exception failed")

    class FailingLogger(CSVLogger):
        def finalize(self, status: str) -> None:
            if status == "failed":
                raise KeyError("secondary: finalize failed")
            super().finalize(status)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Zero3DStrategy(stage=2), max_steps=3,
                         logger=FailingLogger(out + ".logs"), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[FailingOnException()])
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    result = {"raised": None}
    try:
        trainer.fit(Model(), train_dataloaders=data)
    except BaseException as exc:  # noqa: BLE001 - what fit raised is the test's subject
        result["raised"] = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as f:
        json.dump(result, f)


def _run(tmp_path, raise_in_step: bool):
    out = tmp_path / "result.json"
    proc = run_script([sys.executable, __file__, str(out), str(int(raise_in_step))], timeout=240, cwd=tmp_path,
                      ranks=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())["raised"], proc.stdout + proc.stderr


def test_fit_raises_the_first_error_and_logs_the_secondary_ones(tmp_path):
    raised, output = _run(tmp_path, True)
    assert raised == "RuntimeError: boom: the first error", output[-4000:]
    first = "ignored (the first error RuntimeError: boom: the first error is the one raised)"
    for where, err in [("FailingOnException.on_exception", "ValueError: secondary: on_exception failed"),
                       ("FailingLogger.finalize", "KeyError: 'secondary: finalize failed'"),
                       ("Zero3DStrategy.teardown", "OSError: secondary: remove_hooks failed")]:
        assert f"[lightning_scale] rank 0: secondary error in {where}, {first}: {err}" in output, output[-4000:]


def test_a_failing_teardown_step_without_a_first_error_still_raises():
    from lightning_scale.strategies import diagnostics_glue

    class S:
        global_rank = 0

    ran = []

    def bad(text):
        def step():
            ran.append(text)
            raise OSError(text)
        return step

    try:
        diagnostics_glue.run_teardown(S(), ("one", bad("first step")), ("two", bad("second step")))
    except OSError as err:
        raised = str(err)
    assert raised == "first step" and ran == ["first step", "second step"]


if __name__ == "__main__":
    main(sys.argv[1], bool(int(sys.argv[2])))
