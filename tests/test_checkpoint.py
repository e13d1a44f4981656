"""Checkpoint files: atomic, safe to load, and clear about what is wrong."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import leantrain as lt
from leantrain.checkpoint import (
    CheckpointFolder,
    capture_rng,
    check_compatible,
    export_checkpoint,
    export_weights,
    load_checkpoint,
    load_into,
    load_weights,
    restore_rng,
    save_checkpoint,
    tied_aliases,
    unique_tensors,
)
from leantrain.strategies.sharded_state import ShardedState
from tests.conftest import TiedEmbedding


def small_state(step: int = 1) -> dict:
    return {"step": step, "model": nn.Linear(3, 2).state_dict(), "config": {"seed": 0}, "dataset_size": 10}


def test_round_trip_keeps_tensors_and_plain_values(tmp_path):
    state = small_state(7)
    save_checkpoint(tmp_path / "a.pt", state)
    loaded = load_checkpoint(tmp_path / "a.pt")
    assert loaded["step"] == 7 and loaded["config"] == {"seed": 0}
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())


def test_folder_keeps_the_newest_k_and_ignores_unfinished_saves(tmp_path):
    folder = CheckpointFolder(tmp_path / "checkpoints", keep=2)
    for step in (5, 10, 15):
        folder.save(step, small_state(step))
    assert [p.name for p in folder.files()] == ["step-00000010.pt", "step-00000015.pt"]
    (tmp_path / "checkpoints" / ".step-00000020.pt.tmp-123").write_bytes(b"half")
    assert len(folder.files()) == 2
    path, state = folder.newest_valid(warn=print)
    assert path.name == "step-00000015.pt" and state["step"] == 15
    folder.save(20, small_state(20))
    assert not list((tmp_path / "checkpoints").glob(".*tmp*"))  # the stale temporary file is cleaned


def test_protected_checkpoints_stay_beside_the_newest_k_even_when_the_newest_is_protected(tmp_path):
    folder = CheckpointFolder(tmp_path / "checkpoints", keep=1)
    for step, protected in ((4, {4}), (8, {4, 8}), (9, {4, 8}), (10, {4, 10})):
        folder.protected = protected  # the best ones, as extensions/best_checkpoints.py sets them
        folder.save(step, small_state(step))
    # The newest (10, also among the best) and the other best (4); 8 fell out of the best, 9 is not newest.
    assert [p.name for p in folder.files()] == ["step-00000004.pt", "step-00000010.pt"]


def sharded_save(folder: CheckpointFolder, step: int, complete: bool = True):
    """A checkpoint file with a shards folder beside it, as an fsdp run writes them."""
    import torch.distributed.checkpoint as dcp

    shards = folder.shard_folder(step)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"model": {"weight": torch.full((2,), float(step))}}, checkpoint_id=str(shards))
    if not complete:
        (shards / ".metadata").unlink()  # DCP writes it last
    return folder.save(step, {**small_state(step), "model": None, "sharded": shards.name})


def test_sharded_checkpoints_are_pruned_with_their_shards(tmp_path):
    folder = CheckpointFolder(tmp_path, keep=2)
    for step in (4, 8, 12):
        sharded_save(folder, step)
    (tmp_path / "step-00000010.dcp").mkdir()  # a save killed before its file was written
    sharded_save(folder, 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000012.dcp", "step-00000012.pt", "step-00000016.dcp", "step-00000016.pt"
    ]  # fmt: skip


def test_newest_valid_skips_a_checkpoint_whose_shards_are_incomplete(tmp_path):
    folder = CheckpointFolder(tmp_path, keep=5)
    sharded_save(folder, 1)
    sharded_save(folder, 2, complete=False)
    warnings: list[str] = []
    _, state = folder.newest_valid(warn=warnings.append)
    assert state["step"] == 1
    assert len(warnings) == 1 and "step-00000002.dcp is missing or incomplete" in warnings[0]
    with pytest.raises(lt.CheckpointError) as caught:
        export_checkpoint(tmp_path / "step-00000002.pt", tmp_path / "out.safetensors")
    shards = tmp_path / "step-00000002.dcp"
    expected = (
        f"checkpoint {tmp_path / 'step-00000002.pt'}: its sharded state {shards} is missing or incomplete"
    )
    assert str(caught.value) == expected


def test_newest_valid_skips_a_corrupt_newest_file_with_a_warning(tmp_path):
    folder = CheckpointFolder(tmp_path, keep=5)
    folder.save(1, small_state(1))
    newest = folder.save(2, small_state(2))
    newest.write_bytes(newest.read_bytes()[:100])
    warnings: list[str] = []
    _, state = folder.newest_valid(warn=warnings.append)
    assert state["step"] == 1
    assert len(warnings) == 1 and str(newest) in warnings[0] and "corrupt or truncated" in warnings[0]


def expect_one_line_error(path, fragment):
    with pytest.raises(lt.CheckpointError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and fragment in message
    return message


def test_truncated_file(tmp_path):
    save_checkpoint(tmp_path / "c.pt", small_state())
    data = (tmp_path / "c.pt").read_bytes()
    (tmp_path / "c.pt").write_bytes(data[: len(data) // 2])
    expect_one_line_error(tmp_path / "c.pt", "is corrupt or truncated")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One folder for the many small cases below (a tmp_path each costs more than the case)."""
    return tmp_path_factory.mktemp("scratch")


@pytest.mark.parametrize("seed", range(200))
def test_random_bytes(scratch, seed):
    """Arbitrary bytes reach many corners of the unpickler (an IndexError once failed a run)."""
    (scratch / f"r{seed}.pt").write_bytes(random.Random(seed).randbytes(4096))
    expect_one_line_error(scratch / f"r{seed}.pt", "is corrupt or truncated")


def test_missing_file_and_folder(tmp_path):
    expect_one_line_error(tmp_path / "none.pt", "does not exist")
    expect_one_line_error(tmp_path, "does not exist (it is a folder)")


def test_a_torch_file_that_is_not_a_leantrain_checkpoint(tmp_path):
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    expect_one_line_error(tmp_path / "other.pt", "is not a leantrain checkpoint")


class RunsCode:
    """Unpickling this calls os.system: the classic pickle exploit."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    ("container", "refusal"),
    [
        ("torch.save", "holds objects that are not plain data, refused"),
        ("raw pickle", "is corrupt or truncated"),
    ],
)
def test_a_pickle_that_would_run_code_is_refused_and_does_not_run(tmp_path, container, refusal):
    marker = tmp_path / "pwned"
    payload = {"format": "leantrain-checkpoint", "format_version": 1, "evil": RunsCode(str(marker))}
    path = tmp_path / "evil.pt"
    if container == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))
    expect_one_line_error(path, refusal)
    assert not marker.exists()


def test_shards_whose_metadata_would_run_code_are_refused_before_dcp_reads_them(tmp_path):
    """DCP unpickles .metadata with plain pickle: leantrain checks its objects first."""
    folder = CheckpointFolder(tmp_path, keep=5)
    sharded_save(folder, 1)
    sharded_save(folder, 2)
    marker = tmp_path / "pwned"
    (folder.shard_folder(2) / ".metadata").write_bytes(pickle.dumps(RunsCode(str(marker))))
    warned: list[str] = []
    _, state = folder.newest_valid(warn=warned.append)
    assert state["step"] == 1 and len(warned) == 1 and "posix.system" in warned[0], warned
    with pytest.raises(lt.CheckpointError, match=r"\.metadata is refused: it holds posix\.system"):
        export_checkpoint(tmp_path / "step-00000002.pt", tmp_path / "out.safetensors")
    assert not marker.exists()
    export_checkpoint(tmp_path / "step-00000001.pt", tmp_path / "out.safetensors")  # DCP's own: read


@pytest.mark.parametrize("name", ["../../elsewhere", "/etc", "step-1.dcp/../../x", 7])
def test_a_checkpoint_naming_shards_outside_its_folder_is_refused(tmp_path, name):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {**small_state(1), "model": None, "sharded": name})
    expect_one_line_error(path, "names its shards")


def test_the_exploit_used_above_does_run_code_when_unpickled_naively(tmp_path):
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(RunsCode(str(marker))))
    assert marker.exists()


def test_model_mismatch_names_the_file_and_the_keys(tmp_path):
    path = tmp_path / "c.pt"
    with pytest.raises(lt.CheckpointError) as caught:
        load_into(nn.Linear(3, 4), nn.Linear(3, 2).state_dict(), "model", path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "size mismatch for weight" in message


def test_config_and_data_mismatch(tmp_path):
    state = {
        "config": {"global_batch_size": 64, "seed": 0, "shuffle": True, "precision": "32"},
        "dataset_size": 100,
    }
    config = dict(state["config"])
    check_compatible(state, tmp_path, config, 100)
    with pytest.raises(
        lt.CheckpointError, match="global_batch_size=64 but this run has global_batch_size=32"
    ):
        check_compatible(state, tmp_path, {**config, "global_batch_size": 32}, 100)
    with pytest.raises(lt.CheckpointError, match="100 training samples but this run has 99"):
        check_compatible(state, tmp_path, config, 99)


def test_rng_states_round_trip_through_a_safe_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_checkpoint(tmp_path / "rng.pt", {"rng": capture_rng()})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(load_checkpoint(tmp_path / "rng.pt")["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_tied_weights_are_exported_once():
    unique = unique_tensors(TiedEmbedding().state_dict())
    assert list(unique) == ["embed.weight"]


class TiedLanguageModel(nn.Module):
    """Named as transformers' GPT-2: the head that reuses the embedding sorts before it."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(5, 3), "ln_f": nn.LayerNorm(3)})
        self.lm_head = nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def test_tied_weights_keep_their_first_registered_name_whether_or_not_they_share_storage():
    model = TiedLanguageModel()
    assert tied_aliases(model) == {"lm_head.weight": "transformer.wte.weight"}
    one_process = unique_tensors(model.state_dict())
    # FSDP gathers every name into a tensor of its own: only the model's aliases tell the tie.
    gathered = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert len(unique_tensors(gathered)) == 4
    sharded = unique_tensors(gathered, tied_aliases(model))
    assert list(one_process) == list(sharded) == ["transformer.wte.weight", "transformer.ln_f.weight",
                                                  "transformer.ln_f.bias"]  # fmt: skip


def test_exported_weights_load_back_strictly_into_a_fresh_model(tmp_path):
    trained = TiedLanguageModel()
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(1.0)
    export_weights(trained.state_dict(), tmp_path / "model.safetensors")
    fresh = load_weights(TiedLanguageModel(), tmp_path / "model.safetensors")
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied after the load
    for name, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    # A file that kept the head's name of the tie loads as well.
    renamed = {
        ("lm_head.weight" if "wte" in k else k): v
        for k, v in load_file(tmp_path / "model.safetensors").items()
    }
    save_file(renamed, str(tmp_path / "head.safetensors"))
    assert torch.equal(load_weights(TiedLanguageModel(), tmp_path / "head.safetensors").lm_head.weight,
                       trained.lm_head.weight)  # fmt: skip
    # A missing weight is an error, not a silent partial load.
    save_file({k: v for k, v in renamed.items() if "ln_f" not in k}, str(tmp_path / "part.safetensors"))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*transformer.ln_f.weight"):
        load_weights(TiedLanguageModel(), tmp_path / "part.safetensors")
    # neither name of the tie: the same error, naming both
    save_file({k: v for k, v in renamed.items() if "ln_f" in k}, str(tmp_path / "untied.safetensors"))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*transformer.wte.weight.*lm_head.weight"):
        load_weights(TiedLanguageModel(), tmp_path / "untied.safetensors")


def test_export_command_matches_the_weights_of_the_checkpoint(tmp_path):
    model = nn.Linear(3, 2)
    save_checkpoint(tmp_path / "c.pt", {"model": model.state_dict()})
    written = export_checkpoint(tmp_path / "c.pt", tmp_path)
    assert written == tmp_path / "model.safetensors"
    weights = load_file(written)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


CRASH_DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from leantrain.checkpoint import save_checkpoint
    path = sys.argv[1]
    save_checkpoint(path, {"step": 1, "blob": torch.zeros(1000)})

    real_save = torch.save
    def save_then_die(obj, handle):
        real_save({"step": 2, "blob": torch.ones(4_000_000)}, handle)   # a large, partly written file
        handle.flush()
        os.ftruncate(handle.fileno(), os.fstat(handle.fileno()).st_size // 3)
        os.kill(os.getpid(), signal.SIGKILL)                             # killed in the middle of the save
    torch.save = save_then_die
    save_checkpoint(path, {"step": 2})
    """
)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "step.pt"
    done = subprocess.run(
        [sys.executable, "-c", CRASH_DURING_SAVE, str(path)], capture_output=True, timeout=120
    )
    assert done.returncode == -9, done.stderr
    leftovers = [p for p in tmp_path.iterdir() if p.name != "step.pt"]
    assert leftovers and all(".tmp-" in p.name for p in leftovers)  # the torn file is the temporary one
    assert load_checkpoint(path)["step"] == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP: one process saving
def test_a_sharded_checkpoint_exports_the_whole_model_from_one_process(tmp_path, recwarn):
    """`leantrain export` of an fsdp or pipeline checkpoint gathers the model from its DCP shards
    without a process group (here written by one process, the same format as several)."""

    class OneProcessShards(ShardedState):
        def __init__(self, model: nn.Module) -> None:
            self.model = model

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # optimizer state saved beside the model: the export must leave it out
    folder = CheckpointFolder(tmp_path, keep=2)
    OneProcessShards(model).save_sharded(folder.shard_folder(5), optimizer, {})
    folder.save(5, {**small_state(5), "model": None, "sharded": folder.shard_folder(5).name})
    recwarn.clear()
    exported = load_file(export_checkpoint(tmp_path / "step-00000005.pt", tmp_path / "w.safetensors"))
    assert not recwarn.list  # the export says nothing about process groups
    assert sorted(exported) == sorted(model.state_dict())
    assert all(torch.equal(exported[name], value) for name, value in model.state_dict().items())


def test_a_state_that_does_not_fit_is_one_line_cut_at_300_characters(tmp_path):
    """torch lists every missing key over many lines: the account is its first 300 characters, on
    one line; an error without a message is named by its type."""
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(40)])
    with pytest.raises(RuntimeError) as torch_error:
        model.load_state_dict({})
    torch_text = " ".join(str(torch_error.value).split())
    assert len(torch_text) > 300
    with pytest.raises(lt.CheckpointError) as caught:
        load_into(model, {}, "model", tmp_path / "c.pt")
    expected = f"checkpoint {tmp_path / 'c.pt'} does not match this run's model: {torch_text[:300]}..."
    assert str(caught.value) == expected

    class Refuses:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def load_state_dict(self, state):
            raise self.error

    def account(error: Exception) -> str:
        with pytest.raises(lt.CheckpointError) as caught:
            load_into(Refuses(error), {}, "optimizer", tmp_path / "c.pt")
        return str(caught.value).split("does not match this run's optimizer: ")[1]

    assert account(ValueError("x" * 300)) == "x" * 300  # the longest kept whole
    assert account(ValueError("x" * 301)) == "x" * 300 + "..."
    assert account(KeyError()) == "KeyError"  # no message: the type


def test_export_into_a_path_under_a_file_names_the_out_argument(tmp_path):
    save_checkpoint(tmp_path / "c.pt", {"model": nn.Linear(2, 1).state_dict()})
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(lt.ConfigError, match=r"^invalid out='.*file': is a file; give a folder$"):
        export_checkpoint(tmp_path / "c.pt", tmp_path / "file" / "w.safetensors")


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_weights_get_the_mode_the_umask_gives_every_other_file(tmp_path, mask):
    """safetensors' writer makes its files 0600 whatever the umask: on a shared cluster, teammates
    could not read model.safetensors beside a summary.json they can read."""
    before = os.umask(mask)
    try:
        export_weights({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        (tmp_path / "summary.json").write_text("{}")
    finally:
        os.umask(before)
    modes = {(tmp_path / name).stat().st_mode & 0o777 for name in ("model.safetensors", "summary.json")}
    assert modes == {0o666 & ~mask}


def test_a_plain_pickle_is_one_line_without_torchs_warning_before_it(tmp_path, recwarn):
    """torch warns about a pickle of another protocol than its own before it fails to read it: the
    user would get two lines of torch's before leantrain's one."""
    path = tmp_path / "notes.pt"
    with path.open("wb") as handle:
        pickle.dump({"step": 1}, handle, protocol=4)
    with pytest.raises(lt.CheckpointError, match=r"notes.pt is corrupt or truncated"):
        load_checkpoint(path)
    assert [str(w.message) for w in recwarn] == []
