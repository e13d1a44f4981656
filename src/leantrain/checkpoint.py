"""Saving the trained weights (``model.safetensors``)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_model
from torch import nn

from leantrain.files import atomic_write


def export_weights(model: nn.Module, path: Path) -> None:
    """Write the model's weights as safetensors, atomically; tied weights are stored once."""
    atomic_write(Path(path), lambda tmp: save_model(model, str(tmp)))
