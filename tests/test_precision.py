from __future__ import annotations

import torch
from torch import nn

from leantrain.precision import Autocast, Fp32, make_precision

CPU = torch.device("cpu")


def test_make_precision_picks_the_mode():
    assert isinstance(make_precision("32", CPU), Fp32)
    bf16 = make_precision("bf16-mixed", CPU)
    assert isinstance(bf16, Autocast) and bf16.scaler is None
    assert make_precision("16-mixed", CPU).scaler is not None


def test_autocast_runs_matmuls_in_16_bit():
    layer = nn.Linear(4, 4)
    with make_precision("bf16-mixed", CPU).autocast():
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    with make_precision("32", CPU).autocast():
        assert layer(torch.ones(2, 4)).dtype == torch.float32


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    precision = make_precision("16-mixed", CPU)
    before = [p.detach().clone() for p in layer.parameters()]
    precision.backward(layer(torch.ones(1, 2)).sum() * float("inf"))
    params = list(layer.parameters())
    precision.unscale_and_clip(optimizer, params, max_norm=1.0)
    assert precision.step(optimizer) is False
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))
    assert precision.state_dict()["scaler"]["scale"] < 2.0**16
    optimizer.zero_grad()
    precision.backward(layer(torch.ones(1, 2)).sum())
    assert precision.step(optimizer) is True
    assert not all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))


def test_scaler_state_round_trips():
    source = make_precision("16-mixed", CPU)
    source.scaler.scale(torch.ones(()))  # the scale is created lazily, at first use
    source.scaler.update(1024.0)
    target = make_precision("16-mixed", CPU)
    target.load_state_dict(source.state_dict())
    assert target.scaler.get_scale() == 1024.0
