"""``ParallelDims``: how the processes of a run are arranged, the one source of truth for ranks.

``dp x pp x tp = world``, with at most one of ``pp`` and ``tp`` above 1:

- ``pp`` consecutive ranks form one pipeline (its stages);
- ``tp`` consecutive ranks form one tensor-parallel group (each holds a share of every planned
  layer's matrices; consecutive, so that a group sits inside one node, where bandwidth is);
- ``dp`` such groups train on different shares of the global batch. The global batch is split
  over the ``dp`` ranks only: the ranks of one pipeline or tensor-parallel group load the same
  samples. Without either, every rank is a data-parallel rank.

As a 2-D ``DeviceMesh``, ``("dp", "pp")`` or ``("dp", "tp")``: its rows are the groups, its
columns the data-parallel groups.
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
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def group_size(self) -> int:
        """Consecutive ranks that load the same samples (a pipeline, or a tensor-parallel group)."""
        return self.pp * self.tp

    @classmethod
    def of(cls, world_size: int, pipeline_stages: int | None = None, tp: int = 1) -> ParallelDims:
        """The dims of a run of ``world_size`` processes; a ConfigError when the groups do not fit."""
        pp = pipeline_stages or 1
        for field, size in (("pipeline_stages", pp), ("tp", tp)):
            if world_size % size:
                raise ConfigError(field, size, f"must divide the number of processes {world_size}")
        return cls(dp=world_size // (pp * tp), pp=pp, tp=tp)

    def stage(self, rank: int) -> int:
        return rank % self.pp

    def data_rank(self, rank: int) -> int:
        """Which share of the global batch ``rank`` trains on (its pipeline, or its tensor-parallel group)."""
        return rank // self.group_size

    def seed_rank(self, rank: int) -> int:
        """Whose random numbers ``rank`` draws: its own, but the same for a tensor-parallel group
        (its ranks compute the replicated activations alike: their dropout masks must agree)."""
        return rank // self.tp

    def data_env(self, env: ClusterEnv) -> ClusterEnv:
        """``env`` as the data pipeline sees it: ranks are data-parallel ranks."""
        if self.group_size == 1:
            return env
        return dataclasses.replace(
            env,
            rank=self.data_rank(env.rank),
            world_size=self.dp,
            local_world_size=max(1, env.local_world_size // self.group_size),
        )

    def mesh(self, device_type: str) -> torch.distributed.DeviceMesh:
        """``("dp", "pp")`` with a pipeline, else ``("dp", "tp")``."""
        inner = ("pp", self.pp) if self.pp > 1 else ("tp", self.tp)
        return device_mesh(device_type, (self.dp, inner[1]), ("dp", inner[0]))


def device_mesh(
    device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None
) -> torch.distributed.DeviceMesh:
    """A device mesh over the default process group, of real tensors also under a fake tensor mode:
    ``leantrain plan --cluster`` applies the strategies to a model of fake tensors, and a mesh of fake
    rank numbers could not be read back."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    with unset_fake_temporarily():
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
