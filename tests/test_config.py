from __future__ import annotations

import typing

import pytest

import leantrain as lt
from leantrain.config import coerce, describe_type, metavar

BAD_VALUES = [
    ("global_batch_size", 0, "positive integer"),
    ("global_batch_size", -3, "positive integer"),
    ("global_batch_size", 8.5, "must be an integer"),
    ("micro_batch_size", 5, "allowed: 1, 2, 4, 8, 16, 32, 64"),
    ("micro_batch_size", 0, "positive integer"),
    ("max_steps", "abc", "must be an integer or null"),
    ("max_epochs", -1, "positive integer"),
    ("shuffle", "maybe", "true or false"),
    ("max_grad_norm", -1.0, "positive finite number"),
    ("max_grad_norm", float("inf"), "positive finite number"),
    ("precision", "bf17", "one of 32, bf16-mixed, 16-mixed"),
    ("precision", 32, "one of 32, bf16-mixed, 16-mixed"),
    ("num_workers", -2, "0 or more"),
    ("prefetch_factor", 2, "needs num_workers > 0"),
    ("device", "tpu", "allowed: auto, cpu, cuda, cuda:N, mps"),
    ("seed", -1, "between 0 and 2**63 - 1"),
    ("deterministic", 1, "true or false"),
    ("sync_batchnorm", "yes", "true or false"),
    ("log_every_n_steps", 0, "positive integer"),
    ("val_every_n_steps", 0, "positive integer"),
    ("progress", "fancy", "one of auto, rich, plain, none"),
    ("out_dir", 5, "a string or null"),
    ("checkpoint_every", 0, "positive integer"),
    ("keep_checkpoints", 0, "positive integer"),
    ("resume", "auto", "needs out_dir: the run folder to resume"),
    ("resume", " ", "must be auto or the path of a checkpoint file"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD_VALUES)
def test_each_bad_value_gives_one_line_naming_field_value_and_allowed(field, value, allowed):
    with pytest.raises(lt.ConfigError) as caught:
        lt.TrainConfig(**{field: value})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"invalid {field}={value!r}:")
    assert allowed in message
    assert caught.value.field == field


def test_defaults_are_valid_and_frozen():
    cfg = lt.TrainConfig()
    with pytest.raises(AttributeError):
        cfg.global_batch_size = 3  # type: ignore[misc]


def test_micro_batch_must_divide_the_per_rank_batch_for_the_world_size():
    cfg = lt.TrainConfig(global_batch_size=64, micro_batch_size=16)
    cfg.validate(world_size=4)
    with pytest.raises(lt.ConfigError, match=r"micro_batch_size=16: must divide the per-process batch 8"):
        cfg.validate(world_size=8)
    with pytest.raises(lt.ConfigError, match="multiple of the world size 3"):
        cfg.validate(world_size=3)


def test_replace_validates_again():
    with pytest.raises(lt.ConfigError, match="micro_batch_size"):
        lt.TrainConfig(global_batch_size=8).replace(micro_batch_size=3)


def test_epoch_limit_defaults_only_when_no_limit_is_set():
    assert lt.TrainConfig().epoch_limit == 10
    assert lt.TrainConfig(max_steps=5).epoch_limit is None
    assert lt.TrainConfig(max_steps=5, max_epochs=2).epoch_limit == 2


HINTS = typing.get_type_hints(lt.TrainConfig)


@pytest.mark.parametrize(
    ("field", "raw", "expected"),
    [
        ("global_batch_size", "32", 32),
        ("micro_batch_size", "null", None),
        ("micro_batch_size", "none", None),
        ("micro_batch_size", "8", 8),
        ("max_grad_norm", "1e-1", 0.1),
        ("shuffle", "false", False),
        ("shuffle", "True", True),
        ("precision", "32", "32"),
        ("precision", 32, "32"),  # YAML reads `precision: 32` as an int
        ("precision", "bf16-mixed", "bf16-mixed"),
        ("out_dir", "123", "123"),  # a string field keeps digits as text
        ("pin_memory", "null", None),
        ("global_batch_size", "abc", "abc"),  # left for validate() to report
    ],
)
def test_coerce_converts_text_and_yaml_scalars(field, raw, expected):
    assert coerce(raw, HINTS[field]) == expected
    assert type(coerce(raw, HINTS[field])) is type(expected)


def test_type_descriptions_for_help_and_errors():
    assert describe_type(HINTS["micro_batch_size"]) == "an integer, auto or null"
    assert metavar(HINTS["micro_batch_size"]) == "INT|{auto}|null"
    assert metavar(HINTS["precision"]) == "{32,bf16-mixed,16-mixed,bf16-true,16-true}"
    assert [describe_type(kind) for kind in (bool, float, str, type(None))] == [
        "true or false", "a number", "a string", "null"
    ]  # fmt: skip
    assert describe_type(bytes | None) == "bytes or null"  # a type without words of its own: its name
    assert metavar(bytes | None) == "BYTES|null"


def test_fit_help_shows_every_fields_help_under_its_groups_heading(monkeypatch):
    import dataclasses
    import itertools

    from leantrain.cli import _fit_parser, flag
    from leantrain.config import GROUPS

    monkeypatch.setenv("COLUMNS", "2000")  # one line per flag: a help is not cut at a hyphen
    text = _fit_parser().format_help()
    starts = {key: text.index(f"\n{title}:\n") for key, title in GROUPS.items()}
    ends = dict(zip(sorted(starts, key=starts.get), [*sorted(starts.values())[1:], len(text)], strict=True))
    for field in dataclasses.fields(lt.TrainConfig):
        group, help = field.metadata["group"], field.metadata["help"]
        lines = text[starts[group] : ends[group]].splitlines()
        first = next(i for i, line in enumerate(lines) if line.lstrip().startswith(flag(field.name) + " "))
        shown = lines[first] + " ".join(
            itertools.takewhile(lambda line: not line.startswith("  -"), lines[first + 1 :])
        )
        if field.name != "strategy":  # its help lists the registered strategies
            assert isinstance(help, str) and f" {help}" in " ".join(shown.split()), field.name
