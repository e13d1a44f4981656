"""`make mutate`'s hooks into the test run (tests/MUTATION.md); loaded by tests/conftest.py, and inert
unless mutmut runs the tests (``MUTANT_UNDER_TEST`` is set).

Kept apart from conftest.py: `make mutate` runs again every mutant reached by tests whose helpers
changed (tests/mutation_run.py), and this file changes how mutants are checked, not what a test checks.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mutation_run import function_of

# Under `make mutate`, mutmut first records which functions each test reaches. It sees only the test
# process; tests/mutation_hooks/sitecustomize.py records what the processes a test starts run, in
# files that `pytest_runtest_teardown` below adds to the test's record (tests/MUTATION.md).
PROCESS_HITS = Path(__file__).resolve().parent.parent / "process-hits"  # in mutmut's mutants/ copy
if "MUTANT_UNDER_TEST" in os.environ:
    PROCESS_HITS.mkdir(exist_ok=True)
    os.environ["MUTMUT_PROCESS_HITS"] = str(PROCESS_HITS)
    _HOOKS = str(Path(__file__).resolve().with_name("mutation_hooks"))
    os.environ["PYTHONPATH"] = os.pathsep.join([*os.environ["PYTHONPATH"].split(os.pathsep), _HOOKS])
    # mutmut's trampolines wrap every function of the mutated copy: the doctor must not take one of
    # their frames for the user's line that made a host sync (the next frame out is that line).
    import leantrain.diagnose.syncs as _syncs

    _is_library = _syncs._is_library
    _syncs._is_library = lambda filename: f"{os.sep}mutmut{os.sep}" in filename or _is_library(filename)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" in mutant:
        items.sort(key=_mutant_test_order(mutant))
        from mutmut.state import state  # pinned to 3.8.x: its measured test durations

        costs = first_run_costs(items, state().duration_by_test, fixture_seconds())
        beyond = _beyond_the_budget(costs, MUTANT_TEST_SECONDS)
        if beyond:
            config.hook.pytest_deselected(items=items[-beyond:])
            del items[-beyond:]


# `make mutate` runs a mutant's tests until the first fails (-x). mutmut's fork-server runner hands
# them over in no order, and most tests that reach a function never exercise most of its lines
# (every fit calls `Persistence.resume`; few resume). So the tests that killed the function's earlier
# mutants go first, most kills first, then the rest fastest first: a killed mutant runs one or two
# tests, not the ~60 that reached its function before the one that kills it.
KILLERS = Path(__file__).resolve().parent.parent / "mutmut-killers.txt"  # in mutmut's mutants/ copy


# A function every fit reaches is reached by ~900 tests (18 minutes): a mutant of it that survives would
# run them all. A mutant runs its tests in the order above until their recorded time passes this budget,
# but always its first 10: a function only launches reach (a few tests of 15-60 s each) is checked by all
# of them. One that survives them is a survivor (at worst a bug a slower test would have caught: a fast
# test for it is worth writing). MUTANT_TEST_SECONDS=0: no budget.
MUTANT_TEST_SECONDS = float(os.environ.get("MUTANT_TEST_SECONDS", "120"))
MUTANT_FIRST_TESTS = 10


def _beyond_the_budget(costs: list[float], budget: float) -> int:
    """How many of the last tests fall past ``budget`` seconds, given each one's ``costs`` in the order
    they run (:func:`first_run_costs`); the first ``MUTANT_FIRST_TESTS`` always run, and a budget of 0
    runs them all."""
    if budget <= 0:
        return 0
    spent = 0.0
    for index, cost in enumerate(costs):
        spent += cost
        if spent > budget and index >= MUTANT_FIRST_TESTS:
            return len(costs) - index
    return 0


# A module's or a session's fixture (the search a module's tests share, a tracking store, a launched
# reference run) is set up by the first test of a process that asks for it: while recording, its time
# lands on that test alone and its fellows look free. But each mutant runs in a fresh process, where the
# first of them pays it again: seen as free, such a test went first and cost a mutant 7 s where a test
# of 0.1 s would do. So each such fixture's set-up time is written down whenever it is set up (while
# recording and while checking mutants), and a test's cost, in the order and against the budget, is its
# recorded time plus the shared fixtures it is the first to ask for.
FIXTURE_SECONDS = Path(__file__).resolve().parent.parent / "mutmut-fixture-seconds.txt"  # in mutants/
FIXTURE_SECONDS_WORTH_WRITING = 0.1  # pytest's own (tmp_path_factory) and the like cost nothing


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Any:
    started = time.perf_counter()
    outcome = yield
    seconds = time.perf_counter() - started
    shared = "MUTANT_UNDER_TEST" in os.environ and fixturedef.scope != "function"
    failed = outcome.excinfo is not None  # a mutant broke it: its time says nothing
    if shared and not failed and seconds >= FIXTURE_SECONDS_WORTH_WRITING:
        with FIXTURE_SECONDS.open("a", encoding="utf-8") as written:  # one short line per write
            written.write(f"{_fixture_name(fixturedef)}\t{seconds}\n")


def fixture_seconds() -> dict[str, float]:
    """Shared fixture -> its set-up time: the median of those written (a mutant may shorten one, a busy
    machine lengthen it)."""
    times: dict[str, list[float]] = {}
    if FIXTURE_SECONDS.is_file():
        for line in FIXTURE_SECONDS.read_text(encoding="utf-8").splitlines():
            name, _, seconds = line.partition("\t")
            times.setdefault(name, []).append(float(seconds))
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def _fixture_name(fixturedef: Any) -> str:
    return f"{fixturedef.baseid}::{fixturedef.argname}"


def _shared_fixtures(item: Any) -> list[str]:
    """The module, package and session fixtures ``item`` asks for (pytest's resolved fixture defs: the
    last of a name is the one it gets)."""
    info = getattr(item, "_fixtureinfo", None)  # a test function's; other items ask for none
    if info is None:
        return []
    definitions = info.name2fixturedefs
    chosen = [definitions[name][-1] for name in item.fixturenames if definitions.get(name)]
    return [_fixture_name(d) for d in chosen if d.scope != "function"]


def first_run_costs(
    ordered: list[Any], durations: dict[str, float], fixtures: dict[str, float]
) -> list[float]:
    """Each test's time in a fresh process when run in this order: its recorded ``durations`` plus the
    set-up time (``fixtures``) of each shared fixture no test before it asked for. (The test that set a
    fixture up while recording holds its time twice: it runs later than it might, no more.)"""
    paid: set[str] = set()
    costs = []
    for item in ordered:
        new = [name for name in _shared_fixtures(item) if name not in paid]
        paid.update(new)
        costs.append(durations.get(item.nodeid, 0.0) + sum(fixtures.get(name, 0.0) for name in new))
    return costs


def _mutant_test_order(mutant: str) -> Any:
    from mutmut.state import state  # pinned to 3.8.x: its measured test durations

    durations, fixtures = state().duration_by_test, fixture_seconds()
    function = function_of(mutant)
    kills: dict[str, int] = {}
    if KILLERS.is_file():
        for line in KILLERS.read_text(encoding="utf-8").splitlines():
            killed_function, test = line.split("\t")[:2]
            if killed_function == function:
                kills[test] = kills.get(test, 0) + 1
    return lambda item: (-kills.get(item.nodeid, 0), first_run_costs([item], durations, fixtures)[0])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    # every test's time, a skipped one's too (mutmut records again, one by one, each test it has no time
    # of), with its setup and teardown: a fixture's work (a search shared by a module's tests) is counted
    # where its hits are, and a mutant's time limit is made from these times
    if mutant == "stats" and "PYTEST_XDIST_WORKER" in os.environ:
        # for tests/mutation_run.py
        with (PROCESS_HITS / "durations").open("a", encoding="utf-8") as durations:
            durations.write(f"{report.nodeid}\t{report.duration}\n")
    if report.failed and "__mutmut_" in mutant:
        # one short line per write: appends do not interleave
        with KILLERS.open("a", encoding="utf-8") as killers:
            killers.write(f"{function_of(mutant)}\t{report.nodeid}\t{mutant}\n")


@pytest.hookimpl(tryfirst=True)  # before mutmut's own teardown hook reads the test's record
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or "PYTEST_XDIST_WORKER" in os.environ:
        return  # on xdist's workers tests/mutation_run.py reads the files (see record_stats_in_parallel)
    from mutmut.state import state  # pinned to 3.8.x: the hits it records for the running test

    for hits in PROCESS_HITS.glob("*.hits"):
        state()._stats.update(line.split("\t")[1] for line in hits.read_text(encoding="utf-8").splitlines())
        hits.unlink()
