"""The ``leantrain`` command's entry point: start-up without the garbage collector's full passes.

Importing torch leaves about a million long-lived objects (modules, functions, operator
tables). Each full collection of the garbage collector walks all of them (~0.15 s on a 2-core
machine), and the imports after torch's (the CLI's parser, the training loop) trigger one or
more. The command owns its process, so it imports with the collector paused, then moves
everything imported to the permanent generation (``gc.freeze``), which later collections skip:
in start-up and in the training loop alike. Nothing imported is garbage, so nothing is lost;
cycles made afterwards are collected as usual.

The current folder goes first on the import path, as ``python -m leantrain`` puts it (and
torchrun's workers run that): ``--task mylm:MyTask`` finds ``mylm.py`` where the user stands.
The ``leantrain`` script would otherwise start with its own folder (the virtualenv's ``bin``) there.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Sequence

from leantrain.stop_signals import StopSignals


def main(argv: Sequence[str] | None = None) -> int:
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    args = list(sys.argv[1:] if argv is None else argv)
    # A run stops at a step boundary on SIGTERM/SIGUSR1, saying so; armed before torch's import,
    # a signal during the set-up stops it there too (the default action ends it without a word).
    # The other commands keep the default action: they have no step boundary to stop at.
    training = not args or args[0] in ("fit", "doctor")
    with StopSignals() if training else contextlib.nullcontext():
        gc.disable()
        try:
            from leantrain.cli import main as run_command
        finally:
            gc.freeze()
            gc.enable()
        return run_command(args)
