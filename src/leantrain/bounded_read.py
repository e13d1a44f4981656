"""YAML and JSON files a user hands leantrain, read within bounds: a hostile or broken file is one line.

A ``--config`` file from a colleague or a repository is read before anything else runs, and it
must never cost more than a fraction of a second and a few MB to refuse. A small file can be made
expensive in three ways, each bounded here:

- **size**: at most ``MAX_FILE_BYTES + 1`` bytes are ever read (a config is a few KB; ``/dev/zero``
  ends too);
- **nesting**: PyYAML's composer, jsonargparse and Python's ``json`` recurse once per level, and a
  few thousand ``[`` exhaust the stack (a ``RecursionError`` traceback);
- **YAML aliases**: ``l1: &l1 [*l0, *l0, ...]``, nine levels of ten, is 430 bytes and 10^9 values
  once expanded. PyYAML composes an alias as a reference to the one node it names, which is cheap;
  whoever then walks the data as a tree pays for every copy: jsonargparse's ``Namespace.clone``
  took 70 s and 0.9 GB for 10^7 values, before it said that the keys are not flags. The composer
  below counts the values of the expanded tree as it composes: every node once, every alias the
  count of the node it names, kept per node, so counting costs time linear in the file, not in the
  expansion, and composing stops at the first value over ``MAX_VALUES``.

The limits, measured (docs/errors.md): jsonargparse spends about 6.5 us per expanded value of a
``--config`` (10^4 values: 60 ms, 10^5: 0.7 s), so ``MAX_VALUES`` is 10^4, 200 times the 52 fields
of a whole TrainConfig. The parser is libyaml's (PyYAML's C extension) when it is installed: PyYAML's
pure-Python scanner took 0.9 s for 1 MiB of comments, libyaml 5 ms, and composing stops at the
bound, so a 1 MiB file costs milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from leantrain.errors import ConfigError

MAX_FILE_BYTES = 2**20
MAX_DEPTH = 64
MAX_VALUES = 10_000

# libyaml's event parser when PyYAML was built with it; PyYAML's own composer on top of either, so
# that the bounds below see every node as it is composed.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Unbounded(Exception):
    """A YAML document past one of the bounds; the message says which, and where."""


class _BoundedLoader(Composer, _SafeLoader):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader whose composer counts the expanded tree's values and depth as it goes."""

    def __init__(self, text: str) -> None:
        _SafeLoader.__init__(self, text)
        Composer.__init__(self)  # libyaml's parser does not set up the Python composer's anchors
        self._depth = 0  # of the collection being composed
        self._values = 0  # of the expanded tree composed so far
        self._measures: dict[Node, tuple[int, int]] = {}  # a finished node: its expanded values, height

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:  # an undefined alias: PyYAML's own error, from the call below
                self._expand(node, event)
            return super().compose_node(parent, index)
        self._depth += 1
        where = self.peek_event().start_mark
        if self._depth > MAX_DEPTH:
            raise _Unbounded(f"nests deeper than {MAX_DEPTH} levels (line {where.line + 1})")
        self._count(1, where)
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._measures[node] = _measure(node, self._measures)
        return node

    def _expand(self, node: Node, alias: AliasEvent) -> None:
        """Count an alias as the copy of its anchor's tree that a reader of the data will walk."""
        line = alias.start_mark.line + 1
        measure = self._measures.get(node)
        if measure is None:  # anchored, not finished: the alias is inside the collection it names
            raise _Unbounded(f"alias *{alias.anchor} (line {line}) is inside its own anchor: it never ends")
        values, height = measure
        if self._depth + height > MAX_DEPTH:
            raise _Unbounded(
                f"nests deeper than {MAX_DEPTH} levels once alias *{alias.anchor} (line {line}) is expanded"
            )
        self._count(values, alias.start_mark)

    def _count(self, values: int, where: Any) -> None:
        self._values += values
        if self._values > MAX_VALUES:
            raise _Unbounded(
                f"holds more than {MAX_VALUES:,} values once its aliases are expanded (line {where.line + 1})"
            )


def _measure(node: Node, measures: dict[Node, tuple[int, int]]) -> tuple[int, int]:
    """A finished node's (values, height) in the expanded tree, from its children's, already measured."""
    if isinstance(node, ScalarNode):
        return 1, 1
    if isinstance(node, SequenceNode):
        children = node.value
    else:
        assert isinstance(node, MappingNode)
        children = [child for pair in node.value for child in pair]
    values, heights = zip(*(measures[child] for child in children), strict=True) if children else ((), ())
    return 1 + sum(values), 1 + max(heights, default=0)


def read_text(path: Path, field: str, kind: str, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of ``path``, read no further than ``max_bytes``; ConfigError naming ``field`` and
    the file when it is larger, unreadable, a folder or not UTF-8 (``kind`` names the format)."""
    try:
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except IsADirectoryError:
        raise ConfigError(field, str(path), f"is a folder; give a {kind} file") from None
    except OSError as error:
        raise ConfigError(field, str(path), f"cannot be read ({error.strerror})") from None
    if len(data) > max_bytes:
        raise ConfigError(
            field, str(path), f"is larger than {max_bytes:,} bytes, the most leantrain reads of a {kind} file"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(field, str(path), f"is not UTF-8 text (byte {error.start})") from None


def check_yaml(text: str, field: str, source: str) -> None:
    """ConfigError naming ``field`` and ``source`` unless ``text`` is one YAML document within the
    bounds; composed only (the caller's own reader constructs it)."""
    _compose(_BoundedLoader(text), text, field, source)


def load_yaml(path: Path, field: str) -> Any:
    """The data of a YAML file, read and composed within the bounds, then constructed by PyYAML's
    safe constructor (plain values only); ConfigError naming ``field`` and the file otherwise."""
    text = read_text(path, field, "YAML")
    loader = _BoundedLoader(text)
    node = _compose(loader, text, field, str(path))
    try:
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as error:
        raise _not_yaml(error, field, str(path)) from None
    except (ValueError, TypeError) as error:  # an explicit tag its text does not fit: !!int abc
        raise ConfigError(field, str(path), f"holds a value its tag does not allow ({error})") from None


def _compose(loader: _BoundedLoader, text: str, field: str, source: str) -> Node | None:
    if len(text) > MAX_FILE_BYTES:  # text that did not come through read_text
        raise ConfigError(field, source, f"is larger than {MAX_FILE_BYTES:,} bytes, the most leantrain reads")
    try:
        return loader.get_single_node()
    except _Unbounded as error:
        raise ConfigError(field, source, str(error)) from None
    except yaml.YAMLError as error:
        raise _not_yaml(error, field, source) from None


def _not_yaml(error: yaml.YAMLError, field: str, source: str) -> ConfigError:
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or " ".join(str(error).split()[:12])
    return ConfigError(field, source, f"is not valid YAML{where}: {problem}")


def load_json(path: Path, field: str, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """The data of a JSON file, read no further than ``max_bytes`` and nested at most ``MAX_DEPTH``
    levels; ConfigError naming ``field`` and the file otherwise. JSON has no aliases: its values
    are no more than its bytes."""
    text = read_text(path, field, "JSON", max_bytes)
    try:
        data = json.loads(text)
    except RecursionError:  # json's decoder recurses per level
        raise ConfigError(field, str(path), f"nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as error:
        raise ConfigError(field, str(path), f"is not valid JSON ({error})") from None
    if _nests_deeper(data, MAX_DEPTH):
        raise ConfigError(field, str(path), f"nests deeper than {MAX_DEPTH} levels")
    return data


def _nests_deeper(data: Any, limit: int) -> bool:
    """Whether decoded JSON nests deeper than ``limit`` levels (a scalar: 1), walked without recursion."""
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        pending.extend((child, depth + 1) for child in children)
    return False
