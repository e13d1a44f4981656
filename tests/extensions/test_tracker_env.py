"""The team's environment for the trackers (issue 40): ``MLFLOW_*`` and ``WANDB_*`` honoured (a flag >
the environment > leantrain's default), and a resumed run's tracker gets each step once, in order.

Each resumed run here is stopped after step 6 with its last checkpoint at step 4: rows 5 and 6
reached the tracker before the interruption, and the resumed run trains steps 5 and 6 again.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

import leantrain as lt
from leantrain.extensions.trackers import MARKS, TrackerCallback, read_mark, write_mark
from tests.conftest import TinyClassifier, quiet_config
from tests.extensions.test_trackers import wandb_records
from tests.test_resume import StopAt

RUN = dict(global_batch_size=64, max_steps=8, log_every_n_steps=1, checkpoint_every=4)
TEAM_VARIABLES = (
    *("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"),
    *("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_MODE", "WANDB_NAME"),
)


@pytest.fixture(autouse=True)
def no_team_environment(monkeypatch):
    """Each test sets what it tests; nothing from the machine's own environment leaks in."""
    for name in TEAM_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables made: making them takes seconds, copying the file not."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "empty.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def team_store(empty_store, tmp_path) -> str:
    """The URI of a fresh MLflow store, as a team's server would be."""
    shutil.copy(empty_store, tmp_path / "team.db")
    return f"sqlite:///{tmp_path / 'team.db'}"


def interrupted_then_resumed(out: Path, **settings) -> lt.FitResult:
    """Stopped in step 7 (rows 1 to 6 sent, the newest checkpoint at step 4), then resumed to step 8."""
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(out, **RUN, **settings), callbacks=[StopAt(7)]).fit(TinyClassifier())
    return lt.Trainer(quiet_config(out, **RUN, **settings, resume="auto")).fit(TinyClassifier())


def metric_steps(client, run_id: str, metric: str) -> Counter:
    return Counter(m.step for m in client.get_metric_history(run_id, metric))


def test_mlflow_logs_where_the_environment_says_and_gets_each_step_once_across_a_resume(
    tmp_path, team_store, monkeypatch, capsys
):
    """Bugs: MLFLOW_TRACKING_URI ignored (the run goes to the run folder's mlflow.db);
    MLFLOW_EXPERIMENT_NAME ignored; rows of retrained steps sent again after a resume."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    team = team_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", team)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-experiment")
    out = tmp_path / "run"
    interrupted_then_resumed(out, logger="mlflow", progress="plain")
    assert not (out / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=team)
    experiment = client.get_experiment_by_name("team-experiment")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert metric_steps(client, run.info.run_id, "train_loss") == Counter(range(1, 9))  # each step once
    said = capsys.readouterr().out.splitlines()
    assert (
        f"logger mlflow: {team} (MLFLOW_TRACKING_URI), experiment team-experiment (MLFLOW_EXPERIMENT_NAME); "
        "continues its run, which got the rows up to step 6 before the interruption: those steps, "
        "retrained, are not sent again"
    ) in said


def test_mlflow_attaches_to_the_run_id_the_flag_wins_and_the_server_knows_what_it_holds(
    tmp_path, team_store, monkeypatch
):
    """Bugs: MLFLOW_RUN_ID ignored (a run of its own is created); the environment's tracking URI
    taken over ``--mlflow-uri``; after a resume whose marks file is gone (a run folder moved to
    another machine), the tracker's own answer ignored (steps 5 and 6 sent again)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    flag, ignored = team_store, tmp_path / "ignored.db"
    client = MlflowClient(tracking_uri=flag)
    experiment_id = client.create_experiment("made-by-the-team")
    team_run = client.create_run(experiment_id, run_name="the team's run").info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{ignored}")
    monkeypatch.setenv("MLFLOW_RUN_ID", team_run)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        lt.Trainer(quiet_config(out, **RUN, logger="mlflow", mlflow_uri=flag), callbacks=[StopAt(7)]).fit(
            TinyClassifier()
        )
    (out / MARKS / "mlflow.json").unlink()  # only the tracker's own record is left
    lt.Trainer(quiet_config(out, **RUN, logger="mlflow", mlflow_uri=flag, resume="auto")).fit(
        TinyClassifier()
    )
    assert not ignored.exists()
    [run] = client.search_runs([experiment_id])
    assert run.info.run_id == team_run and run.info.status == "FINISHED"
    assert run.data.params["global_batch_size"] == "64"
    assert metric_steps(client, team_run, "train_loss") == Counter(range(1, 9))
    assert client.search_experiments(filter_string="name = 'leantrain'") == []


def wandb_runs(files: Path) -> list[tuple[str, str, list[int]]]:
    """(project, run id, the steps of its history rows with train_loss, in the order written) of each
    W&B offline run folder under ``files``, oldest first."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for path in sorted(files.glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime_ns):
        project, run_id, steps = "", "", []
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.HasField("run"):
                project, run_id = record.run.project, record.run.run_id
            if record.HasField("history"):
                keys = {item.key or "/".join(item.nested_key) for item in record.history.item}
                if "train_loss" in keys:
                    steps.append(record.history.step.num)
        found.append((project, run_id, steps))
    return found


def test_wandb_writes_where_the_environment_says_and_gets_each_step_once_across_a_resume(
    tmp_path, monkeypatch
):
    """Bugs: WANDB_DIR overridden by the run folder; WANDB_PROJECT or WANDB_RUN_ID ignored (leantrain's
    project, an id of its own); rows of retrained steps sent again after a resume (W&B drops a step
    that goes backwards, or keeps it twice once synced)."""
    pytest.importorskip("wandb")
    for name, value in [
        ("WANDB_MODE", "offline"),
        ("WANDB_SILENT", "true"),
        ("WANDB_DIR", str(tmp_path / "wd")),
    ]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_PROJECT", "team-project")
    monkeypatch.setenv("WANDB_RUN_ID", "teamrun01")
    out = tmp_path / "run"
    interrupted_then_resumed(out, logger="wandb")
    assert not (out / "wandb").exists()
    runs = wandb_runs(tmp_path / "wd" / "wandb")
    deadline = time.monotonic() + 20  # W&B's own process may still be writing the resumed run's file
    while (len(runs) < 2 or not runs[-1][2]) and time.monotonic() < deadline:
        time.sleep(0.5)
        runs = wandb_runs(tmp_path / "wd" / "wandb")
    # Offline, each process writes a folder of its own: one run id, its steps in order, each once.
    assert [(project, run_id) for project, run_id, _ in runs] == [("team-project", "teamrun01")] * 2
    assert [step for *_, steps in runs for step in steps] == list(range(1, 9))


class Receiver:
    """A tracker that records each row as it arrives; from ``hang_at`` on it never answers (the
    process is killed while the call is in flight)."""

    name, where, attach, describe = "mlflow", "fake://tracking", None, "fake://tracking"

    def __init__(self, hang_at: int | None = None) -> None:
        self.hang_at = hang_at
        self.received: list[int] = []
        self.hung = threading.Event()

    def start(self, params, run_key, resumed) -> None:
        return None  # the tracker's own answer says nothing of what it holds

    def log(self, step, metrics) -> None:
        self.received.append(step)
        if step == self.hang_at:
            self.hung.set()
            threading.Event().wait()  # never answers: the daemon thread is left behind

    def finish(self, summary) -> None:
        pass


def test_a_row_in_flight_when_the_process_dies_is_never_sent_twice(tmp_path):
    """Bug: the marks file written after each row's call, not before: a kill during the call leaves
    it one row behind what the tracker got, and the resumed run sends that step again."""
    marks = tmp_path / MARKS / "mlflow.json"
    before = Receiver(hang_at=6)
    killed = TrackerCallback(before, {}, lambda text: None, timeout=60, marks=marks)
    for step in range(1, 7):
        killed.on_log(step, {"loss": 1.0})
    assert before.hung.wait(30)  # row 6 reached the tracker; its call never returns
    after = Receiver()
    resumed = TrackerCallback(after, {}, lambda text: None, timeout=60, marks=marks)
    resumed.load_state_dict(killed.state_dict())  # the checkpoint of step 4 holds the run's key
    for step in range(5, 9):
        resumed.on_log(step, {"loss": 1.0})
    resumed.on_end({"steps": 8})
    assert before.received == [1, 2, 3, 4, 5, 6] and after.received == [7, 8]
    assert resumed.not_resent == 2


@pytest.mark.parametrize(
    ("flag", "env", "project", "chosen_by"),
    [("mine", "team", "mine", "--wandb-project"), (None, "team", "team", "WANDB_PROJECT"),
     (None, None, "leantrain", "default")],
)  # fmt: skip
def test_wandb_says_which_project_and_what_chose_it_and_online_it_logs_in_without_a_prompt(
    tmp_path, monkeypatch, flag, env, project, chosen_by
):
    """A run with no stdin (CI, a batch job) must never wait on W&B's key prompt."""
    pytest.importorskip("wandb")
    from leantrain.extensions.wandb_tracker import WandbTracker

    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if env:
        monkeypatch.setenv("WANDB_PROJECT", env)
    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker = WandbTracker(flag, tmp_path, timeout=5)
    assert tracker.project == project and f"project {project} ({chosen_by})" in tracker.describe
    logins: list[dict] = []
    tracker.wandb = SimpleNamespace(login=lambda **how: logins.append(how))
    tracker.connect()
    assert logins == []  # offline: nothing to reach
    monkeypatch.setenv("WANDB_MODE", "online")
    online = WandbTracker(flag, tmp_path, timeout=5)
    online.wandb = tracker.wandb
    online.connect()
    assert logins == [{"verify": True, "prompt": False}]


def test_wandb_says_where_its_files_go_and_what_chose_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from leantrain.extensions.wandb_tracker import WandbTracker

    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    said = WandbTracker(None, run_dir, 5).describe
    assert f"files in {run_dir / 'wandb'} (default: the run folder)," in said
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    said = WandbTracker(None, run_dir, 5).describe
    assert f"files in {tmp_path / 'elsewhere' / 'wandb'} (WANDB_DIR)," in said


@pytest.mark.parametrize("mode_from_env", [True, False])
def test_wandb_says_its_mode_server_entity_and_run_and_where_it_logs(tmp_path, monkeypatch, mode_from_env):
    pytest.importorskip("wandb")
    import wandb

    from leantrain.extensions.wandb_tracker import WandbTracker

    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    files = tmp_path / "run" / "wandb"
    if mode_from_env:
        monkeypatch.setenv("WANDB_MODE", "offline")
        offline = WandbTracker(None, tmp_path / "run", 5)
        assert offline.describe == (
            f"offline (WANDB_MODE), files in {files} (default: the run folder), project leantrain (default)"
        )
        assert offline.where == f"{files} (offline, project leantrain)"
        monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_ENTITY", "team")
    monkeypatch.setenv("WANDB_RUN_ID", "abc123")
    online = WandbTracker(None, tmp_path / "run", 5)
    settings = wandb.Settings()
    mode = "online (WANDB_MODE)" if mode_from_env else settings.mode
    assert online.describe == (
        f"{mode} to {settings.base_url}, files in {files} (default: the run folder), "
        "project leantrain (default), entity team (WANDB_ENTITY), run abc123 (WANDB_RUN_ID)"
    )
    assert online.where == f"{settings.base_url} (project leantrain)"


def test_wandb_keeps_the_bounds_the_user_set_in_its_own_variables(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from leantrain.extensions.wandb_tracker import WandbTracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_FINISH_TIMEOUT", raising=False)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")
    assert WandbTracker(None, tmp_path, timeout=5).bounds == {"finish_timeout": 5}


@pytest.mark.parametrize("resumed", [False, True])
def test_wandb_opens_its_run_with_every_setting_it_read_from_the_environment(tmp_path, monkeypatch, resumed):
    """W&B reads its environment once per process: every setting is passed to init, so that a second run
    in one process (a notebook, a test session) gets its own. A continued run's parameters are not sent
    again; W&B prints nothing of its own and waits on its server no longer than the tracker's bound."""
    pytest.importorskip("wandb")
    from leantrain.extensions.wandb_tracker import WandbTracker

    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_INIT_TIMEOUT", "WANDB_FINISH_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ENTITY", "team")
    monkeypatch.setenv("WANDB_NAME", "named-by-the-team")
    tracker = WandbTracker("proj", tmp_path / "run", timeout=7)
    opened: list[dict] = []
    tracker.wandb = SimpleNamespace(init=lambda **how: opened.append(how), Settings=lambda **how: how)
    assert tracker.start({"lr": 0.1}, "key0001", resumed=resumed) is None  # offline: nothing to continue
    assert opened == [
        {
            "project": "proj",
            "entity": "team",
            "dir": str(tmp_path / "run"),
            "name": "named-by-the-team",
            "mode": "offline",
            "id": "key0001",
            "resume": "allow",
            "config": None if resumed else {"lr": 0.1},
            "settings": {"silent": True, "console": "off", "init_timeout": 7, "finish_timeout": 7},
        }
    ]
    monkeypatch.delenv("WANDB_NAME")
    tracker.start({}, "key0001", resumed)
    assert opened[-1]["name"] == "run"  # the run folder's name


def test_an_online_wandb_run_continued_says_its_last_step_and_each_ending_has_its_exit_code(
    tmp_path, monkeypatch
):
    pytest.importorskip("wandb")
    from leantrain.extensions.wandb_tracker import WandbTracker

    monkeypatch.setenv("WANDB_MODE", "online")
    tracker = WandbTracker("proj", tmp_path, timeout=7)
    ended: list[tuple] = []
    run = SimpleNamespace(
        step=0, summary={}, finish=lambda exit_code: ended.append((exit_code, dict(run.summary)))
    )
    tracker.wandb = SimpleNamespace(init=lambda **how: run, Settings=lambda **how: how)
    # a continued run's W&B step is one past the last it holds; a new run, or one holding none, says nothing
    for step, resumed, last in [(5, True, 4), (1, True, 0), (0, True, None), (5, False, None)]:
        run.step = step
        assert tracker.start({}, "key0001", resumed=resumed) == last
    tracker.finish(None)  # failed or interrupted
    tracker.finish({"loss": 0.5})
    assert ended == [(1, {}), (0, {"summary/loss": 0.5})]


@pytest.mark.parametrize(
    ("content", "step"),
    [
        ('{"run": "r1", "step": 5}', 5),
        ('{"run": "r1", "step": 0}', 0),  # step 0 was handed over: a resume sends from step 1 on
        ('{"run": "other", "step": 5}', None),  # another tracker run's mark
        ('{"run": "r1", "step": -1}', None),
        ('{"run": "r1", "step": true}', None),
        ('{"run": "r1", "step": "5"}', None),
        ('{"run": "r1", "step": 5' + " " * 4073 + "}", None),  # 4,097 bytes: no marks file is that long
        ("[5]", None),
        ("garbage", None),
        (None, None),  # no file
    ],
)
def test_a_marks_file_is_believed_only_when_it_is_small_about_this_run_and_a_step(tmp_path, content, step):
    path = tmp_path / "wandb.json"
    if content is not None:
        path.write_text(content)
    assert read_mark(path, "r1") == step


@pytest.mark.parametrize(
    ("attach", "run_key"),
    [("moved-here", "moved-here"), (None, "saved-key"), ("(no attribute)", "saved-key")],
)
def test_a_resumed_tracker_continues_the_run_the_environment_names_else_the_checkpoints(attach, run_key):
    tracker = SimpleNamespace(name="wandb", where="fake")
    if attach != "(no attribute)":  # read with a default: a tracker may leave it out
        tracker.attach = attach
    callback = TrackerCallback(tracker, {}, print, timeout=5)
    callback.load_state_dict({"run_key": "saved-key"})
    assert callback.run_key == run_key and callback.resumed


def test_the_marks_file_is_written_once_a_step_not_once_a_row(tmp_path, monkeypatch):
    """A step's training row and its validation row reach the tracker one after the other: the step is
    marked before the first, and the file is not written again for the second."""
    from leantrain.extensions import trackers

    written = []
    monkeypatch.setattr(trackers, "write_mark", lambda path, key, step: written.append(step))
    tracker = SimpleNamespace(name="wandb", where="fake", attach=None, log=lambda step, row: None)
    callback = TrackerCallback(tracker, {}, print, timeout=5, marks=tmp_path / "wandb.json")
    for step, row in [(2, {"train_loss": 1.0}), (2, {"val_loss": 2.0}), (4, {"train_loss": 0.5})]:
        callback._deliver(step, row)  # what the tracker's thread does with each row it takes
    assert written == [2, 4]


def test_the_log_line_of_a_tracker_says_where_it_logs_when_it_has_no_description():
    plain = SimpleNamespace(name="mlflow", where="http://tracking:5000", attach=None)
    assert TrackerCallback(plain, {}, print, timeout=5).setup_lines() == [
        "logger mlflow: http://tracking:5000"
    ]
    plain.describe = "http://tracking:5000 (MLFLOW_TRACKING_URI)"
    said = TrackerCallback(plain, {}, print, timeout=5).setup_lines()
    assert said == ["logger mlflow: http://tracking:5000 (MLFLOW_TRACKING_URI)"]


class Recording:
    """A tracker that takes every call at once; ``held``: the last step its run already holds."""

    def __init__(self, held: int | None = None, gate: threading.Event | None = None) -> None:
        self.name, self.where, self.attach, self.held, self.gate = "wandb", "fake", None, held, gate
        self.logged: list[int] = []
        self.finished = False

    def start(self, params, run_key, resumed):
        if self.gate is not None:
            self.gate.wait(30)
        return self.held

    def log(self, step, metrics) -> None:
        self.logged.append(step)

    def finish(self, summary) -> None:
        self.finished = True


def test_the_calls_run_on_a_named_daemon_thread_and_a_run_delivered_in_full_says_nothing():
    gate = threading.Event()
    said: list[str] = []
    tracker = Recording(gate=gate)
    callback = TrackerCallback(tracker, {}, said.append, timeout=30)
    callback.on_log(1, {"train_loss": 1.0})
    try:  # the callback's thread, waiting in start (another test's thread may bear the same name)
        thread = next(t for t in threading.enumerate() if t is callback._thread)
    finally:  # the thread ends either way: a failing test must not hold the test process at exit
        gate.set()
        callback.on_end({"steps": 1})
    assert thread.name == "leantrain-wandb" and thread.daemon  # a silent tracker cannot hold the process
    assert tracker.logged == [1] and tracker.finished and said == []


def test_a_resumed_tracker_resends_from_the_later_of_its_marks_file_and_its_runs_own_record(tmp_path):
    marks = tmp_path / "wandb.json"
    write_mark(marks, "key", 8)
    tracker = Recording(held=6)  # the run's own record lags the marks file
    callback = TrackerCallback(tracker, {}, print, timeout=30, marks=marks)
    callback.load_state_dict({"run_key": "key"})
    for step in range(5, 11):
        callback.on_log(step, {"train_loss": 1.0})
    callback.on_end({"steps": 10})
    assert tracker.logged == [9, 10] and callback.not_resent == 4
