"""Byte counts as people write them (``24GiB``, ``16 GB``) and as the logs show them."""

from __future__ import annotations

from typing import Any

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: Any) -> int | None:
    """``"24GiB"``, ``"16 GB"``, ``"512MiB"``, ``1000`` -> bytes; None when unreadable."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str):
        return None
    number = text.strip().lower().rstrip()
    unit = number.lstrip("0123456789. ")
    value = number[: len(number) - len(unit)].strip()
    try:
        amount = float(value)
    except ValueError:
        return None
    factor = _UNITS.get(unit.strip())
    return None if factor is None or amount < 0 else int(amount * factor)


def format_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} GiB"
