"""tests/mutation_run.py: `make mutate` runs again what changed tests may now check differently."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.mutation_run import (
    changed_test_files,
    check_again,
    compile_ahead,
    files_reaching,
    forget_tests,
    functions_now,
    hashes_of_test_files,
    imported_test_files,
    killers_of_mutants,
    not_checked,
    replaced_functions,
    seconds_by_test,
    uncheck,
)

SINKS = "leantrain.log.sinks.xǁJsonlSinkǁwrite"
DDP = "leantrain.strategies.ddp.x_all_reduce"


def test_a_changed_helper_changes_every_test_file_below_its_folder(tmp_path):
    tests = tmp_path / "tests"
    (tests / "log").mkdir(parents=True)
    for name in ("conftest.py", "test_top.py", "log/conftest.py", "log/test_sinks.py", "log/test_metrics.py"):
        (tests / name).write_text("x = 1\n")
    old = hashes_of_test_files(tests)
    assert set(old) == {
        "tests/conftest.py",
        "tests/test_top.py",
        "tests/log/conftest.py",
        "tests/log/test_sinks.py",
        "tests/log/test_metrics.py",
    }

    (tests / "log" / "test_sinks.py").write_text("x = 2\n")
    assert changed_test_files(old, hashes_of_test_files(tests)) == {"tests/log/test_sinks.py"}

    (tests / "log" / "test_sinks.py").write_text("x = 1\n")
    (tests / "log" / "conftest.py").write_text("x = 2\n")
    assert changed_test_files(old, hashes_of_test_files(tests)) == {
        "tests/log/conftest.py",
        "tests/log/test_sinks.py",
        "tests/log/test_metrics.py",
    }

    (tests / "log" / "conftest.py").write_text("x = 1\n")
    for tool in ("mutation_plugin.py", "mutation_hooks/sitecustomize.py"):  # how mutants are checked
        (tests / tool).parent.mkdir(exist_ok=True)
        (tests / tool).write_text("x = 2\n")
    (tests / "log" / "test_metrics.py").unlink()
    (tests / "test_new.py").write_text("x = 1\n")
    assert changed_test_files(old, hashes_of_test_files(tests)) == {
        "tests/log/test_metrics.py",
        "tests/test_new.py",
    }


def test_a_changed_file_changes_the_files_that_import_it_and_theirs(tmp_path):
    """A test module using another's helper class, a task module of another folder: their importers'
    tests check something else when they change (unseen before: only helpers' folders counted)."""
    tests = tmp_path / "tests"
    for name, text in {
        "log/test_sinks.py": "class Helper: ...\n",
        "test_top.py": "from tests.log.test_sinks import Helper\n",
        "test_chain.py": "import tests.test_top\n",
        "distributed/tasks.py": "def task(): ...\n",
        "test_peer.py": "from tests.distributed import tasks\nfrom leantrain import cli\n",
        "test_alone.py": "import os\n",
    }.items():
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(text)
    imports = imported_test_files(tests)
    assert imports["tests/test_top.py"] == {"tests/log/test_sinks.py"}
    assert imports["tests/test_peer.py"] == {"tests/distributed/tasks.py"}
    assert imports["tests/test_alone.py"] == set()
    old = hashes_of_test_files(tests)
    (tests / "log" / "test_sinks.py").write_text("class Helper:\n    x = 2\n")
    assert changed_test_files(old, hashes_of_test_files(tests), imports) == {
        "tests/log/test_sinks.py", "tests/test_top.py", "tests/test_chain.py"
    }  # fmt: skip
    (tests / "log" / "test_sinks.py").write_text("class Helper: ...\n")
    (tests / "distributed" / "tasks.py").write_text("def task(): return 2\n")
    assert changed_test_files(old, hashes_of_test_files(tests), imports) == {
        "tests/distributed/tasks.py", "tests/test_peer.py"
    }  # fmt: skip


def test_the_tests_of_changed_files_are_forgotten_and_the_functions_they_reached_named():
    stats = {
        "tests_by_mangled_function_name": {
            SINKS: ["tests/log/test_sinks.py::test_a", "tests/test_top.py::test_b"],
            DDP: ["tests/test_top.py::test_b"],
        },
        "duration_by_test": {"tests/log/test_sinks.py::test_a": 1.0, "tests/test_top.py::test_b": 2.0},
    }
    assert forget_tests(stats, {"tests/log/test_sinks.py"}) == {SINKS}
    assert stats["tests_by_mangled_function_name"] == {
        SINKS: ["tests/test_top.py::test_b"],
        DDP: ["tests/test_top.py::test_b"],
    }
    assert stats["duration_by_test"] == {"tests/test_top.py::test_b": 2.0}


def test_the_mutants_named_are_not_checked_again_and_the_others_keep_their_results(tmp_path):
    meta = tmp_path / "src" / "leantrain" / "log" / "sinks.py.meta"
    meta.parent.mkdir(parents=True)
    results = {
        f"{SINKS}__mutmut_1": 1,
        f"{SINKS}__mutmut_2": 0,
        f"{SINKS}__mutmut_3": None,
        f"{DDP}__mutmut_1": 1,
    }
    meta.write_text(json.dumps({"exit_code_by_key": results, "hash_by_function_name": {}}))

    assert uncheck(tmp_path, lambda name, code: name.startswith(SINKS)) == 2
    after = json.loads(meta.read_text())
    assert after["exit_code_by_key"] == {
        f"{SINKS}__mutmut_1": None,
        f"{SINKS}__mutmut_2": None,
        f"{SINKS}__mutmut_3": None,
        f"{DDP}__mutmut_1": 1,
    }
    assert after["hash_by_function_name"] == {}  # the rest of mutmut's record is kept
    assert not_checked(["leantrain.log.*"], tmp_path) == [f"{SINKS}__mutmut_{n}" for n in (1, 2, 3)]
    assert not_checked(["leantrain.strategies.*"], tmp_path) == []
    assert len(not_checked([], tmp_path)) == 3


def test_a_killed_mutant_is_checked_again_when_a_test_that_killed_it_changed_survivors_always(tmp_path):
    killers = tmp_path / "mutmut-killers.txt"
    killers.write_text(
        f"{SINKS}\ttests/log/test_sinks.py::test_a\t{SINKS}__mutmut_1\n"
        f"{SINKS}\ttests/test_top.py::test_b\t{SINKS}__mutmut_2\n"
        f"{SINKS}\ttests/test_top.py::test_b\n"  # a line from before mutants were named
    )
    by_mutant = killers_of_mutants(killers)
    assert by_mutant == {
        f"{SINKS}__mutmut_1": {"tests/log/test_sinks.py::test_a"},
        f"{SINKS}__mutmut_2": {"tests/test_top.py::test_b"},
    }
    again = check_again({SINKS}, {"tests/log/test_sinks.py"}, by_mutant, {f"{SINKS}__mutmut_5"})
    assert again(f"{SINKS}__mutmut_1", 1)  # its killer changed
    assert not again(f"{SINKS}__mutmut_2", 1)  # reached by the changed file's tests, killed by another
    assert again(f"{SINKS}__mutmut_3", 1)  # killed by an unnamed test: reached by the changed file
    assert not again(f"{DDP}__mutmut_1", 1)  # unnamed killer, not reached by the changed file
    assert again(f"{DDP}__mutmut_2", 0) and not again(f"{SINKS}__mutmut_5", 0)  # survivors but equivalents
    assert again(f"{DDP}__mutmut_3", 33)  # no test reached it: a new one may
    # a timeout: again when the changed file's tests reached it (a limit too short, or a loop that a
    # changed test no longer runs), not on every run (each costs its whole limit)
    assert again(f"{SINKS}__mutmut_4", -24) and again(f"{SINKS}__mutmut_4", 36)
    assert not again(f"{DDP}__mutmut_4", -24)


def test_a_mutant_runs_its_ordered_tests_until_their_recorded_time_passes_the_budget_but_its_first_ten():
    from tests.mutation_plugin import _beyond_the_budget, first_run_costs

    durations = {f"fast{n}": 1.0 for n in range(12)} | {"a": 60.0, "b": 30.0, "c": 20.0, "slow": 500.0}
    fast = [SimpleNamespace(nodeid=f"fast{n}") for n in range(12)]
    items = fast + [SimpleNamespace(nodeid=name) for name in ("a", "b", "c")]

    def beyond(ordered: list, budget: float) -> int:
        return _beyond_the_budget(first_run_costs(ordered, durations, {}), budget)

    assert beyond(items, 100.0) == 2  # the 12 fast ones and a: 72 s; b would pass 100
    assert beyond(items, 0.0) == 0  # no budget
    launches = [SimpleNamespace(nodeid=name) for name in ("slow", "a", "b", "c")]
    assert beyond(launches, 100.0) == 0  # fewer than ten: all of them
    assert beyond(launches + fast, 100.0) == 6  # past 100 s from the 11th on


def _asking_for(nodeid: str, *fixtures: tuple[str, str, str]) -> SimpleNamespace:
    """A test item as pytest resolves its fixtures: each (baseid, name, scope) the one it gets."""
    definitions = {
        name: [SimpleNamespace(baseid=base, argname=name, scope=scope)] for base, name, scope in fixtures
    }
    return SimpleNamespace(
        nodeid=nodeid,
        fixturenames=list(definitions),
        _fixtureinfo=SimpleNamespace(name2fixturedefs=definitions),
    )


def test_a_tests_first_run_cost_holds_the_shared_fixtures_no_test_before_it_set_up():
    """A fresh process per mutant: the first test asking for a module's fixture pays it there, whatever
    test paid it while recording."""
    from tests.mutation_plugin import _beyond_the_budget, first_run_costs

    searched = ("tests/simulate/test_plan.py", "searched", "module")
    store = ("tests/test_store.py", "store", "session")
    a = _asking_for("a", searched, ("", "tmp_path", "function"))
    b = _asking_for("b", searched, store)
    c = _asking_for("c")
    durations = {"a": 0.25, "b": 0.5, "c": 2.0}
    fixtures = {"tests/simulate/test_plan.py::searched": 7.0, "tests/test_store.py::store": 3.0}
    assert first_run_costs([a, b, c], durations, fixtures) == [7.25, 3.5, 2.0]
    assert first_run_costs([c, b, a], durations, fixtures) == [2.0, 10.5, 0.25]
    assert first_run_costs([b], durations, {}) == [0.5]  # a fixture not timed yet: free
    # 7 s once and 0.25 s a test: 9.75 s after eleven; c passes 10 s
    assert _beyond_the_budget(first_run_costs([a] * 11 + [c], durations, fixtures), 10.0) == 1


@pytest.fixture(scope="module")
def shared_by_this_module() -> str:
    return "set up once"


def test_pytest_names_the_shared_fixtures_a_test_asks_for(request, shared_by_this_module, tmp_path):
    from tests.mutation_plugin import _shared_fixtures

    assert sorted(_shared_fixtures(request.node)) == [
        "::tmp_path_factory",  # pytest's own, under tmp_path
        "tests/test_mutation_run.py::shared_by_this_module",
    ]
    assert _shared_fixtures(SimpleNamespace(nodeid="a doctest")) == []


def test_a_shared_fixtures_set_up_time_is_written_under_make_mutate_only(tmp_path, monkeypatch):
    import tests.mutation_plugin as plugin

    monkeypatch.setattr(plugin, "FIXTURE_SECONDS", tmp_path / "fixture-seconds.txt")
    starts_and_ends = [10.0, 17.5, 20.0, 21.0, 30.0, 30.05, 40.0, 48.0, 50.0, 70.0, 80.0, 80.5, 90.0, 94.0]
    clock = iter(starts_and_ends)
    monkeypatch.setattr(plugin.time, "perf_counter", lambda: next(clock))

    def set_up(name: str, scope: str, error: Exception | None = None) -> None:
        hook = plugin.pytest_fixture_setup(SimpleNamespace(baseid="t.py", argname=name, scope=scope), None)
        next(hook)
        with pytest.raises(StopIteration):
            hook.send(SimpleNamespace(excinfo=error and (type(error), error, None)))

    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    set_up("searched", "module")  # 7.5 s
    set_up("tmp_path", "function")  # 1 s, a test's own
    set_up("tmp_path_factory", "session")  # 0.05 s: not worth a line
    monkeypatch.setenv("MUTANT_UNDER_TEST", "leantrain.x_f__mutmut_1")
    set_up("searched", "module")  # 8 s
    set_up("searched", "module")  # 20 s on a busy machine
    set_up("searched", "module", ValueError("a mutant broke it"))  # 0.5 s: failed, no time
    monkeypatch.delenv("MUTANT_UNDER_TEST")
    set_up("searched", "module")  # 4 s, a plain test run
    assert plugin.fixture_seconds() == {"t.py::searched": 8.0}  # the median of 7.5, 8 and 20


def test_a_tests_recorded_time_holds_its_setup_and_teardown(tmp_path, monkeypatch):
    """A module's fixture (a search its tests share) is paid in the setup of the test that runs first; a
    mutant's time limit is made from the recorded times, so a time of the call alone made false timeouts."""
    from types import SimpleNamespace

    import tests.mutation_plugin as plugin

    monkeypatch.setattr(plugin, "PROCESS_HITS", tmp_path)
    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    for when, seconds in (("setup", 8.0), ("call", 0.5), ("teardown", 0.25)):
        report = SimpleNamespace(nodeid="t.py::a", when=when, duration=seconds, skipped=False, failed=False)
        plugin.pytest_runtest_logreport(report)
    skipped = SimpleNamespace(nodeid="t.py::b", when="setup", duration=0.125, skipped=True, failed=False)
    plugin.pytest_runtest_logreport(skipped)
    assert seconds_by_test((tmp_path / "durations").read_text()) == {"t.py::a": 8.75, "t.py::b": 0.125}


def test_the_tests_of_a_renamed_function_are_recorded_again_and_not_those_of_a_removed_one(tmp_path):
    """mutmut records a test's reach only when the test changes: a function renamed in the source (or
    split out of another) would show as reached by no test until the tests of the old name run again."""
    meta = tmp_path / "src" / "leantrain" / "strategies" / "split_logits.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"hash_by_function_name": {"x_local_loss": "1", "x__as_values": "2"}}))
    (tmp_path / "src" / "leantrain" / "cli.py.meta").write_text(
        json.dumps({"hash_by_function_name": {"x_main": "3"}})
    )
    functions = functions_now(tmp_path)
    module = "leantrain.strategies.split_logits"
    assert functions == {f"{module}.x_local_loss", f"{module}.x__as_values", "leantrain.cli.x_main"}
    reached = {
        f"{module}.x_local_loss": ["tests/a.py::t1"],
        f"{module}.x__values": ["tests/b.py::t2", "tests/b.py::t3"],  # renamed _as_values
        "leantrain.cli.x_main": ["tests/c.py::t4"],
        "leantrain.cli.x_gone": ["tests/d.py::t5"],  # removed: its module gained no function
    }
    replaced = replaced_functions(reached, functions)
    assert replaced == {f"{module}.x__values"}
    assert files_reaching({"tests_by_mangled_function_name": reached}, replaced) == {"tests/b.py"}


def test_a_launched_process_records_its_hits_under_the_c_locale(tmp_path):
    """A test may start a process under the C locale (the doctor's page is checked so): its hits, a
    method's name with mutmut's "ǁ" and a test's name with "é", must reach the record as they are."""
    trampoline = tmp_path / "fake" / "mutmut" / "mutation"
    trampoline.mkdir(parents=True)
    (trampoline / "trampoline.py").write_text("def record_trampoline_hit(name, caller=None):\n    pass\n")
    hooks = Path(__file__).parent / "mutation_hooks"
    env = {
        **os.environ,
        "PYTHONPATH": f"{hooks}{os.pathsep}{tmp_path / 'fake'}",
        "MUTANT_UNDER_TEST": "stats",
        "MUTMUT_PROCESS_HITS": str(tmp_path),
        "PYTEST_CURRENT_TEST": "tests/test_café.py::test_page (call)",
        "LC_ALL": "C",
        "LANG": "C",
        "PYTHONCOERCECLOCALE": "0",
        "PYTHONUTF8": "0",
    }
    method = "leantrain.m.x\\u01c1P\\u01c1f"  # escaped: the C locale would read "ǁ" in argv as surrogates
    code = f"from mutmut.mutation import trampoline; trampoline.record_trampoline_hit('{method}')"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    (hits,) = tmp_path.glob("*.hits")
    assert hits.read_text(encoding="utf-8") == "tests/test_café.py::test_page\tleantrain.m.xǁPǁf\n"


def test_the_mutated_copy_is_compiled_ahead_where_python_writes_no_byte_code(tmp_path):
    """Bug: each process a test starts compiles the mutated source again (3 s of CPU a process)."""
    names = ("src/leantrain/cli.py", "tests/distributed/tasks.py")
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True)
        (tmp_path / name).write_text("x = 1\n")
    compile_ahead(tmp_path)
    for name in names:
        source = (tmp_path / name).stat()
        header = Path(importlib.util.cache_from_source(str(tmp_path / name))).read_bytes()[:16]
        # What an import checks before it uses the byte-code: the source's time and size, as they are.
        assert header[:4] == importlib.util.MAGIC_NUMBER, name
        assert int.from_bytes(header[8:12], "little") == int(source.st_mtime), name
        assert int.from_bytes(header[12:16], "little") == source.st_size, name
