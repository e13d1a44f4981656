"""``leantrain launch``: start a multi-process run with torchrun's elastic launcher.

Nothing here spawns processes itself: the arguments are translated to
``torch.distributed.run`` (torchrun), which starts ``python -m leantrain fit ...`` once per
process, restarts the group on failure (``--max-restarts``), and forwards stop signals.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch.distributed import run as torchrun

from leantrain.data.workers import cpus_per_process
from leantrain.errors import LeantrainError
from leantrain.runtime import THREADS_FROM_LAUNCH

# Signals torchrun forwards to its workers. SIGUSR1 is what SLURM sends before a time limit;
# leantrain's workers answer it by saving a checkpoint. (The option exists in newer torch.)
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass(frozen=True)
class LaunchOptions:
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "leantrain"
    max_restarts: int = 0

    def check(self) -> None:
        if self.nproc_per_node < 1:
            raise LeantrainError(f"invalid nproc_per_node={self.nproc_per_node}: must be 1 or more")
        if self.max_restarts < 0:
            raise LeantrainError(f"invalid max_restarts={self.max_restarts}: must be 0 or more")
        if self.nnodes != "1" and self.rdzv_endpoint is None:
            raise LeantrainError(
                f"nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT (where node 0 listens)"
            )
        if self.rdzv_endpoint is not None and not _split_endpoint(self.rdzv_endpoint):
            raise LeantrainError(f"invalid rdzv_endpoint={self.rdzv_endpoint!r}: expected HOST:PORT")


def _split_endpoint(endpoint: str) -> tuple[str, str] | None:
    host, sep, port = endpoint.rpartition(":")
    return (host, port) if sep and host and port.isdigit() else None


def torchrun_arguments(
    options: LaunchOptions, fit_arguments: Sequence[str], command: str = "fit"
) -> list[str]:
    """The torchrun command line (without the program name) for a launch of ``leantrain COMMAND``."""
    options.check()
    args = ["--nproc-per-node", str(options.nproc_per_node), "--max-restarts", str(options.max_restarts)]
    if options.rdzv_endpoint is None:
        args.append("--standalone")  # one node: a private rendezvous on a free local port
    elif options.node_rank is not None:
        # Static rendezvous: each node is told its rank; node 0 hosts the store.
        host, port = _split_endpoint(options.rdzv_endpoint) or ("", "")
        args += ["--nnodes", options.nnodes, "--node-rank", str(options.node_rank)]
        args += ["--master-addr", host, "--master-port", port]
    else:
        args += ["--nnodes", options.nnodes, "--rdzv-backend", "c10d"]
        args += ["--rdzv-endpoint", options.rdzv_endpoint, "--rdzv-id", options.rdzv_id]
    if _torchrun_knows("--signals-to-handle"):
        args += ["--signals-to-handle", FORWARDED_SIGNALS]
    return [*args, "--module", "leantrain", command, *fit_arguments]


@contextmanager
def cpus_divided(processes: int) -> Iterator[None]:
    """Each process of the node gets its share of the CPUs as compute threads, unless the user set
    OMP_NUM_THREADS (torchrun alone would give every process 1, whatever the node has). The
    launcher's own environment is put back afterwards."""
    if "OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(cpus_per_process(processes))
    os.environ[THREADS_FROM_LAUNCH] = "1"  # each process may still leave CPUs to its loader workers
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"], os.environ[THREADS_FROM_LAUNCH]


def _torchrun_knows(flag: str) -> bool:
    return any(flag in action.option_strings for action in torchrun.get_args_parser()._actions)


def launch(options: LaunchOptions, fit_arguments: Sequence[str], command: str = "fit") -> int:
    """Run torchrun in this process; its exit status (0 when every worker succeeded)."""
    arguments = torchrun_arguments(options, fit_arguments, command)
    try:
        with cpus_divided(options.nproc_per_node):
            torchrun.main(arguments)
    except SystemExit as exit_:  # torchrun exits with the workers' failure
        return int(exit_.code or 0)
    except Exception as failure:  # ChildFailedError: torchrun has already printed the details
        print(f"leantrain launch: the run failed: {type(failure).__name__}")
        return 1
    return 0
