"""Packing (``--pack-length``) against padding, on documents of realistic length spread, through the CLI.

The documents are the paragraphs of Python's help text (``pydoc_data.topics``, the ``charlm``
example's corpus), one token per character, each cut to at most ``BLOCK`` characters: lengths
from 2 to ``BLOCK``, most far shorter. Two rows, each a fresh ``leantrain fit`` process with the
defaults and the same task settings (``charlm`` with ``block=BLOCK``, ``layers=2``, ``width=64``):

- *padded*: every document padded to the longest (``BLOCK``: items of one shape, as default
  collation needs; ``labels`` -100 and ``attention_mask`` 0 on the padding);
- *packed*: the same documents, unpadded, with ``--pack-length BLOCK``.

Both compute ``global_batch_size x BLOCK`` positions a step. *Tokens/s*: document tokens
(padding left out) over the training loop's time: the padded row's ``samples_per_second`` times
the documents' mean length, the packed row's times ``BLOCK`` (a row holds no padding).
*Padding*: the share of the positions computed that are padding. The padding a collate that pads
each batch to its own longest document would leave is given too (computed on random batches).
The rows run interleaved, once per round in an order rotating each round; medians and ranges.

    python benchmarks/packing.py            # full run; writes results/packing.md
    python benchmarks/packing.py --quick    # smoke run; prints the table only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import add_output_options, cpu_model, git_state, load_now, output_path, publish, ranged, rotated

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "packing.md"
BLOCK = 128
BATCH = 16
TASKS = f"""\
from leantrain.examples.charlm import CharLMTask
def padded(): return CharLMTask(block={BLOCK}, layers=2, width=64, layout="padded")
def documents(): return CharLMTask(block={BLOCK}, layers=2, width=64, layout="documents")
"""
ROWS = {
    "padded to the longest": ["--task", "packing_tasks:padded"],
    f"packed, --pack-length {BLOCK}": ["--task", "packing_tasks:documents", "--pack-length", str(BLOCK)],
}


def document_lengths() -> list[int]:
    """The training documents' lengths, as the task makes them (in a child: this process stays light)."""
    code = (
        f"from leantrain.examples.charlm import CharLMTask; d = CharLMTask(block={BLOCK}, layout='documents')"
        ".train_data(); print([len(d[i]) for i in range(len(d))])"
    )
    return json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout)  # fmt: skip


def batch_padding(lengths: list[int], batches: int = 2000) -> float:
    """The padding of batches of BATCH random documents, each padded to its own longest."""
    import random

    rng = random.Random(0)
    shares = []
    for _ in range(batches):
        picked = rng.sample(lengths, BATCH)
        shares.append(1 - sum(picked) / (BATCH * max(picked)))
    return statistics.mean(shares)


def run(row: str, steps: int, folder: Path) -> dict:
    out = folder / f"run-{len(list(folder.iterdir()))}"
    command = [sys.executable, "-m", "leantrain", "fit", *ROWS[row], "--max-steps", str(steps),
               "--global-batch-size", str(BATCH), "--out-dir", str(out), "--progress", "none"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT / "src")])}
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{row} failed: {done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(parser, "20 steps, 1 round; prints the table only", DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    steps, rounds = (20, 1) if args.quick else (args.steps, args.rounds)
    lengths = document_lengths()
    mean_length = statistics.mean(lengths)
    tokens_per_sample = {row: mean_length if row.startswith("padded") else BLOCK for row in ROWS}
    padding = {row: 1 - tokens_per_sample[row] / BLOCK for row in ROWS}
    speeds: dict[str, list[float]] = {row: [] for row in ROWS}
    ratios = []
    load_before = load_now()
    with tempfile.TemporaryDirectory(prefix="leantrain-packing-") as scratch:
        folder = Path(scratch)
        (folder / "packing_tasks.py").write_text(TASKS)
        for round_index in range(rounds):
            measured = {}
            for row in rotated(list(ROWS), round_index):
                summary = run(row, steps, folder)
                measured[row] = summary["samples_per_second"] * tokens_per_sample[row]
                speeds[row].append(measured[row])
            padded_row, packed_row = list(ROWS)
            ratios.append(measured[packed_row] / measured[padded_row])
    lines = [
        "# Packing (`--pack-length`) against padding to the longest document, through `leantrain fit`",
        "",
        f"- {cpu_model()}; load average before / after: {load_before} / {load_now()}",
        f"- Code measured: {git_state()}",
        f"- Data: the paragraphs of `pydoc_data.topics` (the charlm example's training text), one token "
        f"per character, cut to at most {BLOCK}: {len(lengths):,} documents, {sum(lengths):,} tokens, mean "
        f"length {mean_length:.1f}, median {statistics.median(lengths):.0f}.",
        f"- Runs: `python -m leantrain fit --task packing_tasks:ROW --global-batch-size {BATCH} --max-steps "
        f"{steps}` (+ `--pack-length {BLOCK}` for the packed row), charlm with block {BLOCK}, 2 layers, "
        f"width 64; everything else default. {rounds} round(s), the rows interleaved; median [min to max].",
        f"- *Tokens/s*: document tokens (no padding) per second of the training loop. *Padding*: share "
        f"of the positions computed that are padding. Padding each batch to its own longest document (a "
        f"collate leantrain's fixed-shape items do not do) would still leave "
        f"{batch_padding(lengths):.0%} padding.",
        "",
        "| Row | Padding | Tokens/s |",
        "|---|---:|---:|",
    ]
    for row in ROWS:
        lines.append(f"| {row} | {padding[row]:.0%} | {ranged(speeds[row], 0, thousands=True)} |")
    lines += ["", f"Packed / padded tokens/s, per round: {ranged(ratios, 2)}."]
    publish("\n".join(lines) + "\n", output_path(args, DEFAULT_OUT))


if __name__ == "__main__":
    main()
