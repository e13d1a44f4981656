"""``leantrain plan``: the memory of a run, measured on a model that is never allocated.

The task's model is built on the ``meta`` device (shapes and dtypes, no storage), the
precision prepares it (true 16-bit casts it and makes fp32 masters) and the optimizer
takes one step on meta gradients, which creates its state, still without storage. For the
forward, the parameters are swapped for fake CPU tensors (``FakeTensorMode``): unlike meta
tensors they pass through ``torch.autocast``, so the mixed modes save what they would on
a real device. One forward per candidate micro-batch, on the first items of the task's
data, counts the bytes autograd saves for backward (see ``accountant.py``).

The estimate covers what lives through a step: parameters, gradients, optimizer state and
saved activations. Temporaries inside one operation, the allocator's fragmentation and the
CUDA context are not in it: that is what the safety margin is for.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only
from torch.utils.data import IterableDataset

from leantrain.adapters import with_lora
from leantrain.blocks import BlockPolicy, block_classes, matching_blocks
from leantrain.config import TrainConfig
from leantrain.data.hf import torch_rows
from leantrain.data.loader import collate, move_to_device
from leantrain.errors import ConfigError, LeantrainError, TaskError
from leantrain.memory.accountant import MemoryBreakdown, SavedActivations, breakdown
from leantrain.memory.recompute import apply_activation_checkpointing
from leantrain.step.batching import configured_micro_batch
from leantrain.step.precision import make_precision

CPU = torch.device("cpu")
DEFAULT_MARGIN = 0.1
# Checkpointing is recommended when it lets a micro-batch this many times larger fit.
RECOMPUTE_PAYS = 4


@dataclass(frozen=True)
class EstimateRow:
    micro_batch_size: int
    activation_checkpointing: str | None
    memory: MemoryBreakdown
    fits: bool | None  # None without a budget

    def as_dict(self) -> dict[str, Any]:
        memory = self.memory
        return {
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            **memory.as_dict(),  # the names summary.json gives the same bytes
            "total_bytes": memory.total_bytes,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class MemoryEstimate:
    precision: str
    rows: list[EstimateRow]
    budget: int | None
    margin: float
    chosen: EstimateRow  # the recommendation with a budget (when one fits), else the configured micro-batch
    recommended: EstimateRow | None

    def as_dict(self) -> dict[str, Any]:
        result = {"precision": self.precision, **self.chosen.as_dict()}
        if self.budget is not None:
            result["memory_budget_bytes"] = self.budget
            result["safety_margin"] = self.margin
            result["recommended_micro_batch_size"] = self.recommended and self.recommended.micro_batch_size
            result["recommended_activation_checkpointing"] = (
                self.recommended and self.recommended.activation_checkpointing
            )
        result["rows"] = [row.as_dict() for row in self.rows]
        return result


def candidate_micro_batches(per_rank_batch: int) -> list[int]:
    """Powers of two that divide the per-process batch, and the per-process batch itself."""
    sizes = [2**k for k in range(per_rank_batch.bit_length()) if per_rank_batch % 2**k == 0]
    return sorted({*sizes, per_rank_batch})


def first_items(dataset: Any, count: int) -> list[Any]:
    """The first ``count`` items of a map-style dataset or a stream; TaskError when it has fewer."""
    if isinstance(dataset, IterableDataset):
        items = list(itertools.islice(iter(dataset), count))
    else:
        items = [dataset[i] for i in range(min(count, len(dataset)))]
    if len(items) < count:
        raise TaskError(f"train_data has {len(items)} items, fewer than a micro-batch of {count}")
    return items


def fake_copy_of_parameters(model: nn.Module, mode: FakeTensorMode) -> None:
    """Swap every meta parameter and buffer for a fake CPU tensor (tied weights stay tied)."""
    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(tensor) not in made:
            with mode:
                value = torch.empty(tensor.shape, dtype=tensor.dtype, device=CPU)
            made[id(tensor)] = nn.Parameter(value, requires_grad=tensor.requires_grad) if parameter else value
        return made[id(tensor)]

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = fake(param, parameter=True)  # type: ignore[assignment]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = fake(buffer, parameter=False)


def measure(
    task: Any, cfg: TrainConfig, checkpointing: str | None, micro_sizes: Sequence[int]
) -> list[EstimateRow]:
    """One row per micro-batch size, for one checkpointing setting (no budget applied)."""
    try:
        with torch.device("meta"):
            model = with_lora(task.model(), cfg.to_dict())
    except Exception as error:
        raise TaskError(f"plan builds task.model() on the meta device, and it failed: {error}") from error
    precision = make_precision(cfg.precision, CPU)
    optimizer_params = precision.prepare(model)
    if checkpointing is not None:
        apply_activation_checkpointing(model, BlockPolicy.parse(checkpointing))
    optimizer = task.optimizer(iter(optimizer_params))
    for param in optimizer_params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    try:
        optimizer.step()  # creates the state, on meta
    except Exception as error:
        raise TaskError(
            f"plan runs the task's optimizer on the meta device, and it failed: {error}"
        ) from error
    state = breakdown(
        model, optimizer_params, optimizer, activation_bytes=0, averaged=cfg.ema_decay is not None
    )

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_copy_of_parameters(model, mode)
    model.train()
    items = first_items(torch_rows(task.train_data(), "train_data"), max(micro_sizes))  # as fit reads them
    rows = []
    first_failure: Exception | None = None
    for size in micro_sizes:
        collated = collate(items[:size], range(size), "train_data")
        batch = move_to_device(collated, CPU, dtype=precision.input_dtype)
        fake_batch = tree_map_only(torch.Tensor, mode.from_tensor, batch)
        try:
            with mode, precision.autocast(), SavedActivations(model.parameters()) as saved:
                task.loss(model, fake_batch)
        except Exception as error:
            # Some models cannot train on the smallest micro-batches (BatchNorm needs more than
            # one value per channel): such a size is left out, as long as another one trains.
            first_failure = first_failure or error
            continue
        memory = replace(state, activation_bytes=saved.bytes)
        rows.append(EstimateRow(size, checkpointing, memory, None))
    if not rows and first_failure is not None:
        raise first_failure
    return rows


def fewest_checkpointed_blocks(task: Any, cfg: TrainConfig, budget: int, world_size: int = 1) -> str | None:
    """``activation_checkpointing auto``: the policy recomputing the fewest repeated blocks with
    which the configured micro-batch fits ``budget``; None when it fits without any.

    Saved activations fall as blocks are recomputed, so the fewest is found by bisection
    over "the first k blocks", each candidate measured on the meta device.
    """
    micro = configured_micro_batch(cfg, world_size)

    def fits(policy: str | None) -> bool:
        return measure(task, cfg, policy, [micro])[0].memory.total_bytes <= budget

    if fits(None):
        return None
    with torch.device("meta"):
        model = with_lora(task.model(), cfg.to_dict())
    classes = block_classes(model)
    if not classes:
        raise LeantrainError(
            "activation_checkpointing auto: the model has no repeated blocks to recompute; name them instead"
        )
    blocks = len(matching_blocks(model, BlockPolicy(classes)))
    name = ",".join(classes)
    if not fits(name):
        raise LeantrainError(
            f"the micro-batch of {micro} does not fit memory_budget {cfg.memory_budget} even with all "
            f"{blocks} {name} blocks recomputed: lower micro_batch_size or use 16-bit precision"
        )
    low, high = 0, blocks  # fits with the first `high` blocks, not with the first `low`
    while high - low > 1:
        middle = (low + high) // 2
        if fits(f"{name},first:{middle}"):
            high = middle
        else:
            low = middle
    return name if high == blocks else f"{name},first:{high}"


def _judge(rows: list[EstimateRow], budget: int | None, margin: float) -> list[EstimateRow]:
    if budget is None:
        return rows
    limit = budget * (1 - margin)
    return [
        EstimateRow(r.micro_batch_size, r.activation_checkpointing, r.memory, r.memory.total_bytes <= limit)
        for r in rows
    ]


def estimate_memory(
    task: Any,
    cfg: TrainConfig,
    world_size: int = 1,
    budget: int | None = None,
    margin: float = DEFAULT_MARGIN,
) -> MemoryEstimate:
    """The memory of every candidate micro-batch; with a budget, the largest that fits.

    With a budget, no checkpointing in the config and the whole per-process batch not
    fitting, the model's repeated blocks are tried with checkpointing too; it is
    recommended when it lets a micro-batch at least ``RECOMPUTE_PAYS`` times larger fit
    (recomputation costs about a third more compute; small micro-batches waste more).
    """
    per_rank = cfg.global_batch_size // world_size
    sizes = candidate_micro_batches(per_rank)
    if cfg.activation_checkpointing == "auto":
        if budget is None:
            raise LeantrainError("activation_checkpointing auto needs memory_budget")
        cfg = cfg.replace(
            activation_checkpointing=fewest_checkpointed_blocks(task, cfg, int(budget * (1 - margin)))
        )
    rows = _judge(measure(task, cfg, cfg.activation_checkpointing, sizes), budget, margin)
    best = max((r.micro_batch_size for r in rows if r.fits), default=0)
    if budget is not None and best < per_rank and cfg.activation_checkpointing is None:
        with torch.device("meta"):
            blocks = block_classes(task.model())
        if blocks:
            rows += _judge(measure(task, cfg, ",".join(blocks), sizes), budget, margin)
    plain = [r for r in rows if r.fits and r.activation_checkpointing == cfg.activation_checkpointing]
    recomputed = [r for r in rows if r.fits and r.activation_checkpointing != cfg.activation_checkpointing]
    recommended = max(plain, key=lambda r: r.micro_batch_size, default=None)
    bigger = max(recomputed, key=lambda r: r.micro_batch_size, default=None)
    if bigger is not None and (
        recommended is None or bigger.micro_batch_size >= RECOMPUTE_PAYS * recommended.micro_batch_size
    ):
        recommended = bigger
    configured = configured_micro_batch(cfg, world_size)
    chosen = recommended or next((r for r in rows if r.micro_batch_size == configured), None)
    if chosen is None:
        raise ConfigError(
            "micro_batch_size", configured, "task.loss fails in training on a micro-batch of that size "
            "(plan, on the meta device; BatchNorm, for one, needs more than one value per channel), "
            "others train",
        )  # fmt: skip
    return MemoryEstimate(cfg.precision, rows, budget, margin, chosen, recommended)
