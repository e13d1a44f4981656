"""The doctor's instruments: a Trainer run measured in three stretches of steps.

1. **warm-up** steps are not measured (worker start-up, first-step allocations);
2. **timed** steps: the phase timer only, which costs a few clock reads per micro-batch;
3. **audited** steps: host syncs and retained graphs (TorchFunctionModes, slow per operation)
   and FLOPs (``FlopCounterMode``); never timed. The graphs recorded in the first audited
   step are looked at after the second: whatever is still alive outlived a whole step.
4. optionally **traced** steps under ``torch.profiler``.

The probe plugs into the Trainer through its ``Instruments`` seam (it wraps the precision,
the loss function, the loader and the batches when they are built, and hooks the strategy's
gradient all-reduce through ``register_comm_hook``; under ``--tp``, the collectives inside
forward and backward through ``collectives.py``) and its ``on_step`` callback (the step
boundaries).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.flop_counter import FlopCounterMode

from leantrain.diagnose.collectives import CollectiveClock
from leantrain.diagnose.syncs import HostSyncs, RetainedGraphs
from leantrain.diagnose.timer import PhaseTimer

# `leantrain doctor`'s stretches: timed steps and warm-up steps by default, and steps traced with
# --trace.
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 5
TRACED_STEPS = 3


@dataclass(frozen=True)
class Schedule:
    warmup: int
    timed: int
    traced: int = 0
    audited: int = 2  # record graphs in the first, look at them after the second

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.audited + self.traced


class StepProbe:
    """Implements the Trainer's ``Instruments`` and ``Callback.on_step`` for the doctor."""

    def __init__(self, device: torch.device, schedule: Schedule, trace_dir: Path | None = None) -> None:
        self.schedule = schedule
        self.timer = PhaseTimer(device)
        self.timer.enabled = False
        self.syncs = HostSyncs(device)
        self.graphs = RetainedGraphs()
        self.flop_counter = FlopCounterMode(display=False)
        self.trace_dir = trace_dir
        self.flops_per_step = 0
        self.retained: list = []
        self.audited_steps = 0
        self.backward_calls = 0  # in the timed steps
        self.backwards_with_all_reduce = 0  # of those, the ones that launched an all-reduce
        self._data_seconds = 0.0  # the wait for the batch being moved to the device
        self._launches: list[Any] = []  # clock marks of the all-reduces of the running backward
        self._modes = ExitStack()
        self.collectives = CollectiveClock(self.timer)  # tensor parallelism's, inside forward and backward
        self._wrapped = ExitStack()  # the collectives wrapped while the probe lives (tensor parallelism)
        self._tp, self._split_modules = 1, frozenset[str]()  # from the strategy: see _flops_per_rank
        self._profiler: torch.profiler.profile | None = None

    # -- Instruments: called once by the Trainer when it builds each piece --------------

    def precision(self, precision: Any) -> Any:
        return _TimedPrecision(precision, self)

    def strategy(self, strategy: Any) -> None:
        strategy.register_comm_hook(self._timed_all_reduce)  # DDP's all-reduce; others have none
        self._tp = getattr(getattr(strategy, "dims", None), "tp", 1)
        self._split_modules = frozenset(getattr(strategy, "split_modules", ()))
        if self._tp > 1:
            self._wrapped.enter_context(self.collectives)

    def _flops_per_rank(self) -> int:
        """The audited step's FLOPs on this rank. The counter sees a split layer's product as DTensor
        ops, with the whole layer's shapes: each rank computes 1/tp of those."""
        total = self.flop_counter.get_total_flops()
        if self._tp > 1:
            counts = self.flop_counter.get_flop_counts()  # "RootClass.<module name>" -> op -> FLOPs
            named = ((key.partition(".")[2], ops) for key, ops in counts.items())
            split = sum(sum(ops.values()) for name, ops in named if name in self._split_modules)
            total -= split * (1 - 1 / self._tp)
        return int(total)

    def loss(self, loss_fn: Any) -> Any:
        timer = self.timer

        collectives = self.collectives

        def timed_loss(model: torch.nn.Module, batch: Any) -> Any:
            start = timer.mark()  # marks, not timer.phase(): a context manager costs microseconds
            collectives.phase = "forward"
            try:
                return loss_fn(model, batch)
            finally:
                collectives.phase = None
                timer.add_interval("forward", start, timer.mark())

        return timed_loss

    def loader(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Host time spent waiting for each batch (the sync detector looks away meanwhile)."""
        timer, syncs = self.timer, self.syncs
        iterator = iter(batches)
        while True:
            syncs.paused = True
            start = timer.mark(host=True)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                syncs.paused = False
            end = timer.mark(host=True)
            timer.add_interval("data", start, end, host=True)
            self._data_seconds = end - start
            yield batch

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Host time to have each batch on the device, less the wait for data inside it."""
        timer = self.timer
        while True:
            self._data_seconds = 0.0
            start = timer.mark(host=True)
            try:
                batch = next(batches)
            except StopIteration:
                return
            outside_data = timer.mark(host=True) - start - self._data_seconds
            timer.add_seconds("h2d", max(outside_data, 0.0))
            yield batch

    # Not annotated: DDP checks a hook's annotations against the real types, and with
    # ``from __future__ import annotations`` they are strings.
    def _timed_all_reduce(self, state, bucket):  # type: ignore[no-untyped-def]
        """DDP's default all-reduce, with the moment each bucket's all-reduce is launched."""
        self._launches.append(self.timer.mark())
        return default_hooks.allreduce_hook(None, bucket)

    # -- the step boundaries ------------------------------------------------------------

    def on_step(self, stats: Any) -> None:
        done, plan, timer = stats.step, self.schedule, self.timer
        timed_end = plan.warmup + plan.timed
        if done == plan.warmup:
            timer.enabled = True
            timer.restart_step()
        elif plan.warmup < done <= timed_end:
            timer.end_step()
            if done == timed_end:
                timer.enabled = False
            if done == timed_end and plan.audited:  # none in the doctor's compiled trial
                self._modes.enter_context(self.syncs)
                self._modes.enter_context(self.graphs)
                self._modes.enter_context(self.flop_counter)
        elif done == timed_end + 1:
            self.flops_per_step = self._flops_per_rank()
            self._modes.close()  # the graph recorder and the flop counter stop; the syncs go on
            self._modes.enter_context(self.syncs)
            self.audited_steps = 1
        elif done == timed_end + 2:
            self._modes.close()
            self.audited_steps = 2
            self.retained = self.graphs.alive()
            self.graphs.forget()
            if plan.traced and self.trace_dir is not None:
                self._start_trace()
        elif self._profiler is not None:
            self._profiler.step()  # a ProfilerStep marker per training step in the trace
            if done == timed_end + 2 + plan.traced:
                self._profiler.__exit__(None, None, None)
                self._profiler = None

    def _start_trace(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.trace_dir)),
        )
        self._profiler.__enter__()

    def close(self) -> None:
        """Leave any mode or profiler still active (a run that ended early or failed), and put the
        collectives back."""
        self._modes.close()
        self._wrapped.close()
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None


class _TimedPrecision:
    """A Precision whose backward and optimizer step are timed; everything else passes through.

    In a DDP backward, the gradient all-reduce overlaps the computation; after the last
    bucket is launched only waiting is left. That tail is the *exposed* communication.
    """

    def __init__(self, inner: Any, probe: StepProbe) -> None:
        self._inner = inner
        self._probe = probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def backward(self, loss: torch.Tensor) -> None:
        probe, timer = self._probe, self._probe.timer
        probe._launches = []
        start = timer.mark()
        probe.collectives.phase = "backward"
        try:
            self._inner.backward(loss)
        finally:
            probe.collectives.phase = None
        end = timer.mark()
        if timer.enabled:
            probe.backward_calls += 1
        if probe._launches:
            last_launch = probe._launches[-1]
            timer.add_interval("backward", start, last_launch)
            timer.add_interval("communication", last_launch, end)
            if timer.enabled:
                probe.backwards_with_all_reduce += 1
        else:
            timer.add_interval("backward", start, end)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        timer = self._probe.timer
        start = timer.mark()
        self._inner.step(optimizer)
        timer.add_interval("optimizer", start, timer.mark())
