"""MLflow (``--logger mlflow``, ``--mlflow-uri``), through ``MlflowClient``: no global active run.

The environment MLflow's own clients read is honoured where no flag says otherwise:
``MLFLOW_TRACKING_URI`` (else a SQLite file in the run folder), ``MLFLOW_EXPERIMENT_NAME`` (else
``leantrain``) and ``MLFLOW_RUN_ID`` (log into that existing run instead of creating one).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from leantrain.extensions.tracker_settings import choose

# MLflow's limit on a parameter's value (longer ones are refused).
_PARAM_LIMIT = 6000
_KEY_TAG = "leantrain.run_key"
# The values leantrain gave MLflow's HTTP settings in this process: one equal to them is ours to
# change (a later run's tracker_timeout), any other was set by the user and is kept.
_HTTP_SET: dict[str, str] = {}


def bound_http_requests(timeout: float) -> None:
    """MLflow's HTTP requests bounded by ``timeout`` (connect and read, each try) and 2 quick retries,
    for every value of ``MLFLOW_HTTP_REQUEST_*`` the user did not set. Its defaults (120 s, 7 retries
    with a growing backoff) keep a call to a silent server going for minutes. MLflow reads them at
    each request and takes no per-client setting: they stay in this process's environment."""
    bounds = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, math.ceil(timeout))),  # MLflow parses an integer
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    for name, value in bounds.items():
        current = os.environ.get(name)
        if current is None or current == _HTTP_SET.get(name):
            os.environ[name] = _HTTP_SET[name] = value


class MLflowTracker:
    name = "mlflow"

    def __init__(self, uri: str | None, run_dir: Path, timeout: float) -> None:
        from mlflow.tracking import MlflowClient

        # MLflow 3 refuses a folder ("file") store by default: a SQLite file in the run folder
        # is the local store that needs no server.
        local = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.uri, uri_from = choose(
            uri, "--mlflow-uri", "MLFLOW_TRACKING_URI", local, "default: the run folder"
        )
        self.where = _without_password(self.uri)  # messages name the server, never its credentials
        self.experiment, experiment_from = choose(None, "", "MLFLOW_EXPERIMENT_NAME", "leantrain")
        self.attach = os.environ.get("MLFLOW_RUN_ID") or None
        chosen = (
            f"run {self.attach} (MLFLOW_RUN_ID)"
            if self.attach
            else f"experiment {self.experiment} ({experiment_from})"
        )
        self.describe = f"{self.where} ({uri_from}), {chosen}"
        self.run_dir = run_dir
        bound_http_requests(timeout)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.experiment_id = ""
        self.run_id = ""

    def connect(self) -> None:
        """The first request of a run, and what a server must answer: the run ``MLFLOW_RUN_ID`` names
        exists, or the experiment is found or created."""
        if self.attach:
            self.experiment_id = self.client.get_run(self.attach).info.experiment_id
            return
        found = self.client.get_experiment_by_name(self.experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)

    def start(self, params: dict[str, Any], run_key: str, resumed: bool) -> int | None:
        from mlflow.entities import Param

        # MLflow picks its own run ids: the run carries leantrain's key as a tag to be found again
        # (with MLFLOW_RUN_ID, the key is that id, and the run is asked for by it).
        if self.attach:
            run = self.client.get_run(self.attach)
        else:
            if not self.experiment_id:
                self.connect()
            query = f"tags.{_KEY_TAG} = '{run_key}'"
            found = self.client.search_runs([self.experiment_id], query, max_results=1) if resumed else []
            run = found[0] if found else None
        created = run is None
        if run is None:
            run = self.client.create_run(
                self.experiment_id, run_name=self.run_dir.name, tags={_KEY_TAG: run_key}
            )
        self.run_id = run.info.run_id
        if run.info.status != "RUNNING":
            self.client.update_run(self.run_id, status="RUNNING")
        if created or not resumed:
            # MLflow refuses to change a parameter: those an attached run already has are kept.
            values = [Param(k, str(v)[:_PARAM_LIMIT]) for k, v in params.items() if k not in run.data.params]
            if values:
                self.client.log_batch(self.run_id, params=values)
        if not created and run.data.tags.get(_KEY_TAG) != run_key:  # attached: found again without it
            self.client.set_tag(self.run_id, _KEY_TAG, run_key)
        # What the run already holds: MLflow keeps each metric's latest value at its highest step.
        return max((metric.step for metric in run.data.to_proto().metrics), default=None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._metrics(step, metrics)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary is None:
            self.client.set_terminated(self.run_id, "KILLED")
            return
        numbers = {key: value for key, value in summary.items() if _number(value)}
        self._metrics(int(summary.get("steps", 0)), {f"summary/{k}": v for k, v in numbers.items()})
        for key, value in summary.items():
            if key not in numbers:
                self.client.set_tag(self.run_id, f"summary/{key}", str(value)[:_PARAM_LIMIT])
        self.client.set_terminated(self.run_id, "FINISHED")

    def _metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(key, float(value), now, step) for key, value in metrics.items() if _number(value)]
        self.client.log_batch(self.run_id, metrics=rows)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isinf(value)


def _without_password(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"))
