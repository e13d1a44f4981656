"""Tasks for the multi-process tests, importable by worker processes as ``tests.distributed.tasks:NAME``."""

from __future__ import annotations

from tests.conftest import RegressionTask


def mean_task() -> RegressionTask:
    return RegressionTask(loss_kind="mean")


def sum_task() -> RegressionTask:
    """Per-sample element counts of 1..4: every rank's LossSum count differs."""
    return RegressionTask(loss_kind="sum")
