"""Hostile config files (issue 42): a few hundred bytes of YAML must never cost more than a fraction
of a second and a few MB to refuse, whatever their aliases, nesting or size.

The CLI runs in this process, as in test_hostile_input.py. Memory is the hard bound (measured with
tracemalloc); time is asserted generously, for a busy machine. Each call runs under a guard, so that
a regression costs this machine a MemoryError or a TimeoutError, not its memory: the 10^7 bomb took
0.9 GB before the bound, and 10^9 takes the machine.
"""

from __future__ import annotations

import contextlib
import re
import resource
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from leantrain import cli
from leantrain.bounded_read import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES, check_yaml, load_json, load_yaml
from leantrain.data.cache import MANIFEST, CacheError, open_cache
from leantrain.errors import ConfigError
from tests.test_hostile_input import BASE, ReachedTraining, run_cli

# Python memory a refusal may take, parser construction included (it takes about 1 MB).
REFUSAL_BYTES = 50 * 2**20
REFUSAL_SECONDS = 5.0
# What a regression may take before it fails instead: more than any bound above, far less than the machine.
GUARD_BYTES = 256 * 2**20


def alias_bomb(levels: int, width: int = 10) -> str:
    """``levels`` lines of ``width`` references to the line before: width**levels values once expanded."""
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def flow_bomb(levels: int, width: int = 10) -> str:
    """The same bomb as one flow sequence, for a flag value."""
    parts = [f"&l0 [{', '.join(['x'] * width)}]"]
    parts += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(parts)}]"


def nested(depth: int) -> str:
    return "a: " + "[" * (depth - 1) + "]" * (depth - 1) + "\n"  # the mapping is the first level


def data_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmData:\s+(\d+) kB", status).group(1)) * 1024


@contextlib.contextmanager
def guarded() -> Iterator[dict[str, float]]:
    """Measures the Python memory and the seconds of the block, which may take at most GUARD_BYTES
    more data (a MemoryError past them); run_cli adds its own 60 s alarm."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data_bytes() + GUARD_BYTES, hard))
    tracemalloc.start()
    measured: dict[str, float] = {}
    started = time.perf_counter()
    try:
        yield measured
    finally:
        measured["seconds"] = time.perf_counter() - started
        measured["peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(*args: str) -> str:
    """The one stderr line of ``leantrain ARGS``, refused with exit 2 within the bounds."""
    with guarded() as cost:
        outcome = run_cli(*args)
    lines = outcome.stderr.strip().splitlines()
    assert outcome.code == 2, outcome.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("leantrain: error: "), outcome.stderr[-2000:]
    assert cost["peak_bytes"] < REFUSAL_BYTES, f"{cost['peak_bytes'] / 2**20:.0f} MB"
    assert cost["seconds"] < REFUSAL_SECONDS
    return lines[0]


@pytest.mark.parametrize("levels", [9, 12])  # 10^9 and 10^12 values in 430 and 590 bytes
@pytest.mark.parametrize("command", ["fit", "plan", "doctor"])
def test_an_alias_bomb_is_refused_in_one_line_with_little_memory(in_tmp, command, levels):
    (in_tmp / "bomb.yaml").write_text(alias_bomb(levels))
    line = refused(command, "--config", "bomb.yaml")
    assert f"config='bomb.yaml': holds more than {MAX_VALUES:,} values once its aliases are expanded" in line


def test_a_bomb_in_the_config_of_a_launch_or_a_slurm_job_is_refused_before_it_starts(in_tmp):
    (in_tmp / "bomb.yaml").write_text(alias_bomb(12))
    assert "holds more than" in refused("launch", "fit", "--config", "bomb.yaml")
    assert "holds more than" in refused("slurm", "--dry-run", "true", "fit", "--config", "bomb.yaml")


def test_a_file_replaced_after_the_check_is_bounded_where_jsonargparse_reads_it(in_tmp, monkeypatch):
    # YamlConfig checks the file, then jsonargparse reads it again: what it reads is bounded too.
    monkeypatch.setattr(cli, "check_yaml_mapping", lambda path, field: None)
    (in_tmp / "bomb.yaml").write_text(alias_bomb(9))
    assert "config='bomb.yaml': holds more than" in refused(*BASE, "--config", "bomb.yaml")


def test_a_bomb_in_a_typed_flag_value_is_refused(in_tmp):
    # jsonargparse parses the value of a typed flag as YAML: 400 bytes on a command line, 10^9 values.
    bomb = flow_bomb(9)
    line = refused("launch", "--node-rank", bomb, "fit")
    assert line.startswith(f'leantrain: error: Parser key "node_rank": invalid value={bomb[:179]!r}'[:-1])
    assert line.endswith(f"...({len(bomb) + 2} characters): holds more than {MAX_VALUES:,} values once its "
                         "aliases are expanded (line 1)")  # fmt: skip


def test_an_alias_inside_its_own_anchor_is_refused(in_tmp):
    (in_tmp / "loop.yaml").write_text("a: &a [1, *a]\n")
    assert "alias *a (line 1) is inside its own anchor: it never ends" in refused(
        *BASE, "--config", "loop.yaml"
    )


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900])  # 900: PyYAML's composer recurses past Python's limit
def test_deep_nesting_is_refused_in_one_line(in_tmp, depth):
    (in_tmp / "deep.yaml").write_text(nested(depth))
    assert f"nests deeper than {MAX_DEPTH} levels (line 1)" in refused(*BASE, "--config", "deep.yaml")


def test_nesting_is_counted_with_the_aliases_expanded(in_tmp):
    # Each part nests 40 levels; the alias puts one inside the other: 80 once expanded.
    half = MAX_DEPTH * 5 // 8
    text = f"a: &a {'[' * half}{']' * half}\nb: {'[' * half}*a{']' * half}\n"
    (in_tmp / "deep.yaml").write_text(text)
    line = refused(*BASE, "--config", "deep.yaml")
    assert f"nests deeper than {MAX_DEPTH} levels once alias *a (line 2) is expanded" in line


def test_a_yaml_error_is_one_line_with_its_line_and_problem_or_its_first_twelve_words():
    import yaml

    from leantrain.bounded_read import _not_yaml

    words = " ".join(f"w{n}" for n in range(20))
    bare = _not_yaml(yaml.YAMLError(f"{words}\n  more"), "config", "c.yaml")
    assert str(bare) == f"invalid config='c.yaml': is not valid YAML: {' '.join(words.split()[:12])}"
    mark = yaml.Mark("c.yaml", 0, 6, 0, None, None)  # the 7th line
    marked = yaml.MarkedYAMLError(problem="found a tab", problem_mark=mark)
    assert (
        str(_not_yaml(marked, "config", "c.yaml"))
        == "invalid config='c.yaml': is not valid YAML at line 7: found a tab"
    )


def test_the_depth_and_value_bounds_are_inclusive(tmp_path):
    (tmp_path / "deep.yaml").write_text(nested(MAX_DEPTH))
    assert load_yaml(tmp_path / "deep.yaml", "config")["a"] is not None
    # an alias of 10 levels inside 53 lists (under the mapping): MAX_DEPTH once expanded, one more refused
    outer = MAX_DEPTH - 11
    for lists, loads in ((outer, True), (outer + 1, False)):
        (tmp_path / "alias.yaml").write_text(f"a: &a {'[' * 10}{']' * 10}\nb: {'[' * lists}*a{']' * lists}\n")
        if loads:
            assert load_yaml(tmp_path / "alias.yaml", "config")["b"] is not None
        else:
            with pytest.raises(ConfigError, match="once alias"):
                load_yaml(tmp_path / "alias.yaml", "config")
    # A mapping of one key and a list: 1 + 1 + (1 + n) values.
    (tmp_path / "many.yaml").write_text(f"a: [{', '.join(['1'] * (MAX_VALUES - 3))}]\n")
    assert len(load_yaml(tmp_path / "many.yaml", "config")["a"]) == MAX_VALUES - 3
    (tmp_path / "many.yaml").write_text(f"a: [{', '.join(['1'] * (MAX_VALUES - 2))}]\n")
    with pytest.raises(ConfigError, match="holds more than"):
        load_yaml(tmp_path / "many.yaml", "config")


def test_an_alias_counts_the_values_and_levels_of_what_it_names_exactly(tmp_path):
    """Each bound at its edge through aliases of a list, a mapping and a scalar; the line named is the
    alias's; a collection finished inside another gives its depth back to the one it is in."""

    def loads(text: str) -> str:
        (tmp_path / "a.yaml").write_text(text)
        try:
            load_yaml(tmp_path / "a.yaml", "config")
        except ConfigError as error:
            return str(error).split(": ", 1)[1]
        return "loads"

    def many(count: int) -> str:
        return ", ".join(["1"] * count)

    # the mapping, a, [1 + n], b, [1 + the alias's 1 + n]: 6 + 2n values
    assert loads(f"a: &a [{many(4997)}]\nb: [*a]\n") == "loads"
    assert loads(f"a: &a [{many(4998)}]\nb: [*a]\n") == (
        f"holds more than {MAX_VALUES:,} values once its aliases are expanded (line 2)"
    )
    # a mapping of m pairs is 1 + 2m values: 8 + 4m here
    pairs = ", ".join(f"k{i}: 1" for i in range(2498))
    assert loads(f"a: &a {{{pairs}}}\nb: [*a, 1, 1]\n") == "loads"
    assert loads(f"a: &a {{{pairs}, k: 1}}\nb: [*a, 1, 1]\n").startswith("holds more than")
    # a scalar is one value, one level: 5 + k values; 1 + lists + 1 levels
    assert loads(f"a: &a x\nb: [{', '.join(['*a'] * 9995)}]\n") == "loads"
    assert loads(f"a: &a x\nb: [{', '.join(['*a'] * 9996)}]\n").startswith("holds more than")
    assert loads(f"a: &a x\nb: {'[' * (MAX_DEPTH - 2)}*a{']' * (MAX_DEPTH - 2)}\n") == "loads"
    assert loads(f"a: &a x\nb: {'[' * (MAX_DEPTH - 1)}*a{']' * (MAX_DEPTH - 1)}\n") == (
        f"nests deeper than {MAX_DEPTH} levels once alias *a (line 2) is expanded"
    )
    # [[], then 63 levels]: 65 deep with the mapping, though the empty list before ended at level 3
    assert loads(f"a: [[], {'[' * 63}{']' * 63}]\n") == f"nests deeper than {MAX_DEPTH} levels (line 1)"


def test_yaml_text_past_the_size_bound_is_refused_before_it_is_parsed():
    """Text that was not read from a file by leantrain (a typed flag's value, the config file as
    jsonargparse reads it again) is bounded too."""
    with pytest.raises(ConfigError) as error:
        check_yaml("1" * (MAX_FILE_BYTES + 1), "value", "a flag's text")
    assert (error.value.field, str(error.value)) == (
        "value",
        f'invalid value="a flag\'s text": is larger than {MAX_FILE_BYTES:,} bytes, the most leantrain reads',
    )
    check_yaml("1" * MAX_FILE_BYTES, "value", "a flag's text")  # the largest is parsed


@pytest.mark.parametrize("name", ["big.yaml", "/dev/zero"])
def test_an_oversized_file_is_refused_after_reading_no_more_than_the_bound(in_tmp, name):
    (in_tmp / "big.yaml").write_text("# " + "x" * MAX_FILE_BYTES + "\nmax_steps: 1\n")
    line = refused(*BASE, "--config", name)
    assert f"is larger than {MAX_FILE_BYTES:,} bytes, the most leantrain reads of a YAML file" in line


def test_a_file_of_the_largest_size_is_read(tmp_path):
    text = "max_steps: 1\n"
    (tmp_path / "full.yaml").write_text("#" * (MAX_FILE_BYTES - len(text) - 1) + "\n" + text)
    assert load_yaml(tmp_path / "full.yaml", "config") == {"max_steps": 1}


class RecordsConfig:
    """Stands for the Trainer that `fit` builds: keeps the config it was given, and stops there."""

    config = None

    def __init__(self, config, callbacks=(), instruments=None) -> None:
        RecordsConfig.config = config
        raise ReachedTraining


def test_a_config_that_uses_anchors_and_aliases_for_shared_values_still_works(in_tmp, monkeypatch):
    monkeypatch.setattr("leantrain.trainer.Trainer", RecordsConfig)
    (in_tmp / "run.yaml").write_text(
        "# one value, written once\n"
        "max_steps: &steps 12\n"
        "log_every_n_steps: *steps\n"
        "global_batch_size: 32\n"
        "micro_batch_size: 8\n"
    )
    outcome = run_cli(*BASE, "--config", "run.yaml", "--out", "out")
    assert outcome.code is None, outcome.stderr  # None: training was reached
    config = RecordsConfig.config
    assert (config.max_steps, config.log_every_n_steps, config.micro_batch_size) == (12, 12, 8)


def test_yaml_tags_that_build_objects_or_do_not_fit_their_text_are_one_line(tmp_path):
    (tmp_path / "object.yaml").write_text("a: !!python/object/apply:os.system [ls]\n")
    with pytest.raises(ConfigError) as error:
        load_yaml(tmp_path / "object.yaml", "mixture")
    assert (error.value.field, str(error.value)) == ("mixture", (
        f"invalid mixture={str(tmp_path / 'object.yaml')!r}: is not valid YAML at line 1: could not "
        "determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"
    ))  # fmt: skip
    (tmp_path / "int.yaml").write_text("a: !!int abc\n")
    with pytest.raises(ConfigError) as error:
        load_yaml(tmp_path / "int.yaml", "mixture")
    assert (error.value.field, str(error.value)) == ("mixture", (
        f"invalid mixture={str(tmp_path / 'int.yaml')!r}: holds a value its tag does not allow (invalid "
        "literal for int() with base 10: 'abc')"
    ))  # fmt: skip


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[" * 100_000, "nests deeper than 64 levels"),  # json's own recursion: RecursionError
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nests deeper than 64 levels"),
        ("{not json", "is not valid JSON"),
        ("1" * (MAX_FILE_BYTES + 1), f"is larger than {MAX_FILE_BYTES:,} bytes"),
    ],
)
def test_a_json_file_past_the_bounds_is_one_line(tmp_path, text, reason):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_json(tmp_path / "x.json", "cache")
    assert str(refused.value).startswith(f"invalid cache={str(tmp_path / 'x.json')!r}: {reason}")


def test_json_nests_64_levels_of_lists_or_objects_and_no_more_and_reads_as_far_as_asked(tmp_path):
    path = tmp_path / "x.json"
    for depth, inner in ((MAX_DEPTH, "[]"), (MAX_DEPTH - 1, "[1]"), (MAX_DEPTH - 1, '{"a": 1}')):
        path.write_text("[" * (depth - 1) + inner + "]" * (depth - 1))  # a scalar is one level
        assert load_json(path, "cache") is not None
    for text in ("[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH, '{"a": ' * MAX_DEPTH + "1" + "}" * MAX_DEPTH):
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"nests deeper than {MAX_DEPTH} levels"):
            load_json(path, "cache")
    path.write_text('{"a": [1, 2, 3]}')  # 16 bytes
    assert load_json(path, "cache", max_bytes=16) == {"a": [1, 2, 3]}
    with pytest.raises(ConfigError) as refused:
        load_json(path, "cache", max_bytes=15)
    assert str(refused.value) == (
        f"invalid cache={str(path)!r}: is larger than 15 bytes, the most leantrain reads of a JSON file"
    )


def test_a_hostile_cache_manifest_is_one_line_naming_the_folder(tmp_path):
    (tmp_path / MANIFEST).write_text('{"format": 1, "pad": "' + "x" * MAX_FILE_BYTES + '"}')
    with pytest.raises(
        CacheError, match=rf"cache {re.escape(str(tmp_path))}: cache\.json is unreadable \(is larger"
    ):
        open_cache(tmp_path, {})
    (tmp_path / MANIFEST).write_text("[1, 2]")
    with pytest.raises(CacheError, match="holds no leantrain cache manifest"):
        open_cache(tmp_path, {})
