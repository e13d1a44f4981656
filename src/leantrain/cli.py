"""The ``leantrain`` command: ``fit``, ``doctor``, ``plan``, ``cache``, ``launch``, ``slurm``, ``examples``,
``export``.

Every :class:`TrainConfig` field is a hyphenated ``fit`` flag and a key of the YAML file
given with ``--config``; the flags are generated from the dataclass, grouped as its
fields are. Values arrive as text (flags) or YAML scalars and are converted by
:func:`leantrain.config.coerce`; :meth:`TrainConfig.validate` then reports any bad value
in one line. Errors caused by the user's input print that line and exit with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import typing
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, get_loader, set_loader
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from leantrain.bounded_read import check_yaml, load_yaml
from leantrain.checkpoint import export_checkpoint, export_pretrained
from leantrain.cluster import detect
from leantrain.config import GROUPS, TrainConfig, coerce, metavar
from leantrain.data.cache import prepare_cache, task_source
from leantrain.data.limits import check_num_workers
from leantrain.data.remote_cache import cache_root, fetch_split, publish_split
from leantrain.data.workers import auto_workers
from leantrain.diagnose.probe import DEFAULT_STEPS, DEFAULT_WARMUP, TRACED_STEPS
from leantrain.errors import (
    ConfigError,
    LeantrainError,
    LeantrainWarning,
    RunInterrupted,
    StorageError,
    TaskError,
)
from leantrain.examples import DEFAULT_EXAMPLE, EXAMPLES, load_example
from leantrain.extensions.weight_average import averaged_weights
from leantrain.files import check_folder
from leantrain.launch.slurm import CPUS_PER_GPU, SlurmOptions, run_folder, sbatch_script, submit
from leantrain.memory.estimate import DEFAULT_MARGIN, RECOMPUTE_PAYS, MemoryEstimate, estimate_memory
from leantrain.remote import check_url, is_url
from leantrain.run.mirror import exported
from leantrain.run.preflight import check_machine
from leantrain.strategies.registry import check_config, names, strategies
from leantrain.task import call_task, load_task
from leantrain.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from leantrain.diagnose.doctor import Diagnosis
    from leantrain.trainer import FitResult

# Start-up is paid by every command and every process of a launch: what only one command uses
# (the training loop, the doctor and its report, torchrun's launcher) is imported inside that command.

# Exit codes (docs/errors.md): 0 done; 1 a bug, with its traceback; 2 bad input (one line);
# 74 the storage refused a write (sysexits' EX_IOERR; one line that says what is safe);
# 128 + N stopped by signal N after a checkpoint; 130 Ctrl-C.
EXIT_USAGE = 2
EXIT_STORAGE = 74
# Flags that are not TrainConfig fields.
TASK_FLAGS = ("task", "example")
# `--json` alone or `--json true|false`, for every command that can print JSON.
JSON_FLAG, JSON_OPTIONS = "--json", {"type": bool, "nargs": "?", "const": True, "default": False}
# Extra spellings of field flags, as SPEC.md writes them.
FLAG_ALIASES = {"out_dir": ["--out"]}


class YamlConfig(ActionConfigFile):
    """``--config FILE``: jsonargparse's config file, refused in one line unless it is a YAML mapping
    within leantrain's bounds on size, nesting and aliases (docs/errors.md)."""

    def __call__(self, parser: Any, cfg: Any, values: Any, option_string: str | None = None) -> None:
        check_yaml_mapping(Path(values), "config")
        super().__call__(parser, cfg, values, option_string)


def check_yaml_mapping(path: Path, field: str) -> None:
    """ConfigError naming ``field`` unless ``path`` is a readable UTF-8 YAML file holding a mapping,
    within the bounds of :mod:`leantrain.bounded_read`."""
    data = load_yaml(path, field)
    if not isinstance(data, dict):
        found = "nothing" if data is None else f"a {type(data).__name__}"
        raise ConfigError(field, str(path), f"must hold a mapping of field: value lines, found {found}")


def _bounded_yaml_value(text: str, path: str = "") -> Any:
    """jsonargparse's YAML loader, behind leantrain's bounds: jsonargparse reads the ``--config`` file
    again after YamlConfig checked it (a file replaced in between is bounded too), and parses typed
    flag values (``--node-rank``) as YAML, where an alias bomb costs as much as in a file."""
    check_yaml(text, "config" if path else "value", str(path) if path else text)
    return get_loader("yaml")(text)


# The parser mode of every leantrain parser (subcommands take their parent's): jsonargparse passes a
# config file's path to a loader that accepts one, so the error names the file.
BOUNDED_YAML = "leantrain-yaml"
set_loader(BOUNDED_YAML, _bounded_yaml_value, (yaml.YAMLError,))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fit_parser(
    description: str = "Train a task. With no arguments: the built-in 'digits' example.",
) -> ArgumentParser:
    """The fit flags; ``plan`` and ``doctor`` take them too, and add their own."""
    parser = ArgumentParser(description=description, exit_on_error=False)
    parser.add_argument("--config", action=YamlConfig, help="YAML file of flags (keys as field names)")
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
        switch = {"nargs": "?", "const": True} if hints[field.name] is bool else {}  # --x means --x true
        groups[field.metadata["group"]].add_argument(
            flag(field.name),
            *FLAG_ALIASES.get(field.name, []),
            dest=field.name,
            default=field.default,
            metavar=metavar(hints[field.name]) if field.name != "strategy" else "{" + ",".join(names()) + "}",
            help=field.metadata["help"] if field.name != "strategy" else _strategy_help(),
            **switch,
        )
    return parser


def _strategy_help() -> str:
    lines = [f"{name}: {cls.summary}" for name, cls in strategies().items()]
    return "auto: ddp when launched as several processes, else single; " + "; ".join(lines)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="leantrain",
        description="A PyTorch training engine that tells you why.",
        exit_on_error=False,
        parser_mode=BOUNDED_YAML,
    )
    commands = parser.add_subcommands(dest="command")
    commands.add_subcommand("fit", _fit_parser(), help="train a task (default: the digits example)")
    commands.add_subcommand(
        "examples", ArgumentParser(exit_on_error=False), help="list the built-in example tasks"
    )
    commands.add_subcommand("launch", _launch_parser(), help="run fit as several processes (torchrun)")
    commands.add_subcommand("slurm", _slurm_parser(), help="submit fit as a SLURM job (sbatch)")
    commands.add_subcommand("export", _export_parser(), help="turn a checkpoint into safetensors weights")
    commands.add_subcommand(
        "plan", _plan_parser(), help="memory of a run per micro-batch size, without a GPU"
    )
    commands.add_subcommand(
        "cache", _cache_parser(), help="preprocess a task's data once into a memory-mapped cache"
    )
    commands.add_subcommand(
        "doctor", _doctor_parser(), help="measure where a run's time and memory go, and what to change"
    )
    return parser


def _doctor_parser() -> ArgumentParser:
    parser = _fit_parser(
        "Train a few steps with instruments: time per step by phase, MFU, memory by kind, host syncs "
        "and retained graphs in your code; then a verdict and advice ranked by payoff."
    )
    doctor = parser.add_argument_group("Doctor")
    doctor.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps (after the warm-up)")
    doctor.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP, help="steps run before timing")
    doctor.add_argument("--report", default=None, help="also write a self-contained HTML report here")
    doctor.add_argument(JSON_FLAG, **JSON_OPTIONS, help="print one JSON object instead of the report")
    doctor.add_argument(
        "--trace", default=None, help=f"also write a torch.profiler trace of {TRACED_STEPS} steps into DIR"
    )
    doctor.add_argument(
        "--try-compile",
        type=bool,
        nargs="?",
        const=True,
        default=True,
        help="a compute-bound eager run in one process is measured again with --compile; advised if faster",
    )
    return parser


def run_doctor_command(values: dict[str, Any], console: Console) -> Diagnosis:
    steps, warmup = values.pop("steps"), values.pop("warmup_steps")
    report, as_json, trace = values.pop("report"), values.pop("json"), values.pop("trace")
    try_compile = values.pop("try_compile")
    if steps < 1:
        raise ConfigError("steps", steps, "must be a positive integer")
    if warmup < 1:
        raise ConfigError("warmup_steps", warmup, "must be a positive integer (step 1 is never timed)")
    cfg = config_from_args(values)
    task, name = resolve_task(values.get("task"), values.get("example"))
    task_flags = f"--task {values['task']}" if values.get("task") else f"--example {name}"
    if as_json and cfg.progress == "auto":
        cfg = dataclasses.replace(cfg, progress="none")  # stdout carries the JSON alone
    from leantrain.diagnose.doctor import run_doctor
    from leantrain.diagnose.report import print_report, write_html

    diagnosis = run_doctor(task, cfg, steps, warmup, trace, name, task_flags, try_compile)
    if not detect().is_main:
        return diagnosis
    if as_json:
        print(json.dumps(diagnosis.as_dict()))
    else:
        print_report(diagnosis, Console(width=max(console.width, 110)))
    if report:
        written = write_html(diagnosis, report)
        if not as_json:
            console.print(f"report: {written}")
    return diagnosis


def _plan_parser() -> ArgumentParser:
    parser = _fit_parser(
        "Measure the memory of a run on a model built on the meta device (no memory, no accelerator): "
        "parameters, gradients, optimizer state and saved activations per micro-batch size."
    )
    plan = parser.add_argument_group("Plan")
    plan.add_argument(
        "--safety-margin",
        type=float,
        default=DEFAULT_MARGIN,
        help="share of the budget kept free (0.1: 10%%)",
    )
    plan.add_argument(JSON_FLAG, **JSON_OPTIONS, help="print one JSON object instead of a table")
    cluster = parser.add_argument_group("Cluster (simulated on fake tensors: no GPU, no memory)")
    cluster.add_argument(
        "--cluster",
        default=None,
        help="plan each GPU of this cluster: 8xH100, 2x8xH100 (nodes x GPUs x kind), 2x8x80GiB",
    )
    cluster.add_argument(
        "--search", **JSON_OPTIONS, help="with --cluster: try the layouts, list those that fit, fastest first"
    )
    cluster.add_argument(
        "--mfu", type=float | None, default=None, help="with --cluster: the compute efficiency assumed (0-1)"
    )
    return parser


def run_plan(values: dict[str, Any], console: Console) -> MemoryEstimate | None:
    margin, as_json = values.pop("safety_margin"), values.pop("json")
    cluster, search, mfu = values.pop("cluster"), values.pop("search"), values.pop("mfu")
    if not 0 <= margin < 1:
        raise ConfigError("safety_margin", margin, "must be at least 0 and below 1")
    cfg = config_from_args(values)
    if cluster is not None:
        run_cluster_plan(values, cfg, cluster, search, mfu, as_json, console)
        return None
    if search or mfu is not None:
        raise ConfigError("search" if search else "mfu", search or mfu, "plans a cluster: give --cluster too")
    if cfg.tp > 1:  # a table of the whole model would read as each rank's
        raise ConfigError(
            "tp", cfg.tp, "leantrain plan measures one process holding the whole model: plan each rank of a "
            "tensor-parallel layout with --cluster (e.g. --cluster 8xH100)",
        )  # fmt: skip
    budget = None if cfg.memory_budget is None else parse_bytes(cfg.memory_budget)
    task, _ = resolve_task(values.get("task"), values.get("example"))
    plan = estimate_memory(task, cfg, budget=budget, margin=margin)
    if as_json:
        print(json.dumps(plan.as_dict()))
    else:
        # Wider than the 80 columns rich assumes for a pipe: the table has eight or nine columns.
        Console(width=max(console.width, 110)).print(_plan_table(plan))
    return plan


def run_cluster_plan(
    values: dict[str, Any],
    cfg: TrainConfig,
    cluster_text: str,
    search: bool,
    mfu: float | None,
    as_json: bool,
    console: Console,
) -> None:
    """``plan --cluster``: rank 0 of the job simulated on fake tensors; with ``--search``, every layout."""
    # The simulation's modules import torch's fake tensors and tracers: only when asked for.
    from leantrain.simulate.cluster_plan import plan_cluster
    from leantrain.simulate.hardware import parse_cluster
    from leantrain.simulate.report import plan_notes, plan_table, search_table
    from leantrain.simulate.search import Tried
    from leantrain.simulate.search import search as search_layouts

    cluster = parse_cluster(cluster_text)
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError("mfu", mfu, "must be above 0 and at most 1")
    task, _ = resolve_task(values.get("task"), values.get("example"))
    wide = Console(width=max(console.width, 130))
    # The launch line names the job as given: its task and global batch; the layout's flags follow.
    example = values.get("example") or DEFAULT_EXAMPLE
    job = ["--task", values["task"]] if values.get("task") else ["--example", example]
    job += ["--global-batch-size", str(cfg.global_batch_size)]
    if not search:
        plan = plan_cluster(task, cfg, cluster, mfu)
        if as_json:
            print(
                json.dumps(
                    {**plan.as_dict(), "command": plan.command(job), "slurm_command": plan.slurm_command(job)}
                )
            )
            return
        wide.print(plan_table(plan))
        for line in plan_notes(plan, job):
            wide.print(escape(line), soft_wrap=True)
        return

    def progress(index: int, tried: Tried) -> None:  # on stderr: --json's stdout stays one object
        shown = tried.plan.layout.fit_flags() if tried.plan else [tried.reason or ""]
        print(f"layout {index}: {' '.join(shown)}", file=sys.stderr, flush=True)

    tried = search_layouts(task, cfg, cluster, mfu, progress)
    if as_json:
        print(json.dumps({"cluster": str(cluster), "layouts": [one.as_dict() for one in tried]}))
    else:
        wide.print(search_table(tried, job))


def _plan_table(plan: MemoryEstimate) -> Table:
    budget = "" if plan.budget is None else f", budget {format_bytes(plan.budget)} less {plan.margin:.0%}"
    table = Table(title=f"memory per step, precision {plan.precision}{budget}")
    kinds = list(plan.rows[0].memory.parts()) if plan.rows else []  # params, grads, ..., ema when kept
    for column in ("micro", "recompute", *kinds, "total", "fits"):
        table.add_column(column, justify="left" if column == "recompute" else "right", no_wrap=True)
    for row in plan.rows:
        m = row.memory
        sizes = [format_bytes(m.parts()[kind]) for kind in kinds]
        fits = "" if row.fits is None else "yes" if row.fits else "no"
        marker = " *" if row is plan.recommended else ""
        table.add_row(
            str(row.micro_batch_size), row.activation_checkpointing or "-", *sizes,
            format_bytes(m.total_bytes), fits + marker,
        )  # fmt: skip
    if plan.recommended is not None:
        table.caption = (
            f"* recommended: the largest micro-batch that fits; with recomputation when that fits one "
            f"{RECOMPUTE_PAYS}x larger"
        )
    elif plan.budget is not None:
        table.caption = "nothing fits: use 16-bit precision, or shard the model"
    return table


def _export_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Write a checkpoint's model weights as safetensors (tied weights once, under their first "
        "name), or as a transformers save_pretrained folder.",
        exit_on_error=False,
    )
    parser.add_argument("checkpoint", help="a checkpoint file (run folder/checkpoints/step-*.pt)")
    parser.add_argument(
        "out", help="the .safetensors file (or a folder: OUT/model.safetensors); transformers: a folder"
    )
    parser.add_argument(
        "--format",
        choices=["safetensors", "transformers"],
        default="safetensors",
        help="transformers: load the weights into the task's model and call its save_pretrained(OUT), "
        "so that from_pretrained(OUT) reads them back (needs --task or --example)",
    )
    parser.add_argument(
        "--weights",
        choices=["trained", "ema"],
        default="trained",
        help="ema: the moving average of the weights (a run with --ema-decay), as ema.safetensors holds it",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --format transformers, for an adapter (PEFT) checkpoint: the base with the adapter folded "
        "in, a model without peft; without it, the adapter in PEFT's format (PeftModel.from_pretrained)",
    )
    parser.add_argument("--task", default=None, help="the task whose model to fill, as 'pkg.module:Name'")
    parser.add_argument("--example", default=None, help=f"a built-in task: {', '.join(EXAMPLES)}")
    return parser


def run_export(values: dict[str, Any], console: Console) -> None:
    choose = averaged_weights if values["weights"] == "ema" else None
    if values["format"] == "safetensors":
        if values["merge"]:
            raise ConfigError("merge", True, "needs --format transformers (and the task that made the base)")
        write = functools.partial(export_checkpoint, choose=choose)
    else:
        if not (values["task"] or values["example"]):
            raise TaskError("export --format transformers needs --task or --example: the model to fill")
        task, _ = resolve_task(values["task"], values["example"])
        make_model = functools.partial(call_task, "task.model()", task.model)
        write = functools.partial(export_pretrained, make_model, choose=choose, merge=values["merge"])
    # Either may be a URL (object storage): read and written through a local copy.
    written = exported(str(values["checkpoint"]), str(values["out"]), write)
    console.print(f"wrote {written}")


def _cache_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Load every item of the task's train and val data once and store them, memory-mapped, "
        "in OUT/train and OUT/val; then `fit --cache OUT` reads them at memory speed.",
        exit_on_error=False,
    )
    parser.add_argument("--task", default=None, help="the task, as 'pkg.module:Name'")
    parser.add_argument("--example", default=None, help=f"a built-in task: {', '.join(EXAMPLES)}")
    parser.add_argument("--out", required=True, help="the cache folder")
    parser.add_argument(
        "--num-workers", default="auto", help="processes that load the items: N, or auto (the CPUs available)"
    )
    return parser


def run_cache(values: dict[str, Any], console: Console) -> None:
    task, _ = resolve_task(values.get("task"), values.get("example"))
    workers = coerce(values["num_workers"], int | typing.Literal["auto"])
    if workers == "auto":
        workers = auto_workers(processes_per_node=1)
    elif not isinstance(workers, int) or workers < 0:
        raise ConfigError("num_workers", values["num_workers"], "must be 0 or more, or auto")
    check_num_workers(workers)
    out = str(values["out"])
    if is_url(out):
        check_url(out, "out")
    check_folder(cache_root(out), "out", writable=False)
    for split in ("train", "val"):
        data_fn = getattr(task, f"{split}_data", None)
        dataset = data_fn() if callable(data_fn) else None
        if dataset is None:
            continue
        fetched = is_url(out) and fetch_split(out, split)
        folder = cache_root(out) / split
        cached, built = prepare_cache(dataset, folder, task_source(task, split), f"{split}_data", workers)
        if is_url(out) and built:
            publish_split(out, split)
        how = "already complete" + (", copied to this machine" if fetched else "")
        if built:
            how = f"built in {built['build_seconds']:.1f} s with {workers} worker(s)"
        where = f"{out}/{split} (local copy {folder})" if is_url(out) else str(folder)
        console.print(f"{where}: {len(cached):,} items, {cached.nbytes / 2**20:,.1f} MiB, {how}")


def _launch_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Start `fit` (or `doctor`) as several processes with torchrun's elastic launcher: "
        "leantrain launch --nproc-per-node 2 fit [fit flags]",
        exit_on_error=False,
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (one per GPU)")
    parser.add_argument("--nnodes", default="1", help="nodes in the run, or MIN:MAX for elastic membership")
    parser.add_argument(
        "--node-rank", type=int | None, default=None, help="this node's rank (static rendezvous)"
    )
    parser.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (node 0); multi-node"
    )
    parser.add_argument("--rdzv-id", default="leantrain", help="the run's id, the same on every node")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the group this often after a failure (use --resume auto)",
    )
    parser.add_argument("fit_arguments", nargs=argparse.REMAINDER, help="fit, then the fit flags")
    return parser


def _slurm_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Submit `fit` as a SLURM job: one task per node runs `leantrain launch`; "
        "near the time limit it checkpoints and requeues itself.",
        exit_on_error=False,
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes")
    parser.add_argument(
        "--gpus-per-node", type=int, default=1, help="GPUs (= processes) per node; 0: a CPU cluster"
    )
    parser.add_argument(
        "--procs-per-node",
        type=int | None,
        default=None,
        help="processes per node on CPUs (--gpus-per-node 0)",
    )
    parser.add_argument(
        "--cpus-per-task",
        type=int | None,
        default=None,
        help=f"CPUs of each node's task; null: {CPUS_PER_GPU} per GPU, or SLURM's default without GPUs",
    )
    parser.add_argument("--partition", default=None, help="SLURM partition")
    parser.add_argument("--time", default=None, help="time limit, e.g. 2:00:00")
    parser.add_argument("--job-name", default="leantrain", help="job name")
    parser.add_argument("--account", default=None, help="SLURM account to charge")
    parser.add_argument("--qos", default=None, help="SLURM quality of service")
    parser.add_argument("--constraint", default=None, help="node features required, e.g. a100")
    parser.add_argument(
        "--exclusive", type=bool, nargs="?", const=True, default=False, help="whole nodes, shared with no job"
    )
    parser.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        help="a further sbatch option, written as given (repeatable), e.g. --sbatch-arg=--mem=64G",
    )
    parser.add_argument(
        "--signal-seconds", type=int, default=120, help="checkpoint this long before the time limit"
    )
    parser.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node")
    parser.add_argument("--dry-run", type=bool, default=False, help="print the sbatch script, do not submit")
    parser.add_argument("fit_arguments", nargs=argparse.REMAINDER, help="fit, then the fit flags")
    return parser


def _fit_arguments(
    values: dict[str, Any],
    command: str,
    world_size: int | None,
    commands: tuple[str, ...] = ("fit",),
    processes_per_node: int | None = None,
) -> tuple[str, list[str]]:
    """The command (``fit``, or ``doctor`` where allowed) after ``launch ...`` and its flags,
    checked now: bad input fails before any process starts.

    ``world_size``, when known, also checks that the batch splits over that many processes;
    ``processes_per_node``, when they start here, that this machine can hold their workers and
    write their folders.
    """
    arguments = list(values.pop("fit_arguments"))
    if not arguments or arguments[0] not in commands:
        raise LeantrainError(
            f"{command} needs the command to run: leantrain {command} [options] {'|'.join(commands)} [flags]"
        )
    parsed = getattr(build_parser().parse_args(arguments), arguments[0]).as_dict()
    config = config_from_args(parsed)
    if world_size is not None:
        check_config(config, world_size)
    if processes_per_node is not None:  # the processes start on this machine: check what they need of it
        check_machine(config, Path(config.out_dir or "runs"), processes_per_node)
    return arguments[0], arguments[1:]


def config_from_args(values: dict[str, Any]) -> TrainConfig:
    """A validated TrainConfig from parsed flag values (text or YAML scalars), its strategy's rules
    checked too (those that need the number of processes are checked where it is known)."""
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name: coerce(values[f.name], hints[f.name]) for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**fields)
    check_config(config)
    return config


def resolve_task(task: str | None, example: str | None) -> tuple[Any, str]:
    """The task object and a short name for it (used in the default run folder)."""
    if task and example:
        raise TaskError("give either --task or --example, not both")
    if task:
        return load_task(task), task.rpartition(":")[2]
    name = example or DEFAULT_EXAMPLE
    return load_example(name), name


def run_fit(values: dict[str, Any], console: Console) -> FitResult:
    from leantrain.trainer import Trainer

    cfg = config_from_args(values)
    task, name = resolve_task(values.get("task"), values.get("example"))
    result = Trainer(cfg).fit(task, name=name)
    if detect().is_main:  # in a multi-process run, rank 0 speaks for all
        console.print(_summary_table(result))
    return result


def _summary_table(result: FitResult) -> Table:
    table = Table(
        title=escape(f"summary ({result.out_url or result.out_dir}/summary.json)"), show_header=False
    )
    for key, value in result.summary().items():
        table.add_row(key, _summary_text(value))
    return table


def _summary_text(value: object) -> str:
    """A summary.json value as the table shows it: booleans as JSON writes them (a bool is an int)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:,.4g}"
    return f"{value:,}" if isinstance(value, int) else escape(str(value))


def list_examples(console: Console) -> None:
    table = Table(title="built-in examples (leantrain fit --example NAME)")
    table.add_column("name")
    table.add_column("task")
    table.add_column("what it is")
    for name, (spec, description) in EXAMPLES.items():
        table.add_row(name + (" (default)" if name == DEFAULT_EXAMPLE else ""), spec, escape(description))
    console.print(table)


def main(argv: Sequence[str] | None = None) -> int:
    with _warnings_as_lines():
        return _main(argv)


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """leantrain's own warnings as one line each, as its errors are (``leantrain: warning: ...``),
    not Python's two lines with the file, the line number and the source line that raised them."""
    show = warnings.showwarning

    def shown(message: Warning | str, category: type[Warning], *where: Any, **options: Any) -> None:
        if not issubclass(category, LeantrainWarning):
            return show(message, category, *where, **options)
        file = options.get("file") or (where[2] if len(where) > 2 else None) or sys.stderr
        print(f"leantrain: warning: {message}", file=file, flush=True)

    warnings.showwarning = shown
    try:
        yield
    finally:
        warnings.showwarning = show


def _main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args = ["fit"]  # `leantrain` alone trains the default example
    console = Console()
    try:
        namespace = build_parser().parse_args(args)
        if namespace.command == "examples":
            list_examples(console)
        elif namespace.command == "launch":
            values = namespace.launch.as_dict()
            nodes = values["nnodes"]  # "N", or "MIN:MAX" for elastic membership (size unknown here)
            world = values["nproc_per_node"] * int(nodes) if str(nodes).isdigit() else None
            run, run_arguments = _fit_arguments(
                values, "launch", world, ("fit", "doctor"), values["nproc_per_node"]
            )
            from leantrain.launch.torchrun import LaunchOptions, launch

            return launch(LaunchOptions(**values), run_arguments, run)
        elif namespace.command == "slurm":
            values = namespace.slurm.as_dict()
            dry_run = values.pop("dry_run")
            fit_values = {"fit_arguments": values.pop("fit_arguments")}
            options = SlurmOptions(**{**values, "sbatch_arg": tuple(values["sbatch_arg"])})
            options.check()  # before the fit flags: the world size below needs valid options
            world = values["nodes"] * options.processes_per_node
            _, fit_arguments = _fit_arguments(fit_values, "slurm", world)
            script = sbatch_script(options, fit_arguments)
            if dry_run:
                print(script, end="")
            else:
                console.print(f"submitted SLURM job {submit(script, run_folder(fit_arguments))}")
        elif namespace.command == "plan":
            run_plan(namespace.plan.as_dict(), console)
        elif namespace.command == "cache":
            run_cache(namespace.cache.as_dict(), console)
        elif namespace.command == "doctor":
            run_doctor_command(namespace.doctor.as_dict(), console)
        elif namespace.command == "export":
            run_export(namespace.export.as_dict(), console)
        else:
            values = namespace.fit.as_dict()
            run_fit(values, console)
    except argparse.ArgumentError as error:
        return _fail(f"leantrain: error: {' '.join(str(error).split())}")
    except StorageError as error:
        return _fail(f"leantrain: error: {error}", code=EXIT_STORAGE)
    except LeantrainError as error:
        return _fail(f"leantrain: error: {error}")
    except RunInterrupted as stop:
        # 128 + signal number: the shell's convention for "ended by this signal".
        return _fail(f"leantrain: {stop}", code=128 + stop.signal_number)
    except KeyboardInterrupt:
        return _fail("leantrain: interrupted", code=130)
    except BrokenPipeError:
        # Standard output's reader went away (`leantrain fit | head`): stop as a pipe's writer does,
        # with the shell's code for SIGPIPE, and without Python's report of the failed flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _fail("leantrain: stopped: its standard output was closed (the reader ended)", code=128 + 13)
    return 0


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    # One line, whatever the value quoted in it holds (a path may contain a line break).
    print(message.replace("\r", "\\r").replace("\n", "\\n"), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
