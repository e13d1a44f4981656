"""The ``leantrain`` command: ``fit``, ``examples`` and ``export``.

Every :class:`TrainConfig` field is a hyphenated ``fit`` flag and a key of the YAML file
given with ``--config``; the flags are generated from the dataclass, grouped as its
fields are. Values arrive as text (flags) or YAML scalars and are converted by
:func:`leantrain.config.coerce`; :meth:`TrainConfig.validate` then reports any bad value
in one line. Errors caused by the user's input print that line and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser
from rich.console import Console
from rich.table import Table

from leantrain.checkpoint import export_checkpoint
from leantrain.config import GROUPS, TrainConfig, coerce, metavar
from leantrain.errors import LeantrainError, RunInterrupted, TaskError
from leantrain.examples import DEFAULT_EXAMPLE, EXAMPLES, load_example
from leantrain.task import load_task
from leantrain.trainer import FitResult, Trainer

EXIT_USAGE = 2
# Flags that are not TrainConfig fields.
TASK_FLAGS = ("task", "example")
# Extra spellings of field flags, as SPEC.md writes them.
FLAG_ALIASES = {"out_dir": ["--out"]}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fit_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Train a task. With no arguments: the built-in 'digits' example.", exit_on_error=False
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file of flags (keys as field names)")
    source = parser.add_argument_group("Task")
    source.add_argument(
        "--task", default=None, help="the task to train, as 'pkg.module:Name' (class or factory)"
    )
    source.add_argument(
        "--example",
        default=None,
        help=f"a built-in task: {', '.join(EXAMPLES)}; null: {DEFAULT_EXAMPLE} unless --task is given",
    )
    hints = typing.get_type_hints(TrainConfig)
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for field in dataclasses.fields(TrainConfig):
        groups[field.metadata["group"]].add_argument(
            flag(field.name),
            *FLAG_ALIASES.get(field.name, []),
            dest=field.name,
            default=field.default,
            metavar=metavar(hints[field.name]),
            help=field.metadata["help"],
        )
    return parser


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="leantrain", description="A PyTorch training engine that tells you why.", exit_on_error=False
    )
    commands = parser.add_subcommands(dest="command")
    commands.add_subcommand("fit", _fit_parser(), help="train a task (default: the digits example)")
    commands.add_subcommand(
        "examples", ArgumentParser(exit_on_error=False), help="list the built-in example tasks"
    )
    export = ArgumentParser(
        description="Write a checkpoint's model weights as safetensors.", exit_on_error=False
    )
    export.add_argument("checkpoint", help="a checkpoint file (run folder/checkpoints/step-*.pt)")
    export.add_argument("out", help="the .safetensors file to write (or a folder: OUT/model.safetensors)")
    commands.add_subcommand("export", export, help="turn a checkpoint into safetensors weights")
    return parser


def config_from_args(values: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from parsed flag values (text or YAML scalars)."""
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name: coerce(values[f.name], hints[f.name]) for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**fields)


def resolve_task(task: str | None, example: str | None) -> tuple[Any, str]:
    """The task object and a short name for it (used in the default run folder)."""
    if task and example:
        raise TaskError("give either --task or --example, not both")
    if task:
        return load_task(task), task.rpartition(":")[2]
    name = example or DEFAULT_EXAMPLE
    return load_example(name), name


def run_fit(values: dict[str, Any], console: Console) -> FitResult:
    cfg = config_from_args(values)
    task, name = resolve_task(values.get("task"), values.get("example"))
    result = Trainer(cfg).fit(task, name=name)
    console.print(_summary_table(result))
    return result


def _summary_table(result: FitResult) -> Table:
    table = Table(title=f"summary ({result.out_dir}/summary.json)", show_header=False)
    for key, value in result.summary().items():
        text = (
            f"{value:,.4g}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        )
        table.add_row(key, str(text))
    return table


def list_examples(console: Console) -> None:
    table = Table(title="built-in examples (leantrain fit --example NAME)")
    table.add_column("name")
    table.add_column("task")
    table.add_column("what it is")
    for name, (spec, description) in EXAMPLES.items():
        table.add_row(name + (" (default)" if name == DEFAULT_EXAMPLE else ""), spec, description)
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args = ["fit"]  # `leantrain` alone trains the default example
    console = Console()
    try:
        namespace = build_parser().parse_args(args)
        if namespace.command == "examples":
            list_examples(console)
        elif namespace.command == "export":
            written = export_checkpoint(namespace.export.checkpoint, namespace.export.out)
            console.print(f"wrote {written}")
        else:
            values = namespace.fit.as_dict()
            run_fit(values, console)
    except argparse.ArgumentError as error:
        return _fail(f"leantrain: error: {' '.join(str(error).split())}")
    except LeantrainError as error:
        return _fail(f"leantrain: error: {error}")
    except RunInterrupted as stop:
        # 128 + signal number: the shell's convention for "ended by this signal".
        return _fail(f"leantrain: {stop}", code=128 + stop.signal_number)
    except KeyboardInterrupt:
        return _fail("leantrain: interrupted", code=130)
    return 0


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
