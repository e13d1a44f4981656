"""The table of `make mutate`: mutants made, killed and left, per module (tests/MUTATION.md).

Reads ``mutmut results --all true`` (run from the repository root after ``mutmut run``),
prints a markdown table and, with ``--write``, puts it into tests/MUTATION.md between the
``<!-- mutation table -->`` markers. A mutant's name is ``<module>.x_<function>__mutmut_<n>``
(``xǁClassǁmethod`` for methods), so its module is the part before ``.x``.

Survivors listed in tests/mutation_equivalent.txt (with why each cannot change what a user gets)
are counted apart, as *equivalent*; *killed %* is over the mutants that can change behaviour.
A listed mutant that no longer survives is reported as stale: take it off the list.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

MUTATION_MD = Path(__file__).with_name("MUTATION.md")
EQUIVALENT_TXT = Path(__file__).with_name("mutation_equivalent.txt")
BEGIN, END = "<!-- mutation table -->", "<!-- end of mutation table -->"
LINE = re.compile(r"^\s*(?P<name>(?P<module>[\w.]+)\.x[_ǁ]\S*__mutmut_\d+): (?P<status>.+?)\s*$")
# mutmut's words -> the table's columns; "not checked": the run was stopped before it got there;
# "equivalent": a survivor listed in mutation_equivalent.txt.
COLUMNS = ("killed", "survived", "equivalent", "no tests", "timeout", "suspicious", "segfault", "not checked")


def equivalent_mutants(text: str) -> set[str]:
    """The names in mutation_equivalent.txt: the first word of each line that is not a comment."""
    return {line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")}


def counts(results: str, equivalent: set[str] = frozenset()) -> tuple[dict[str, Counter], list[str]]:
    """Module -> status -> mutants, from the text of ``mutmut results --all true``; and the listed
    equivalents that were run and did not survive, or are no longer made (stale entries)."""
    by_module: dict[str, Counter] = defaultdict(Counter)
    status_of = {}
    for line in results.splitlines():
        match = LINE.match(line)
        if match:
            status = status_of[match["name"]] = match["status"]
            if status == "survived" and match["name"] in equivalent:
                status = "equivalent"
            by_module[match["module"]][status] += 1
    stale = [name for name in equivalent if status_of.get(name) not in ("survived", "not checked")]
    return dict(by_module), sorted(stale)


def table(by_module: dict[str, Counter]) -> str:
    """Markdown: one row per module and a total; *killed %* counts the mutants that ran and can
    change behaviour (killed, survived or timed out: a timeout is a kill, the mutant made the
    tests hang)."""
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
    page = markdown.read_text(encoding="utf-8")
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{markdown}: the markers {BEGIN} and {END} are missing")
    markdown.write_text(page[: start + len(BEGIN)] + "\n" + text + "\n" + page[end:], encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"also update the table in {MUTATION_MD}")
    args = parser.parse_args()
    mutmut = Path(sys.executable).with_name("mutmut")
    done = subprocess.run([mutmut, "results", "--all", "true"], capture_output=True, text=True, check=True)
    by_module, stale = counts(done.stdout, equivalent_mutants(EQUIVALENT_TXT.read_text(encoding="utf-8")))
    if not by_module:
        raise SystemExit("no mutants found: run `make mutate` (or `mutmut run`) first")
    text = table(by_module)
    print(text)
    for name in stale:
        print(f"stale in {EQUIVALENT_TXT.name}: {name} did not survive (killed, renamed or not run)")
    if args.write:
        write_into(MUTATION_MD, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
