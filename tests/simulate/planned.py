"""``leantrain plan --cluster`` in this process, for the tests that set a real run beside its plan."""

from __future__ import annotations

import json
from contextlib import redirect_stdout
from io import StringIO
from typing import Any

from leantrain.cli import main

ACCOUNTED = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "ema_bytes")


def planned(fit_arguments: list[str], processes: int) -> dict[str, Any]:
    """The plan of ``fit_arguments`` (``fit`` and its flags, as a test launches them) on one node of
    ``processes`` GPUs: the JSON ``plan --cluster --json`` prints."""
    flags = fit_arguments[1:] if fit_arguments[0] == "fit" else fit_arguments
    printed = StringIO()
    with redirect_stdout(printed):
        code = main(["plan", *flags, "--cluster", f"1x{processes}xH100", "--json"])
    assert code == 0, printed.getvalue()
    return json.loads(printed.getvalue())


def accounted(plan: dict[str, Any]) -> dict[str, int]:
    """The memory accountant's figures of a plan, under the names summary.json gives them."""
    return {kind: plan[f"accounted_{kind}"] for kind in ACCOUNTED}


def summarized(summary: dict[str, Any]) -> dict[str, int]:
    """The same figures of a real run's summary.json (its rank 0's)."""
    return {kind: summary[kind] for kind in ACCOUNTED}
