"""Checkpoints written while training goes on (``--async-checkpoint true``, the default).

The loop takes a copy of the checkpoint's tensors (the staging copy: host memory, page-locked
on CUDA, each storage once so that tied weights stay tied), hands the copy to a thread that
writes it, and trains on. At most one save is in flight: the next one, the end of the run, a stop
signal and an error first wait for it. The write itself is the synchronous one (temporary file,
fsync, rename), so a process killed mid-write still leaves the previous checkpoint loadable.

A write that fails on the thread (a full disk) is raised in the loop at the next wait, as the
synchronous save would have raised it. ``blocked_seconds`` is what the loop lost to saving:
staging, waiting for the previous write, and whole synchronous saves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_map_only


def staged(state: Any, buffers: dict[tuple[Any, ...], torch.Tensor] | None = None) -> tuple[Any, dict]:
    """``state`` with every tensor copied to host memory (page-locked for CUDA tensors): the copy
    a background write may read while training changes the originals; and the copies, by source.

    Tensors that share a storage region (tied weights) share one copy. ``buffers``: the copies of
    the previous staging, written into again where the source is the same tensor (the weights and
    optimizer state stay in place between saves): fresh memory costs page faults, and page-locked
    memory a slow allocation, on every save otherwise.
    """
    buffers = buffers or {}
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    on_cuda = False

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal on_cuda
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride(),
               tensor.dtype, tensor.device)  # fmt: skip
        if key not in copies:
            on_cuda = on_cuda or tensor.is_cuda
            target = buffers.get(key)
            if target is None:
                target = torch.empty_strided(
                    tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
                )
            copies[key] = target.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return copies[key]

    result = tree_map_only(torch.Tensor, copy, state)
    if on_cuda:
        torch.cuda.synchronize()  # the non-blocking copies must land before the write reads them
    return result, copies


class BackgroundSaves:
    """Runs checkpoint writes on a thread, one at a time (``enabled=False``: in the loop)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.blocked_seconds = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}  # the last staged copy's tensors

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """Counts the block's time as time the loop lost to saving."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_seconds += time.perf_counter() - started

    def submit(self, write: Callable[[Any], Any], state: Any) -> None:
        """``write(state)``: now, or on the thread with a staged copy (call it inside ``blocking``)."""
        self.settle()
        if not self.enabled:
            write(state)
            return
        copy, self._buffers = staged(state, self._buffers)  # the previous write is done: reusable
        self._thread = threading.Thread(
            target=self._run, args=(write, copy), name="leantrain-checkpoint", daemon=True
        )
        self._thread.start()

    def _run(self, write: Callable[[Any], Any], state: Any) -> None:
        try:
            write(state)
        except BaseException as error:  # raised in the loop at the next wait
            self._error = error

    def wait(self) -> None:
        """Until the write in flight is done; its error, if it failed."""
        with self.blocking():
            self.settle()

    def settle(self) -> None:
        """``wait`` without counting the time (call it inside ``blocking``)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
