"""A tracker that is down, slow or silent never holds up training (issue 42).

A real TCP server that accepts connections and never answers stands for a tracking server under
load or a proxy that swallows requests; a fake tracker (through the ``Tracker`` protocol) that
blocks stands for one that stops answering mid-run. Each test carries a pytest timeout: on the
bug it names, the run would hang, and the timeout turns the hang into a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

import leantrain as lt
from leantrain import cli
from leantrain.extensions import mlflow_tracker
from leantrain.extensions.trackers import PACKAGES, TrackerCallback
from tests.conftest import TinyClassifier, quiet_config

RUN = dict(global_batch_size=64, max_steps=8, log_every_n_steps=2)
# MLflow's HTTP settings leantrain sets in the process's environment: restored after each test.
HTTP_SETTINGS = (
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
)


@pytest.fixture(autouse=True)
def http_settings_restored(monkeypatch):
    for name in HTTP_SETTINGS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def silent_server() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server that accepts every connection and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])  # held open, never read, never answered

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    done.set()
    thread.join()
    for connection in [*held, listener]:  # an abandoned tracker's request ends here, with an error
        connection.close()


def refused_uri() -> str:
    """A local port nothing listens on: connecting is refused at once."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def tracker_warnings(caught: list[warnings.WarningMessage], name: str) -> list[str]:
    texts = [str(w.message) for w in caught if issubclass(w.category, lt.LeantrainWarning)]
    return [text for text in texts if f"logger {name}" in text]


class BlockingTracker:
    """A tracker whose ``log`` answers ``answers`` times, then blocks until ``release`` is set."""

    name = "mlflow"
    where = "fake://tracking"

    def __init__(self, answers: int) -> None:
        self.answers = answers
        self.rows: list[int] = []
        self.finished = False
        self.blocked = threading.Event()
        self.release = threading.Event()

    def connect(self) -> None:
        pass

    def start(self, params, run_key, resumed) -> None:
        pass

    def log(self, step, metrics) -> None:
        if len(self.rows) >= self.answers:
            self.blocked.set()
            self.release.wait()
        self.rows.append(step)

    def finish(self, summary) -> None:
        self.finished = True


class StepCounter:
    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def on_step(self, stats: lt.StepStats) -> None:
        self.steps.append(stats.step)


@pytest.mark.timeout(60)
def test_a_silent_mlflow_server_costs_the_run_its_bound_and_one_warning(tmp_path, silent_server, monkeypatch):
    """Bug: the end of the run joins the tracker's thread without a bound. MLflow's own request
    timeout is set long here, as a user may (it is kept): only leantrain's bound ends the wait."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    config = quiet_config(
        tmp_path / "run", **RUN, logger="mlflow", mlflow_uri=silent_server, tracker_timeout=2
    )
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lt.Trainer(config).fit(TinyClassifier())
    assert time.monotonic() - started < 2 + 20
    assert result.steps == 8
    # Said at the end; or, on a machine so busy that 2 s pass between two log points, during the run.
    [said] = tracker_warnings(caught, "mlflow")
    assert said in (
        f"logger mlflow at {silent_server}: 5 rows and the summary were not delivered within 2 s; "
        "metrics.csv has every value",
        f"logger mlflow at {silent_server} did not answer within 2 s and is switched off for this run; "
        "training goes on, metrics.csv has every value",
    )
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "600"  # the user's value, kept
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"  # leantrain's, where none was set


@pytest.mark.timeout(60)
def test_mlflow_requests_to_a_silent_server_give_up_after_the_bound(tmp_path, silent_server):
    """Bug: MLflow's defaults (120 s a request, 7 retries with backoff) left in force: the
    abandoned thread, and a required tracker's check, would wait minutes."""
    pytest.importorskip("mlflow")
    from mlflow.exceptions import MlflowException

    tracker = mlflow_tracker.MLflowTracker(silent_server, tmp_path, timeout=1)
    started = time.monotonic()
    with pytest.raises(MlflowException, match=r"timeout|timed out"):
        tracker.connect()
    # 3 tries of 1 s and backoffs of 0 and 2 s (+ up to 1 s of jitter each): well under 20 s.
    assert time.monotonic() - started < 20


@pytest.mark.timeout(60)
def test_a_tracker_that_stops_answering_mid_run_is_switched_off_once_and_never_waited_on(
    tmp_path, monkeypatch
):
    """Bug: a call in flight for longer than the bound is not noticed during the run (the run's
    end would then wait the bound and report it as undelivered rows instead)."""
    pytest.importorskip("mlflow")
    fake = BlockingTracker(answers=2)
    monkeypatch.setattr(mlflow_tracker, "MLflowTracker", lambda uri, run_dir, timeout: fake)

    class OutwaitsTheBound:
        """Once the tracker is stuck, the next log point comes after more than the bound."""

        def on_log(self, step, metrics) -> None:
            if step == 3:  # row 3 is the one the tracker blocks on
                assert fake.blocked.wait(30)
                time.sleep(0.5 + 0.2)

    settings = dict(global_batch_size=64, max_steps=12, log_every_n_steps=1, tracker_timeout=0.5)
    config = quiet_config(tmp_path / "run", **settings, logger="mlflow")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lt.Trainer(config, callbacks=[OutwaitsTheBound()]).fit(TinyClassifier())
    fake.release.set()
    assert result.steps == 12
    assert tracker_warnings(caught, "mlflow") == [
        "logger mlflow at fake://tracking did not answer within 0.5 s and is switched off for this run; "
        "training goes on, metrics.csv has every value"
    ]
    assert fake.rows[:2] == [1, 2] and not fake.finished


def test_the_queue_of_a_stuck_tracker_stays_within_its_bound_and_counts_what_it_drops():
    """Bug: an unbounded queue (a stuck tracker grows the process's memory, row by row)."""
    fake = BlockingTracker(answers=0)
    said: list[str] = []
    callback = TrackerCallback(fake, {}, said.append, timeout=60, max_rows=5)
    callback.on_log(1, {"loss": 1.0})
    assert fake.blocked.wait(30)  # row 1 in flight, its call blocked
    longest = 0
    for step in range(2, 1001):
        callback.on_log(step, {"loss": 1.0})
        longest = max(longest, callback._calls.qsize())
    assert longest <= 5 and callback.dropped == 995
    fake.release.set()  # the tracker answers again: what the queue held is delivered, in order
    callback.on_end({"steps": 1000})
    assert fake.rows == [1, 2, 3, 4, 5] and fake.finished
    assert said == [
        "logger mlflow at fake://tracking: 995 rows were not delivered (995 dropped from its full queue "
        "of 5 rows); metrics.csv has every value"
    ]


@pytest.mark.timeout(60)
def test_a_required_tracker_that_does_not_answer_stops_the_run_before_training(tmp_path, silent_server):
    """Bug: tracker_required not checked before training (the run trains without its tracker)."""
    pytest.importorskip("mlflow")
    config = quiet_config(
        tmp_path / "run",
        **RUN,
        logger="mlflow",
        mlflow_uri=silent_server,
        tracker_timeout=1,
        tracker_required=True,
    )
    steps = []
    with pytest.raises(lt.LeantrainError) as raised:
        lt.Trainer(config, callbacks=[StepCounter(steps)]).fit(TinyClassifier())
    assert str(raised.value) == (
        f"logger mlflow at {silent_server} did not answer within 1 s and tracker_required is set; "
        "nothing was trained"
    )
    assert steps == []
    # the call that never answered is left in a daemon thread that says what it waits on (thread dumps)
    left = [thread for thread in threading.enumerate() if thread.name == "leantrain-mlflow-connect"]
    assert left and all(thread.daemon for thread in left)  # a daemon: it cannot hold the process at exit


@pytest.mark.timeout(60)
def test_a_required_tracker_refused_at_the_start_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """Bug: the same, through the command line: it must print one line and exit 2."""
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    uri = refused_uri()
    args = ["fit", "--task", "tests.conftest:TinyClassifier", "--progress", "none", "--max-steps", "2"]
    args += ["--logger", "mlflow", "--mlflow-uri", uri, "--tracker-timeout", "20", "--tracker-required"]
    code = cli.main(args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"leantrain: error: logger mlflow at {uri} cannot be reached and tracker_required"
    )
    assert "Connection refused" in lines[0] and lines[0].endswith("nothing was trained")
    # the error's own class is named (mlflow's, whichever version raises it)
    assert re.search(r"tracker_required is set \((?!NoneType)\w+: ", lines[0]), lines[0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tracker_timeout": 0}, "invalid tracker_timeout=0: must be a positive number of seconds"),
        ({"tracker_timeout": float("inf")}, "invalid tracker_timeout=inf: must be a positive number"),
        ({"tracker_timeout": "soon"}, "invalid tracker_timeout='soon': must be a number"),
        ({"logger": "tensorboard", "tracker_required": True}, "invalid tracker_required=True: needs logger"),
    ],
)
def test_bad_tracker_bounds_are_one_line_errors_naming_the_field(fields, message):
    with pytest.raises(lt.ConfigError, match=f"^{re.escape(message)}"):
        lt.TrainConfig(**{"logger": "mlflow", **fields})


@pytest.mark.parametrize(
    ("unsent", "ended", "summary", "told"),
    [
        (0, False, None, "the end of its run was not delivered"),
        (0, False, {"loss": 1.0}, "the summary was not delivered"),
        (1, True, None, "1 row was not delivered"),
        (1, False, None, "1 row and the end of its run were not delivered"),
        (2, True, None, "2 rows were not delivered"),
        (2, False, {"loss": 1.0}, "2 rows and the summary were not delivered"),
    ],
)
def test_what_did_not_reach_a_tracker_is_told_in_words_that_agree(unsent, ended, summary, told):
    from leantrain.extensions.trackers import TrackerCallback

    class Tracker:
        name, where = "mlflow", "fake://tracking"

    callback = TrackerCallback(Tracker(), {}, print, timeout=2)
    assert callback._undelivered(unsent, ended, summary) == told


def test_mlflows_http_bounds_follow_the_tracker_timeout_and_keep_what_the_user_set(monkeypatch):
    pytest.importorskip("mlflow")
    from leantrain.extensions import mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "_HTTP_SET", {})
    for name in HTTP_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # the user's
    mlflow_tracker.bound_http_requests(0.4)  # whole seconds, at least 1
    assert [os.environ[name] for name in HTTP_SETTINGS] == ["1", "5", "1"]
    mlflow_tracker.bound_http_requests(2.5)  # a later run's bound replaces leantrain's own value
    assert [os.environ[name] for name in HTTP_SETTINGS] == ["3", "5", "1"]


def test_mlflow_says_where_it_logs_and_what_chose_it(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from leantrain.extensions.mlflow_tracker import MLflowTracker

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    tracker = MLflowTracker(None, tmp_path / "run", 5)
    store = f"sqlite:///{(tmp_path / 'run' / 'mlflow.db').resolve()}"
    assert tracker.uri == store
    assert tracker.describe == f"{store} (default: the run folder), experiment leantrain (default)"
    named = MLflowTracker(f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "run", 5)
    assert named.describe == f"sqlite:///{tmp_path / 'm.db'} (--mlflow-uri), experiment leantrain (default)"
    monkeypatch.setenv("MLFLOW_RUN_ID", "abc123")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    attached = MLflowTracker(None, tmp_path / "run", 5)
    assert attached.describe == f"{store} (default: the run folder), run abc123 (MLFLOW_RUN_ID)"
    assert attached.experiment == "team"


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("https://ann:s3cret@mlflow.example:5000/x", "https://ann:***@mlflow.example:5000/x"),
        ("https://ann:p@ss@mlflow.example/x", "https://ann:***@mlflow.example/x"),  # an @ in the password
        ("https://mlflow.example:5000", "https://mlflow.example:5000"),
    ],
)
def test_messages_name_the_mlflow_server_never_its_password(uri, shown):
    pytest.importorskip("mlflow")
    from leantrain.extensions.mlflow_tracker import _without_password

    assert _without_password(uri) == shown


def test_a_trackers_state_is_saved_under_its_name():
    """The key in the checkpoint: a later version resumes the checkpoints an earlier one wrote, and two
    trackers of one run keep their runs apart."""
    trackers = [SimpleNamespace(name=name, where="fake", attach=None) for name in PACKAGES]
    keys = [TrackerCallback(tracker, {}, print, 5).state_key for tracker in trackers]
    assert keys == ["tracker:mlflow", "tracker:wandb"]
