"""Built-in example tasks: ``leantrain fit --example NAME`` or ``leantrain examples``."""

from __future__ import annotations

from typing import Any

from leantrain.errors import TaskError
from leantrain.task import load_task

# name -> (task spec, one-line description)
EXAMPLES: dict[str, tuple[str, str]] = {
    "digits": (
        "leantrain.examples.digits:DigitsTask",
        "small CNN on scikit-learn's 8x8 handwritten digits (1,797 images); reports val accuracy",
    ),
    "charlm": (
        "leantrain.examples.charlm:CharLMTask",
        "GPT-style character model (Block x 4) on Python's pydoc topics text; token-level LossSum",
    ),
    "slowdata": (
        "leantrain.examples.slowdata:SlowDataTask",
        "tiny model fed by CPU-heavy per-item augmentation: data loading is the bottleneck",
    ),
    "hf-gpt2": (
        "leantrain.examples.hf_lm:HFCausalLMTask",
        "a transformers GPT2LMHeadModel (GPT2Block x 4, from a config) on a datasets.Dataset of the pydoc "
        "text's bytes; needs leantrain[hf]",
    ),
}

DEFAULT_EXAMPLE = "digits"


def load_example(name: str) -> Any:
    if name not in EXAMPLES:
        raise TaskError(f"unknown example {name!r}; available: {', '.join(EXAMPLES)}")
    return load_task(EXAMPLES[name][0])
