"""``slowdata``: a tiny model fed by CPU-heavy per-item work, so loading is the bottleneck.

Each item is a 48x48 image of oriented stripes (the class is the orientation), warped
by a random affine transform several times with bilinear resampling in NumPy: a few
milliseconds of CPU per item, against microseconds of model compute per sample. With
``num_workers=0`` the model waits for data; worker processes (or a cache of the
deterministic part) remove the wait.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SIZE = 48
CLASSES = 8


def _stripes(label: int, phase: float) -> np.ndarray:
    angle = np.pi * label / CLASSES
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
    return np.sin((x * np.cos(angle) + y * np.sin(angle)) * 0.6 + phase)


def _random_affine(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Small random rotation, scale and shift, resampled bilinearly (vectorised NumPy)."""
    angle, scale = rng.uniform(-0.15, 0.15), rng.uniform(0.9, 1.1)
    shift = rng.uniform(-2, 2, size=2)
    cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64) - SIZE / 2
    src_x = np.clip(cos * x - sin * y + SIZE / 2 + shift[0], 0, SIZE - 1.001)
    src_y = np.clip(sin * x + cos * y + SIZE / 2 + shift[1], 0, SIZE - 1.001)
    x0, y0 = src_x.astype(int), src_y.astype(int)
    fx, fy = src_x - x0, src_y - y0
    top = image[y0, x0] * (1 - fx) + image[y0, x0 + 1] * fx
    bottom = image[y0 + 1, x0] * (1 - fx) + image[y0 + 1, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


class SlowAugmentedStripes(Dataset):
    """Deterministic per index: item ``i`` uses a generator seeded from ``(seed, i)``."""

    def __init__(self, size: int = 4096, passes: int = 12, seed: int = 0) -> None:
        self.size, self.passes, self.seed = size, passes, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} items")
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(CLASSES))
        image = _stripes(label, rng.uniform(0, 2 * np.pi))
        for _ in range(self.passes):
            image = _random_affine(image, rng)
        image = image + rng.normal(0, 0.1, size=image.shape)
        return torch.from_numpy(image.astype(np.float32)).unsqueeze(0), label


class SlowDataTask:
    def __init__(self, size: int = 4096, passes: int = 12, lr: float = 3e-3) -> None:
        self.size, self.passes, self.lr = size, passes, lr

    def model(self) -> nn.Module:
        return nn.Sequential(
            nn.AvgPool2d(4), nn.Flatten(), nn.Linear((SIZE // 4) ** 2, 64), nn.ReLU(), nn.Linear(64, CLASSES)
        )

    def train_data(self) -> Dataset:
        return SlowAugmentedStripes(self.size, self.passes, seed=0)

    def val_data(self) -> Dataset:
        return SlowAugmentedStripes(self.size // 8, self.passes, seed=1)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch
        return {"accuracy": (model(images).argmax(dim=1) == labels).float().mean()}

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr)
