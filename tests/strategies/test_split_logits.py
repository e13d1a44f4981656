"""``--loss-parallel``'s decision, on one process: the task's loss is tried on the split logits and on
the gathered ones, and the split logits are kept only when every rank finds the two equal.

The output layer here returns what a colwise layer returns under ``--tp``: logits that gather whole on
demand (``full_tensor``); the launches of tests/distributed/test_tensor_parallel.py run the real ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.strategies.base import Example
from leantrain.strategies.split_logits import SplitLogits
from leantrain.task import LossSum


class Split:
    """Vocabulary-split logits; the loss reads ``local`` unless they are gathered."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.local, self.whole = logits[..., :3], logits

    def full_tensor(self) -> torch.Tensor:
        return self.whole


class ColwiseHead(nn.Linear):
    """With dropout: in training mode the two tries would draw different masks."""

    def forward(self, x: torch.Tensor) -> Split:  # type: ignore[override]
        return Split(F.dropout(super().forward(x), 0.5, self.training))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"lm_head": ColwiseHead(4, 6)}).train()


BATCH = (torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0]))


def logits_of(output) -> torch.Tensor:
    return output.local if isinstance(output, Split) else output


def reads_the_split_logits(model: nn.Module, batch) -> torch.Tensor:
    """Not a cross-entropy over the whole vocabulary on split logits: another value."""
    x, labels = batch
    return F.cross_entropy(logits_of(model["lm_head"](x)), labels)


def the_same_either_way(model: nn.Module, batch) -> LossSum:
    x, labels = batch
    output = model["lm_head"](x)
    whole = output.whole if isinstance(output, Split) else output
    return LossSum(F.cross_entropy(whole, labels, reduction="sum"), torch.tensor(5.0))


def test_a_loss_that_differs_on_split_logits_gathers_them_and_says_why():
    net = model()
    split = SplitLogits(net, "lm_head")
    asked = []
    line = split.decide(True, Example(reads_the_split_logits, lambda: BATCH), lambda b: asked.append(b) or b)
    assert line == (
        "loss parallel: off (the task's loss differs on split logits: it is not a cross-entropy over them): "
        "lm_head's logits gathered"
    )
    assert asked == [True] and not split.on and net.training  # asked of the ranks; the mode given back
    assert isinstance(net["lm_head"](BATCH[0]), torch.Tensor)  # gathered from now on


def test_a_loss_equal_on_both_is_kept_on_split_logits_unless_another_rank_disagrees():
    net = model()
    split = SplitLogits(net, "lm_head")
    line = split.decide(True, Example(the_same_either_way, lambda: BATCH), lambda b: b)
    assert line == "loss parallel: on: the cross-entropy on lm_head's logits split by vocabulary"
    assert split.on and isinstance(net["lm_head"](BATCH[0]), Split)
    assert net.training  # tried in evaluation mode (no dropout), then training again
    evaluated = model().eval()
    SplitLogits(evaluated, "lm_head").decide(True, Example(the_same_either_way, lambda: BATCH), lambda b: b)
    assert not evaluated.training  # the mode it had
    other = SplitLogits(model(), "lm_head")
    line = other.decide(True, Example(the_same_either_way, lambda: BATCH), lambda b: True)
    assert line == "loss parallel: off (another rank found the losses unequal): lm_head's logits gathered"
    assert not other.on


def test_turned_off_without_a_micro_batch_or_an_output_layer():
    lines = [
        SplitLogits(model(), "lm_head").decide(
            False, Example(the_same_either_way, lambda: BATCH), lambda b: b
        ),
        SplitLogits(model(), "lm_head").decide(True, None, lambda b: b),
    ]
    assert lines == [
        "loss parallel: off (--loss-parallel false): lm_head's logits gathered",
        "loss parallel: off (no first micro-batch to try the loss on): lm_head's logits gathered",
    ]
    assert (
        SplitLogits(model(), None).decide(True, Example(the_same_either_way, lambda: BATCH), lambda b: b)
        is None
    )
