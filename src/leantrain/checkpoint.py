"""Checkpoints: atomic saves, safe loads, exact resume, and safetensors export.

A checkpoint is one ``torch.save`` file, ``checkpoints/step-00000120.pt``, holding only
tensors and plain Python values, so that it loads with ``weights_only=True``: loading a
checkpoint never runs code from the file. It holds everything that the next step
depends on: model, optimizer, scheduler and precision (loss scaler) state, the step (the
sampler's whole position: see ``data/sampler.py``), the losses not yet logged, and the
RNG states of Python, NumPy and torch (CPU and CUDA), taken at the step boundary.
"""

from __future__ import annotations

import io
import pickle
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils._pytree import tree_leaves

from leantrain.adapters import (
    FrozenBase,
    check_not_adapter_checkpoint,
    load_adapter_weights,
    merged,
    with_lora,
)
from leantrain.errors import CheckpointError, TaskError, one_line
from leantrain.files import as_the_umask_says, atomic_write, check_folder, writing
from leantrain.remote import RemoteFolder, is_url
from leantrain.runtime import seed_everything

FORMAT = "leantrain-checkpoint"
FORMAT_VERSION = 1
# Settings that fix the sample order and the update rule: a checkpoint only resumes a run
# that agrees on them. Everything else (max_steps, logging, workers, micro-batch) may change.
MUST_MATCH = ("global_batch_size", "seed", "shuffle", "precision")
_NAME = re.compile(r"step-(\d+)\.pt")


SHARDS_SUFFIX = ".dcp"  # the folder beside a sharded checkpoint's file: step-N.dcp/
_SHARDS_NAME = re.compile(r"step-\d+\.dcp")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def capture_rng() -> dict[str, Any]:
    """The RNG states of Python, NumPy and torch, as tensors and plain values."""
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically: a crash during the save leaves the previous file intact."""
    payload = {"format": FORMAT, "format_version": FORMAT_VERSION, **state}
    atomic_write(Path(path), lambda tmp: _save(payload, tmp), "checkpoint", tensor_bytes(payload))


def _save(payload: dict[str, Any], path: Path) -> None:
    # Through a Python file: a full disk then surfaces as OSError(ENOSPC) under torch's RuntimeError;
    # given a path, torch's C++ writer reports only "unexpected pos" (measured: no slower, 400 MB).
    with path.open("wb") as handle:
        torch.save(payload, handle)


def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state``, each storage once: what torch.save writes, near enough."""
    storages = {}
    for leaf in tree_leaves(state):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def check_checkpoint_file(path: Path) -> None:
    """CheckpointError unless ``path`` is a file (what it holds is checked when it is loaded)."""
    if "\0" in str(path):
        raise CheckpointError(f"checkpoint {str(path)!r} contains a NUL character, which no path may hold")
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist" + (" (it is a folder)" if path.is_dir() else "")
        )


def load_checkpoint(path: Path | str) -> dict[str, Any]:
    """Load a checkpoint safely; CheckpointError (one line, naming the file) when it is unusable.

    What torch warns while reading (a plain pickle of another protocol than its own) is held back
    until the file is known to be a checkpoint: before the one line that says it is not, it would
    only be noise."""
    path = Path(path)
    check_checkpoint_file(path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state = _read(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a leantrain checkpoint")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {state.get('format_version')}; "
            f"this leantrain reads version {FORMAT_VERSION}"
        )
    shards = state.get("sharded")
    if shards is not None and not (isinstance(shards, str) and _SHARDS_NAME.fullmatch(shards)):
        # Joined onto the checkpoint's folder: a crafted '../..' or absolute path would point anywhere.
        raise CheckpointError(f"checkpoint {path} names its shards {shards!r}, not a shard folder beside it")
    for warning in said:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return state


def _read(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # weights_only refuses any object that is not a tensor or a plain value: this is
        # where a file crafted to run code on unpickling is stopped. Random bytes fail here
        # too, as an unknown opcode rather than a forbidden global.
        forbidden = [line for line in str(error).splitlines() if "GLOBAL" in line]
        if forbidden:
            raise CheckpointError(
                f"checkpoint {path} holds objects that are not plain data, refused: {forbidden[0].strip()}"
            ) from error
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated (not a readable torch file)"
        ) from error
    except Exception as error:
        # Arbitrary bytes reach the unpickler's internals (IndexError, KeyError, struct.error,
        # ...): whatever it raises, the file is unusable, and weights_only ran no code.
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({one_line(error)})") from error


def check_compatible(state: dict[str, Any], path: Path, config: dict[str, Any], dataset_size: int) -> None:
    """CheckpointError naming the first setting in which the checkpoint and this run differ."""
    saved = state["config"]
    for name in MUST_MATCH:
        if saved.get(name) != config[name]:
            raise CheckpointError(
                f"checkpoint {path} was saved with {name}={saved.get(name)!r} but this run has "
                f"{name}={config[name]!r}; resuming would change the optimisation"
            )
    if state["dataset_size"] != dataset_size:
        raise CheckpointError(
            f"checkpoint {path} was saved with {state['dataset_size']} training samples but this run "
            f"has {dataset_size}; the sample order would differ"
        )


def load_into(target: Any, saved: dict[str, Any], what: str, path: Path) -> None:
    """``target.load_state_dict(saved)``, with a mismatch reported as one line naming the file."""
    try:
        if isinstance(target, nn.Module):
            target.load_state_dict(saved, strict=True)
        else:
            target.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as error:
        raise CheckpointError(
            f"checkpoint {path} does not match this run's {what}: {one_line(error)}"
        ) from error


class CheckpointFolder:
    """The checkpoints of one run: numbered files, the newest K kept, and those of the steps in
    ``protected`` (the best ones by a metric, see ``extensions/best_checkpoints.py``)."""

    def __init__(self, folder: Path, keep: int) -> None:
        self.folder = Path(folder)
        self.keep = keep
        self.protected: set[int] = set()

    def files(self) -> list[Path]:
        """Checkpoint files, oldest first (temporary files of interrupted saves are not listed)."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.fullmatch(p.name))]
        return [path for _, path in sorted(found)]

    def shard_folder(self, step: int) -> Path:
        """Where a sharded checkpoint's shards go (its file refers to it by name)."""
        return self.folder / checkpoint_name(step).replace(".pt", SHARDS_SUFFIX)

    def shards_of(self, checkpoint: Path, name: str) -> Path:
        """Where the shards ``name`` of the loaded ``checkpoint`` are: beside its file."""
        return checkpoint.parent / name

    def describe(self, checkpoint: Path) -> str:
        """How a checkpoint of this folder is named to the user."""
        return str(checkpoint)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / checkpoint_name(step)
        save_checkpoint(path, state)
        files = self.files()
        for old in files[: -self.keep]:  # the newest K stay, protected or not; older ones unless protected
            if _step_of(old) not in self.protected:
                old.unlink(missing_ok=True)
        for stale in self.folder.glob(".step-*.pt.tmp-*"):  # left by a save that was killed
            stale.unlink(missing_ok=True)
        kept = {p.name.replace(".pt", SHARDS_SUFFIX) for p in self.files()}
        for shards in self.folder.glob(f"step-*{SHARDS_SUFFIX}"):
            # Shards of a removed checkpoint, or of a save killed before its file was written.
            if shards.name not in kept and shards.name < self.shard_folder(step).name:
                shutil.rmtree(shards, ignore_errors=True)
        return path

    def newest_valid(self, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads; unusable newer ones are reported through ``warn``."""
        for path in reversed(self.files()):
            try:
                state = load_checkpoint(path)
                if state.get("sharded"):
                    check_shards(path, self.folder / state["sharded"])
                return path, state
            except CheckpointError as error:
                warn(f"skipping {error}")
        return None


def _step_of(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    assert match is not None
    return int(match.group(1))


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Each further name of a tied parameter or buffer -> its first name.

    "First" is the order of ``state_dict`` (the order modules were registered in): for a
    transformers language model, the input embedding (``transformer.wte.weight``) rather
    than the output head that reuses it (``lm_head.weight``), as transformers itself saves it.
    """
    first_name: dict[int, str] = {}
    aliases = {}
    for name, tensor in (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ):
        owner = first_name.setdefault(id(tensor), name)
        if owner != name:
            aliases[name] = owner
    return aliases


def unique_tensors(
    state_dict: dict[str, torch.Tensor], aliases: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """One entry per tensor: tied weights keep their first name, so every strategy exports the same names.

    ``aliases`` (from :func:`tied_aliases`) names the ties of a state dict whose tensors no
    longer share storage (FSDP gathers each name into a tensor of its own); without it, ties
    are found as several names over one storage (a state dict as the model or a checkpoint
    file holds it)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    unique = {}
    for name, tensor in state_dict.items():
        if aliases and name in aliases:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() == 0 or key not in seen:  # empty tensors share no data: keep them all
            seen.add(key)
            unique[name] = tensor.detach().cpu().contiguous()
    return unique


def export_weights(
    state_dict: dict[str, torch.Tensor], path: Path, aliases: dict[str, str] | None = None
) -> None:
    """Write weights as safetensors, atomically; tied weights are stored once, under their first name."""
    tensors = unique_tensors(state_dict, aliases)
    atomic_write(
        Path(path),
        lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
        "weights",
        tensor_bytes(tensors),
    )


def load_weights(model: nn.Module, path: Path | str) -> nn.Module:
    """Load a ``model.safetensors`` that leantrain wrote into ``model`` (of the same architecture).

    The file holds tied weights once; their other names are filled from it, so the load is
    strict: a name missing from the file or the model is an error, not a silent partial load.
    """
    from safetensors.torch import load_file

    return _load_tied(model, load_file(str(path)))


def _load_tied(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """``model.load_state_dict(weights)``, strict, with every name of a tied weight filled from
    the one that ``weights`` holds: its first name when it holds that. A checkpoint keeps each name of a
    tie; ``--weights ema`` replaces the first (the averaged parameter), and the other, loaded after it
    over the same tensor, must not put the trained value back."""
    aliases = tied_aliases(model)
    for alias, owner in aliases.items():  # a file that kept another name of the tie
        if owner not in weights and alias in weights:
            weights[owner] = weights[alias]
    for alias, owner in aliases.items():
        if owner in weights:
            weights[alias] = weights[owner]
    model.load_state_dict(weights)
    return model


# Other weights made from a checkpoint's model weights and its callbacks' states (the average).
WeightsOf = Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]


def _checkpoint_weights(
    checkpoint: Path | str, choose: WeightsOf | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model weights of a checkpoint (a sharded one's gathered here), or what ``choose`` makes
    of them and the callbacks' states; and the checkpoint's state (its tied aliases, its frozen base)."""
    state = load_checkpoint(checkpoint)
    model, callbacks = state["model"], state.get("callbacks", {})
    if state.get("sharded"):
        whole = _gathered_shards(Path(checkpoint), state["sharded"])
        model, callbacks = whole["model"], {**callbacks, **whole.get("callbacks", {})}
    if choose is not None:
        try:
            model = choose(model, callbacks)
        except CheckpointError as error:
            raise CheckpointError(f"checkpoint {checkpoint} {error}") from None
    return model, state


def export_checkpoint(checkpoint: Path | str, out: Path | str, choose: WeightsOf | None = None) -> Path:
    """``leantrain export``: the model weights of a checkpoint (or what ``choose`` makes of them)
    as a safetensors file."""
    out = Path(out)
    if out.is_dir():
        out = out / "model.safetensors"
    check_folder(out.parent, "out")
    weights, state = _checkpoint_weights(checkpoint, choose)
    export_weights(weights, out, state.get("tied"))
    return out


def export_pretrained(
    make_model: Callable[[], nn.Module],
    checkpoint: Path | str,
    out: Path | str,
    choose: WeightsOf | None = None,
    merge: bool = False,
) -> Path:
    """``leantrain export --format transformers``: the checkpoint's weights loaded into the task's
    model (``make_model``, called as the run called it: after seeding with the run's seed, so that
    a base drawn at random is the one an adapter trained on) and written by its own
    ``save_pretrained`` into the folder ``out``: for an adapter model, the adapter in PEFT's format,
    or with ``merge`` the merged model."""
    weights, state = _checkpoint_weights(checkpoint, choose)
    seed_everything(state["config"]["seed"])
    model = with_lora(make_model(), state["config"])  # a run's --lora-* adapters
    if not callable(getattr(model, "save_pretrained", None)):
        raise TaskError(
            f"--format transformers needs a transformers model (one with save_pretrained); "
            f"task.model() returned a {type(model).__name__}: use the default safetensors format"
        )
    _fill(model, weights, state, checkpoint)
    if merge:
        model = merged(model)
    out = Path(out)
    check_folder(out, "out")
    before = _file_times(out)
    with writing("transformers folder", out):
        model.save_pretrained(str(out))
        for written, mtime in _file_times(out).items():
            if before.get(written) != mtime:  # its weights: safetensors makes them the owner's only
                as_the_umask_says(written)
    return out


def _fill(
    model: nn.Module, weights: dict[str, torch.Tensor], state: dict[str, Any], checkpoint: Path | str
) -> None:
    """A checkpoint's weights into the task's fresh model: all of them, or an adapter's onto the
    same base."""
    frozen = FrozenBase.of(model)
    if frozen is not None:
        frozen.check(state.get("frozen"), checkpoint)
        load_adapter_weights(model, weights, frozen, f"checkpoint {checkpoint}")
        return
    check_not_adapter_checkpoint(state, checkpoint)
    try:
        _load_tied(model, weights)
    except RuntimeError as error:  # load_state_dict's list of missing, unexpected and mis-sized names
        raise CheckpointError(
            f"checkpoint {checkpoint}: its weights do not fit task.model(): {one_line(error)}"
        ) from None


def _file_times(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else {}


def check_shards(checkpoint: Path, folder: Path | str) -> None:
    """CheckpointError unless ``folder`` (a path, or a URL) holds the complete shards of ``checkpoint``,
    described by plain data.

    DCP writes its ``.metadata`` file last, after every process wrote its shards. DCP reads that file
    with an unrestricted ``pickle.load``: a crafted one would run code on the machine that resumes
    or exports the checkpoint, so its objects are checked first against the classes DCP writes."""
    if is_url(folder):
        remote = RemoteFolder(str(folder))
        complete = ".metadata" in remote.sizes()
        metadata = remote.read_bytes(".metadata", METADATA_LIMIT) if complete else b""
    else:
        path = Path(folder) / ".metadata"
        complete = path.is_file() and path.stat().st_size <= METADATA_LIMIT
        metadata = path.read_bytes() if complete else b""
    if not complete:
        raise CheckpointError(f"checkpoint {checkpoint}: its sharded state {folder} is missing or incomplete")
    try:
        _MetadataUnpickler(io.BytesIO(metadata)).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"checkpoint {checkpoint}: its shards' .metadata is refused: {error}") from None
    except Exception as error:  # truncated or random bytes reach the unpickler's internals
        raise CheckpointError(
            f"checkpoint {checkpoint}: its shards' .metadata is corrupt ({one_line(error)})"
        ) from None


METADATA_LIMIT = 1 << 30  # bytes: DCP's index of every shard; tens of MB for the largest models
# What DCP's .metadata holds (its dataclasses and enums, torch sizes, dtypes and layouts, paths): any
# other global is refused before DCP unpickles the file.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"it holds {module}.{name}, which is not DCP's plain metadata")
        return super().find_class(module, name)


def _gathered_shards(checkpoint: Path, shards: str) -> dict[str, Any]:
    """Everything a sharded checkpoint's shards hold (model, optimizer, callbacks' states split like
    the model), read whole in this one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = checkpoint.parent / shards
    check_shards(checkpoint, folder)
    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(folder), str(whole))
        return torch.load(whole, map_location="cpu", weights_only=True)
