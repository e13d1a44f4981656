"""Adapters (PEFT, e.g. LoRA): a frozen base model with a small trained adapter.

A task whose ``model()`` returns a ``peft.PeftModel`` (or a run with ``--lora-rank``) is an
adapter run. Only the adapter trains, so only the adapter is kept: the optimizer gets the
adapter's parameters alone (no state, no fp32 masters for the base), checkpoints and weight
files hold the adapter's tensors (megabytes, under the names the model gives them), and the
base comes from ``task.model()`` again on resume and export.

That makes the base part of what a checkpoint depends on, so a checkpoint records a
fingerprint of it (``FrozenBase``): a resume or an export onto another base (a changed
``task.model()``, another pretrained file) is refused in one line instead of pairing the
adapter with weights it was not trained on.

peft is imported only when a model is one of its own (it is in ``leantrain[hf]``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from leantrain.errors import CheckpointError, ConfigError, TaskError, one_line
from leantrain.files import as_the_umask_says, writing

FINGERPRINT_SAMPLES = 1024  # elements read per frozen tensor: cheap even for a 70B base
ADAPTER_FOLDER = "adapter"  # in the run folder: the adapter in PEFT's own format


def is_adapter_model(model: nn.Module) -> bool:
    """A ``peft.PeftModel`` (also once a strategy wrapped or sharded it in place)."""
    peft = sys.modules.get("peft")  # a model of peft's was made by an imported peft
    return peft is not None and isinstance(model, peft.PeftModel)


def trained_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer updates: every parameter, or an adapter model's trainable ones only.

    Any other model keeps its frozen parameters in the optimizer: a callback may unfreeze them
    during the run (gradual unfreezing), and the optimizer skips them until they have gradients.
    """
    params = list(model.parameters())
    return [p for p in params if p.requires_grad] if is_adapter_model(model) else params


def _fingerprint(tensor: torch.Tensor) -> float:
    """A number that changes when the tensor's values do: an evenly spaced sample of at most
    ``FINGERPRINT_SAMPLES`` elements, weighted by position (a permutation changes it too)."""
    flat = tensor.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)].double()
    weights = torch.linspace(1.0, 2.0, sample.numel(), dtype=torch.float64, device=sample.device)
    return float(torch.dot(sample, weights)) if sample.numel() else 0.0


@dataclass(frozen=True)
class FrozenBase:
    """The frozen parameters of an adapter model as ``task.model()`` made them: left out of its
    checkpoints, and fingerprinted so that a resume can tell the same base from another."""

    names: frozenset[str]
    fingerprint: dict[str, float]

    @classmethod
    def of(cls, model: nn.Module) -> FrozenBase | None:
        """None for a model that is not an adapter model (its checkpoints hold every weight)."""
        if not is_adapter_model(model):
            return None
        frozen = {  # every name of a tied weight: the state dict holds each
            name: p for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
        }
        return cls(frozenset(frozen), {name: _fingerprint(p) for name, p in frozen.items()})

    def without_frozen(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a state dict keyed by parameter name) without the frozen base."""
        return {name: value for name, value in state.items() if name not in self.names}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"names": sorted(self.names), "fingerprint": self.fingerprint}

    def check(self, saved: dict[str, Any] | None, path: Path | str) -> None:
        """CheckpointError unless the checkpoint's adapter was trained on this same base."""
        if saved is None:
            raise CheckpointError(
                f"checkpoint {path} holds a whole model, not an adapter: resume it with the task "
                "whose model it trained (task.model() now returns an adapter model)"
            )
        differ = [
            name
            for name, value in saved["fingerprint"].items()
            if name not in self.fingerprint or not _close(self.fingerprint[name], value)
        ]
        if differ:
            raise CheckpointError(
                f"checkpoint {path}: its adapter was trained on another base model: {len(differ)} of "
                f"{len(saved['fingerprint'])} frozen tensors differ from task.model()'s "
                f"(first: {differ[0]}); load the same base weights in task.model()"
            )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def check_not_adapter_checkpoint(state: dict[str, Any], path: Path | str) -> None:
    """CheckpointError for an adapter checkpoint resumed into a model that is not an adapter model."""
    if state.get("frozen") is not None:
        raise CheckpointError(
            f"checkpoint {path} holds an adapter only, and task.model() returns a model without one: "
            "resume it with the task (and --lora-* flags) that trained it"
        )


def load_adapter_weights(
    model: nn.Module, weights: dict[str, torch.Tensor], frozen: FrozenBase, source: str
) -> None:
    """The adapter's tensors (from ``source``, for the error) into ``model``; every name but the
    frozen base's must be among them."""
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # a tensor of another shape: torch's message spans lines
        raise CheckpointError(
            f"{source}: the adapter's weights do not fit task.model(): {one_line(error)}"
        ) from None
    missing = [name for name in missing if name not in frozen.names]
    if missing or unexpected:
        first = (missing or unexpected)[0]
        raise CheckpointError(
            f"{source}: the adapter's weights do not fit task.model(): {len(missing)} missing, "
            f"{len(unexpected)} unexpected (first: {first})"
        )


def write_peft_folder(model: nn.Module, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """The adapter in PEFT's own format (``adapter_model.safetensors`` and ``adapter_config.json``,
    one subfolder per further adapter, as ``PeftModel.save_pretrained`` lays them out), so that
    ``PeftModel.from_pretrained(base, folder)`` reads it. ``weights``: the adapter's tensors under
    the model's names (gathered: they may come from a sharded model)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    with writing("adapter folder", folder):
        for name, config in model.peft_config.items():
            where = folder if name == "default" else folder / name
            where.mkdir(parents=True, exist_ok=True)
            tensors = get_peft_model_state_dict(model, state_dict=weights, adapter_name=name)
            tensors = {key: value.detach().cpu().contiguous() for key, value in tensors.items()}
            save_file(tensors, str(where / "adapter_model.safetensors"), {"format": "pt"})
            as_the_umask_says(where / "adapter_model.safetensors")
            config.save_pretrained(str(where))
    return folder


def merged(model: nn.Module) -> nn.Module:
    """The base with the adapter folded into its weights (``export --merge``): a model without peft."""
    if not is_adapter_model(model):
        raise TaskError(
            f"--merge folds an adapter into its base; task.model() returned a {type(model).__name__} "
            "without one: leave --merge out"
        )
    return model.merge_and_unload()


def with_lora(model: nn.Module, settings: dict[str, Any]) -> nn.Module:
    """``model`` with the adapters that ``settings`` (a run's config, as a dict) ask for with
    ``lora_rank``; the model itself without it."""
    rank = settings.get("lora_rank")
    if rank is None:
        return model
    if is_adapter_model(model):
        raise ConfigError("lora_rank", rank, "task.model() already returns an adapter (peft) model")
    targets = (settings.get("lora_targets") or "all-linear").split(",")
    return lora_model(model, rank, settings.get("lora_alpha"), settings.get("lora_dropout", 0.0), targets)


def lora_model(
    model: nn.Module, rank: int, alpha: float | None, dropout: float, targets: Iterable[str]
) -> Any:
    """``model`` with LoRA adapters of ``rank`` on the modules named by ``targets`` (``--lora-*``)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise TaskError("--lora-rank needs peft: pip install 'leantrain[hf]'") from None
    names = list(targets)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        lora_dropout=dropout,
        target_modules=names[0] if names == ["all-linear"] else names,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # peft's message names the targets it could not find
        raise TaskError(f"--lora-targets {','.join(names)}: {one_line(error)}") from None


def adapter_summary(model: nn.Module) -> str:
    """One line for the run log: the adapter's size against the model's."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    kinds = sorted({type(config).__name__.removesuffix("Config") for config in model.peft_config.values()})
    return (
        f"adapter {', '.join(kinds)}: {trained:,} of {total:,} parameters train "
        f"({100 * trained / max(1, total):.2f} %); the base is frozen and left out of checkpoints"
    )
