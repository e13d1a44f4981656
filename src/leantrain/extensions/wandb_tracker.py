"""Weights & Biases (``--logger wandb``, ``--wandb-project``); ``WANDB_MODE=offline`` needs no network.

The environment W&B reads itself is honoured where no flag says otherwise: ``WANDB_PROJECT`` (else
``leantrain``), ``WANDB_DIR`` (else the run folder), ``WANDB_NAME`` (else the run folder's name),
``WANDB_RUN_ID`` (log into that run), ``WANDB_ENTITY`` and ``WANDB_MODE`` (never passed by leantrain).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from leantrain.extensions.tracker_settings import choose

# Modes in which W&B writes files and talks to no server.
_LOCAL_MODES = ("offline", "dryrun", "disabled")


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str | None, run_dir: Path, timeout: float) -> None:
        import wandb

        self.wandb = wandb
        self.project, project_from = choose(project, "--wandb-project", "WANDB_PROJECT", "leantrain")
        self.run_dir = run_dir
        self.run: Any = None
        self.attach = os.environ.get("WANDB_RUN_ID") or None
        # The settings W&B will use, read from the environment without starting its service.
        settings = wandb.Settings()
        settings.update_from_env_vars(dict(os.environ))
        self.offline = settings.mode in _LOCAL_MODES
        # W&B writes into DIR/wandb: WANDB_DIR, else the run folder. Passed to init even when it comes
        # from the environment: W&B reads its environment once per process, so a second run in the same
        # process (a notebook, a test session) would otherwise write where the first one's WANDB_DIR said.
        self.dir_from = "WANDB_DIR" if os.environ.get("WANDB_DIR") else "default: the run folder"
        self.dir = Path(settings.root_dir) if os.environ.get("WANDB_DIR") else run_dir
        self.mode, self.entity = settings.mode, os.environ.get("WANDB_ENTITY") or None
        files = self.dir / "wandb"
        server = f"{files} (offline, " if self.offline else f"{settings.base_url} ("
        self.where = f"{server}project {self.project})"
        self.describe = self._describe(settings, files, project_from)
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

    def _describe(self, settings: Any, files: Path, project_from: str) -> str:
        """For the run's log: where it logs, and what chose each setting."""
        env = os.environ
        mode = f"{settings.mode} (WANDB_MODE)" if env.get("WANDB_MODE") else settings.mode
        parts = [mode if self.offline else f"{mode} to {settings.base_url}"]
        parts.append(f"files in {files} ({self.dir_from})")
        parts.append(f"project {self.project} ({project_from})")
        parts += [f"entity {settings.entity} (WANDB_ENTITY)"] if env.get("WANDB_ENTITY") else []
        parts += [f"run {self.attach} (WANDB_RUN_ID)"] if self.attach else []
        return ", ".join(parts)

    def start(self, params: dict[str, Any], run_key: str, resumed: bool) -> int | None:
        # The key is the W&B run id; resume="allow" continues that run (offline: synced as one). Every
        # setting read from the environment in __init__ is passed, not left to W&B's once-per-process read.
        self.run = self.wandb.init(
            project=self.project,
            entity=self.entity,
            dir=str(self.dir),
            name=os.environ.get("WANDB_NAME") or self.run_dir.name,
            mode=self.mode,
            id=run_key,
            resume="allow",
            config=None if resumed else params,
            settings=self.wandb.Settings(silent=True, console="off", **self.bounds),
        )
        if not resumed or self.offline:
            return None
        # Online, a continued run's next step is one past the last the server holds (offline: 0).
        step = int(self.run.step)
        return step - 1 if step > 0 else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            # Prefixed: W&B's summary also holds each metric's last logged value, and the last
            # history row, flushed at finish, would overwrite a value of the same name.
            self.run.summary.update({f"summary/{key}": value for key, value in summary.items()})
        self.run.finish(exit_code=0 if summary is not None else 1)
