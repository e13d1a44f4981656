"""What a run needs of this machine, checked before the model is built and before any process starts.

The config's own rules (``TrainConfig.validate``, the strategy's ``check_config``) hold anywhere;
these depend on where the run starts: how many workers its CPUs and memory can hold, and whether
its folders and files are there and writable. A SLURM job is checked where it runs, not where it
is submitted. Each problem is one line naming the field.
"""

from __future__ import annotations

from pathlib import Path

from leantrain.checkpoint import CheckpointFolder, check_checkpoint_file
from leantrain.config import TrainConfig
from leantrain.data.limits import check_num_workers, check_prefetch
from leantrain.data.workers import auto_workers
from leantrain.errors import LeantrainError
from leantrain.files import check_folder


def check_machine(cfg: TrainConfig, run_dir: Path, processes_per_node: int = 1) -> None:
    """ConfigError or CheckpointError for the first thing this machine cannot give the run."""
    check_num_workers(cfg.num_workers, processes_per_node)
    workers = cfg.num_workers if isinstance(cfg.num_workers, int) else auto_workers(processes_per_node)
    check_prefetch(cfg.prefetch_factor, workers)  # counts no memory could hold; the loader checks sizes
    check_folder(run_dir, "out_dir")
    if cfg.resume is None:  # nothing is overwritten: a finished or interrupted run is continued, or left
        _check_not_a_run(run_dir)
    if cfg.cache is not None:
        check_folder(cfg.cache, "cache", writable=False)  # a finished cache is only read
    if cfg.resume not in (None, "auto"):
        check_checkpoint_file(Path(cfg.resume))


def _check_not_a_run(run_dir: Path) -> None:
    """A LeantrainError when ``run_dir`` holds a run: what to type to continue it, or start it again."""
    held = [
        marker for marker in ("metrics.csv", "summary.json", "checkpoints") if (run_dir / marker).exists()
    ]
    if not held:
        return
    if "summary.json" in held or CheckpointFolder(run_dir / "checkpoints", keep=1).files():
        raise LeantrainError(
            f"out_dir {run_dir} already holds a run ({held[0]}); continue it with --resume auto "
            "or choose another out_dir"
        )
    # A run that died before its first checkpoint (a task error, Ctrl-C): only its log is there.
    raise LeantrainError(
        f"out_dir {run_dir} holds a run that ended before its first checkpoint ({', '.join(held)}): "
        "nothing of it can be continued; add --resume auto to start it again there (its log is "
        "replaced), or choose another out_dir"
    )
