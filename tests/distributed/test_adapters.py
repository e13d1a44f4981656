"""LoRA adapters under fsdp: the base sharded and frozen, the adapter trained as on one process,
its checkpoint (the adapter's shards only) resumed exactly on two processes and on one."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.distributed.conftest import trained_weights

pytest.importorskip("peft")

FIT = ["fit", "--task", "tests.distributed.tasks:tiny_llama_lora_float64", "--global-batch-size", "4",
       "--max-steps", "4", "--checkpoint-every", "2", "--progress", "plain", "--logger", "none"]  # fmt: skip


def assert_close(got: dict, expected: dict, tolerance: float) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert (got[name] - value).abs().max().item() <= tolerance, name


def test_fsdp_adapter_trains_as_one_process_and_resumes_exactly(tmp_path):
    one = trained_weights(tmp_path / "one", FIT)
    assert any(value.abs().max() > 0 for name, value in one.items() if "lora_B" in name)
    two = trained_weights(tmp_path / "two", [*FIT, "--strategy", "fsdp"], processes=2)
    assert_close(two, one, 1e-10)  # float64: the same sums in another order
    folder = tmp_path / "two" / "checkpoints" / "step-00000004.dcp"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    stored = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert {key.removeprefix("model.") for key in stored if key.startswith("model.")} == set(one)  # no base

    # Killed after step 2: its last checkpoint gone, resumed on two processes, then on one.
    for name in ("again", "on_one"):
        shutil.copytree(tmp_path / "two", tmp_path / name)
        for late in (tmp_path / name / "checkpoints").glob("step-00000004*"):
            shutil.rmtree(late) if late.is_dir() else late.unlink()
        (tmp_path / name / "model.safetensors").unlink()
    again = trained_weights(tmp_path / "again", [*FIT, "--strategy", "fsdp", "--resume", "auto"], processes=2)
    for name, value in two.items():
        assert torch.equal(again[name], value), name
    on_one = trained_weights(tmp_path / "on_one", [*FIT, "--resume", "auto"])
    assert_close(on_one, one, 1e-10)
