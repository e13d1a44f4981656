"""An exponential moving average of the weights (``--ema-decay D``), ``ema.safetensors`` at the
end, and validation of the average instead of the trained weights (``--ema-validate``).

After every optimizer step that updated the weights, ``e = D * e + (1 - D) * w``, starting from
the initial weights (``e_0 = w_0``). A skipped step (an fp16 overflow, ``--on-nan skip``) changed
no weight and does not move the average either. The average follows what the optimizer updates:
the fp32 masters in the true 16-bit modes, each process's shards under fsdp, each stage's
parameters in a pipeline. It is held at least in fp32 (float64 stays float64), on the device.
Buffers (BatchNorm statistics) are not averaged: an export or a validation of the average uses
the model's current ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from leantrain.errors import CheckpointError
from leantrain.memory.accountant import averaged_dtype
from leantrain.step.local_values import local_values
from leantrain.step.precision import Precision


class WeightAverage:
    """A callback on every process (swapping the average in is local, exporting it collective).

    Its state is split like the model's (``saved_with_model``): in the checkpoint file for a
    whole model, in each process's shards for a sharded strategy.
    """

    state_key = "ema"
    saved_with_model = True

    def __init__(
        self,
        decay: float,
        names: Sequence[str],
        params: Sequence[torch.Tensor],
        precision: Precision,
        write_weights: Callable[[str], None],
        warn: Callable[[str], None],
        validate_average: bool = False,
    ) -> None:
        if len(names) != len(params):
            raise ValueError(f"{len(names)} parameter names for {len(params)} parameters")
        self.decay = decay
        self.weight = 1.0 - decay  # lerp's: e + (1 - D) * (w - e) is D * e + (1 - D) * w
        self.names = list(names)
        self.params = list(params)
        self.precision = precision
        self.write_weights = write_weights
        self.warn = warn
        self.validate_average = validate_average
        with torch.no_grad():
            self.average = [p.detach().to(averaged_dtype(p.dtype), copy=True) for p in self.params]
        # lerp takes one dtype: a parameter trained in 16 bits as it is (its average is fp32) goes apart
        apart = [p.dtype != a.dtype for p, a in zip(self.params, self.average, strict=True)]
        self._fused = [i for i, alone in enumerate(apart) if not alone]
        self._apart = [i for i, alone in enumerate(apart) if alone]

    def on_step(self, stats: Any) -> None:  # a run.hooks.StepStats (a layer above this one)
        if not stats.stepped:
            return
        averages, params = local_values(self.average), local_values(self.params)
        with torch.no_grad():
            if self._fused:  # one fused kernel over every parameter of its average's dtype
                fused = [averages[i] for i in self._fused], [params[i] for i in self._fused]
                torch._foreach_lerp_(*fused, self.weight)
            for i in self._apart:
                averages[i].lerp_(params[i].to(averages[i].dtype), self.weight)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model computes with the average inside the block, and exactly as before after it.

        Where the dtypes agree the two exchange contents, one tensor at a time (no second copy
        of the model); a 16-bit parameter trained directly is kept aside instead, as the
        exchange would round the average to 16 bits.
        """
        kept = self._swap_in()
        try:
            yield
        finally:
            self._swap_out(kept)

    def evaluated_weights(self) -> AbstractContextManager[Any]:
        """What a validation runs under: the average, with ``--ema-validate``."""
        return self.swapped_in() if self.validate_average else nullcontext()

    def _swap_in(self) -> list[torch.Tensor | None]:
        kept: list[torch.Tensor | None] = []
        with torch.no_grad():
            for param, average in zip(self.params, self.average, strict=True):
                held = param.detach().clone()
                param.copy_(average)
                if held.dtype == average.dtype:
                    average.copy_(held)  # exchanged: the average's tensor holds the weights meanwhile
                    kept.append(None)
                else:
                    kept.append(held)
        self.precision.refresh_model()
        return kept

    def _swap_out(self, kept: list[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for param, average, held in zip(self.params, self.average, kept, strict=True):
                if held is None:
                    held = param.detach().clone()
                    param.copy_(average)
                    average.copy_(held)
                else:
                    param.copy_(held)
        self.precision.refresh_model()

    def on_end(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:  # a finished run (an interrupted one resumes from its checkpoint)
            with self.swapped_in():
                self.write_weights("ema.safetensors")

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "weights": dict(zip(self.names, self.average, strict=True))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["weights"]
        if sorted(saved) != sorted(self.names):
            missing = sorted(set(self.names) - set(saved)) or sorted(set(saved) - set(self.names))
            raise ValueError(f"the saved average does not match the model's parameters (first: {missing[0]})")
        with torch.no_grad():
            for name, average in zip(self.names, self.average, strict=True):
                if saved[name] is not average:  # a sharded load fills the average in place
                    average.copy_(saved[name])
        if state["decay"] != self.decay:
            self.warn(
                f"the checkpoint's average was kept with ema_decay {state['decay']}; it goes on with "
                f"{self.decay} from here"
            )


def averaged_weights(model: dict[str, torch.Tensor], callbacks: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights with the average in place of each parameter (buffers as
    trained): what ``ema.safetensors`` would hold at that step (``leantrain export --weights ema``)."""
    saved = callbacks.get(WeightAverage.state_key)
    if saved is None:
        raise CheckpointError("holds no weight average: its run had no --ema-decay")
    return {**model, **saved["weights"]}
