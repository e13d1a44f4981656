"""The process group of a multi-process run, and the collectives every multi-process strategy shares."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from leantrain.cluster import ClusterEnv
from leantrain.step.local_values import local_values
from leantrain.strategies.base import Strategy


class Collectives(Strategy):
    """A strategy of several processes (the process group is up): real collectives."""

    multi_process: ClassVar[bool] = True

    @property
    def comm_device(self) -> torch.device:
        # NCCL reduces device tensors, gloo host ones.
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any_rank(self, flag: bool) -> bool:
        value = torch.tensor([1 if flag else 0], device=self.comm_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered


def all_reduce_in_place(tensors: list[torch.Tensor], group: Any, divide_by: int = 1) -> None:
    """Replace each tensor's values (a DTensor's local shard) by their sum over ``group``, divided by
    ``divide_by`` (a mean): one flat all-reduce per dtype, not one per tensor."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for local in local_values(tensors):
        by_dtype.setdefault(local.dtype, []).append(local)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat /= divide_by
        torch._foreach_copy_(same, list(_unflatten_dense_tensors(flat, same)))


def init_process_group(env: ClusterEnv, device: torch.device, timeout: timedelta | None = None) -> bool:
    """Join the process group of a multi-process run; True when this call created it.
    ``timeout``: its collectives' (None: torch's default)."""
    if not env.distributed or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    where: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size, "timeout": timeout}
    store = _restart_safe_agent_store(env)
    if store is not None:
        where["store"] = store
    else:  # a bare SLURM task (no torchrun) starts its own store on rank 0
        where["init_method"] = (
            "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
        )
    dist.init_process_group(backend=backend, **where)
    return True


def group_store() -> dist.Store | None:
    """The store of this process's group (the ranks' shared key-value store), None without one."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


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
