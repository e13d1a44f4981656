"""tests/mutation_report.py: the per-module table of `make mutate`, equivalents counted apart."""

from __future__ import annotations

from tests.mutation_report import counts, equivalent_mutants, table

RESULTS = """
    leantrain.step.losses.xǁ_Columnǁdoubled__mutmut_3: survived
    leantrain.step.losses.xǁ_Columnǁdoubled__mutmut_4: killed
    leantrain.step.losses.x_helper__mutmut_1: survived
    leantrain.step.losses.x_helper__mutmut_2: timeout
    leantrain.checkpoint.x_save__mutmut_1: no tests
    leantrain.checkpoint.x_save__mutmut_2: killed
    leantrain.checkpoint.x_save__mutmut_3: not checked
"""
EQUIVALENT = """
# a comment
leantrain.step.losses.xǁ_Columnǁdoubled__mutmut_3  # the default device is the CPU here
leantrain.checkpoint.x_save__mutmut_2  # killed since: stale
leantrain.checkpoint.x_save__mutmut_3  # not run yet: not stale
leantrain.checkpoint.x_gone__mutmut_1  # no longer made (the function was renamed): stale
"""


def test_listed_survivors_are_equivalent_and_listed_kills_are_stale():
    by_module, stale = counts(RESULTS, equivalent_mutants(EQUIVALENT))
    losses = by_module["leantrain.step.losses"]
    assert (losses["killed"], losses["survived"], losses["equivalent"], losses["timeout"]) == (1, 1, 1, 1)
    assert by_module["leantrain.checkpoint"]["no tests"] == 1
    assert stale == ["leantrain.checkpoint.x_gone__mutmut_1", "leantrain.checkpoint.x_save__mutmut_2"]


def test_the_share_is_over_the_mutants_that_can_change_behaviour():
    rows = table(counts(RESULTS, equivalent_mutants(EQUIVALENT))[0]).splitlines()
    losses = next(row for row in rows if "step.losses" in row)
    # killed 1 + timeout 1 of 3 that ran and can change behaviour; the equivalent one left out
    assert losses.endswith("| 66.7 |")
    checkpoint = next(row for row in rows if "checkpoint" in row)
    assert checkpoint.endswith("| 100.0 |")  # the no-test mutant did not run
