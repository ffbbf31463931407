"""What the Trainer strategy and the Fabric strategy share: devices, the grid ranks, object collectives."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist


class GridStrategyMixin:
    """Mixed in before Lightning's ``ParallelStrategy`` (Trainer's or Fabric's). Needs ``self.topology``
    (a :class:`~lightning_scale.topology.Topology`, None before ``setup_environment``) and ``self._num_nodes``."""

    topology: Any
    _num_nodes: int
    _process_group_backend: Optional[str]

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """Tensor- and pipeline-parallel peers read the same batch: only the dp axis (and ep, whose ranks are
        data-parallel too) splits data."""
        topo = self.topology
        if topo is None:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        return {"num_replicas": topo.data_size, "rank": topo.data_rank}

    # ---------------------------------------------------------------- the grid (for users who shard data by hand)
    # A sampler splits over dp only: DistributedSampler(ds, num_replicas=strategy.dp_size, rank=strategy.dp_rank).
    # Tensor-, sequence- and pipeline-parallel peers read the same batch; check_batch verifies it (docs/models.md).
    @property
    def dp_rank(self) -> int:
        """This rank's index on the data-parallel axis (what a sampler splits over; with ep > 1, dp x ep)."""
        return self.topology.data_rank if self.topology is not None else self.global_rank

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks, each reading its own batches (world size / (tp * pp * sp))."""
        return self.topology.data_size if self.topology is not None else self.world_size

    @property
    def tp_rank(self) -> int:
        return self.topology.tp_rank if self.topology is not None else 0

    @property
    def tp_size(self) -> int:
        return self.topology.tp if self.topology is not None else 1

    @property
    def sp_rank(self) -> int:
        """This rank's index on the sequence-parallel axis (its slice of each sequence)."""
        return getattr(self.topology, "sp_rank", 0) if self.topology is not None else 0

    @property
    def sp_size(self) -> int:
        return getattr(self.topology, "sp", 1) if self.topology is not None else 1

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 = the first)."""
        return self.topology.pp_rank if self.topology is not None else 0

    @property
    def pp_size(self) -> int:
        return self.topology.pp if self.topology is not None else 1

    # ---------------------------------------------------------------- the data contract (tp / pp peers, same batch)
    def batch_to_device(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning moves every train / val / test / predict batch through here: check it after the move."""
        batch = super().batch_to_device(batch, *args, **kwargs)
        self.check_batch(batch)
        return batch

    def check_batch(self, batch: Any, stage: Optional[str] = None) -> None:
        """Raise :class:`~lightning_scale.diagnostics.BatchMismatchError` on every rank when tp / sp / pp peers hold
        different batches: on the first batch of each run (stage) always, on every batch in debug mode
        (``diagnostics.debug_collectives`` / ``LIGHTNING_SCALE_DEBUG_COLLECTIVES=1``). A collective: every rank
        calls it once per batch (the Trainer does, through ``batch_to_device``; a Fabric loop may)."""
        from lightning_scale.diagnostics import check_same_batch, trace

        topo = self.topology
        if topo is None or (topo.tp == getattr(topo, "ep", 1) and topo.pp == 1 and getattr(topo, "sp", 1) == 1):
            return
        trainer = getattr(getattr(self, "lightning_module", None), "_trainer", None)
        if stage is None:
            stage = trainer.state.stage.value if trainer is not None and trainer.state.stage is not None else "run"
        seen = self.__dict__.setdefault("_batches_checked", {})
        n = seen[stage] = seen.get(stage, -1) + 1
        diagnostics = getattr(getattr(self, "config", None), "diagnostics", None)
        debug = bool(getattr(diagnostics, "debug_collectives", False)) or trace.debug_env()
        if n == 0 or debug:
            step = f"step {trainer.global_step} ({stage} batch {n})" if trainer is not None else f"{stage} batch {n}"
            check_same_batch(batch, topo, where=step, device=self.root_device)

    def _new_run(self, *stages: str) -> None:
        checked = self.__dict__.get("_batches_checked", {})
        for stage in stages:  # the first batch of this run is checked again
            checked.pop(stage, None)

    def on_train_start(self) -> None:
        self._new_run("train")
        super().on_train_start()

    def on_validation_start(self) -> None:
        self._new_run("validate", "sanity_check")
        super().on_validation_start()

    def on_test_start(self) -> None:
        self._new_run("test")
        super().on_test_start()

    def on_predict_start(self) -> None:
        self._new_run("predict")
        super().on_predict_start()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Every preset of ``lightning_scale.config.PRESETS`` under its name (the Trainer's or Fabric's registry)."""
        from lightning_scale.config import PRESETS

        for name, (kwargs, description) in PRESETS.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **kwargs)

    # ---------------------------------------------------------------- object collectives
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def _gather_object(self, obj: Any) -> List[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, obj)
        return every
