"""MLflow (``--logger mlflow``, ``--mlflow-uri``), through ``MlflowClient``: no global active run."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

# MLflow's limit on a parameter's value (longer ones are refused).
_PARAM_LIMIT = 6000
_KEY_TAG = "leantrain.run_key"


class MLflowTracker:
    name = "mlflow"

    def __init__(self, uri: str | None, run_dir: Path) -> None:
        from mlflow.tracking import MlflowClient

        # MLflow 3 refuses a folder ("file") store by default: a SQLite file in the run folder
        # is the local store that needs no server.
        self.uri = uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.run_dir = run_dir
        self.client = MlflowClient(tracking_uri=self.uri)
        self.run_id = ""

    def start(self, params: dict[str, Any], run_key: str, resumed: bool) -> None:
        from mlflow.entities import Param

        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "leantrain")
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        # MLflow picks its own run ids: the run carries leantrain's key as a tag to be found again.
        if resumed:
            runs = self.client.search_runs([experiment_id], f"tags.{_KEY_TAG} = '{run_key}'", max_results=1)
            if runs:
                self.run_id = runs[0].info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
                return  # its parameters were logged when it began (MLflow refuses to change them)
        run = self.client.create_run(experiment_id, run_name=self.run_dir.name, tags={_KEY_TAG: run_key})
        self.run_id = run.info.run_id
        values = [Param(key, str(value)[:_PARAM_LIMIT]) for key, value in params.items()]
        self.client.log_batch(self.run_id, params=values)

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
