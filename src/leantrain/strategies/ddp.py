"""``--strategy ddp``: ``DistributedDataParallel``, one process per device, gradients all-reduced in
backward, overlapped with it."""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from leantrain.strategies.base import Example, Strategy
from leantrain.strategies.process_group import Collectives, all_reduce_in_place
from leantrain.strategies.sync_batch_norm import SyncsBatchNorm
from leantrain.strategies.tensor_parallel import TensorParallel


class Distributed(SyncsBatchNorm, Collectives):
    name = "ddp"
    summary = "DistributedDataParallel: one process per device, a full replica in each"
    _buckets: tuple[torch.Tensor, ...] = ()  # planning: the memory of DDP's buckets, emulated

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        self.model = self.with_synced_batch_norm(model)
        self._hook: Callable[..., Any] | None = None
        self.module = self._wrapped()

    def _wrapped(self) -> nn.Module:
        if self.planning:
            # DDP's C++ reducer cannot hold fake tensors: the plan runs the model as it is, and holds
            # what the reducer holds through a step: its buckets, a gradient-sized buffer per dtype.
            # Backward's gradients are made beside them and copied in (then the gradients become views
            # of the buckets), as measured on real processes (benchmarks/cluster_plan_real.py).
            self._buckets = _buckets(self.model)
            return self.model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Gradients as views into the all-reduce buckets: no copy between them after each
        # all-reduce, and one gradient-sized buffer less.
        module = DistributedDataParallel(self.model, device_ids=device_ids, gradient_as_bucket_view=True)
        if self._hook is not None:
            module.register_comm_hook(None, self._hook)
        return module

    def reset_after_out_of_memory(self) -> None:
        # The reducer expected the abandoned step's backward; a fresh wrapper (every rank makes
        # one: they all agreed on the error) starts clean. The weights are equal on every rank,
        # so its broadcast of rank 0's changes nothing. The old wrapper's reducer still hooks
        # the parameters: it must be gone first.
        self.module = self.model
        gc.collect()
        self.module = self._wrapped()

    def held(self) -> list[torch.Tensor]:
        return list(self._buckets)

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        if self.planning:  # no reducer (see ``_wrapped``): its all-reduce, in place, for the plan to see
            for param in params:
                if param.grad is not None:
                    torch.distributed.all_reduce(param.grad)

    def register_comm_hook(self, hook: Callable[..., Any]) -> None:
        self._hook = hook
        self.module.register_comm_hook(None, hook)

    def no_sync(self) -> AbstractContextManager[Any]:
        # Gradients of non-final micro-batches only accumulate locally; the all-reduce
        # runs once, during the final micro-batch's backward.
        return nullcontext() if self.planning else self.module.no_sync()  # type: ignore[operator]

    @classmethod
    def with_tensor_parallel(cls) -> type[Strategy]:
        return DistributedTensorParallel


class DistributedTensorParallel(TensorParallel, Distributed):
    """ddp with ``--tp``: the plan splits the model over each group; the groups are replicas.

    DDP's wrapper cannot hold DTensor parameters, so none is made: after the micro-batches'
    backward, every rank's gradient values (its shards) are averaged over its data-parallel
    group in one flat all-reduce per dtype. It does not overlap backward as DDP's buckets do.
    """

    def wrap(self, model: nn.Module, example: Example | None) -> None:
        self.model = self.module = self.apply_plan(self.with_synced_batch_norm(model), example)

    def reset_after_out_of_memory(self) -> None:
        """No wrapper: nothing waits on the abandoned step."""

    def register_comm_hook(self, hook: Callable[..., Any]) -> None:
        """No DDP buckets to hook: the all-reduce runs in ``finish_gradients``."""

    def no_sync(self) -> AbstractContextManager[Any]:
        return nullcontext()  # the gradients are reduced once, after the last micro-batch

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        super().finish_gradients(params)  # the group's own sums first
        grads = [p.grad for p in params if p.grad is not None]
        if self.dims.dp > 1 and grads:
            all_reduce_in_place(grads, self.data_group, divide_by=self.dims.dp)


def _buckets(model: nn.Module) -> tuple[torch.Tensor, ...]:
    """A flat buffer per dtype of the trainable parameters, made from them (fake ones under planning,
    so it costs this machine nothing)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.requires_grad:
            by_dtype.setdefault(param.dtype, []).append(param)
    return tuple(params[0].new_zeros(sum(p.numel() for p in params)) for params in by_dtype.values())
