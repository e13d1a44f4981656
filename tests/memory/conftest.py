"""The memory tests train on the CPU even where a GPU is present: there the budget is enforced by
counting saved bytes (a simulated out-of-memory error), which is what these tests check. The real
CUDA allocator's cap and out-of-memory errors are tested in tests/test_cuda.py."""

from __future__ import annotations

import pytest


@pytest.fixture
def fit(fit):
    def on_the_cpu(task, callbacks=(), **fields):
        return fit(task, callbacks, **{"device": "cpu", **fields})

    return on_the_cpu
