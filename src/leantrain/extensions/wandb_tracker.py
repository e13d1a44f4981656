"""Weights & Biases (``--logger wandb``, ``--wandb-project``); ``WANDB_MODE=offline`` needs no network."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Modes in which W&B writes files and talks to no server.
_LOCAL_MODES = ("offline", "dryrun", "disabled")


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str | None, run_dir: Path, timeout: float) -> None:
        import wandb

        self.wandb = wandb
        self.project = project or "leantrain"
        self.run_dir = run_dir
        self.run: Any = None
        # The mode and server W&B will use, read from the environment without starting its service.
        settings = wandb.Settings()
        settings.update_from_env_vars(dict(os.environ))
        self.offline = settings.mode in _LOCAL_MODES
        server = f"{run_dir / 'wandb'} (offline, " if self.offline else f"{settings.base_url} ("
        self.where = f"{server}project {self.project})"
        # W&B's own bounds on opening and closing a run (its default waits for every upload at the
        # end, and at exit); a value the user set in WANDB_INIT_TIMEOUT/WANDB_FINISH_TIMEOUT is kept.
        bounds = {"init_timeout": timeout, "finish_timeout": timeout}
        self.bounds = {
            key: value for key, value in bounds.items() if f"WANDB_{key.upper()}" not in os.environ
        }

    def connect(self) -> None:
        """Online: the server accepts the API key (offline there is nothing to reach)."""
        if not self.offline:
            self.wandb.login(verify=True, prompt=False)

    def start(self, params: dict[str, Any], run_key: str, resumed: bool) -> None:
        # The key is the W&B run id; resume="allow" continues that run (offline: synced as one).
        self.run = self.wandb.init(
            project=self.project,
            dir=str(self.run_dir),
            name=self.run_dir.name,
            id=run_key,
            resume="allow",
            config=None if resumed else params,
            settings=self.wandb.Settings(silent=True, console="off", **self.bounds),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            # Prefixed: W&B's summary also holds each metric's last logged value, and the last
            # history row, flushed at finish, would overwrite a value of the same name.
            self.run.summary.update({f"summary/{key}": value for key, value in summary.items()})
        self.run.finish(exit_code=0 if summary is not None else 1)
