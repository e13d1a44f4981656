from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

import leantrain as lt
from leantrain.checkpoint import unique_tensors
from leantrain.examples.charlm import CharLMTask
from leantrain.examples.digits import DigitsTask
from leantrain.step.accumulator import StepStatus, _underflow_share
from leantrain.step.loss_scaler import INITIAL_SCALE, DynamicLossScaler
from leantrain.step.precision import Autocast, Fp32, MasterWeights, make_precision
from tests.conftest import TiedEmbedding, TinyClassifier

CPU = torch.device("cpu")
MODES = ["32", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]


def test_make_precision_picks_the_mode():
    assert isinstance(make_precision("32", CPU), Fp32)
    assert isinstance(make_precision("bf16-mixed", CPU), Autocast)
    assert isinstance(make_precision("bf16-true", CPU), MasterWeights)
    for name in MODES[1:]:
        has_scaler = make_precision(name, CPU).loss_scale() is not None
        assert has_scaler == name.startswith("16-"), name


def test_autocast_runs_matmuls_in_16_bit():
    layer = nn.Linear(4, 4)
    with make_precision("bf16-mixed", CPU).autocast():
        assert layer(torch.ones(2, 4)).dtype == torch.bfloat16
    with make_precision("32", CPU).autocast():
        assert layer(torch.ones(2, 4)).dtype == torch.float32


@pytest.mark.parametrize(("name", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_16_bit_keeps_the_model_in_16_bit_and_the_optimizer_on_fp32_masters(name, dtype):
    model = nn.Linear(3, 2)
    initial = [p.detach().clone() for p in model.parameters()]
    precision = make_precision(name, CPU)
    masters = precision.prepare(model)
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(m, p) for m, p in zip(masters, initial, strict=True))  # exact initial values
    assert precision.input_dtype == dtype


@pytest.mark.parametrize(("name", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_master_weights_keep_updates_smaller_than_16_bit_resolution(name, dtype):
    """lr * grad = 1e-4 per step: below half the 16-bit spacing at 1.0, so a 16-bit weight never moves."""

    def train(model: nn.Module, optimizer_params, precision) -> None:
        optimizer = torch.optim.SGD(optimizer_params, lr=1e-4)
        for _ in range(20):
            precision.backward(model.weight.sum())  # gradient 1 for every weight
            precision.unscale_and_clip(list(model.parameters()), None)
            precision.step(optimizer)
            precision.zero_grad(optimizer)

    naive = nn.Linear(4, 1, bias=False).to(dtype)
    nn.init.ones_(naive.weight)
    train(naive, naive.parameters(), Fp32())
    assert torch.equal(naive.weight, torch.ones_like(naive.weight))  # every update rounded away

    model = nn.Linear(4, 1, bias=False)
    nn.init.ones_(model.weight)
    precision = make_precision(name, CPU)
    masters = precision.prepare(model)
    train(model, masters, precision)
    assert torch.allclose(masters[0], torch.full_like(masters[0], 1 - 20 * 1e-4), atol=1e-6, rtol=0)
    assert torch.equal(model.weight, masters[0].to(dtype))  # the model holds the rounded masters
    assert not torch.equal(model.weight, torch.ones_like(model.weight))


class Elementwise:
    """y = w * x + b: elementwise ops, which autocast leaves in fp32, so 16-mixed is exact."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(64, 6, generator=gen)
        self.y = 3 * self.x + 1

    def model(self) -> nn.Module:
        module = nn.Module()
        module.w = nn.Parameter(torch.zeros(6))
        module.b = nn.Parameter(torch.zeros(6))
        return module

    def train_data(self):
        return TensorDataset(self.x, self.y)

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model.w * x + model.b, y)

    def optimizer(self, params):
        return torch.optim.SGD(params, lr=0.1)


def test_clipping_with_accumulation_unscales_exactly_once_per_step(fit, monkeypatch):
    """The true gradient norm is ~10, the scaled one ~3e5: a max norm of 1000 clips only a wrong one."""
    calls = []
    unscale = DynamicLossScaler.unscale_
    monkeypatch.setattr(
        DynamicLossScaler, "unscale_", lambda self, grads: calls.append(1) or unscale(self, grads)
    )
    settings = dict(
        global_batch_size=32, micro_batch_size=8, max_steps=5, log_every_n_steps=1, max_grad_norm=1000.0
    )
    reference = fit(Elementwise(), **settings)
    scaled = fit(Elementwise(), precision="16-mixed", **settings)
    assert len(calls) == 5  # 4 micro-batches per step, 5 steps
    for name, value in reference.model.state_dict().items():
        assert torch.equal(scaled.model.state_dict()[name], value), name
    assert not torch.equal(reference.model.w.cpu(), torch.zeros(6))  # it trained


class Spikes(TinyClassifier):
    """The loss is multiplied by 1e4 on step 3: finite, but its scaled fp16 gradients overflow."""

    calls = 0

    def loss(self, model, batch):
        self.calls += 1
        loss = super().loss(model, batch)
        return loss * 1e4 if self.calls == 3 else loss


class Recorder:
    def __init__(self) -> None:
        self.statuses: list[StepStatus] = []
        self.logs: list[dict] = []

    def on_step(self, stats: lt.StepStats) -> None:
        self.statuses.append(stats.status)

    def on_log(self, step: int, metrics: dict) -> None:
        if "train_loss" in metrics:
            self.logs.append(metrics)


@pytest.mark.parametrize("name", ["16-mixed", "16-true"])
def test_an_overflow_is_skipped_the_scale_halves_and_training_recovers(fit, name):
    recorder = Recorder()
    result = fit(
        Spikes(),
        callbacks=[recorder],
        precision=name,
        global_batch_size=32,
        max_steps=24,
        log_every_n_steps=1,
    )
    assert recorder.statuses[2] is StepStatus.OVERFLOW
    assert recorder.statuses.count(StepStatus.OVERFLOW) == 1
    scales = [m["loss_scale"] for m in recorder.logs]
    assert scales[:4] == [INITIAL_SCALE, INITIAL_SCALE, INITIAL_SCALE / 2, INITIAL_SCALE / 2]
    assert [m["skipped_steps"] for m in recorder.logs][:4] == [0, 0, 1, 1]
    assert result.skipped_steps == 1 and result.nonfinite_steps == 0
    assert recorder.logs[-1]["train_loss"] < 0.8 * recorder.logs[0]["train_loss"]


def test_the_scale_grows_after_a_run_of_good_steps():
    scaler = DynamicLossScaler(CPU, initial_scale=8.0, growth_interval=3)
    for _ in range(3):
        scaler.update(overflowed=False)
    assert float(scaler.scale) == 16.0
    scaler.update(overflowed=True)
    assert float(scaler.scale) == 8.0


def test_the_default_scale_doubles_after_2000_good_steps_as_documented():
    """docs/precision.md: the fp16 scale starts at 2^15 and doubles after 2000 good steps in a row."""
    scaler = DynamicLossScaler(CPU)
    for _ in range(1999):
        scaler.update(overflowed=False)
    assert float(scaler.scale) == INITIAL_SCALE == 2.0**15
    scaler.update(overflowed=False)
    assert float(scaler.scale) == 2.0**16


def test_the_scaler_keeps_fp32_state_whatever_the_default_dtype():
    """torch's scale update kernel takes fp32 tensors only: a user's float64 default dtype (common
    in float64 research code) must not reach the scaler's state."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        scaler = DynamicLossScaler(CPU, initial_scale=8.0, growth_interval=1)
        grads = [torch.full((3,), 16.0, dtype=torch.float16)]
        assert float(scaler.unscale_(grads)) == 0.0 and grads[0].tolist() == [2.0, 2.0, 2.0]
        scaler.update(overflowed=False)
    finally:
        torch.set_default_dtype(previous)
    assert scaler.scale.dtype == scaler.found_inf.dtype == torch.float32
    assert float(scaler.scale) == 16.0


def test_a_nan_loss_does_not_lower_the_scale(fit):
    class NanOnce(TinyClassifier):
        calls = 0

        def loss(self, model, batch):
            self.calls += 1
            return super().loss(model, batch) * (float("nan") if self.calls == 2 else 1.0)

    recorder = Recorder()
    fit(
        NanOnce(),
        callbacks=[recorder],
        precision="16-mixed",
        on_nan="skip",
        global_batch_size=32,
        max_steps=3,
        log_every_n_steps=1,
    )
    assert recorder.statuses == [StepStatus.STEPPED, StepStatus.NONFINITE_LOSS, StepStatus.STEPPED]
    assert [m["loss_scale"] for m in recorder.logs] == [INITIAL_SCALE] * 3


@pytest.mark.parametrize("name", ["16-mixed", "16-true", "bf16-true"])
def test_precision_state_round_trips(name):
    source, target = make_precision(name, CPU), make_precision(name, CPU)
    model = nn.Linear(2, 2)
    source.prepare(model)
    target_model = copy.deepcopy(model)
    target.prepare(target_model)
    if source.loss_scale() is not None:
        source.skip_step(overflowed=True)
    if isinstance(source, MasterWeights):
        with torch.no_grad():
            source.masters[0].add_(1e-3)
    target.load_state_dict(source.state_dict())
    assert target.state_dict().keys() == source.state_dict().keys()
    if source.loss_scale() is not None:
        assert float(target.loss_scale()) == INITIAL_SCALE / 2
    if isinstance(source, MasterWeights):
        assert torch.equal(target.masters[0], source.masters[0])
        assert torch.equal(target_model.weight, source.masters[0].to(target_model.weight.dtype))


@pytest.mark.parametrize("name", ["16-true", "bf16-true"])
def test_true_16_bit_exports_the_fp32_masters_and_resumes_exactly(fit, tmp_path, name):
    settings = dict(precision=name, global_batch_size=32, max_steps=6, log_every_n_steps=3)
    whole = fit(TinyClassifier(), checkpoint_every=3, **settings)
    assert all(p.dtype != torch.float32 for p in whole.model.parameters())
    exported = load_file(whole.out_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in exported.values())
    for key, value in whole.model.state_dict().items():
        assert torch.equal(exported[key].to(value.dtype), value.cpu()), key
    resumed = fit(
        TinyClassifier(), resume=str(whole.out_dir / "checkpoints" / "step-00000003.pt"), **settings
    )
    again = load_file(resumed.out_dir / "model.safetensors")
    assert all(torch.equal(again[key], value) for key, value in exported.items())


class ReductionFlags:
    def __init__(self) -> None:
        self.seen: set[tuple[bool, bool]] = set()

    def on_step(self, stats: lt.StepStats) -> None:
        matmul = torch.backends.cuda.matmul
        self.seen.add(
            (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
        )


@pytest.mark.parametrize("allowed", [False, True])
def test_reduced_precision_reduction_is_off_during_fit_unless_asked(fit, allowed):
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    flags = ReductionFlags()
    fit(
        TinyClassifier(),
        callbacks=[flags],
        global_batch_size=32,
        max_steps=2,
        reduced_precision_reduction=allowed,
    )
    assert flags.seen == {(allowed, allowed)}
    assert (
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
    ) == before


EXAMPLES = {
    "digits": (DigitsTask, dict(global_batch_size=32, max_steps=20)),
    "charlm": (
        # Small: CPUs without fp16 matrix instructions emulate 16-bit products (~20x slower than 32).
        lambda: CharLMTask(block=16, layers=2, width=32, heads=2, max_chars=60_000),
        dict(global_batch_size=16, max_steps=20),
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_every_mode_trains_the_examples(fit, example, mode):
    make, settings = EXAMPLES[example]
    recorder = Recorder()
    result = fit(make(), callbacks=[recorder], precision=mode, log_every_n_steps=4, **settings)
    losses = [m["train_loss"] for m in recorder.logs]
    assert losses[-1] < 0.85 * losses[0], losses
    assert result.precision == mode and result.nonfinite_steps == 0


class ScaledLoss(TinyClassifier):
    """The loss times ``factor`` from loss call ``first_call`` on."""

    def __init__(self, factor: float, first_call: int = 1) -> None:
        super().__init__()
        self.factor = factor
        self.first_call = first_call
        self.calls = 0

    def loss(self, model, batch):
        self.calls += 1
        return super().loss(model, batch) * (self.factor if self.calls >= self.first_call else 1.0)


def test_a_collapsing_scale_and_many_skipped_steps_are_warned_about_once(fit):
    """From step 3 on, gradients of 1e30 overflow fp16 at any scale: every step is skipped."""
    task = ScaledLoss(1e30, first_call=3)
    with pytest.warns(lt.LeantrainWarning) as caught:
        result = fit(task, precision="16-mixed", global_batch_size=32, max_steps=22, log_every_n_steps=5)
    texts = [str(w.message) for w in caught]
    assert result.skipped_steps == 20
    assert sum("3 of the last 5 steps were skipped" in t for t in texts) == 1
    assert sum("loss scale collapsed" in t for t in texts) == 1


def test_underflowing_fp16_gradients_are_warned_about(fit):
    """Gradients of 1e-30 are 0 in fp16 even scaled by 2^15."""
    recorder = Recorder()
    with pytest.warns(lt.LeantrainWarning, match="non-zero fp16 gradient values are below"):
        fit(
            ScaledLoss(1e-30),
            callbacks=[recorder],
            precision="16-mixed",
            global_batch_size=32,
            max_steps=4,
            log_every_n_steps=2,
        )
    assert [m["grad_underflow_share"] for m in recorder.logs] == [1.0, 1.0]


def test_a_healthy_fp16_run_warns_nothing(fit, recwarn, native_16_bit_cpu):
    fit(TinyClassifier(), precision="16-mixed", global_batch_size=32, max_steps=8, log_every_n_steps=2)
    assert not [w for w in recwarn if issubclass(w.category, lt.LeantrainWarning)]


def test_the_scale_settling_at_the_start_is_counted_but_not_warned_about(fit, recwarn, native_16_bit_cpu):
    """A token-level LossSum backpropagates a sum over many tokens: the first steps overflow."""
    task = CharLMTask(block=32, layers=2, width=64, heads=4, max_chars=60_000)
    result = fit(task, precision="16-mixed", global_batch_size=16, max_steps=12, log_every_n_steps=4)
    assert result.skipped_steps >= 4
    assert not [w for w in recwarn if issubclass(w.category, lt.LeantrainWarning)]


@pytest.mark.parametrize("name", MODES)
def test_every_mode_clips_by_the_norm_the_strategy_measures(name):
    """Each of the 4 weights gets the gradient 8 x 1/64 = 0.125 (norm 0.25; small enough for fp16
    at the initial loss scale). A pipeline stage holds only its own parameters, so the strategy's
    norm covers all stages: here twice this stage's, and that is the norm clipping must use."""
    model = nn.Linear(4, 1, bias=False)
    precision = make_precision(name, CPU)
    params = precision.prepare(model)
    with precision.autocast():
        loss = model(torch.full((8, 4), 1 / 64, dtype=precision.input_dtype or torch.float32)).sum()
    precision.backward(loss)
    stage_norms = []

    def all_stages_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        stage_norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
        return torch.tensor(2 * stage_norms[-1])

    report = precision.unscale_and_clip(params, 0.1, all_stages_norm)
    assert stage_norms == [pytest.approx(0.25, rel=1e-3)]  # unscaled, measured once
    assert float(report.norm) == pytest.approx(0.5, rel=1e-3)  # the norm before clipping is reported
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert float(clipped) == pytest.approx(0.1 * 0.25 / 0.5, rel=1e-3)  # scaled by max_norm / global norm
    if report.overflow is not None:
        assert float(report.overflow) == 0.0


class PartlyFrozen(TinyClassifier):
    """The first layer frozen, and an optimizer over the trainable parameters only (the usual recipe)."""

    def model(self) -> nn.Module:
        model = super().model()
        model[0].requires_grad_(False)
        return model

    def optimizer(self, params):
        self.trainable_given = [p for p in params if p.requires_grad]
        return torch.optim.Adam(self.trainable_given, lr=1e-2)


@pytest.mark.parametrize("name", ["bf16-true", "16-true"])
def test_a_partly_frozen_model_trains_in_true_16_bit(fit, recwarn, name, native_16_bit_cpu):
    task = PartlyFrozen()
    torch.manual_seed(0)
    initial = task.model().state_dict()
    result = fit(task, precision=name, global_batch_size=32, max_steps=3, seed=0, max_grad_norm=1.0)
    exported = load_file(result.out_dir / "model.safetensors")
    for key in ("0.weight", "0.bias"):  # frozen: exactly the initial values, and no master asks for a grad
        assert torch.equal(exported[key], initial[key]), key
    assert not torch.equal(exported["2.weight"], initial["2.weight"])  # the rest trained
    # The fp32 masters the optimizer receives keep the model's requires_grad (what users filter on).
    assert [p.shape for p in task.trainable_given] == [(2, 16), (2,)]
    assert not [w for w in recwarn if issubclass(w.category, lt.LeantrainWarning)]


@pytest.mark.parametrize("name", ["bf16-true", "16-true"])
def test_true_16_bit_exports_tied_weights_as_their_one_master(name):
    model = TiedEmbedding()
    precision = make_precision(name, CPU)
    [master] = precision.prepare(model)
    with torch.no_grad():
        master.add_(1e-4)  # an update below 16-bit resolution: only the master holds it
    state = precision.trained_state_dict(model)
    assert list(unique_tensors(state)) == ["embed.weight"]  # one storage: exported once
    assert torch.equal(state["head.weight"], master)


def test_true_16_bit_names_itself_and_refuses_masters_of_another_model():
    precision = make_precision("bf16-true", CPU)
    assert precision.name == "bf16-true"
    precision.prepare(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"^1 master weights saved, the model has 2$"):
        precision.load_state_dict({"masters": [torch.zeros(2, 2)]})


SMALLEST_NORMAL = torch.finfo(torch.float16).tiny  # 2**-14: below it fp16 loses precision


@pytest.mark.parametrize(
    ("values", "share"),
    [
        # Exact zeros are left out; the smallest normal itself is not below it: 1 of 4.
        ([0.0, 0.0, 1e-6, 1.0, SMALLEST_NORMAL, 2.0], 0.25),
        ([0.0, 1.0], 0.0),  # one non-zero value, not tiny
        ([0.0, 1e-6], 1.0),  # one non-zero value, tiny
        ([0.0, 0.0], 1.0),  # zero everywhere: fully underflowed
    ],
)
def test_the_underflow_share_counts_non_zero_values_below_fp16s_smallest_normal(values, share):
    param = nn.Parameter(torch.zeros(len(values)))
    param.grad = torch.tensor(values)
    assert float(_underflow_share([param, nn.Parameter(torch.zeros(1))])) == share  # no grad: skipped
    assert _underflow_share([nn.Parameter(torch.zeros(1))]) is None
