"""The parallel plan: how the model is wrapped, and the communication the loop needs.

``parallelize`` is applied once, before the loop. The loop only calls the returned
object's methods (``no_sync``, ``all_reduce_sum``, ``any_rank``, ``gather``), never asks
which strategy it has.
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from leantrain.batching import Accumulator, BatchPlan
from leantrain.config import TrainConfig
from leantrain.errors import ConfigError
from leantrain.evaluation import evaluate
from leantrain.parallel.dims import ParallelDims
from leantrain.parallel.env import ClusterEnv
from leantrain.runtime import resolve_device

DP_WARNING = (
    "strategy dp (DataParallel) drives every GPU from one process: each step it scatters the "
    "inputs, copies the model to every GPU and gathers the outputs, and the Python thread is "
    "shared. DDP runs one process per GPU and communicates only gradients, overlapped with "
    "backward: `leantrain launch --nproc-per-node N fit --strategy ddp` is faster."
)


class SingleProcess:
    """One process, one device: nothing to communicate."""

    strategy = "single"
    sharded = False  # True: each process holds a shard of the state (see parallel/fsdp.py)

    def __init__(self, model: nn.Module) -> None:
        self.module = model  # what forward and backward run on
        self.model = model  # the unwrapped model: state dicts and weights

    def trained_weights(self, precision: Any) -> dict[str, torch.Tensor]:
        """The weights to export (call on every rank; a sharded plan gathers them to rank 0)."""
        return precision.trained_state_dict(self.model)

    def optimizer_params(self, prepared: list[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer updates, given what precision.prepare returned before wrapping."""
        return prepared

    def evaluate(self, task: Any, batches: Any, precision: Any, all_reduce_sum: Any) -> dict[str, float]:
        """Validation metrics of this process's share of the data, summed over the ranks given."""
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return evaluate(self.module, task, batches, device, precision, all_reduce_sum)

    def accumulator(
        self, plan: BatchPlan, precision: Any, max_grad_norm: float | None, agree_on_oom: Any
    ) -> Accumulator:
        """What runs one optimizer step's micro-batches under this plan."""
        return Accumulator(
            plan,
            precision,
            self.model.parameters(),
            max_grad_norm,
            self.no_sync,
            self.all_reduce_sum,
            agree_on_oom,
        )

    def no_sync(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def any_rank(self, flag: bool) -> bool:
        return flag

    def gather(self, value: Any) -> list[Any]:
        """``value`` from every rank, in rank order."""
        return [value]


class DataParallelPlan(SingleProcess):
    """``nn.DataParallel`` over the visible GPUs of one process (kept for comparison)."""

    strategy = "dp"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        warnings.warn(DP_WARNING, stacklevel=3)
        self.module = nn.DataParallel(model) if torch.cuda.device_count() > 1 else model


class Collectives(SingleProcess):
    """The collectives every multi-process plan shares (the process group is up)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__(model)
        self.device = device

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any_rank(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], device=self._comm_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


class DistributedPlan(Collectives):
    """``DistributedDataParallel``: one process per device, gradients all-reduced in backward."""

    strategy = "ddp"

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__(model, device)
        device_ids = [device.index] if device.type == "cuda" else None
        # Gradients as views into the all-reduce buckets: no copy between them after each
        # all-reduce, and one gradient-sized buffer less.
        self.module = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    def no_sync(self) -> AbstractContextManager[Any]:
        # Gradients of non-final micro-batches only accumulate locally; the all-reduce
        # runs once, during the final micro-batch's backward.
        return self.module.no_sync()


def resolve_strategy(strategy: str, env: ClusterEnv) -> str:
    """The concrete strategy for a config value, or a ConfigError when it cannot run here."""
    if strategy == "auto":
        return "ddp" if env.distributed else "single"
    if strategy in ("ddp", "fsdp", "pipeline") and not env.distributed:
        raise ConfigError(
            "strategy", strategy, "needs several processes: run `leantrain launch --nproc-per-node N fit ...`"
        )
    if strategy in ("single", "dp", "split") and env.distributed:
        raise ConfigError(
            "strategy",
            strategy,
            f"runs in one process, but {env.world_size} were launched; use ddp, fsdp, pipeline or auto",
        )
    return strategy


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    cfg: TrainConfig,
    strategy: str,
    device: torch.device,
    example_inputs: Any = None,
) -> SingleProcess:
    """The one function that applies a run's parallel plan (the process group, if any, is up).

    The order is fixed: the Trainer calls it after precision.prepare and activation
    checkpointing (wrappers see the model as it will run, checkpointed blocks included);
    inside, the plan of the resolved ``strategy`` cuts the model (pipeline stages, split
    parts) or wraps it (FSDP2 units then the root, DDP, DP); the optimizer is built after,
    over ``plan.optimizer_params``. ``dims`` arranges the processes (data parallel x
    pipeline); ``example_inputs`` (the model's inputs for one micro-batch) lets the
    pipeline plan trace a model that is not an ``nn.Sequential``.
    """
    if dims.pp > 1 and strategy != "pipeline":
        raise ConfigError("pipeline_stages", dims.pp, "is used with strategy pipeline only")
    if strategy == "ddp":
        return DistributedPlan(model, device)
    if strategy == "split":
        from leantrain.parallel.split import SplitPlan, parse_device_map

        if cfg.device_map is None:
            raise ConfigError("device_map", None, "is needed with strategy split")
        return SplitPlan(model, parse_device_map(cfg.device_map))
    if strategy == "pipeline":
        from leantrain.parallel.pipeline import PipelinePlan

        return PipelinePlan(model, device, dims, cfg.pipeline_schedule, example_inputs)
    if strategy == "fsdp":
        from leantrain.parallel.fsdp import ShardedPlan  # torch.distributed.fsdp, only when used

        return ShardedPlan(model, device, cfg.precision, cfg.shard_blocks)
    if strategy == "dp":
        return DataParallelPlan(model)
    return SingleProcess(model)


def run_device(strategy: str, device: torch.device, cfg: TrainConfig) -> torch.device:
    """Where inputs go: the configured device, or with split the first device of the map."""
    if strategy != "split" or cfg.device_map is None:
        return device
    from leantrain.parallel.split import parse_device_map

    # Every device of the map must exist here (a one-line ConfigError otherwise).
    devices = [resolve_device(str(part)) for part in parse_device_map(cfg.device_map)]
    return devices[0]


def build_device(strategy: str, device: torch.device) -> torch.device:
    """Where the model is built: with split on the CPU, each part then moved to its own device
    (the whole model need not fit the first one)."""
    return torch.device("cpu") if strategy == "split" else device


def init_process_group(env: ClusterEnv, device: torch.device) -> bool:
    """Join the process group of a multi-process run; True when this call created it."""
    if not env.distributed or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = _restart_safe_agent_store(env)
    if store is not None:
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size)
        return True
    # A bare SLURM task (no torchrun) starts its own store on rank 0.
    init_method = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=env.rank, world_size=env.world_size
    )
    return True


def _restart_safe_agent_store(env: ClusterEnv) -> dist.Store | None:
    """Under torchrun, the launcher's store, with keys kept apart for each restart of the group.

    After an elastic restart, workers sometimes read the previous attempt's addresses from the
    launcher's store and gloo fails (or hangs) connecting to processes that no longer exist.
    A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps each attempt to its own keys.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False)
    return dist.PrefixStore(f"leantrain/attempt_{attempt}", store)
