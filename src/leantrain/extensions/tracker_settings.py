"""What chose a tracker's setting: a flag, the team's environment, or leantrain's default."""

from __future__ import annotations

import os


def choose(
    flag_value: str | None, flag: str, variable: str, default: str, why_default: str = "default"
) -> tuple[str, str]:
    """A setting and what chose it: the flag's value, else the environment variable's (an empty one
    counts as unset, as the trackers' libraries read it), else leantrain's default."""
    if flag_value:
        return flag_value, flag
    if value := os.environ.get(variable):
        return value, variable
    return default, why_default
