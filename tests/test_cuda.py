"""What only a GPU shows: the CUDA device a run picks, the allocator's cap and its real
out-of-memory errors, exact resume with the device prefetcher. Skipped without CUDA; run on a GPU
machine with ``pytest -m cuda`` (results in benchmarks/results/gpu.md).

The CUDA-only code (the prefetcher's streams, the timer's events, the allocator's retries) is also run
on the CPU here, through fakes of the few ``torch.cuda`` calls it makes: what it asks of CUDA, in order."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain.cluster import ClusterEnv
from leantrain.trainer import _process_device
from tests.conftest import RegressionTask
from tests.test_resume import StopAt, train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakeStream:
    """A CUDA stream that logs what is asked of it."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def __repr__(self) -> str:
        return self.name


@pytest.fixture
def fake_streams(monkeypatch) -> list:
    """torch.cuda's streams on the CPU: the prefetcher's own side stream and the compute (current) one;
    the log names each copy with the stream it was queued on, each wait and each ``record_stream``."""
    import contextlib

    from leantrain.data import loader

    log: list = []
    compute, current = FakeStream("compute", log), []

    def side_stream(device):
        assert device == torch.device("cuda", 0)
        return FakeStream("side", log)

    @contextlib.contextmanager
    def on(stream):
        current.append(stream)
        yield
        current.pop()

    def current_stream(device):
        assert device == torch.device("cuda", 0)
        return compute

    def move_to_device(batch, device, non_blocking=False, dtype=None):
        assert device == torch.device("cuda", 0)
        log.append(
            f"copy {batch['step']} on {current[-1] if current else 'compute'}, non_blocking={non_blocking}"
        )
        return loader.map_tensors(
            batch, lambda t: t.to(dtype) if dtype and t.is_floating_point() else t.clone()
        )

    def record_stream(tensor, stream):
        log.append(f"{tensor.tolist()} used on {stream}")

    monkeypatch.setattr(torch.cuda, "Stream", side_stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(loader, "move_to_device", move_to_device)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return log


def test_the_prefetcher_copies_the_next_batch_on_its_stream_and_the_step_waits_for_it(fake_streams):
    from leantrain.data.loader import CudaPrefetcher, device_batches

    host = [
        {"step": step, "x": torch.tensor([step + 0.5]), "nested": [(torch.tensor([step]),)]}
        for step in (0, 1)
    ]
    batches = device_batches(iter(host), torch.device("cuda", 0), dtype=torch.float64)
    assert isinstance(batches, CudaPrefetcher) and iter(batches) is batches
    assert fake_streams == ["copy 0 on side, non_blocking=True"]  # the first one, before it is asked for
    first = next(batches)
    assert first["x"].dtype == torch.float64 and first["nested"][0][0].dtype == torch.int64
    assert fake_streams[1:] == [
        "compute waits for side",  # the step's kernels come after the copy
        "[0.5] used on compute",  # every tensor, nested ones too: not reused while the step reads it
        "[0] used on compute",
        "copy 1 on side, non_blocking=True",  # then the next copy, beside the step
    ]
    second = next(batches)
    assert torch.equal(second["x"], torch.tensor([1.5], dtype=torch.float64))
    assert fake_streams[-1] == "[1] used on compute"  # nothing left to copy
    with pytest.raises(StopIteration):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)


def test_the_device_timer_reads_cuda_events_once_in_seconds(monkeypatch):
    """On CUDA a phase is two events on the current stream; their milliseconds are read once, after one
    synchronize, when the results are asked for (reading a host clock would time the launches only)."""
    from leantrain.diagnose.timer import PhaseTimer

    now_ms, synchronized = [0.0], []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.timing, self.ms = enable_timing, None

        def record(self) -> None:
            self.ms = now_ms[0]

        def elapsed_time(self, end: FakeEvent) -> float:
            assert self.timing and end.timing, "CUDA times only events made with enable_timing=True"
            assert len(synchronized) == 1, "events are read after a synchronize"
            return end.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append(True))
    timer = PhaseTimer("cuda")
    with timer.phase("forward"):
        now_ms[0] += 250.0
    with timer.phase("backward"):
        now_ms[0] += 500.0
    timer.end_step()
    assert synchronized == []  # a step adds no synchronisation
    row = timer.steps()[0]
    assert (row["forward"], row["backward"]) == (0.25, 0.5)


def test_allocator_retries_count_from_cuda_stats_that_start_empty():
    """``torch.cuda.memory_stats()`` is empty until CUDA allocates: no retry yet."""
    from leantrain.memory.adaptive import AllocatorRetries

    def retries(*counts: int | None, steps_in_a_row: int) -> list[bool]:
        stats = iter([{} if n is None else {"num_alloc_retries": n} for n in counts])
        watch = AllocatorRetries(lambda: next(stats), steps_in_a_row)
        return [watch.too_many() for _ in counts[1:]]

    # from an empty start; a streak starts again from 0 once it was reported
    assert retries(None, 1, 2, 3, 4, steps_in_a_row=2) == [False, True, False, True]
    assert retries(0, None, 1, steps_in_a_row=1) == [False, True]  # empty again: still none
    assert retries(5, 5, 6, steps_in_a_row=1) == [False, True]  # counted from the first reading, not 0
    stats = iter([{"num_alloc_retries": n} for n in range(5)])
    watch = AllocatorRetries(lambda: next(stats))  # by default: three steps in a row
    assert [watch.too_many() for _ in range(4)] == [False, False, True, False]


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


@pytest.mark.cuda
@needs_cuda
def test_packed_attention_on_the_gpu_is_flex_attention_with_the_document_mask(monkeypatch):
    import torch.nn.functional as F

    from leantrain.data import document_attention as attention

    ids = torch.tensor([[0] * 100 + [1] * 60, [0] * 30 + [1] * 130], device="cuda")
    q, k, v = (torch.randn(2, 2, 160, 16, device="cuda") for _ in range(3))
    used = []
    flex = attention.flex_document_attention
    monkeypatch.setattr(attention, "flex_document_attention", lambda *a: used.append(1) or flex(*a))
    out = attention.document_attention(q, k, v, ids)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attention.document_mask(ids))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    attention.document_attention(q, k, v, ids, dropout_p=0.1)  # flex_attention has no dropout: SDPA
    assert used == [1]
