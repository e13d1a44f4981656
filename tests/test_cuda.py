"""What only a GPU shows: the CUDA device a run picks, the allocator's cap and its real
out-of-memory errors, exact resume with the device prefetcher. Skipped without CUDA; run on a GPU
machine with ``pytest -m cuda`` (results in benchmarks/results/gpu.md)."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain.cluster import ClusterEnv
from leantrain.trainer import _process_device
from tests.conftest import RegressionTask
from tests.test_resume import StopAt, train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_more_local_ranks_than_gpus_is_a_clear_error(monkeypatch):
    """Checked before any CUDA call, so it runs on the CPU too (one GPU simulated)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    second = ClusterEnv("torchrun", rank=1, local_rank=1, world_size=2, local_world_size=2)
    with pytest.raises(lt.ConfigError, match="2 processes on this node but 1 CUDA device"):
        _process_device(torch.device("cuda"), second)


@pytest.mark.cuda
@needs_cuda
def test_the_default_device_is_the_current_gpu_with_its_index(fit):
    result = fit(RegressionTask(), global_batch_size=16, max_steps=2)
    assert next(result.model.parameters()).device == torch.device("cuda", torch.cuda.current_device())


class Greedy(RegressionTask):
    """Each sample of a micro-batch holds 64 MiB on the GPU through backward."""

    def loss(self, model, batch):
        x = batch[0]
        held = torch.ones(len(x), 2**24, device=x.device, dtype=torch.float32, requires_grad=True)
        return super().loss(model, batch) + 0 * (held * 2).sum()


@pytest.mark.cuda
@needs_cuda
def test_a_real_out_of_memory_error_halves_the_micro_batch_and_the_cap_is_lifted_after(fit):
    fraction = torch.cuda.get_per_process_memory_fraction()
    budget = torch.cuda.memory_allocated() + 700 * 2**20  # 8 x 2 x 64 MiB does not fit, 2 x 2 x 64 does
    with pytest.warns(lt.LeantrainWarning, match="out of memory at step 1: micro-batch 8 -> 4"):
        halved = fit(
            Greedy(), global_batch_size=16, micro_batch_size=8, memory_budget=str(budget), max_steps=3
        )
    assert halved.micro_batch_size < 8 and halved.accumulation_steps * halved.micro_batch_size == 16
    assert torch.cuda.get_per_process_memory_fraction() == fraction  # a later run is not capped
    fixed = fit(Greedy(), global_batch_size=16, micro_batch_size=halved.micro_batch_size, max_steps=3)
    for a, b in zip(halved.model.parameters(), fixed.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_cuda
def test_dropout_on_the_gpu_and_host_augmentation_resume_exactly(tmp_path):
    """The prefetcher reads a batch ahead; the GPU's generator is the one the checkpoint restores."""
    reference = train(tmp_path / "reference", checkpoint_every=3)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "run", [StopAt(7)], checkpoint_every=3)
    resumed = train(tmp_path / "run", checkpoint_every=3, resume="auto")
    assert next(resumed.model.parameters()).is_cuda
    for a, b in zip(reference.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_come_from_the_main_process_and_from_workers(workers):
    """Without workers leantrain loads in place of a DataLoader: it must pin as a DataLoader does."""
    from torch.utils.data import TensorDataset

    from leantrain.data.loader import build_loader

    dataset = TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    batches = list(build_loader(dataset, "train_data", batch_size=4, num_workers=workers, pin_memory=True))
    assert [len(batch[0]) for batch in batches] == [4, 2]
    assert all(tensor.is_pinned() for batch in batches for tensor in batch)
