"""Exact resume: a run stopped at any step and resumed ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import csv
import os
import signal
import warnings
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import leantrain as lt
from leantrain.checkpoint import load_checkpoint
from tests.conftest import RegressionTask, quiet_config


class NoisyImages(Dataset):
    """Items drawn with torch's global RNG: random augmentation, in the loader's process."""

    def __init__(self, size: int = 72) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((8,), float(index % 5)) + 0.3 * torch.randn(8), index % 3


class RandomnessEverywhere:
    """Dropout, random augmentation, Adam, a scheduler: every piece of state a resume must restore."""

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def train_data(self) -> Dataset:
        return NoisyImages()

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-2)

    def scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)


class StopAt:
    """Simulates a crash: raises after the given optimizer step (the loop is left mid-run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, stats: lt.StepStats) -> None:
        if stats.step == self.step:
            raise KeyboardInterrupt


SETTINGS = dict(global_batch_size=16, micro_batch_size=8, max_steps=14, log_every_n_steps=3)


def train(out_dir, callbacks=(), **changes) -> lt.FitResult:
    return lt.Trainer(quiet_config(out_dir, **{**SETTINGS, **changes}), callbacks=list(callbacks)).fit(
        RandomnessEverywhere()
    )


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def metric_rows(run_dir) -> list[dict]:
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_bit_identical(tmp_path, workers):
    # 72 samples / 16 = 4 steps an epoch; a crash after step 9 resumes from the checkpoint of
    # step 5 (mid-epoch 1), between the log points of steps 3 and 6: the checkpoint holds the
    # losses of steps 4 and 5, which the log of step 6 must still count.
    reference = train(tmp_path / "reference", num_workers=workers, checkpoint_every=2)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", [StopAt(9)], num_workers=workers, checkpoint_every=5)
    (saved_window,) = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000005.pt")[
        "losses"
    ]  # one rank's
    assert saved_window["steps"] == [3, 3, 4, 4]  # steps 4 and 5 (0-based), two micro-batches each
    resumed = train(tmp_path / "run", num_workers=workers, checkpoint_every=5, resume="auto")
    assert_same_parameters(reference.model, resumed.model)
    assert resumed.final_train_loss == reference.final_train_loss
    drop = {"samples_per_second"}  # timing differs, everything else is the same
    rows = [{k: v for k, v in row.items() if k not in drop} for row in metric_rows(tmp_path / "run")]
    expected = [
        {k: v for k, v in row.items() if k not in drop} for row in metric_rows(tmp_path / "reference")
    ]
    assert rows == expected


def test_without_the_rng_state_the_resume_would_differ(tmp_path, monkeypatch):
    """The control for the test above: dropout really depends on the restored RNG (loading puts
    the main process's generators back after each micro-batch: only the restore sets them)."""
    reference = train(tmp_path / "reference", checkpoint_every=3, num_workers=2)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", [StopAt(7)], checkpoint_every=3, num_workers=2)
    monkeypatch.setattr("leantrain.run.persistence.restore_rng", lambda state: None)
    resumed = train(tmp_path / "run", checkpoint_every=3, resume="auto", num_workers=2)
    assert not all(
        torch.equal(x, y)
        for x, y in zip(reference.model.parameters(), resumed.model.parameters(), strict=True)
    )


def test_sigterm_saves_a_checkpoint_and_stops_cleanly(tmp_path):
    class SendSigterm:
        def on_step(self, stats: lt.StepStats) -> None:
            if stats.step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    reference = train(tmp_path / "reference")
    with pytest.raises(lt.RunInterrupted) as caught:
        train(tmp_path / "run", [SendSigterm()])
    assert caught.value.step == 5 and caught.value.signal_name == "SIGTERM"
    assert caught.value.checkpoint.endswith("step-00000005.pt")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is removed again
    resumed = train(tmp_path / "run", resume="auto")
    assert_same_parameters(reference.model, resumed.model)


def test_checkpoint_every_never_writes_no_checkpoint_even_when_stopped(tmp_path):
    class SendSigterm:
        def on_step(self, stats: lt.StepStats) -> None:
            if stats.step == 5:
                os.kill(os.getpid(), signal.SIGTERM)

    reference = train(tmp_path / "reference")
    unsaved = train(tmp_path / "unsaved", checkpoint_every="never")
    assert_same_parameters(reference.model, unsaved.model)  # training itself is unchanged
    assert (unsaved.out_dir / "model.safetensors").is_file()
    with pytest.raises(lt.RunInterrupted, match="no checkpoint was written") as caught:
        train(tmp_path / "stopped", [SendSigterm()], checkpoint_every="never")
    assert caught.value.step == 5 and caught.value.checkpoint is None
    for run in ("unsaved", "stopped"):
        assert not any((tmp_path / run / "checkpoints").glob("*")), run


def test_resume_from_a_named_file_and_train_longer(tmp_path):
    short = train(tmp_path / "short", max_steps=6)
    longer = train(tmp_path / "longer", max_steps=10)
    checkpoint = short.out_dir / "checkpoints" / "step-00000006.pt"
    extended = train(tmp_path / "extended", max_steps=10, resume=str(checkpoint))
    assert_same_parameters(longer.model, extended.model)


def test_the_summary_counts_the_time_of_earlier_processes(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", [StopAt(9)], checkpoint_every=4)
    saved = load_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000008.pt")["progress"]
    resumed = train(tmp_path / "run", checkpoint_every=4, resume="auto")
    assert saved["wall_seconds"] > 0 and saved["train_seconds"] > 0
    assert resumed.wall_seconds > saved["wall_seconds"]


def test_a_finished_run_resumed_keeps_its_memory_counts_in_the_summary(tmp_path):
    """Resumed at its last step, the run steps no more and measures nothing: the checkpoint's counts."""
    finished = train(tmp_path / "run", max_steps=6)
    again = train(tmp_path / "run", max_steps=6, resume="auto")
    kinds = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")
    counts = {kind: finished.summary()[kind] for kind in kinds}
    assert all(counts.values()) and {kind: again.summary()[kind] for kind in kinds} == counts


def test_resume_auto_without_a_checkpoint_starts_fresh(tmp_path):
    fresh = train(tmp_path / "a")
    also_fresh = train(tmp_path / "b", resume="auto")
    assert_same_parameters(fresh.model, also_fresh.model)


def test_a_changed_global_batch_is_refused(tmp_path):
    train(tmp_path / "run", max_steps=4)
    with pytest.raises(lt.CheckpointError, match="global_batch_size=16 but this run has global_batch_size=8"):
        train(tmp_path / "run", global_batch_size=8, micro_batch_size=8, resume="auto")


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    lt.Trainer(quiet_config(tmp_path / "other", global_batch_size=16, max_steps=1)).fit(
        RegressionTask(samples=72)
    )
    checkpoint = tmp_path / "other" / "checkpoints" / "step-00000001.pt"
    with pytest.raises(lt.CheckpointError, match=r"does not match this run's model: .*Missing key"):
        train(tmp_path / "run", resume=str(checkpoint), micro_batch_size=16)


def test_a_finished_run_folder_needs_resume_to_be_reused(tmp_path):
    train(tmp_path / "run", max_steps=2)
    with pytest.raises(lt.LeantrainError, match=r"already holds a run .* --resume auto"):
        train(tmp_path / "run", max_steps=2)


def test_a_run_that_died_before_its_first_checkpoint_says_what_to_type_and_starts_again(tmp_path):
    """A run ended by an error before any checkpoint leaves only its log: the corrected command is
    refused with the exact flag that starts it again there, and that flag does."""

    class Fails:
        def on_step(self, stats: lt.StepStats) -> None:
            raise KeyboardInterrupt  # as Ctrl-C during step 1

    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", [Fails()], checkpoint_every=4)
    assert (tmp_path / "run" / "metrics.csv").exists()
    message = r"holds a run that ended before its first checkpoint \(metrics.csv.*add --resume auto to start"
    with pytest.raises(lt.LeantrainError, match=message):
        train(tmp_path / "run", checkpoint_every=4)
    again = train(tmp_path / "run", checkpoint_every=4, resume="auto")
    assert_same_parameters(again.model, train(tmp_path / "fresh", checkpoint_every=4).model)


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    train(tmp_path / "run", checkpoint_every=2, keep_checkpoints=2)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step-00000012.pt", "step-00000014.pt"]


def test_a_callback_saved_with_the_model_is_read_from_the_resumed_shards(tmp_path):
    """Under a sharded strategy, a callback split like the model's (the weight average) is saved in
    the shards; resuming fills its state in place from there, and only from there."""
    import torch.distributed.checkpoint as dcp

    from leantrain.run.persistence import CALLBACKS_IN_SHARDS, Resumed

    saved = torch.arange(4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process writing shards: torch says it is not distributed
        dcp.save({CALLBACKS_IN_SHARDS: {"ema": {"w": saved}}}, checkpoint_id=str(tmp_path / "step.dcp"))
    resumed = Resumed(step=4, callbacks_in_shards=["ema"], shards=tmp_path / "step.dcp")
    template = {"w": torch.zeros(4, dtype=torch.float64)}
    assert resumed.callback_from_shards("ema", template) is template
    assert torch.equal(template["w"], saved)
    assert resumed.callback_from_shards("other", {"w": torch.zeros(4)}) is None  # not in the shards
    assert Resumed(step=4, callbacks_in_shards=["ema"]).callback_from_shards("ema", {}) is None  # no shards
