"""Hidden host synchronisations and retained autograd graphs, found in the user's code.

Both detectors are ``TorchFunctionMode`` s: while one is active, every tensor operation
called from Python passes through it, and it looks at the calling frame. That costs time
per operation, so the doctor turns them on for a few steps only, never the timed ones.

* ``HostSyncs`` counts the calls that make the host wait for the device: ``.item()``,
  ``.tolist()``, ``.cpu()``/``.to("cpu")``, ``.numpy()``, ``bool()``/``int()``/``float()``
  of a tensor (an ``if loss > 0:``), printing or formatting a tensor, and
  ``torch.cuda.synchronize``/``torch.cuda.empty_cache``, by the file and line that made
  the call. On a CPU run nothing waits, but the same line stalls an accelerator, so they
  are counted all the same. A call is attributed to the first frame outside torch and
  the standard library; calls made by leantrain's own engine (its one planned read per
  step, its log points) are counted apart, as ``engine``.
* ``RetainedGraphs`` remembers (weakly) every tensor with a ``grad_fn`` created while it
  records, with the line that created it; a tensor still alive a whole step later keeps
  its autograd graph alive (a loss appended to a list, an output stored on ``self``).

Usable on a hand-written loop::

    with diagnose.HostSyncs() as syncs:
        train_one_step()
    for site in syncs.sites():
        print(site.call, site.file, site.line, site.count)
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIRS = tuple(
    {os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")}
)
# This file's package's parent: leantrain itself (importing the package from here would be a cycle).
_LEANTRAIN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The built-in examples are tasks, i.e. user code, even though they ship with leantrain.
_EXAMPLES_DIR = os.path.join(_LEANTRAIN_DIR, "examples") + os.sep
_THIS_FILE = os.path.abspath(__file__)

# Tensor methods that read device values on the host, and how the report names them.
_SYNC_CALLS = {
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.cpu: ".cpu()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "int(tensor)",
    torch.Tensor.__repr__: "print(tensor)",
    torch.Tensor.__format__: "format(tensor)",
}
_CUDA_CALLS = {"synchronize": "torch.cuda.synchronize()", "empty_cache": "torch.cuda.empty_cache()"}


@dataclass(frozen=True)
class CallSite:
    file: str
    line: int
    engine: bool  # inside leantrain itself (not its examples): not the user's doing


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return (
        path.startswith(_TORCH_DIR)
        or path == _THIS_FILE
        or filename.startswith("<")  # frozen importlib, generated code
        or (os.path.realpath(path).startswith(_STDLIB_DIRS) and "site-packages" not in path)
    )


_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep


def caller_site(frame: FrameType | None) -> CallSite | None:
    """The first frame, from ``frame`` outwards, that is not torch's, this module's or the stdlib's.

    None for calls made inside ``torch.optim``: optimizers read their step counters, host
    scalars by design (unless ``capturable``), which is no sync of the device.
    """
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_OPTIM_DIR):
            return None
        if not _is_library(filename):
            path = os.path.abspath(filename)
            engine = path.startswith(_LEANTRAIN_DIR) and not path.startswith(_EXAMPLES_DIR)
            return CallSite(path, frame.f_lineno, engine)
        frame = frame.f_back
    return None


@dataclass(frozen=True)
class HostSync:
    call: str  # ".item()", "bool(tensor)", ...
    file: str
    line: int
    count: int
    seconds: float  # spent inside these calls (on CUDA: mostly waiting for the device)

    def per_step(self, steps: int) -> float:
        return self.count / max(steps, 1)


def _moves_to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a device tensor to the CPU (the host waits).

    Unlike ``.cpu()``, ``.to(device)`` is usually written for the run's device: on a CPU
    run it moves nothing, and on a GPU run the same line moves data to the GPU.
    """
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    try:
        device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    except (TypeError, RuntimeError):
        return False
    return device is not None and device.type == "cpu"


class HostSyncs(TorchFunctionMode):
    """Counts host synchronisations by call site while active (see the module docstring).

    ``device``: count only reads of tensors on this device type (None: any device). On a
    CPU run, pass ``"cpu"``: the same lines would stall an accelerator.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device_type = None if device is None else torch.device(device).type
        self.paused = False  # set while the engine loads data: a dataset's CPU work is not a sync
        self._counts: Counter[tuple[str, CallSite]] = Counter()
        self._seconds: defaultdict[tuple[str, CallSite], float] = defaultdict(float)
        self._patched: dict[str, Any] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _SYNC_CALLS.get(func)
        if name is None and func is torch.Tensor.to and _moves_to_cpu(args, kwargs):
            name = '.to("cpu")'
        if name is None or self.paused or not self._watched(args):
            return func(*args, **kwargs)
        started = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            self._record(name, sys._getframe(1), time.perf_counter() - started)

    def _watched(self, args: tuple) -> bool:
        tensor = args[0] if args else None
        return isinstance(tensor, torch.Tensor) and (
            self.device_type is None or tensor.device.type == self.device_type
        )

    def _record(self, name: str, frame: FrameType | None, seconds: float) -> None:
        site = caller_site(frame)
        if site is not None:
            self._counts[name, site] += 1
            self._seconds[name, site] += seconds

    def __enter__(self) -> HostSyncs:
        # Not tensor methods: torch.cuda's functions are wrapped while the mode is active.
        for attribute, name in _CUDA_CALLS.items():
            original = getattr(torch.cuda, attribute)
            self._patched[attribute] = original
            setattr(torch.cuda, attribute, self._counting(original, name))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for attribute, original in self._patched.items():
            setattr(torch.cuda, attribute, original)
        self._patched = {}
        super().__exit__(*exc)

    def _counting(self, original: Any, name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if not self.paused:
                    self._record(name, sys._getframe(1), time.perf_counter() - started)

        return counted

    def sites(self, engine: bool = False) -> list[HostSync]:
        """The user's sync calls (``engine=True``: leantrain's own), most frequent first."""
        found = [
            HostSync(name, site.file, site.line, count, self._seconds[name, site])
            for (name, site), count in self._counts.items()
            if site.engine == engine
        ]
        return sorted(found, key=lambda s: (-s.count, s.file, s.line))


@dataclass(frozen=True)
class RetainedGraph:
    file: str
    line: int
    tensors: int  # tensors created there that are still alive
    bytes: int  # their own storage (the graph behind them holds more)


class RetainedGraphs(TorchFunctionMode):
    """Records tensors with a ``grad_fn`` made while active; ``alive()`` lists those still referenced.

    Record during one step, call ``alive()`` after the next one: nothing a step creates
    for autograd should outlive it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._made: list[tuple[weakref.ref, CallSite]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.grad_fn is not None:
            site = caller_site(sys._getframe(1))
            if site is not None:
                self._made.append((weakref.ref(result), site))
        return result

    def alive(self) -> list[RetainedGraph]:
        """Where the still-referenced tensors were created, most tensors first."""
        counts: Counter[CallSite] = Counter()
        sizes: Counter[CallSite] = Counter()
        for ref, site in self._made:
            tensor = ref()
            if tensor is not None:
                counts[site] += 1
                sizes[site] += tensor.numel() * tensor.element_size()
        found = [RetainedGraph(site.file, site.line, n, sizes[site]) for site, n in counts.items()]
        return sorted(found, key=lambda g: (-g.tensors, g.file, g.line))

    def forget(self) -> None:
        self._made = []
