"""Tensor-parallel plans: which modules a ``--tp`` run splits, and how; where a plan comes from.

A plan maps module names to styles. A name may hold ``*`` for one part of a dotted name
(``layers.*.mlp.up_proj``, as in transformers' plans). The styles, on ``nn.Linear`` (and
``nn.Embedding``, whose vocabulary rows are its "input" side here as in Megatron):

- ``colwise``: the output features split; the input whole on every rank, the output left split
  (the next layer is ``rowwise``: a block's matrices communicate once, at its end);
- ``rowwise``: the input features split (an embedding: its vocabulary); the partial outputs
  summed over the group (one all-reduce);
- ``colwise_rep`` (transformers: ``colwise_gather_output``): ``colwise`` with its output
  gathered whole, for a head whose logits a plain loss reads;
- ``rowwise_split_input`` (``rowwise_rep``): ``rowwise`` on a whole input (each rank takes its
  part); ``embedding_rowwise``/``embedding_colwise``: transformers' names for an embedding's;
  ``replicate``: left whole; ``replicated_with_grad_allreduce``: whole, but applied to split
  activations, so each rank's gradient is a part, summed over the group;
- sequence parallelism (``--sequence-parallel``, on by default where a plan has it): from a
  ``sequence_split`` module's input to a ``sequence_gather`` module's, each rank holds its share
  of the positions; ``sequence_parallel`` modules (norms) run on it, ``sequence_colwise`` layers
  all-gather it before their product and ``sequence_rowwise`` layers reduce-scatter into it
  (instead of an all-reduce). Off, the same plan runs with whole activations.

A parameter that the plan leaves whole yet that works on split activations gets a different
gradient on each rank of a group; the first step checks that every whole parameter's gradient
agrees over the group, and names the first that does not (see ``TensorParallel``).

Where it comes from, in this order: the task's ``tp_plan(model)``; a transformers model's own
(``config.base_model_tp_plan`` under the base model's prefix, and the head's ``_tp_plan``),
read, not re-typed. Everything a plan does not name stays whole on every rank of a group.
Each plan is checked before training: every name matches a module, each style applies to its
module and splits it evenly, and the attention heads divide (the model's ``heads``-like
attributes and a transformers config's head counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

from torch import nn

from leantrain.errors import ConfigError


class Style(NamedTuple):
    """What a style splits: "out" (a Linear's output features, an Embedding's width), "in" (a
    Linear's input features, an Embedding's vocabulary) or "" (nothing: the module stays whole);
    how its input arrives and its output leaves: "whole", "split" (by feature: a colwise
    neighbour's output) or "sequence" (split by position, sequence parallelism)."""

    splits: str
    takes: str
    gives: str


# transformers' names for the same styles are accepted as they are.
STYLES: dict[str, Style] = {
    "colwise": Style("out", "whole", "split"),
    "colwise_rep": Style("out", "whole", "whole"),
    "colwise_gather_output": Style("out", "whole", "whole"),
    "embedding_colwise": Style("out", "whole", "split"),
    "rowwise": Style("in", "split", "whole"),
    "rowwise_rep": Style("in", "whole", "whole"),
    "rowwise_split_input": Style("in", "whole", "whole"),
    "embedding_rowwise": Style("in", "whole", "whole"),
    "replicate": Style("", "whole", "whole"),
    "replicated_with_grad_allreduce": Style("", "whole", "whole"),
    # Sequence parallelism: between blocks each rank holds its share of the positions.
    "sequence_split": Style("", "whole", "sequence"),
    "sequence_parallel": Style("", "sequence", "sequence"),
    "sequence_colwise": Style("out", "sequence", "split"),
    "sequence_rowwise": Style("in", "split", "sequence"),
    "sequence_gather": Style("", "sequence", "whole"),
}


def style_of(name: str, sequence_parallel: bool) -> Style:
    """The style ``name`` means, sequence parallelism on or off (off: whole where it would split)."""
    style = STYLES[name]
    if sequence_parallel:
        return style
    return Style(
        style.splits, *("whole" if side == "sequence" else side for side in (style.takes, style.gives))
    )


# Whole on every rank but used on split activations (a norm over each head: Qwen3's q_norm): each
# rank's gradient is a part, summed over the group after backward.
SUMMED = "replicated_with_grad_allreduce"
# Attributes that hold a number of attention heads, in leantrain's examples and transformers.
HEAD_COUNTS = ("heads", "num_heads", "n_head", "num_attention_heads", "num_key_value_heads")


def plan_of(model: nn.Module, task_plan: Mapping[str, str] | None, tp: int) -> tuple[dict[str, str], str]:
    """The plan for ``model`` and where it came from; a ConfigError when there is none."""
    if task_plan is not None:
        if not isinstance(task_plan, Mapping) or not task_plan:
            raise ConfigError("tp", tp, "task.tp_plan(model) must return a dict of module names to styles")
        return dict(task_plan), "task.tp_plan(model)"
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if base_plan:
        prefix = getattr(model, "base_model_prefix", "")
        under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        plan = {f"{under}{name}": style for name, style in base_plan.items()}
        plan.update(getattr(model, "_tp_plan", None) or {})  # the head, on the model with one
        return plan, f"{type(model).__name__}'s own plan (transformers)"
    raise ConfigError(
        "tp",
        tp,
        f"{type(model).__name__} has no tensor-parallel plan: give the task a tp_plan(model) returning "
        "{module name: colwise|rowwise|colwise_rep} (docs/parallelism.md)",
    )


def planned_modules(model: nn.Module, plan: Mapping[str, str], tp: int) -> dict[str, str]:
    """Every module the plan names, by full name, with its style, checked (see the module's doc)."""
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            allowed = ", ".join(STYLES)
            raise ConfigError("tp", tp, f"plan entry {pattern}: style {style!r} is not one of {allowed}")
        matched = [name for name in names if _matches(pattern, name)]
        if not matched:
            raise ConfigError("tp", tp, f"plan entry {pattern} matches no module of {type(model).__name__}")
        for name in matched:
            if STYLES[style][0]:
                _check_divides(name, model.get_submodule(name), style, tp)
            chosen[name] = style
    _check_heads(model, tp)
    return chosen


def _matches(pattern: str, name: str) -> bool:
    wanted, parts = pattern.split("."), name.split(".")
    if len(wanted) != len(parts):
        return False
    return all(fnmatchcase(part, want) for part, want in zip(parts, wanted, strict=True))


def _check_divides(name: str, module: nn.Module, style: str, tp: int) -> None:
    splits = STYLES[style][0]
    if isinstance(module, nn.Linear):
        size = module.in_features if splits == "in" else module.out_features
    elif isinstance(module, nn.Embedding):
        size = module.num_embeddings if splits == "in" else module.embedding_dim
    else:
        kind = type(module).__name__
        raise ConfigError(
            "tp", tp, f"plan entry {name}: {style} splits an nn.Linear or nn.Embedding, not {kind}"
        )
    if size % tp:
        raise ConfigError("tp", tp, f"must divide {name}'s {size} features that {style} splits")


def _check_heads(model: nn.Module, tp: int) -> None:
    holders: list[tuple[str, Any]] = [("config", getattr(model, "config", None))]
    holders += [(name or type(model).__name__, module) for name, module in model.named_modules()]
    for where, holder in holders:
        for attribute in HEAD_COUNTS:
            count = getattr(holder, attribute, None)
            if isinstance(count, int) and not isinstance(count, bool) and count % tp:
                raise ConfigError("tp", tp, f"must divide the {count} attention heads of {where}.{attribute}")


def output_layer(model: nn.Module, chosen: Mapping[str, str]) -> str | None:
    """The Linear whose gathered output is the logits: the last that the plan splits colwise and
    gathers (transformers' ``lm_head``); None when there is none."""
    gathering = [
        name
        for name, module in model.named_modules()
        if name in chosen and STYLES[chosen[name]][::2] == ("out", "whole") and isinstance(module, nn.Linear)
    ]
    return gathering[-1] if gathering else None


def parallel_styles(
    model: nn.Module, chosen: Mapping[str, str], sequence_parallel: bool, left_split: str | None = None
) -> dict[str, Any]:
    """``torch.distributed.tensor.parallel`` styles for the checked plan ``chosen``; ``left_split``:
    a gathering module whose output stays split instead, as a DTensor (``split_logits.py``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    layouts = {"whole": Replicate(), "split": Shard(-1), "sequence": Shard(1)}
    styles: dict[str, Any] = {}
    for name, style in chosen.items():
        splits, takes, gives = style_of(style, sequence_parallel)
        if isinstance(model.get_submodule(name), nn.Embedding):
            takes = "whole"  # token ids, whole on every rank, whatever the style's name says
        if name == left_split:
            styles[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        elif splits == "out":
            styles[name] = ColwiseParallel(input_layouts=layouts[takes], output_layouts=layouts[gives])
        elif splits == "in":
            styles[name] = RowwiseParallel(input_layouts=layouts[takes], output_layouts=layouts[gives])
        elif (takes, gives) == ("sequence", "sequence"):
            styles[name] = SequenceParallel(use_local_output=True)
    return styles


def sequence_moves(chosen: Mapping[str, str], sequence_parallel: bool) -> dict[str, str]:
    """The modules whose first input sequence parallelism splits or gathers (see ``sequence.py``)."""
    moves = {("whole", "sequence"): "split", ("sequence", "whole"): "gather"}
    found = {}
    for name, style in chosen.items():
        splits, takes, gives = style_of(style, sequence_parallel)
        if not splits and (takes, gives) in moves:
            found[name] = moves[takes, gives]
    return found
