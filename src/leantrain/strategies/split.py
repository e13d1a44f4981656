"""``--strategy split --device-map D0,D1,...``: one process, the model cut into consecutive parts.

The model's repeated blocks (as for activation checkpointing) are divided in order into as
many runs as there are devices, balanced by block count: part ``i`` runs on device ``Di``.
Modules registered before the first block (embeddings) go with the first part, modules
after the last block (final norm, head) with the last. A forward pre-hook on every placed
module moves the tensors it receives to its device, so activations travel from part to
part; inputs arrive on the first device (the run's device), and the model's output is
moved back there, beside the batch's targets, so the task's loss runs unchanged. Weights
tied across parts stay with their first user, and the hook takes its inputs there.

One device computes at a time: a split is for a model that does not fit one device, not
for speed (``pipeline`` keeps several busy). The devices may all be the CPU, which is how
it is tested without GPUs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from leantrain.blocks import BlockPolicy, matching_blocks
from leantrain.config import TrainConfig
from leantrain.errors import ConfigError
from leantrain.runtime import resolve_device
from leantrain.strategies.base import Example, Strategy


def parse_device_map(text: str) -> list[torch.device]:
    """``"cuda:0,cuda:1"`` -> devices; a ConfigError naming ``device_map`` otherwise."""
    names = [name.strip() for name in text.split(",")]
    try:
        devices = [torch.device(name) for name in names if name]
    except RuntimeError:
        devices = []
    if len(devices) < 2 or len(devices) != len(names):
        raise ConfigError("device_map", text, "needs two or more comma-separated devices, e.g. cuda:0,cuda:1")
    return devices


def balanced_parts(count: int, parts: int) -> list[int]:
    """The part of each of ``count`` consecutive items, ``parts`` runs as equal as they can be."""
    return [index * parts // count for index in range(count)]


def placement(model: nn.Module, parts: int) -> dict[str, int]:
    """Module name -> part, for the repeated blocks and for the modules around them that hold
    tensors: before the first block, part 0; after a block, that block's part."""
    blocks = [name for name, _ in matching_blocks(model, BlockPolicy(field="device_map"))]
    if len(blocks) < parts:
        raise ConfigError(
            "device_map", f"{parts} devices", f"needs as many repeated blocks; the model has {len(blocks)}"
        )
    block_part = dict(zip(blocks, balanced_parts(len(blocks), parts), strict=True))
    where: dict[str, int] = {}
    current = 0
    for name, module in model.named_modules():
        if name in block_part:
            current = where[name] = block_part[name]
        elif (
            name and not any(name.startswith(block + ".") for block in block_part) and _holds_tensors(module)
        ):
            where[name] = current
    return where


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors on ``device``; containers keep their class (a transformers
    ``ModelOutput`` is a dict whose fields are also attributes; a named tuple takes its fields apart)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to_device(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        moved = copy.copy(value)
        for key, item in value.items():
            moved[key] = _to_device(item, device)
        return moved
    return value


class Split(Strategy):
    """One process; the model's parts on their devices, activations moved between them."""

    name = "split"
    summary = "one process, the model's consecutive parts on the devices of device_map"
    precisions = ("32", "bf16-mixed", "16-mixed")
    needs = ("device_map",)

    @classmethod
    def check(cls, cfg: TrainConfig, world_size: int | None) -> None:
        parse_device_map(cfg.device_map or "")

    @classmethod
    def input_device(cls, cfg: TrainConfig, device: torch.device) -> torch.device:
        """The first device of the map (each must exist here: a one-line ConfigError otherwise)."""
        devices = [resolve_device(str(part)) for part in parse_device_map(cfg.device_map or "")]
        return devices[0]

    @classmethod
    def build_device(cls, device: torch.device) -> torch.device:
        """The CPU: each part then moves to its own device (the whole model need not fit the first)."""
        return torch.device("cpu")

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        self.model = self.module = model
        self.devices = devices = parse_device_map(self.cfg.device_map or "")
        self.placement = placement(model, len(devices))
        modules = dict(model.named_modules())
        moved: set[int] = set()
        for name, part in self.placement.items():
            module = modules[name]
            for tensor in [*module.parameters(), *module.buffers()]:
                if id(tensor) not in moved:  # a tied weight stays with its first user
                    moved.add(id(tensor))
                    tensor.data = tensor.data.to(devices[part])
            home = next(iter(module.parameters()), None)
            module.register_forward_pre_hook(self._mover(home.device if home is not None else devices[part]),
                                             with_kwargs=True)  # fmt: skip

        # The output comes back to the inputs' device, where the batch's targets are: the
        # task's loss then works unchanged.
        model.register_forward_hook(lambda module, args, output: _to_device(output, devices[0]))

    @staticmethod
    def _mover(device: torch.device) -> Any:
        def move_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _to_device(args, device), _to_device(kwargs, device)

        return move_inputs

    def parts(self) -> list[list[str]]:
        """The placed module names of each part, in device-map order."""
        return [[n for n, p in self.placement.items() if p == part] for part in range(len(self.devices))]
