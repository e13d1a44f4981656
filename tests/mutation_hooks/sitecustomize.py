"""Under ``make mutate`` only: tell mutmut which functions the processes a test starts have run.

mutmut learns which tests reach a function by recording, in the test process, each call that passes
through a mutated function's trampoline. torchrun's workers, the CLI and a killed save run in processes
of their own, so what only they execute (the reductions of a world > 1, what ranks > 0 log) was never
recorded, and every mutant there counted as untested. ``tests/mutation_plugin.py`` puts this folder on
the path of the processes tests start under ``make mutate``; Python imports this module at start-up, and
while mutmut records (``MUTANT_UNDER_TEST=stats``) every hit in the process is appended, once per test
and function, to a file of its own in ``MUTMUT_PROCESS_HITS``, with the test that runs. The test process
adds those files to the test's hits when the test ends. ``tests/mutation_run.py`` records on
pytest-xdist's workers the same way (they are processes the test run starts), and reads the files
itself. Nothing here runs outside ``make mutate``.
"""

import os


def _record_hits_in_a_file(folder: str) -> None:
    from mutmut.mutation import trampoline

    seen: set[tuple[str, str]] = set()
    path = os.path.join(folder, f"{os.getpid()}.hits")

    def record(name: str, caller: str | None = None) -> None:
        # The test that runs: pytest names it in the environment, and processes it starts inherit it.
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        if (test, name) not in seen:  # a line per function, not per call: the step loop calls some every step
            seen.add((test, name))
            # Written as it happens: a killed process keeps what it ran. UTF-8 whatever the locale: names of
            # methods hold mutmut's "ǁ", and a test may start a process under the C locale, where a test's
            # name read from the environment holds its bytes as surrogates (written back as they came).
            with open(path, "a", encoding="utf-8", errors="surrogateescape") as hits:
                hits.write(f"{test}\t{name}\n")

    trampoline.record_trampoline_hit = record


if os.environ.get("MUTANT_UNDER_TEST") == "stats" and os.environ.get("MUTMUT_PROCESS_HITS"):
    _record_hits_in_a_file(os.environ["MUTMUT_PROCESS_HITS"])
