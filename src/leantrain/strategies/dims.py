"""``ParallelDims``: how the processes of a run are arranged, the one source of truth for ranks.

``dp x pp = world``: ``pp`` consecutive ranks form one pipeline (its stages), and ``dp``
such pipelines train on different shares of the global batch. Without a pipeline,
``pp = 1`` and every rank is a data-parallel rank. The global batch is split over the
``dp`` ranks only: the stages of one pipeline load the same samples.

Rank ``r`` is stage ``r % pp`` of pipeline ``r // pp``; as a 2-D ``DeviceMesh`` with the
dimensions ``("dp", "pp")``, its rows are pipelines and its columns data-parallel groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from leantrain.cluster import ClusterEnv
from leantrain.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @classmethod
    def of(cls, world_size: int, pipeline_stages: int | None) -> ParallelDims:
        """The dims of a run of ``world_size`` processes; a ConfigError when the stages do not fit."""
        pp = pipeline_stages or 1
        if world_size % pp:
            raise ConfigError(
                "pipeline_stages",
                pp,
                f"must divide the number of processes {world_size}",
            )
        return cls(dp=world_size // pp, pp=pp)

    def stage(self, rank: int) -> int:
        return rank % self.pp

    def pipeline(self, rank: int) -> int:
        """The data-parallel rank: which pipeline (which share of the global batch) ``rank`` is in."""
        return rank // self.pp

    def data_env(self, env: ClusterEnv) -> ClusterEnv:
        """``env`` as the data pipeline sees it: ranks are data-parallel ranks."""
        if self.pp == 1:
            return env
        return dataclasses.replace(
            env,
            rank=self.pipeline(env.rank),
            world_size=self.dp,
            local_world_size=max(1, env.local_world_size // self.pp),
        )

    def mesh(self, device_type: str) -> torch.distributed.DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp, self.pp), mesh_dim_names=("dp", "pp"))
