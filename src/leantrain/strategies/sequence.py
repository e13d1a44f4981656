"""Sequence parallelism's way in and out: a module's first input split by position over the
tensor-parallel group (``sequence_split``), or gathered whole again (``sequence_gather``).

Between the two, each rank holds its share of the positions: the norms run on it
(``sequence_parallel``), a ``sequence_colwise`` layer all-gathers it before its product and a
``sequence_rowwise`` layer reduce-scatters its output back into it; the activations kept for
backward outside the split matrices are 1/N as large. Both moves go through DTensor, so their
backward is the matching collective: the gradient of a split input is gathered whole again, the
gradient of a gathered one is cut to each rank's share.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from leantrain.errors import ConfigError


def add_sequence_moves(model: nn.Module, moves: dict[str, str], mesh: Any) -> None:
    """Hook each module of ``moves`` (name -> "split" or "gather") to move its first input."""
    for name, move in moves.items():
        hook = _split_first_input if move == "split" else _gather_first_input
        model.get_submodule(name).register_forward_pre_hook(partial(hook, mesh))


def _split_first_input(mesh: Any, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole, *rest = args
    if whole.shape[1] % mesh.size():
        raise ConfigError(
            "tp",
            mesh.size(),
            f"must divide the sequence length {whole.shape[1]} that sequence parallelism splits "
            "(or --sequence-parallel false)",
        )
    shared = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
    return (shared.redistribute(mesh, [Shard(1)]).to_local(), *rest)


def _gather_first_input(mesh: Any, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Shard

    part, *rest = args
    return (DTensor.from_local(part, mesh, [Shard(1)], run_check=False).full_tensor(), *rest)
