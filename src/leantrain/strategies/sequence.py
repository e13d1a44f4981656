"""Sequence parallelism's way in and out: a module's first input split by position over the
tensor-parallel group (``sequence_split``), or gathered whole again (``sequence_gather``). The first
input is the first positional argument, or without one the first tensor passed by keyword
(transformers calls its attention with ``hidden_states=``).

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

import torch
from torch import nn

from leantrain.errors import ConfigError


def add_sequence_moves(model: nn.Module, moves: dict[str, str], mesh: Any) -> None:
    """Hook each module of ``moves`` (name -> "split" or "gather") to move its first input."""
    for name, move in moves.items():
        change = _split if move == "split" else _gather
        model.get_submodule(name).register_forward_pre_hook(
            partial(_first_input, change, mesh), with_kwargs=True
        )


def _first_input(
    change: Any, mesh: Any, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with the first input replaced by ``change(mesh, input)``."""
    if args:
        return (change(mesh, args[0]), *args[1:]), kwargs
    name = next((key for key, value in kwargs.items() if isinstance(value, torch.Tensor)), None)
    if name is None:
        raise ConfigError(
            "tp", mesh.size(), f"{type(module).__name__} is given no tensor to move for sequence parallelism"
        )
    return args, {**kwargs, name: change(mesh, kwargs[name])}


def _split(mesh: Any, whole: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if whole.shape[1] % mesh.size():
        raise ConfigError(
            "tp",
            mesh.size(),
            f"must divide the sequence length {whole.shape[1]} that sequence parallelism splits "
            "(or --sequence-parallel false)",
        )
    shared = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
    return shared.redistribute(mesh, [Shard(1)]).to_local()


def _gather(mesh: Any, part: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(part, mesh, [Shard(1)], run_check=False).full_tensor()
