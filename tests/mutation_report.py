"""The table of `make mutate`: mutants made, killed and left, per module (tests/MUTATION.md).

Reads ``mutmut results --all true`` (run from the repository root after ``mutmut run``),
prints a markdown table and, with ``--write``, puts it into tests/MUTATION.md between the
``<!-- mutation table -->`` markers. A mutant's name is ``<module>.x_<function>__mutmut_<n>``
(``xǁClassǁmethod`` for methods), so its module is the part before ``.x``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

MUTATION_MD = Path(__file__).with_name("MUTATION.md")
BEGIN, END = "<!-- mutation table -->", "<!-- end of mutation table -->"
LINE = re.compile(r"^\s*(?P<module>[\w.]+)\.x[_ǁ]\S*__mutmut_\d+: (?P<status>.+?)\s*$")
# mutmut's words -> the table's columns; "not checked": the run was stopped before it got there.
COLUMNS = ("killed", "survived", "no tests", "timeout", "suspicious", "segfault", "not checked")


def counts(results: str) -> dict[str, Counter]:
    """Module -> status -> mutants, from the text of ``mutmut results --all true``."""
    by_module: dict[str, Counter] = defaultdict(Counter)
    for line in results.splitlines():
        match = LINE.match(line)
        if match:
            by_module[match["module"]][match["status"]] += 1
    return dict(by_module)


def table(by_module: dict[str, Counter]) -> str:
    """Markdown: one row per module and a total; *killed %* counts the mutants that ran (killed,
    survived or timed out: a timeout is a kill, the mutant made the tests hang)."""
    head = ["module", "mutants", *COLUMNS, "killed %"]
    rows = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    total: Counter = Counter()
    for module in sorted(by_module):
        rows.append(_row(module, by_module[module]))
        total.update(by_module[module])
    rows.append(_row("**all**", total))
    return "\n".join(rows)


def _row(name: str, found: Counter) -> str:
    ran = found["killed"] + found["survived"] + found["timeout"]
    share = f"{100 * (found['killed'] + found['timeout']) / ran:.1f}" if ran else "-"
    cells = [name, str(sum(found.values())), *(str(found[c]) for c in COLUMNS), share]
    return "| " + " | ".join(cells) + " |"


def write_into(markdown: Path, text: str) -> None:
    """Replace what lies between the markers of ``markdown`` with ``text``."""
    page = markdown.read_text()
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{markdown}: the markers {BEGIN} and {END} are missing")
    markdown.write_text(page[: start + len(BEGIN)] + "\n" + text + "\n" + page[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"also update the table in {MUTATION_MD}")
    args = parser.parse_args()
    mutmut = Path(sys.executable).with_name("mutmut")
    done = subprocess.run([mutmut, "results", "--all", "true"], capture_output=True, text=True, check=True)
    by_module = counts(done.stdout)
    if not by_module:
        raise SystemExit("no mutants found: run `make mutate` (or `mutmut run`) first")
    text = table(by_module)
    print(text)
    if args.write:
        write_into(MUTATION_MD, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
