"""Weights & Biases (``--logger wandb``, ``--wandb-project``); ``WANDB_MODE=offline`` needs no network."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str | None, run_dir: Path) -> None:
        import wandb

        self.wandb = wandb
        self.project = project or "leantrain"
        self.run_dir = run_dir
        self.run: Any = None

    def start(self, params: dict[str, Any], run_key: str, resumed: bool) -> None:
        # The key is the W&B run id; resume="allow" continues that run (offline: synced as one).
        self.run = self.wandb.init(
            project=self.project,
            dir=str(self.run_dir),
            name=self.run_dir.name,
            id=run_key,
            resume="allow",
            config=None if resumed else params,
            settings=self.wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            # Prefixed: W&B's summary also holds each metric's last logged value, and the last
            # history row, flushed at finish, would overwrite a value of the same name.
            self.run.summary.update({f"summary/{key}": value for key, value in summary.items()})
        self.run.finish(exit_code=0 if summary is not None else 1)
