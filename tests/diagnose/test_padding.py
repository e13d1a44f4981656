"""The doctor's padding report for token data, and its advice to pack (--pack-length) above 10 %."""

from __future__ import annotations

from leantrain.diagnose import Measurements, RunFacts, advise
from leantrain.diagnose.doctor import run_doctor
from leantrain.diagnose.report import headline
from leantrain.examples.charlm import CharLMTask
from tests.conftest import quiet_config, without_validation
from tests.diagnose.test_advice import COMPUTE


def packing_advice(share: float | None) -> list:
    advice = advise(RunFacts(padding_share=share, token_length=64), Measurements(COMPUTE))
    return [a for a in advice if "--pack-length 64" in a.change]


def test_packing_is_advised_above_a_tenth_of_padding_only():
    (advice,) = packing_advice(0.5)
    assert "50% of the tokens computed are padding" in advice.evidence
    assert "2.0x" in advice.expected_gain
    assert packing_advice(0.1) == []
    assert packing_advice(None) == []


def tiny_lm(layout: str) -> CharLMTask:
    return without_validation(
        CharLMTask(block=64, layers=1, heads=2, width=16, max_chars=4000, layout=layout)
    )


def test_the_doctor_measures_the_padding_of_padded_documents_and_none_once_packed(tmp_path):
    # On the CPU: packed documents attend through flex_attention on CUDA, which torch 2.11 could not
    # run under the doctor's audit (TorchFunctionModes); the padding share does not depend on it.
    cpu = dict(global_batch_size=8, device="cpu")
    padded = run_doctor(tiny_lm("padded"), quiet_config(tmp_path / "a", **cpu), 1, 1, None, try_compile=False)
    documents = tiny_lm("documents")
    items = [documents.train_data()[i] for i in range(64)]
    real = sum(len(item) for item in items)
    assert padded.facts.padding_share == 1 - real / (64 * 64)  # the positions whose attention_mask is 0
    assert f"{padded.facts.padding_share:.0%} of tokens padding" in headline(padded)
    assert any("--pack-length 64" in a.change for a in padded.advice)
    packed = run_doctor(documents, quiet_config(tmp_path / "b", **cpu, pack_length=64), 1, 1, None,
                        try_compile=False)  # fmt: skip
    assert packed.facts.padding_share == 0
    assert not any("--pack-length" in a.change for a in packed.advice)
