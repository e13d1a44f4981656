"""--strategy split: consecutive parts on their devices, in one process (devices: the CPU here)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import leantrain as lt
from leantrain.examples import load_example
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.registry import check_config
from leantrain.strategies.split import Split, _to_device, balanced_parts
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


# On the CPU every device is the same one, so where a tensor goes is seen by the device it is *sent*
# to: `cpu` and `cpu:0` are the same memory but different devices to ask for.
CPU, CPU0 = torch.device("cpu"), torch.device("cpu:0")


class Point(NamedTuple):
    x: torch.Tensor
    label: str


def test_tensors_are_moved_inside_any_container_and_containers_keep_their_class() -> None:
    from transformers.modeling_outputs import CausalLMOutput

    meta = torch.device("meta")  # moved tensors keep their shape and lose their data: a visible move
    one = torch.ones(2)
    value = {
        "point": Point(one, "a"),
        "list": [one, 3],
        "tuple": (one,),
        "output": CausalLMOutput(logits=one),
        "plain": "text",
    }
    moved = _to_device(value, meta)
    assert isinstance(moved["point"], Point) and moved["point"].x.is_meta and moved["point"].label == "a"
    assert isinstance(moved["list"], list) and moved["list"][0].is_meta and moved["list"][1] == 3
    assert isinstance(moved["tuple"], tuple) and moved["tuple"][0].is_meta
    assert isinstance(moved["output"], CausalLMOutput) and moved["output"].logits.is_meta
    assert moved["output"]["logits"].is_meta  # a ModelOutput's fields are both keys and attributes
    assert moved["plain"] == "text"
    assert not value["list"][0].is_meta and not value["output"].logits.is_meta  # the input is left as it was


class Scale(torch.nn.Module):
    """A module with a buffer and no parameter (as a rotary embedding's cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.tensor(2.0))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * self.factor


class TiedBlocks(torch.nn.Module):
    """An embedding and a head that share one weight, around two repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.token = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(2))
        self.scale = Scale()
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.token.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.token(ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.scale(hidden))


@pytest.fixture
def sent(monkeypatch) -> list[tuple[tuple[int, ...], torch.device | None]]:
    """(shape, device asked for) of every `Tensor.to` call, in order."""
    calls: list[tuple[tuple[int, ...], torch.device | None]] = []
    to = torch.Tensor.to

    def recording_to(tensor, *args, **kwargs):
        calls.append((tuple(tensor.shape), args[0] if args else kwargs.get("device")))
        return to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    return calls


def test_each_part_goes_to_its_device_and_a_tied_weight_stays_with_its_first_user(sent) -> None:
    model = TiedBlocks()
    split(model, "cpu,cpu:0")
    # the embedding and the first block to cpu, the second block and the buffer after it to cpu:0; the
    # head's weight, tied to the embedding's, is not moved a second time
    assert sent == [((10, 4), CPU), ((4, 4), CPU), ((4,), CPU), ((4, 4), CPU0), ((4,), CPU0), ((), CPU0)]
    assert model.head.weight is model.token.weight


def test_inputs_go_to_each_modules_weights_and_the_output_back_to_the_first_device(sent) -> None:
    model = TiedBlocks()
    split(model, "cpu,cpu:0")
    sent.clear()
    model(torch.tensor([[1, 2]]))
    # token, blocks.0: cpu; blocks.1: where its weights are (the tensors of cpu:0 say cpu); the buffer
    # that has no weight: its part's device; the head: where its tied weight stayed; then the output
    # back to the first device, beside the targets
    assert [device for _, device in sent] == [CPU, CPU, CPU, CPU0, CPU, CPU]


def test_keyword_inputs_are_moved_too(sent) -> None:
    model = TiedBlocks()
    split(model, "cpu,cpu:0")
    sent.clear()
    model.blocks[1](input=torch.ones(1, 4))
    assert sent == [((1, 4), CPU)]


@pytest.mark.parametrize("use", ["check", "input_device", "wrap"])
def test_without_a_device_map_the_error_shows_the_empty_value_given(use) -> None:
    cfg = lt.TrainConfig(strategy="split")
    with pytest.raises(lt.ConfigError) as caught:
        if use == "wrap":
            Split(cfg, torch.device("cpu"), ParallelDims()).wrap(DeepRegression().model(), None)
        else:
            getattr(Split, use)(cfg, torch.device("cpu")) if use == "input_device" else Split.check(cfg, 1)
    assert str(caught.value) == (
        "invalid device_map='': needs two or more comma-separated devices, e.g. cuda:0,cuda:1"
    )


def test_the_inputs_start_on_the_first_device_of_the_map() -> None:
    assert Split.input_device(lt.TrainConfig(strategy="split", device_map="cpu:0,cpu"), CPU) == CPU0
    assert Split.input_device(lt.TrainConfig(strategy="split", device_map="cpu,cpu:0"), CPU) == CPU
