"""One rank's training step, simulated: the real strategy on a model of fake tensors.

Inside a fake world (``fake_world.py``) of the cluster's size, the task's model is built under
``FakeTensorMode`` (shapes and dtypes, no storage: a 70B model costs nothing), prepared as ``fit``
prepares it (LoRA adapters, precision, activation checkpointing), and handed to the strategy that
``fit`` would use, which shards and plans it over the fake process group exactly as on the cluster.
Then one optimizer step runs on a fake micro-batch of the task's shapes: forward and backward of up to
two micro-batches (the first without gradient sync, as accumulation runs it), the strategy's
gradient reductions, the gradient norm when clipping, the optimizer's update.

What it measures, with the instruments ``fit`` uses: the memory accountant's parameters, gradients,
optimizer state and saved activations (the numbers a real run's summary.json gives), the peak of
live tensors by kind (torch's ``MemTracker``: temporaries and communication buffers too), the
step's FLOPs (the doctor's counter), and every collective it issues (``traffic.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map_only

from leantrain.adapters import with_lora
from leantrain.blocks import BlockPolicy
from leantrain.config import TrainConfig
from leantrain.errors import ConfigError, LeantrainError, TaskError
from leantrain.memory.accountant import MemoryBreakdown, SavedActivations, breakdown
from leantrain.memory.estimate import fake_copy_of_parameters
from leantrain.memory.recompute import apply_activation_checkpointing
from leantrain.simulate.local_flops import LocalFlops
from leantrain.simulate.propagation import ShapePropagation
from leantrain.simulate.traffic import Sent, TrafficLog
from leantrain.step.accumulator import MicroLoss
from leantrain.step.precision import Precision, make_precision
from leantrain.strategies.base import Example, Strategy
from leantrain.task import LossSum

CPU = torch.device("cpu")


@dataclass(frozen=True)
class RankStep:
    """What one simulated rank holds and does in one optimizer step."""

    memory: MemoryBreakdown  # the accountant's, as a real run's summary.json gives it
    peak: dict[str, int]  # live bytes by kind at the step's peak (MemTracker), and "Total"
    flops: int  # the whole step's, on this rank (every micro-batch)
    sent: list[Sent]  # the whole step's collectives (every micro-batch)
    micro_batches: int  # per optimizer step, on this rank


def fake_batch(batch: Any, mode: FakeTensorMode | None, precision: Precision) -> Any:
    """``batch`` (a real collated micro-batch) as fake tensors (real ones without a ``mode``), floats in
    the precision's input dtype."""
    dtype = precision.input_dtype

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        return tensor if mode is None else mode.from_tensor(tensor)

    return tree_map_only(torch.Tensor, convert, batch)


def _term(loss: Any, samples: int) -> MicroLoss:
    """What backward runs on: the step's weighting does not change what is held."""
    value = loss.sum if isinstance(loss, LossSum) else loss
    if not isinstance(value, torch.Tensor):
        raise TaskError(f"task.loss must return a tensor or a LossSum, got {type(loss).__name__}")
    return MicroLoss(value, value.detach(), None, samples)


def _check_all_fake(model: nn.Module) -> None:
    """Every parameter fake after wrapping: a real one would be memory this machine pays for."""
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if not isinstance(local, FakeTensor):
            raise LeantrainError(
                f"plan --cluster: parameter {name} became a real tensor while the strategy wrapped the "
                "model; this strategy cannot be simulated on fake tensors"
            )


class _Batches:
    """The micro-batches of a step, telling the instruments which micro-batch runs."""

    def __init__(self, batch: Any, count: int, log: TrafficLog, tracker: Any) -> None:
        self.batch, self.count, self.log, self.tracker = batch, count, log, tracker

    def __iter__(self) -> Iterator[Any]:
        for micro in range(self.count):
            self.log.micro = micro
            if micro:
                self.tracker.reset_mod_stats()  # MemTracker keeps one forward per module; the peak stays
            yield self.batch


def _optimizer_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """The state a run holds from its second step on (Adam's moments are made by its first)."""
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _peak_tracker(propagation: ShapePropagation) -> Any:
    """torch's ``MemTracker``, keeping only the step's peak (its per-module peaks walk every module at
    every op: three quarters of a Llama 8B plan's time, and the plan reads the step's alone), and
    leaving out DTensor's tensors of whole shapes (``propagation.py``)."""
    from torch.distributed._tools import mem_tracker

    class StepPeak(mem_tracker.MemTracker):
        def _track(self, reftype: Any, tensor: torch.Tensor) -> None:
            if not propagation.running:
                super()._track(reftype, tensor)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[mem_tracker._TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[mem_tracker._TOTAL_KEY]
                    self._peak_mem_snap[device] = dict(snapshot)

    return StepPeak()


def _task_model(task: Any, cfg: TrainConfig, mode: FakeTensorMode | None) -> nn.Module:
    """The task's model with its adapters: of fake tensors with a ``mode``, else real."""
    if mode is None:
        return with_lora(task.model(), cfg.to_dict())
    # Built on the meta device (no initialisation runs), then given fake CPU tensors of the same
    # shapes: a model built under the fake mode itself cannot convert its own dtype (``.to``).
    try:
        with torch.device("meta"):
            model = with_lora(task.model(), cfg.to_dict())
    except Exception as error:
        raise TaskError(
            f"plan --cluster builds task.model() on the meta device, and it failed: {error}"
        ) from error
    fake_copy_of_parameters(model, mode)
    return model


def simulate_rank_step(
    task: Any,
    cfg: TrainConfig,
    strategy_class: type[Strategy],
    dims: Any,
    batch: Any,
    accumulation: int,
    real: bool = False,
) -> RankStep:
    """One optimizer step of this rank (the fake world must be up); ``batch``: one real micro-batch.

    ``real``: the same step on real tensors in a real process group, which is how the simulation is
    checked against a run (``benchmarks/cluster_plan_real.py``)."""
    mode = None if real else FakeTensorMode(allow_non_fake_inputs=True)
    fake = mode or nullcontext()
    precision = make_precision(cfg.precision, CPU)
    model = _task_model(task, cfg, mode)
    with fake:
        prepared = precision.prepare(model)
        micro = fake_batch(batch, mode, precision)
    policy = cfg.activation_checkpointing
    if policy == "auto":
        reason = "plan --cluster takes a policy; --search tries them"
        raise ConfigError("activation_checkpointing", policy, reason)
    if policy is not None:
        apply_activation_checkpointing(model, BlockPolicy.parse(policy))
    strategy = strategy_class(cfg, CPU, dims)
    strategy.planning = not real  # a real check runs the strategy exactly as fit does
    plan = getattr(task, "tp_plan", None)
    # Outside the fake mode: torch builds device meshes of real rank numbers while it shards.
    strategy.wrap(model, Example(task.loss, lambda: micro, plan if callable(plan) else None))
    if mode is not None:
        _check_all_fake(strategy.model)
    with fake:
        params = strategy.optimizer_params(prepared)
        optimizer = task.optimizer(iter(params))
        _optimizer_state(optimizer, params)
        runs = min(accumulation, 2)  # one without gradient sync, the last with it
        propagation = ShapePropagation()
        log, tracker, flops = TrafficLog(), _peak_tracker(propagation), LocalFlops(propagation)
        tracker.track_external(strategy.module, optimizer, *strategy.held())
        saved = SavedActivations(strategy.model.parameters())
        first = True

        def loss_fn(module: nn.Module, batch: Any) -> Any:
            nonlocal first
            if not first:
                return task.loss(module, batch)
            first = False
            with saved:  # the first micro-batch's saved activations, as fit's FirstStepMemory counts
                return task.loss(module, batch)

        samples = int(cfg.global_batch_size // (dims.dp * accumulation))
        with propagation, tracker, flops, log:
            strategy.forward_backward(
                loss_fn, iter(_Batches(micro, runs, log, tracker)), runs,
                lambda loss, index: _term(loss, samples), precision, lambda: None,
            )  # fmt: skip
            log.micro = None
            grads = [p for p in strategy.model.parameters() if p.requires_grad]
            strategy.finish_gradients(grads)
            if cfg.max_grad_norm is not None:
                strategy.grad_norm([p.grad for p in grads if p.grad is not None])
            optimizer.step()
        memory = breakdown(strategy.model, params, optimizer, saved.bytes, cfg.ema_decay is not None)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    return RankStep(
        memory=memory,
        peak={str(getattr(kind, "value", kind)): int(size) for kind, size in peak.items()},
        flops=flops.flops * accumulation // runs,
        sent=log.whole_step(accumulation),
        micro_batches=accumulation,
    )
