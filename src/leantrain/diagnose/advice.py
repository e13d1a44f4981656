"""From measurements to a verdict and ranked advice: pure functions of plain values.

Every rule reads ``RunFacts`` (what the run was set up with) and ``Measurements`` (what
the doctor measured) and returns ``Advice`` with its evidence in numbers, the exact change,
and the expected gain. ``advise`` ranks them the way a performance engineer tries them:
first leaks that will end the run (``tier`` 0: graphs kept alive), then changes that keep
the results as they are (``tier`` 1: a loader setting, a line of user code), then those
that change numerics or need work (``tier`` 2: precision, a cache, the batch), each tier
by expected speed-up. Rules for a user's own loop (workers restarting
every epoch, gradients all-reduced on every micro-batch) read the same facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import IterableDataset

from leantrain.diagnose.syncs import HostSync, RetainedGraph
from leantrain.memory.accountant import MemoryBreakdown
from leantrain.step.compilation import CompilerEvent
from leantrain.units import format_bytes

# A verdict names a bottleneck that takes at least this share of the step.
BOTTLENECK_SHARE = 0.3
# Below this share of the step, data loading is not worth advice.
DATA_ADVICE_SHARE = 0.1
# Above this share of padding among the tokens computed, packing is advised (issue 39).
PADDING_ADVICE_SHARE = 0.1
# Memory this close to the budget is a limit.
MEMORY_PRESSURE = 0.9
# A micro-batch this many times smaller than what fits is worth raising.
MICRO_BATCH_HEADROOM = 4
# Measured in benchmarks/results/data.md: 1 main-process thread instead of 2 beside 2 busy workers.
THREADS_MEASURED_GAIN = 1.24
# A compiled trial must beat the eager step by this much to be advised (within it: noise).
COMPILE_WORTH = 1.03

VERDICTS = ("data-bound", "host-sync-bound", "compute-bound", "communication-bound", "memory-bound")


@dataclass(frozen=True)
class RunFacts:
    """How the run was set up (resolved values, not config spellings)."""

    device_type: str = "cpu"
    strategy: str = "single"
    strategy_caveat: tuple[str, str, str, str] | None = None  # title, why, change, gain (Strategy.caveat)
    precision: str = "32"
    micro_batch_size: int = 1
    accumulation_steps: int = 1
    global_batch_size: int = 1
    world_size: int = 1
    tensor_parallel: int = 1  # --tp: ranks per tensor-parallel group
    num_workers: int = 0
    persistent_workers: bool = True
    auto_workers: int = 1  # what --num-workers auto picks here
    torch_threads: int = 1
    available_cpus: int = 1
    pin_memory: bool = False
    cache: str | None = None
    map_style: bool = True
    items_repeat: bool | None = None  # a second load of an item gives the same values
    # Token data: the share of the positions computed that are padding (attention_mask 0, else label -100),
    # from a sample of items; 0 when packed (--pack-length); None for other data. And the items' length.
    padding_share: float | None = None
    token_length: int | None = None
    micro_batch_halved: bool = False  # the run ran out of memory and shrank its micro-batch
    memory_budget: int | None = None  # bytes: the flag, or a CUDA device's memory
    fast_16bit_ratio: float | None = None  # peak 16-bit / fp32 matmul rate, where much faster
    task_flags: str = "--task pkg.module:Task"  # the task on a command line
    compile: str = "none"  # --compile
    # Whether the model has repeated blocks (--compile blocks compiles them); None: the model is
    # not known (a hand-written loop's facts).
    repeated_blocks: bool | None = None

    @property
    def compile_to_try(self) -> str | None:
        """The ``--compile`` a trial of this eager run would use, or None."""
        if self.compile != "none" or self.repeated_blocks is None:
            return None
        return "blocks" if self.repeated_blocks else "model"


@dataclass(frozen=True)
class CompileTrial:
    """The same steps measured again with ``--compile`` (the doctor's trial of a compute-bound run)."""

    scope: str  # blocks or model
    step_seconds: float  # the compiled run's mean step, after its warm-up
    compile_seconds: float

    def speedup(self, eager_step_seconds: float) -> float:
        """The eager step over the compiled one."""
        return _speedup(eager_step_seconds, self.step_seconds)


def loader_facts(loader: Any) -> dict[str, Any]:
    """The ``RunFacts`` fields a ``torch.utils.data.DataLoader`` tells, for checking your own loop::

    RunFacts(**loader_facts(loader), device_type="cuda", precision="32")
    """
    dataset = getattr(loader, "dataset", None)
    return {
        "num_workers": loader.num_workers,
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "map_style": not isinstance(dataset, IterableDataset),
    }


@dataclass(frozen=True)
class Measurements:
    phases: dict[str, float]  # mean seconds per step by phase, and "total"
    memory: MemoryBreakdown | None = None
    host_syncs: list[HostSync] = field(default_factory=list)  # in the user's code
    audited_steps: int = 1
    retained_graphs: list[RetainedGraph] = field(default_factory=list)
    backward_calls: int = 0  # in the timed steps
    backwards_with_all_reduce: int = 0
    compiler_events: list[CompilerEvent] = field(default_factory=list)  # --compile: breaks, recompiles
    compile_trial: CompileTrial | None = None  # the eager run measured again, compiled

    @property
    def step(self) -> float:
        return max(self.phases.get("total", 0.0), 1e-12)

    def share(self, *phases: str) -> float:
        return sum(self.phases.get(p, 0.0) for p in phases) / self.step

    @property
    def sync_seconds(self) -> float:
        """Seconds per step spent inside the user's host syncs."""
        return sum(s.seconds for s in self.host_syncs) / max(self.audited_steps, 1)


@dataclass(frozen=True)
class Advice:
    title: str
    evidence: str
    change: str
    expected_gain: str
    tier: int = 1  # 0: a leak; 1: results stay the same; 2: numerics, data or optimisation change
    speedup: float = 1.0  # the estimate the ranking uses (1.0: none measured)

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ("title", "evidence", "change", "expected_gain")}


def verdict(facts: RunFacts, m: Measurements) -> str:
    """The bottleneck: the largest of data, communication and host-sync time when it takes
    at least ``BOTTLENECK_SHARE`` of the step; else memory when it limits the run; else compute."""
    shares = {
        "data-bound": m.share("data", "h2d"),
        "communication-bound": m.share("communication"),
        "host-sync-bound": m.sync_seconds / m.step,
    }
    name, share = max(shares.items(), key=lambda item: item[1])
    if share >= BOTTLENECK_SHARE:
        return name
    if facts.micro_batch_halved or _memory_use(facts, m) >= MEMORY_PRESSURE:
        return "memory-bound"
    return "compute-bound"


def advise(facts: RunFacts, m: Measurements) -> list[Advice]:
    """Every rule's advice, ranked: tier first, then the expected speed-up."""
    found: list[Advice] = []
    for rule in RULES:
        found.extend(rule(facts, m))
    return sorted(found, key=lambda a: (a.tier, -a.speedup))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms"


def _speedup(step: float, new_step: float) -> float:
    return step / max(new_step, step * 1e-3)


def _memory_use(facts: RunFacts, m: Measurements) -> float:
    if facts.memory_budget is None or m.memory is None:
        return 0.0
    return m.memory.total_bytes / facts.memory_budget


def more_workers(facts: RunFacts, m: Measurements) -> list[Advice]:
    data = m.phases.get("data", 0.0)
    if m.share("data") < DATA_ADVICE_SHARE or facts.num_workers >= facts.auto_workers or not facts.map_style:
        return []
    # With w workers loading in parallel, the loading takes 1/w of the time, at best hidden
    # behind the rest of the step: the gain is bounded by both.
    # One process's loading time per step: the whole wait without workers; with busy
    # workers, each of them spends the whole step loading.
    workers = facts.auto_workers
    loading = data if facts.num_workers == 0 else m.step * facts.num_workers
    gain = _speedup(m.step, max(m.step - data, loading / workers))
    return [
        Advice(
            "load data in more worker processes",
            f"the step waits {_ms(data)} of {_ms(m.step)} for data ({m.share('data'):.0%}) with "
            f"{facts.num_workers} worker(s); {workers} worker(s) per process fit the "
            f"{facts.available_cpus} CPUs available",
            f"--num-workers auto  (here: {workers} workers; or --num-workers tune to measure)",
            f"up to {gain:.2f}x samples/s",
            tier=1,
            speedup=gain,
        )
    ]


def threads_compete_with_workers(facts: RunFacts, m: Measurements) -> list[Advice]:
    busy = facts.num_workers + facts.torch_threads
    if (
        facts.num_workers == 0
        or facts.torch_threads < 2
        or busy <= facts.available_cpus
        or m.share("data") < DATA_ADVICE_SHARE
    ):
        return []
    return [
        Advice(
            "give the main process one thread while workers load",
            f"{facts.num_workers} workers and {facts.torch_threads} compute threads share "
            f"{facts.available_cpus} CPUs, and the step still waits {m.share('data'):.0%} for data: "
            "the compute threads spin-wait on cores the workers need (a thread count set by "
            "OMP_NUM_THREADS or torch.set_num_threads, which leantrain leaves alone)",
            "OMP_NUM_THREADS=1 leantrain fit ...  (or unset it and drop torch.set_num_threads: "
            "leantrain then gives the main process the CPUs the workers leave)",
            f"measured {THREADS_MEASURED_GAIN:.2f}x with 2 workers on 2 CPUs (benchmarks/results/data.md)",
            tier=1,
            speedup=THREADS_MEASURED_GAIN,
        )
    ]


def cache_items(facts: RunFacts, m: Measurements) -> list[Advice]:
    data = m.phases.get("data", 0.0)
    if m.share("data") < DATA_ADVICE_SHARE or facts.cache is not None or not facts.map_style:
        return []
    gain = _speedup(m.step, m.step - data)
    if facts.items_repeat is False:
        return [
            Advice(
                "move the random part of __getitem__ into Task.augment, then cache the rest",
                f"the step waits {_ms(data)} for data; item 0 loaded twice differs, so a cache "
                "would freeze its random augmentation",
                "Task.augment(batch) for the random part; then leantrain cache "
                f"{facts.task_flags} --out DIR and --cache DIR",
                f"up to {gain:.1f}x samples/s if the deterministic part is the expensive one",
                tier=2,
                speedup=gain,
            )
        ]
    return [
        Advice(
            "preprocess the data once into a memory-mapped cache",
            f"the step waits {_ms(data)} of {_ms(m.step)} for data; items are deterministic "
            "(item 0 loaded twice is the same)",
            f"leantrain cache {facts.task_flags} --out DIR, then fit --cache DIR "
            "(a preprocessing change needs a new cache)",
            f"up to {gain:.1f}x samples/s (the data wait removed)",
            tier=2,
            speedup=gain,
        )
    ]


def pack_documents(facts: RunFacts, m: Measurements) -> list[Advice]:
    share = facts.padding_share
    if share is None or share <= PADDING_ADVICE_SHARE:
        return []
    gain = 1 / (1 - share)
    return [
        Advice(
            "pack the token documents into rows instead of padding them",
            f"{share:.0%} of the tokens computed are padding (items of {facts.token_length} tokens)",
            f"return each document unpadded (a 1-D tensor, or a dict of input_ids) and add --pack-length "
            f"{facts.token_length}: rows of that many tokens, no padding, each document attending only to "
            "itself (docs/data.md, packing)",
            f"up to {gain:.1f}x tokens/s (the padding's compute spent on real tokens)",
            tier=2,
            speedup=gain,
        )
    ]


def workers_restart_every_epoch(facts: RunFacts, m: Measurements) -> list[Advice]:
    if facts.num_workers == 0 or facts.persistent_workers:
        return []
    return [
        Advice(
            "keep DataLoader workers alive between epochs",
            f"{facts.num_workers} workers without persistent_workers are started again every epoch "
            "(process start-up, the dataset copied to each)",
            "DataLoader(..., persistent_workers=True)  (leantrain's loaders always do this)",
            "the start-up time of every epoch after the first",
            tier=1,
        )
    ]


def pin_memory_off(facts: RunFacts, m: Measurements) -> list[Advice]:
    if facts.device_type != "cuda" or facts.pin_memory:
        return []
    h2d = m.phases.get("h2d", 0.0)
    return [
        Advice(
            "pin host batches",
            f"pin_memory is off on CUDA: copies are synchronous from pageable memory "
            f"(h2d {_ms(h2d)} per step, {m.share('h2d'):.0%})",
            "--pin-memory true",
            f"up to {_speedup(m.step, m.step - h2d):.2f}x (the copy overlaps compute)",
            tier=1,
            speedup=_speedup(m.step, m.step - h2d),
        )
    ]


def host_syncs(facts: RunFacts, m: Measurements) -> list[Advice]:
    found = []
    for sync in m.host_syncs:
        per_step = sync.per_step(m.audited_steps)
        seconds = sync.seconds / max(m.audited_steps, 1)
        if facts.device_type == "cpu":
            gain, speedup = (
                "none on this CPU run; on an accelerator each call idles the device until its queue drains",
                1.0,
            )
        else:
            speedup = _speedup(m.step, m.step - seconds)
            gain = f"up to {speedup:.2f}x ({_ms(seconds)} per step spent waiting in this call)"
        found.append(
            Advice(
                f"remove the host sync {sync.call} at {sync.file}:{sync.line}",
                f"{sync.call} runs {per_step:g} time(s) per step at {sync.file}:{sync.line}",
                _SYNC_FIX.get(sync.call, _READ_LATER),
                gain,
                tier=1,
                speedup=speedup,
            )
        )
    return found


_READ_LATER = (
    "keep the value on the device: return it from Task.metrics (read at log points), or read it every N steps"
)
_SYNC_FIX = {
    "bool(tensor)": "decide on the device (torch.where, masking) or check every N steps",
    "print(tensor)": "log the value through Task.metrics instead of printing it every step",
    "format(tensor)": "log the value through Task.metrics instead of formatting it every step",
    "torch.cuda.synchronize()": "remove it: the next host read synchronises when one is really needed",
    "torch.cuda.empty_cache()": "remove it: the caching allocator reuses freed memory; emptying it "
    "makes every later allocation a slow cudaMalloc",
}


def retained_graphs(facts: RunFacts, m: Measurements) -> list[Advice]:
    return [
        Advice(
            f"stop keeping autograd graphs alive ({graph.file}:{graph.line})",
            f"{graph.tensors} tensor(s) with a grad_fn created at {graph.file}:{graph.line} were "
            f"still referenced a whole step later ({format_bytes(graph.bytes)} of their own)",
            "keep tensor.detach() (or a float read at log time) instead of the tensor itself",
            "memory: each kept tensor holds its step's graph; a list of them grows every step",
            tier=0,
        )
        for graph in m.retained_graphs
    ]


def all_reduce_every_micro_batch(facts: RunFacts, m: Measurements) -> list[Advice]:
    if facts.accumulation_steps < 2 or m.backward_calls == 0:
        return []
    per_step = m.backwards_with_all_reduce / m.backward_calls * facts.accumulation_steps
    if per_step <= 1.5:
        return []
    comm = m.phases.get("communication", 0.0)
    saved = comm * (1 - 1 / per_step)
    return [
        Advice(
            "all-reduce gradients once per optimizer step, not per micro-batch",
            f"{per_step:.1f} of {facts.accumulation_steps} backward passes per step all-reduce "
            f"gradients ({_ms(comm)} of exposed communication per step)",
            "run the forward and backward of non-final micro-batches inside model.no_sync()",
            f"up to {_speedup(m.step, m.step - saved):.2f}x",
            tier=1,
            speedup=_speedup(m.step, m.step - saved),
        )
    ]


def strategy_caveat(facts: RunFacts, m: Measurements) -> list[Advice]:
    """The known cost of the run's strategy, as the strategy itself states it."""
    if facts.strategy_caveat is None:
        return []
    title, why, change, gain = facts.strategy_caveat
    return [Advice(title, why, change, gain, tier=1)]


def communication(facts: RunFacts, m: Measurements) -> list[Advice]:
    comm = m.phases.get("communication", 0.0)
    if m.share("communication") < BOTTLENECK_SHARE:
        return []
    if facts.tensor_parallel > 1:
        return [_fewer_tensor_parallel_ranks(facts, m, comm)]
    found = []
    if facts.precision in ("32", "bf16-mixed", "16-mixed"):
        gain = _speedup(m.step, m.step - comm / 2)
        found.append(
            Advice(
                "all-reduce 16-bit gradients",
                f"the step waits {_ms(comm)} of {_ms(m.step)} for the gradient all-reduce; "
                f"precision {facts.precision} keeps fp32 gradients",
                "--precision bf16-true  (16-bit gradients: half the bytes; fp32 master weights)",
                f"up to {gain:.2f}x",
                tier=2,
                speedup=gain,
            )
        )
    compute = m.step - comm
    gain = 2 * m.step / (2 * compute + comm)  # per sample, with twice the batch per process
    found.append(
        Advice(
            "give each process more samples per all-reduce",
            f"communication is {m.share('communication'):.0%} of the step for "
            f"{facts.global_batch_size // facts.world_size} samples per process",
            f"--global-batch-size {facts.global_batch_size * 2}  (the optimisation changes: "
            "retune the learning rate, or --lr-scaling)",
            f"up to {gain:.2f}x samples/s",
            tier=2,
            speedup=gain,
        )
    )
    return found


def _fewer_tensor_parallel_ranks(facts: RunFacts, m: Measurements, comm: float) -> Advice:
    """Under --tp the step's communication is activations, at every block and micro-batch: more
    samples per rank or 16-bit gradients do not shrink it; fewer ranks per group do."""
    tp, half = facts.tensor_parallel, facts.tensor_parallel // 2
    if half > 1:  # half the group: half its collectives' bytes per rank
        change, gain = f"--tp {half}", _speedup(m.step, m.step - comm / 2)
    else:  # no tensor parallelism left (from 2 or 3): its collectives gone
        change, gain = (
            "--tp 1 --strategy fsdp  (if the state fits sharded alone)",
            _speedup(m.step, m.step - comm),
        )
    return Advice(
        "fewer ranks per tensor-parallel group",
        f"the step waits {_ms(comm)} of {_ms(m.step)} for tensor parallelism's collectives (activations "
        f"all-reduced, gathered or reduce-scattered at every block, over {tp} ranks)",
        change + "; on a cluster, keep each group inside a node",
        f"up to {gain:.2f}x, less what the data-parallel side then communicates",
        tier=2,
        speedup=gain,
    )


def memory_limits(facts: RunFacts, m: Measurements) -> list[Advice]:
    use = _memory_use(facts, m)
    if not facts.micro_batch_halved and use < MEMORY_PRESSURE:
        return []
    evidence = (
        "the run ran out of memory and halved its micro-batch"
        if facts.micro_batch_halved
        else f"the run uses {use:.0%} of its memory budget"
    )
    return [
        Advice(
            "make room: recompute activations or keep fewer bytes per value",
            evidence,
            "leantrain plan ... --memory-budget SIZE shows each option; then --activation-checkpointing "
            "auto, or --precision bf16-true",
            "a larger micro-batch fits (fewer, larger kernels); no more out-of-memory retries",
            tier=2,
        )
    ]


def micro_batch_far_below_fit(facts: RunFacts, m: Measurements) -> list[Advice]:
    if facts.memory_budget is None or m.memory is None or facts.accumulation_steps < 2:
        return []
    per_sample = m.memory.activation_bytes / facts.micro_batch_size
    state = m.memory.total_bytes - m.memory.activation_bytes
    free = facts.memory_budget * MEMORY_PRESSURE - state
    if per_sample <= 0 or free <= 0:
        return []
    per_process = facts.micro_batch_size * facts.accumulation_steps
    fits = [d for d in range(1, per_process + 1) if per_process % d == 0 and d * per_sample <= free]
    best = max(fits, default=facts.micro_batch_size)
    if best < MICRO_BATCH_HEADROOM * facts.micro_batch_size:
        return []
    return [
        Advice(
            "use a larger micro-batch",
            f"micro-batch {facts.micro_batch_size} saves {format_bytes(m.memory.activation_bytes)} for "
            f"backward, and {format_bytes(m.memory.total_bytes)} of the "
            f"{format_bytes(facts.memory_budget)} budget is used: micro-batch {best} fits",
            f"--micro-batch-size {best}  (or auto; the global batch and the results stay)",
            f"{facts.accumulation_steps} -> {per_process // best} micro-steps per step; "
            f"measure it: leantrain doctor --micro-batch-size {best}",
            tier=1,
        )
    ]


def fp32_on_fast_16bit(facts: RunFacts, m: Measurements) -> list[Advice]:
    ratio = facts.fast_16bit_ratio
    if facts.precision != "32" or ratio is None or ratio < 2:
        return []
    compute = m.share("forward", "backward")
    gain = 1 / (1 - compute * (1 - 1 / ratio))
    return [
        Advice(
            "compute in bf16",
            f"precision 32 on a device whose 16-bit matrix units are {ratio:.0f}x faster; forward and "
            f"backward are {compute:.0%} of the step",
            "--precision bf16-mixed  (fp32 weights and optimizer; matmuls in bf16)",
            f"up to {gain:.2f}x",
            tier=2,
            speedup=gain,
        )
    ]


def compile_the_model(facts: RunFacts, m: Measurements) -> list[Advice]:
    """Advised only on the doctor's own trial: on the CPU, compiling can be slower than eager
    (benchmarks/results/compile.md), so no gain is assumed."""
    trial = m.compile_trial  # only ever measured for an eager run
    if trial is None:
        return []
    gain = trial.speedup(m.step)
    if gain < COMPILE_WORTH:
        return []
    how = "each repeated block compiled once, in place" if trial.scope == "blocks" else "the whole model"
    return [
        Advice(
            f"compile the {'repeated blocks' if trial.scope == 'blocks' else 'model'} with torch.compile",
            f"measured: {_ms(m.step)} per step eagerly, {_ms(trial.step_seconds)} with --compile "
            f"{trial.scope} after {trial.compile_seconds:.1f} s of compiling",
            f"--compile {trial.scope}  ({how}; the first steps pay the compile time)",
            f"{gain:.2f}x samples/s after the first steps",
            tier=1,
            speedup=gain,
        )
    ]


def compiler_findings(facts: RunFacts, m: Measurements) -> list[Advice]:
    """A graph break splits the compiled code; a place recompiled more than once keeps compiling."""
    found = []
    for event in m.compiler_events:
        if event.kind == "graph break":
            found.append(
                Advice(
                    f"torch.compile graph break at {event.where}",
                    f"{event.reason}: the compiled graph ends there and the rest of the code runs in "
                    "another graph or eagerly",
                    "keep Python-side reads out of the compiled forward (.item(), printing a tensor, "
                    "branching on its value); compute such values outside it",
                    "the block compiles into one graph",
                )
            )
        elif event.count > 1:
            found.append(
                Advice(
                    f"torch.compile recompiled {event.count} times at {event.where}",
                    f"the first reason: {event.reason}",
                    "keep what the code branches on the same from step to step (fixed shapes, numbers "
                    "passed as tensors)",
                    "no compiling during training after the first steps",
                )
            )
    return found


RULES: tuple[Callable[[RunFacts, Measurements], list[Advice]], ...] = (
    retained_graphs,
    host_syncs,
    compiler_findings,
    more_workers,
    threads_compete_with_workers,
    pin_memory_off,
    workers_restart_every_epoch,
    all_reduce_every_micro_batch,
    strategy_caveat,
    micro_batch_far_below_fit,
    cache_items,
    pack_documents,
    communication,
    fp32_on_fast_16bit,
    compile_the_model,
    memory_limits,
)
