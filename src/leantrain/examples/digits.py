"""``digits``: a small CNN on the 8x8 handwritten digits that scikit-learn ships."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


@cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images (scaled to [0, 1]) and their labels, bundled with scikit-learn: no download.

    Read from scikit-learn's file with NumPy (20 ms): importing ``sklearn.datasets`` to read it took
    1.2 s, most of the start of a short run (``leantrain fit`` with no arguments, each launched rank).
    """
    found = importlib.util.find_spec("sklearn")  # located, not imported
    folder = found.submodule_search_locations if found else None
    bundled = Path(folder[0]) / "datasets" / "data" / "digits.csv.gz" if folder else None
    if bundled is not None and bundled.is_file():
        rows = np.loadtxt(bundled, delimiter=",")  # 64 pixels (0-16), then the label, per line
        images, labels = rows[:, :-1].reshape(-1, 8, 8), rows[:, -1]
    else:  # a scikit-learn that keeps the file elsewhere: its own reader
        from sklearn.datasets import load_digits

        data = load_digits()
        images, labels = data.images, data.target
    return (images / 16.0).astype(np.float32), labels.astype(np.int64)


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, classes)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


class DigitsTask:
    """Classify 8x8 digit images; a fixed 80/20 train/validation split."""

    def __init__(self, lr: float = 2e-3, width: int = 32, val_fraction: float = 0.2, dtype: str = "float32"):
        self.lr = lr
        self.width = width
        self.val_fraction = val_fraction
        self.dtype = getattr(torch, dtype)

    def _split(self, train: bool) -> TensorDataset:
        images, labels = _digits()
        order = np.random.default_rng(0).permutation(len(labels))  # fixed: same split for every seed
        n_val = int(len(labels) * self.val_fraction)
        chosen = order[n_val:] if train else order[:n_val]
        x = torch.from_numpy(images[chosen]).unsqueeze(1).to(self.dtype)
        return TensorDataset(x, torch.from_numpy(labels[chosen]))

    def model(self) -> nn.Module:
        return DigitsCNN(self.width).to(self.dtype)

    def train_data(self) -> TensorDataset:
        return self._split(train=True)

    def val_data(self) -> TensorDataset:
        return self._split(train=False)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch
        return {"accuracy": (model(images).argmax(dim=1) == labels).float().mean()}

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=1e-4)
