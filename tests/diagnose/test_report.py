"""The doctor's terminal report: every figure of a Diagnosis where the report says it is, each table
under its title and column names, and text from the run (code, paths, compiler reasons) shown as it is.

rich reads ``[...]`` as markup: a compiler's reason with ``[/tmp/x]`` in it made the report fail, and
``[input_ids]`` in advice vanished. Text from the run is escaped, and these tests put brackets in it."""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import re
import subprocess
import sys
from html.parser import HTMLParser
from typing import Any

import pytest
from rich.console import Console

from leantrain.diagnose.advice import Advice, CompileTrial, RunFacts
from leantrain.diagnose.doctor import Diagnosis
from leantrain.diagnose.flops import PeakFlops
from leantrain.diagnose.probe import Schedule
from leantrain.diagnose.report import (
    compile_trial_line,
    flops_line,
    headline,
    percent,
    print_report,
    render_html,
)
from leantrain.diagnose.syncs import HostSync, RetainedGraph
from leantrain.diagnose.timer import PHASES
from leantrain.memory.accountant import MemoryBreakdown
from leantrain.step.compilation import CompilerEvent
from leantrain.units import format_bytes

MS = {"data": 4.0, "h2d": 0.0, "forward": 10.0, "backward": 20.0, "communication": 0.0, "optimizer": 3.0}
MS["other"] = 0.5


def diagnosis(**changes) -> Diagnosis:
    """A run with every finding the report can show."""
    phases = {phase: MS[phase] / 1000 for phase in PHASES}
    phases["total"] = sum(phases.values())
    here = os.path.abspath
    fields = dict(
        verdict="compute-bound", phases=phases, step_phases=[phases], samples_per_second=426.7,
        flops_per_step=123_456_789, peak=PeakFlops(2e12, "float32", "measured: 1024^3 matmul [2 threads]"),
        mfu=0.0123, memory=MemoryBreakdown(4096, 4096, 8192, 2**20), peak_memory_bytes=3 * 2**20,
        host_syncs=[HostSync("batch[labels].item()", here("train.py"), 12, 6, 0.01)], engine_host_syncs=[],
        audited_steps=3, retained_graphs=[RetainedGraph(here("[w]/model.py"), 40, 2, 2048)],
        compiler_events=[CompilerEvent("graph break", f"{here('model.py')}:41", "reads [/tmp/x] [bold]", 3)],
        compile_trial=CompileTrial("blocks", 0.025, 12.5),
        advice=[
            Advice("pin [host] batches", "batch[input_ids] copies 4 ms", "--pin-memory [cuda]", "10% [est]"),
            Advice("second", "e2", "c2", "g2"),
        ],
        facts=RunFacts(compile="blocks"), schedule=Schedule(warmup=2, timed=5, traced=1),
        trace_dir="/tmp/[trace]", nan_origin="non-finite loss at step 3 in [bold]x[/bold]",
    )  # fmt: skip
    return Diagnosis(**{**fields, **changes})


def report(d: Diagnosis, styles: bool = False) -> list[str]:
    """The report's lines; with ``styles``, in a colour terminal's escape codes."""
    console = Console(record=True, width=200, force_terminal=True, color_system="standard")
    print_report(d, console)
    return console.export_text(styles=styles).splitlines()


def table(lines: list[str], title: str | None = None) -> tuple[list[str], list[list[str]]]:
    """The column names and rows of the table under ``title`` (the first table when None; a title wider
    than its table is drawn on several lines), each cell as it is drawn (with its padding: where the text
    sits tells how it is justified)."""
    headers = [i for i, line in enumerate(lines) if line.startswith("┃")]
    if title is None:
        header = headers[0]
    else:
        # the lines above the table's top border end with its title
        header = next(i for i in headers if " ".join(line.strip() for line in lines[: i - 1]).endswith(title))
    names = [cell.strip() for cell in lines[header].split("┃")[1:-1]]
    rows = []
    for line in lines[header + 2 :]:
        if not line.startswith("│"):
            break
        rows.append(line.split("│")[1:-1])
    return names, rows


def right_justified(cell: str) -> bool:
    return cell.endswith(" ") and not cell.endswith("  ") and cell.startswith("  ")


def test_the_report_shows_each_figure_where_it_says():
    d = diagnosis()
    lines = report(d)
    assert lines[0] == f"verdict: {headline(d)}"
    assert lines[1] == "time per step by phase: mean of 5 steps after 2 warm-up"
    names, rows = table(lines)
    assert names == ["phase", "ms/step", "share"]
    total = sum(MS.values())
    assert [row[0].strip() for row in rows] == [*PHASES, "step"]
    for row, phase in zip(rows, PHASES, strict=False):
        assert (
            float(row[1]) == MS[phase]
            and abs(float(row[2].strip().rstrip("%")) - 100 * MS[phase] / total) < 1
        )
        assert not row[0].startswith("  ") and all(
            right_justified(cell) for cell in row[1:] if cell.strip() != "0%"
        )
    assert [cell.strip() for cell in rows[-1]] == ["step", f"{total:.2f}", "100%"]
    assert flops_line(d) in lines  # its brackets kept
    parts = ", ".join(f"{kind} {format_bytes(size)}" for kind, size in d.memory.parts().items())
    assert f"memory: {parts}; total {format_bytes(d.memory.total_bytes)}; process peak 3.0 MiB" in lines
    assert parts.startswith("params 4.0 KiB, grads 4.0 KiB, optimizer 8.0 KiB, activation 1.0 MiB")


def test_the_findings_are_tables_of_places_in_your_code_with_their_counts():
    lines = report(diagnosis())
    names, rows = table(lines, "host syncs in your code (counted over 3 steps)")
    assert names == ["call", "where", "per step"]
    assert [[cell.strip() for cell in row] for row in rows] == [["batch[labels].item()", "train.py:12", "2"]]
    names, rows = table(lines, "tensors with autograd graphs alive a step after they were made")
    assert names == ["created at", "tensors", "their bytes"]
    assert [[cell.strip() for cell in row] for row in rows] == [["[w]/model.py:40", "2", "2.0 KiB"]]
    names, rows = table(lines, "torch.compile (--compile blocks): graph breaks and recompilations")
    assert names == ["kind", "where", "times", "reason"]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["graph break", "model.py:41", "3", "reads [/tmp/x] [bold]"]
    ]
    # no audited step: counted over one (the counts are not divided by zero, nor by two)
    unaudited = report(diagnosis(audited_steps=0))
    assert [
        cell.strip() for cell in table(unaudited, "host syncs in your code (counted over 1 steps)")[1][0]
    ][2] == "6"


def test_the_headline_gives_the_step_the_speed_and_the_runs_facts():
    d = diagnosis(phases={**diagnosis().phases, "total": 1.23456})
    facts = "(precision 32, micro-batch 1 x 1 accumulation, 0 loader worker(s), 1 process(es), cpu"
    assert headline(d) == f"compute-bound: 1,234.6 ms per step, 427 samples/s, MFU 1.2% {facts})"
    padded = dataclasses.replace(d, facts=dataclasses.replace(d.facts, padding_share=0.25))
    assert (
        headline(padded)
        == f"compute-bound: 1,234.6 ms per step, 427 samples/s, MFU 1.2% {facts}, 25% of tokens padding)"
    )


def test_shares_show_two_significant_digits_below_ten_percent_and_the_flops_line_its_units():
    assert [percent(share) for share in (0, 1, 0.5, 0.1, 0.0999, 0.0123, 0.000081)] == [
        "0%", "100%", "50%", "10%", "10%", "1.2%", "0.0081%"
    ]  # fmt: skip
    assert flops_line(diagnosis()) == (
        "FLOPs per step 1.235e+08; peak 2 TFLOP/s (float32, measured: 1024^3 matmul [2 threads]); MFU 1.2%"
    )


def test_the_compile_trial_nan_origin_advice_and_trace_are_shown_as_they_are():
    d = diagnosis()
    lines = report(d)
    trial = compile_trial_line(d)
    assert trial in lines
    assert trial == (
        "torch.compile trial: --compile blocks took 25.0 ms per step against 37.5 ms eagerly (1.50x) after "
        "12.5 s of compiling: advised"
    )
    # at the threshold (1.03x) it is advised, a hair under it not
    at = diagnosis(phases={**d.phases, "total": 1.03}, compile_trial=CompileTrial("model", 1.0, 3.0))
    assert compile_trial_line(at) == (
        "torch.compile trial: --compile model took 1,000.0 ms per step against 1,030.0 ms eagerly (1.03x) "
        "after 3.0 s of compiling: advised"
    )
    under = dataclasses.replace(at, compile_trial=CompileTrial("model", 1.0001, 3.0))
    assert compile_trial_line(under).endswith("(1.03x) after 3.0 s of compiling: not advised (under 1.03x)")
    assert "non-finite step: non-finite loss at step 3 in [bold]x[/bold]" in lines
    advice = lines[lines.index("1. pin [host] batches") :]
    assert advice[:8] == [
        "1. pin [host] batches",
        "   evidence: batch[input_ids] copies 4 ms",
        "   change:   --pin-memory [cuda]",
        "   expected: 10% [est]",
        "2. second",
        "   evidence: e2",
        "   change:   c2",
        "   expected: g2",
    ]
    assert lines[-1] == "profiler trace of 1 steps in /tmp/[trace] (TensorBoard or Perfetto)"
    # the figures in these lines are not coloured as rich colours numbers: plain text, bold titles
    styled = report(d, styles=True)
    plain = [line for line in styled if line.startswith(("   ", "non-finite", "torch.compile trial"))]
    assert len(plain) == 8 and not any("\x1b[" in line for line in plain)
    assert "\x1b[1m1. pin [host] batches" in "\n".join(styled)


def test_a_report_with_nothing_found_says_so_and_shows_no_empty_section():
    quiet = diagnosis(
        host_syncs=[], retained_graphs=[], compiler_events=[], compile_trial=None, advice=[], memory=None,
        nan_origin=None, trace_dir=None,
    )  # fmt: skip
    lines = report(quiet)
    for line in ("host syncs in your code: none", "retained graphs: none", "advice: nothing to change found"):
        assert line in lines
    assert "torch.compile: no graph breaks, no recompilations" in lines  # --compile blocks, nothing seen
    assert not any(
        line.startswith(("memory:", "non-finite", "profiler", "torch.compile trial")) for line in lines
    )
    eager = report(diagnosis(facts=RunFacts(compile="none"), compile_trial=None))
    assert not any(line.lstrip().startswith("torch.compile") for line in eager)


def test_places_are_shown_relative_to_the_working_folder_when_below_it(tmp_path, monkeypatch):
    from leantrain.diagnose.report import _short_where, short_path

    monkeypatch.chdir(tmp_path)
    assert short_path(str(tmp_path / "src" / "model.py")) == "src/model.py"
    outside = str(tmp_path.parent / "other.py")
    assert short_path(outside) == outside  # not ../other.py
    assert _short_where(f"{tmp_path / 'model.py'}:41") == "model.py:41"
    assert _short_where(f"{tmp_path / 'c:d.py'}:7") == "c:d.py:7"  # the line number after the last colon
    assert _short_where("<eval_with_key>") == "<eval_with_key>"  # no file and line: as it is


def test_the_html_page_is_utf8_in_a_new_folder_whatever_the_locale(tmp_path):
    """A container's C locale, where Python does not coerce it, writes text files as ASCII: a compiler's
    reason naming ``café.py`` must still reach the page, in a folder that is not there yet."""
    d = diagnosis(compiler_events=[CompilerEvent("graph break", "model.py:41", "reads café.py", 1)])
    (tmp_path / "diagnosis.pkl").write_bytes(pickle.dumps(d))
    page = tmp_path / "new" / "folder" / "report.html"
    code = (
        "import pickle, sys; from leantrain.diagnose.report import write_html; "
        "d = pickle.load(open(sys.argv[1], 'rb')); write_html(d, sys.argv[2]); "
        "write_html(d, sys.argv[2])"  # the second time over the first page
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "diagnosis.pkl"), str(page)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # The charts aside (matplotlib dates them and names their clip paths at random), the page as rendered.
    text = functools.partial(re.sub, r"<svg.*?</svg>", "", flags=re.DOTALL)
    assert text(page.read_bytes().decode("utf-8")) == text(render_html(d))
    assert "reads café.py" in text(render_html(d))


def test_the_html_pages_charts_draw_each_phase_and_each_kind_of_memory():
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from leantrain.diagnose.report import PHASE_COLOURS, _svg, memory_figure, phase_figure

    first = diagnosis().phases
    second = {**{phase: seconds / 5 for phase, seconds in first.items()}, "optimizer": 0.0}
    d = diagnosis(step_phases=[first, second], schedule=Schedule(warmup=2, timed=2, traced=1))
    figure = phase_figure(d)
    axes = figure.axes[0]
    assert (axes.get_title(), axes.get_xlabel(), axes.get_ylabel()) == (
        "time per step by phase",
        "step",
        "ms",
    )
    drawn = [bars.get_label() for bars in axes.containers]
    assert drawn == ["data", "forward", "backward", "optimizer", "other"]  # those that took time, in order
    below = [0.0, 0.0]
    for phase, bars in zip(drawn, axes.containers, strict=True):  # stacked, in ms, at steps 3 and 4
        heights = [row[phase] * 1000 for row in d.step_phases]
        assert [bar.get_x() + bar.get_width() / 2 for bar in bars] == [3, 4]
        assert [bar.get_height() for bar in bars] == pytest.approx(heights)
        assert [bar.get_y() for bar in bars] == pytest.approx(below)
        assert {to_hex(bar.get_facecolor()) for bar in bars} == {PHASE_COLOURS[phase]}
        assert [bar.get_width() for bar in bars] == pytest.approx([0.8, 0.8])
        below = [b + h for b, h in zip(below, heights, strict=True)]
    legend = axes.get_legend()
    assert [text.get_text() for text in legend.get_texts()] == drawn and not legend.get_frame_on()
    figure.canvas.draw()
    assert all(tick == int(tick) for tick in axes.get_xticks())  # steps are whole numbers
    renderer = figure.canvas.get_renderer()
    # beside the bars, also where the plot's top right is empty (the second step is short)
    beside, plot = legend.get_window_extent(renderer), axes.get_window_extent(renderer)
    assert 0 < beside.x0 - plot.x1 < 0.05 * plot.width  # just right of the axes, its top at theirs
    assert abs(beside.y1 - plot.y1) < 0.05 * plot.height
    assert [side for side, spine in axes.spines.items() if spine.get_visible()] == ["left", "bottom"]
    assert tuple(figure.get_size_inches()) == (8, 3.2)
    # the SVG holds what is drawn, the legend beside the axes included (not the figure's 8 x 3.2 in)
    box = figure.get_tightbbox(renderer)
    size = re.search(r'<svg[^>]* width="([\d.]+)pt" height="([\d.]+)pt"', _svg(figure))
    padded = [(inches + 0.2) * 72 for inches in (box.width, box.height)]  # 0.1 in around, in points
    assert [float(points) for points in size.groups()] == pytest.approx(padded, rel=0.01)

    figure = memory_figure(d)
    axes = figure.axes[0]
    [bars] = axes.containers
    kinds = ["params", "grads", "optimizer", "activation"]
    assert [label.get_text() for label in axes.get_yticklabels()] == kinds
    assert axes.yaxis_inverted()  # the first kind on top
    assert [bar.get_width() for bar in bars] == [4096 / 2**20, 4096 / 2**20, 8192 / 2**20, 1.0]  # in MiB
    assert [to_hex(bar.get_facecolor()) for bar in bars] == ["#1f77b4", "#2ca02c", "#8c564b", "#ff7f0e"]
    assert [text.get_text() for text in axes.texts] == ["4.0 KiB", "4.0 KiB", "8.0 KiB", "1.0 MiB"]
    assert [text.xyann for text in axes.texts] == [(3, 0)] * 4  # 3 points past the end of each bar
    total = format_bytes(d.memory.total_bytes)
    assert (axes.get_xlabel(), axes.get_title()) == ("MiB", f"memory by kind (total {total})")
    assert tuple(figure.get_size_inches()) == (8, 2.2)
    assert [side for side, spine in axes.spines.items() if spine.get_visible()] == ["left", "bottom"]
    current = plt.figure()  # _svg closes the figure it draws, not whichever is current
    _svg(figure)
    assert (plt.fignum_exists(figure.number), plt.fignum_exists(current.number)) == (False, True)
    plt.close(current)


class _Page(HTMLParser):
    """A doctor page's blocks in order: ("title" | "h1" | "h2" | "p" | "li", text) and ("table", rows),
    each row a list of (cell text, is it right-aligned); a <br> reads as a line break; text outside them
    (but the style and the charts) as ("stray", text)."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.blocks: list[tuple[str, Any]] = []
        self._text: list[str] | None = None
        self._rows: list[list[tuple[str, bool]]] | None = None
        self._numeric = False
        self._skipped = 0  # inside <style> or a chart's <svg>
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self._skipped += tag in ("style", "svg")
        if tag == "table":
            self._rows = []
        elif tag == "tr" and self._rows is not None:
            self._rows.append([])
        elif tag in ("title", "h1", "h2", "p", "li", "td", "th"):
            self._text, self._numeric = [], ("class", "n") in attrs
        elif tag == "br" and self._text is not None:
            self._text.append("\n")

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)
        elif data.strip() and not self._skipped:
            self.blocks.append(("stray", data))

    def handle_endtag(self, tag):
        self._skipped -= tag in ("style", "svg")
        if tag in ("td", "th") and self._rows is not None and self._text is not None:
            self._rows[-1].append(("".join(self._text), self._numeric))
        elif tag in ("title", "h1", "h2", "p", "li") and self._text is not None:
            self.blocks.append((tag, "".join(self._text)))
        elif tag == "table" and self._rows is not None:
            self.blocks.append(("table", self._rows))
            self._rows = None
        if tag in ("td", "th", "title", "h1", "h2", "p", "li"):
            self._text = None

    def after(self, heading: str) -> list[tuple[str, Any]]:
        """The blocks between the ``h2`` named ``heading`` and the next ``h2``."""
        start = self.blocks.index(("h2", heading)) + 1
        end = next((i for i in range(start, len(self.blocks)) if self.blocks[i][0] == "h2"), len(self.blocks))
        return self.blocks[start:end]


def test_the_html_page_shows_each_figure_in_its_section_escaped():
    event = CompilerEvent("recompilation", "model.py:41", "reads <tensor> & [x]", 3)
    d = diagnosis(compiler_events=[event])
    raw = render_html(d)
    assert "<tensor>" not in raw and "&lt;tensor&gt; &amp; [x]" in raw  # the page's text, not its markup
    page = _Page(raw)
    assert not [text for tag, text in page.blocks if tag == "stray"]
    assert page.blocks[:3] == [("title", "leantrain doctor: compute-bound"), ("h1", "leantrain doctor"),
                               ("p", headline(d))]  # fmt: skip
    assert [text for tag, text in page.blocks if tag == "h2"] == [
        "Advice, in the order to try it", "Time per step by phase", "Memory", "Host syncs in your code",
        "Retained graphs", "torch.compile: graph breaks and recompilations",
    ]  # fmt: skip
    assert page.after("Advice, in the order to try it") == [
        ("li", "pin [host] batches\nevidence: batch[input_ids] copies 4 ms\nchange: --pin-memory [cuda]\n"
               "expected: 10% [est]"),
        ("li", "second\nevidence: e2\nchange: c2\nexpected: g2"),
    ]  # fmt: skip
    assert "<code>--pin-memory [cuda]</code>" in raw
    # MS's milliseconds of a 37.5 ms step, and their shares of it
    shown = [("data", "4.00", "11%"), ("h2d", "0.00", "0%"), ("forward", "10.00", "27%"),
             ("backward", "20.00", "53%"), ("communication", "0.00", "0%"), ("optimizer", "3.00", "8%"),
             ("other", "0.50", "1.3%"), ("step", "37.50", "100%")]  # fmt: skip
    phases = [[("phase", False), ("ms/step", False), ("share", False)]] + [
        [(phase, False), (ms, True), (share, True)] for phase, ms, share in shown
    ]
    assert page.after("Time per step by phase") == [("table", phases), ("p", flops_line(d) + ".")]
    assert page.after("Memory") == []  # its chart only
    assert page.after("Host syncs in your code") == [("table", [
        [("call", False), ("where", False), ("per step", False)],
        [("batch[labels].item()", False), ("train.py:12", False), ("2", True)],  # 6 calls over 3 steps
    ])]  # fmt: skip
    assert page.after("Retained graphs") == [("table", [
        [("created at", False), ("tensors", False), ("bytes", False)],
        [("[w]/model.py:40", False), ("2", True), ("2.0 KiB", True)],
    ]), ("p", compile_trial_line(d) + ".")]  # fmt: skip
    assert page.after("torch.compile: graph breaks and recompilations") == [("table", [
        [("kind", False), ("where", False), ("times", False), ("reason", False)],
        [("recompilation", False), ("model.py:41", False), ("3", True), ("reads <tensor> & [x]", True)],
    ])]  # fmt: skip


def test_an_html_page_with_nothing_found_says_so_and_leaves_out_what_was_not_run():
    quiet = diagnosis(host_syncs=[], retained_graphs=[], compiler_events=[], compile_trial=None, advice=[],
                      memory=None)  # fmt: skip
    page = _Page(render_html(quiet))
    assert not [text for tag, text in page.blocks if tag == "stray"]
    assert page.after("Advice, in the order to try it") == [("p", "Nothing to change found.")]
    assert page.after("Host syncs in your code") == [("p", "None.")]
    assert page.after("Retained graphs") == [("p", "None.")]
    assert page.after("torch.compile: graph breaks and recompilations") == [("p", "None.")]
    assert ("h2", "Memory") not in page.blocks
    assert not any(tag == "p" and text.startswith("torch.compile trial") for tag, text in page.blocks)
    eager = _Page(render_html(diagnosis(facts=RunFacts(compile="none"), compile_trial=None, audited_steps=0)))
    assert eager.after("Host syncs in your code")[0][1][1][2] == ("6", True)  # no step audited: as one
    assert not [text for tag, text in eager.blocks if tag == "stray"]
    assert [text for tag, text in eager.blocks if tag == "h2"][-1] == "Retained graphs"  # nothing compiled


@pytest.mark.parametrize(
    ("activation", "unit", "widths"),
    [
        (3 * 2**30, "GiB", [4096 / 2**30, 4096 / 2**30, 8192 / 2**30, 3.0]),
        (2**30 - 1, "MiB", [4096 / 2**20, 4096 / 2**20, 8192 / 2**20, (2**30 - 1) / 2**20]),
        (3 * 2**10, "KiB", [4.0, 4.0, 8.0, 3.0]),
    ],
)
def test_the_memory_chart_is_in_the_largest_unit_its_biggest_bar_reaches(activation, unit, widths):
    from leantrain.diagnose.report import memory_figure

    d = diagnosis(memory=MemoryBreakdown(4096, 4096, 8192, activation))
    axes = memory_figure(d).axes[0]
    [bars] = axes.containers
    assert axes.get_xlabel() == unit
    assert [bar.get_width() for bar in bars] == pytest.approx(widths)
    tiny = memory_figure(diagnosis(memory=MemoryBreakdown(10, 20, 30, 1000))).axes[0]
    assert tiny.get_xlabel() == "B" and [bar.get_width() for bar in tiny.containers[0]] == [10, 20, 30, 1000]


def test_the_memory_chart_shows_the_weights_average_in_a_fifth_colour():
    from matplotlib.colors import to_hex

    from leantrain.diagnose.report import memory_figure

    axes = memory_figure(diagnosis(memory=MemoryBreakdown(10, 20, 30, 40, ema_bytes=50))).axes[0]
    assert [label.get_text() for label in axes.get_yticklabels()][-1] == "ema"
    colours = [to_hex(bar.get_facecolor()) for bar in axes.containers[0]]
    assert colours == ["#1f77b4", "#2ca02c", "#8c564b", "#ff7f0e", "#9467bd"]
