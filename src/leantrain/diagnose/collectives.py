"""The time tensor parallelism's collectives take, for the doctor's ``communication`` phase.

Under ``--tp`` the collectives run inside forward and backward: DTensor's all-reduces after the
rowwise layers, all-gathers before the colwise ones (sequence parallelism), reduce-scatters, all
issued through ``torch.distributed._functional_collectives``. While the doctor times steps, those
functions are wrapped: each collective is waited for where it is issued (on the CPU it is
synchronous anyway; on CUDA the marks are events on the current stream, which the wait orders
after the collective), and its interval moves from the phase that issued it (forward or
backward) to ``communication``. Issued elsewhere (between phases), it is taken from ``other``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leantrain.diagnose.timer import PhaseTimer

# The functional collectives DTensor's placements and redistribution call (those a torch lacks are skipped).
WRAPPED = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
)


class CollectiveClock:
    """Wraps the functional collectives while entered; ``phase`` says which phase is running."""

    def __init__(self, timer: PhaseTimer) -> None:
        self.timer = timer
        self.phase: str | None = None  # "forward" or "backward" while one runs (set by the probe)
        self.count = 0  # collectives timed
        self._originals: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> CollectiveClock:
        import torch.distributed._functional_collectives as funcol

        for name in WRAPPED:
            if (original := getattr(funcol, name, None)) is not None:
                self._originals[name] = original
                setattr(funcol, name, self._timed(original))
        return self

    def __exit__(self, *error: object) -> None:
        import torch.distributed._functional_collectives as funcol

        for name, original in self._originals.items():
            setattr(funcol, name, original)
        self._originals.clear()

    def _timed(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            timer = self.timer
            start = timer.mark()
            result = collective(*args, **kwargs)
            wait = getattr(result, "wait", None)  # an AsyncCollectiveTensor: waited for here
            result = wait() if callable(wait) else result
            end = timer.mark()
            if timer.enabled:
                self.count += 1
                timer.add_interval("communication", start, end)
                if self.phase is not None:
                    timer.add_interval(self.phase, end, start)  # taken out of the phase that issued it
            return result

        return timed
