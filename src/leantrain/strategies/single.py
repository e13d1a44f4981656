"""``--strategy single``: one process, one device (the contract's defaults, see ``base.py``)."""

from __future__ import annotations

from leantrain.strategies.base import Strategy


class Single(Strategy):
    name = "single"
    summary = "one process, one device"
