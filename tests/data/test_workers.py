from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch.utils.data import Dataset

from leantrain.data.loader import build_loader
from leantrain.data.workers import (
    MAX_AUTO_WORKERS,
    TuneResult,
    auto_prefetch,
    auto_workers,
    available_cpus,
    cgroup_cpu_quota,
    tune_candidates,
    tune_workers,
)


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_quota_is_read_from_v2_or_v1_files(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == quota


def test_a_quota_caps_the_cpus_of_the_affinity_mask(tmp_path):
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one
    assert available_cpus(tmp_path) == 1
    assert available_cpus(tmp_path / "none") >= 1


@pytest.mark.parametrize(
    ("cpus", "processes", "workers"), [(8, 2, 4), (2, 4, 1), (2, 1, 2), (128, 1, MAX_AUTO_WORKERS)]
)
def test_auto_gives_each_process_its_share_of_the_cpus(cpus, processes, workers):
    assert auto_workers(processes, cpus) == workers


def test_auto_prefetch_keeps_two_steps_in_flight():
    assert auto_prefetch(workers=2, accumulation_steps=4) == 4
    assert auto_prefetch(workers=8, accumulation_steps=1) == 2
    assert auto_prefetch(workers=1, accumulation_steps=4) == 8  # one worker loads both steps ahead


def test_tune_candidates_go_up_to_the_share_of_the_cpus():
    """4 workers on 2 CPUs won a trial by chance and torch warned that its suggested maximum is 2."""
    assert tune_candidates(2, 1) == [0, 1, 2]
    assert tune_candidates(8, 4) == [0, 1, 2]
    assert tune_candidates(6, 1) == [0, 1, 2, 4, 6]
    assert tune_candidates(2, 2) == [0, 1]
    assert tune_candidates(1, 4) == [0, 1]


class Sleepy(Dataset):
    """Each item waits 4 ms without using the CPU: more workers load proportionally faster."""

    def __len__(self):
        return 400

    def __getitem__(self, index):
        time.sleep(0.004)
        return index


def test_tune_measures_and_keeps_a_faster_count():
    result = tune_workers(
        lambda workers, batches: build_loader(Sleepy(), "d", batch_sampler=batches, num_workers=workers),
        [list(range(i, i + 8)) for i in range(0, 400, 8)],
        candidates=[0, 4],
        batches_per_trial=6,
    )
    assert set(result.samples_per_second) == {0, 4}
    assert result.workers == 4 and result.samples_per_second[4] > 2 * result.samples_per_second[0]
    assert "4 is fastest" in result.report()


def test_tune_counts_samples_not_the_fields_of_a_batch(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr("leantrain.data.workers.time.perf_counter", lambda: float(next(clock)))  # 1 s a trial

    def loader(workers, batches):  # collated (inputs, labels) pairs: len() of one is 2
        return iter([(torch.zeros(len(b)), torch.zeros(len(b))) for b in batches])

    result = tune_workers(loader, [list(range(8))] * 10, candidates=[0, 2], batches_per_trial=3)
    assert result.samples_per_second == {0: 24.0, 2: 24.0} and result.workers == 0


def test_tune_only_tries_counts_that_the_run_has_batches_for(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr("leantrain.data.workers.time.perf_counter", lambda: float(next(clock)))

    def loader(workers, batches):
        return iter([torch.zeros(len(b)) for b in batches])

    result = tune_workers(loader, [list(range(4))] * 4, candidates=[0, 1, 2, 4], batches_per_trial=8)
    assert set(result.samples_per_second) == {0, 1, 2}  # 4 workers would need 4 + 2 micro-batches
    assert tune_workers(loader, [list(range(4))] * 2, candidates=[0, 1]) is None


def test_tune_times_eight_micro_batches_after_one_per_worker_and_keeps_the_fewest_within_five_percent(
    monkeypatch,
):
    ends = iter([0.0, 20.0, 20.0, 39.0])  # 0 workers: 20 s; 2 workers: 19 s, 5% faster to the digit
    monkeypatch.setattr("leantrain.data.workers.time.perf_counter", lambda: next(ends))
    trials = []

    def loader(workers, batches):
        trials.append((workers, len(batches)))
        warnings.warn("This DataLoader will create 64 worker processes in total.", UserWarning, stacklevel=1)
        warnings.warn("a warning of the data's own", UserWarning, stacklevel=1)
        return iter([torch.zeros(len(b)) for b in batches])

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = tune_workers(loader, [list(range(38))] * 12, candidates=[0, 2])
    assert trials == [(0, 1 + 8), (2, 2 + 8)]  # the default: 8 timed after the warm-up
    assert result.samples_per_second == {0: 8 * 38 / 20, 2: 8 * 38 / 19} and result.workers == 0
    assert [str(w.message) for w in seen] == ["a warning of the data's own"] * 2  # torch's: expected here
    ends = iter([0.0, 1.0])
    assert tune_workers(loader, [[0]] * 3, candidates=[0]).samples_per_second == {0: 2.0}  # 1 + 2: enough
    assert TuneResult(2, {0: 1000.4, 2: 2500.0}).report() == (
        "num_workers tune: 2 is fastest (samples/s by worker count: 0: 1,000, 2: 2,500)"
    )


def test_fit_with_tune_on_a_run_too_short_to_measure_falls_back_to_auto(fit):
    from tests.conftest import RegressionTask

    result = fit(RegressionTask(), num_workers="tune", global_batch_size=16, max_steps=2)
    assert result.num_workers == auto_workers(1)
