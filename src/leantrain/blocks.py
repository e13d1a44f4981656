"""A model's repeated blocks, and the policies that pick some of them.

Activation checkpointing recomputes the blocks a policy picks (``memory/recompute.py``),
FSDP shards them as units, and ``split`` and ``pipeline`` cut the model between them.

A policy is comma-separated terms:

* class names (``Block``): every module of that class;
* ``every:N``: only every N-th of the matching modules (the 1st, the N+1-th, ...);
* ``first:N``: only the first N of them (after ``every``);
* no class name: the model's repeated blocks (see :func:`block_classes`);
* ``auto`` (activation checkpointing only): the fewest of the repeated blocks that let the
  micro-batch fit the memory budget (resolved before training, see
  ``memory/estimate.fewest_checkpointed_blocks``);
* ``selective`` (activation checkpointing only, with the terms above but not ``auto``): the
  picked blocks are checkpointed op by op, keeping their matrix products' outputs and
  recomputing the rest (see ``memory/recompute.py``).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from torch import nn

from leantrain.errors import ConfigError

_COUNT = re.compile(r"(every|first):(\d+)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class BlockPolicy:
    classes: tuple[str, ...] = ()  # empty: the model's repeated blocks
    every: int = 1
    first: int | None = None  # only the first N matches (after every)
    auto: bool = False
    selective: bool = False  # op-level: keep the blocks' matrix products, recompute the rest
    field: str = "activation_checkpointing"  # the config field errors name

    @classmethod
    def parse(cls, text: str, field: str = "activation_checkpointing") -> BlockPolicy:
        """``"Block"``, ``"Block,every:2"``, ``"every:3"``, ``"Block,first:2"``, ``"auto"``,
        ``"selective"``, ``"Block,selective"``.

        Anything else is a ConfigError naming the field."""
        recompute = field == "activation_checkpointing"
        if text.strip() == "auto" and recompute:
            return cls(auto=True)
        classes: list[str] = []
        counts: dict[str, int] = {}
        selective = False
        for term in (t.strip() for t in text.split(",")):
            match = _COUNT.fullmatch(term)
            if match and int(match.group(2)) >= 1:
                counts[match.group(1)] = int(match.group(2))
            elif term == "selective" and recompute:
                selective = True
            elif _NAME.fullmatch(term) and term not in ("auto", "selective"):
                classes.append(term)
            else:
                raise ConfigError(
                    field,
                    text,
                    ("auto (alone), selective, or " if recompute else "")
                    + "comma-separated module class names, every:N and first:N (N >= 1), "
                    + (
                        "e.g. Block, Block,every:2 or Block,selective"
                        if recompute
                        else "e.g. Block or Block,every:2"
                    ),
                )
        return cls(
            tuple(classes), counts.get("every", 1), counts.get("first"), selective=selective, field=field
        )


def block_classes(model: nn.Module) -> tuple[str, ...]:
    """The class of the model's repeated blocks.

    Candidates are classes with at least two instances side by side in a ``ModuleList`` or
    ``Sequential``; composite modules (with submodules of their own) beat leaf layers, then
    the outermost wins: in a GPT, ``Block`` rather than the two ``Linear`` of its MLP.
    """
    depth_of = {module: name.count(".") + bool(name) for name, module in model.named_modules()}
    candidates: dict[str, tuple[bool, int]] = {}
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            kinds = Counter(type(child).__name__ for child in module.children())
            for child in module.children():
                kind = type(child).__name__
                if kinds[kind] >= 2:
                    leaf = next(child.children(), None) is None
                    key = (leaf, depth_of[child])
                    candidates[kind] = min(candidates.get(kind, key), key)
    if not candidates:
        return ()
    return (min(candidates, key=lambda kind: candidates[kind]),)


def matching_blocks(model: nn.Module, policy: BlockPolicy) -> list[tuple[str, nn.Module]]:
    """(name, module) of the modules the policy checkpoints, in the order of ``named_modules``."""
    classes = policy.classes or block_classes(model)
    if not classes:
        raise ConfigError(
            policy.field,
            f"every:{policy.every}",
            "needs module class names: this model has no ModuleList or Sequential of repeated blocks",
        )
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in classes if name not in present]
    if missing:
        raise ConfigError(
            policy.field,
            ",".join(classes),
            f"the model has no module of class {', '.join(missing)}; "
            f"its classes: {', '.join(sorted(present))}",
        )
    # The root is no block of itself (a Sequential of Sequentials would match it).
    found = [(name, m) for name, m in model.named_modules() if name and type(m).__name__ in classes]
    # A match inside another match would be recomputed twice: keep the outermost only.
    outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o != n)]
    return outer[:: policy.every][: policy.first]
