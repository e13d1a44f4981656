"""Imports point down: leaves <- the step <- strategies, data, memory, log, ... <- the run <- the CLI.

Every ``import`` of a leantrain module counts, inside functions too: an import moved into a
function to break a cycle is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import leantrain

SOURCE = Path(leantrain.__file__).parent

# Lowest first. A module may import its own layer or any layer below it, never above.
LAYERS = [
    ("leaves", ["_version", "errors", "files", "units", "blocks", "config", "task", "cluster", "runtime",
                "stop_signals", "checkpoint", "bounded_read", "remote", "adapters"]),
    ("step", ["step"]),
    ("pieces", ["strategies", "data", "memory", "log", "launch", "diagnose.advice", "diagnose.flops",
                "diagnose.probe", "diagnose.syncs", "diagnose.timer", "diagnose.nan_origin",
                "diagnose.collectives", "examples", "extensions"]),
    ("run", ["run", "trainer", "simulate"]),
    ("commands", ["diagnose", "cli", "entry", "__main__", ""]),
]  # fmt: skip


def layer_of(module: str) -> int:
    """The layer of ``leantrain.<module>``: its longest matching prefix decides."""
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") or prefix == "") and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank is not None, f"leantrain.{module} is in no layer: add it to LAYERS"
    return rank


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports() -> dict[str, set[str]]:
    """leantrain module -> the leantrain modules it imports (anywhere in the file)."""
    modules = {module_name(path): path for path in SOURCE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                short = target.removeprefix("leantrain").removeprefix(".")
                if target.startswith("leantrain") and short in modules and short != name:
                    found.add(short)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_there_are_no_import_cycles() -> None:
    assert cycles(imports()) == []


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"leantrain.{source} ({LAYERS[layer_of(source)][0]}) imports leantrain.{target} "
        f"({LAYERS[layer_of(target)][0]})"
        for source, targets in sorted(imports().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(source)
    ]
    assert upward == []


def test_the_checks_catch_what_they_name() -> None:
    """The cycle finder and the layer order, on a made-up graph."""
    assert cycles({"config": {"strategies.split"}, "strategies.split": {"config"}, "errors": set()}) == [
        ["config", "strategies.split"]
    ]
    assert layer_of("config") < layer_of("step.batching") < layer_of("strategies.fsdp") < layer_of("run.loop")
    assert layer_of("diagnose.advice") < layer_of("diagnose.doctor") == layer_of("cli")


def test_strategy_names_are_compared_only_inside_strategies() -> None:
    """Outside ``strategies/``, code asks the strategy object; it never compares its name."""
    from leantrain.strategies.registry import names

    compared = []
    for path in SOURCE.rglob("*.py"):
        if module_name(path).startswith("strategies"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                values = [node.left, *node.comparators]
                for value in values:
                    elements = value.elts if isinstance(value, (ast.Tuple, ast.List, ast.Set)) else [value]
                    if any(isinstance(e, ast.Constant) and e.value in names()[1:] for e in elements):
                        compared.append(f"{path.relative_to(SOURCE)}:{node.lineno}")
    assert compared == []
