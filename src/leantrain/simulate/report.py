"""The tables ``leantrain plan --cluster`` prints: one plan by kind of memory, or the search's layouts."""

from __future__ import annotations

from collections.abc import Sequence

from rich.markup import escape
from rich.table import Table

from leantrain.simulate.cluster_plan import ALLOCATOR_OVERHEAD, CUDA_CONTEXT_BYTES, ClusterPlan
from leantrain.simulate.search import Tried
from leantrain.units import format_bytes

# MemTracker's kinds, in the order the table shows them, with the names the table gives them.
KINDS = {
    "Parameter": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Buffer": "buffers",
    "Other": "held by the strategy",  # what a wrapper the plan could not build holds (DDP's buckets)
}


def _seconds(value: float) -> str:
    return f"{value * 1e3:,.1f} ms" if value < 1 else f"{value:,.2f} s"


def plan_notes(plan: ClusterPlan, fit_flags: Sequence[str] = ()) -> list[str]:
    """What goes under a plan's table: its launch line, then the time model's assumptions."""
    commands = ["launch: " + plan.command(fit_flags), "or:     " + plan.slurm_command(fit_flags)]
    if plan.layout.compile != "none":
        commands.append(
            f"- --compile {plan.layout.compile} is planned eagerly: a compiled step may hold less (its "
            "partitioner recomputes cheap values) and run faster than planned"
        )
    return [*commands, *(f"- {line}" for line in plan.time.assumptions)]


def plan_table(plan: ClusterPlan) -> Table:
    """Memory per GPU at the step's peak by kind, what the allocator reserves, the modelled time."""
    layout = plan.layout
    title = (
        f"per GPU on {plan.cluster}: {layout.strategy}, dp {plan.dp} x tp {layout.tp}, micro-batch "
        f"{layout.micro_batch_size} x {plan.accumulation}, {layout.precision}, recompute "
        f"{layout.activation_checkpointing or '-'}"
    )
    table = Table(title=title, show_header=True)
    table.add_column("at the peak", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    for kind, name in KINDS.items():
        if plan.peak.get(kind):
            table.add_row(name, format_bytes(plan.peak[kind]))
    table.add_row("live tensors", format_bytes(plan.peak.get("Total", 0)), style="bold")
    reserved = f"reserved (allocator +{ALLOCATOR_OVERHEAD:.0%}, modelled)"
    table.add_row(reserved, format_bytes(plan.reserved_bytes))
    table.add_row("CUDA context (assumed)", format_bytes(CUDA_CONTEXT_BYTES))
    headroom = plan.cluster.memory_bytes - plan.reserved_bytes - CUDA_CONTEXT_BYTES
    verdict = "fits" if plan.fits else "does NOT fit"
    gpu = format_bytes(plan.cluster.memory_bytes)
    table.add_row(f"{verdict}: GPU {gpu}", f"{format_bytes(headroom)} free")
    time = plan.time
    table.add_row("step (modelled)", _seconds(time.step_s), style="bold")
    table.add_row("  compute", _seconds(time.compute_s))
    table.add_row("  communication, exposed of all", f"{_seconds(time.exposed_communication_s)} of "
                  f"{_seconds(time.communication_s)}")  # fmt: skip
    if time.tokens_per_s_per_gpu is not None:
        table.add_row("tokens/s per GPU (modelled)", f"{time.tokens_per_s_per_gpu:,.0f}")
    return table


def search_table(tried: Sequence[Tried], fit_flags: Sequence[str] = (), shown: int = 20) -> Table:
    """The layouts, fitting ones first and fastest first; the first ``shown``."""
    fitting = sum(one.fits for one in tried)
    table = Table(title=f"{len(tried)} layouts tried, {fitting} fit (fastest first)")
    columns = ("strategy", "dp x tp", "micro x acc", "recompute", "precision", "peak", "reserved", "fits",
               "step", "tokens/s/GPU")  # fmt: skip
    for column in columns:
        left = column in ("strategy", "recompute")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    for one in tried[:shown]:
        cfg, plan = one.cfg, one.plan
        if plan is None:
            recompute = cfg.activation_checkpointing or "-"
            table.add_row(
                cfg.strategy, f"? x {cfg.tp}", f"{cfg.micro_batch_size}", recompute, cfg.precision,
                "", "", "no", escape(one.reason or ""), "",
            )  # fmt: skip
            continue
        tokens, layout = plan.time.tokens_per_s_per_gpu, plan.layout
        table.add_row(
            layout.strategy, f"{plan.dp} x {layout.tp}", f"{layout.micro_batch_size} x {plan.accumulation}",
            layout.activation_checkpointing or "-", layout.precision, format_bytes(plan.peak.get("Total", 0)),
            format_bytes(plan.reserved_bytes), "yes" if plan.fits else "no", _seconds(plan.time.step_s),
            "" if tokens is None else f"{tokens:,.0f}",
        )  # fmt: skip
    best = next((one.plan for one in tried if one.fits and one.plan is not None), None)
    table.caption = (
        "fastest that fits: " + escape(best.command(fit_flags)) if best is not None else "no layout fits"
    )
    return table
