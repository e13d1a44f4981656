"""FLOP counting and MFU."""

from __future__ import annotations

import pytest
import torch

from leantrain.diagnose import PeakFlops, count_flops, mfu, peak_flops
from leantrain.diagnose.flops import at_least, compute_dtype


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


def test_a_measured_peak_below_what_the_steps_reached_is_raised_to_it() -> None:
    """On a shared machine the peak's short measurement can be slowed by other work; the steps'
    own rate is then the better bound, and MFU stays a share. A datasheet peak is never changed."""
    slowed = PeakFlops(1e11, "float32", "measured: 1024^3 matmul, 2 threads")
    raised = at_least(slowed, 1.5e11)
    assert raised.flops_per_second == 1.5e11 and "raised to the rate the timed steps reached" in raised.source
    assert mfu(1.5e11, 1.0, raised) == 1.0
    assert at_least(slowed, 0.5e11) == slowed
    datasheet = PeakFlops(1e11, "bfloat16", "datasheet: NVIDIA H100")
    assert at_least(datasheet, 1.5e11) == datasheet
