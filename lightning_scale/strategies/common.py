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
        """Tensor- and pipeline-parallel peers read the same batch: only the dp axis splits data."""
        topo = self.topology
        if topo is None:
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        return {"num_replicas": topo.dp, "rank": topo.dp_rank}

    # ---------------------------------------------------------------- the grid (for users who shard data by hand)
    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank if self.topology is not None else self.global_rank

    @property
    def dp_size(self) -> int:
        return self.topology.dp if self.topology is not None else self.world_size

    @property
    def tp_rank(self) -> int:
        return self.topology.tp_rank if self.topology is not None else 0

    @property
    def pp_rank(self) -> int:
        return self.topology.pp_rank if self.topology is not None else 0

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
