"""A run: assembled by named builders (``builders.py``), its loop (``loop.py``), its saved state
(``state.py``)."""
