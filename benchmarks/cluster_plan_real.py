"""``plan --cluster`` against real processes: the peak of live tensors per rank, simulated and measured.

For each layout (leantrain's charlm example and a tiny transformers Llama; 1, 2 and 4 processes on
gloo; single, ddp, fsdp, ``--tp``, fsdp x tp, recomputed blocks), the same optimizer step runs twice:

* real: ``torchrun`` starts the processes, each runs ``simulate_rank_step(..., real=True)``: the
  strategy exactly as ``fit`` runs it, on real tensors, the real collectives, torch's MemTracker
  watching; rank 0 writes its peak by kind and the accountant's figures;
* simulated: ``leantrain plan --cluster 1xNxH100 --json`` in one process, on fake tensors.

The table gives both peaks, their ratio, and whether the accountant's figures are equal.
RSS is not compared: on models of a few MiB the process's own ~400 MiB (Python, torch, its kernels)
is all RSS shows.

    .venv/bin/python benchmarks/cluster_plan_real.py      # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cluster_plan_real.md"
CHARLM = "tests.distributed.tasks:tiny_charlm"  # float64, 4 blocks of width 32, tied head
LLAMA = "tests.distributed.tasks:tiny_llama_float64"
BATCH = ["--global-batch-size", "8", "--micro-batch-size", "2", "--max-grad-norm", "0.5"]
LAYOUTS = [  # (task, processes, flags)
    (CHARLM, 1, []),
    (CHARLM, 2, ["--strategy", "ddp"]),
    (CHARLM, 2, ["--strategy", "fsdp"]),
    (CHARLM, 2, ["--strategy", "ddp", "--tp", "2"]),
    (CHARLM, 4, ["--strategy", "fsdp", "--tp", "2", "--activation-checkpointing", "Block"]),
    (CHARLM, 4, ["--strategy", "fsdp", "--precision", "bf16-mixed"]),
    (LLAMA, 1, []),
    (LLAMA, 2, ["--strategy", "fsdp"]),
    (LLAMA, 4, ["--strategy", "fsdp", "--tp", "2"]),
]
ACCOUNTED = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")


def worker(task_name: str, flags: list[str], out: Path) -> None:
    """One rank of the real run (under torchrun): the step on real tensors, rank 0 writes its figures."""
    import torch
    import torch.distributed as dist

    from leantrain.cli import build_parser, config_from_args, resolve_task
    from leantrain.simulate.cluster_plan import sample_batch
    from leantrain.simulate.rank_step import simulate_rank_step
    from leantrain.step.batching import configured_micro_batch
    from leantrain.strategies.registry import check_config

    dist.init_process_group("gloo")
    values = build_parser().parse_args(["fit", "--task", task_name, *BATCH, *flags]).fit.as_dict()
    cfg = config_from_args(values)
    task, _ = resolve_task(task_name, None)
    world = dist.get_world_size()
    strategy = check_config(cfg, world)
    dims = strategy.dims(cfg, world)
    micro = configured_micro_batch(cfg, dims.dp)
    accumulation = cfg.global_batch_size // (dims.dp * micro)
    torch.manual_seed(cfg.seed)  # every rank's initial weights alike, as fit draws them
    step = simulate_rank_step(task, cfg, strategy, dims, sample_batch(task, micro), accumulation, real=True)
    if dist.get_rank() == 0:
        figures = {"peak": step.peak, **{kind: getattr(step.memory, kind) for kind in ACCOUNTED}}
        out.write_text(json.dumps(figures))
    dist.destroy_process_group()


def real_run(task: str, processes: int, flags: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(processes), __file__, "--worker", task, str(out), *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, capture_output=True, timeout=600)
    return json.loads(out.read_text())


def simulated(task: str, processes: int, flags: list[str]) -> dict:
    command = [sys.executable, "-m", "leantrain", "plan", "--task", task, *BATCH, *flags,
               "--cluster", f"1x{processes}xH100", "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}
    done = subprocess.run(command, check=True, env=env, capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout)


def main() -> None:
    rows = []
    scratch = Path("/tmp/cluster_plan_real")
    scratch.mkdir(exist_ok=True)
    for task, processes, flags in LAYOUTS:
        started = time.perf_counter()
        real = real_run(task, processes, flags, scratch / "rank0.json")
        plan = simulated(task, processes, flags)
        real_peak, plan_peak = real["peak"]["Total"], plan["peak_bytes"]
        equal = all(real[kind] == plan[f"accounted_{kind}"] for kind in ACCOUNTED)
        rows.append((task.split(":")[1], processes, " ".join(flags) or "single", real_peak, plan_peak, equal))
        print(f"{rows[-1]}  ({time.perf_counter() - started:.0f} s)", flush=True)
    lines = [
        "| task | processes | layout | real peak (MiB) | simulated peak (MiB) | simulated / real "
        "| accountant equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, processes, layout, real_peak, plan_peak, equal in rows:
        lines.append(
            f"| {name} | {processes} | `{layout}` | {real_peak / 2**20:.3f} | {plan_peak / 2**20:.3f} | "
            f"{plan_peak / real_peak:.3f} | {'yes' if equal else 'NO'} |"
        )
    table = "\n".join(lines)
    print(table)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    RESULTS.write_text(
        f"# plan --cluster: simulated against real processes (benchmarks/cluster_plan_real.py)\n\n"
        f"Commit {commit.stdout.strip()}, {time.strftime('%Y-%m-%d')}, this 2-core CPU machine, gloo. "
        "The peak of live tensors on rank 0 during one optimizer step (torch's MemTracker), measured on real "
        "processes running the strategy as `fit` does, and simulated by `plan --cluster` on fake tensors; "
        "`--global-batch-size 8 --micro-batch-size 2 --max-grad-norm 0.5`.\n\n" + table + "\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    arguments, rest = parser.parse_known_args()
    if arguments.worker:
        worker(arguments.worker[0], rest, Path(arguments.worker[1]))
    else:
        main()
