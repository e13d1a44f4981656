"""``--compile``: compiled runs train as eager ones do, and what the compiler does is reported.

Each compiled run compiles afresh (``torch._dynamo.reset()``): a cache left by another test
could otherwise serve it, or its recompilation limit fall back to eager without a word. The
model is small (three residual blocks, float64) to keep compile time to seconds.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import leantrain as lt
from leantrain import cli
from leantrain.config import TrainConfig
from leantrain.diagnose.doctor import run_doctor
from leantrain.diagnose.report import render_html
from leantrain.errors import ConfigError
from leantrain.step.compilation import CompilerEvent, CompileWatch, _Collector, _reason, compile_model
from tests.distributed.conftest import fit_here
from tests.distributed.tasks import Residual, block_regression_reading_back

FIT = ["fit", "--task", "tests.distributed.tasks:block_regression", "--global-batch-size", "16",
       "--micro-batch-size", "8", "--max-steps", "5", "--progress", "plain", "--logger", "none",
       "--checkpoint-every", "never"]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def trained(out: Path, *flags: str) -> tuple[dict, dict]:
    fit_here(*FIT, *flags, "--out", str(out))
    return load_file(out / "model.safetensors"), json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(
    "flags",
    [
        ["--compile", "blocks"],
        ["--compile", "model"],
        ["--compile", "blocks", "--activation-checkpointing", "Residual"],
    ],
    ids=["blocks", "model", "blocks-recomputed"],
)  # fmt: skip
def test_a_compiled_run_trains_as_the_eager_one(tmp_path, flags):
    eager, _ = trained(tmp_path / "eager")
    compiled, summary = trained(tmp_path / "compiled", *flags)
    assert max(float((compiled[k] - eager[k]).abs().max()) for k in eager) <= 1e-9
    assert summary["compile_seconds"] > 0  # it did compile
    # samples_per_second leaves the compiling out: the training time it implies is shorter than
    # the run's wall time less the compiling.
    train_seconds = summary["samples"] / summary["samples_per_second"]
    assert train_seconds < summary["wall_seconds"] - summary["compile_seconds"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocks_compiled_for_a_gpu_train_as_eager_there(tmp_path):
    """Inductor's Triton kernels (float64, like the CPU tests)."""
    runs = {}
    for name, flags in (("eager", []), ("compiled", ["--compile", "blocks"])):
        out = tmp_path / name
        assert cli.main([*FIT, "--device", "cuda", *flags, "--out", str(out)]) == 0
        runs[name] = load_file(out / "model.safetensors"), json.loads((out / "summary.json").read_text())
    (eager, _), (compiled, summary) = runs["eager"], runs["compiled"]
    assert max(float((compiled[k] - eager[k]).abs().max()) for k in eager) <= 1e-9
    assert summary["compile_seconds"] > 0 and summary["device"].startswith("cuda")


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_a_model_of_torch_layers_only_is_compiled_too(tmp_path, scope):
    """An nn.Sequential of nn.Linear and nn.Tanh: torch.compile skips torch's own code as the first
    frame, so compiling it as Module.compile does would compile nothing, without a word."""
    task = ["--task", "tests.distributed.tasks:mean_task"]  # Linear, Tanh, Linear (the blocks: Linear)
    eager, _ = trained(tmp_path / "eager", *task)
    compiled, summary = trained(tmp_path / "compiled", *task, "--compile", scope)
    assert summary["compile_seconds"] > 0
    assert max(float((compiled[k] - eager[k]).abs().max()) for k in eager) <= 1e-9


def test_an_eager_checkpoint_resumes_compiled(tmp_path):
    """The compiled modules keep their names: the checkpoint of an eager run loads into a compiled one."""
    whole, _ = trained(tmp_path / "whole", "--max-steps", "6")
    trained(tmp_path / "split", "--max-steps", "3", "--checkpoint-every", "3")
    resumed, summary = trained(tmp_path / "split", "--max-steps", "6", "--checkpoint-every", "3", "--resume",
                               "auto", "--compile", "blocks")  # fmt: skip
    assert max(float((resumed[k] - whole[k]).abs().max()) for k in whole) <= 1e-9
    assert summary["compile_seconds"] > 0


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class ConvNet:
    """A float64 conv net of BatchNorm blocks: compiled code must update their running statistics."""

    def model(self) -> nn.Module:
        blocks = [ConvBlock(8) for _ in range(3)]
        head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)]
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *blocks, *head).double()

    def train_data(self) -> TensorDataset:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(64, 3, 8, 8, generator=generator, dtype=torch.float64)
        return TensorDataset(images, torch.randint(0, 4, (64,), generator=generator))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels)

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)


def test_a_batch_norm_conv_net_compiled_by_blocks_trains_as_eager(tmp_path):
    states = {}
    for mode in ("none", "blocks"):
        cfg = TrainConfig(global_batch_size=16, max_steps=5, compile=mode, logger="none", progress="none",
                          checkpoint_every="never", out_dir=str(tmp_path / mode))  # fmt: skip
        result = lt.Trainer(cfg).fit(ConvNet())
        states[mode] = (result.model.state_dict(), result.compile_seconds)
    (eager, _), (compiled, seconds) = states["none"], states["blocks"]
    assert seconds > 0 and any("running_mean" in name for name in eager)
    assert max(float((compiled[k].double() - eager[k].double()).abs().max()) for k in eager) <= 1e-9


def test_compile_options_are_checked_before_the_run():
    with pytest.raises(ConfigError, match="compile_mode"):
        TrainConfig(compile_mode="max-autotune")
    with pytest.raises(ConfigError, match="compile"):
        TrainConfig(compile="everything")
    flat = nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # no class twice: no repeated blocks
    with pytest.raises(ConfigError, match=r"compile='blocks'.*--compile model"):
        compile_model(flat, "blocks", {}, None)


def test_blocks_are_compiled_in_place_and_keep_their_names():
    model = nn.Sequential(nn.Linear(6, 16), Residual(16, False), Residual(16, False), nn.Linear(16, 4))
    keys = list(model.state_dict())
    assert compile_model(model, "blocks", {}, None) == ["1", "2"]
    assert list(model.state_dict()) == keys  # checkpoints load into an eager model alike
    assert isinstance(model[1], Residual) and "forward" in vars(model[1])  # compiled in place
    assert "forward" not in vars(model[0])


def test_each_place_the_compiler_recompiles_or_breaks_is_reported_once():
    block = Residual(8, read_back=True).double()
    block.compile()
    reported = []
    watch = CompileWatch(True, reported.append)
    with watch.watching():
        for rows in (4, 4, 3, 5, 2):  # new shapes: recompilations of the same code
            block(torch.randn(rows, 8, dtype=torch.float64)).sum().backward()
    assert watch.seconds > 0
    kinds = [(event.kind, event.where) for event in reported]
    assert len(kinds) == len(set(kinds))  # once per kind and place ...
    counted = {(event.kind, event.where): event.count for event in watch.events}
    # ... however often it happened there: the break in each of the 2 compilations, 1 recompilation
    assert sorted((kind, count) for (kind, _), count in counted.items()) == [
        ("graph break", 2),
        ("recompilation", 1),
    ]
    breaks = [event for event in reported if event.kind == "graph break"]
    assert breaks and breaks[0].where.endswith(f"tasks.py:{_line_of('.item() > 1e6')}")
    assert "item()" in breaks[0].reason
    # rows 4, then 3: the frame of the block's forward compiled again, its guard on x's first size failed
    recompiled = [event for event in reported if event.kind == "recompilation"]
    forward = inspect.getsourcelines(Residual.forward)[1]
    assert recompiled and recompiled[0].where.endswith(f"tasks.py:{forward}")
    assert recompiled[0].reason == "tensor 'x' size mismatch at index 0. expected 4, actual 3"


def test_a_compiler_message_without_text_is_a_graph_break_at_an_unknown_place():
    """Bug: an empty message read as lines raises in the log handler (logging prints its traceback)."""
    events = []
    _Collector(events.append).emit(logging.LogRecord("torch._dynamo", logging.DEBUG, "", 0, "", None, None))
    assert events == [CompilerEvent("graph break", "unknown", "unsupported code")]


def test_a_recompilations_reason_is_its_newest_failed_guard_in_each_torch_format():
    """torch 2.13 names the frame ("0/1: ") and adds the guard's source after "  #"; older releases did
    neither. Without a failed guard listed, the reason says so."""
    newest = "- 0/1: tensor 'x' size mismatch at index 0. expected 8, actual 5  # x.size()[0] == 8"
    message = f"Recompiling function forward in m.py:3\n  triggered by:\n    {newest}\n    - 0/0: grad_mode"
    assert _reason("recompilation", message) == "tensor 'x' size mismatch at index 0. expected 8, actual 5"
    older = "Recompiling function forward in m.py:3\n    - tensor 'x' size mismatch at index 0. expected 8"
    assert _reason("recompilation", older) == "tensor 'x' size mismatch at index 0. expected 8"
    assert _reason("recompilation", "Recompiling function forward in m.py:3") == "guards failed"
    changed = "Recompiling function forward in m.py:3\n    - 0/2: GLOBAL_STATE changed: grad_mode"
    assert _reason("recompilation", changed) == "GLOBAL_STATE changed: grad_mode"  # only the frame cut off


def test_a_graph_breaks_reason_is_the_specific_cause_torch_gives_after_its_generic_line():
    head = "Graph break in user code at m.py:3"
    generic = "Graph Break Reason: Encountered graph break when attempting to trace CALL: a call"
    cause = "Unsupported Tensor.item() call with capture_scalar_outputs=False"
    assert _reason("graph break", f"{head}\n{generic}\n\n{cause}\nUser code traceback:") == cause
    specific = f"{head}\nGraph Break Reason: data-dependent branching\nUser code traceback:\n  File m.py"
    assert _reason("graph break", specific) == "data-dependent branching"
    assert _reason("graph break", f"{head}\n\n{cause}") == cause  # no reason line: the first after the head
    assert _reason("graph break", head) == "unsupported code"
    assert _reason("graph break", f"{head}\n{generic}\n{cause}") == cause  # the cause ends the message
    assert _reason("graph break", f"{head}\n{generic}") == generic.removeprefix("Graph Break Reason: ")


def test_the_doctor_reports_a_graph_break_by_file_and_line(tmp_path):
    cfg = TrainConfig(
        global_batch_size=16, micro_batch_size=8, compile="blocks", device="cpu", progress="none"
    )
    diagnosis = run_doctor(block_regression_reading_back(), cfg, steps=3, warmup=2)
    where = f"tasks.py:{_line_of('.item() > 1e6')}"
    assert any(e.kind == "graph break" and e.where.endswith(where) for e in diagnosis.compiler_events)
    assert any(where in advice.title for advice in diagnosis.advice)
    assert diagnosis.as_dict()["compiler_events"]
    assert where in render_html(diagnosis)


def _line_of(text: str) -> int:
    source = (Path(__file__).parent / "distributed" / "tasks.py").read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if text in line)
