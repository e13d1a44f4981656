"""How the global batch is split: global batch = micro-batch x accumulation steps x data-parallel ranks.

The split changes how the work is cut, never the math: see ``step/accumulator.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from leantrain.config import TrainConfig


def configured_micro_batch(cfg: TrainConfig, world_size: int = 1) -> int:
    """The configured micro-batch size; ``auto`` starts from the whole per-process batch."""
    micro = cfg.micro_batch_size
    return micro if isinstance(micro, int) else cfg.global_batch_size // world_size


@dataclass(frozen=True)
class BatchSplit:
    """The split of the global batch: ``micro x accumulation x world = global``."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int = 1

    def __post_init__(self) -> None:
        per_rank = self.global_batch_size // self.world_size
        if per_rank * self.world_size != self.global_batch_size or per_rank % self.micro_batch_size:
            raise ValueError(f"inconsistent batch split {self}")

    @classmethod
    def from_config(cls, cfg: TrainConfig, world_size: int = 1) -> BatchSplit:
        """The configured split; ``micro_batch_size`` auto starts from the whole per-process batch."""
        cfg.validate(world_size)
        return cls(cfg.global_batch_size, configured_micro_batch(cfg, world_size), world_size)

    def with_micro_batch(self, micro_batch_size: int) -> BatchSplit:
        return BatchSplit(self.global_batch_size, micro_batch_size, self.world_size)

    def micro_batch_choices(self) -> list[int]:
        """Every micro-batch size that splits the per-process batch evenly, smallest first."""
        per_rank = self.per_rank_batch_size
        return [size for size in range(1, per_rank + 1) if per_rank % size == 0]

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def accumulation_steps(self) -> int:
        return self.per_rank_batch_size // self.micro_batch_size
