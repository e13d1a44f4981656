"""``--tp N``: tensor parallelism, each planned layer's matrices split over ``N`` consecutive ranks.

The processes form a ``("dp", "tp")`` mesh (``ParallelDims``): the ranks of a tensor-parallel
group hold a share of every planned matrix (a ``DTensor``, see ``tp_plan.py``) and load the
same samples; the groups side by side are data-parallel. ``ddp`` and ``fsdp`` run with it
through the variants their modules define (``with_tensor_parallel``), which share this part:

- the plan, applied before anything wraps the model; weights tied before it (an embedding and
  its head) are tied again after, when the plan splits them alike;
- the sums the run reduces (losses, counts) over the data-parallel group only: a group's ranks
  hold the same values, counted once;
- the gradient's norm over every kind of tensor the ranks hold: a rank's squares divided by the
  number of ranks that hold the same values, summed over the world (exact in float64);
- checkpoints through DCP (``ShardedState``): each rank's shards; resumed on the same layout or
  resharded onto another (one process, fsdp alone).

What is not planned stays whole on every rank of a group; it computes alike on each, and its
gradient is alike too (DTensor reduces the gradient of a replicated input).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leantrain.adapters import trained_parameters
from leantrain.checkpoint import tied_aliases
from leantrain.config import TrainConfig
from leantrain.errors import ConfigError
from leantrain.step.accumulator import LossFn, MicroLoss, TermFn
from leantrain.step.evaluation import LossAndMetrics
from leantrain.step.precision import Precision
from leantrain.strategies.base import Example
from leantrain.strategies.process_group import Collectives, all_reduce_in_place
from leantrain.strategies.sequence import add_sequence_moves
from leantrain.strategies.sharded_state import ShardedState
from leantrain.strategies.split_logits import SplitLogits
from leantrain.strategies.tp_plan import (
    STYLES,
    SUMMED,
    output_layer,
    parallel_styles,
    plan_of,
    planned_modules,
    sequence_moves,
)


class TensorParallel(ShardedState, Collectives):
    """The part of a strategy's tensor-parallel variant that every variant shares (no name of its own)."""

    precision_reason = "with --tp: fp32 parameters, computed in bf16 with bf16-mixed"
    mesh: Any = None  # the ("dp", "tp") DeviceMesh, made by ``apply_plan``
    summed: tuple[str, ...] = ()  # modules planned replicated_with_grad_allreduce
    split_modules: tuple[str, ...] = ()  # the modules the plan splits (each rank computes 1/tp of them)
    split_logits: SplitLogits = SplitLogits(nn.Module(), None)  # made by ``apply_plan``
    _agreement_checked = False  # whether the first step's gradients were checked (finish_gradients)
    _pending: list[nn.Parameter] | None = None  # parameters whose gradient DTensor leaves Partial

    @classmethod
    def check(cls, cfg: TrainConfig, world_size: int | None) -> None:
        if cfg.lora_rank is not None:
            # peft wraps the planned Linears in modules of its own, which no plan names.
            rule = "not with --lora-rank: adapters train a small share of the model; use ddp or fsdp"
            raise ConfigError("tp", cfg.tp, rule)
        super().check(cfg, world_size)

    def apply_plan(self, model: nn.Module, example: Example | None) -> nn.Module:
        """Split ``model``'s planned layers over this rank's tensor-parallel group, in place."""
        from torch.distributed.tensor.parallel import parallelize_module

        # torch warns once per rank, when the final weights are gathered from 2D shards, that it
        # gathers each dimension in turn: a one-off cost at the end, not the user's to act on.
        logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_SEQUENTIAL_GATHERS_QUIET)

        tp = self.dims.tp
        task_plan = example.tp_plan(model) if example is not None and example.tp_plan is not None else None
        plan, source = plan_of(model, task_plan, tp)
        chosen = planned_modules(model, plan, tp)
        parameters = dict(model.named_parameters(remove_duplicate=False))
        tied = {alias: first for alias, first in tied_aliases(model).items() if alias in parameters}
        self.mesh = self.dims.mesh(self.device.type)
        logits = output_layer(model, chosen)
        sequence = self.cfg.sequence_parallel
        parallelize_module(model, self.mesh["tp"], parallel_styles(model, chosen, sequence, logits))
        add_sequence_moves(model, sequence_moves(chosen, sequence), self.mesh["tp"])
        _tie_again(model, tied, tp)
        self.summed = tuple(name for name, style in chosen.items() if style == SUMMED)
        self.split_modules = tuple(name for name, style in chosen.items() if STYLES[style].splits)
        self.notes.append(
            f"tensor parallel over {tp} ranks x {self.dims.dp} data-parallel: {len(self.split_modules)} "
            f"modules split ({source})"
        )
        self.split_logits = SplitLogits(model, logits, values=not self.planning)
        if (line := self.split_logits.decide(self.cfg.loss_parallel, example, self.any_rank)) is not None:
            self.notes.append(line)
        return model

    def forward_backward(
        self,
        loss_fn: LossFn,
        batches: Iterator[Any],
        count: int,
        term: TermFn,
        precision: Precision,
        before_last_backward: Callable[[], None],
    ) -> list[MicroLoss]:
        # The task's loss and its backward under loss_parallel, when the logits stay split.
        with self.split_logits.context():
            local = self.split_logits.local(loss_fn)
            return super().forward_backward(local, batches, count, term, precision, before_last_backward)

    def forward_only(
        self, loss_and_metrics: LossAndMetrics, batches: Iterable[Any], precision: Precision
    ) -> Iterator[tuple[Any, dict[str, Any], int]]:
        with self.split_logits.context():
            yield from super().forward_only(self.split_logits.local(loss_and_metrics), batches, precision)

    def optimizer_params(self, prepared: list[nn.Parameter]) -> list[nn.Parameter]:
        # The plan replaced each planned parameter by a DTensor: the optimizer takes those.
        return trained_parameters(self.model)

    @property
    def data_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the parts of the gradients of ``replicated_with_grad_allreduce`` modules over the
        group, and DTensor's pending sums (a norm under sequence parallelism: each rank's positions
        give a part); at the first step, check that every whole parameter's gradient agrees."""
        if self._pending is None:  # the same parameters every step: found once
            self._pending = [p for p in params if p.grad is not None and _has_pending_sum(p.grad)]
        for param in self._pending:
            if param.grad is not None:
                param.grad = param.grad.redistribute(param.grad.device_mesh, param.placements)  # type: ignore[attr-defined]
        group = self.mesh["tp"].get_group()
        parts = [p.grad for name in self.summed for p in self.model.get_submodule(name).parameters()]
        all_reduce_in_place([grad for grad in parts if grad is not None], group)
        if not self._agreement_checked and not self.planning:  # fake gradients have no values
            self._agreement_checked = True
            _check_whole_gradients_agree(self.model, group, self.comm_device, self.cfg.tp)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.data_group)
        return tensor

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        squares = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        world = dist.get_world_size()
        for grad in grads:
            local, holders = _local_and_holders(grad, world)
            squares += local.double().pow(2).sum().to(self.comm_device) / holders
        dist.all_reduce(squares)
        return squares.sqrt()


class _NotSequentialGathers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather" not in record.getMessage()


_SEQUENTIAL_GATHERS_QUIET = _NotSequentialGathers()  # one filter, however many runs a process makes


def _local_and_holders(tensor: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
    """This rank's values of ``tensor`` and how many ranks of the world hold the same values."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, world  # whole on every rank
    mesh = tensor.device_mesh
    holders = world // mesh.size()  # ranks outside its mesh hold copies of it
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            holders *= mesh.size(dim)
    return tensor.to_local(), holders


def _tie_again(model: nn.Module, tied: dict[str, str], tp: int) -> None:
    """Tie the weights that were tied before the plan (alias -> first name): the plan gives each
    module a parameter of its own."""
    for name, first in tied.items():
        kept = model.get_parameter(first)
        if getattr(model.get_parameter(name), "placements", None) != getattr(kept, "placements", None):
            raise ConfigError(
                "tp",
                tp,
                f"the plan splits the tied weights {first} and {name} differently; plan them alike, "
                "or untie them in task.model()",
            )
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, kept)


def _check_whole_gradients_agree(
    model: nn.Module, group: dist.ProcessGroup, device: torch.device, tp: int
) -> None:
    """A ConfigError naming the first parameter left whole by the plan whose gradient differs over
    the tensor-parallel ``group``: it works on split activations, and each rank holds a part of
    its gradient (the replicas would drift apart silently)."""
    whole = [
        (name, p.grad) for name, p in model.named_parameters() if p.grad is not None and not _split(p.grad)
    ]
    if not whole:
        return
    local = [grad.to_local() if hasattr(grad, "to_local") else grad for _, grad in whole]
    sums = torch.stack([torch.stack([g.double().sum(), g.double().abs().sum()]) for g in local]).to(device)
    highest, lowest = sums.clone(), -sums
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MAX, group=group)
    spread = (highest + lowest).amax(dim=1)  # max - min over the group, of each statistic
    scale = highest.abs().amax(dim=1).clamp(min=1e-30)
    for (name, _), differs in zip(whole, (spread > 1e-6 * scale).tolist(), strict=True):
        if differs:
            raise ConfigError(
                "tp",
                tp,
                f"{name} is whole on every rank but gets a different gradient on each: it works on "
                "split activations; plan its module replicated_with_grad_allreduce (or split it)",
            )


def _has_pending_sum(grad: torch.Tensor) -> bool:
    return any(placement.is_partial() for placement in getattr(grad, "placements", ()))


def _split(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is split over the tensor-parallel dimension (a planned parameter)."""
    names = getattr(getattr(tensor, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tp" in names
