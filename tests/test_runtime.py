from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

import leantrain as lt
from leantrain import runtime
from leantrain.runtime import deterministic_kernels, peak_memory_bytes, resolve_device


def test_auto_device_is_cuda_when_present_else_cpu():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_unavailable_cuda_is_a_config_error():
    with pytest.raises(lt.ConfigError, match="invalid device='cuda:1': CUDA is not available"):
        resolve_device("cuda:1")


def test_deterministic_kernels_are_enabled_inside_and_restored_after():
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_peak_memory_on_cpu_rises_by_a_large_allocation():
    """In a fresh process (this one's peak may already be above anything the test allocates); the
    allocation is freed before the reading: a peak, not the memory in use."""
    code = (
        "import torch, leantrain.runtime as r; cpu = torch.device('cpu'); before = r.peak_memory_bytes(cpu); "
        "big = torch.ones(256 * 2**20, dtype=torch.uint8); del big; print(before, r.peak_memory_bytes(cpu))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(int, done.stdout.split())
    # the 256 MiB, touched; less what the start-up's own passing peak already covered (under `make mutate`
    # the mutated copy imports mutmut first: 247 MiB then)
    assert after - before >= 200 * 2**20


def test_peak_memory_of_a_child_is_its_own_not_its_parents():
    """ru_maxrss of a child started by a large process reports the parent's peak; VmHWM does not."""
    big = torch.ones(512 * 1024 * 1024, dtype=torch.uint8)  # the parent's peak: 512 MiB above torch's
    parent = peak_memory_bytes(torch.device("cpu"))
    code = "import torch, leantrain.runtime as r; print(r.peak_memory_bytes(torch.device('cpu')))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    del big
    assert int(child.stdout) < parent - 256 * 1024 * 1024  # the child only imported torch


@pytest.mark.parametrize(("precision", "kind"), [("bf16-mixed", "bf16"), ("bf16-true", "bf16"),
                                                  ("16-mixed", "fp16"), ("16-true", "fp16")])  # fmt: skip
def test_16_bit_on_a_cpu_without_its_instructions_is_named_before_the_run(monkeypatch, precision, kind):
    """charlm trained 17x slower in bf16 and 21x in fp16 than in 32 on this machine's AVX2 CPU,
    and nothing said so."""
    asked = []
    monkeypatch.setattr(runtime, "native_16_bit", lambda wanted: asked.append(wanted) or False)
    text = runtime.emulated_precision(precision, torch.device("cpu"))
    assert asked == [kind] and text is not None
    assert text.startswith(f"precision {precision} on this CPU, which has no {kind} matrix instructions")
    assert runtime.emulated_precision("32", torch.device("cpu")) is None
    assert runtime.emulated_precision(precision, torch.device("cuda")) is None
    for known in (True, None):  # has them, or cannot tell: nothing to say
        monkeypatch.setattr(runtime, "native_16_bit", lambda wanted, known=known: known)
        assert runtime.emulated_precision(precision, torch.device("cpu")) is None


def test_a_run_in_emulated_16_bit_warns_at_its_start(fit, monkeypatch):
    from tests.conftest import TinyClassifier

    monkeypatch.setattr(runtime, "native_16_bit", lambda kind: False)
    with pytest.warns(lt.LeantrainWarning, match="precision bf16-mixed on this CPU, which has no bf16"):
        # On the CPU, also on a GPU machine: the warning is about a CPU.
        fit(TinyClassifier(samples=32), precision="bf16-mixed", global_batch_size=16, max_steps=1,
            device="cpu")  # fmt: skip


def test_this_cpus_16_bit_support_is_read_from_torch_on_x86():
    """On this machine's kind of CPU the answer is known (True or False), not None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("read on x86 only")
    assert runtime.native_16_bit("bf16") in (True, False)
    assert runtime.native_16_bit("fp16") in (True, False)
