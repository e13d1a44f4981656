"""User-facing errors: each one is a single line that names what is wrong.

The CLI prints ``str(error)`` for any :class:`LeantrainError` (no traceback) and exits
with code 2. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any


class LeantrainError(Exception):
    """Base class of errors caused by the user's input (config, task, data, files)."""


class ConfigError(LeantrainError, ValueError):
    """An invalid configuration value; names the field, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field}={_shortened(repr(value))}: {allowed}")


# A value longer than this is cut in the message: the line must stay one readable line. Long enough
# for the paths of real folders (a run folder under a cluster's scratch space) to be named whole.
SHOWN_VALUE_CHARS = 200


def _shortened(text: str) -> str:
    if len(text) <= SHOWN_VALUE_CHARS:
        return text
    return f"{text[: SHOWN_VALUE_CHARS - 20]}...({len(text):,} characters)"


def one_line(error: BaseException, limit: int = 300) -> str:
    """An error's message for one line of ours: its lines and runs of spaces joined (torch's messages
    span lines), cut after ``limit`` characters with "..."; its type's name when it has no message."""
    text = " ".join(str(error).split())
    return (text[:limit] + "...") if len(text) > limit else text or type(error).__name__


class TaskError(LeantrainError):
    """A task that cannot be found, imported or built, or that breaks the Task protocol."""


class DataError(LeantrainError):
    """A dataset item that failed to load; the message names the item's index.

    When the item fails inside a DataLoader worker process, torch re-raises the error in
    the main process as ``DataError(full_worker_traceback)``. We keep that traceback in
    ``details`` and reduce the message to our own one-line summary, which is the last
    line of the traceback.
    """

    def __init__(self, message: str) -> None:
        self.details = message
        if "\n" in message:
            marker = f"{type(self).__name__}: "
            lines = [line for line in message.splitlines() if marker in line]
            if lines:
                message = lines[-1].split(marker, 1)[1]
        super().__init__(message)


class CollateError(DataError, TaskError):
    """Items that load but cannot be put into one batch (None, or shapes that differ): the task's
    dataset breaks the Task contract. A DataError too, so that when raised in a worker process it
    keeps its one-line message (see DataError)."""


class NonFiniteLossError(LeantrainError):
    """A step's loss or gradient was NaN or infinite (``on_nan="stop"``).

    ``step`` is the failed optimizer step (1-based); ``checkpoint`` holds the state after
    the step before it, the last good state, or is None when nothing could be saved.
    """

    def __init__(self, message: str, step: int = 0, checkpoint: str | None = None) -> None:
        self.step = step
        self.checkpoint = checkpoint
        super().__init__(message)


class SpikeError(LeantrainError):
    """The training loss kept spiking: more than ``max_rollbacks`` rollbacks (``on_spike="rollback"``).

    ``rollbacks`` lists each one as summary.json does (the spike's step and loss, the step restored, the
    global batches skipped).
    """

    def __init__(self, message: str, rollbacks: list[dict[str, Any]]) -> None:
        self.rollbacks = rollbacks
        super().__init__(message)


class CheckpointError(LeantrainError):
    """A checkpoint that is missing, corrupt, unsafe, or does not match this run; names the file."""


class StorageError(LeantrainError):
    """A write the storage refused (no space, no permission, a read-only file system), in one line:
    what was written, where, how much it needed, and what is safe. The CLI exits with EXIT_STORAGE."""


class LeantrainWarning(UserWarning):
    """Something in a run looks wrong but training goes on (e.g. many skipped fp16 steps)."""


class RunInterrupted(Exception):
    """Training stopped on a signal (SIGTERM, SIGUSR1), after saving a checkpoint unless told never to.

    Not a LeantrainError: nothing was wrong with the input, and the run can go on. ``set_up_only``:
    the signal came while the run was set up, and it stopped before training (nothing to save).
    """

    def __init__(
        self,
        signal_name: str,
        signal_number: int,
        step: int,
        checkpoint: str | None,
        set_up_only: bool = False,
    ) -> None:
        self.signal_name = signal_name
        self.signal_number = signal_number
        self.step = step
        self.checkpoint = checkpoint  # None: checkpoint_every is never, or nothing was trained
        if set_up_only:
            again = "start it again with --resume auto" if step else "start it again"
            super().__init__(
                f"stopped by {signal_name} while the run was set up, before step {step + 1}: nothing "
                f"was trained; {again}"
            )
            return
        where = (
            f"checkpoint {checkpoint}; continue with --resume auto"
            if checkpoint is not None
            else "no checkpoint was written (checkpoint_every is never): the run cannot be continued"
        )
        super().__init__(f"stopped by {signal_name} after step {step}; {where}")
