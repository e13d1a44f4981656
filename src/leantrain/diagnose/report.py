"""The doctor's outputs: a terminal report (rich), JSON, and a self-contained HTML page.

The HTML page carries everything inline: charts as SVG drawn by matplotlib (text as
paths, no fonts to fetch), styles in a <style> element, no scripts. A Content Security
Policy in the page forbids any other load, so a browser shows it offline and refuses
anything a later change might add by mistake.
"""

from __future__ import annotations

import html
import io
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from leantrain.diagnose.advice import COMPILE_WORTH
from leantrain.diagnose.doctor import Diagnosis
from leantrain.diagnose.timer import PHASES
from leantrain.files import atomic_write
from leantrain.units import format_bytes

PHASE_COLOURS = {
    "data": "#d62728",
    "h2d": "#ff7f0e",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "communication": "#9467bd",
    "optimizer": "#8c564b",
    "other": "#7f7f7f",
}
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def short_path(path: str) -> str:
    """A path relative to the working folder when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def percent(share: float) -> str:
    """A share as a percentage with two significant digits below 10% (MFU is often tiny)."""
    return f"{share:.0%}" if share >= 0.1 or share == 0 else f"{share * 100:.2g}%"


def headline(d: Diagnosis) -> str:
    f = d.facts
    return (
        f"{d.verdict}: {d.phases['total'] * 1000:,.1f} ms per step, {d.samples_per_second:,.0f} samples/s, "
        f"MFU {percent(d.mfu)} (precision {f.precision}, micro-batch {f.micro_batch_size} x "
        f"{f.accumulation_steps} accumulation, {f.num_workers} loader worker(s), {f.world_size} "
        f"process(es), {f.device_type}"
        + ("" if f.padding_share is None else f", {percent(f.padding_share)} of tokens padding")
        + ")"
    )


def flops_line(d: Diagnosis) -> str:
    return (
        f"FLOPs per step {d.flops_per_step:,.4g}; peak {d.peak.flops_per_second / 1e12:,.3g} TFLOP/s "
        f"({d.peak.dtype}, {d.peak.source}); MFU {percent(d.mfu)}"
    )


def print_report(d: Diagnosis, console: Console) -> None:
    console.print(f"[bold]verdict: {headline(d)}[/bold]")
    schedule = d.schedule
    console.print(f"time per step by phase: mean of {schedule.timed} steps after {schedule.warmup} warm-up")
    phases = Table()
    for column in ("phase", "ms/step", "share"):
        phases.add_column(column, justify="left" if column == "phase" else "right")
    total = max(d.phases["total"], 1e-12)
    for phase in PHASES:
        phases.add_row(phase, f"{d.phases[phase] * 1000:,.2f}", percent(d.phases[phase] / total))
    phases.add_row("[bold]step[/bold]", f"{total * 1000:,.2f}", "100%")
    console.print(phases)
    console.print(flops_line(d))
    if d.memory is not None:
        parts = ", ".join(f"{kind} {format_bytes(size)}" for kind, size in d.memory.parts().items())
        console.print(
            f"memory: {parts}; total {format_bytes(d.memory.total_bytes)}; "
            f"process peak {format_bytes(d.peak_memory_bytes)}"
        )
    _print_findings(d, console)
    if d.nan_origin:
        console.print(f"non-finite step: {d.nan_origin}", markup=False, highlight=False)
    if not d.advice:
        console.print("advice: nothing to change found")
    for rank, advice in enumerate(d.advice, 1):
        console.print(f"[bold]{rank}. {escape(advice.title)}[/bold]", highlight=False)
        console.print(f"   evidence: {advice.evidence}", highlight=False, markup=False)
        console.print(f"   change:   {advice.change}", highlight=False, markup=False)
        console.print(f"   expected: {advice.expected_gain}", highlight=False, markup=False)
    if d.trace_dir:
        where = f"profiler trace of {schedule.traced} steps in {d.trace_dir} (TensorBoard or Perfetto)"
        console.print(where, markup=False)


def _print_findings(d: Diagnosis, console: Console) -> None:
    steps = max(d.audited_steps, 1)
    if d.host_syncs:
        table = Table(title=f"host syncs in your code (counted over {steps} steps)")
        for column in ("call", "where", "per step"):
            table.add_column(column)
        for sync in d.host_syncs:
            table.add_row(
                escape(sync.call), escape(f"{short_path(sync.file)}:{sync.line}"), f"{sync.per_step(steps):g}"
            )
        console.print(table)
    else:
        console.print("host syncs in your code: none")
    if d.retained_graphs:
        table = Table(title="tensors with autograd graphs alive a step after they were made")
        for column in ("created at", "tensors", "their bytes"):
            table.add_column(column)
        for graph in d.retained_graphs:
            where = escape(f"{short_path(graph.file)}:{graph.line}")
            table.add_row(where, str(graph.tensors), format_bytes(graph.bytes))
        console.print(table)
    else:
        console.print("retained graphs: none")
    if d.facts.compile != "none":
        table = Table(title=f"torch.compile (--compile {d.facts.compile}): graph breaks and recompilations")
        for column in ("kind", "where", "times", "reason"):
            table.add_column(column)
        for event in d.compiler_events:
            table.add_row(
                event.kind, escape(_short_where(event.where)), str(event.count), escape(event.reason)
            )
        console.print(table if d.compiler_events else "torch.compile: no graph breaks, no recompilations")
    if d.compile_trial is not None:
        console.print(compile_trial_line(d), highlight=False)


def compile_trial_line(d: Diagnosis) -> str:
    """The doctor's compiled trial, in one sentence."""
    trial = d.compile_trial
    assert trial is not None
    gain = trial.speedup(d.phases["total"])
    verdict = "advised" if gain >= COMPILE_WORTH else f"not advised (under {COMPILE_WORTH:.2f}x)"
    eager, compiled = d.phases["total"] * 1000, trial.step_seconds * 1000
    return (
        f"torch.compile trial: --compile {trial.scope} took {compiled:,.1f} ms per step against "
        f"{eager:,.1f} ms eagerly ({gain:.2f}x) after {trial.compile_seconds:.1f} s of compiling: {verdict}"
    )


def _short_where(where: str) -> str:
    path, _, line = where.rpartition(":")
    return f"{short_path(path)}:{line}" if path else where


# -- HTML ---------------------------------------------------------------------------


def _pyplot() -> Any:
    """matplotlib's pyplot drawing off screen, text as paths (a page with no font to load)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "path"
    return plt


def _svg(figure: Any) -> str:
    """``figure`` as inline SVG (no XML declaration or doctype), cropped to what it draws (the legend
    beside the axes included); the figure is closed."""
    buffer = io.StringIO()
    try:
        figure.savefig(buffer, format="svg", bbox_inches="tight")
    finally:
        _pyplot().close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def phase_figure(d: Diagnosis) -> Any:
    """Stacked bars: milliseconds per phase for every timed step."""
    from matplotlib.ticker import MaxNLocator

    figure, axes = _pyplot().subplots(figsize=(8, 3.2))
    steps = list(range(d.schedule.warmup + 1, d.schedule.warmup + 1 + len(d.step_phases)))
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        values = [row[phase] * 1000 for row in d.step_phases]
        if any(values):
            axes.bar(steps, values, bottom=bottom, color=PHASE_COLOURS[phase], label=phase, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("step")
    axes.set_ylabel("ms")
    axes.set_title("time per step by phase")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes.spines[["top", "right"]].set_visible(False)
    return figure


def memory_figure(d: Diagnosis) -> Any:
    """Horizontal bars: bytes by kind."""
    assert d.memory is not None
    labels, sizes = zip(*d.memory.parts().items(), strict=True)
    # The axis in the largest unit that keeps the biggest bar at 1 or more.
    units = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    unit, scale = next(((name, size) for name, size in units if max(sizes) >= size), ("B", 1))
    values = [size / scale for size in sizes]
    figure, axes = _pyplot().subplots(figsize=(8, 2.2))
    colors = ["#1f77b4", "#2ca02c", "#8c564b", "#ff7f0e", "#9467bd"][: len(sizes)]
    bars = axes.barh(labels, values, color=colors)
    axes.bar_label(bars, labels=[format_bytes(size) for size in sizes], padding=3)
    axes.invert_yaxis()
    axes.set_xlabel(unit)
    axes.set_title(f"memory by kind (total {format_bytes(d.memory.total_bytes)})")
    axes.spines[["top", "right"]].set_visible(False)
    return figure


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 62rem; margin: 2rem auto; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
.verdict { font-size: 1.2rem; padding: .6rem 1rem; background: #fff4e0; border-left: 4px solid #e69500; }
table { border-collapse: collapse; margin: .5rem 0; }
td, th { padding: .25rem .7rem; border-bottom: 1px solid #ddd; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
code { background: #f3f3f3; padding: 0 .2rem; }
ol li { margin-bottom: .8rem; }
.chart svg { max-width: 100%; height: auto; }
"""


def _rows(rows: list[list[str]], numeric_from: int = 1) -> str:
    out = []
    for row in rows:
        cells = "".join(
            f'<td class="n">{html.escape(c)}</td>' if i >= numeric_from else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(row)
        )
        out.append(f"<tr>{cells}</tr>")
    return "".join(out)


def _table(headers: list[str], rows: str) -> str:
    if not rows:
        return "<p>None.</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    return f"<table><tr>{head}</tr>{rows}</table>"


def render_html(d: Diagnosis) -> str:
    total = max(d.phases["total"], 1e-12)
    phase_rows = [[p, f"{d.phases[p] * 1000:,.2f}", percent(d.phases[p] / total)] for p in PHASES]
    phase_rows.append(["step", f"{total * 1000:,.2f}", "100%"])
    steps = max(d.audited_steps, 1)
    syncs = _rows(
        [[s.call, f"{short_path(s.file)}:{s.line}", f"{s.per_step(steps):g}"] for s in d.host_syncs], 2
    )
    graphs = _rows(
        [[f"{short_path(g.file)}:{g.line}", str(g.tensors), format_bytes(g.bytes)] for g in d.retained_graphs]
    )
    compiler = _rows([[e.kind, _short_where(e.where), str(e.count), e.reason] for e in d.compiler_events], 2)
    trial = "" if d.compile_trial is None else f"<p>{html.escape(compile_trial_line(d))}.</p>"
    compiled = trial + (
        "" if d.facts.compile == "none"
        else f"<h2>torch.compile: graph breaks and recompilations</h2>\n"
        f"{_table(['kind', 'where', 'times', 'reason'], compiler)}"
    )  # fmt: skip
    advice = "".join(
        f"<li><b>{html.escape(a.title)}</b><br>evidence: {html.escape(a.evidence)}<br>"
        f"change: <code>{html.escape(a.change)}</code><br>expected: {html.escape(a.expected_gain)}</li>"
        for a in d.advice
    )
    memory = "" if d.memory is None else f'<h2>Memory</h2><div class="chart">{_svg(memory_figure(d))}</div>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<title>leantrain doctor: {html.escape(d.verdict)}</title><style>{_STYLE}</style></head>
<body>
<h1>leantrain doctor</h1>
<p class="verdict">{html.escape(headline(d))}</p>
<h2>Advice, in the order to try it</h2>
{f"<ol>{advice}</ol>" if advice else "<p>Nothing to change found.</p>"}
<h2>Time per step by phase</h2>
<div class="chart">{_svg(phase_figure(d))}</div>
{_table(["phase", "ms/step", "share"], _rows(phase_rows))}
<p>{html.escape(flops_line(d))}.</p>
{memory}
<h2>Host syncs in your code</h2>
{_table(["call", "where", "per step"], syncs)}
<h2>Retained graphs</h2>
{_table(["created at", "tensors", "bytes"], graphs)}
{compiled}
</body></html>
"""


def write_html(d: Diagnosis, path: str | Path) -> Path:
    path = Path(path)
    page = render_html(d)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return path
