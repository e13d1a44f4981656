"""--pack-length: rows of exactly N tokens, attention and labels kept inside each document, exact losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

import leantrain as lt
from leantrain.data.document_attention import transformers_inputs
from leantrain.data.loader import collate
from leantrain.data.packing import PackedDocuments, PackedRowSampler, padding_share
from leantrain.errors import ConfigError, DataError, TaskError
from leantrain.examples.charlm import CharLMTask
from leantrain.step.batching import BatchSplit
from tests.conftest import quiet_config
from tests.test_resume import StopAt, assert_same_parameters

N = 12


class Items(Dataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def random_documents(count: int = 14, vocab: int = 50, seed: int = 0) -> list[torch.Tensor]:
    """Documents of 1 to 30 tokens: most shorter than N, some longer (split over rows)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 31, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (length,), generator=gen) for length in lengths]


def next_token_labels(document: torch.Tensor) -> torch.Tensor:
    return torch.cat([document[1:], torch.tensor([-100])])


def pieces(documents: list[torch.Tensor], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The spec, written out independently: documents end to end in index order, cut every n tokens
    (the last partial row dropped); each (document, row) overlap is one piece with its labels."""
    rows = sum(map(len, documents)) // n
    found, offset = [], 0
    for document in documents:
        labels = next_token_labels(document)
        for start in range(0, len(document)):
            at = offset + start
            if at >= rows * n:
                break
            if start == 0 or at % n == 0:  # a piece begins: the document's start, or a row's
                length = min(len(document) - start, n - at % n, rows * n - at)
                found.append((document[start : start + length], labels[start : start + length]))
        offset += len(document)
    return found


def test_rows_hold_the_documents_end_to_end_with_restarting_positions():
    documents = random_documents()
    packed = PackedDocuments(Items(documents), N, seed=0, shuffle=False, name="train_data")
    rows = [packed[i] for i in range(len(packed))]
    assert len(rows) == sum(map(len, documents)) // N
    expected = iter(pieces(documents, N))
    for row in rows:
        assert all(row[key].shape == (N,) for key in ("input_ids", "labels", "position_ids", "document_ids"))
        for segment in range(int(row["document_ids"].max()) + 1):
            where = row["document_ids"] == segment
            ids, labels = next(expected)
            assert torch.equal(row["input_ids"][where], ids)
            assert torch.equal(row["labels"][where], labels)
            assert torch.equal(row["position_ids"][where], torch.arange(len(ids)))
    assert next(expected, None) is None


def test_a_dicts_own_labels_are_kept_and_no_label_names_another_documents_token():
    documents = [{"input_ids": torch.arange(5), "labels": torch.tensor([7, 7, 7, -100, 7])}, torch.arange(7)]
    row = PackedDocuments(Items(documents), N, 0, False, "train_data")[0]
    assert row["labels"].tolist() == [7, 7, 7, -100, 7, 1, 2, 3, 4, 5, 6, -100]


def test_packing_is_deterministic_from_seed_and_epoch():
    def rows(seed: int, epoch: int) -> list[list[int]]:
        packed = PackedDocuments(Items(random_documents()), N, seed, True, "train_data")
        return [packed[epoch * len(packed) + i]["input_ids"].tolist() for i in range(len(packed))]

    assert rows(0, 0) == rows(0, 0)
    assert rows(0, 1) == rows(0, 1)
    assert rows(0, 0) != rows(0, 1)  # every epoch its own order
    assert rows(0, 0) != rows(1, 0)
    tokens = sorted(t for row in rows(0, 1) for t in row)
    everything = sorted(t for document in random_documents() for t in document.tolist())
    assert set(tokens) <= set(everything) and len(tokens) == len(everything) // N * N


def test_the_rows_of_a_step_do_not_depend_on_world_size_or_micro_batch():
    def step_rows(world: int, micro: int) -> list[list[int]]:
        split = BatchSplit(8, micro, world)
        samplers = [PackedRowSampler(40, split, 10, seed=3, rank=rank) for rank in range(world)]
        steps: list[list[int]] = [[] for _ in range(10)]
        for sampler in samplers:
            for micro_batch in sampler:
                steps[micro_batch.position[0]] += list(micro_batch)
        return steps

    single = step_rows(1, 8)
    assert single[5] == list(range(40, 48))  # step 5 is epoch 1 (5 steps an epoch): its first rows
    assert step_rows(2, 2) == single
    assert step_rows(4, 1) == single


class TinyCharLM(CharLMTask):
    """charlm's model, tiny and in float64, on its documents layout."""

    def __init__(self, max_chars: int = 2500) -> None:
        super().__init__(block=16, layers=1, heads=2, width=16, max_chars=max_chars, layout="documents")

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return super().model().double()


def llama(attention: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attention,
    )  # fmt: skip
    return LlamaForCausalLM(config).double().eval()


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config).double().eval()


def hf_loss(model: nn.Module, batch: dict) -> lt.LossSum:
    from leantrain.examples.hf_lm import HFCausalLMTask

    return HFCausalLMTask.loss(None, model, batch)  # type: ignore[arg-type]  # a method that reads no state


MODELS = {
    "charlm": lambda: (TinyCharLM(max_chars=50).model().eval(), TinyCharLM(max_chars=50).loss),
    "llama-sdpa": lambda: (llama("sdpa"), hf_loss),
    "llama-eager": lambda: (llama("eager"), hf_loss),
    "gpt2": lambda: (gpt2(), hf_loss),
}


@pytest.mark.parametrize("leak", [False, True], ids=["document-mask", "leaking-mask"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_batch_has_the_loss_sum_of_its_pieces_run_alone(name, leak):
    model, loss = MODELS[name]()
    documents = random_documents(vocab=50)
    packed = PackedDocuments(Items(documents), N, 0, False, "train_data")
    batch = collate([packed[i] for i in range(len(packed))], range(len(packed)), "train_data")
    if leak:  # the bug this test exists for: one document per row, so documents attend to each other
        batch["document_ids"] = torch.zeros_like(batch["document_ids"])
    with torch.no_grad():
        together = loss(model, batch)
        alone = [
            loss(model, {"input_ids": ids[None], "labels": labels[None]})
            for ids, labels in pieces(documents, N)
        ]
    assert int(together.count) == sum(int((labels != -100).sum()) for _, labels in pieces(documents, N))
    difference = abs(float(together.sum) - sum(float(piece.sum) for piece in alone))
    # transformers' eager attention takes its softmax in float32 whatever the model's dtype: exact to
    # float32's rounding there, to float64's everywhere else. A leak moves the sum by 0.06 to 0.3.
    tolerance = 1e-6 if name.endswith("eager") else 1e-10
    assert (difference > 1e-3) if leak else (difference < tolerance)


def fit_packed(out_dir, callbacks=(), **changes) -> lt.FitResult:
    fields = dict(global_batch_size=8, micro_batch_size=8, max_steps=24, pack_length=16, log_every_n_steps=5)
    task = TinyCharLM()
    task.val_data = lambda: None  # the steps are what these tests compare
    return lt.Trainer(quiet_config(out_dir, **{**fields, **changes}), callbacks=list(callbacks)).fit(task)


def test_a_packed_run_is_the_same_however_the_global_batch_is_split(tmp_path):
    whole = fit_packed(tmp_path / "whole")
    split = fit_packed(tmp_path / "split", micro_batch_size=2, num_workers=2)
    for (key, a), b in zip(whole.model.state_dict().items(), split.model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), key


def test_a_packed_run_resumed_mid_epoch_is_bit_identical(tmp_path):
    # about 2,250 characters of documents: 140 rows of 16, 17 steps an epoch; the run crosses into epoch 1
    reference = fit_packed(tmp_path / "reference", checkpoint_every=11)
    with pytest.raises(KeyboardInterrupt):
        fit_packed(tmp_path / "run", [StopAt(15)], checkpoint_every=11)
    resumed = fit_packed(tmp_path / "run", checkpoint_every=11, resume="auto")
    assert_same_parameters(reference.model, resumed.model)
    assert resumed.final_train_loss == reference.final_train_loss


def test_bad_values_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="invalid pack_length=0"):
        lt.TrainConfig(pack_length=0)
    with pytest.raises(
        TaskError, match=r"train_data item 0 is \(int64\[4\], int64\[4\]\); return a 1-D"
    ) as error:
        PackedDocuments(Items([(torch.arange(4), torch.arange(4))]), 4, 0, True, "train_data")
    assert "\n" not in str(error.value)
    with pytest.raises(TaskError, match="train_data item 1 is float32"):
        PackedDocuments(Items([torch.arange(4), torch.ones(4)]), 4, 0, True, "train_data")
    with pytest.raises(TaskError, match="fewer than one row of pack_length=9"):
        PackedDocuments(Items([torch.arange(4), torch.arange(4)]), 9, 0, True, "train_data")
    with pytest.raises(TaskError, match=r"Linear\.forward takes no position_ids"):
        transformers_inputs(nn.Linear(2, 2), {"input_ids": torch.zeros(1, 2)})

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([torch.arange(4)] * 8)

    task = TinyCharLM()
    task.train_data = Stream
    with pytest.raises(
        ConfigError, match="pack_length=16: packs map-style data; train_data is an IterableDataset"
    ):
        lt.Trainer(quiet_config(tmp_path / "stream", pack_length=16, max_steps=1)).fit(task)


def test_the_log_line_counts_what_packing_leaves_out_and_a_document_that_fails_later_names_its_row():
    documents = [torch.arange(5), torch.arange(7), torch.arange(6)]  # 18 tokens: 4 rows of 4, 2 left
    packed = PackedDocuments(Items(documents), 4, 0, False, "train_data")
    assert packed.note() == (
        "pack_length 4: 3 train_data documents, 18 tokens -> 4 rows per epoch (2 tokens of the last partial "
        "row left out)"
    )

    class Vanishing(Items):  # read whole once (to measure the documents), then gone
        reads = 0

        def __getitem__(self, index: int):
            Vanishing.reads += 1
            if Vanishing.reads > len(self.items):
                raise FileNotFoundError(f"shard {index}")
            return self.items[index]

    packed = PackedDocuments(Vanishing(documents), 4, 0, False, "train_data")
    with pytest.raises(
        DataError, match=r"^train_data item 1 \(packed into row 2 of epoch 1\) failed: FileNotF"
    ):
        packed[len(packed) + 2]  # epoch 1, row 2: document 1, tokens 3-6

    class Changing(Items):  # measured whole once, then floats: each read is checked again
        reads = 0

        def __getitem__(self, index: int):
            Changing.reads += 1
            return self.items[index].float() if Changing.reads > len(self.items) else self.items[index]

    packed = PackedDocuments(Changing(documents), 4, 0, False, "train_data")
    with pytest.raises(TaskError, match=r"^pack_length packs token sequences: train_data item 1 is "):
        packed[2]  # row 2: document 1 alone


def test_numpy_documents_pack_as_tensors_and_labels_must_have_the_shape_of_their_ids():
    import numpy as np

    tensors = [torch.arange(5), {"input_ids": torch.arange(7), "labels": torch.arange(7) + 100}]
    arrays = [np.arange(5), {"input_ids": np.arange(7), "labels": np.arange(7) + 100}]
    as_tensors = PackedDocuments(Items(tensors), 4, 0, False, "train_data")
    as_arrays = PackedDocuments(Items(arrays), 4, 0, False, "train_data")
    for row in range(len(as_tensors)):
        for key, value in as_tensors[row].items():
            assert torch.equal(as_arrays[row][key], value), (row, key)
    expected = (
        r"^pack_length packs token sequences: train_data item 0 is .*; return a 1-D integer tensor, or a "
        r"dict with a 1-D integer input_ids and optional labels of its shape$"
    )
    for labels in (torch.arange(4), [0, 1, 2, 3, 4]):  # another shape; not a tensor
        with pytest.raises(TaskError, match=expected):
            PackedDocuments(
                Items([{"input_ids": torch.arange(5), "labels": labels}]), 4, 0, False, "train_data"
            )

    class Unreadable(Items):
        def __getitem__(self, index: int):
            if index == 1:
                raise KeyError(index)
            return self.items[index]

    with pytest.raises(DataError, match=r"^train_data item 1 failed: KeyError: 1$"):
        PackedDocuments(Unreadable(tensors), 4, 0, False, "train_data")


def test_padding_share_counts_masked_positions_or_ignored_labels():
    padded = {"input_ids": torch.zeros(8), "attention_mask": torch.tensor([1, 1, 1, 0, 0, 0, 0, 0])}
    labelled = {"input_ids": torch.zeros(4), "labels": torch.tensor([1, 2, -100, -100])}
    assert padding_share([padded, labelled]) == pytest.approx(7 / 12)
    assert padding_share([torch.zeros(3)]) is None
    assert padding_share([{"input_ids": torch.zeros(0)}]) is None  # no position computed: no share
