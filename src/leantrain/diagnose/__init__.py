"""The doctor's checks, as functions and context managers usable on a hand-written loop.

* ``PhaseTimer``: seconds per step by phase (CUDA events on GPU, wall clock on CPU).
* ``HostSyncs``: host synchronisations (``.item()``, ``bool(tensor)``, ``print(tensor)``,
  ``torch.cuda.synchronize`` ...) counted by the file and line of your code that made them.
* ``RetainedGraphs``: tensors with an autograd graph that outlive their step, by where
  they were created.
* ``count_flops``, ``peak_flops``, ``mfu``: model FLOPs utilisation.
* ``breakdown``: memory by kind (parameters, gradients, optimizer state, activations).
* ``RunFacts`` (``loader_facts(loader)`` fills the loader's part), ``Measurements``,
  ``verdict``, ``advise``: the rules that turn measurements into a verdict and ranked advice.
* ``run_doctor``: the whole diagnosis of a task, as ``leantrain doctor`` runs it.
"""

from typing import TYPE_CHECKING, Any

from leantrain.diagnose.advice import Advice, Measurements, RunFacts, advise, loader_facts, verdict
from leantrain.diagnose.flops import PeakFlops, count_flops, mfu, peak_flops
from leantrain.diagnose.syncs import HostSync, HostSyncs, RetainedGraph, RetainedGraphs
from leantrain.diagnose.timer import PHASES, PhaseTimer
from leantrain.memory.accountant import MemoryBreakdown, SavedActivations, breakdown

if TYPE_CHECKING:
    from leantrain.diagnose.doctor import Diagnosis, run_doctor

__all__ = [
    "PHASES",
    "Advice",
    "Diagnosis",
    "HostSync",
    "HostSyncs",
    "Measurements",
    "MemoryBreakdown",
    "PeakFlops",
    "PhaseTimer",
    "RetainedGraph",
    "RetainedGraphs",
    "RunFacts",
    "SavedActivations",
    "advise",
    "breakdown",
    "count_flops",
    "loader_facts",
    "mfu",
    "peak_flops",
    "run_doctor",
    "verdict",
]


def __getattr__(name: str) -> Any:
    # The doctor trains through the Trainer: imported on first use, so that the CLI can read the
    # probe's defaults (and a hand-written loop use the checks) without loading the training loop.
    if name in ("Diagnosis", "run_doctor"):
        import leantrain.diagnose.doctor as doctor

        return getattr(doctor, name)
    raise AttributeError(f"module 'leantrain.diagnose' has no attribute {name!r}")
