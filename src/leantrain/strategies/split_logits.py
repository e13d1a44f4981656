"""``--loss-parallel``: the task's cross-entropy on logits split by vocabulary, never gathered whole.

Under ``--tp`` the output layer (a plan's last gathered ``colwise``: transformers' ``lm_head``)
computes ``batch x sequence x vocabulary / N`` logits on each rank. Gathered, every rank holds
all of them, the largest activation of a language model; torch's ``loss_parallel`` computes the
cross-entropy on the split logits instead (one all-reduce of a few numbers per row).

It needs the task's loss to be a cross-entropy over those logits (``F.cross_entropy`` on them,
in any reduction, with class indices), and the loss's backward under the same context. Whether
the loss is such is not read from its code but tried: before training, the first micro-batch's
loss is computed both ways (evaluation mode, no gradient); the split logits are kept only when
every rank finds the two equal, else the logits are gathered as the plan says and the run log
says why. The loss the task returns is a DTensor then; the rest of the run sees its local value.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from leantrain.errors import one_line
from leantrain.strategies.base import Example
from leantrain.task import LossSum

# The split loss sums the same terms in another order: float32 rounding, not a different loss.
AGREEMENT = dict(rtol=1e-5, atol=1e-6)


def _gathered(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: the output layer's split logits, gathered whole (differentiable)."""
    return output.full_tensor()


def local_loss(loss: Any) -> Any:
    """``loss`` (a tensor or a LossSum) with its DTensors as plain tensors (differentiable)."""
    if isinstance(loss, LossSum):
        return LossSum(local_loss(loss.sum), local_loss(loss.count))
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


class SplitLogits:
    """Whether this run's loss reads vocabulary-split logits (``on``), and what that takes."""

    def __init__(self, model: nn.Module, output_layer: str | None, values: bool = True) -> None:
        """``values``: False for fake tensors (``plan --cluster``): the loss is only tried on split logits."""
        self.model, self.output_layer, self.on = model, output_layer, False
        self.values = values

    def decide(self, wanted: bool, example: Example | None, any_rank: Callable[[bool], bool]) -> str | None:
        """Keep the split logits when ``wanted`` and the task's loss agrees on them (see the module's
        doc); else gather them. The run log's line, None without an output layer to split."""
        if self.output_layer is None:
            return None
        why = "--loss-parallel false" if not wanted else "no first micro-batch to try the loss on"
        if wanted and example is not None:
            why = self._disagreement(example)
        if any_rank(why is not None):  # every rank takes the same decision
            self.model.get_submodule(self.output_layer).register_forward_hook(_gathered)
            why = why or "another rank found the losses unequal"
            return f"loss parallel: off ({why}): {self.output_layer}'s logits gathered"
        self.on = True
        return f"loss parallel: on: the cross-entropy on {self.output_layer}'s logits split by vocabulary"

    def _disagreement(self, example: Example) -> str | None:
        """None when the task's loss on the first micro-batch is the same on split and gathered logits."""
        from torch.distributed.tensor.parallel import loss_parallel

        layer, was_training = self.model.get_submodule(self.output_layer), self.model.training
        self.model.eval()
        try:
            batch = example.batch()
            with torch.no_grad():
                hook = layer.register_forward_hook(_gathered)
                try:
                    gathered = local_loss(example.loss_fn(self.model, batch))
                finally:
                    hook.remove()
                with loss_parallel():
                    split = local_loss(example.loss_fn(self.model, batch))
        except Exception as error:  # an op that split logits do not support: the task's loss is another
            return f"the task's loss fails on split logits: {type(error).__name__}: {one_line(error, 120)}"
        finally:
            self.model.train(was_training)
        # A LossSum's sum and count side by side (a NamedTuple of numbers), a plain loss as it is.
        if not self.values or torch.allclose(_as_values(split), _as_values(gathered), **AGREEMENT):
            return None
        return "the task's loss differs on split logits: it is not a cross-entropy over them"

    def context(self) -> AbstractContextManager[Any]:
        """Where the task's loss and its backward run."""
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.on else nullcontext()

    def local(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` returning plain tensors (the task's loss, or its loss and metrics)."""
        if not self.on:
            return loss_fn

        def plain(*args: Any) -> Any:
            result = loss_fn(*args)
            if isinstance(result, tuple) and not isinstance(result, LossSum):  # (loss, metrics)
                loss, metrics = result
                return local_loss(loss), {name: local_loss(value) for name, value in metrics.items()}
            return local_loss(result)

        return plain


def _as_values(loss: Any) -> torch.Tensor:
    return torch.as_tensor(loss).double()
