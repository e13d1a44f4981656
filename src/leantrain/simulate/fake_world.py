"""A world of N ranks inside this one process: torch's fake process group.

Its collectives return at once and move nothing; with fake tensors (no storage) that is all a
simulated step needs: the strategies shard, plan and gather exactly as they do over gloo or NCCL,
and every tensor keeps the shape and dtype it would have on the rank simulated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from leantrain.errors import LeantrainError


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """The default process group, for ``rank`` of ``world_size``, while the block runs."""
    # Registers the "fake" backend (torch's testing package; about a second, once).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise LeantrainError(
            "leantrain plan --cluster simulates the ranks in one process: run it as one process, not "
            "under torchrun or leantrain launch"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
