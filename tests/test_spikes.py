"""Loss spikes (``--on-spike``): judged on each step's loss, warned about, or rolled back past with the
bad batches skipped; exact across reruns and kills; a run that keeps spiking stops with one line."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.run.snapshot import HostSnapshot, TrainingState, copy_into
from leantrain.run.spikes import MIN_HISTORY, Spike, SpikeDetector
from leantrain.step.precision import make_precision
from tests.conftest import PlantedSpikes, PoisonedSteps, quiet_config
from tests.test_resume import StopAt

# Spikes at steps 27 and 44 (judged at the log points 30 and 45; snapshots every 10 steps).
ROLLBACK = dict(
    global_batch_size=16, max_steps=60, log_every_n_steps=5, on_spike="rollback", snapshot_every=10,
    checkpoint_every=4, val_every_n_steps=60,
)  # fmt: skip
SPIKE_STEPS = (27, 44)


def train(out, task, callbacks=(), **changes) -> lt.FitResult:
    return lt.Trainer(quiet_config(out, **{**ROLLBACK, **changes}), callbacks=list(callbacks)).fit(task)


# -- the rule ------------------------------------------------------------------------------


def falling(steps: int) -> list[tuple[int, float]]:
    """A loss that falls with a 20 % batch-to-batch wobble: what training looks like."""
    gen = torch.Generator().manual_seed(0)
    wobble = 1 + 0.2 * torch.randn(steps, generator=gen, dtype=torch.float64)
    return [(i, float(2.0 * 0.999**i * wobble[i].abs())) for i in range(steps)]


def judged(losses: list[tuple[int, float]], every: int = 10, window: int = 100) -> Spike | None:
    """The first spike a run logging every ``every`` steps finds in ``losses`` (one call per log point)."""
    detector = SpikeDetector(6.0, window)
    for first in range(0, len(losses), every):
        if (spike := detector.first_spike(losses[first : first + every], accept=True)) is not None:
            return spike
    return None


def test_the_rule_finds_the_first_spike_and_nothing_in_ordinary_training():
    assert judged(falling(300)) is None
    losses = falling(300)
    losses[155] = (155, losses[155][1] * 4)  # four times its neighbours (the wobble: 20 %)
    losses[200] = (200, losses[200][1] * 50)
    spike = judged(losses)
    assert (spike.step, spike.loss) == (156, losses[155][1])
    assert losses[155][1] > spike.threshold > max(loss for _, loss in losses[150:155])


def test_each_log_window_is_judged_against_the_steps_before_it():
    """One threshold per log point: a window's own losses do not move it (a rise inside one window is
    judged against the window before)."""
    base = [(i, 1.0 + 0.002 * i) for i in range(40)]  # 1.0 .. 1.078
    rising = [(40 + i, 1.0 + 0.05 * i) for i in range(10)]  # 1.0 .. 1.45 within one window
    detector = SpikeDetector(6.0, 100)
    detector.first_spike(base, accept=True)
    before = detector.limit()
    found = detector.first_spike(rising, accept=True)
    first_above = next(step for step, loss in rising if loss > before)
    assert (found.step, found.threshold) == (first_above + 1, before)


def test_no_step_is_judged_before_the_history_is_long_enough():
    detector = SpikeDetector(6.0, 100)
    assert detector.first_spike([(i, 1.0) for i in range(MIN_HISTORY - 1)], accept=True) is None
    assert detector.first_spike([(MIN_HISTORY - 1, 1e6)], accept=True) is None  # 19 known: not judged
    assert detector.first_spike([(MIN_HISTORY, 1e6)], accept=True).step == MIN_HISTORY + 1


def after(history: list[tuple[int, float]], candidate: float) -> Spike | None:
    detector = SpikeDetector(6.0, 100)
    detector.first_spike(history, accept=True)
    return detector.first_spike([(len(history), candidate)], accept=True)


def test_a_flat_loss_keeps_a_one_percent_floor_and_negative_losses_are_judged_as_they_are():
    flat = [(i, 2.0) for i in range(MIN_HISTORY)]
    assert after(flat, 2.0 * 1.05) is None
    assert after(flat, 2.0 * 1.07).step == 21
    negative = [(i, -1.0 + 0.01 * (i % 3)) for i in range(MIN_HISTORY)]
    assert after(negative, -0.5).step == 21
    assert after(negative, -0.95) is None


def test_a_non_finite_loss_is_a_spike_and_what_follows_a_spike_joins_only_when_accepted():
    history = falling(30)
    detector = SpikeDetector(6.0, 100)
    spike = detector.first_spike([*history, (30, math.nan), (31, 1.0)], accept=False)
    assert spike.step == 31 and math.isnan(spike.threshold)
    assert list(detector.history) == [loss for _, loss in history]  # nothing after the spike
    accepting = SpikeDetector(6.0, 100)
    accepting.first_spike([*history, (30, math.nan), (31, 1.0)], accept=True)
    assert list(accepting.history) == [loss for _, loss in history] + [1.0]  # the NaN never
    restored = SpikeDetector(6.0, 100)
    restored.load_state_dict(accepting.state_dict())
    assert list(restored.history) == list(accepting.history)


def test_a_noisy_loss_is_judged_on_its_logarithm():
    """Batch losses spread as a log-normal (late in training, small batches): one 4.5 times the median
    is 3 spreads of the logarithms, an ordinary batch; on the losses themselves it would be 7."""
    gen = torch.Generator().manual_seed(0)
    noisy = torch.exp(0.5 * torch.randn(200, generator=gen, dtype=torch.float64))
    history = [(i, float(v)) for i, v in enumerate(noisy)]
    median = float(noisy.median())
    assert after(history[-100:], 4.5 * median) is None
    assert after(history[-100:], 40 * median).step == 101


def test_the_history_is_the_last_window_steps():
    detector = SpikeDetector(6.0, window=25)
    detector.first_spike(falling(60), accept=True)
    assert list(detector.history) == [loss for _, loss in falling(60)[-25:]]


# -- the snapshot --------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32", "bf16-true"])
def test_a_snapshot_puts_back_weights_optimizer_scheduler_and_generators(precision):
    """Restored in place: the state after more steps is the snapshot's again, bit for bit (the Adam
    state made after it is dropped), and the fp32 masters of a -true model with it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    mode = make_precision(precision, torch.device("cpu"))
    params = mode.prepare(model)
    optimizer = torch.optim.Adam(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = TrainingState(model, optimizer, params, frozen=frozenset(),
                          stateful={"precision": mode, "scheduler": scheduler})  # fmt: skip

    def steps(count: int) -> None:
        for _ in range(count):
            loss = model(torch.randn(8, 4).to(next(model.parameters()).dtype)).square().mean()
            mode.backward(loss)
            mode.unscale_and_clip(params, None)
            mode.step(optimizer)
            mode.zero_grad(optimizer)
            scheduler.step()

    def taken() -> tuple:
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        masters = [p.detach().clone() for p in params]
        lr = optimizer.param_groups[0]["lr"]
        return weights, masters, json.dumps(scheduler.state_dict()), torch.get_rng_state(), lr

    for before in (0, 2):  # before the optimizer has state, and after
        steps(before)
        snapshot, expected = HostSnapshot.capture(before, state), taken()
        expected_adam = {
            i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()
        }
        steps(3)
        snapshot.restore(state)
        weights, masters, schedule, rng, lr = taken()
        assert all(torch.equal(weights[k], v) for k, v in expected[0].items())
        assert all(torch.equal(a, b) for a, b in zip(masters, expected[1], strict=True))
        assert (schedule, lr) == (expected[2], expected[4]) and torch.equal(rng, expected[3])
        adam = optimizer.state_dict()["state"]
        assert adam.keys() == expected_adam.keys()
        assert all(torch.equal(adam[i][k], v) for i, s in expected_adam.items() for k, v in s.items())
        if precision == "bf16-true":  # the model computes with the restored masters
            assert all(
                torch.equal(p.float(), m.to(torch.bfloat16).float())
                for p, m in zip(model.parameters(), masters, strict=True)
            )


def test_a_saved_value_the_live_state_lacks_is_added_beside_the_tensors_there_as_a_copy():
    """An optimizer state entry made after the live state's last change (a momentum buffer): it joins the
    device of the tensors beside it (seen with `meta`, which keeps shapes and drops data), and it is a
    copy, so the snapshot stays intact for the next rollback."""
    meta = torch.device("meta")
    saved = {"step": torch.tensor(3.0), "momentum_buffer": torch.ones(2), "betas": (0.9, 0.99)}
    restored = copy_into({"step": torch.zeros((), device=meta)}, saved)
    assert restored["momentum_buffer"].is_meta and restored["betas"] == (0.9, 0.99)
    beside_nothing = copy_into({"lr": 0.1}, saved)  # no tensor there: kept on the host
    assert torch.equal(beside_nothing["momentum_buffer"], saved["momentum_buffer"])
    beside_nothing["momentum_buffer"].add_(1)
    assert torch.equal(saved["momentum_buffer"], torch.ones(2))


# -- runs ------------------------------------------------------------------------------------


def test_rollback_heals_a_run_that_planted_samples_ruin(tmp_path):
    """Without rollback the run does not recover; with it, the run ends near a run whose data never had
    those samples, the rollbacks name the spikes and the skipped samples hold the planted ones."""
    bad = PlantedSpikes.at_steps(SPIKE_STEPS).bad
    ruined = train(tmp_path / "ruined", PlantedSpikes(bad), on_spike="warn", snapshot_every=None)
    healed = train(tmp_path / "healed", PlantedSpikes(bad))
    clean = train(tmp_path / "clean", PlantedSpikes(bad, drop_bad=True))
    assert ruined.val_metrics["val_loss"] > 100 * clean.val_metrics["val_loss"]
    assert ruined.loss_spikes >= 1 and ruined.rollbacks == []
    # 15 of 60 steps skipped: fewer updates than the clean run (over 200 steps the two end within 6 %)
    assert healed.val_metrics["val_loss"] < 2 * clean.val_metrics["val_loss"]
    assert [(r["step"], r["restored_step"], r["skipped_steps"]) for r in healed.rollbacks] == [
        (27, 20, [21, 30]), (44, 40, [41, 45])
    ]  # fmt: skip
    for rollback, sample in zip(healed.rollbacks, bad, strict=True):
        assert sample in rollback["skipped_samples"] and len(rollback["skipped_samples"]) == 16 * (
            rollback["skipped_steps"][1] - rollback["restored_step"]
        )
    summary = json.loads((tmp_path / "healed" / "summary.json").read_text())
    assert summary["rollbacks"] == healed.rollbacks and summary["loss_spikes"] == 2
    events = [
        row
        for row in (tmp_path / "healed" / "metrics.csv").read_text().splitlines()
        if ",20.0," in row or ",40.0," in row
    ]
    assert len(events) == 2  # one row per rollback: the step restored, the spike's loss


def test_a_healed_run_is_bit_identical_across_reruns_and_kills_during_and_after_recovery(tmp_path):
    bad = PlantedSpikes.at_steps(SPIKE_STEPS).bad
    whole = train(tmp_path / "whole", PlantedSpikes(bad))
    again = train(tmp_path / "again", PlantedSpikes(bad))
    # Killed after step 29: the newest checkpoint (step 28) holds the spiked state, and the snapshot
    # of step 20 to go back to; after step 33: the checkpoint of step 32, after the first rollback.
    for stop in (29, 33):
        out = tmp_path / f"killed{stop}"
        with pytest.raises(KeyboardInterrupt):
            train(out, PlantedSpikes(bad), [StopAt(stop)])
        resumed = train(out, PlantedSpikes(bad), resume="auto")
        assert resumed.rollbacks == whole.rollbacks, stop
        for name, value in whole.model.state_dict().items():
            assert torch.equal(resumed.model.state_dict()[name], value), (stop, name)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value), name
    assert again.rollbacks == whole.rollbacks


def test_rollback_turned_on_at_a_resume_starts_from_the_resumed_state(tmp_path):
    """A checkpoint of a run without rollback holds no snapshot: the first is the resumed step's."""
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(out, PlantedSpikes.at_steps([27]), [StopAt(7)], on_spike="warn", snapshot_every=None)
    resumed = train(out, PlantedSpikes.at_steps([27]), resume="auto", max_steps=30)
    assert [(r["restored_step"], r["skipped_steps"]) for r in resumed.rollbacks] == [(20, [21, 30])]
    # Before the first snapshot step: back to the resumed step (a NaN at step 9, the 5th after it).
    early = tmp_path / "early"
    with pytest.raises(KeyboardInterrupt):
        train(early, PoisonedSteps(set()), [StopAt(7)], on_spike="warn", snapshot_every=None, max_steps=30)
    resumed = train(early, PoisonedSteps({5}), resume="auto", max_steps=30, val_every_n_steps=None)
    assert [(r["restored_step"], r["skipped_steps"]) for r in resumed.rollbacks] == [(4, [5, 9])]


def test_a_non_finite_step_is_rolled_back_too(tmp_path):
    """A NaN at step 23 (on_nan stop would end the run there) goes back to the snapshot of step 20."""
    task = PoisonedSteps({23}, samples=400)
    result = train(tmp_path / "run", task, val_every_n_steps=None, max_steps=25)
    assert result.steps == 25
    [rollback] = result.rollbacks
    assert (rollback["step"], rollback["restored_step"], rollback["skipped_steps"]) == (23, 20, [21, 23])
    assert math.isnan(rollback["loss"])


def test_a_run_that_keeps_spiking_stops_with_one_line_naming_the_spikes(tmp_path):
    with pytest.raises(lt.SpikeError) as error:
        train(tmp_path / "run", PlantedSpikes.at_steps(SPIKE_STEPS), max_rollbacks=1)
    message = str(error.value)
    assert "\n" not in message
    assert re.fullmatch(
        r"the training loss spiked 2 times, more than max_rollbacks=1: step 27 \(loss [^)]+\), step 44 "
        r"\(loss [^)]+\); skipped steps 21-30, 41-45 \(summary.json and the checkpoint list their samples\); "
        r"the data or the learning rate needs a look \(raise --max-rollbacks to go on\)",
        message,
    ), message
    assert [r["step"] for r in error.value.rollbacks] == [27, 44]


def test_warn_is_the_default_and_off_judges_nothing(tmp_path):
    task = PlantedSpikes.at_steps([27])
    with pytest.warns(
        lt.LeantrainWarning, match=r"^loss spike at step 27: .* above the threshold .*--on-spike rollback"
    ):
        warned = lt.Trainer(
            quiet_config(tmp_path / "warn", global_batch_size=16, max_steps=30, log_every_n_steps=5)
        ).fit(task)
    assert warned.loss_spikes == 1 and warned.rollbacks == []
    off = train(tmp_path / "off", task, on_spike="off", snapshot_every=None, max_steps=30)
    assert off.loss_spikes == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(snapshot_every=10), r"^invalid snapshot_every=10: needs on_spike rollback$"),
        (
            dict(on_spike="rollback", snapshot_every=7),
            r"^invalid snapshot_every=7: must be a multiple of log_every_n_steps \(5\)",
        ),
        (dict(on_spike="sometimes"), r"^invalid on_spike='sometimes'"),
        (dict(spike_window=5), r"^invalid spike_window=5: must be 20 or more"),
        (dict(spike_threshold=0.0), r"^invalid spike_threshold=0.0: must be a positive finite number$"),
        (dict(max_rollbacks=-1), r"^invalid max_rollbacks=-1: must be 0 or more$"),
    ],
)
def test_bad_spike_settings_are_one_line_errors(fields, message):
    with pytest.raises(lt.ConfigError, match=message):
        lt.TrainConfig(log_every_n_steps=5, **fields)


def test_rollback_skips_nothing_when_nothing_spikes(tmp_path):
    """No spike: the run is the one without --on-spike, bit for bit (snapshots change nothing)."""
    plain = train(tmp_path / "plain", PlantedSpikes(), on_spike="off", snapshot_every=None, max_steps=30)
    guarded = train(tmp_path / "guarded", PlantedSpikes(), max_steps=30)
    assert guarded.rollbacks == []
    for name, value in plain.model.state_dict().items():
        assert torch.equal(guarded.model.state_dict()[name], value), name
    shutil.rmtree(tmp_path / "plain")
