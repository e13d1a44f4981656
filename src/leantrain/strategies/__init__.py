"""Where the work runs: one module per strategy (``base.py``: the contract; ``registry.py``: the
names)."""
