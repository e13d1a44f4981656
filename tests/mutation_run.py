"""`make mutate`: the mutation check, incremental by default (tests/MUTATION.md).

mutmut keeps each mutant's result in ``mutants/`` and runs again only the mutants of functions whose
source changed. A changed *test* goes unseen by it: a test weakened since the last run would still be
counted as killing its mutants. So before mutmut runs, this script compares every file under tests/ with
the hashes it saved last time, and for each file that changed (or is new, or gone):

- the mutants a test of it killed (tests/mutation_plugin.py writes each kill to
  ``mutants/mutmut-killers.txt``) are set back to *not checked*; a mutant killed before kills were
  written per mutant, when a test of the file reached its function;
- its tests are dropped from mutmut's record of which tests reach which function, so that mutmut records
  them again (a changed test may reach other functions now).

And every survivor not listed in tests/mutation_equivalent.txt, and every mutant no test reached, is
checked again: a new test (a new file too) may kill or reach it, and mutmut checks a mutant once. A
timeout is checked again when a changed file's tests reached its function (mutmut itself checks every
timeout again when the time limit's settings change). And the tests that reached a function now gone
from a module that gained one (a rename) are recorded again.

A changed helper (``conftest.py``, a module of shared tasks) changes every test in its folder and below,
and a changed file changes every file that imports it (a test module importing another's helpers);
the mutation check's own files (``mutation_*.py``, ``mutation_hooks/``) change none.
Then mutmut runs the mutants not checked yet, of every module or of the modules the patterns name.
``--full`` empties ``mutants/`` first: every mutant again, from a fresh record.

mutmut's own first step, a clean run of every test the mutants reach, is left out: for a module that
every fit reaches that is the whole suite, single-process (half an hour), before each incremental run.
`make test` is that check; mutmut's record of which test reaches what is itself a run of every test
that fails on a failing one, and a test that failed unmutated would be named by every mutant it
"killed" in ``mutants/mutmut-killers.txt``.

    python tests/mutation_run.py                         # what changed since the last run
    python tests/mutation_run.py 'leantrain.log.*'       # the same, for the modules the patterns name
    python tests/mutation_run.py --full                  # everything
"""

from __future__ import annotations

import argparse
import ast
import compileall
import fnmatch
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
TEST_HASHES = MUTANTS / "test-hashes.json"
STATS = MUTANTS / "mutmut-stats.json"
KILLERS = MUTANTS / "mutmut-killers.txt"  # written by tests/mutation_plugin.py


def generate_mutants() -> None:
    """What ``mutmut run`` does first (mutmut 3.8.x, pinned): the mutated copy of the source as it is
    now, with the results of unchanged functions kept and those of changed ones set back to not checked."""
    from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
    from mutmut.mutation.trampoline import set_mutant_under_test

    set_mutant_under_test("mutant_generation")
    MUTANTS.mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    create_mutants(os.cpu_count() or 2)


def compile_ahead(folder: Path) -> None:
    """The byte-code of the mutated copy (and of its tests) written now. Where PYTHONDONTWRITEBYTECODE is
    set, as on this project's machines, Python writes none itself, and every process a test starts
    compiled the whole mutated source again: each function's mutants make it several times the size,
    about 3 s of CPU a process, more than its imports. Unchanged files are skipped."""
    compileall.compile_dir(folder / "src", quiet=1, workers=0)
    compileall.compile_dir(folder / "tests", quiet=1, workers=0)


def record_stats_in_parallel(workers: int, test_files: list[str] | None = None) -> None:
    """mutmut's record of which tests reach which function, made by every test once on ``workers``
    pytest-xdist processes (mutmut's own is one process: half an hour for this suite, twice this);
    with ``test_files``, by their tests only, added to the record there is.

    The workers and the processes they start record through tests/mutation_hooks/sitecustomize.py,
    each hit with the test that made it; their files are read here into mutmut's state and saved as
    its own stats run would save them. A test that fails ends it: mutants checked against a failing
    test would all count as killed. (mutmut would record the tests of changed files itself, in one
    process, where its output is lost when a test fails.)"""
    from mutmut.__main__ import _refresh_change_detection_baseline
    from mutmut.configuration import config
    from mutmut.state import state
    from mutmut.stats import load_stats, save_stats

    if test_files:
        load_stats()

    hits = MUTANTS / "process-hits"
    shutil.rmtree(hits, ignore_errors=True)
    hits.mkdir()
    source = str(MUTANTS / config().source_paths[0])
    env = {**os.environ, "MUTANT_UNDER_TEST": "stats", "MUTMUT_PROCESS_HITS": str(hits), "PYTHONPATH": source}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        str(workers),
        "--dist",
        "worksteal",
        "-q",
        "-p",
        "no:randomly",
    ]
    command += [*(test_files or config().pytest_add_cli_args_test_selection), *config().pytest_add_cli_args]
    started = time.monotonic()
    if subprocess.call(command, cwd=MUTANTS, env=env):
        raise SystemExit("a test failed while mutmut recorded which tests reach what (above): fix it first")
    for path in hits.glob("*.hits"):
        for line in path.read_text(encoding="utf-8").splitlines():
            test, _, function = line.partition("\t")
            if test:  # not at import, before any test
                state().tests_by_mangled_function_name[function].add(test)
    state().duration_by_test.update(seconds_by_test((hits / "durations").read_text(encoding="utf-8")))
    if not test_files:  # the whole record: mutmut's baseline of what it was made from
        state().stats_time = time.monotonic() - started
        _refresh_change_detection_baseline()
    save_stats()
    shutil.rmtree(hits)


def seconds_by_test(durations: str) -> dict[str, float]:
    """Each test's time from the lines tests/mutation_plugin.py writes (``test<TAB>seconds``, one per
    phase: setup, call, teardown): their sum."""
    seconds: dict[str, float] = {}
    for line in durations.splitlines():
        test, _, phase_seconds = line.partition("\t")
        seconds[test] = seconds.get(test, 0.0) + float(phase_seconds)
    return seconds


def run_mutmut(names: list[str]) -> None:
    """``mutmut run NAMES`` (all when empty), less its clean run of the tests (see the module)."""
    from mutmut.__main__ import _run
    from mutmut.workers import isolation

    isolation.ForkServerRunner.run_clean_tests = lambda self, tests: 0
    _run(names, None)


def hashes_of_test_files(tests: Path) -> dict[str, str]:
    """Path relative to the repository -> sha256, for every Python file under ``tests``."""
    return {
        str(path.relative_to(tests.parent)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(tests.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def changed_test_files(
    old: dict[str, str], new: dict[str, str], imports: dict[str, set[str]] | None = None
) -> set[str]:
    """The test files whose tests may check something else now: those changed, added or removed; for a
    changed helper (any file not named ``test_*.py``) every test file in its folder and below; and every
    file that imports a changed one, and so on (``imports``: :func:`imported_test_files`): a test module
    whose helper class lives in another test module, a task module of another folder."""
    changed = {path for path in old.keys() | new.keys() if old.get(path) != new.get(path)}
    changed -= {path for path in changed if _of_the_mutation_check(path)}
    for helper in [path for path in changed if not Path(path).name.startswith("test_")]:
        folder = str(Path(helper).parent) + "/"
        changed |= {path for path in new if path.startswith(folder)}
    importing = {path for path, imported in (imports or {}).items() if imported & changed} - changed
    while importing:
        changed |= importing
        importing = {path for path, imported in (imports or {}).items() if imported & changed} - changed
    return changed


def imported_test_files(tests: Path) -> dict[str, set[str]]:
    """Each Python file under ``tests`` (as :func:`hashes_of_test_files` names it) -> the files under
    ``tests`` it imports (``from tests.data.test_stream_resume import StreamTask``, ``from
    tests.distributed import tasks``)."""
    root, found = tests.parent, {}
    for path in sorted(tests.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
        modules = [
            root / f"{name.replace('.', '/')}.py" for name in names if name.split(".")[0] == tests.name
        ]
        found[str(path.relative_to(root))] = {str(m.relative_to(root)) for m in modules if m.is_file()}
    return found


def _of_the_mutation_check(path: str) -> bool:
    """This script, the report, the pytest plugin and the recorder: they change how mutants are checked,
    not what any test checks."""
    return Path(path).name.startswith("mutation_") or "mutation_hooks" in Path(path).parts


def forget_tests(stats: dict, files: set[str]) -> set[str]:
    """Drop the tests of ``files`` from mutmut's record (in place); return the functions they reached."""

    def of_files(test: str) -> bool:
        return test.split("::", 1)[0] in files

    reached = set()
    for function, tests in stats["tests_by_mangled_function_name"].items():
        kept = [test for test in tests if not of_files(test)]
        if len(kept) < len(tests):
            reached.add(function)
            stats["tests_by_mangled_function_name"][function] = kept
    stats["duration_by_test"] = {t: d for t, d in stats["duration_by_test"].items() if not of_files(t)}
    return reached


def function_of(mutant: str) -> str:
    """``leantrain.log.sinks.xǁJsonlSinkǁwrite__mutmut_3`` -> ``leantrain.log.sinks.xǁJsonlSinkǁwrite``."""
    return mutant.rsplit("__mutmut_", 1)[0]


# mutmut's results (3.8.x): 0 a survivor, 33 no test reaches the mutant's function, these a timeout (its
# tests' CPU time passed the limit made from their recorded times); the other codes, killed.
SURVIVED, NO_TESTS = 0, 33
TIMEOUTS = {-24, 24, 36, 152, 255}


def killers_of_mutants(killers: Path) -> dict[str, set[str]]:
    """Mutant -> the tests that killed it, from the lines tests/mutation_plugin.py appends to
    ``killers`` (function, test, mutant; a line without a mutant is from before they were named)."""
    found: dict[str, set[str]] = {}
    if killers.is_file():
        for line in killers.read_text(encoding="utf-8").splitlines():
            fields = line.split("\t")
            if len(fields) == 3:
                found.setdefault(fields[2], set()).add(fields[1])
    return found


def check_again(
    reached: set[str], changed: set[str], killers: dict[str, set[str]], equivalent: set[str]
) -> Callable[[str, int], bool]:
    """Whether a mutant's recorded result must be checked again after the test files ``changed``:
    - a killed one, if a test that killed it is in a changed file (it may no longer fail); killed with
      no test named (before killers were recorded per mutant), if a changed file's tests reached its
      function (``reached``);
    - every survivor but the ``equivalent`` ones (a test written for it may be new), and every mutant
      no test reached (a new test may reach it);
    - a timeout (a mutant that made a loop endless, or a limit too short for its tests) when a changed
      file's tests reached its function: like a kill, but with no test to name."""

    def again(name: str, code: int) -> bool:
        if code == SURVIVED:
            return name not in equivalent
        if code == NO_TESTS:
            return True
        if code in TIMEOUTS:
            return function_of(name) in reached
        killed_by = killers.get(name)
        if killed_by:
            return any(test.split("::", 1)[0] in changed for test in killed_by)
        return function_of(name) in reached

    return again


def uncheck(mutants: Path, again: Callable[[str, int], bool]) -> int:
    """Set the recorded result of every mutant that ``again`` names back to not checked; how many."""
    count = 0
    for meta in mutants.rglob("*.py.meta"):
        data = json.loads(meta.read_text())
        results = data["exit_code_by_key"]
        stale = [name for name, code in results.items() if code is not None and again(name, code)]
        for name in stale:
            results[name] = None
        if stale:
            meta.write_text(json.dumps(data, indent=4))
            count += len(stale)
    return count


def not_checked(patterns: list[str], mutants: Path) -> list[str]:
    """The mutants not checked yet whose names match one of ``patterns`` (all when none is given)."""
    names = []
    for meta in sorted(mutants.rglob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if code is None and (not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)):
                names.append(name)
    return names


def functions_now(mutants: Path) -> set[str]:
    """Every function of the mutated copy, as mutmut names them (``leantrain.cli.x_main``)."""
    functions = set()
    for meta in mutants.rglob("*.py.meta"):
        module = ".".join(meta.relative_to(mutants / "src").with_suffix("").with_suffix("").parts)
        functions |= {f"{module}.{name}" for name in json.loads(meta.read_text())["hash_by_function_name"]}
    return functions


def replaced_functions(reached: dict[str, list[str]], functions: set[str]) -> set[str]:
    """The functions in mutmut's record (``reached``: function -> tests) that are gone from a module
    that now has a function the record does not know: renamed, or split in two. mutmut records tests
    only when they change, so the new function's mutants would show as reached by no test; the tests
    that reached the gone ones are recorded again (see ``files_reaching``)."""

    def module(function: str) -> str:
        return function.rsplit(".", 1)[0]

    gaining = {module(function) for function in functions if function not in reached}
    return {function for function in reached if function not in functions and module(function) in gaining}


def files_reaching(stats: dict, functions: set[str]) -> set[str]:
    """The test files whose tests reached ``functions`` in mutmut's record."""
    reached = stats["tests_by_mangled_function_name"]
    return {test.split("::", 1)[0] for function in functions for test in reached[function]}


def listed_equivalents() -> set[str]:
    """The names in tests/mutation_equivalent.txt, as tests/mutation_report.py reads them. That file is
    loaded by its path: importing the ``tests`` package here would make the forked pytest runs of the
    mutated copy (mutants/tests) find this checkout's instead."""
    spec = importlib.util.spec_from_file_location("mutation_report", ROOT / "tests" / "mutation_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report.equivalent_mutants(report.EQUIVALENT_TXT.read_text(encoding="utf-8"))


def invalidate_changed_tests() -> list[str]:
    """Apply the changes of tests/ since the last run to mutmut's record and results (see the module);
    and check every survivor again that mutation_equivalent.txt does not list: a test written for it
    may be new, and mutmut checks a mutant once. Returns the test files to record again."""
    new = hashes_of_test_files(ROOT / "tests")
    changed: set[str] = set()
    if TEST_HASHES.is_file() and STATS.is_file():
        old = json.loads(TEST_HASHES.read_text())
        changed = changed_test_files(old, new, imported_test_files(ROOT / "tests"))
        stats = json.loads(STATS.read_text())
        reached = forget_tests(stats, changed)
        STATS.write_text(json.dumps(stats, indent=4))
        rule = check_again(reached, changed, killers_of_mutants(KILLERS), listed_equivalents())
        again = uncheck(MUTANTS, rule)
        print(f"{len(changed)} test files changed; {again} mutants (their kills, and survivors) run again")
    return sorted(path for path in changed if path in new and Path(path).name.startswith("test_"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", help="mutant names or fnmatch patterns ('leantrain.log.*')")
    parser.add_argument("--full", action="store_true", help="empty mutants/ first: every mutant again")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist processes of the first record")
    args = parser.parse_args()
    os.chdir(ROOT)  # mutmut reads pyproject.toml and writes mutants/ here
    # Two mutants at a time and the ranks they launch share the cores: OpenMP's threads wait asleep, not
    # spinning on the CPU the others need (as in `make test`; set before any process loads OpenMP).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.full:
        shutil.rmtree(MUTANTS, ignore_errors=True)
    record_again = invalidate_changed_tests()
    names = []
    recorded = STATS.is_file() and json.loads(STATS.read_text())["duration_by_test"]
    generate_mutants()  # the mutated copy, its source and tests as they are now
    compile_ahead(MUTANTS)
    if not recorded:  # none yet, or emptied by a change to a helper of every test (tests/conftest.py)
        record_stats_in_parallel(args.workers)
    else:
        stats = json.loads(STATS.read_text())
        replaced = replaced_functions(stats["tests_by_mangled_function_name"], functions_now(MUTANTS))
        record_again = sorted({*record_again, *files_reaching(stats, replaced)})
        if record_again:
            record_stats_in_parallel(args.workers, record_again)
        if replaced:  # recorded again: the gone functions' entries can go (not before: a stop keeps them)
            stats = json.loads(STATS.read_text())
            for function in replaced:
                del stats["tests_by_mangled_function_name"][function]
            STATS.write_text(json.dumps(stats, indent=4))
    # Saved once the record holds them: a run stopped before sees the same changes next time.
    TEST_HASHES.write_text(json.dumps(hashes_of_test_files(ROOT / "tests"), indent=1))
    if args.patterns:
        # mutmut runs every mutant a pattern names again, checked or not: name the unchecked ones.
        names = not_checked(args.patterns, MUTANTS)
        if not names:
            print("every mutant these patterns name is checked already")
    if names or not args.patterns:
        run_mutmut(names)
    return subprocess.call([sys.executable, str(ROOT / "tests" / "mutation_report.py")])


if __name__ == "__main__":
    sys.exit(main())
