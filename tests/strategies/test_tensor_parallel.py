"""--tp before any process starts (the layout's rules) and the plans (where they come from, what they
may split), in one process; tests/distributed/test_tensor_parallel.py trains with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import leantrain as lt
from leantrain.cluster import ClusterEnv
from leantrain.examples.charlm import CharLMTask
from leantrain.strategies.dims import ParallelDims
from leantrain.strategies.registry import check_config
from leantrain.strategies.tp_plan import (
    STYLES,
    parallel_styles,
    plan_of,
    planned_modules,
    sequence_moves,
    style_of,
)
from tests.test_batch_norm import one_process_group


def test_tp_groups_consecutive_ranks_that_load_the_same_samples_and_share_random_numbers():
    dims = check_config(lt.TrainConfig(tp=2, global_batch_size=8), 8).dims(lt.TrainConfig(tp=2), 8)
    assert dims == ParallelDims(dp=4, tp=2) and dims.world_size == 8
    assert [dims.data_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.seed_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    env = ClusterEnv("torchrun", rank=5, local_rank=5, world_size=8, local_world_size=8)
    data = dims.data_env(env)
    assert (data.rank, data.world_size, data.local_world_size) == (2, 4, 4)
    # Without --tp or stages every rank is its own data rank and draws its own numbers.
    assert [ParallelDims(dp=4).seed_rank(rank) for rank in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("fields", "world", "message"),
    [
        ({"tp": 2}, 3, "invalid tp=2: must divide the number of processes 3"),
        ({"tp": 2}, 1, r"invalid tp=2: needs 2 processes or more: `leantrain launch --nproc-per-node 2"),
        (
            {"tp": 2, "strategy": "pipeline", "pipeline_stages": 2},
            4,
            "strategy pipeline has no tensor parallelism",
        ),
        ({"tp": 2, "precision": "bf16-true"}, 2, "with strategy ddp: 32 or bf16-mixed .with --tp"),
        ({"tp": 2, "micro_batch_size": "auto"}, 2, "does not yet adapt the micro-batch"),
        ({"tp": 2, "lora_rank": 8}, 2, "invalid tp=2: not with --lora-rank"),
        ({"tp": 2, "global_batch_size": 6}, 8, "global_batch_size=6: must be a multiple of the world size 4"),
        ({"tp": 0}, 2, "invalid tp=0: must be 1 .off. or a number of processes up to 1024"),
    ],
)
def test_a_layout_that_cannot_run_is_one_line_before_any_process_starts(fields, world, message):
    with pytest.raises(lt.ConfigError, match=message):
        check_config(lt.TrainConfig(**{"global_batch_size": 8, **fields}), world)


def test_ddp_and_fsdp_run_tp_through_variants_that_keep_their_names():
    for name in ("ddp", "fsdp", "auto"):
        chosen = check_config(lt.TrainConfig(strategy=name, tp=2), 4)
        assert chosen.name == (name if name != "auto" else "ddp") and chosen.sharded


def charlm() -> tuple[CharLMTask, nn.Module]:
    task = CharLMTask(block=16, layers=2, heads=4, width=32, max_chars=2000)
    return task, task.model()


def test_the_examples_plan_splits_each_blocks_four_matrices_and_the_positions_between_them():
    task, model = charlm()
    plan, source = plan_of(model, task.tp_plan(model), 2)
    assert source == "task.tp_plan(model)"
    chosen = planned_modules(model, plan, 2)
    matrices = [f"blocks.{i}.{name}" for i in (0, 1) for name in ("qkv", "proj", "mlp.0", "mlp.2")]
    assert sorted(name for name, style in chosen.items() if STYLES[style].splits) == sorted(matrices)
    assert chosen["blocks.1.qkv"] == "sequence_colwise" and chosen["blocks.0.mlp.2"] == "sequence_rowwise"
    # The positions split at the first block's input, gathered at the head's; the norms between run on them.
    assert sequence_moves(chosen, sequence_parallel=True) == {"blocks.0": "split", "head": "gather"}
    assert {chosen[f"blocks.{i}.norm{j}"] for i in (0, 1) for j in (1, 2)} | {chosen["norm"]} == {
        "sequence_parallel"
    }
    # --sequence-parallel false: the same plan without the moves, the matrices as plain colwise/rowwise.
    assert sequence_moves(chosen, sequence_parallel=False) == {}
    assert style_of("sequence_colwise", False) == STYLES["colwise"]
    assert style_of("sequence_rowwise", False) == STYLES["rowwise"]
    assert style_of("sequence_parallel", False) == STYLES["replicate"]


def test_sequence_parallelism_gathers_before_a_colwise_and_reduce_scatters_after_a_rowwise():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4))
    chosen = {"0": "sequence_parallel", "1": "sequence_colwise", "2": "sequence_rowwise"}
    on = parallel_styles(model, chosen, sequence_parallel=True)
    assert isinstance(on["0"], SequenceParallel)
    assert on["1"].input_layouts == (Shard(1),) and on["2"].output_layouts == (Shard(1),)
    off = parallel_styles(model, chosen, sequence_parallel=False)
    assert "0" not in off  # the norm whole
    assert off["1"].input_layouts == (Replicate(),) and off["2"].output_layouts == (Replicate(),)


def test_a_sequence_that_does_not_divide_is_one_line():
    from leantrain.strategies.sequence import _split

    class PairOfRanks:
        def size(self) -> int:
            return 2

    with pytest.raises(lt.ConfigError, match="invalid tp=2: must divide the sequence length 15"):
        _split(PairOfRanks(), torch.zeros(1, 15, 4))


@pytest.mark.parametrize(("move", "length"), [("split", 4), ("gather", 16)])
def test_a_module_given_its_input_by_keyword_has_it_moved(move, length):
    """transformers calls its attention with ``hidden_states=``: a hook that moved only a positional
    input could not split or gather it (the module got the whole sequence, or failed)."""
    from torch.distributed.device_mesh import init_device_mesh

    from leantrain.simulate.fake_world import fake_world
    from leantrain.strategies.sequence import add_sequence_moves

    class Attention(nn.Module):
        def forward(self, *, hidden_states: torch.Tensor, scale: float) -> torch.Tensor:
            return hidden_states * scale

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = Attention()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attention(hidden_states=x, scale=2.0)

    with fake_world(2, 0):  # shapes only: the fake group moves no values
        layer = Layer()
        add_sequence_moves(layer, {"attention": move}, init_device_mesh("cpu", (2,)))
        assert layer(torch.ones(3, 8, 5)).shape == (3, length, 5)


def test_a_transformers_model_brings_its_own_plan_under_its_prefix():
    pytest.importorskip("transformers")
    from leantrain.examples.hf_lm import _causal_lm

    model = _causal_lm("llama", block=16, layers=2, heads=4, width=32, dropout=0.0)
    plan, source = plan_of(model, None, 2)
    assert source == "LlamaForCausalLM's own plan (transformers)"
    chosen = planned_modules(model, plan, 2)
    assert chosen["model.layers.1.self_attn.q_proj"] == "colwise"
    assert chosen["model.layers.0.mlp.down_proj"] == "rowwise"
    assert chosen["lm_head"] == "colwise_gather_output"
    # transformers 5.24 splits the embedding too; 5.17 and 5.18 leave it whole (their plan has no entry).
    assert chosen.get("model.embed_tokens", "embedding_rowwise") == "embedding_rowwise"
    # GPT-2 ships no plan (its fused Conv1D attention has none): one line says what to give.
    gpt2 = _causal_lm("gpt2", block=16, layers=2, heads=4, width=32, dropout=0.0)
    with pytest.raises(
        lt.ConfigError, match="GPT2LMHeadModel has no tensor-parallel plan: give the task a tp_plan"
    ):
        plan_of(gpt2, None, 2)


@pytest.mark.parametrize(
    ("plan", "tp", "message"),
    [
        ({"blocks.*.qkv": "diagonal"}, 2, "plan entry blocks.*.qkv: style 'diagonal' is not one of colwise"),
        ({"blocks.*.attention": "colwise"}, 2, "plan entry blocks.*.attention matches no module of CharGPT"),
        (
            {"blocks.*": "colwise"},
            2,
            "plan entry blocks.0: colwise splits an nn.Linear or nn.Embedding, not Block",
        ),
        # An embedding's rows; not token's: the alphabet of the pydoc text is Python's (103 characters
        # in 3.11, even in 3.12).
        ({"position": "rowwise"}, 3, "must divide position's 16 features that rowwise splits"),
        ({"blocks.*.qkv": "colwise"}, 8, "invalid tp=8: must divide the 4 attention heads of blocks.0.heads"),
        ({"blocks.*.mlp.0": "colwise"}, 3, "must divide blocks.0.mlp.0's 128 features that colwise splits"),
    ],
)
def test_a_plan_that_cannot_split_the_model_names_the_entry(plan, tp, message):
    _, model = charlm()
    with pytest.raises(lt.ConfigError, match=message):
        planned_modules(model, plan, tp)


def test_one_part_of_a_name_per_star():
    _, model = charlm()
    assert planned_modules(model, {"*.0.qkv": "colwise"}, 2) == {"blocks.0.qkv": "colwise"}
    with pytest.raises(lt.ConfigError, match="matches no module"):
        planned_modules(model, {"*.qkv": "colwise"}, 2)  # blocks.0.qkv has three parts


def test_styles_take_an_embeddings_token_ids_whole_and_gather_only_where_asked():
    from torch.distributed.tensor import Replicate, Shard

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 8))
    chosen = {"0": "rowwise", "1": "colwise", "2": "rowwise", "3": "colwise_rep"}
    styles = parallel_styles(model, chosen, sequence_parallel=True)
    assert styles["0"].input_layouts == (Replicate(),) and styles["2"].input_layouts == (Shard(-1),)
    assert styles["1"].output_layouts == (Shard(-1),) and styles["3"].output_layouts == (Replicate(),)


def test_the_plan_ties_the_embedding_and_its_head_again_or_refuses_to_split_them_apart():
    from leantrain.strategies.base import Example
    from leantrain.strategies.tensor_parallel import TensorParallel

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token, self.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
            self.head.weight = self.token.weight

    def applied(plan: dict[str, str]) -> nn.Module:
        strategy = TensorParallel(lt.TrainConfig(tp=1), torch.device("cpu"), ParallelDims(dp=1, tp=1))
        return strategy.apply_plan(Tied(), Example(None, lambda: None, lambda model: plan))  # type: ignore[arg-type]

    with one_process_group("gloo"):
        model = applied({"token": "rowwise", "head": "colwise_rep"})  # both split by vocabulary row
        assert model.head.weight is model.token.weight
        assert [name for name, _ in model.named_parameters()] == ["token.weight"]
        with pytest.raises(
            lt.ConfigError, match=r"splits the tied weights token\.weight and head\.weight differently"
        ):
            applied({"head": "colwise_rep"})
