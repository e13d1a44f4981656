"""When DTensor runs an op that no rank runs: its propagation of shapes.

To learn an op's output shapes, DTensor runs it at the whole tensors' shapes on fake tensors. On real
tensors it makes a fake mode of its own for that, which the plan's instruments tell apart; under a plan
the fake mode is already the plan's, so it reuses it, and its whole-shape op looks like one of this
rank's: a colwise layer would count 1.5 times its FLOPs, a sharded gradient's norm a whole gradient's
memory. While ``running``, the instruments leave the op out.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

# DTensor's private method (torch 2.13): a torch without it leaves the instruments counting the op.
_PROPAGATE = "_propagate_tensor_meta_non_cached"


class ShapePropagation:
    """``with ShapePropagation() as propagation:``; ``propagation.running`` inside DTensor's propagation."""

    def __init__(self) -> None:
        self.depth = 0

    @property
    def running(self) -> bool:
        return self.depth > 0

    def __enter__(self) -> ShapePropagation:
        propagator = DTensor._op_dispatcher.sharding_propagator
        original = getattr(propagator, _PROPAGATE, None)
        if original is not None:

            def propagate(*args: Any, **kwargs: Any) -> Any:
                self.depth += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self.depth -= 1

            setattr(propagator, _PROPAGATE, propagate)  # on the instance: __exit__ removes it
        return self

    def __exit__(self, *error: object) -> None:
        propagator = DTensor._op_dispatcher.sharding_propagator
        if _PROPAGATE in vars(propagator):
            delattr(propagator, _PROPAGATE)
