"""From the task's datasets to the run's loaders: cache, sizes, worker count, sharding.

The run (``run/loop.py`` and ``run/builders.py``) calls these in order: :func:`load_train_data`
(the cache, if asked for, and the epoch length), then, once the resume step is known,
:func:`build_train_loader` and :func:`build_val_loader` (with the count of validation forwards
every rank runs: see ``step/evaluation.py``). Every decision taken here is returned as a note
for the run log.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from leantrain.cluster import ClusterEnv
from leantrain.config import TrainConfig
from leantrain.data.cache import MANIFEST, CacheError, prepare_cache, task_source
from leantrain.data.hf import torch_rows
from leantrain.data.limits import check_prefetch, item_bytes
from leantrain.data.loader import build_loader, check_map_style, collate
from leantrain.data.mixture import Mixture
from leantrain.data.packing import PackedDocuments, PackedRowSampler
from leantrain.data.remote_cache import cache_root, fetch_split, publish_split
from leantrain.data.sampler import GlobalBatchSampler
from leantrain.data.shard import DataPosition, GlobalBatchShard, MarkedLoader, StreamPlan
from leantrain.data.stream import RankShard, StreamReader, check_stream_steps, stream_length
from leantrain.data.workers import (
    auto_prefetch,
    auto_workers,
    available_cpus,
    tune_candidates,
    tune_workers,
)
from leantrain.errors import ConfigError, TaskError
from leantrain.remote import is_url
from leantrain.step.batching import BatchSplit
from leantrain.task import call_task


@dataclass
class TrainData:
    dataset: Dataset | IterableDataset
    size: int | None  # samples per epoch; None for a stream without __len__
    notes: list[str] = field(default_factory=list)

    @property
    def is_stream(self) -> bool:
        return isinstance(self.dataset, IterableDataset)


def _cached(
    dataset: Any, task: Any, split: str, cfg: TrainConfig, env: ClusterEnv, notes: list[str]
) -> Dataset:
    """``dataset`` served from ``cfg.cache/split``; rank 0 builds it first when missing."""
    assert cfg.cache is not None
    if isinstance(dataset, IterableDataset):
        raise CacheError(
            f"cache {cfg.cache}: {split} data is an IterableDataset; a cache needs a map-style dataset"
        )
    folder = cache_root(cfg.cache) / split
    workers = cfg.num_workers if isinstance(cfg.num_workers, int) else auto_workers(env.local_world_size)
    remote = is_url(cfg.cache)
    if env.is_main:
        fetched = remote and fetch_split(cfg.cache, split)
        cached, built = prepare_cache(dataset, folder, task_source(task, split), f"{split}_data", workers)
        if remote and built:
            publish_split(cfg.cache, split)
        verb = f"built in {built['build_seconds']:.1f} s" if built else "fetched" if fetched else "read"
        notes.append(
            f"cache {folder}: {len(cached):,} {split} items, {cached.nbytes / 2**20:,.1f} MiB, {verb}"
        )
    if env.distributed:
        dist.barrier()  # the others open it once rank 0 has finished it
    if not env.is_main:
        if remote and not (folder / MANIFEST).is_file():  # another machine than rank 0's
            fetch_split(cfg.cache, split)
        cached, _ = prepare_cache(
            dataset, folder, task_source(task, split), f"{split}_data", workers, build=False
        )
    return cached


def load_train_data(task: Any, cfg: TrainConfig, env: ClusterEnv) -> TrainData:
    notes: list[str] = []
    dataset = torch_rows(call_task("task.train_data()", task.train_data), "train_data")
    if cfg.cache is not None:
        dataset = _cached(dataset, task, "train", cfg, env, notes)
    dataset = _packed(dataset, cfg, "train_data", cfg.shuffle, notes)
    if isinstance(dataset, Mixture) and cfg.max_steps is None:
        raise TaskError(
            "train_data is a Mixture: set max_steps (a mixture has no epochs; its sources have theirs)"
        )
    if isinstance(dataset, IterableDataset):
        check_stream_steps(dataset, "train_data", cfg.max_steps)
        size = stream_length(dataset)
        if size is None and cfg.max_epochs is not None:
            raise TaskError(
                "train_data is an IterableDataset without __len__: max_epochs needs a known length"
            )
        return TrainData(dataset, size, notes)
    return TrainData(dataset, check_map_style(dataset, "train_data"), notes)


def _packed(dataset: Any, cfg: TrainConfig, name: str, shuffle: bool, notes: list[str]) -> Any:
    """``dataset``'s token documents packed into rows of ``cfg.pack_length`` (see ``packing.py``)."""
    if cfg.pack_length is None:
        return dataset
    if isinstance(dataset, Mixture):  # rows packed within each source: a row's N tokens are one source's
        return dataset.mapped(
            lambda source, data: _packed(data, cfg, f"{name} source {source!r}", shuffle, notes)
        )
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            "pack_length", cfg.pack_length, f"packs map-style data; {name} is an IterableDataset"
        )
    packed = PackedDocuments(dataset, cfg.pack_length, cfg.seed, shuffle, name)
    notes.append(packed.note())
    return packed


def _workers(
    cfg: TrainConfig,
    env: ClusterEnv,
    batch_split: BatchSplit,
    data: TrainData,
    sampler: GlobalBatchSampler | None,
) -> tuple[int, int | None]:
    """(workers, prefetch factor) for the config's num_workers: a number, auto or tune."""
    choice = cfg.num_workers
    if isinstance(choice, int):
        return choice, cfg.prefetch_factor
    cpus = available_cpus()
    workers = auto_workers(env.local_world_size, cpus)
    if choice == "auto" and cfg.cache is not None:
        # Measured (benchmarks/results/data.md): from the cache an item costs microseconds, and
        # handing batches over from worker processes costs more than loading them in place.
        data.notes.append("num_workers auto: 0 with the cache (items load at memory speed)")
        return 0, cfg.prefetch_factor
    if choice == "tune" and data.is_stream:
        data.notes.append(f"num_workers tune measures map-style data only; auto chose {workers}")
    elif choice == "tune" and sampler is not None:
        batches = list(itertools.islice(iter(sampler), 64))

        def trial_loader(count: int, micro_batches: list[list[int]]) -> DataLoader:
            prefetch = auto_prefetch(count, batch_split.accumulation_steps) if count else None
            return build_loader(data.dataset, "train_data", batch_sampler=micro_batches, num_workers=count,
                                prefetch_factor=prefetch, seed=cfg.seed)  # fmt: skip

        result = tune_workers(trial_loader, batches, tune_candidates(cpus, env.local_world_size))
        if result is None:
            data.notes.append(
                f"num_workers tune: too few micro-batches in this run to measure; auto chose {workers}"
            )
        else:
            workers = result.workers
            data.notes.append(result.report())
    else:
        data.notes.append(f"num_workers auto: {workers} ({cpus} CPUs for {env.local_world_size} process(es))")
    prefetch = cfg.prefetch_factor or (
        auto_prefetch(workers, batch_split.accumulation_steps) if workers else None
    )
    return workers, prefetch


def build_train_loader(
    data: TrainData,
    cfg: TrainConfig,
    env: ClusterEnv,
    batch_split: BatchSplit,
    total_steps: int,
    start_step: int,
    pin_memory: bool,
    saved: dict[str, Any] | None = None,
    tokens: list[int] | None = None,
) -> tuple[DataLoader, int, int | None]:
    """The training loader from ``start_step`` on; returns (loader, workers, prefetch factor).

    For a stream or a mixture: ``saved`` is the data position a checkpoint holds (``DataPart``'s
    ``checkpoint_state``), used where it is at ``start_step``; ``tokens``: the tokens this process
    counts from (default: the saved ones on rank 0, which holds the run's total)."""
    sampler = None
    if not data.is_stream:
        assert data.size is not None
        sampler_class = PackedRowSampler if isinstance(data.dataset, PackedDocuments) else GlobalBatchSampler
        sampler = sampler_class(
            data.size,
            batch_split,
            total_steps,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            rank=env.rank,
            start_step=start_step,
        )
    workers, prefetch = _workers(cfg, env, batch_split, data, sampler)
    if cfg.prefetch_factor is not None and workers and not data.is_stream:  # a chosen count: can it be held?
        check_prefetch(prefetch, workers, batch_split.micro_batch_size * _first_item_bytes(data.dataset))
    options = dict(num_workers=workers, pin_memory=pin_memory, prefetch_factor=prefetch, seed=cfg.seed)
    if sampler is not None:
        return build_loader(data.dataset, "train_data", batch_sampler=sampler, **options), workers, prefetch
    plan = (
        data.dataset.plan("train_data", batch_split.global_batch_size, cfg.seed, cfg.shuffle)
        if isinstance(data.dataset, Mixture)
        else StreamPlan(data.dataset, "train_data", batch_split.global_batch_size)  # type: ignore[arg-type]
    )
    positions = _saved_positions(saved, start_step, plan.names)
    if tokens is None:
        tokens = list(saved["tokens"]) if saved and env.is_main and positions else [0] * len(plan.names)
    data.notes.extend(_resume_notes(plan, start_step, positions))
    shard = GlobalBatchShard(plan, "train_data", batch_split, total_steps, env.rank, start_step, positions,
                             cfg.seed, marks=True)  # fmt: skip
    position = DataPosition(plan.names, start_step, positions or [None] * len(plan.names), tokens)
    return MarkedLoader(shard, position, **_stream_options(options)), workers, prefetch


def _saved_positions(saved: dict[str, Any] | None, step: int, names: list[str]) -> list[Any] | None:
    """The sources' saved positions, when ``saved`` holds them at ``step`` for these sources."""
    if not saved or saved.get("step") != step or saved.get("sources") != names:
        return None
    return saved["positions"]


def _resume_notes(plan: Any, start_step: int, positions: list[Any] | None) -> list[str]:
    """For a resumed run, one line per stream: restored from its state, or how much it re-reads."""
    if not start_step:
        return []
    notes = []
    saved = positions or [None] * len(plan.names)
    for name, reader, draws, position in zip(
        plan.names, plan.readers(), plan.draws_before(start_step), saved, strict=True
    ):
        if not isinstance(reader, StreamReader):
            continue
        again = reader.rereads(draws, position)
        if position is not None and not again:
            where = f"epoch {position['epoch']}, item {position['read']:,}"
            notes.append(f"{name}: resumed from the stream's saved state at {where} (nothing re-read)")
        else:
            why = "no exact state_dict()" if position is not None else "no saved position for this step"
            notes.append(f"{name}: re-reads {again:,} items to reach step {start_step} ({why})")
    return notes


def _first_item_bytes(dataset: Any) -> int:
    """The bytes of item 0 (0 when it fails to load: the loader then names the failing item)."""
    try:
        return item_bytes(dataset[0])
    except Exception:  # reported by the loader, with the item's index
        return 0


def _stream_options(options: dict[str, Any]) -> dict[str, Any]:
    workers = options["num_workers"]
    return dict(
        num_workers=workers,
        pin_memory=options["pin_memory"],
        prefetch_factor=options["prefetch_factor"],
        persistent_workers=workers > 0,
        # The loader draws its workers' base seed when it starts; from the global generator that draw
        # would shift the training step's random numbers (Task.augment, dropout) on a resumed run.
        generator=torch.Generator().manual_seed(options["seed"]),
    )


class ValidationData(NamedTuple):
    """This rank's validation loader, and what it takes for every rank to run as many forwards."""

    loader: DataLoader
    forwards: int | None  # the batches of the largest share; None: unknown (a stream)
    spare: Callable[[], Any]  # one item as a batch (not on the device): for a rank without a batch


def build_val_loader(
    task: Any,
    cfg: TrainConfig,
    env: ClusterEnv,
    batch_split: BatchSplit,
    workers: int,
    prefetch: int | None,
    pin: bool,
    notes: list[str],
) -> ValidationData | None:
    """Validation data, each rank taking every world_size-th sample, in micro-batches."""
    val_fn = getattr(task, "val_data", None)
    val_data = call_task("task.val_data()", val_fn) if callable(val_fn) else None
    if val_data is None:
        return None
    val_data = torch_rows(val_data, "val_data")
    if cfg.cache is not None:
        val_data = _cached(val_data, task, "val", cfg, env, notes)
    val_data = _packed(val_data, cfg, "val_data", False, notes)
    options = dict(num_workers=workers, pin_memory=pin, prefetch_factor=prefetch, seed=cfg.seed)
    micro = batch_split.micro_batch_size
    if isinstance(val_data, IterableDataset):
        shard = RankShard(val_data, "val_data", env.rank, env.world_size)
        loader = DataLoader(shard, batch_size=micro, **_stream_options(options))
        return ValidationData(loader, None, lambda: _as_batch(next(iter(val_data))))
    size = check_map_style(val_data, "val_data")
    share = Subset(val_data, range(env.rank, size, env.world_size)) if env.distributed else val_data
    largest_share = -(-size // env.world_size)
    loader = build_loader(share, "val_data", batch_size=micro, **options)
    return ValidationData(loader, -(-largest_share // micro), lambda: _as_batch(val_data[0]))


def _as_batch(item: Any) -> Any:
    return collate([item], [0], "val_data")
