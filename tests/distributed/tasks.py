"""Tasks for the multi-process tests, importable by worker processes as ``tests.distributed.tasks:NAME``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from leantrain.examples.charlm import CharLMTask
from tests.conftest import (
    DeepRegression,
    HeavyFromStep,
    PlantedSpikes,
    PoisonedSteps,
    RegressionTask,
    StreamedRegression,
)


def mean_task() -> RegressionTask:
    return RegressionTask(loss_kind="mean")


def mean_task_fp32() -> RegressionTask:
    return RegressionTask(loss_kind="mean", dtype=torch.float32)


def deep_task() -> DeepRegression:
    return DeepRegression(loss_kind="mean")


class DeepWithValidation(DeepRegression):
    """DeepRegression with 32 validation samples and a metric: validation runs through the stages."""

    def val_data(self):
        return torch.utils.data.TensorDataset(self.x[:32], self.y[:32], self.mask[:32])

    def metrics(self, model, batch):
        x, y, _ = batch
        return {"abs_error": (model(x) - y).abs().mean()}


def deep_sum_task() -> DeepRegression:
    return DeepRegression(loss_kind="sum")


def deep_task_fp32() -> DeepRegression:
    return DeepRegression(loss_kind="mean", dtype=torch.float32)


class TinyCharLM64(CharLMTask):
    """A float64 transformer with a custom forward and tied embedding/head weights (not a Sequential)."""

    def __init__(self) -> None:
        super().__init__(block=16, layers=4, heads=2, width=32, max_chars=20_000)

    def model(self) -> torch.nn.Module:
        return super().model().double()


def tiny_charlm() -> TinyCharLM64:
    return TinyCharLM64()


def sum_task() -> RegressionTask:
    """Per-sample element counts of 1..4: every rank's LossSum count differs."""
    return RegressionTask(loss_kind="sum")


class SlowItems(RegressionTask):
    """Each item takes 2 ms to load: slow enough to kill a process in the middle of a run."""

    seconds_per_item = 0.002

    def train_data(self):
        data = super().train_data()
        delay = self.seconds_per_item

        class Slow(type(data)):
            def __getitem__(self, index):
                time.sleep(delay)
                return super().__getitem__(index)

        return Slow(*data.tensors)


def slow_sum_task() -> SlowItems:
    return SlowItems(loss_kind="sum")


def slower_sum_task() -> SlowItems:
    """5 ms an item: a step of 16 samples over 2 processes takes at least 40 ms on any machine."""
    task = SlowItems(loss_kind="sum")
    task.seconds_per_item = 0.005
    return task


class RecordsRandomNumbers(RegressionTask):
    """Writes one torch.rand() draw per loss call to PROBE_DIR/rank<RANK>.txt: what dropout would see."""

    def loss(self, model, batch):
        with open(Path(os.environ["PROBE_DIR"]) / f"rank{os.environ.get('RANK', '0')}.txt", "a") as record:
            record.write(f"{torch.rand(()).item()!r}\n")
        return super().loss(model, batch)


def nan_on_rank1_at_step3() -> PoisonedSteps:
    """Rank 1's loss is NaN on step 3 (one micro-batch per step); rank 0's stays finite."""
    return PoisonedSteps({3} if os.environ.get("RANK") == "1" else set())


def nan_in_second_half_of_step3() -> PoisonedSteps:
    """One process, micro-batch = half the global batch: what rank 1 computes above is loss call 6."""
    return PoisonedSteps({6})


def unsized_stream_task() -> StreamedRegression:
    """RegressionTask's data as a stream without __len__, in index order."""
    return StreamedRegression(sized=False)


def heavy_on_rank1_later() -> HeavyFromStep:
    """After a few loss calls, rank 1's micro-batches need more memory; rank 0's never do."""
    return HeavyFromStep(heavy=False, rank=1, after_calls=6)


def heavy_on_rank1() -> HeavyFromStep:
    """Rank 1's micro-batches need more memory from the start; rank 0's never do."""
    return HeavyFromStep(heavy=True, rank=1)


class ReduceDtypeProbe(RegressionTask):
    """``mean_task_fp32`` whose optimizer, before its first step, writes how many of the gradient
    elements this rank holds are bf16 values, into ``$LEANTRAIN_PROBE/rank<R>.txt``. Gradients
    computed in bf16 and reduced in bf16 are all bf16 values; reduced in fp32, the average of
    two ranks' bf16 values mostly is not."""

    def __init__(self) -> None:
        super().__init__(loss_kind="mean", dtype=torch.float32)

    def optimizer(self, params):
        optimizer = super().optimizer(params)
        probe = Path(os.environ["LEANTRAIN_PROBE"]) / f"rank{os.environ.get('RANK', '0')}.txt"

        def record(optimizer, args, kwargs) -> None:
            if probe.exists():
                return
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]  # shards
            flat = torch.cat([g.flatten() for g in local])
            in_bf16 = int((flat.to(torch.bfloat16).float() == flat).sum())
            probe.write_text(f"{in_bf16} {flat.numel()}")

        optimizer.register_step_pre_hook(record)
        return optimizer


def tiny_gpt2():
    """transformers' GPT2LMHeadModel (tied embedding and head) on a datasets.Dataset (examples/hf_lm.py)."""
    from leantrain.examples.hf_lm import HFCausalLMTask

    return HFCausalLMTask("gpt2", block=16, layers=2, heads=2, width=32, max_chars=4000)


def stalled_validation():
    """TinyClassifier whose validation loss follows STALLS: best at the 2nd validation, then stalls."""
    from tests.extensions.test_early_stopping_and_best import STALLS, ScriptedValidation

    return ScriptedValidation(STALLS)


class SleepsOnRank1(RegressionTask):
    """Rank 1's loss never returns from step 3 on (the hang watchdog's test); rank 0 then waits
    for it in the gradients' all-reduce."""

    def __init__(self) -> None:
        super().__init__(loss_kind="mean")
        self.calls = 0

    def loss(self, model, batch):
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls > 4:  # micro-batches 1-4: steps 1 and 2
            time.sleep(3600)  # the line the watchdog must name
        return super().loss(model, batch)


class Residual(torch.nn.Module):
    """A repeated block of its own class (``--compile blocks`` and FSDP find it)."""

    def __init__(self, width: int, read_back: bool) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.read_back = read_back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + torch.tanh(self.linear(x))
        if self.read_back and y.abs().max().item() > 1e6:  # a host read: torch.compile breaks its graph here
            y = y / 2
        return y


class BlockRegression(RegressionTask):
    """RegressionTask's float64 data through three ``Residual`` blocks (small to compile)."""

    read_back = False

    def model(self) -> torch.nn.Module:
        blocks = [Residual(16, self.read_back) for _ in range(3)]
        return torch.nn.Sequential(torch.nn.Linear(6, 16), *blocks, torch.nn.Linear(16, 4)).to(self.dtype)


def block_regression() -> BlockRegression:
    return BlockRegression(loss_kind="sum")


def block_regression_reading_back() -> BlockRegression:
    task = BlockRegression(loss_kind="sum")
    task.read_back = True
    return task


class UnevenValidation(DeepRegression):
    """DeepRegression with 101 validation samples and a metric: on 2 processes, shares of 51 and 50
    samples (26 and 25 micro-batches of 2), and a last micro-batch of 1 sample on one process."""

    def val_data(self):
        return torch.utils.data.TensorDataset(self.x[:101], self.y[:101], self.mask[:101])

    def metrics(self, model, batch):
        x, y, _ = batch
        return {"abs_error": (model(x) - y).abs().mean()}


class TinyLlamaLoRA:
    """transformers' LlamaForCausalLM (2 layers, width 32, from a config) with peft LoRA adapters
    (r=8) on q_proj and v_proj, on the pydoc text's bytes; ``dtype`` for the model and its loss.
    ``base_seed``: the base's initial weights (another seed: another "pretrained" base)."""

    def __init__(self, dtype: torch.dtype = torch.float32, base_seed: int = 0, targets=("q_proj", "v_proj")):
        from leantrain.examples.hf_lm import HFCausalLMTask

        self.lm = HFCausalLMTask("llama", block=16, layers=2, heads=4, width=32, max_chars=4000)
        self.dtype, self.base_seed, self.targets = dtype, base_seed, list(targets)

    def base(self) -> torch.nn.Module:
        """The "pretrained" base: the same weights at every call."""
        with torch.random.fork_rng():
            torch.manual_seed(self.base_seed)
            return self.lm.model().to(self.dtype)

    def model(self) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model

        return get_peft_model(self.base(), LoraConfig(r=8, lora_alpha=16, target_modules=self.targets))

    def train_data(self):
        return self.lm.train_data()

    def val_data(self):
        return self.lm.val_data()

    def loss(self, model, batch):
        from leantrain.task import LossSum

        logits = model(input_ids=batch["input_ids"]).logits
        labels = batch["labels"]
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return LossSum(total, labels.numel())

    def optimizer(self, params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def tiny_llama_lora() -> TinyLlamaLoRA:
    return TinyLlamaLoRA()


def tiny_llama_lora_float64() -> TinyLlamaLoRA:
    return TinyLlamaLoRA(torch.float64)


def planted_spikes() -> PlantedSpikes:
    """Bad samples in the global batches of steps 27 and 44 (see tests/test_spikes.py)."""
    return PlantedSpikes.at_steps([27, 44])


class TinyLlama64:
    """transformers' LlamaForCausalLM (2 layers, width 32, 4 heads, 2 key/value heads) in float64,
    on the pydoc text's bytes: a model whose tensor-parallel plan is transformers' own."""

    def __init__(self) -> None:
        from leantrain.examples.hf_lm import HFCausalLMTask

        self.lm = HFCausalLMTask("llama", block=16, layers=2, heads=4, width=32, max_chars=4000)

    def model(self) -> torch.nn.Module:
        return self.lm.model().double()

    def train_data(self):
        return self.lm.train_data()

    def val_data(self):
        return self.lm.val_data()

    def loss(self, model, batch):
        return self.lm.loss(model, batch)

    def optimizer(self, params):
        return self.lm.optimizer(params)


def tiny_llama_float64() -> TinyLlama64:
    return TinyLlama64()


class HeadScale(torch.nn.Module):
    """One weight per position of a head, applied to every head of its input (a norm's weight over
    each head, as Qwen3's q_norm): under --tp, to each rank's own heads."""

    def __init__(self, head_width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, head_width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.unflatten(-1, (-1, self.weight.numel())) * self.weight).flatten(-2)


class HeadScaledRegression:
    """Linear(4 -> 16) split by output, a HeadScale over its 4 heads of 4, Linear(16 -> 4) split by
    input, in float64. ``summed``: the plan names the HeadScale replicated_with_grad_allreduce (else
    it leaves it whole, and each rank of a group holds a part of its gradient)."""

    def __init__(self, summed: bool) -> None:
        self.summed = summed

    def model(self) -> torch.nn.Module:
        layers = torch.nn.Linear(4, 16), HeadScale(4), torch.nn.Linear(16, 4)
        return torch.nn.Sequential(*layers).double()

    def train_data(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator, dtype=torch.float64)
        return torch.utils.data.TensorDataset(x, x.flip(1).tanh())

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)

    def tp_plan(self, model):
        plan = {"0": "colwise", "2": "rowwise"}
        return {**plan, "1": "replicated_with_grad_allreduce"} if self.summed else plan


def head_scaled_summed() -> HeadScaledRegression:
    return HeadScaledRegression(summed=True)


def head_scaled_whole() -> HeadScaledRegression:
    return HeadScaledRegression(summed=False)


class TinyLlamaGatherLoss(TinyLlama64):
    """TinyLlama64 with its cross-entropy written by hand (log_softmax, then gather): the same loss,
    but ``gather`` of split logits by whole labels is an op that split logits do not support."""

    def loss(self, model, batch):
        from leantrain.task import LossSum

        labels = batch["labels"]
        picked = model(input_ids=batch["input_ids"]).logits.log_softmax(-1).gather(-1, labels[..., None])
        return LossSum(-picked.sum(), labels.numel())


def tiny_llama_gather_loss() -> TinyLlamaGatherLoss:
    return TinyLlamaGatherLoss()
