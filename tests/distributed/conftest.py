"""Helpers to run leantrain as several real processes (torchrun, gloo, CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file

from leantrain import cli
from tests.conftest import one_worker_at_a_time

REPO = Path(__file__).parents[2]
Watch = Callable[[str, threading.Event], None]
LEANTRAIN = str(Path(sys.executable).parent / "leantrain")


def worker_env() -> dict[str, str]:
    """One intra-op thread per process (2 cores are shared), the tests importable, and the CPU even
    where a GPU is present: these are gloo jobs, and a one-GPU machine cannot give each rank its own."""
    # The repository for `tests.`; then tests/conftest.py's path, which leads with the source tree
    # the tests loaded (the repository root holds no `leantrain` package, so that one is imported).
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}


# The stop signals torchrun's launcher installs handlers for in its own process (to forward them).
LAUNCHER_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
)


@contextmanager
def as_a_launcher() -> Iterator[None]:
    """This process set up as `leantrain launch` would be (the workers' environment, the repository
    as the working folder), and put back afterwards, with the signal handlers torchrun installs."""
    environment, folder = dict(os.environ), os.getcwd()
    handlers = {number: signal.getsignal(number) for number in LAUNCHER_SIGNALS}
    os.environ.update(worker_env())
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(folder)
        os.environ.clear()
        os.environ.update(environment)
        for number, handler in handlers.items():
            signal.signal(number, handler)


def _launcher_here(launch: Callable[[], int], watch: Watch | None = None) -> tuple[int, str]:
    """``launch()`` run as a launcher in this process (``as_a_launcher``), standard output and error,
    which the workers inherit, into a file: its exit code and that output. ``watch(path, finished)``,
    if given, reads the file on a thread while the launch runs."""
    with tempfile.NamedTemporaryFile() as output, as_a_launcher():
        sys.stdout.flush(), sys.stderr.flush()
        kept = os.dup(1), os.dup(2)
        os.dup2(output.fileno(), 1)  # the workers inherit these
        os.dup2(output.fileno(), 2)
        finished = threading.Event()
        if watch is not None:
            threading.Thread(target=watch, args=(output.name, finished), daemon=True).start()
        try:
            code = launch()
        finally:
            finished.set()
            sys.stdout.flush(), sys.stderr.flush()
            for fd, original in zip((1, 2), kept, strict=True):
                os.dup2(original, fd)
                os.close(original)
        output.seek(0)
        return code, output.read().decode(errors="replace")


def launch_here(
    *launch_arguments: str, check: bool = True, watch: Watch | None = None
) -> subprocess.CompletedProcess:
    """``leantrain launch ...``, with torchrun's launcher in this process: the workers are real
    processes, but the launcher's own interpreter start-up (~3 s of CPU a launch, most of a small
    test's cost) is saved; tests of the launcher itself start it as a process. The workers' output
    (stdout and stderr together) is returned as ``stdout``; a run that fails is an assertion error
    unless ``check`` is false. ``watch``: see ``_launcher_here``."""
    args = ["launch", *launch_arguments]
    code, text = _launcher_here(lambda: cli.main(args), watch)
    assert code == 0 or not check, f"leantrain {' '.join(args)} failed:\n{text[-6000:]}"
    return subprocess.CompletedProcess(["leantrain", *args], code, text, "")


def torchrun_here(*arguments: str) -> str:
    """``python -m torch.distributed.run ARGUMENTS`` (a script of plain torch), its launcher in this
    process as in ``launch_here``; the workers' output, stdout and stderr together."""
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def launch() -> int:
        try:
            run.main(list(arguments))
        except ChildFailedError:
            return 1
        return 0

    code, text = _launcher_here(launch)
    assert code == 0, f"torchrun {' '.join(arguments)} failed:\n{text[-6000:]}"
    return text


def fit_here(*fit_arguments: str) -> None:
    """``leantrain fit ...`` in this process, on the CPU like the launched ranks: the one-process
    reference of a test of the math across processes. Its interpreter start-up (~3 s) would be
    most of such a small run, and the CLI is not what these tests check."""
    assert fit_arguments[0] == "fit", fit_arguments
    assert cli.main([*fit_arguments, "--device", "cpu"]) == 0, f"leantrain {' '.join(fit_arguments)} failed"


def trained_weights(out: Path, fit_arguments: list[str], processes: int = 1) -> dict:
    """Run ``fit`` (in this process, or under ``launch`` with more than one) into ``out``; its final
    weights."""
    arguments = [*fit_arguments, "--out", str(out)]
    if processes == 1:
        fit_here(*arguments)
    else:
        launch_here("--nproc-per-node", str(processes), *arguments)
    return load_file(out / "model.safetensors")


def worker_pids(launcher: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the worker processes that the torchrun launcher started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ranks = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"LOCAL_RANK=")]
        if parent == launcher and ranks:
            found[int(ranks[0])] = int(entry.name)
    return found


def run_with_one_kill(fit_arguments: list[str], kill_after: str, processes: int = 2) -> str:
    """``launch --nproc-per-node PROCESSES --max-restarts 1 fit ...`` (``launch_here``), SIGKILL rank 1
    once a line of the run starts with ``kill_after``; the group restarts and the run must end well.
    Returns the workers' output."""
    killed = []

    def kill_rank_1(path: str, finished: threading.Event) -> None:
        with open(path, "rb") as output:
            line = b""
            while not finished.is_set():
                line += output.readline()
                if not line.endswith(b"\n"):  # nothing new, or a line still being written
                    time.sleep(0.01)
                elif line.startswith(kill_after.encode()):
                    os.kill(worker_pids(os.getpid())[1], signal.SIGKILL)
                    killed.append(line)
                    return
                else:
                    line = b""

    launch = ["--nproc-per-node", str(processes), "--max-restarts", "1", *fit_arguments]
    stdout = launch_here(*launch, watch=kill_rank_1).stdout
    assert killed, f"no line started with {kill_after!r}:\n{stdout[-3000:]}"
    return stdout


# slow_sum_task on 2 ranks, 40 steps: the run that the killed-rank and SLURM requeue tests interrupt.
SLOW_SUM_ON_TWO_RANKS = ["--task", "tests.distributed.tasks:slow_sum_task", "--global-batch-size", "16",
                         "--micro-batch-size", "4", "--max-steps", "40", "--log-every-n-steps", "1",
                         "--progress", "plain", "--logger", "none"]  # fmt: skip


@pytest.fixture(scope="session")
def uninterrupted_slow_sum(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SLOW_SUM_ON_TWO_RANKS trained without a stop (a checkpoint every 4 steps, an average of the
    weights kept: neither changes the weights), launched once for every pytest-xdist worker
    (tests/launch/test_slurm.py imports it too)."""
    with one_worker_at_a_time(tmp_path_factory, "uninterrupted-slow-sum") as out:
        if not (out / "summary.json").exists():  # written last
            flags = ["--checkpoint-every", "4", "--ema-decay", "0.8", "--out", str(out)]
            launch_here("--nproc-per-node", "2", "fit", *SLOW_SUM_ON_TWO_RANKS, *flags)
    return out


@pytest.fixture
def quiet_fit_flags() -> list[str]:
    return ["--progress", "plain", "--logger", "none", "--log-every-n-steps", "5"]
