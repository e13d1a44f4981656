"""The Strategy contract: where a run's work happens, and what its processes tell each other.

A strategy is chosen by name (``--strategy``, see ``registry.py``). Before any process starts,
its class checks the config (``check_config`` applies the rules its class attributes declare,
then ``check``). Each process then builds one: ``wrap`` places or wraps the model, after
``precision.prepare`` and activation checkpointing, so wrappers see the model as it will run;
the optimizer is built after, over ``optimizer_params``. From then on the accumulator, the
loop, validation and checkpoints only call the methods below and never ask which strategy
they have.

The defaults are those of one process on one device: nothing to communicate, a plain loop of
forward and backward over the micro-batches. A new strategy is one module in this package
that subclasses ``Strategy``, sets ``name`` and overrides what differs; ``registry.py`` finds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from leantrain.config import TrainConfig
from leantrain.step.accumulator import LossFn, MicroLoss, TermFn
from leantrain.step.batching import BatchSplit
from leantrain.step.evaluation import LossAndMetrics, batch_size_of
from leantrain.step.precision import Precision, local_grad_norm
from leantrain.strategies.dims import ParallelDims


class Example(NamedTuple):
    """What a strategy may need of the task: the loss and a function that returns one micro-batch
    on the device (called only when needed: it loads data), for a strategy that traces the model
    (a pipeline); the task's ``tp_plan(model)``, if it has one, for tensor parallelism."""

    loss_fn: LossFn
    batch: Callable[[], Any]
    tp_plan: Callable[[nn.Module], Any] | None = None


class Caveat(NamedTuple):
    """A known cost of a strategy, as the doctor advises on it."""

    title: str
    why: str
    change: str
    gain: str


class Strategy:
    """The contract, with the defaults of one process on one device (see ``single.py``)."""

    name: ClassVar[str] = ""  # what --strategy names it; empty: not a strategy of its own
    summary: ClassVar[str] = ""  # its line in `leantrain fit --help`
    multi_process: ClassVar[bool] = False  # needs several processes (torchrun); else exactly one
    sharded: ClassVar[bool] = False  # each process holds a part of the state: DCP checkpoints
    adapts_micro_batch: ClassVar[bool] = True  # micro_batch_size auto, memory_budget
    precisions: ClassVar[tuple[str, ...] | None] = None  # the precisions it supports; None: all
    precision_reason: ClassVar[str] = ""  # why only those, for the error
    needs: ClassVar[tuple[str, ...]] = ()  # config fields it requires (and that only it uses)
    uses: ClassVar[tuple[str, ...]] = ()  # config fields only it uses, optional
    caveat: ClassVar[Caveat | None] = None  # a known cost of the strategy, which the doctor reports
    simulated: ClassVar[bool] = True  # ``plan --cluster`` can run it on fake tensors (see ``planning``)

    # -- before any process starts (class methods: no model, no process group) -------------

    @classmethod
    def check(cls, cfg: TrainConfig, world_size: int | None) -> None:
        """Rules of this strategy beyond those its class attributes declare (``world_size``:
        the processes launched, when known). Raise a ConfigError naming the field."""

    @classmethod
    def dims(cls, cfg: TrainConfig, world_size: int) -> ParallelDims:
        """How the processes are arranged: data-parallel ranks (groups of ``--tp`` ranks, with it)."""
        return ParallelDims.of(world_size, tp=cfg.tp)

    @classmethod
    def with_tensor_parallel(cls) -> type[Strategy] | None:
        """The class that runs this strategy with ``--tp`` above 1 (see ``tensor_parallel.py``);
        None: this strategy has no tensor parallelism."""
        return None

    @classmethod
    def input_device(cls, cfg: TrainConfig, device: torch.device) -> torch.device:
        """Where the batches go (and the device the process drives)."""
        return device

    @classmethod
    def build_device(cls, device: torch.device) -> torch.device:
        """Where the model is built, before ``wrap`` places it."""
        return device

    @classmethod
    def check_task(cls, task: Any) -> None:
        """A TaskError when the task uses something this strategy cannot run."""

    @classmethod
    def can_sync_batch_norm(cls, device: torch.device) -> bool:
        """Whether ``--sync-batchnorm`` would apply on ``device`` (see ``sync_batch_norm.py``)."""
        return False

    # -- in each process, once the process group is up ------------------------------------

    def __init__(self, cfg: TrainConfig, device: torch.device, dims: ParallelDims) -> None:
        self.cfg, self.device, self.dims = cfg, device, dims
        self.model: nn.Module = nn.Module()  # the unwrapped model (or stage): state dicts, weights
        self.module: nn.Module = self.model  # what forward and backward run on
        self.notes: list[str] = []  # what ``wrap`` decided, for the run log
        # ``leantrain plan --cluster`` runs the strategy on fake tensors over a fake process group
        # (``simulate/``): what reads values (a check, a C++ reducer) steps aside while this is set.
        self.planning = False

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        """Place or wrap the model (``example``: for strategies that trace it)."""
        self.model = self.module = model

    def held(self) -> list[torch.Tensor]:
        """Under ``planning``: tensors the strategy holds beyond the model's and the optimizer's (what a
        wrapper it could not build would hold), for the plan to count."""
        return []

    def reset_after_out_of_memory(self) -> None:
        """Start clean after a step that every rank abandoned for an out-of-memory error."""

    def register_comm_hook(self, hook: Callable[..., Any]) -> None:
        """Time (or change) the gradient all-reduce: DDP's communication hook. Nothing to hook here."""

    @property
    def comm_device(self) -> torch.device:
        """Where tensors for collectives live."""
        return self.device

    def optimizer_params(self, prepared: list[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer updates, given what precision.prepare returned before wrapping."""
        return prepared

    def trained_weights(
        self, precision: Precision, frozen: frozenset[str] = frozenset()
    ) -> dict[str, torch.Tensor]:
        """The weights to export (call on every rank: a sharded strategy gathers them to rank 0),
        but for the ``frozen`` names (an adapter model's base)."""
        weights = precision.trained_state_dict(self.model)
        return {name: value for name, value in weights.items() if name not in frozen}

    # -- collectives: the identity on one process ------------------------------------------

    def no_sync(self) -> AbstractContextManager[Any]:
        """Around forward and backward of a non-final micro-batch: skip the gradient reduction."""
        return nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def any_rank(self, flag: bool) -> bool:
        return flag

    def gather(self, value: Any) -> list[Any]:
        """``value`` from every rank, in rank order."""
        return [value]

    # -- one optimizer step and validation -------------------------------------------------

    def prepare_step(self, split: BatchSplit, precision: Precision) -> None:
        """Called when the micro-batch split is set or changes (a pipeline builds its schedule)."""

    def forward_backward(
        self,
        loss_fn: LossFn,
        batches: Iterator[Any],
        count: int,
        term: TermFn,
        precision: Precision,
        before_last_backward: Callable[[], None],
    ) -> list[MicroLoss]:
        """Forward and backward of the next ``count`` micro-batches; gradients accumulate.

        ``no_sync`` is entered around forward *and* backward of every non-final micro-batch;
        ``term(loss, micro)`` turns each loss into what backward runs on. Return each micro-batch's
        ``MicroLoss.after_backward()``: nothing of its graph may outlive its backward.
        """
        results = []
        last = count - 1
        for micro in range(count):
            batch = next(batches)
            with nullcontext() if micro == last else self.no_sync():
                with precision.autocast():
                    loss = loss_fn(self.module, batch)
                result = term(loss, micro)
                if micro == last:
                    before_last_backward()
                precision.backward(result.term)
            results.append(result.after_backward())
            del loss, result  # the graph goes now, not when the next micro-batch's forward replaces them
        return results

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        """After the micro-batches' backward, before normalisation: reductions of its own."""

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The total norm of the model's gradient, for clipping."""
        return local_grad_norm(grads)

    def forward_only(
        self, loss_and_metrics: LossAndMetrics, batches: Iterable[Any], precision: Precision
    ) -> Iterator[tuple[Any, dict[str, Any], int]]:
        """(loss, metrics, samples) of each batch this process computes a loss for, in eval mode."""
        was_training = self.module.training
        self.module.eval()
        try:
            for batch in batches:
                with precision.autocast():
                    loss, extra = loss_and_metrics(self.module, batch)
                yield loss, extra, batch_size_of(batch)
        finally:
            self.module.train(was_training)

    # -- checkpoints of strategies whose processes hold parts of the state -------------------

    def save_sharded(
        self,
        folder: Path,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        background: bool = False,
        frozen: frozenset[str] = frozenset(),
    ) -> Any:
        raise NotImplementedError(f"strategy {self.name} saves whole checkpoints")

    def load_sharded(
        self,
        folder: Path,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        frozen: frozenset[str] = frozenset(),
    ) -> None:
        raise NotImplementedError(f"strategy {self.name} loads whole checkpoints")
