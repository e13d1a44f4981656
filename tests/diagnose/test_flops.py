"""FLOP counting and MFU."""

from __future__ import annotations

import pytest
import torch

from leantrain.diagnose import PeakFlops, count_flops, mfu, peak_flops
from leantrain.diagnose.flops import compute_dtype


def test_a_linear_layers_step_counts_its_three_matmuls() -> None:
    batch, fan_in, fan_out = 8, 32, 16
    layer = torch.nn.Linear(fan_in, fan_out)
    x = torch.randn(batch, fan_in, requires_grad=True)

    def step() -> None:
        layer(x).sum().backward()

    # forward x @ W^T, backward grad @ W (input) and grad^T @ x (weight): 2*b*i*o each
    assert count_flops(step) == 3 * 2 * batch * fan_in * fan_out


def test_mfu_is_the_share_of_the_peak() -> None:
    peak = PeakFlops(1e12, "float32", "test")
    assert mfu(2e11, 0.5, peak) == pytest.approx(0.4)
    assert mfu(1e9, 0.0, peak) == 0.0


def test_cpu_peak_is_measured_in_the_compute_type() -> None:
    peak = peak_flops("cpu", compute_dtype("bf16-mixed"))
    assert peak.dtype == "bfloat16" and peak.source.startswith("measured")
    assert peak.flops_per_second > 1e8  # any CPU of the last 20 years
    assert compute_dtype("32") is torch.float32 and compute_dtype("16-true") is torch.float16
