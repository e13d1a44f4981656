"""SIGTERM reaches ``leantrain fit`` at every stage of its life and is always answered by its line.

A scheduler's SIGTERM can come at any time. Once in 16 tries, a run with --checkpoint-every never
exited 143 with nothing on stderr: the signal came while the run was still being set up, before
its handlers were installed, and the default action ended the process without a word. The task
below tells the test (a marker file) when it has reached the stage to be signalled there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LEANTRAIN = str(Path(sys.executable).parent / "leantrain")

TASK_FILE = """
import os
import pathlib
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

MARK = pathlib.Path(os.environ["STOP_TEST_MARK"])
STAGE = os.environ["STOP_TEST_STAGE"]


class Tiny:
    def __init__(self):
        self.calls = 0

    def model(self):
        if STAGE == "set-up":
            MARK.touch()
            time.sleep(2)  # the signal arrives while the model is built
        return nn.Linear(4, 1)

    def train_data(self):
        generator = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, 1, generator=generator))

    def loss(self, model, batch):
        self.calls += 1
        if STAGE == "step" and self.calls == 3:
            MARK.touch()
            time.sleep(1)  # the signal arrives during step 3
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)
"""


@pytest.mark.parametrize(("stage", "line"), [
    ("set-up", "leantrain: stopped by SIGTERM while the run was set up, before step 1: nothing was "
               "trained; start it again"),
    ("step", "leantrain: stopped by SIGTERM after step 3; no checkpoint was written (checkpoint_every "
             "is never): the run cannot be continued"),
])  # fmt: skip
def test_sigterm_is_answered_by_its_line_at_every_stage(tmp_path, stage, line):
    (tmp_path / "stoptask.py").write_text(TASK_FILE)
    mark = tmp_path / "reached"
    flags = ["--max-steps", "100", "--global-batch-size", "8", "--checkpoint-every", "never",
             "--logger", "none", "--progress", "none", "--out", "out"]  # fmt: skip
    environment = {**os.environ, "STOP_TEST_MARK": str(mark), "STOP_TEST_STAGE": stage}
    command = [LEANTRAIN, "fit", "--task", "stoptask:Tiny", *flags]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        waited = time.monotonic()
        while not mark.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() - waited < 240, "the run never reached the stage"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=240)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines()[-1] == line
