"""What judging loss spikes and keeping rollback snapshots costs (``--on-spike``).

Two tables:

- *Through ``leantrain fit``*: the charlm example with its defaults (``--on-spike warn``: every step's
  loss judged at the log points), against ``--on-spike off`` and ``--on-spike rollback`` (a host
  snapshot at the start and every 4 log points), each a fresh process, the rows interleaved in an
  order rotating each round. *Samples/s* is ``summary.json``'s (the training loop's time, which
  includes the snapshots). Nothing spikes in these runs: this is the price of the insurance.
- *The snapshot itself*: a transformers GPT-2 (built from a config, no download) with AdamW state
  after one step, in fp32: the bytes a snapshot holds, and the time to take it and to restore it,
  beside the time of one training step of a micro-batch, in one process (median of several).

    python benchmarks/spikes.py            # full run; writes results/spikes.md
    python benchmarks/spikes.py --quick    # smoke run; prints the tables only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged, rotated

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "spikes.md"
ROWS = {"off": ["--on-spike", "off"], "warn (default)": [], "rollback": ["--on-spike", "rollback"]}


def fit(row: str, steps: int, folder: Path) -> dict:
    out = folder / f"run-{len(list(folder.iterdir()))}"
    command = [sys.executable, "-m", "leantrain", "fit", "--example", "charlm", *ROWS[row],
               "--max-steps", str(steps), "--out-dir", str(out), "--progress", "none"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{row} failed: {done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def snapshot_costs(layers: int, repeats: int) -> dict[str, float]:
    """Bytes, capture and restore seconds of a GPT-2's snapshot, and one training step's seconds."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from leantrain.run.snapshot import HostSnapshot, TrainingState

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=256, n_head=4, vocab_size=8192, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 8192, (4, 128))

    def step() -> None:
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's state exists
    state = TrainingState(model, optimizer, list(model.parameters()), frozen=frozenset(), stateful={})
    timings: dict[str, list[float]] = {"capture": [], "restore": [], "step": []}
    for _ in range(repeats):
        started = time.perf_counter()
        snapshot = HostSnapshot.capture(1, state)
        timings["capture"].append(time.perf_counter() - started)
        started = time.perf_counter()
        snapshot.restore(state)
        timings["restore"].append(time.perf_counter() - started)
        started = time.perf_counter()
        step()
        timings["step"].append(time.perf_counter() - started)
    parameters = sum(p.numel() for p in model.parameters())
    return {"parameters": parameters, "bytes": snapshot.nbytes()} | {
        name: statistics.median(values) for name, values in timings.items()
    }


def judging_costs(steps: int = 50, repeats: int = 300) -> dict[str, float]:
    """Seconds per log point of a ``steps``-step window: reading the per-step losses (over what the read
    cost before they existed: the window's mean alone) and judging them."""
    import timeit

    import torch

    from leantrain.run.spikes import SpikeDetector
    from leantrain.step.losses import LossTracker

    def filled() -> LossTracker:
        tracker = LossTracker()
        for step in range(steps):
            tracker.add(step, torch.tensor(1.0 + step / 1000, dtype=torch.float64), 64, True)
        return tracker

    fill = timeit.timeit(filled, number=repeats) / repeats
    read = timeit.timeit(lambda: filled().read(), number=repeats) / repeats - fill
    window = filled().read()
    assert window is not None
    detector = SpikeDetector(6.0, 100)
    detector.first_spike([(i, 2.0 - i / 1000) for i in range(100)], accept=True)
    judge = timeit.timeit(lambda: detector.first_spike(window.step_losses, accept=True), number=repeats)
    return {"read": read, "judge": judge / repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(parser, "60 steps, 1 round, a 2-layer GPT-2; prints the tables only", DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=210)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    steps, rounds, layers = (60, 1, 2) if args.quick else (args.steps, args.rounds, 6)
    load_before = load_now()
    speeds: dict[str, list[float]] = {row: [] for row in ROWS}
    step_seconds: list[float] = []  # the default row's
    with tempfile.TemporaryDirectory(prefix="leantrain-spikes-") as scratch:
        for round_index in range(rounds):
            for row in rotated(list(ROWS), round_index):
                summary = fit(row, steps, Path(scratch))
                speeds[row].append(summary["samples_per_second"])
                if not ROWS[row]:
                    step_seconds.append(summary["global_batch_size"] / summary["samples_per_second"])
    costs = snapshot_costs(layers, repeats=3 if args.quick else 7)
    judging = judging_costs()
    ratios = {row: [s / o for s, o in zip(speeds[row], speeds["off"], strict=True)] for row in ROWS}
    lines = [
        "# Loss spikes: what judging them and keeping rollback snapshots costs",
        "",
        f"- {cpu_model()}; load average before / after: {load_before} / {load_now()}",
        f"- Code measured: {git_state()}",
        f"- `python -m leantrain fit --example charlm --max-steps {steps}` with its defaults (log every 50 "
        f"steps: with rollback a snapshot at step 0 and every 200 steps), {rounds} round(s), the rows "
        f"interleaved; median [min to max]; nothing spikes.",
        "",
        "| --on-spike | samples/s | / off, same round |",
        "|---|---:|---:|",
    ]
    for row in ROWS:
        lines.append(f"| {row} | {ranged(speeds[row], 1, thousands=True)} | {ranged(ratios[row], 3)} |")
    mib = costs["bytes"] / 2**20
    per_step = (judging["read"] + judging["judge"]) / 50
    step = statistics.median(step_seconds)
    lines += [
        "",
        f"The samples/s ratios are within this machine's noise. Measured in one process instead: a log "
        f"point of 50 steps reads their losses in {judging['read'] * 1e6:,.0f} us (the per-step losses "
        f"included) and judges them in {judging['judge'] * 1e6:,.0f} us: {per_step * 1e6:.1f} us per "
        f"step, {per_step / step:.4%} of charlm's {step * 1000:,.0f} ms step.",
        "",
        f"The snapshot of a GPT-2 ({layers} layers, width 256, vocabulary 8,192: "
        f"{costs['parameters'] / 1e6:.1f} M parameters) with AdamW's state, fp32, median of "
        f"{3 if args.quick else 7}:",
        "",
        "| holds | take | restore | one training step (4 x 128 tokens) |",
        "|---:|---:|---:|---:|",
        f"| {mib:,.1f} MiB | {costs['capture'] * 1000:,.1f} ms | {costs['restore'] * 1000:,.1f} ms | "
        f"{costs['step'] * 1000:,.1f} ms |",
        "",
        "The snapshot holds the weights and the optimizer's two moments: 12 bytes per parameter here "
        "(16 with fp32 masters of a 16-bit model). Taken every `--snapshot-every` steps, its time is "
        "shared by those steps.",
    ]
    publish("\n".join(lines) + "\n", output_path(args, DEFAULT_OUT))


if __name__ == "__main__":
    main()
