"""The trackers against their real libraries: MLflow in a SQLite store, W&B offline."""

from __future__ import annotations

import csv
import json
import time
import warnings
from pathlib import Path

import pytest

import leantrain as lt
from tests.conftest import TinyClassifier, quiet_config
from tests.test_resume import StopAt

RUN = dict(global_batch_size=64, max_steps=8, log_every_n_steps=2, val_every_n_steps=4)


def csv_steps(run_dir: Path, column: str) -> list[int]:
    with (run_dir / "metrics.csv").open() as rows:
        return sorted(int(row["step"]) for row in csv.DictReader(rows) if row.get(column))


def mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("leantrain")
    runs = client.search_runs([experiment.experiment_id])
    return client, runs


def history_steps(client, run_id: str, metric: str) -> list[int]:
    return sorted({m.step for m in client.get_metric_history(run_id, metric)})


def test_mlflow_gets_the_config_the_rows_of_metrics_csv_and_the_summary_in_one_run_across_a_resume(tmp_path):
    pytest.importorskip("mlflow")
    out, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = dict(RUN, logger="mlflow", mlflow_uri=uri, checkpoint_every=2)
    started_ms = time.time() * 1000
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(out, **settings), callbacks=[StopAt(5)]).fit(TinyClassifier())
    _, runs = mlflow_run(uri)
    assert [r.info.status for r in runs] == ["KILLED"]
    result = lt.Trainer(quiet_config(out, **settings, resume="auto")).fit(TinyClassifier())
    client, runs = mlflow_run(uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # one run, continued
    run = runs[0]
    assert run.data.params["global_batch_size"] == "64" and run.data.params["logger"] == "mlflow"
    for metric in ("train_loss", "val_loss", "val_accuracy", "lr"):
        assert history_steps(client, run.info.run_id, metric) == csv_steps(out, metric), metric
    assert run.data.metrics["summary/steps"] == result.steps == 8
    assert run.data.metrics["summary/final_train_loss"] == pytest.approx(result.final_train_loss)
    [steps] = client.get_metric_history(run.info.run_id, "summary/steps")
    assert steps.step == 8  # the summary sits at the last step, beside the last rows
    # metrics carry the time they were logged, in milliseconds
    assert started_ms <= steps.timestamp <= time.time() * 1000
    # what is not a number is a tag: the summary's strings and its flags
    assert run.data.tags["summary/strategy"] == "single" and run.data.tags["summary/stopped_early"] == "False"
    assert "summary/strategy" not in run.data.metrics and "summary/steps" not in run.data.tags


def test_a_resumed_mlflow_run_continues_its_own_run_not_the_experiments_latest(tmp_path):
    """Two runs log to one experiment; the first, killed, resumes after the second ran: it must find its
    own MLflow run by its key, not take the newest run of the experiment."""
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = dict(RUN, logger="mlflow", mlflow_uri=uri, checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(tmp_path / "first", **settings), callbacks=[StopAt(5)]).fit(TinyClassifier())
    lt.Trainer(quiet_config(tmp_path / "second", **settings)).fit(TinyClassifier())
    lt.Trainer(quiet_config(tmp_path / "first", **settings, resume="auto")).fit(TinyClassifier())
    client, runs = mlflow_run(uri)
    by_name = {run.info.run_name: run for run in runs}
    assert sorted(by_name) == ["first", "second"]
    for name, run in by_name.items():
        assert run.info.status == "FINISHED", name
        steps = history_steps(client, run.info.run_id, "train_loss")
        assert steps == csv_steps(tmp_path / name, "train_loss") == [2, 4, 6, 8], name


def test_a_continued_mlflow_run_runs_again_and_one_made_at_a_resume_gets_the_config(tmp_path, monkeypatch):
    """Opening the MLflow run of a resumed leantrain run: a killed one is set running again (its
    parameters kept); none of its key yet (the first part logged nowhere), one is made with them."""
    pytest.importorskip("mlflow")
    from leantrain.extensions.mlflow_tracker import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = MLflowTracker(uri, tmp_path / "run", 10)
    first.start({"lr": 0.1}, "key-1", resumed=False)
    first.finish(None)
    client, [killed] = mlflow_run(uri)
    assert killed.info.status == "KILLED"
    updates = []  # status changes asked of the server: only for a run that is not running
    update_run = type(client).update_run
    monkeypatch.setattr(
        type(client), "update_run", lambda self, *a, **k: updates.append((a, k)) or update_run(self, *a, **k)
    )
    again = MLflowTracker(uri, tmp_path / "run", 10)
    again.start({"lr": 0.1}, "key-1", resumed=True)
    assert again.run_id == killed.info.run_id and client.get_run(again.run_id).info.status == "RUNNING"
    made = MLflowTracker(uri, tmp_path / "other", 10)
    made.start({"lr": 0.2}, "key-2", resumed=True)
    assert made.run_id != killed.info.run_id and client.get_run(made.run_id).data.params == {"lr": "0.2"}
    assert updates == [((killed.info.run_id,), {"status": "RUNNING"})]  # not the new run, made running
    # a run of the user's own, named by MLFLOW_RUN_ID: it gets the key's tag, to be found by it again
    theirs = client.create_run(killed.info.experiment_id).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", theirs)
    attached = MLflowTracker(uri, tmp_path / "third", 10)
    attached.connect()  # tracker_required's check: the run's own experiment
    assert attached.experiment_id == killed.info.experiment_id
    attached.start({"lr": 0.3}, "key-3", resumed=False)
    assert attached.run_id == theirs and client.get_run(theirs).data.tags["leantrain.run_key"] == "key-3"


def test_a_tracker_that_fails_mid_run_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from leantrain.extensions.mlflow_tracker import MLflowTracker

    calls = []

    def server_down(self, step, metrics):
        calls.append(step)
        raise ConnectionError("API request to http://tracking:5000 failed")

    monkeypatch.setattr(MLflowTracker, "log", server_down)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lt.Trainer(quiet_config(tmp_path / "run", **RUN, logger="mlflow", mlflow_uri=uri)).fit(
            TinyClassifier()
        )
    assert result.steps == 8 and calls == [2]  # switched off after the first failure
    texts = [str(w.message) for w in caught if issubclass(w.category, lt.LeantrainWarning)]
    assert [t for t in texts if "logger mlflow" in t] == [
        f"logger mlflow at {uri} failed and is switched off for this run (ConnectionError: API request "
        "to http://tracking:5000 failed); training goes on, metrics.csv has every value"
    ]
    assert csv_steps(tmp_path / "run", "train_loss") == [2, 4, 6, 8]


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B offline file: a 7-byte file header, then LevelDB's log format (32 KiB
    blocks of records, each a 7-byte header: CRC, little-endian length, type; long records are
    split into FIRST, MIDDLE and LAST pieces). wandb 0.31 ships no Python reader of its own."""
    data, block, position = path.read_bytes(), 32768, 7
    records, pending = [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        piece = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):  # FULL, LAST
            records.append(pending)
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_history(run_dir: Path) -> tuple[list[dict], dict]:
    """The history rows and the final summary of the W&B offline run(s) in ``run_dir``."""
    from wandb.proto import wandb_internal_pb2

    rows, summary = [], {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.HasField("history"):
                rows.append({_key(item): json.loads(item.value_json) for item in record.history.item})
            if record.HasField("summary"):
                summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    return rows, summary


def test_wandb_offline_writes_the_metrics_and_the_summary_under_one_run_id_across_a_resume(
    tmp_path, monkeypatch
):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    settings = dict(RUN, logger="wandb,tensorboard", wandb_project="tests", checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(out, **settings), callbacks=[StopAt(5)]).fit(TinyClassifier())
    result = lt.Trainer(quiet_config(out, **settings, resume="auto")).fit(TinyClassifier())
    # Offline, each process writes a folder of its own, holding run-<id>.wandb: one id, two folders.
    runs = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and len({path.name for path in runs}) == 1, runs
    history, summary = wandb_history(out)
    deadline = time.monotonic() + 20  # W&B's own process may still be writing the resumed run's file
    while len({row["_step"] for row in history if "train_loss" in row}) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
        history, summary = wandb_history(out)
    assert sorted({row["_step"] for row in history if "train_loss" in row}) == csv_steps(out, "train_loss")
    assert sorted({row["_step"] for row in history if "val_loss" in row}) == csv_steps(out, "val_loss")
    assert summary["summary/steps"] == result.steps == 8
    assert summary["summary/samples_per_second"] == result.samples_per_second
    assert summary["summary/strategy"] == "single"
    assert list(out.glob("events.out.tfevents.*"))  # TensorBoard beside it


def test_a_tracker_that_is_not_installed_is_a_one_line_error_before_the_run(tmp_path, monkeypatch):
    import leantrain.extensions.trackers as trackers

    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(lt.ConfigError, match=r"^invalid logger='wandb': needs the wandb package: pip install "
                       r"'leantrain\[wandb\]'$"):  # fmt: skip
        lt.Trainer(quiet_config(tmp_path / "run", **RUN, logger="tensorboard,wandb")).fit(TinyClassifier())
    assert not (tmp_path / "run").exists()
