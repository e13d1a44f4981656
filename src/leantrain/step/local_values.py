"""Each rank's own values of tensors that may be distributed, for foreach kernels.

Under tensor parallelism a rank holds a mix: ``DTensor`` shards of the planned layers (of one
mesh, or two once FSDP shards them further) and whole tensors of the rest. torch's foreach
kernels refuse such a mix. Elementwise arithmetic needs no communication: on each rank's local
values (a DTensor's local shard is a view, so in-place kernels write the DTensor) it is what
one process computes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def local_values(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with each DTensor replaced by its local shard (a view)."""
    return [tensor.to_local() if hasattr(tensor, "to_local") else tensor for tensor in tensors]
