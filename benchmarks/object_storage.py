"""Run folders in object storage: checkpoint writes and resume, a local folder against S3.

A model of about 16M parameters (an MLP of 6 layers of 1600 x 1600) with Adam: one checkpoint holds
the weights and both moments, about 185 MB. Every run goes through ``leantrain.Trainer.fit`` with
leantrain's defaults (background saves: ``async_checkpoint=True``; leantrain's thread count), the
default logger and progress bar off only to keep TensorBoard's writes and the terminal out of the
figures. Two storages, the same work:

- *local*: ``out_dir`` a folder in the machine's temporary folder;
- *S3*: ``out_dir="s3://bench/<run>"`` with a local ``staging_dir``: each checkpoint is written to
  the staging folder, then uploaded (with its manifest) on the save's thread.

The S3 service is moto's server, started by this script in a process of its own on 127.0.0.1 (a
separate process, as a real store is: its request handling does not hold this process's GIL), with
s3fs as the client, exactly as leantrain talks to AWS or MinIO. moto is Python, on the same cores
as the training, and keeps the objects in its memory: its throughput is not AWS's (nor a network's).
What the figures show is leantrain's overhead of a run folder at a URL and whether the uploads stay
off the training loop (blocked time about that of a local folder), not the speed of S3.

*Writes*: 30 steps of 256 samples, ``checkpoint_every=10`` (3 saves, the last at the end of the
run): 10 steps between saves outlast an upload to moto here, as minutes between saves outlast an
upload in real training (with saves closer than an upload, the next save waits for the previous
one: at most one is in flight). An ``on_step`` callback stamps the wall clock after every step.
From each run:

- *blocked per checkpoint*: ``summary.json``'s ``checkpoint_blocked_seconds`` over the 3 saves
  (the time the loop spent in saves: the staging copy, a wait for the previous write if still in
  flight, and at the end the wait for the final one);
- *blocked per mid-run checkpoint*: the same counter as saved in the final checkpoint (its
  ``progress``: written at the last save, it holds the time of the saves before it), over those 2:
  the mid-run saves alone, where an upload overlaps training (the second save waits there for the
  first's upload if it is still in flight; the final save's wait for the second's is not in it);
- *end of run*: from the last step's stamp to ``fit``'s return (the final checkpoint's copy, its
  write or upload awaited, the run's files uploaded, the summary);
- *training*: from the first step's stamp to the last's (the steps, the mid-run saves, and what an
  upload in flight takes of the cores from the steps);
- *wall*: ``Trainer(...).fit(...)`` as a whole; the median step (gaps between stamps);
- *S3 server's CPU*: the moto process's CPU seconds during the run (from /proc): taken from the
  cores the training runs on, as a remote store would not (the local rows: the idle server).

*Resume* (``resume="auto"``, ``max_steps`` = the saved step + 1, ``checkpoint_every="never"``: no
further save, so its wall is the resume and one step) from the folder the write run of the
same round left: locally the same folder, for S3 the same URL with a new, empty staging folder (a
run on another machine: the run's files and the newest checkpoint are downloaded). *Resume time*:
from the ``fit`` call to the first call of the task's ``loss`` (the first forward starts: set-up and
resume done, no step's time in it); the same figure for the write run (a fresh start) beside it.
The runs check that the first step after the resume is the saved step + 1.

Storages run interleaved in one process, the order rotating each round, after an untimed short run
of each (imports, allocator, the S3 client); medians [ranges] over rounds. A full run takes 3-5 min
on two quiet cores, about 8 when other work keeps them busy (the steps slow down 2-3x).

    python benchmarks/object_storage.py          # full run: results/object_storage.md
    python benchmarks/object_storage.py --quick  # smoke run (1 round, 8 steps); prints the table only

Needs ``s3fs`` and ``moto[server]`` (the ``dev`` install has both).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

import leantrain as lt
from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged, rotated
from checkpoint import LAYERS, WIDTH, WideMLP
from leantrain.checkpoint import checkpoint_name, load_checkpoint

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "object_storage.md"
BUCKET = "bench"
# Large enough that the steps between two saves outlast an upload to moto (a few seconds): the
# regime of real training, where saves are minutes apart. Smaller, the next save waits for the
# previous upload (at most one save is in flight), and blocked time measures moto's throughput.
BATCH = 256
STORAGES = ("local", "S3")


class TimedMLP(WideMLP):
    """benchmarks/checkpoint.py's model (Adam: a checkpoint of ~185 MB), noting when its first forward
    starts: the end of set-up (a resume's download included)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_loss: float | None = None

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.first_loss is None:
            self.first_loss = time.perf_counter()
        return super().loss(model, batch)


class Stamps:
    """The wall clock and the step number after every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.steps: list[int] = []

    def on_step(self, stats: Any) -> None:
        self.times.append(time.perf_counter())
        self.steps.append(stats.step)

    def median_step(self) -> float:
        return statistics.median(b - a for a, b in zip(self.times, self.times[1:], strict=False))


# ---------------------------------------------------------------------------------------
# The S3 service


def serve() -> None:
    """``--serve``: moto's S3 server on a free port of 127.0.0.1; prints the port, runs until stdin
    closes (so it ends with its parent, even one that crashed)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    # Nobody reads the pipe after the port: anything printed later would fill it and stall the server.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.stdin.read()
    server.stop()


class S3Service:
    """The ``--serve`` process, the AWS_* variables pointing leantrain's s3fs at it, and a bucket."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        port = self.process.stdout.readline().strip()
        if not port:
            raise RuntimeError("moto's server did not start (pip install 'moto[server]')")
        os.environ.update(
            AWS_ACCESS_KEY_ID="test",
            AWS_SECRET_ACCESS_KEY="test",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        )
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        self.fs.mkdir(BUCKET)

    def cpu_seconds(self) -> float:
        """The server's CPU time so far (user + system, /proc): what it took of the cores the
        training runs on, which a remote store would not take."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def size(self, url: str) -> int:
        self.fs.invalidate_cache()
        return int(self.fs.size(url))

    def remove(self, url: str) -> None:
        """A finished run's objects: moto keeps them in memory, and the rounds would add up."""
        self.fs.rm(url, recursive=True)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


# ---------------------------------------------------------------------------------------
# Runs


@dataclass
class Figures:
    """One storage's figures, a value per round."""

    blocked: list[float] = field(default_factory=list)  # per checkpoint, all saves
    blocked_mid: list[float] = field(default_factory=list)  # per checkpoint, the mid-run saves
    end: list[float] = field(default_factory=list)  # last step's stamp -> fit's return
    training: list[float] = field(default_factory=list)  # first step's stamp -> last step's
    wall: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)  # the write run's median step
    start: list[float] = field(default_factory=list)  # fresh run: fit -> first forward
    resume: list[float] = field(default_factory=list)  # resume: fit -> first forward
    resume_wall: list[float] = field(default_factory=list)
    checkpoint_bytes: list[int] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)  # moto's CPU seconds in the write run


def timed_fit(config: lt.TrainConfig) -> tuple[float, float, float, Stamps, Path]:
    """``fit`` once: (its start, the first forward's start, its return, the step stamps, the run's
    local folder)."""
    stamps, task = Stamps(), TimedMLP()
    started = time.perf_counter()
    result = lt.Trainer(config, callbacks=[stamps]).fit(task)
    ended = time.perf_counter()
    assert result.out_dir is not None  # a URL run's staging folder: summary.json is written there
    assert task.first_loss is not None
    return started, task.first_loss, ended, stamps, Path(result.out_dir)


def settings(storage: str, round_dir: Path) -> dict[str, Any]:
    """Where a run of ``storage`` writes: a folder, or a URL with its staging folder."""
    if storage == "local":
        return dict(out_dir=str(round_dir / "run"))
    return dict(out_dir=f"s3://{BUCKET}/{round_dir.name}", staging_dir=str(round_dir / "staging-a"))


def one_round(storage: str, steps: int, every: int, scratch: Path, s3: S3Service, into: Figures) -> None:
    """A write run, then a resume of it, of ``storage``; their figures appended to ``into``."""
    round_dir = Path(tempfile.mkdtemp(dir=scratch))
    common = dict(global_batch_size=BATCH, progress="none", logger="none", checkpoint_every=every)
    where = settings(storage, round_dir)
    server_before = s3.cpu_seconds()
    started, first, ended, stamps, folder = timed_fit(lt.TrainConfig(max_steps=steps, **where, **common))
    into.server_cpu.append(s3.cpu_seconds() - server_before)
    saves = steps // every
    summary = json.loads((folder / "summary.json").read_text())
    final = folder / "checkpoints" / checkpoint_name(steps)  # a URL run's staging keeps the newest
    before_final = load_checkpoint(final)["progress"]["checkpoint_blocked_seconds"]
    size = final.stat().st_size
    if storage == "S3":  # the uploaded object is the staged file, byte for byte
        uploaded = s3.size(f"{where['out_dir']}/checkpoints/{final.name}")
        assert uploaded == size, (uploaded, size)
    step = stamps.median_step()
    into.blocked.append(summary["checkpoint_blocked_seconds"] / saves)
    into.blocked_mid.append(before_final / (saves - 1))
    into.end.append(ended - stamps.times[-1])
    into.training.append(stamps.times[-1] - stamps.times[0])
    into.wall.append(ended - started)
    into.step.append(step)
    into.start.append(first - started)
    into.checkpoint_bytes.append(size)

    # Another machine: nothing of the run on this one but what the URL holds.
    resumed_where = where | ({"staging_dir": str(round_dir / "staging-b")} if storage == "S3" else {})
    # It saves nothing: its wall is then the resume and one step, without another upload.
    resumed = common | {"checkpoint_every": "never"}
    config = lt.TrainConfig(max_steps=steps + 1, resume="auto", **resumed_where, **resumed)
    started, first, ended, stamps, _ = timed_fit(config)
    assert stamps.steps[0] == steps + 1, f"{storage}: resumed at step {stamps.steps[0] - 1}, not {steps}"
    into.resume.append(first - started)
    into.resume_wall.append(ended - started)
    if storage == "S3":
        s3.remove(where["out_dir"])
    print(
        f"{storage:5}  blocked/ckpt {1000 * into.blocked[-1]:6.0f} ms "
        f"(mid-run {1000 * into.blocked_mid[-1]:5.0f})  end {into.end[-1]:5.2f} s  "
        f"wall {into.wall[-1]:5.1f} s  step {1000 * step:4.0f} ms  resume {into.resume[-1]:5.2f} s",
        flush=True,
    )


def measure(steps: int, every: int, rounds: int, scratch: Path, s3: S3Service) -> dict[str, Figures]:
    figures = {storage: Figures() for storage in STORAGES}
    for index in range(rounds):
        for storage in rotated(STORAGES, index):
            print(f"round {index + 1}/{rounds}  ", end="")
            one_round(storage, steps, every, scratch, s3, figures[storage])
    return figures


# ---------------------------------------------------------------------------------------
# Report


def ms(values: list[float]) -> str:
    return ranged([1000 * v for v in values], 0, thousands=True)


def report(figures: dict[str, Figures], steps: int, every: int, rounds: int, header: list[str]) -> str:
    saves = steps // every
    lines = [
        *header,
        "## Checkpoint writes",
        "",
        f"| Storage | Blocked per checkpoint, all {saves} (ms) | Blocked per mid-run checkpoint (ms) "
        "| Training, first to last step (s) | Last step to fit's return (s) | Run wall (s) "
        "| Median step (ms) | S3 server's CPU (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for storage, got in figures.items():
        lines.append(
            f"| {storage} | {ms(got.blocked)} | {ms(got.blocked_mid)} | {ranged(got.training, 1)} "
            f"| {ranged(got.end, 2)} | {ranged(got.wall, 1)} | {ms(got.step)} "
            f"| {ranged(got.server_cpu, 1)} |"
        )
    lines += [
        "",
        '## Resume (`resume="auto"`)',
        "",
        "| Storage | Resume: fit to the first forward (s) | Fresh start, the same (s) "
        "| Resume run's wall (s) |",
        "|---|---:|---:|---:|",
    ]
    for storage, got in figures.items():
        lines.append(
            f"| {storage} | {ranged(got.resume, 2)} | {ranged(got.start, 2)} | {ranged(got.resume_wall, 1)} |"
        )
    local, remote = figures["local"], figures["S3"]

    def minus(a: list[float], b: list[float]) -> list[float]:  # S3 - local, round by round
        return [x - y for x, y in zip(a, b, strict=True)]

    lines += [
        "",
        "S3 minus local, round by round (medians [ranges]): blocked per mid-run checkpoint "
        f"{ms(minus(remote.blocked_mid, local.blocked_mid))} ms; training "
        f"{ranged(minus(remote.training, local.training), 2)} s; last step to fit's return (the final "
        f"upload, mostly) {ranged(minus(remote.end, local.end), 2)} s; run wall "
        f"{ranged(minus(remote.wall, local.wall), 1)} s; resume "
        f"{ranged(minus(remote.resume, local.resume), 2)} s "
        f"(the newest checkpoint, {statistics.median(local.checkpoint_bytes) / 1e6:.0f} MB, downloaded).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(parser, "1 round of 8 steps, a save every 4; prints only", DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the S3 process
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    out = output_path(args, DEFAULT_OUT)
    steps, every, rounds = (8, 4, 1) if args.quick else (30, 10, args.rounds)
    parameters = sum(p.numel() for p in TimedMLP().model().parameters())
    load_before, started = load_now(), time.time()
    s3 = S3Service()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for storage in STORAGES:  # warm-up: imports, allocator, the S3 client and server
                print("warm-up    ", end="")
                one_round(storage, 2, 1, Path(scratch), s3, Figures())
            figures = measure(steps, every, rounds, Path(scratch), s3)
    finally:
        s3.close()
    megabytes = statistics.median(figures["local"].checkpoint_bytes) / 1e6
    header = [
        "# Run folders in object storage: checkpoint writes and resume, local folder against S3",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu_model()}, {os.cpu_count()} cores; "
        f"load average before / after: {load_before} / {load_now()}; the run took "
        f"{(time.time() - started) / 60:.1f} min",
        f"- Code measured: commit {git_state()}; torch {torch.__version__}",
        f"- Model: an MLP of {LAYERS} layers of {WIDTH} x {WIDTH}, {parameters / 1e6:.1f}M float32 "
        f"parameters, Adam: a checkpoint file of {megabytes:.1f} MB (the same size at the URL)",
        f"- Runs: `Trainer.fit` with leantrain's defaults (background saves), {steps} steps of {BATCH} "
        f"samples, a save every {every} steps ({steps // every} saves, the last at the end), logger "
        f"and progress off; the resume runs to step {steps + 1}, saving nothing. {rounds} round(s), the "
        "storages interleaved; medians [ranges].",
        "- *local*: a folder in the machine's temporary folder. *S3*: `s3://` through s3fs to moto's S3 "
        "server in another process on 127.0.0.1, the run staged in a local folder; resumed with a new, "
        "empty staging folder (another machine: everything is downloaded). The local resume reads the "
        "file the write run just wrote (likely still in the page cache).",
        "- **moto is not AWS**: a Python server on the same cores as the training, objects in its memory. "
        "Its throughput is not S3's, and its CPU time (the last column) comes out of the training's "
        "cores: the S3 rows' steps run slower than beside a remote store. The figures show leantrain's "
        "overhead and that the uploads run in the background (blocked time about local's), not the "
        "speed of S3.",
        "- *Blocked per checkpoint*: summary.json's `checkpoint_blocked_seconds` over all saves, the "
        "final one (whose write or upload the end of the run awaits) included; *mid-run*: the same "
        "counter as the final checkpoint saved it (the saves before it), over those saves. *Last step "
        "to fit's return*: the final save, its upload and the run files'. *Resume*: from the `fit` call "
        "to the first forward's start (set-up and resume, no step); *fresh start*: the same for the "
        "write run, which resumed nothing.",
        "",
    ]
    publish(report(figures, steps, every, rounds, header), out)


if __name__ == "__main__":
    main()
