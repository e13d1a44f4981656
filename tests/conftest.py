"""Shared test fixtures: small deterministic tasks, and a quiet fit() helper."""

from __future__ import annotations

import fcntl
import gc
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import leantrain as lt

# Processes the tests start (the CLI, torchrun's workers, a killed save) import the same
# leantrain as the tests: the source tree this process loaded, first on their path. Under
# `make mutate` that is the mutated copy, whose mutants would otherwise go unseen there.
_SOURCE_ROOT = str(Path(lt.__file__).resolve().parents[1])
_OTHER_PATHS = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _SOURCE_ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join([_SOURCE_ROOT, *_OTHER_PATHS])

# Under `make mutate`, mutmut first records which functions each test reaches. It sees only the test
# process; tests/mutation_hooks/sitecustomize.py records what the processes a test starts run, in
# files that `pytest_runtest_teardown` below adds to the test's record (tests/MUTATION.md).
PROCESS_HITS = Path(__file__).resolve().parent.parent / "process-hits"  # in mutmut's mutants/ copy
if "MUTANT_UNDER_TEST" in os.environ:
    PROCESS_HITS.mkdir(exist_ok=True)
    os.environ["MUTMUT_PROCESS_HITS"] = str(PROCESS_HITS)
    _HOOKS = str(Path(__file__).resolve().with_name("mutation_hooks"))
    os.environ["PYTHONPATH"] = os.pathsep.join([_SOURCE_ROOT, _HOOKS, *_OTHER_PATHS])
    # mutmut's trampolines wrap every function of the mutated copy: the doctor must not take one of
    # their frames for the user's line that made a host sync (the next frame out is that line).
    import leantrain.diagnose.syncs as _syncs

    _is_library = _syncs._is_library
    _syncs._is_library = lambda filename: f"{os.sep}mutmut{os.sep}" in filename or _is_library(filename)


def python_path(*first: str | Path) -> str:
    """PYTHONPATH for a process a test starts: ``first``, then this process's (the source tree, and
    the user's entries: packages installed there, jsonargparse say, must stay importable)."""
    return os.pathsep.join([*map(str, first), os.environ["PYTHONPATH"]])


class RegressionTask:
    """A float64 MLP on random data; ``loss_kind`` picks a mean loss or a LossSum.

    For ``"sum"`` each sample has 1..4 valid target positions (a mask), so per-sample
    element counts differ, as token-level losses with padding do.
    """

    def __init__(self, samples: int = 160, loss_kind: str = "mean", dtype: torch.dtype = torch.float64):
        self.loss_kind = loss_kind
        self.dtype = dtype
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(samples, 6, generator=gen, dtype=dtype)
        self.y = torch.randn(samples, 4, generator=gen, dtype=dtype)
        lengths = torch.randint(1, 5, (samples,), generator=gen)
        self.mask = (torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).to(self.dtype)

    def train_data(self) -> Dataset:
        return TensorDataset(self.x, self.y, self.mask)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor | lt.LossSum:
        x, y, mask = batch
        error = (model(x) - y) ** 2
        if self.loss_kind == "mean":
            return error.mean()
        return lt.LossSum((error * mask).sum(), mask.sum())

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class DeepRegression(RegressionTask):
    """Four repeated blocks between an input and an output layer: something to split or pipeline."""

    def model(self) -> nn.Module:
        blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
        return nn.Sequential(nn.Linear(6, 16), *blocks, nn.Linear(16, 4)).to(self.dtype)


class PoisonedSteps(RegressionTask):
    """A RegressionTask whose loss is multiplied by ``factor`` on the given loss calls (1-based)."""

    def __init__(self, calls: set[int], factor: float = float("nan"), **kwargs) -> None:
        super().__init__(**kwargs)
        self.poisoned = calls
        self.factor = factor
        self.calls = 0

    def loss(self, model, batch):
        self.calls += 1
        loss = super().loss(model, batch)
        return loss * self.factor if self.calls in self.poisoned else loss


class PlantedSpikes:
    """A float64 regression onto a teacher network, with planted bad samples: the targets of the items
    in ``bad`` are scaled by ``factor`` (a step that meets one explodes), or with ``drop_bad`` the data
    has none of them (the run the healed one is compared with). A clean validation set."""

    def __init__(
        self, bad: Iterable[int] = (), factor: float = 1e3, samples: int = 4000, drop_bad: bool = False
    ) -> None:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(samples, 6, generator=gen, dtype=torch.float64)
        teacher = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        y = x @ teacher + 0.1 * torch.randn(samples, 4, generator=gen, dtype=torch.float64)
        self.val_x = torch.randn(256, 6, generator=gen, dtype=torch.float64)
        self.val_y = self.val_x @ teacher
        self.bad = list(bad)
        keep = torch.ones(samples, dtype=torch.bool)
        if drop_bad:
            keep[list(bad)] = False
        else:
            y[list(bad)] *= factor
        self.x, self.y = x[keep], y[keep]

    @classmethod
    def at_steps(cls, steps: Iterable[int], **kwargs: Any) -> PlantedSpikes:
        """One bad sample in each of these steps' global batches (1-based; seed 0, batch 16, 4000 samples)."""
        from leantrain.data.sampler import GlobalBatchSampler
        from leantrain.step.batching import BatchSplit

        order = GlobalBatchSampler(4000, BatchSplit(16, 16), 1000)
        return cls([order.global_batch(step - 1)[3] for step in steps], **kwargs)

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4)).double()

    def train_data(self) -> Dataset:
        return TensorDataset(self.x, self.y)

    def val_data(self) -> Dataset:
        return TensorDataset(self.val_x, self.val_y)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.02, momentum=0.9)


class StreamedRegression(RegressionTask):
    """RegressionTask's data as a stream (in index order), sized or not."""

    def __init__(self, sized: bool = True) -> None:
        super().__init__()
        self.sized = sized

    def train_data(self):
        data = super().train_data()

        class Stream(IterableDataset):
            def __iter__(inner):
                return (data[i] for i in range(len(data)))

        if self.sized:
            Stream.__len__ = lambda inner: len(data)
        return Stream()


class TinyClassifier:
    """A small classifier with validation data and an accuracy metric."""

    def __init__(self, samples: int = 256) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 8, generator=gen)
        self.y = (self.x[:, 0] > 0).long()

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def train_data(self) -> Dataset:
        return TensorDataset(self.x, self.y)

    def val_data(self) -> Dataset:
        return TensorDataset(self.x[:50], self.y[:50])

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def metrics(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"accuracy": (model(x).argmax(1) == y).float().mean()}

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-2)


class TiedEmbedding(nn.Module):
    """An embedding whose weight the output head shares (as language models tie them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


class ReadEachStep:
    """A callback that reads ``read()`` after each optimizer step (or only after ``steps``)."""

    def __init__(self, read: Any, steps: set[int] | None = None) -> None:
        self.read, self.steps = read, steps
        self.values: dict[int, Any] = {}

    def on_step(self, stats: Any) -> None:
        if self.steps is None or stats.step in self.steps:
            self.values[stats.step] = self.read()

    def seen(self) -> set[Any]:
        return set(self.values.values())


@contextmanager
def one_worker_at_a_time(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A folder that every pytest-xdist worker of this session shares, held by one worker at a time:
    a session fixture that makes something slow in it once (if absent) serves all of them."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the workers' base folders are siblings under the session's own
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield folder


def without_validation(task: Any) -> Any:
    """``task`` with no validation data, for tests of the training steps: the end-of-run validation
    would cost most of a short run and checks nothing they assert."""
    task.val_data = lambda: None
    return task


def quiet_config(out_dir: Path, **fields: Any) -> lt.TrainConfig:
    """A config that writes into ``out_dir`` and prints nothing."""
    fields.setdefault("progress", "none")
    fields.setdefault("logger", "none")
    return lt.TrainConfig(out_dir=str(out_dir), **fields)


@pytest.fixture
def native_16_bit_cpu(monkeypatch):
    """A CPU with bf16 and fp16 matrix instructions, as far as leantrain can tell: tests of what a
    16-bit run warns about would otherwise also see the warning about this machine's CPU."""
    monkeypatch.setattr("leantrain.runtime.native_16_bit", lambda kind: True)


@pytest.fixture
def fit(tmp_path: Path):
    """fit(task, **config_fields) -> FitResult, each call in its own run folder."""
    counter = iter(range(1000))

    def run(task: Any, callbacks: Iterable[Any] = (), **fields: Any) -> lt.FitResult:
        config = quiet_config(tmp_path / f"run{next(counter)}", **fields)
        return lt.Trainer(config, callbacks=list(callbacks)).fit(task)

    return run


class HeavyFromStep(RegressionTask):
    """Once ``heavy`` (from the start, or set by a callback), each loss also saves ~8 KiB per sample
    for backward; ``rank`` limits that to one process (RANK), None to all."""

    def __init__(
        self, heavy: bool = True, rank: int | None = None, after_step: int | None = None, after_calls: int = 0
    ) -> None:
        super().__init__()
        self.heavy, self.rank, self.after_step = heavy, rank, after_step
        self.after_calls, self.calls = after_calls, 0  # heavy from loss call ``after_calls`` + 1 on, if set

    def on_step(self, stats) -> None:  # used as a callback too: heavy after step ``after_step``
        if self.after_step is not None and stats.step >= self.after_step:
            self.heavy = True

    def loss(self, model, batch):
        import os

        x, y, _ = batch
        prediction = model(x)  # one forward per micro-batch, as DDP requires
        loss = ((prediction - y) ** 2).mean()
        self.calls += 1
        mine = self.rank is None or os.environ.get("RANK", "0") == str(self.rank)
        if (self.heavy or 0 < self.after_calls < self.calls) and mine:
            wide = prediction.repeat(1, 256).tanh()  # tanh saves its [micro, 1024] output
            loss = loss + 0 * wide.sum()
        return loss


# The tests that start processes (launches, the CLI, kills) are the long ones: they run first, so
# that `make test`'s pytest-xdist workers end on short tests. Work stealing moves queued tests,
# not a running one: a long test started last would run alone while the other worker idles.
# tests/test_peer_bugs.py shares two launches among its tests.
PROCESS_TESTS = ("tests/distributed/", "tests/e2e/", "tests/launch/", "tests/test_peer_bugs.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" in mutant:
        items.sort(key=_mutant_test_order(mutant))
        from mutmut.state import state  # pinned to 3.8.x: its measured test durations

        beyond = _beyond_the_budget(items, state().duration_by_test, MUTANT_TEST_SECONDS)
        if beyond:
            config.hook.pytest_deselected(items=items[-beyond:])
            del items[-beyond:]
        return
    items.sort(key=lambda item: not item.nodeid.startswith(PROCESS_TESTS))  # stable: order kept within


# `make mutate` runs a mutant's tests until the first fails (-x). mutmut's fork-server runner hands
# them over in no order, and most tests that reach a function never exercise most of its lines
# (every fit calls `Persistence.resume`; few resume). So the tests that killed the function's earlier
# mutants go first, most kills first, then the rest fastest first: a killed mutant runs one or two
# tests, not the ~60 that reached its function before the one that kills it.
KILLERS = Path(__file__).resolve().parent.parent / "mutmut-killers.txt"  # in mutmut's mutants/ copy


# A function every fit reaches is reached by ~900 tests (18 minutes): a mutant of it that survives would
# run them all. A mutant runs its tests in the order above until their recorded time passes this budget;
# one that survives them is a survivor (at worst a bug a slower test would have caught: a fast test for
# it is worth writing). MUTANT_TEST_SECONDS=0: no budget.
MUTANT_TEST_SECONDS = float(os.environ.get("MUTANT_TEST_SECONDS", "120"))


def _beyond_the_budget(ordered: list[pytest.Item], durations: dict[str, float], budget: float) -> int:
    """How many of the last tests of ``ordered`` fall past ``budget`` seconds of their recorded
    ``durations``; the first test always runs, and a budget of 0 runs them all."""
    if budget <= 0:
        return 0
    spent = 0.0
    for index, item in enumerate(ordered):
        spent += durations.get(item.nodeid, 0.0)
        if spent > budget and index > 0:
            return len(ordered) - index
    return 0


def _mutated_function(mutant: str) -> str:
    return mutant.rsplit("__mutmut_", 1)[0]


def _mutant_test_order(mutant: str) -> Any:
    from mutmut.state import state  # pinned to 3.8.x: its measured test durations

    durations = state().duration_by_test
    function = _mutated_function(mutant)
    kills: dict[str, int] = {}
    if KILLERS.is_file():
        for line in KILLERS.read_text().splitlines():
            killed_function, _, test = line.partition("\t")
            if killed_function == function:
                kills[test] = kills.get(test, 0) + 1
    return lambda item: (-kills.get(item.nodeid, 0), durations.get(item.nodeid, 0.0))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if mutant == "stats" and report.when == "call" and "PYTEST_XDIST_WORKER" in os.environ:
        with (PROCESS_HITS / "durations").open("a") as durations:  # for tests/mutation_run.py
            durations.write(f"{report.nodeid}\t{report.duration}\n")
    if report.failed and "__mutmut_" in mutant:
        with KILLERS.open("a") as killers:  # one short line per write: appends do not interleave
            killers.write(f"{_mutated_function(mutant)}\t{report.nodeid}\n")


@pytest.hookimpl(tryfirst=True)  # before mutmut's own teardown hook reads the test's record
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or "PYTEST_XDIST_WORKER" in os.environ:
        return  # on xdist's workers tests/mutation_run.py reads the files (see record_stats_in_parallel)
    from mutmut.state import state  # pinned to 3.8.x: the hits it records for the running test

    for hits in PROCESS_HITS.glob("*.hits"):
        state()._stats.update(line.split("\t")[1] for line in hits.read_text().splitlines())
        hits.unlink()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the heap the tests share, as the CLI's entry point does (``leantrain/entry.py``).

    After collection, torch, the engine and the test modules hold about a million objects that
    live until the end; every full garbage collection would walk them again (0.1-0.3 s each on
    this machine, several per test). Frozen, collections see only what the tests make. The two
    imports that the first ``Trainer.fit`` would make are made first (the engine, and torch's
    ``_dynamo``, which the first optimizer imports: ~2 s), so that they are frozen too and paid
    once. Under ``make mutate`` this runs in mutmut's fork server, and every forked mutant run
    inherits the frozen heap: a mutant's first test took ~4 s without it, ~0.8 s with it."""
    import torch._dynamo  # noqa: F401

    import leantrain.trainer  # noqa: F401

    gc.freeze()
