"""Lightning-side building blocks shared by the example, the strategy tests and the benchmarks."""

from lightning_scale.lit.data import ByteCorpusDataModule
from lightning_scale.lit.gpt_module import GPTLightningModule

__all__ = ["ByteCorpusDataModule", "GPTLightningModule"]
