from __future__ import annotations

import csv
import math
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2

from leantrain.log.sinks import CSVSink, TensorBoardSink, tensorboard_tag
from leantrain.log.tfevents import Crc32c, EventFileWriter


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


def test_a_resumed_csv_drops_rows_that_are_not_rows_instead_of_failing(tmp_path):
    """A crash mid-write tears the last row; a power loss can leave zeros; a person may edit the file."""
    path = tmp_path / "metrics.csv"
    path.write_bytes(b"step,train_loss\n10,1.5\n20,1.0\n,0.7\nx,0.6\n\x00\x00\x00\n\xff\xfe,0.1\n30,0.5\n")
    sink = CSVSink(path, keep_until_step=20)
    sink.write(30, {"train_loss": 0.4})
    sink.close()
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["train_loss"]) for r in rows] == [("10", "1.5"), ("20", "1.0"), ("30", "0.4")]


def test_tensorboard_writes_event_files(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.write(1, {"train_loss": 2.0, "val_accuracy": 0.5, "bad": float("nan")})
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "val/accuracy"}  # non-finite values are left out
    assert events.Scalars("train/loss")[0].value == 2.0


def test_tensorboard_tags_group_train_and_val():
    assert tensorboard_tag("val_loss") == "val/loss"
    assert tensorboard_tag("train_loss") == "train/loss"
    assert tensorboard_tag("samples_per_second") == "train/samples_per_second"
    assert tensorboard_tag("val_top5_accuracy") == "val/top5_accuracy"  # split at the first underscore
    assert tensorboard_tag("train_grad_norm") == "train/grad_norm"


def read_scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard itself reads from the folder's event files."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_tensorboard_keeps_every_value_as_float32_and_a_huge_one_as_infinity(tmp_path):
    sink = TensorBoardSink(tmp_path)
    for step, value in enumerate([0.1, 2.5, 1e300, -7.0], start=1):
        sink.write(step, {"train_loss": value, "lr": 3e-4})
    sink.close()
    assert read_scalars(tmp_path, "train/loss") == [
        (1, pytest.approx(0.1, rel=1e-7)),
        (2, 2.5),
        (3, math.inf),
        (4, -7.0),
    ]
    assert [step for step, _ in read_scalars(tmp_path, "train/lr")] == [1, 2, 3, 4]


def test_a_resumed_run_hides_what_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    first = TensorBoardSink(tmp_path)
    for step in range(1, 6):
        first.write(step, {"train_loss": float(step)})
    first.close()  # interrupted after step 5; the checkpoint was of step 3
    resumed = TensorBoardSink(tmp_path, keep_until_step=3)
    for step in (4, 5, 6):
        resumed.write(step, {"train_loss": 10.0 * step})
    resumed.close()
    kept_then_new = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert read_scalars(tmp_path, "train/loss") == kept_then_new


def test_crc32c_is_the_castagnoli_checksum():
    crc32c = Crc32c()
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"") == 0


def test_every_event_is_what_tensorboards_own_protocol_buffers_read_field_by_field(tmp_path):
    """Each record's checksums (TensorBoard's reader checks them) and fields, the version event, the restart
    of a resumed run, steps past one varint byte, float32's largest value kept and past it infinity."""
    before = time.time()
    writer = EventFileWriter(tmp_path / "a" / "new" / "folder", restart_step=300)
    writer.add_scalars(2**40, {"train/loss": 0.5, "train/max": 3.4028234663852886e38, "val/loss": 3e39})
    writer.close()
    raws = list(RawEventFileLoader(str(writer.path)).Load())
    version, restart, values = events = [event_pb2.Event.FromString(raw) for raw in raws]
    for event in events:  # no field TensorBoard does not know and would skip
        whole = event.SerializeToString()
        event.DiscardUnknownFields()
        assert event.SerializeToString() == whole
    assert (version.file_version, version.step) == ("brain.Event:2", 0)
    assert (restart.session_log.status, restart.step) == (event_pb2.SessionLog.START, 300)
    assert values.step == 2**40
    assert [(value.tag, value.simple_value) for value in values.summary.value] == [
        ("train/loss", 0.5), ("train/max", 3.4028234663852886e38), ("val/loss", math.inf)]  # fmt: skip
    assert all(before <= event.wall_time <= time.time() for event in (version, restart, values))


def test_a_fresh_run_hides_nothing_that_an_earlier_file_in_its_folder_holds(tmp_path):
    """Only a resumed run writes the restart event that makes TensorBoard drop later steps of older files."""
    older = TensorBoardSink(tmp_path)
    older.write(1, {"train_loss": 1.0})
    older.close()
    fresh = TensorBoardSink(tmp_path)
    assert fresh.path.parent == tmp_path and fresh.path.name.startswith("events.out.tfevents.")
    fresh.write(2, {"train_loss": 2.0})
    fresh.close()
    events = [event_pb2.Event.FromString(raw) for raw in RawEventFileLoader(str(fresh.path)).Load()]
    assert [event.HasField("session_log") for event in events] == [False, False]
    assert read_scalars(tmp_path, "train/loss") == [(1, 1.0), (2, 2.0)]
