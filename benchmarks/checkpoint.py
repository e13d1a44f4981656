"""Training time lost per checkpoint: synchronous saves against background saves (issue 17).

A model of about 16M parameters (an MLP of 6 layers of 1600 x 1600) with Adam: one checkpoint
holds the weights and both moments, about 190 MB. Every run trains 60 steps through
``leantrain.Trainer.fit`` with leantrain's defaults otherwise (compute threads, the default logger
off only to keep TensorBoard's writes out of the figure), in three modes:

- *none*: ``checkpoint_every="never"``, the baseline;
- *sync*: ``checkpoint_every=15, async_checkpoint=False``: the loop writes each checkpoint;
- *async*: ``checkpoint_every=15, async_checkpoint=True``: the loop copies the state and a
  thread writes it.

Saves land after steps 15, 30, 45 and 60. An ``on_step`` callback stamps the wall clock after
every step up to step 59, so the timed window holds the three mid-run saves and the steps after
each (where a background write competes with training for the CPU and the disk), and not the
final save (which every mode waits for). *Lost per checkpoint* is the window's time beyond as
many steps at the same run's median step time, over 3: measured within one run, it does not
suffer from the noise between runs on a shared machine (the *none* row is its noise floor).
*Blocked per checkpoint* is ``summary.json``'s ``checkpoint_blocked_seconds`` (the time the loop
spent in saves, the final one included) over 4. Both are measured with all cores computing and
with one core left free (a stand-in for accelerator training, where the host idles). The modes
run interleaved, in an order rotating each round; medians and ranges over rounds.

    python benchmarks/checkpoint.py           # full run (about 2 min on 2 cores): results/checkpoint.md
    python benchmarks/checkpoint.py --quick   # smoke run (1 round, 20 steps); prints the table only
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import leantrain as lt
from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "checkpoint.md"
TARGET = 0.5  # async loses at most half of what a synchronous save loses
WIDTH, LAYERS = 1600, 6
MODES = {
    "none": dict(checkpoint_every="never"),
    "sync": dict(async_checkpoint=False),
    "async": dict(async_checkpoint=True),
}


class WideMLP:
    """About 16M float32 parameters; Adam keeps two moments of each."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(1024, WIDTH, generator=generator)
        self.y = torch.randn(1024, WIDTH, generator=generator)

    def model(self) -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        return nn.Sequential(*layers[:-1])

    def train_data(self) -> TensorDataset:
        return TensorDataset(self.x, self.y)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-4)


class Stamps:
    """The wall clock after every step up to ``last``."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.times: list[float] = []

    def on_step(self, stats: Any) -> None:
        if stats.step <= self.last:
            self.times.append(time.perf_counter())

    def excess(self) -> float:
        """Seconds the window took beyond its steps at this run's median step time."""
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        return sum(gaps) - len(gaps) * statistics.median(gaps)


def run(mode: str, steps: int, every: int, threads: int, scratch: Path) -> tuple[float, float]:
    """One run; (the window's excess seconds, checkpoint_blocked_seconds)."""
    out = Path(tempfile.mkdtemp(dir=scratch)) / mode
    fields = {"checkpoint_every": every, **MODES[mode]}
    config = lt.TrainConfig(
        global_batch_size=32, max_steps=steps, out_dir=str(out), progress="none", logger="none",
        keep_checkpoints=2, **fields,
    )  # fmt: skip
    stamps = Stamps(steps - 1)
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)  # leantrain keeps a thread count the user set
    try:
        lt.Trainer(config, callbacks=[stamps]).fit(WideMLP())
    finally:
        torch.set_num_threads(kept)
    summary = json.loads((out / "summary.json").read_text())
    return stamps.excess(), summary["checkpoint_blocked_seconds"]


def measure(threads: int, steps: int, every: int, rounds: int, scratch: Path) -> dict[str, dict[str, list]]:
    """Every mode's excess and blocked seconds per round, at ``threads`` compute threads."""
    results: dict[str, dict[str, list]] = {mode: {"excess": [], "blocked": []} for mode in MODES}
    order = list(MODES)
    for index in range(rounds):
        for mode in order[index % 3 :] + order[: index % 3]:
            excess, blocked = run(mode, steps, every, threads, scratch)
            results[mode]["excess"].append(excess)
            results[mode]["blocked"].append(blocked)
            print(f"{threads} thread(s), round {index + 1}/{rounds}  {mode:5}  excess {excess:5.2f} s  "
                  f"blocked {blocked:5.2f} s")  # fmt: skip
    return results


def table(threads: int, results: dict[str, dict[str, list]], mid_run: int, saves: int) -> list[str]:
    lost = {mode: [1000 * v / mid_run for v in results[mode]["excess"]] for mode in MODES}
    lines = [
        f"### {threads} compute thread(s)"
        + (": every core computes" if threads > 1 else ": a core left free"),
        "",
        "| Mode | Lost per checkpoint (ms) | Blocked per checkpoint (ms) |",
        "|---|---:|---:|",
    ]
    for mode in MODES:
        blocked = ranged([1000 * v / saves for v in results[mode]["blocked"]], 0, thousands=True)
        label = "none (noise floor)" if mode == "none" else mode
        lines.append(
            f"| {label} | {ranged(lost[mode], 0, thousands=True)} | {blocked if mode != 'none' else '-'} |"
        )
    share = [a / s for a, s in zip(lost["async"], lost["sync"], strict=True)]
    verdict = "met" if statistics.median(share) <= TARGET else "**not met**"
    lines += [
        "",
        f"Async loses {ranged(share, 2)} of what a synchronous save loses: target <= {TARGET} {verdict}.",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(parser, "1 round of 20 steps, a save every 5; prints only", DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out = output_path(args, DEFAULT_OUT)
    steps, every, rounds = (20, 5, 1) if args.quick else (60, 15, args.rounds)
    mid_run, saves = steps // every - 1, steps // every
    parameters = sum(p.numel() for p in WideMLP().model().parameters())
    cores = torch.get_num_threads()
    load_before, started = load_now(), time.time()
    with tempfile.TemporaryDirectory() as scratch:
        run("none", 3, 1, cores, Path(scratch))  # warm-up: imports, allocator, file cache
        measured = {threads: measure(threads, steps, every, rounds, Path(scratch)) for threads in (cores, 1)}
    lines = [
        "# Training time lost per checkpoint: synchronous against background saves",
        "",
        f"- Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu_model()}, {cores} cores; load "
        f"average before / after: {load_before} / {load_now()}; the run took "
        f"{(time.time() - started) / 60:.1f} min",
        f"- Code measured: commit {git_state()}; torch {torch.__version__}",
        f"- Model: an MLP of {LAYERS} layers of {WIDTH} x {WIDTH}, {parameters / 1e6:.1f}M float32 "
        f"parameters, Adam: a checkpoint holds about {parameters * 12 / 1e6:.0f} MB of tensors (weights and "
        "two moments), written into the machine's temporary folder (ext4 here)",
        f"- Runs: {steps} steps of 32 samples, a save every {every} steps ({saves} saves). *Lost per "
        f"checkpoint*: the time of steps 2 to {steps - 1} beyond as many steps at the run's median step "
        f"time, over the {mid_run} saves in that window (a save's time, and a background write's "
        "contention, land in the steps after it); the *none* row is the estimator's noise floor. "
        f"*Blocked*: summary.json's checkpoint_blocked_seconds over all {saves} saves. {rounds} round(s), "
        "the modes interleaved; medians [ranges].",
        "- Two thread settings: all cores computing (training on the CPU, leantrain's default thread "
        "count), and one core left free, which stands in for training on an accelerator (the host's "
        "cores idle while the device computes).",
        "",
    ]
    for threads, results in measured.items():
        lines += table(threads, results, mid_run, saves)
    publish("\n".join(lines), out)


if __name__ == "__main__":
    main()
