"""Finding a line of a test file by a marker comment, so no test hard-codes a line number."""

from __future__ import annotations

from pathlib import Path


def line_of(file: str, marker: str) -> int:
    """The one line of ``file`` that ends with ``# marker``."""
    lines = Path(file).read_text().splitlines()
    matches = [number for number, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(matches) == 1, f"{marker}: {matches}"
    return matches[0]
