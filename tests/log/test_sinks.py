from __future__ import annotations

import csv

from leantrain.log.sinks import CSVSink, TensorBoardSink, tensorboard_tag


def test_csv_gains_late_columns_without_losing_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    sink = CSVSink(path)
    sink.write(10, {"train_loss": 1.5})
    sink.write(20, {"train_loss": 1.0})
    sink.write(20, {"val_loss": 0.9})
    sink.write(30, {"train_loss": 0.5})
    sink.close()
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["10", "20", "20", "30"]
    assert rows[2]["val_loss"] == "0.9" and rows[2]["train_loss"] == ""
    assert rows[3]["train_loss"] == "0.5"


def test_tensorboard_writes_event_files(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write(1, {"train_loss": 2.0, "val_accuracy": 0.5, "bad": float("nan")})
    sink.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "val/accuracy"}  # non-finite values are left out
    assert events.Scalars("train/loss")[0].value == 2.0


def test_tensorboard_tags_group_train_and_val():
    assert tensorboard_tag("val_loss") == "val/loss"
    assert tensorboard_tag("train_loss") == "train/loss"
    assert tensorboard_tag("samples_per_second") == "train/samples_per_second"
