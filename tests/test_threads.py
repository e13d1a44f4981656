"""Compute threads beside loader workers: lowered for the run on the CPU, restored after, and a
count the user chose left alone (docs/data.md)."""

from __future__ import annotations

import os

import pytest
import torch

import leantrain as lt
from leantrain import runtime
from leantrain.launch.torchrun import cpus_divided
from leantrain.runtime import THREADS_FROM_LAUNCH, compute_threads_restored, leave_cpus_to_workers
from tests.conftest import ReadEachStep, RegressionTask, quiet_config


@pytest.fixture
def four_default_threads(monkeypatch):
    """A process whose torch default is 4 threads on 4 CPUs, whatever this machine has."""
    before = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", THREADS_FROM_LAUNCH):
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(4)
    monkeypatch.setattr(runtime, "_THREADS_AT_IMPORT", 4)
    monkeypatch.setattr("leantrain.data.workers.available_cpus", lambda: 4)
    yield
    torch.set_num_threads(before)


def test_workers_get_the_cpus_and_the_count_comes_back(four_default_threads):
    with compute_threads_restored():
        note = leave_cpus_to_workers(workers=3, cpus=4)
        assert torch.get_num_threads() == 1
        assert note.startswith("compute threads: 1 (was 4): 3 loader worker(s)")
    assert torch.get_num_threads() == 4
    assert leave_cpus_to_workers(workers=0, cpus=4) is None and torch.get_num_threads() == 4


@pytest.mark.parametrize("chosen_by", ["OMP_NUM_THREADS", "MKL_NUM_THREADS", "set_num_threads"])
def test_a_count_the_user_chose_is_left_alone(four_default_threads, monkeypatch, chosen_by):
    if chosen_by == "set_num_threads":
        torch.set_num_threads(3)
    else:
        monkeypatch.setenv(chosen_by, "4")
    expected = torch.get_num_threads()
    assert leave_cpus_to_workers(workers=2, cpus=4) is None
    assert torch.get_num_threads() == expected


def test_the_launchers_own_share_may_still_be_lowered(four_default_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv(THREADS_FROM_LAUNCH, "1")
    with compute_threads_restored():
        assert leave_cpus_to_workers(workers=2, cpus=4) is not None
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize(("workers", "expected"), [(0, 4), (1, 3), (2, 2)])
def test_fit_trains_with_what_the_workers_leave(four_default_threads, tmp_path, capsys, workers, expected):
    threads = ReadEachStep(torch.get_num_threads)
    # On the CPU: a run on a GPU leaves the threads alone (its compute is not on the cores the workers use).
    config = quiet_config(
        tmp_path, global_batch_size=32, max_steps=4, num_workers=workers, progress="plain", device="cpu"
    )
    result = lt.Trainer(config, callbacks=[threads]).fit(RegressionTask())
    assert threads.seen() == {expected} and result.compute_threads == expected
    assert torch.get_num_threads() == 4  # put back after the run
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compute threads:")]
    if workers == 0:
        assert said == []
    else:  # once, with the numbers
        [line] = said
        assert line.startswith(f"compute threads: {expected} (was 4): {workers} loader worker(s)"), line


def test_launch_divides_the_cpus_among_its_processes_and_puts_the_environment_back(four_default_threads):
    with cpus_divided(processes=2):
        assert os.environ["OMP_NUM_THREADS"] == "2" and os.environ[THREADS_FROM_LAUNCH] == "1"
    assert "OMP_NUM_THREADS" not in os.environ and THREADS_FROM_LAUNCH not in os.environ


def test_launch_keeps_the_users_omp_num_threads(four_default_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with cpus_divided(processes=2):
        assert os.environ["OMP_NUM_THREADS"] == "3" and THREADS_FROM_LAUNCH not in os.environ
