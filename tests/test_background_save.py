"""Checkpoints written on a thread (--async-checkpoint): what is written, when, and what fails."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import leantrain as lt
from leantrain.checkpoint import load_checkpoint
from leantrain.errors import StorageError
from leantrain.run.background_save import BackgroundSaves, staged
from tests.conftest import RegressionTask, TiedEmbedding, quiet_config


def test_the_write_sees_the_state_of_the_save_not_what_training_did_after_it():
    weight = torch.zeros(3)
    written: list[torch.Tensor] = []

    def slow_write(state):
        time.sleep(0.2)  # training goes on meanwhile
        written.append(state["weight"].clone())

    saves = BackgroundSaves(enabled=True)
    with saves.blocking():
        saves.submit(slow_write, {"weight": weight})
    weight.add_(1.0)  # the next optimizer step, in place
    assert not written  # the write is still going on
    saves.wait()
    assert torch.equal(written[0], torch.zeros(3))


def test_one_write_at_a_time_in_order():
    order: list[str] = []
    running = threading.Event()

    def write(name):
        def run(state):
            assert not running.is_set(), "two writes at once"
            running.set()
            time.sleep(0.05)
            order.append(name)
            running.clear()

        return run

    saves = BackgroundSaves(enabled=True)
    for name in ("a", "b", "c"):
        saves.submit(write(name), {})
    saves.wait()
    assert order == ["a", "b", "c"]


def test_a_failed_write_is_raised_at_the_next_wait_and_only_once():
    def full_disk(state):
        raise StorageError("could not write checkpoint x: No space left on device")

    saves = BackgroundSaves(enabled=True)
    saves.submit(full_disk, {})
    with pytest.raises(StorageError, match="No space left on device"):
        saves.wait()
    saves.wait()  # reported once


def test_tied_weights_stay_one_tensor_in_the_staged_copy():
    model = TiedEmbedding()
    state = model.state_dict()
    copy, _ = staged(state)
    assert copy["embed.weight"] is copy["head.weight"]
    assert copy["embed.weight"].data_ptr() != state["embed.weight"].data_ptr()
    assert torch.equal(copy["embed.weight"], state["embed.weight"])


def test_async_and_synchronous_checkpoints_hold_the_same_state(tmp_path):
    results = {}
    for mode in (True, False):
        config = quiet_config(tmp_path / str(mode), global_batch_size=16, max_steps=12, checkpoint_every=4,
                              keep_checkpoints=3, async_checkpoint=mode)  # fmt: skip
        results[mode] = lt.Trainer(config).fit(RegressionTask())
    for step in (4, 8, 12):
        name = f"checkpoints/step-{step:08d}.pt"
        saved = {mode: load_checkpoint(tmp_path / str(mode) / name) for mode in (True, False)}
        for part in ("model", "optimizer"):
            left, right = (torch.utils._pytree.tree_leaves(saved[mode][part]) for mode in (True, False))
            assert len(left) == len(right)
            assert all(
                torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                for a, b in zip(left, right, strict=True)
            ), (step, part)
    summary = json.loads((tmp_path / "True" / "summary.json").read_text())
    assert summary["checkpoint_blocked_seconds"] > 0
