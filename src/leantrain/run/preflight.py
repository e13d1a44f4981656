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
from leantrain.data.remote_cache import cache_root
from leantrain.data.workers import auto_workers
from leantrain.errors import LeantrainError
from leantrain.files import check_folder
from leantrain.remote import is_url
from leantrain.run.mirror import RunMirror


def check_machine(
    cfg: TrainConfig, run_dir: Path, processes_per_node: int = 1, mirror: RunMirror | None = None
) -> None:
    """ConfigError or CheckpointError for the first thing this machine cannot give the run.
    ``mirror``: the run folder is at a URL (``run_dir`` its staging folder)."""
    check_num_workers(cfg.num_workers, processes_per_node)
    workers = cfg.num_workers if isinstance(cfg.num_workers, int) else auto_workers(processes_per_node)
    check_prefetch(cfg.prefetch_factor, workers)  # counts no memory could hold; the loader checks sizes
    check_folder(run_dir, "out_dir")
    if cfg.resume is None:  # nothing is overwritten: a finished or interrupted run is continued, or left
        if mirror is not None:
            held = mirror.held_markers()
            _check_not_a_run(mirror.url, held, "checkpoints" in held)
        else:
            _check_not_a_run(str(run_dir), *_markers(run_dir))
    if cfg.cache is not None:  # a URL's cache is copied to this machine: its local copy is checked
        check_folder(cache_root(cfg.cache), "cache", writable=False)  # a finished cache is only read
    if cfg.resume not in (None, "auto") and not is_url(cfg.resume):
        check_checkpoint_file(Path(cfg.resume))


def _markers(run_dir: Path) -> tuple[list[str], bool]:
    """What in ``run_dir`` says it holds a run; whether a checkpoint is among it."""
    held = [
        marker for marker in ("metrics.csv", "summary.json", "checkpoints") if (run_dir / marker).exists()
    ]
    return held, bool(held) and bool(CheckpointFolder(run_dir / "checkpoints", keep=1).files())


def _check_not_a_run(run_dir: str, held: list[str], checkpointed: bool) -> None:
    """A LeantrainError when ``run_dir`` holds a run (``held``, ``checkpointed``: the markers found
    there): what to type to continue it, or start it again."""
    if not held:
        return
    if "summary.json" in held or checkpointed:
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
