"""Learning-rate schedules that know the run: how many optimizer steps it has.

Two sources, never both: the task's own ``scheduler(optimizer)`` or
``scheduler(optimizer, total_steps)`` (given the run's optimizer steps when it takes a second
argument), or a built-in schedule (``lr_schedule`` constant, linear or cosine, with
``lr_warmup_steps`` and ``lr_min_ratio``). A built-in schedule is a ``LambdaLR`` whose factor is a
function of (step, total steps) alone, so its checkpoint section is the scheduler's state dict and
a resume sets the learning rate from that function: under a changed ``max_steps`` it follows the
new total (and says so). A task's scheduler with a finite length shorter than the run (see
:func:`shorter_than_the_run`) gets a warning, once, at set-up.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from leantrain.config import TrainConfig
from leantrain.errors import ConfigError, TaskError
from leantrain.task import call_task


class ScheduleShape:
    """The factor on the base learning rates after ``step`` optimizer updates.

    Warmup: ``step / warmup`` (the first update at 0, rising linearly to the base rate); then
    ``constant`` 1, ``linear`` ``1 - p`` or ``cosine`` ``0.5 (1 + cos(pi p))``, with ``p`` the
    progress from the end of the warmup (0) to ``total_steps`` (1), and the decay taken from 1 down
    to ``min_ratio`` instead of 0. A plain object (no closure): ``LambdaLR`` saves its attributes.
    """

    def __init__(self, kind: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> None:
        self.kind = kind
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_ratio = min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        decay = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * decay

    def describe(self) -> str:
        floor = f" to {self.min_ratio:g} x" if self.min_ratio and self.kind != "constant" else ""
        return f"{self.kind}{floor} over {self.total_steps} steps, warmup {self.warmup_steps}"


class BuiltInSchedule(LambdaLR):
    """A built-in schedule: ``LambdaLR`` over a :class:`ScheduleShape`.

    Resuming keeps this run's shape (not the saved one) and sets the learning rates for the
    restored step from it: identical to the saved rates when nothing changed; under a changed
    total (``max_steps``) or schedule, the new one from here on, said in ``resume_warning``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shape: ScheduleShape) -> None:
        self.shape = shape
        self.resume_warning: str | None = None
        super().__init__(optimizer, shape)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("resume_warning", None)
        state.pop("shape", None)  # saved once, as lr_lambdas
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("lr_lambdas")
        keys = set(vars(self.shape))
        if not saved or not all(isinstance(s, dict) and set(s) == keys for s in saved):
            raise ValueError("it was not saved by a built-in lr_schedule (a task's own scheduler?)")
        mine = dict(vars(self.shape))
        super().load_state_dict(state_dict)
        vars(self.shape).update(mine)  # this run's shape, whatever the checkpoint's was
        factor = self.shape(self.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(base * factor)
            else:
                group["lr"] = base * factor
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        if saved[0] != mine:
            before = ScheduleShape(**saved[0]).describe()
            self.resume_warning = (
                f"the learning-rate schedule changed on resume at step {self.last_epoch}: the checkpoint's "
                f"was {before}, this run's is {self.shape.describe()} (max_steps or the lr_* settings "
                "changed); the learning rate follows the new one from here on"
            )


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """``lr_warmup_steps`` in steps: a count as given, a fraction of ``total_steps`` rounded up.

    A warmup as long as the run or longer is refused: the learning rate would never reach the
    rates the task set, and the decay would never start (a fraction scales with the run)."""
    value = cfg.lr_warmup_steps
    steps = value if isinstance(value, int) else math.ceil(value * total_steps)
    if steps >= total_steps:
        raise ConfigError(
            "lr_warmup_steps",
            value,
            f"is {steps} steps, not fewer than the run's {total_steps} optimizer steps: the learning rate "
            "would never reach its base value; give fewer steps or a fraction such as 0.1",
        )
    return steps


def make_scheduler(task: Any, optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> Any:
    """The run's scheduler: the task's, a built-in one (``cfg.lr_schedule``), or None."""
    own = getattr(task, "scheduler", None)
    if cfg.lr_schedule == "task":
        return task_scheduler(own, optimizer, total_steps) if callable(own) else None
    if callable(own):
        raise TaskError(
            f"the task has its own scheduler and lr_schedule is {cfg.lr_schedule}: use one of the two "
            "(lr_schedule task, the default, uses the task's)"
        )
    shape = ScheduleShape(cfg.lr_schedule, warmup_steps(cfg, total_steps), total_steps, cfg.lr_min_ratio)
    return BuiltInSchedule(optimizer, shape)


def task_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """``task.scheduler(optimizer, total_steps)`` when it takes a second argument, else
    ``task.scheduler(optimizer)``."""
    try:
        signature = inspect.signature(scheduler)
    except (TypeError, ValueError):  # no signature to read (a builtin): the one-argument form
        return call_task("task.scheduler(optimizer)", scheduler, optimizer)
    for args, shown in (((optimizer, total_steps), "optimizer, total_steps"), ((optimizer,), "optimizer")):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return call_task(f"task.scheduler({shown})", scheduler, *args)
    raise TaskError(
        f"task.scheduler{signature} must take (optimizer) or (optimizer, total_steps), the run's "
        "optimizer steps"
    )


# Schedulers with a finite length: the attribute that holds it; past it the schedule is not what
# it was built for (OneCycleLR raises, CosineAnnealingLR rises again, the decays stop).
_LENGTHS = {
    "OneCycleLR": "total_steps",
    "CosineAnnealingLR": "T_max",
    "LinearLR": "total_iters",
    "PolynomialLR": "total_iters",
}


def finite_length(scheduler: Any) -> tuple[int, str] | None:
    """The steps after which ``scheduler`` ends, and what says so; None: it has no end that matters.

    A ``LinearLR`` that rises (a warmup) is meant to end early, and is not counted. A
    ``SequentialLR`` ends with its last scheduler, after its last milestone; a ``ChainedScheduler``
    with the first of its schedulers to end."""
    name = type(scheduler).__name__
    if name == "SequentialLR":
        last = finite_length(scheduler._schedulers[-1])
        milestone = scheduler._milestones[-1]
        return None if last is None else (milestone + last[0], f"milestone {milestone} + {last[1]}")
    if name == "ChainedScheduler":
        ends = [end for inner in scheduler._schedulers if (end := finite_length(inner)) is not None]
        return min(ends, default=None)
    attribute = _LENGTHS.get(name)
    if attribute is None or not isinstance(steps := getattr(scheduler, attribute, None), int):
        return None
    if name == "LinearLR" and scheduler.end_factor >= scheduler.start_factor:
        return None
    return steps, f"{name} {attribute}={steps}"


def shorter_than_the_run(scheduler: Any, total_steps: int) -> str | None:
    """The warning for a task's scheduler that ends before the run's last step, or None."""
    end = finite_length(scheduler)
    if end is None or end[0] >= total_steps:
        return None
    return (
        f"task.scheduler's {type(scheduler).__name__} ends after {end[0]} steps ({end[1]}) but the run has "
        f"{total_steps} optimizer steps: past its end the learning rate is not what it was built for; take "
        "the run's length as an argument, scheduler(self, optimizer, total_steps), or use --lr-schedule"
    )
