"""TrainConfig: every setting of a run in one flat, typed, frozen dataclass.

Fields are grouped by concern (the ``group`` in each field's metadata drives the
sections of ``leantrain fit --help``). :meth:`TrainConfig.validate` checks the values
when the config is created and turns every bad one into a one-line
:class:`~leantrain.errors.ConfigError` naming the field, the value and what is allowed.
Rules that involve a strategy (its own fields, its precisions, how many processes it needs)
belong to the strategy: ``leantrain.strategies.registry.check_config`` applies them, before
any process starts (the CLI) and when ``Trainer.fit`` begins.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from leantrain.blocks import BlockPolicy
from leantrain.errors import ConfigError
from leantrain.remote import check_url, is_url
from leantrain.units import parse_bytes

Precision = Literal["32", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
NanPolicy = Literal["stop", "skip"]
SpikePolicy = Literal["off", "warn", "rollback"]
WorkerChoice = Literal["auto", "tune"]
Auto = Literal["auto"]
Never = Literal["never"]
LrScaling = Literal["none", "linear", "sqrt"]
LrSchedule = Literal["task", "constant", "linear", "cosine"]
PipelineSchedule = Literal["1f1b", "gpipe"]
ProgressMode = Literal["auto", "rich", "plain", "none"]
MetricMode = Literal["min", "max"]
CompileScope = Literal["none", "model", "blocks"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
LOGGERS = ("tensorboard", "mlflow", "wandb")

GROUPS = {
    "batch": "Batch and schedule: the global batch defines the math",
    "optimization": "Optimization",
    "precision": "Precision",
    "memory": "Memory",
    "compile": "Compilation (torch.compile)",
    "data": "Data loading",
    "parallel": "Devices and parallelism",
    "reproducibility": "Reproducibility",
    "logging": "Logging and outputs",
    "checkpointing": "Checkpoints and resume",
    "early stopping": "Early stopping",
    "averaging": "Weight averaging",
    "adapters": "Adapters (LoRA through peft)",
    "spikes": "Loss spikes and rollback",
}

# Epochs trained when neither max_steps nor max_epochs is given.
DEFAULT_EPOCHS = 10


def _field(default: Any, group: str, help: str) -> Any:
    # Runs only while TrainConfig is defined, at import: before `make mutate` switches a mutant on, so
    # out of its reach (tests/MUTATION.md). tests/test_config.py checks the defaults are valid and that
    # `fit --help` shows each field's help under its group's heading.
    return field(default=default, metadata={"group": group, "help": help})  # pragma: no mutate


@dataclass(frozen=True)
class TrainConfig:
    """The settings of one training run. See ``leantrain fit --help`` for each field."""

    # batch
    global_batch_size: int = _field(64, "batch", "samples per optimizer step, summed over all processes")
    micro_batch_size: int | Auto | None = _field(
        None,
        "batch",
        "samples per forward/backward; null: the whole per-process batch; auto: the largest that fits "
        "(searched at start, halved after an out-of-memory error; the global batch stays)",
    )
    max_steps: int | None = _field(None, "batch", "optimizer steps to train; the first limit reached stops")
    max_epochs: int | None = _field(
        None, "batch", f"passes over the training data; null: {DEFAULT_EPOCHS} when max_steps is null too"
    )
    shuffle: bool = _field(True, "batch", "shuffle the sample order each epoch, from (seed, epoch)")
    pack_length: int | None = _field(
        None,
        "batch",
        "pack the training (and validation) token documents, in each epoch's order, into rows of exactly "
        "N tokens that never attend across documents (position_ids, document_ids); a sample is then a "
        "row of N tokens; null: off",
    )
    # optimization
    max_grad_norm: float | None = _field(
        None, "optimization", "clip gradients to this total L2 norm; null: no clipping"
    )
    lr_scaling: LrScaling = _field(
        "none",
        "optimization",
        "scale the task's learning rates by global_batch_size / reference_batch_size (linear) or its "
        "square root (sqrt), for a global batch other than the one they were tuned for",
    )
    reference_batch_size: int | None = _field(
        None, "optimization", "the global batch the task's learning rates were tuned for (with lr_scaling)"
    )
    lr_schedule: LrSchedule = _field(
        "task",
        "optimization",
        "the learning-rate schedule over the run's optimizer steps: task (the task's scheduler, if it has "
        "one; else constant rates); constant, linear (to 0 at the last step) or cosine (half a cosine "
        "to 0), after lr_warmup_steps",
    )
    lr_warmup_steps: int | float = _field(
        0,
        "optimization",
        "with lr_schedule constant, linear or cosine: steps over which the learning rate rises linearly "
        "from 0 to the task's rates; an integer, or a fraction of the run's steps below 1 (0.1)",
    )
    lr_min_ratio: float = _field(
        0.0,
        "optimization",
        "with lr_schedule linear or cosine: decay to this fraction of the rates, not to 0",
    )
    # precision
    precision: Precision = _field(
        "32",
        "precision",
        "number format: -mixed runs matmuls in 16-bit under autocast; -true keeps the model in 16-bit "
        "with fp32 master weights; 16 (fp16) adds dynamic loss scaling",
    )
    on_nan: NanPolicy = _field(
        "stop",
        "precision",
        "a non-finite loss or gradient: stop (save the last good state, exit non-zero) or skip the step",
    )
    # spikes
    on_spike: SpikePolicy = _field(
        "warn",
        "spikes",
        "a training step whose loss stands out (above median + spike_threshold x spread of the last "
        "spike_window steps): off, warn, or rollback (go back to the newest snapshot in host memory, skip "
        "the global batches since, go on; non-finite steps too)",
    )
    spike_threshold: float = _field(
        6.0,
        "spikes",
        "how many spreads (the MAD x 1.4826 of the log losses, at least 0.01) above their median a spike is",
    )
    spike_window: int = _field(100, "spikes", "the steps whose losses make the baseline a spike is judged on")
    snapshot_every: int | None = _field(
        None,
        "spikes",
        "with on_spike rollback: copy the training state to host memory every N steps, a multiple of "
        "log_every_n_steps (default: 4 log points)",
    )
    max_rollbacks: int = _field(
        3,
        "spikes",
        "with on_spike rollback: stop the run (one line naming the spikes) at the next spike after N",
    )
    reduced_precision_reduction: bool = _field(
        False, "precision", "on CUDA, let 16-bit matmuls accumulate in 16-bit (faster, less exact)"
    )
    # memory
    activation_checkpointing: str | None = _field(
        None,
        "memory",
        "recompute these blocks' activations in backward instead of keeping them: module class names "
        "(Block), optionally every:N (every N-th of them) and first:N; no name: the model's repeated "
        "blocks; auto: the fewest of them that fit memory_budget; selective (alone or with the terms "
        "above, e.g. Block,selective): keep the blocks' matrix products' outputs, recompute the rest",
    )
    memory_budget: str | None = _field(
        None,
        "memory",
        "device memory the run may use (24GiB, 16GB): on CUDA a cap on the allocator; on CPU enforced "
        "by counting saved activations (a simulated out-of-memory error); needed by micro_batch_size "
        "auto on CPU",
    )
    # compile
    compile: CompileScope = _field(
        "none",
        "compile",
        "torch.compile: none; model (the whole model at once); blocks (each repeated block on its own: "
        "one compilation serves every block, so compile time does not grow with depth)",
    )
    compile_mode: CompileMode = _field(
        "default",
        "compile",
        "torch.compile's mode: default, reduce-overhead (CUDA graphs), max-autotune, "
        "max-autotune-no-cudagraphs",
    )
    # data
    num_workers: int | WorkerChoice = _field(
        0,
        "data",
        "DataLoader worker processes: N (0: load in the main process), auto (this process's share of the "
        "CPUs), or tune (measure a few counts on the first batches, keep the fastest)",
    )
    pin_memory: bool | None = _field(None, "data", "page-locked host batches; null: on with CUDA only")
    prefetch_factor: int | None = _field(
        None,
        "data",
        "batches each worker loads ahead (needs workers); null: 2, or 2 steps' worth with auto/tune",
    )
    cache: str | None = _field(
        None,
        "data",
        "folder of a memory-mapped cache of the task's data: built on first use (see `leantrain cache`), "
        "read at memory speed after",
    )
    # parallel
    device: str = _field("auto", "parallel", "auto (CUDA if present, else CPU), cpu, cuda, cuda:N or mps")
    strategy: str = _field(
        "auto",
        "parallel",
        "auto: ddp when launched as several processes, else single; or a strategy's name (see "
        "`leantrain fit --help`); its rules are checked by leantrain.strategies before the run starts",
    )
    device_map: str | None = _field(
        None,
        "parallel",
        "with split: the devices of the model's consecutive parts, e.g. cuda:0,cuda:1 (the repeated "
        "blocks divided evenly; inputs on the first device)",
    )
    pipeline_stages: int | None = _field(
        None,
        "parallel",
        "with pipeline: processes per pipeline (the model's stages); the processes launched divided by "
        "it run side by side as data-parallel pipelines (hybrid)",
    )
    pipeline_schedule: PipelineSchedule = _field(
        "1f1b", "parallel", "with pipeline: 1f1b (fewer activations alive) or gpipe (all forwards first)"
    )
    tp: int = _field(
        1,
        "parallel",
        "tensor-parallel degree: each planned layer's matrices split over this many consecutive ranks "
        "(the plan: task.tp_plan(model), a transformers model's own, or the example's); ddp or fsdp "
        "over the rest (--strategy fsdp --tp 2 on 4 processes is 2D); 1: off",
    )
    sequence_parallel: bool = _field(
        True,
        "parallel",
        "with --tp: between the plan's sequence_split and sequence_gather, each rank holds its share "
        "of the positions (norms and the activations between blocks split by sequence); false: whole",
    )
    loss_parallel: bool = _field(
        True,
        "parallel",
        "with --tp: the task's cross-entropy on the output layer's logits split by vocabulary (none "
        "gathered), where the first micro-batch's loss agrees with the gathered logits'; false: gathered",
    )
    shard_blocks: str | None = _field(
        None,
        "parallel",
        "with fsdp, the module class names sharded as units (each gathered only while it runs); null: "
        "the model's repeated blocks",
    )
    sync_batchnorm: bool = _field(
        False,
        "parallel",
        "with ddp or fsdp on CUDA: convert the model's BatchNorm layers to SyncBatchNorm, which normalise "
        "over every process's micro-batch together (accumulation still splits them); not on CPU",
    )
    # reproducibility
    seed: int = _field(0, "reproducibility", "seeds Python, NumPy, torch and the sample order")
    deterministic: bool = _field(False, "reproducibility", "use only deterministic kernels (slower)")
    # logging
    out_dir: str | None = _field(
        None, "logging", "run folder, or a URL (s3://bucket/run, gs://, az://: see docs/checkpointing.md); "
        "null: runs/<task>-<time>",
    )  # fmt: skip
    staging_dir: str | None = _field(
        None, "logging", "with out_dir a URL: the local folder the run writes before uploading; null: "
        "~/.cache/leantrain/staging/<name>-<hash>",
    )  # fmt: skip
    log_every_n_steps: int = _field(50, "logging", "read metrics from the device every N steps")
    val_every_n_steps: int | None = _field(None, "logging", "validate every N steps; null: once, at the end")
    progress: ProgressMode = _field(
        "auto", "logging", "auto: a live bar on a terminal, plain lines otherwise"
    )
    logger: str = _field(
        "tensorboard",
        "logging",
        "where metrics go besides metrics.csv (always written), comma-separated: tensorboard (event files "
        "in the run folder), mlflow, wandb; none: metrics.csv only",
    )
    mlflow_uri: str | None = _field(
        None,
        "logging",
        "with logger mlflow: the tracking URI (a server, sqlite:///x.db, a folder); null: "
        "MLFLOW_TRACKING_URI, else the sqlite file mlflow.db in the run folder",
    )
    wandb_project: str | None = _field(
        None,
        "logging",
        "with logger wandb: the W&B project; null: WANDB_PROJECT, else leantrain (WANDB_MODE, WANDB_DIR "
        "and the other WANDB_* variables are honoured)",
    )
    tracker_timeout: float = _field(
        30.0,
        "logging",
        "with logger mlflow or wandb: seconds a tracker may take to answer; one still silent after that "
        "is switched off with a warning (training never waits for it), and the end of the run waits "
        "at most this long for its last rows and summary (metrics.csv has every value)",
    )
    tracker_required: bool = _field(
        False,
        "logging",
        "with logger mlflow or wandb: stop before training (one line, exit 2) when a tracker cannot be "
        "reached within tracker_timeout; false: train anyway, with a warning",
    )
    hang_timeout: float = _field(
        1800.0,
        "parallel",
        "end the run (exit code 75) when it makes no progress for this many seconds, naming the "
        "rank that did not arrive and where it is stuck; 0: never",
    )
    # checkpointing
    checkpoint_every: int | Never | None = _field(
        None,
        "checkpointing",
        "save a checkpoint every N steps; null: only at the end and on SIGTERM/SIGUSR1; never: no "
        "checkpoint at all (nothing to resume from)",
    )
    keep_checkpoints: int = _field(3, "checkpointing", "keep the newest K checkpoints of the run")
    async_checkpoint: bool = _field(
        True,
        "checkpointing",
        "write checkpoints on a thread while training goes on (the loop only copies the state to host "
        "memory, which holds that copy meanwhile); false: the loop waits for each write",
    )
    resume: str | None = _field(
        None, "checkpointing", "auto: the newest valid checkpoint in out_dir, else start fresh; or a file "
        "(a path or a URL)",
    )  # fmt: skip
    keep_best: int = _field(
        0,
        "checkpointing",
        "also keep the K checkpoints with the best best_metric (validations at val_every_n_steps), and "
        "the best weights as best.safetensors; 0: none",
    )
    best_metric: str | None = _field(
        None, "checkpointing", "with keep_best: a validation metric, e.g. val_loss"
    )
    best_mode: MetricMode = _field("min", "checkpointing", "with keep_best: min (lower is better) or max")
    # early stopping
    early_stop_metric: str | None = _field(
        None,
        "early stopping",
        "stop when this validation metric (e.g. val_loss) stops improving; needs val_every_n_steps",
    )
    early_stop_mode: MetricMode = _field("min", "early stopping", "min (lower is better) or max")
    early_stop_patience: int = _field(
        3, "early stopping", "validations in a row without improvement before the run stops"
    )
    early_stop_min_delta: float = _field(
        0.0, "early stopping", "an improvement smaller than this does not count"
    )
    # weight averaging
    ema_decay: float | None = _field(
        None,
        "averaging",
        "keep an exponential moving average of the weights, e = D*e + (1-D)*w after every optimizer "
        "step from e = the initial weights, written as ema.safetensors; e.g. 0.999; null: none",
    )
    ema_validate: bool = _field(
        False, "averaging", "with ema_decay: validate the averaged weights instead of the trained ones"
    )
    # adapters
    lora_rank: int | None = _field(
        None,
        "adapters",
        "train LoRA adapters of this rank on the task's model (peft): the model is frozen, and only the "
        "adapters train and are kept in checkpoints; null: train the model (or the task's own adapter)",
    )
    lora_targets: str | None = _field(
        None,
        "adapters",
        "with lora_rank: the modules that get adapters, as comma-separated names (q_proj,v_proj: every "
        "module whose name ends so) or all-linear; null: all-linear",
    )
    lora_alpha: float | None = _field(
        None, "adapters", "with lora_rank: the adapters' scale is lora_alpha / lora_rank; null: 2 x lora_rank"
    )
    lora_dropout: float = _field(0.0, "adapters", "with lora_rank: dropout on the adapters' inputs")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, world_size: int = 1) -> None:
        """Raise :class:`ConfigError` for the first invalid value (world size: data-parallel ranks)."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _matches(value, hints[f.name]):
                raise ConfigError(f.name, value, f"must be {describe_type(hints[f.name])}")
        for name, (check, allowed) in _VALUE_RULES.items():
            value = getattr(self, name)
            if value is not None and not check(value):
                raise ConfigError(name, value, allowed)
        self._validate_batch(world_size)
        if self.memory_budget is not None and not parse_bytes(self.memory_budget):
            raise ConfigError(
                "memory_budget", self.memory_budget, "must be a size such as 24GiB, 16GB or 512MiB"
            )
        if (self.lr_scaling == "none") != (self.reference_batch_size is None):
            raise ConfigError(
                "reference_batch_size",
                self.reference_batch_size,
                "is needed with lr_scaling linear or sqrt, and only with them",
            )
        self._validate_schedule()
        if self.activation_checkpointing is not None:
            BlockPolicy.parse(self.activation_checkpointing)  # raises a ConfigError naming the field
        if self.activation_checkpointing == "auto" and (
            self.memory_budget is None or self.micro_batch_size == "auto"
        ):
            raise ConfigError(
                "activation_checkpointing",
                "auto",
                "needs memory_budget, and a micro_batch_size that is not auto (one of the two adapts)",
            )
        if self.compile_mode != "default" and self.compile == "none":
            raise ConfigError("compile_mode", self.compile_mode, "needs compile model or blocks")
        if self.cache is not None and not self.cache.strip():
            raise ConfigError("cache", self.cache, "must be a folder path")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ConfigError("prefetch_factor", self.prefetch_factor, "needs num_workers > 0")
        if self.resume == "auto" and self.out_dir is None:
            raise ConfigError("resume", self.resume, "needs out_dir: the run folder to resume")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ConfigError("device", self.device, "allowed: auto, cpu, cuda, cuda:N, mps")
        self._validate_storage()
        self._validate_watching()
        self._validate_adapters()
        self._validate_spikes()

    def _validate_spikes(self) -> None:
        """Snapshots are taken at log points, where the steps before them have been judged."""
        if self.snapshot_every is None:
            return
        if self.on_spike != "rollback":
            raise ConfigError("snapshot_every", self.snapshot_every, "needs on_spike rollback")
        if self.snapshot_every % self.log_every_n_steps:
            raise ConfigError(
                "snapshot_every",
                self.snapshot_every,
                f"must be a multiple of log_every_n_steps ({self.log_every_n_steps}): the steps before a "
                "snapshot are judged at a log point",
            )

    @property
    def snapshot_steps(self) -> int:
        """Steps between two rollback snapshots (``snapshot_every``, else every 4 log points)."""
        return self.snapshot_every or 4 * self.log_every_n_steps

    def _validate_schedule(self) -> None:
        """The warmup and the floor belong to a built-in schedule (a task's scheduler has its own)."""
        if self.lr_warmup_steps and self.lr_schedule == "task":
            raise ConfigError(
                "lr_warmup_steps", self.lr_warmup_steps, "needs lr_schedule constant, linear or cosine"
            )
        if self.lr_min_ratio and self.lr_schedule not in ("linear", "cosine"):
            raise ConfigError("lr_min_ratio", self.lr_min_ratio, "needs lr_schedule linear or cosine")

    def _validate_adapters(self) -> None:
        """The adapter's settings belong to ``lora_rank``."""
        if self.lora_rank is not None:
            return
        for name, unset in (("lora_targets", None), ("lora_alpha", None), ("lora_dropout", 0.0)):
            if (value := getattr(self, name)) != unset:
                raise ConfigError(name, value, "needs lora_rank (the adapters' rank)")

    def _validate_storage(self) -> None:
        """URLs (object storage): a scheme this machine can serve; the staging folder only with one."""
        for name in ("out_dir", "resume", "cache"):
            if is_url(value := getattr(self, name)):
                check_url(value, name)
        if self.staging_dir is not None and not is_url(self.out_dir):
            raise ConfigError(
                "staging_dir", self.staging_dir, "needs out_dir to be a URL (s3://..., gs://...)"
            )

    def _validate_watching(self) -> None:
        """Trackers, best checkpoints and early stopping: options that only work together."""
        for name, value, needs in (
            ("mlflow_uri", self.mlflow_uri, "mlflow"),
            ("wandb_project", self.wandb_project, "wandb"),
        ):
            if value is not None and needs not in self.loggers:
                raise ConfigError(name, value, f"needs logger {needs}")
        if self.tracker_required and not {"mlflow", "wandb"} & set(self.loggers):
            raise ConfigError("tracker_required", True, "needs logger mlflow or wandb")
        watched = {"best_metric": self.best_metric, "early_stop_metric": self.early_stop_metric}
        for name, metric in watched.items():
            if metric is not None and not metric.startswith("val_"):
                raise ConfigError(name, metric, "must be a validation metric: val_loss or val_<task metric>")
        if (self.keep_best > 0) != (self.best_metric is not None):
            raise ConfigError("best_metric", self.best_metric, "is needed with keep_best > 0, and only then")
        if self.keep_best and not self.saves_checkpoints:
            raise ConfigError("keep_best", self.keep_best, "needs checkpoints (checkpoint_every is never)")
        if self.ema_validate and self.ema_decay is None:
            raise ConfigError(
                "ema_validate", self.ema_validate, "needs ema_decay: there is no average to validate"
            )
        if self.early_stop_metric is not None and self.val_every_n_steps is None:
            raise ConfigError(
                "early_stop_metric",
                self.early_stop_metric,
                "needs val_every_n_steps: without it the run validates once, at the end",
            )

    @property
    def compile_options(self) -> dict[str, str]:
        """torch.compile's keyword arguments for ``compile_mode``."""
        return {} if self.compile_mode == "default" else {"mode": self.compile_mode}

    @property
    def loggers(self) -> list[str]:
        """The trackers besides metrics.csv, in the order given."""
        return [] if self.logger == "none" else list(dict.fromkeys(self.logger.split(",")))

    def _validate_batch(self, world_size: int) -> None:
        per_rank, rest = divmod(self.global_batch_size, world_size)
        if rest:
            raise ConfigError(
                "global_batch_size",
                self.global_batch_size,
                f"must be a multiple of the world size {world_size}",
            )
        micro = self.micro_batch_size
        if isinstance(micro, int) and per_rank % micro:
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            raise ConfigError(
                "micro_batch_size",
                micro,
                f"must divide the per-process batch {per_rank} (global_batch_size {self.global_batch_size}"
                f" / world size {world_size}); allowed: {', '.join(map(str, divisors))}",
            )

    @property
    def epoch_limit(self) -> int | None:
        """The epoch limit in force: max_epochs, or the default when no limit is set at all."""
        if self.max_epochs is None and self.max_steps is None:
            return DEFAULT_EPOCHS
        return self.max_epochs

    @property
    def saves_checkpoints(self) -> bool:
        return self.checkpoint_every != "never"

    def checkpoint_due(self, done: int, total_steps: int) -> bool:
        """Whether a checkpoint is written after optimizer step ``done`` (1-based)."""
        if self.checkpoint_every == "never":
            return False
        every = self.checkpoint_every
        return done == total_steps or (every is not None and done % every == 0)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(value: int | float) -> bool:
    return value > 0


# Value checks beyond the type, for fields whose value is not None.
_VALUE_RULES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "global_batch_size": (_positive, "must be a positive integer"),
    "micro_batch_size": (lambda v: v == "auto" or v > 0, "must be a positive integer, auto or null"),
    "reference_batch_size": (_positive, "must be a positive integer"),
    "pack_length": (_positive, "must be a positive number of tokens"),
    "pipeline_stages": (lambda v: v >= 2, "must be 2 or more"),
    "tp": (lambda v: 1 <= v <= 1024, "must be 1 (off) or a number of processes up to 1024"),
    "lr_warmup_steps": (
        lambda v: v >= 0 and (isinstance(v, int) or v < 1),
        "must be a number of steps (0 or more) or a fraction of the run's steps below 1 (0.1)",
    ),
    "lr_min_ratio": (lambda v: 0 <= v < 1, "must be 0 or more and below 1"),
    "max_steps": (_positive, "must be a positive integer"),
    "max_epochs": (_positive, "must be a positive integer"),
    "max_grad_norm": (lambda v: 0 < v < math.inf, "must be a positive finite number (null: no clipping)"),
    "num_workers": (lambda v: isinstance(v, str) or v >= 0, "must be 0 or more, auto or tune"),
    "prefetch_factor": (_positive, "must be a positive integer"),
    "seed": (lambda v: 0 <= v < 2**63, "must be between 0 and 2**63 - 1"),
    "log_every_n_steps": (_positive, "must be a positive integer"),
    "val_every_n_steps": (_positive, "must be a positive integer"),
    "checkpoint_every": (lambda v: v == "never" or v > 0, "must be a positive integer, never or null"),
    "keep_checkpoints": (_positive, "must be a positive integer"),
    "resume": (lambda v: bool(v.strip()), "must be auto or the path of a checkpoint file"),
    "keep_best": (lambda v: v >= 0, "must be 0 or more"),
    "early_stop_patience": (_positive, "must be a positive integer"),
    "early_stop_min_delta": (lambda v: 0 <= v < math.inf, "must be 0 or a positive finite number"),
    "hang_timeout": (lambda v: 0 <= v < math.inf, "must be 0 (off) or a positive number of seconds"),
    "tracker_timeout": (lambda v: 0 < v < math.inf, "must be a positive number of seconds"),
    "ema_decay": (lambda v: 0 < v < 1, "must be between 0 and 1 (exclusive), e.g. 0.999"),
    "spike_threshold": (lambda v: 0 < v < math.inf, "must be a positive finite number"),
    "spike_window": (lambda v: v >= 20, "must be 20 or more (steps: a spike is judged against a median)"),
    "snapshot_every": (_positive, "must be a positive integer"),
    "max_rollbacks": (lambda v: v >= 0, "must be 0 or more"),
    "lora_rank": (_positive, "must be a positive integer"),
    "lora_targets": (
        lambda v: re.fullmatch(r"[\w.\-]+(,[\w.\-]+)*", v) is not None,
        "must be comma-separated module names (q_proj,v_proj) or all-linear",
    ),
    "lora_alpha": (lambda v: 0 < v < math.inf, "must be a positive number"),
    "lora_dropout": (lambda v: 0 <= v < 1, "must be 0 or more and below 1"),
    "logger": (
        lambda v: v == "none" or (bool(v) and set(v.split(",")) <= set(LOGGERS)),
        f"must be none or a comma-separated list of {', '.join(LOGGERS)}",
    ),
}


def _union_args(annotation: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return None


def _matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is of the (simple) annotated type; bool never passes for int."""
    options = _union_args(annotation)
    if options is not None:
        return any(_matches(value, option) for option in options)
    if typing.get_origin(annotation) is Literal:
        return value in typing.get_args(annotation) and not isinstance(value, bool)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, annotation)


def describe_type(annotation: Any) -> str:
    """Human words for an annotation: ``int | None`` -> "an integer or null"."""
    options = _union_args(annotation)
    if options is not None:
        parts = [describe_type(option) for option in options]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        return str(values[0]) if len(values) == 1 else "one of " + ", ".join(str(v) for v in values)
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return "null" if annotation is type(None) else words.get(annotation, annotation.__name__)


def metavar(annotation: Any) -> str:
    """A short placeholder for --help: ``INT|null``, ``{32,bf16-mixed}``, ``BOOL``."""
    options = _union_args(annotation)
    if options is not None:
        return "|".join(metavar(option) for option in options)
    if typing.get_origin(annotation) is Literal:
        return "{" + ",".join(str(v) for v in typing.get_args(annotation)) + "}"
    names = {int: "INT", float: "NUM", bool: "BOOL", str: "STR"}
    return "null" if annotation is type(None) else names.get(annotation, annotation.__name__.upper())


def coerce(raw: Any, annotation: Any) -> Any:
    """Best-effort conversion of a command-line or YAML value to the annotated type.

    Returns the value unchanged when it cannot be converted, so that ``validate()`` is
    the one place that reports bad values, with the same message for the CLI, YAML and
    Python.
    """
    if not isinstance(raw, str):
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            literal = _literal_text(annotation, str(raw))
            if literal is not None:  # precision: 32 in YAML, "32" in the Literal
                return literal
        return raw
    text = raw.strip()
    options = _union_args(annotation) or (annotation,)
    if type(None) in options and text.lower() in ("none", "null", ""):
        return None
    for option in options:
        converted = _convert_scalar(text, option)
        if converted is not None:
            return converted
    return raw


def _literal_text(annotation: Any, text: str) -> str | None:
    options = _union_args(annotation) or (annotation,)
    for option in options:
        if typing.get_origin(option) is Literal and text in typing.get_args(option):
            return text
    return None


def _convert_scalar(text: str, option: Any) -> Any:
    if typing.get_origin(option) is Literal:
        return text if text in typing.get_args(option) else None
    if option is bool:
        return {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}.get(
            text.lower()
        )
    if option is int:
        return int(text) if re.fullmatch(r"[+-]?\d+", text) else None
    if option is float:
        try:
            return float(text)
        except ValueError:
            return None
    if option is str:
        return text
    return None
