"""The doctor on tasks built to have one known problem each, and on a clean one."""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import leantrain as lt
from leantrain.cli import main
from leantrain.diagnose import run_doctor
from leantrain.diagnose.advice import COMPILE_WORTH, VERDICTS
from leantrain.diagnose.report import CSP
from leantrain.examples import load_example
from leantrain.examples.slowdata import SlowDataTask
from tests.conftest import RegressionTask, quiet_config
from tests.diagnose.lines import line_of


def doctor(task, tmp_path: Path, steps: int = 4, warmup: int = 2, try_compile: bool = False, **fields):
    """The doctor without its compiled trial (a compile per test), unless asked."""
    config = quiet_config(tmp_path / "run", **fields)
    return run_doctor(task, config, steps=steps, warmup=warmup, try_compile=try_compile)


class ReadsItsLoss(RegressionTask):
    """Reads the loss on the host every micro-batch, as a print-debugging loop would."""

    def loss(self, model, batch):
        loss = super().loss(model, batch)
        self.last = loss.item()  # doctor:item
        return loss


class KeepsLosses(RegressionTask):
    """Appends every loss, graph and all, to a list."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[torch.Tensor] = []

    def loss(self, model, batch):
        x, y, _ = batch
        loss = ((model(x) - y) ** 2).mean()  # doctor:kept
        self.history.append(loss)
        return loss


@pytest.fixture
def one_compute_thread():
    """Torch's compute on one thread, in the thread that loads the data. Beside other work, two
    compute threads wait for each other at every kernel whenever one of them is descheduled:
    beside two other 2-thread torch processes on 2 cores, the tiny model's step took up to 0.16 s
    (0.0025 s on a quiet machine) while loading went from 0.085 to 0.33 s, and the data share fell
    from 0.97 to 0.68 (0.38 in a failed CI run). On one thread, load slows loading and compute
    alike: the share stayed between 0.95 and 0.985 under the same load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.serial  # the verdict weighs measured times: another test beside it would move them
def test_data_bound_example_is_diagnosed_and_workers_come_first(tmp_path: Path, one_compute_thread) -> None:
    d = doctor(SlowDataTask(size=256), tmp_path, global_batch_size=32, num_workers=0)
    assert d.verdict == "data-bound"
    assert d.phases["data"] > 0.5 * d.phases["total"]
    assert d.advice[0].change.startswith("--num-workers auto")
    assert any("leantrain cache" in a.change for a in d.advice)


def test_an_item_call_in_the_loss_is_found_with_its_line(tmp_path: Path) -> None:
    d = doctor(ReadsItsLoss(), tmp_path, global_batch_size=32, micro_batch_size=16)
    [sync] = d.host_syncs
    assert (sync.call, sync.file, sync.line) == (".item()", __file__, line_of(__file__, "doctor:item"))
    assert sync.per_step(d.audited_steps) == 2  # one per micro-batch
    # Found, but ranked after anything with a measured gain: on the CPU it costs nothing.
    assert f"remove the host sync .item() at {__file__}:{sync.line}" in [a.title for a in d.advice]
    assert d.retained_graphs == []


def test_kept_losses_are_found_where_they_were_created(tmp_path: Path) -> None:
    d = doctor(KeepsLosses(), tmp_path, global_batch_size=32)
    [graph] = d.retained_graphs
    assert (graph.file, graph.line) == (__file__, line_of(__file__, "doctor:kept"))
    assert graph.tensors == 1  # recorded during one step, of one micro-batch
    assert d.host_syncs == []
    assert d.advice[0].title.startswith("stop keeping autograd graphs alive")


@pytest.mark.serial  # the verdict weighs measured times: another test beside it would move them
def test_a_clean_compute_heavy_task_is_compute_bound_without_false_alarms(tmp_path: Path) -> None:
    d = doctor(load_example("charlm"), tmp_path, steps=3, device="cpu", try_compile=True)  # a GPU: bf16
    assert d.verdict == "compute-bound"
    assert d.host_syncs == [] and d.retained_graphs == []
    # Compute-bound and eager: measured again, compiled; advised only if that was faster.
    trial = d.compile_trial
    assert trial is not None and trial.scope == "blocks" and trial.compile_seconds > 0
    faster = d.phases["total"] / trial.step_seconds >= COMPILE_WORTH
    assert [a.change.split("  ")[0] for a in d.advice] == (["--compile blocks"] if faster else [])
    assert d.phases["forward"] + d.phases["backward"] > 0.7 * d.phases["total"]
    assert d.flops_per_step > 0 and 0 < d.mfu <= 1  # 1: the peak measurement was slowed (at_least)
    assert [s.file.endswith("accumulator.py") for s in d.engine_host_syncs].count(True) == 1


def test_doctor_trains_what_fit_trains(tmp_path: Path) -> None:
    """The instruments measure; they change nothing: same weights as a plain fit of as many steps."""
    d = doctor(RegressionTask(), tmp_path / "d", steps=3, warmup=1, global_batch_size=32, micro_batch_size=16)
    steps = d.schedule.total
    cfg = quiet_config(
        tmp_path / "fit", global_batch_size=32, micro_batch_size=16, max_steps=steps, log_every_n_steps=steps
    )
    plain = lt.Trainer(cfg).fit(RegressionTask())
    weights = load_file(tmp_path / "d" / "run" / "model.safetensors")
    for name, value in plain.model.state_dict().items():
        assert torch.equal(weights[name], value.cpu()), name  # fit's model is on its device
    assert not any((tmp_path / "d" / "run" / "checkpoints").glob("*"))  # a measurement: nothing to resume


class _Resources(HTMLParser):
    """Every attribute through which a page could load something."""

    def __init__(self) -> None:
        super().__init__()
        self.references: list[str] = []
        self.tags: list[str] = []
        self.csp: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        values = dict(attrs)
        for key in ("src", "href", "xlink:href", "action", "data", "poster", "srcset"):
            if values.get(key):
                self.references.append(values[key])
        if tag == "meta" and values.get("http-equiv") == "Content-Security-Policy":
            self.csp = values.get("content")


def test_cli_json_and_a_self_contained_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    report = tmp_path / "report.html"
    code = main(["doctor", "--example", "digits", "--steps", "3", "--warmup-steps", "1", "--json",
                 "--report", str(report), "--out", str(tmp_path / "run")])  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] in VERDICTS
    assert set(data["phases"]) == {
        "data",
        "h2d",
        "forward",
        "backward",
        "communication",
        "optimizer",
        "other",
    }
    assert sum(data["phases"].values()) == pytest.approx(data["step_seconds"])
    assert {"host_syncs", "retained_graphs", "advice", "mfu", "memory"} <= set(data)
    assert data["run"]["task_flags"] == "--example digits"
    page = _Resources()
    page.feed(report.read_text())
    assert page.csp == CSP
    assert page.tags.count("svg") == 2  # the phase chart and the memory chart, inline
    # Only references inside the page (SVG's own #ids) or inline data: nothing to fetch.
    assert all(ref.startswith(("#", "data:")) for ref in page.references), page.references
    assert "url(http" not in report.read_text()


@pytest.mark.serial  # its verdict weighs data against compute time (one thread: see one_compute_thread)
def test_cli_terminal_report(tmp_path: Path, capsys: pytest.CaptureFixture, one_compute_thread) -> None:
    flags = ["--steps", "2", "--warmup-steps", "1", "--global-batch-size", "16", "--progress", "none"]
    code = main(["doctor", "--example", "slowdata", *flags, "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0
    assert "verdict: data-bound" in out
    assert "1. load data in more worker processes" in out
    assert "--num-workers auto" in out


@pytest.mark.parametrize(("flag", "value", "field"), [("--steps", "0", "steps"),
                                                      ("--warmup-steps", "0", "warmup_steps")])  # fmt: skip
def test_bad_step_counts_are_one_line_errors(flag, value, field, capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", flag, value]) == 2
    allowed = "must be a positive integer" + {"steps": "", "warmup_steps": " (step 1 is never timed)"}[field]
    assert capsys.readouterr().err == f"leantrain: error: invalid {field}=0: {allowed}\n"


def test_the_doctor_command_gives_the_doctor_its_flags(tmp_path, monkeypatch, capsys) -> None:
    """One step timed after one warm-up step is allowed; the compile trial is on unless switched off;
    with --json the progress is off unless asked for (stdout carries the JSON alone)."""
    from leantrain.diagnose import doctor as doctor_module
    from leantrain.diagnose.probe import DEFAULT_STEPS, DEFAULT_WARMUP
    from tests.diagnose.test_report import diagnosis

    given = []

    def recorded(task, cfg, steps, warmup, trace, name, task_flags, try_compile):
        given.append((type(task).__name__, steps, warmup, trace, name, task_flags, try_compile, cfg.progress))
        return diagnosis()

    monkeypatch.setattr(doctor_module, "run_doctor", recorded)
    monkeypatch.setenv("COLUMNS", "80")  # the width rich gives a console that is not a terminal
    assert main(["doctor", "--steps", "1", "--warmup-steps", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == diagnosis().as_dict()
    trace = str(tmp_path / "trace")
    charlm = ["--example", "charlm", "--try-compile", "false", "--trace", trace, "--progress", "plain"]
    assert main(["doctor", *charlm, "--json"]) == 0
    capsys.readouterr()
    task = "tests.conftest:RegressionTask"
    assert main(["doctor", "--task", task]) == 0
    report = capsys.readouterr().out.splitlines()
    assert any("verdict: " in line for line in report)  # the report, not JSON, 110 columns wide at least
    assert max(map(len, report)) == 110
    assert given == [
        ("DigitsTask", 1, 1, None, "digits", "--example digits", True, "none"),
        ("CharLMTask", DEFAULT_STEPS, DEFAULT_WARMUP, trace, "charlm", "--example charlm", False, "plain"),
        (
            "RegressionTask",
            DEFAULT_STEPS,
            DEFAULT_WARMUP,
            None,
            "RegressionTask",
            f"--task {task}",
            True,
            "auto",
        ),
    ]


def test_trace_is_written_for_perfetto(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    d = run_doctor(RegressionTask(), quiet_config(tmp_path / "run"), steps=2, warmup=1, trace_dir=trace)
    files = list(trace.glob("*.pt.trace.json"))
    assert len(files) == 1 and d.trace_dir == str(trace)
    events = json.loads(files[0].read_text())["traceEvents"]
    assert any(event.get("name") == "aten::addmm" for event in events)


def test_a_non_finite_step_the_doctor_ran_is_named_in_its_report(tmp_path: Path) -> None:
    """With --on-nan skip the doctor's run goes on past the step; its report says where the NaN came from."""
    from rich.console import Console

    from leantrain.diagnose.report import print_report
    from tests.test_nan_policy import HugeTarget

    d = doctor(HugeTarget(), tmp_path, global_batch_size=16, on_nan="skip")
    assert d.nan_origin is not None and d.nan_origin.startswith("non-finite loss at step 3")
    assert d.as_dict()["nan_origin"] == d.nan_origin
    console = Console(record=True, width=400)
    print_report(d, console)
    assert f"non-finite step: {d.nan_origin}" in console.export_text()


def test_the_doctor_is_imported_on_first_use_not_with_its_package():
    """`leantrain.diagnose` (its probe's defaults, the checks a hand-written loop uses) loads without
    the training loop; `Diagnosis` and `run_doctor` come from the doctor when asked for."""
    code = (
        "import sys, leantrain.diagnose as d\n"
        "print('leantrain.trainer' in sys.modules, 'leantrain.diagnose.doctor' in sys.modules)\n"
        "from leantrain.diagnose import doctor\n"
        "print(d.run_doctor is doctor.run_doctor, d.Diagnosis is doctor.Diagnosis)\n"
        "try:\n    d.nope\nexcept AttributeError as error:\n    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.splitlines() == [
        "False False",
        "True True",
        "module 'leantrain.diagnose' has no attribute 'nope'",
    ]
