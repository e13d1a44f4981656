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


# `make mutate`'s own hooks (tests/MUTATION.md): nothing in them runs outside it.
pytest_plugins = ["tests.mutation_plugin"]


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", ""):
        return  # tests/mutation_plugin.py orders a mutant's tests
    items.sort(key=lambda item: not item.nodeid.startswith(PROCESS_TESTS))  # stable: order kept within


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
