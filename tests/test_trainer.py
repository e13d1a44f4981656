from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

import leantrain as lt
from tests.conftest import ReadEachStep, RegressionTask, TinyClassifier, quiet_config

SUMMARY_KEYS = {
    "steps",
    "samples",
    "final_train_loss",
    "samples_per_second",
    "wall_seconds",
    "micro_batch_size",
    "accumulation_steps",
    "world_size",
    "precision",
    "strategy",
    "peak_memory_bytes",
}


def test_fit_writes_summary_metrics_tensorboard_and_weights(tmp_path):
    cfg = quiet_config(
        tmp_path / "run",
        global_batch_size=32,
        micro_batch_size=8,
        max_steps=16,
        log_every_n_steps=4,
        val_every_n_steps=8,
        logger="tensorboard",
    )
    result = lt.Trainer(cfg).fit(TinyClassifier())
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["steps"] == 16 and summary["samples"] == 16 * 32
    assert summary["accumulation_steps"] == 4 and summary["micro_batch_size"] == 8
    assert summary["world_size"] == 1 and summary["precision"] == "32" and summary["strategy"] == "single"
    assert summary["peak_memory_bytes"] > 0 and summary["samples_per_second"] > 0
    assert 0.5 < summary["val_accuracy"] <= 1.0 and summary["val_loss"] == result.val_metrics["val_loss"]
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["step"] for r in rows if r["train_loss"]] == ["4", "8", "12", "16"]
    assert [r["step"] for r in rows if r["val_loss"]] == ["8", "16"]
    assert list(run.glob("events.out.tfevents.*"))
    weights = load_file(run / "model.safetensors")
    for name, param in result.model.state_dict().items():
        assert torch.equal(weights[name], param.cpu())


def test_training_reduces_the_loss(fit):
    first = fit(TinyClassifier(), global_batch_size=32, max_steps=1)
    longer = fit(TinyClassifier(), global_batch_size=32, max_steps=60)
    assert longer.final_train_loss < 0.5 * first.final_train_loss


def test_max_epochs_limits_the_steps(fit):
    result = fit(TinyClassifier(samples=100), global_batch_size=32, max_epochs=2)
    assert result.steps == 2 * (100 // 32)
    assert fit(TinyClassifier(samples=100), global_batch_size=32, max_epochs=5, max_steps=4).steps == 4


def test_same_seed_same_result_and_other_seed_differs(fit):
    a = fit(RegressionTask(), global_batch_size=16, max_steps=5, seed=1)
    b = fit(RegressionTask(), global_batch_size=16, max_steps=5, seed=1)
    c = fit(RegressionTask(), global_batch_size=16, max_steps=5, seed=2)
    pa, pb, pc = (list(r.model.parameters()) for r in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc, strict=True))


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_mode_is_on_while_training_and_restored_after(fit, deterministic):
    before = torch.are_deterministic_algorithms_enabled()
    during = ReadEachStep(torch.are_deterministic_algorithms_enabled)
    fit(TinyClassifier(), callbacks=[during], global_batch_size=32, max_steps=2, deterministic=deterministic)
    assert during.seen() == {deterministic or before}
    assert torch.are_deterministic_algorithms_enabled() == before


class Recorder:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.logs: list[tuple[int, dict]] = []

    def on_step(self, stats: lt.StepStats) -> None:
        self.steps.append(stats.step)

    def on_log(self, step: int, metrics: dict) -> None:
        self.logs.append((step, metrics))


def test_callbacks_see_every_step_and_every_log(fit):
    recorder = Recorder()
    fit(TinyClassifier(), callbacks=[recorder], global_batch_size=32, max_steps=6, log_every_n_steps=3)
    assert recorder.steps == [1, 2, 3, 4, 5, 6]
    assert [step for step, m in recorder.logs if "train_loss" in m] == [3, 6]
    assert [step for step, m in recorder.logs if "val_loss" in m] == [6]


class RemembersItsStart(RegressionTask):
    """Keeps a copy of the initial weights it built."""

    def model(self):
        model = super().model()
        self.initial = [p.detach().clone() for p in model.parameters()]
        return model


def first_update_norm(fit, recorder: Recorder, **fields) -> float:
    task = RemembersItsStart()
    result = fit(task, callbacks=[recorder], global_batch_size=16, max_steps=1, log_every_n_steps=1, **fields)
    pairs = zip(result.model.parameters(), task.initial, strict=True)
    return float(sum((p.detach().cpu() - q).pow(2).sum() for p, q in pairs)) ** 0.5  # q: built on the CPU


def test_gradient_clipping_logs_the_norm_and_bounds_the_update(fit):
    # SGD's first step (momentum buffer = gradient) moves the weights by lr x the gradient it gets.
    lr, max_norm = 0.05, 1e-3
    free, clipped = Recorder(), Recorder()
    unclipped_move = first_update_norm(fit, free)
    clipped_move = first_update_norm(fit, clipped, max_grad_norm=max_norm)
    [(_, metrics)] = clipped.logs
    assert metrics["grad_norm"] > 100 * max_norm  # the norm before clipping is logged
    assert unclipped_move == pytest.approx(lr * metrics["grad_norm"], rel=1e-9)  # the control
    # Bounded, and scaled to the bound rather than zeroed (torch's clip adds 1e-6 to the norm).
    assert lr * max_norm * (1 - 1e-4) < clipped_move <= lr * max_norm


SYNC_CALLS = {"item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy", "__format__", "__repr__"}
LEANTRAIN_SRC = str(Path(lt.__file__).parent)


class HostSyncRecorder(TorchFunctionMode):
    """Records host-sync calls made by leantrain's own code: (step, call, function, file:line)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.calls: list[tuple[int, str, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_CALLS:
            caller = inspect.stack(0)[1]
            if caller.filename.startswith(LEANTRAIN_SRC):
                step = self.recorder.steps[-1] if self.recorder.steps else 0
                where = f"{Path(caller.filename).name}:{caller.lineno}"
                self.calls.append((step, name, caller.function, where))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed", "bf16-true", "16-true"])
def test_the_hot_loop_reads_one_flag_per_step_and_nothing_else_between_log_points(fit, precision):
    recorder = Recorder()
    mode = HostSyncRecorder(recorder)
    with mode:
        fit(
            TinyClassifier(),
            callbacks=[recorder],
            global_batch_size=32,
            micro_batch_size=8,
            max_steps=10,
            log_every_n_steps=5,
            max_grad_norm=1.0,
            precision=precision,
        )
    # The finite check decides whether a step may update: one read per optimizer step. (`in`:
    # under `make mutate` the function's name carries the mutation tool's prefix and suffix.)
    checks = [call for call in mode.calls if "_check_finite" in call[2]]
    assert [step for step, *_ in checks] == list(range(10)), checks
    others = {step for step, _, function, _ in mode.calls if "_check_finite" not in function}
    assert others and others <= {0, 5, 10}, mode.calls  # set-up, the two log points, the end


@pytest.mark.parametrize(
    ("bad_loss", "message"),
    [
        (lambda out: out, "must be a scalar tensor, got shape"),
        (lambda out: 3.0, "must be a tensor or lt.LossSum, got float"),
    ],
)
def test_a_bad_loss_value_is_a_task_error(fit, bad_loss, message):
    class BadLoss(RegressionTask):
        def loss(self, model, batch):
            return bad_loss(model(batch[0]))

    with pytest.raises(lt.TaskError, match=message):
        fit(BadLoss(), global_batch_size=16, max_steps=1)


def test_model_must_be_a_module(fit):
    class NotAModule(RegressionTask):
        def model(self):
            return "a string"

    with pytest.raises(lt.TaskError, match=r"task.model\(\) must return a torch.nn.Module, got str"):
        fit(NotAModule(), global_batch_size=16, max_steps=1)


def test_an_existing_run_folder_is_never_overwritten(tmp_path):
    cfg = quiet_config(tmp_path / "run", global_batch_size=16, max_steps=1)
    lt.Trainer(cfg).fit(RegressionTask())
    before = (tmp_path / "run" / "summary.json").read_bytes()
    with pytest.raises(lt.LeantrainError, match="already holds a run"):
        lt.Trainer(cfg).fit(RegressionTask())
    assert (tmp_path / "run" / "summary.json").read_bytes() == before


def test_default_run_folder_is_named_after_the_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = lt.TrainConfig(global_batch_size=16, max_steps=1, progress="none", logger="none")
    result = lt.Trainer(cfg).fit(RegressionTask(), name="regression")
    assert result.out_dir.parent == Path("runs") and result.out_dir.name.startswith("regression-")
    assert (tmp_path / result.out_dir / "summary.json").exists()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains(fit, precision):
    first = fit(TinyClassifier(), global_batch_size=32, max_steps=1, precision=precision)
    result = fit(TinyClassifier(), global_batch_size=32, max_steps=60, precision=precision)
    assert result.precision == precision
    assert result.final_train_loss < 0.5 * first.final_train_loss
    assert all(p.dtype == torch.float32 for p in result.model.parameters())
