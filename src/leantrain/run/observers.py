"""The observers: what watches the run and speaks for it.

The log (``RunLogger``: metrics.csv, TensorBoard, the terminal), the callbacks (the built-in
ones of ``watchers.py``, then the user's), the health of the numbers (skipped steps, the fp16
loss scale), the heartbeat the hang watchdog reads, the compiler's events, and the window of
steps each log point reports on (``LogWindow``). Built by
``builders.build_observers``; the callbacks' state is what of them a checkpoint holds
(``checkpoint_state`` and ``restore_callbacks`` below).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from leantrain.errors import CheckpointError
from leantrain.log.precision_health import PrecisionHealth
from leantrain.log.run_logger import RunLogger
from leantrain.run.hooks import StepStats, state_key
from leantrain.run.watchdog import Heartbeat, Watchdog
from leantrain.step.compilation import CompileWatch


class Observers:
    def __init__(
        self,
        logger: RunLogger,
        callbacks: Sequence[Any],
        health: PrecisionHealth,
        heartbeat: Heartbeat,
        compiler: CompileWatch,
        watchdog: Watchdog,
    ) -> None:
        self.logger = logger
        self.callbacks = list(callbacks)  # the built-in ones, then the user's; their state is checkpointed
        self.health = health
        self.heartbeat = heartbeat  # marked as the loop moves on; the watchdog reads it
        self.compiler = compiler
        self.watchdog = watchdog
        # Looked up once: the loop calls them without asking each callback what it has.
        self._step_hooks = [c.on_step for c in self.callbacks if hasattr(c, "on_step")]
        self._log_hooks = [c.on_log for c in self.callbacks if hasattr(c, "on_log")]

    @contextmanager
    def watching(self) -> Iterator[None]:
        """While the loop runs: the hang watchdog and the compiler's reports."""
        with self.watchdog.watching(), self.compiler.watching():
            yield

    def on_step(self, stats: StepStats) -> None:
        for hook in self._step_hooks:
            hook(stats)

    def on_log(self, done: int, metrics: dict[str, float]) -> None:
        for hook in self._log_hooks:
            hook(done, metrics)

    def stop_reason(self) -> str | None:
        """The first callback's request to end the run (early stopping), if any."""
        return next((reason for c in self.callbacks if (reason := getattr(c, "stop_reason", None))), None)

    def checkpoint_requested(self, done: int) -> bool:
        """Whether a callback asked for a checkpoint at this step (a new best validation)."""
        return any(getattr(c, "checkpoint_at", None) == done for c in self.callbacks)

    @contextmanager
    def evaluated_weights(self) -> Iterator[None]:
        """The weights a validation runs on: a callback may swap others in (``--ema-validate``)."""
        with ExitStack() as weights:
            for callback in (c for c in self.callbacks if hasattr(c, "evaluated_weights")):
                weights.enter_context(callback.evaluated_weights())
            yield

    def end(self, summary: dict[str, Any] | None) -> None:
        """``on_end`` of each callback: the summary, or None after an error or a stop signal."""
        for callback in self.callbacks:
            if hasattr(callback, "on_end"):
                callback.on_end(summary)

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_state(self, sharded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The callbacks' states: (in the checkpoint file, with the model's shards). Under a sharded
        strategy a callback whose state is split like the model's (the weight average) goes with
        the shards; everything else, and everything of a whole checkpoint, into the file."""
        stateful = [callback for callback in self.callbacks if hasattr(callback, "state_dict")]
        in_file = {state_key(callback): callback.state_dict() for callback in stateful}
        with_model = [state_key(c) for c in stateful if sharded and getattr(c, "saved_with_model", False)]
        return in_file, {key: in_file.pop(key) for key in with_model}


def restore_callbacks(
    callbacks: Sequence[Any],
    saved: dict[str, Any],
    from_shards: Callable[[str, dict[str, Any]], dict[str, Any] | None],
    step: int,
    warn: Callable[[str], None],
) -> None:
    """Each stateful callback's state from a resumed checkpoint: ``saved`` (the file's), else
    ``from_shards(key, its current state)`` (a sharded strategy's shards); a warning for a callback
    the checkpoint holds no state of."""
    for callback in (c for c in callbacks if hasattr(c, "load_state_dict")):
        key = state_key(callback)
        state = saved.get(key)
        if state is None:  # under a sharded strategy, each process reads its own part
            state = from_shards(key, callback.state_dict())
        if state is None:
            warn(f"the checkpoint holds no state of callback {key}: it starts afresh at step {step}")
            continue
        try:
            callback.load_state_dict(state)
        except (KeyError, ValueError, TypeError) as error:
            raise CheckpointError(
                f"the checkpoint's state of callback {key} does not load: {error}"
            ) from None


def say_error(line: str) -> None:
    """A one-line error on stderr, flushed: the watchdog ends the process right after it."""
    print(f"leantrain: error: {line}", file=sys.stderr, flush=True)


class LogWindow:
    """The steps since the last log point and the training time they took (compiling left out)."""

    def __init__(self, first_step: int, started: float, compiled: float) -> None:
        self.first_step, self.started, self.compiled = first_step, started, compiled

    def close(self, done: int, compiled: float) -> tuple[int, float]:
        """(steps, seconds) of the window that ends after step ``done``. ``compiled``: the compiler's
        seconds so far (those since the window began are left out)."""
        seconds = max(time.perf_counter() - self.started - (compiled - self.compiled), 1e-9)
        self.compiled = compiled
        return done - self.first_step, seconds

    def restart(self, done: int) -> None:
        """The next window starts now, after step ``done`` (the log point's own time is in neither)."""
        self.first_step, self.started = done, time.perf_counter()

    def leave_out(self, seconds: float, compiled: float) -> None:
        """Time that was not training (a validation, its compiling included)."""
        self.started += seconds
        self.compiled = compiled
