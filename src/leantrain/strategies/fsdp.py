"""``--strategy fsdp``: FSDP2 (``fully_shard``), parameters, gradients and optimizer state sharded.

Each process keeps 1/world of every parameter (a ``DTensor`` shard), of its gradient and of
the optimizer state. A block is gathered whole just before it runs and freed after, in
forward and again in backward; gradients are reduce-scattered, each process keeping its
shard. Units: every module of the ``shard_blocks`` classes (default: the model's repeated
blocks, as for activation checkpointing), then the root for what is left.

Precision: ``32``, or ``bf16-mixed`` through FSDP's own mixed-precision policy: fp32 shards
(the master weights), gathered and computed in bf16, gradients reduced in fp32.

Accumulation: the reduce-scatter is skipped on non-final micro-batches
(``set_requires_gradient_sync(False)``, the FSDP form of DDP's ``no_sync``); the gradients
then accumulate *unsharded* until the final micro-batch, which costs one full gradient of
memory per process during accumulation. That is FSDP's documented trade (communication
once per step); with little memory, fewer accumulation steps and larger micro-batches
avoid it.

Checkpoints: ``torch.distributed.checkpoint`` writes each process's shards into a folder
beside the checkpoint file (``step-N.dcp/``); rank 0 writes the file itself, with everything
that is not sharded, last, so that a checkpoint file exists only when its shards are
complete. The final weights are gathered to rank 0 for ``model.safetensors``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from leantrain.adapters import trained_parameters
from leantrain.blocks import BlockPolicy, block_classes, matching_blocks
from leantrain.config import TrainConfig
from leantrain.strategies.base import Example, Strategy
from leantrain.strategies.dims import device_mesh
from leantrain.strategies.process_group import Collectives
from leantrain.strategies.sharded_state import ShardedState
from leantrain.strategies.sync_batch_norm import SyncsBatchNorm
from leantrain.strategies.tensor_parallel import TensorParallel


def shard_units(model: nn.Module, shard_blocks: str | None) -> list[tuple[str, nn.Module]]:
    """The modules sharded as units before the root: the named classes, or the repeated blocks."""
    if shard_blocks is None and not block_classes(model):
        return []  # no repeated blocks: the root alone is one unit
    if shard_blocks is None:
        policy = BlockPolicy(field="shard_blocks")  # the repeated blocks
    else:
        policy = BlockPolicy.parse(shard_blocks, field="shard_blocks")
    return matching_blocks(model, policy)


class FullyShard(ShardedState, SyncsBatchNorm, Collectives):
    name = "fsdp"
    summary = "FSDP2: parameters, gradients and optimizer state sharded over the processes"
    uses = ("shard_blocks",)

    @classmethod
    def check(cls, cfg: TrainConfig, world_size: int | None) -> None:
        if cfg.shard_blocks is not None:
            BlockPolicy.parse(cfg.shard_blocks, field="shard_blocks")

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        # torch.distributed.fsdp takes most of a second to import: only when used.
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.shard_mesh()
        if self.cfg.precision == "bf16-mixed":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        model = self.with_synced_batch_norm(model)
        units = shard_units(model, self.cfg.shard_blocks)
        self.units = [name for name, _ in units]
        for _, block in units:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)  # the module itself becomes an FSDPModule
        self.model = self.module = model

    def shard_mesh(self) -> Any:
        """The mesh the parameters are sharded over: every process."""
        return device_mesh(self.device.type, (torch.distributed.get_world_size(),))

    @classmethod
    def with_tensor_parallel(cls) -> type[Strategy]:
        return FullyShardTensorParallel

    @contextmanager
    def _without_gradient_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def no_sync(self) -> Any:
        return self._without_gradient_sync()

    def optimizer_params(self, prepared: list[nn.Parameter]) -> list[nn.Parameter]:
        # fully_shard replaced every parameter by a sharded one: the optimizer takes those.
        return trained_parameters(self.model)


class FullyShardTensorParallel(TensorParallel, FullyShard):
    """fsdp with ``--tp``: the plan first, then FSDP over the data-parallel dimension of the mesh
    (2D: each rank holds 1/dp of its tensor-parallel shard)."""

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        super().wrap(self.apply_plan(model, example), example)

    def shard_mesh(self) -> Any:
        return self.mesh["dp"]
