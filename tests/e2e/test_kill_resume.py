"""Kill ``leantrain fit`` for real (SIGKILL, SIGTERM), resume it, and compare the final weights."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import one_worker_at_a_time

LEANTRAIN = str(Path(sys.executable).parent / "leantrain")
# digits: 1,437 training samples / 32 = 44 steps an epoch, so 50 steps cross an epoch
# boundary, and most kills land mid-epoch; micro-batch 8 = 4 accumulation steps.
FIT = ["fit", "--example", "digits", "--global-batch-size", "32", "--micro-batch-size", "8",
       "--max-steps", "50", "--checkpoint-every", "4", "--log-every-n-steps", "1", "--progress", "plain",
       "--logger", "none", "--ema-decay", "0.9", "--async-checkpoint", "true"]  # fmt: skip
if torch.cuda.is_available():  # cuDNN's default convolution backward adds in any order
    FIT += ["--deterministic", "true"]


def start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [LEANTRAIN, *FIT, "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(out: Path, *extra: str) -> str:
    """Run to the end; its output."""
    done = subprocess.run(
        [LEANTRAIN, *FIT, "--out", str(out), *extra], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_for_step(process: subprocess.Popen, step: int) -> None:
    """Read the plain progress lines until training has passed ``step``."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            return
    raise AssertionError(
        f"the run ended before step {step}: {process.stderr.read() if process.stderr else ''}"
    )


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """One uninterrupted run, shared by the tests of every pytest-xdist worker (the first to ask
    trains it, the others wait for it: it uses both cores anyway)."""
    with one_worker_at_a_time(tmp_path_factory, "kill-resume-reference") as out:
        if not (out / "model.safetensors").is_file():
            finish(out)
    return out


@pytest.fixture(scope="session")
def reference(reference_run) -> dict[str, torch.Tensor]:
    return weights(reference_run)


def assert_bit_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def assert_same_run(out: Path, reference_run: Path) -> None:
    """The weights and their moving average both end as the uninterrupted run's."""
    for weights_file in ("model.safetensors", "ema.safetensors"):
        assert_bit_identical(load_file(out / weights_file), load_file(reference_run / weights_file))


def test_sigkill_at_random_moments_then_resume_auto_each_time(tmp_path, reference_run):
    """Three kills of one run at random moments (each anywhere inside a step or its save), each
    followed by `--resume auto`: the weights end bit-identical to the uninterrupted run's."""
    chooser = random.Random(0)
    out = tmp_path / "run"
    resume: tuple[str, ...] = ()
    for first, last in ((2, 15), (16, 30), (31, 45)):  # later each time: every process makes progress
        process = start(out, *resume)
        wait_for_step(process, chooser.randint(first, last))
        time.sleep(chooser.uniform(0, 0.05))
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert process.returncode == -signal.SIGKILL
        resume = ("--resume", "auto")
    finish(out, *resume)
    assert_same_run(out, reference_run)


def test_sigkill_during_a_checkpoint_save(tmp_path, reference_run):
    """Kill exactly while a checkpoint's temporary file is being written, after several saves: the
    resume starts after the newest complete one (the half-written file is ignored)."""
    out = tmp_path / "run"
    folder = out / "checkpoints"
    process = start(out, "--checkpoint-every", "1")
    # Five or more complete saves before the one killed: when step 7 is logged, step 6's save may
    # still be writing on its thread (--async-checkpoint), step 5's is done.
    wait_for_step(process, 7)
    caught_in_save = False
    while process.poll() is None and not caught_in_save:
        if any(".tmp-" in name.name for name in folder.iterdir()):
            process.send_signal(signal.SIGKILL)
            caught_in_save = True
        time.sleep(0.001)  # a save takes longer; the run keeps its core
    process.wait()
    if not caught_in_save:
        pytest.skip("every save finished before the poll saw it; nothing was killed")
    assert any(".tmp-" in p.name for p in folder.iterdir()), "the kill landed after the save completed"
    newest = max(int(p.stem.split("-")[1]) for p in folder.glob("step-*.pt"))
    assert newest >= 5
    resumed = finish(out, "--resume", "auto")  # saving every 4 steps again
    first_step = next(line for line in resumed.splitlines() if line.startswith("step "))
    assert first_step.split()[1] == f"{newest + 1}/50"
    assert_same_run(out, reference_run)


def test_sigterm_saves_exits_128_plus_15_and_resumes(tmp_path, reference_run):
    out = tmp_path / "run"
    process = start(out)
    wait_for_step(process, 13)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM after step" in stderr and "--resume auto" in stderr
    assert "Traceback" not in stderr
    finish(out, "--resume", "auto")
    assert_same_run(out, reference_run)


def test_export_turns_a_checkpoint_into_the_same_weights(tmp_path, reference_run, reference):
    checkpoint = reference_run / "checkpoints" / "step-00000050.pt"
    done = subprocess.run([LEANTRAIN, "export", str(checkpoint), str(tmp_path / "w.safetensors")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert_bit_identical(load_file(tmp_path / "w.safetensors"), reference)
    broken = subprocess.run([LEANTRAIN, "export", str(tmp_path / "none.pt"), str(tmp_path / "x")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert broken.returncode == 2
    assert broken.stderr.strip() == f"leantrain: error: checkpoint {tmp_path / 'none.pt'} does not exist"
