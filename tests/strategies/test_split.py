"""--strategy split: consecutive parts on their devices, in one process (devices: the CPU here)."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain.examples import load_example
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.registry import check_config
from leantrain.strategies.split import Split, balanced_parts
from tests.conftest import DeepRegression


def test_a_split_model_trains_exactly_as_the_whole_model(fit):
    whole = fit(DeepRegression(), global_batch_size=16, micro_batch_size=4, max_steps=10, device="cpu")
    split = fit(DeepRegression(), global_batch_size=16, micro_batch_size=4, max_steps=10,
                strategy="split", device_map="cpu,cpu")  # fmt: skip
    assert split.strategy == "split"
    for name, value in whole.model.state_dict().items():
        assert torch.equal(split.model.state_dict()[name], value), name


def split(model: torch.nn.Module, device_map: str) -> Split:
    strategy = Split(
        lt.TrainConfig(strategy="split", device_map=device_map), torch.device("cpu"), ParallelDims()
    )
    strategy.wrap(model, None)
    return strategy


def test_blocks_are_divided_in_order_and_the_rest_goes_to_the_ends() -> None:
    plan = split(DeepRegression().model(), "cpu,cpu")
    # the 6->16 input layer is a Linear too, but the repeated blocks are the Sequentials
    assert plan.parts() == [["0", "1", "2"], ["3", "4", "5"]]
    charlm = split(load_example("charlm").model(), "cpu,cpu,cpu")
    # 4 blocks over 3 devices: 2, 1, 1; embeddings first, the final norm and the head last
    assert charlm.parts() == [
        ["token", "position", "blocks.0", "blocks.1"],
        ["blocks.2"],
        ["blocks.3", "norm", "head"],
    ]


def test_parts_are_as_equal_as_they_can_be() -> None:
    assert balanced_parts(5, 2) == [0, 0, 0, 1, 1]
    assert balanced_parts(4, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize(("fields", "field"), [
    ({"strategy": "split"}, "device_map"),
    ({"device_map": "cpu,cpu"}, "device_map"),
    ({"strategy": "split", "device_map": "cpu"}, "device_map"),
    ({"strategy": "split", "device_map": "cpu,warp:3"}, "device_map"),
    ({"strategy": "split", "device_map": "cpu,cpu", "precision": "bf16-true"}, "precision"),
])  # fmt: skip
def test_bad_split_settings_are_one_line_errors(fields, field) -> None:
    with pytest.raises(lt.ConfigError) as caught:
        check_config(lt.TrainConfig(**fields))
    assert caught.value.field == field and "\n" not in str(caught.value)


def test_more_devices_than_blocks_is_refused() -> None:
    with pytest.raises(lt.ConfigError, match="needs as many repeated blocks; the model has 4"):
        split(DeepRegression().model(), ",".join(["cpu"] * 5))
