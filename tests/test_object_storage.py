"""Run folders in object storage (``--out s3://...``) against a real S3 API: moto's server on 127.0.0.1.

Nothing of leantrain is mocked: runs upload, list, read and delete through s3fs over HTTP, as they
would against AWS or MinIO.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, load_file

from leantrain import TrainConfig, cli, remote
from leantrain.errors import StorageError
from leantrain.run.mirror import MirroredCheckpoints, default_staging, exported
from leantrain.trainer import Trainer
from tests.conftest import RegressionTask
from tests.distributed.conftest import REPO, launch_here, worker_env

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "runs"


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    """An S3 endpoint for this module's tests, its bucket made; the AWS_* variables point at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = dict(os.environ)
    os.environ.update(
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stop()


def objects(fs, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(name.removeprefix(f"{BUCKET}/{prefix}/") for name in fs.find(f"{BUCKET}/{prefix}"))


def weights_at(fs, key: str) -> dict[str, torch.Tensor]:
    fs.invalidate_cache()  # this test's listing cache: the runs wrote since
    return load(fs.cat_file(f"{BUCKET}/{key}"))


def fit(tmp_path, out: str, staging: str, **settings) -> object:
    config = dict(global_batch_size=8, micro_batch_size=4, logger="none", progress="plain")
    config |= dict(log_every_n_steps=1, out_dir=out, staging_dir=str(tmp_path / staging)) | settings
    return Trainer(TrainConfig(**config)).fit(RegressionTask())


def test_a_run_at_a_url_resumes_on_another_machine_as_the_uninterrupted_run(tmp_path, s3, capsys):
    url = f"s3://{BUCKET}/resumed"
    fit(tmp_path, url, "machine-a", max_steps=6, checkpoint_every=2, keep_checkpoints=2)
    held = objects(s3, "resumed")
    # The newest two complete checkpoints, each with its manifest; the run's files beside them.
    assert [name for name in held if name.startswith("checkpoints/")] == [
        f"checkpoints/step-0000000{step}.{kind}" for step in (4, 6) for kind in ("manifest.json", "pt")
    ]
    assert {"metrics.csv", "summary.json", "model.safetensors"} <= set(held)
    summary = json.loads(s3.cat_file(f"{BUCKET}/resumed/summary.json"))
    assert summary["out_dir"] == url and summary["steps"] == 6
    # `leantrain export` from the URL to the URL: the checkpoint's weights are the run's at its step.
    exported = f"s3://{BUCKET}/exports/step6.safetensors"
    assert cli.main(["export", f"{url}/checkpoints/step-00000006.pt", exported]) == 0
    at_step_6 = weights_at(s3, "resumed/model.safetensors")
    assert all(torch.equal(weights_at(s3, "exports/step6.safetensors")[n], t) for n, t in at_step_6.items())
    # to a folder at the URL: its files go there, and the line says which file holds the weights
    capsys.readouterr()
    assert cli.main(["export", f"{url}/checkpoints/step-00000006.pt", f"s3://{BUCKET}/exports/step6/"]) == 0
    assert capsys.readouterr().out.split() == ["wrote", f"s3://{BUCKET}/exports/step6/model.safetensors"]
    assert objects(s3, "exports/step6") == ["model.safetensors"]
    in_folder = weights_at(s3, "exports/step6/model.safetensors")
    assert all(torch.equal(in_folder[name], tensor) for name, tensor in at_step_6.items())

    # Another staging folder: nothing of the first machine's files, only the URL's.
    again = fit(tmp_path, url, "machine-b", max_steps=9, checkpoint_every=2, resume="auto")
    whole = fit(tmp_path, str(tmp_path / "local"), "unused", max_steps=9, staging_dir=None)
    resumed_weights = weights_at(s3, "resumed/model.safetensors")
    expected = load_file(whole.out_dir / "model.safetensors")
    assert all(torch.equal(resumed_weights[name], expected[name]) for name in expected)
    rows = (tmp_path / "machine-b" / "metrics.csv").read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in rows] == list(range(1, 10))  # the first machine's rows kept
    assert again.summary()["out_dir"] == url


def test_a_second_run_on_the_same_url_is_refused_in_one_line(tmp_path, s3, capsys):
    url = f"s3://{BUCKET}/taken"
    fit(tmp_path, url, "first", max_steps=2, checkpoint_every=2)
    flags = ["--max-steps", "2", "--out", url, "--staging-dir", str(tmp_path / "second"), "--logger", "none"]
    assert cli.main(["fit", *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"leantrain: error: out_dir {url} already holds a run (metrics.csv); continue it with " \
        "--resume auto or choose another out_dir"  # fmt: skip
    # its checkpoints alone (the run's files lost) still say it holds a run
    s3.rm([f"{BUCKET}/taken/{name}" for name in ("metrics.csv", "summary.json")])
    assert cli.main(["fit", *flags]) == 2
    assert "already holds a run (checkpoints); continue it with --resume auto" in capsys.readouterr().err


# The process dies (os._exit: no handler, no clean-up) right after this upload, before the manifest.
DIE_AFTER_UPLOADING = """
import os, sys
from leantrain import remote
put = remote.RemoteFolder.put
def put_then_die(self, local, name):
    put(self, local, name)
    if name.endswith(sys.argv[1]):
        os._exit(137)
remote.RemoteFolder.put = put_then_die
from leantrain.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_process_killed_mid_upload_resumes_from_the_last_complete_checkpoint(tmp_path, s3, capsys):
    url = f"s3://{BUCKET}/killed"
    flags = ["--task", "tests.conftest:RegressionTask", "--global-batch-size", "8", "--micro-batch-size", "4",
             "--logger", "none", "--checkpoint-every", "2", "--out", url, "--max-steps", "8",
             "--staging-dir", str(tmp_path / "stage"), "--resume", "auto"]  # fmt: skip
    killed = subprocess.run(
        [sys.executable, "-c", DIE_AFTER_UPLOADING, "step-00000006.pt", "fit", *flags],
        env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == 137, killed.stderr[-3000:]
    held = objects(s3, "killed")
    assert "checkpoints/step-00000006.pt" in held and "checkpoints/step-00000006.manifest.json" not in held
    capsys.readouterr()
    assert cli.main(["fit", *flags]) == 0  # the next start, here (the same staging folder)
    assert "resumed after step 4" in capsys.readouterr().out
    whole = fit(tmp_path, str(tmp_path / "whole"), "unused", max_steps=8, staging_dir=None)
    weights = weights_at(s3, "killed/model.safetensors")
    expected = load_file(whole.out_dir / "model.safetensors")
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


GARBLED = [b"[1, 2", b"[]", b'{"objects": {"a": "big"}}', b"[" * 5000 + b"]" * 5000]  # the last: too deep


@pytest.mark.parametrize("manifest", GARBLED)
def test_a_garbled_manifest_is_skipped_with_a_warning(tmp_path, s3, capsys, manifest):
    url = f"s3://{BUCKET}/garbled-{len(manifest)}"
    fit(tmp_path, url, "a", max_steps=4, checkpoint_every=2)
    s3.pipe_file(f"{BUCKET}/garbled-{len(manifest)}/checkpoints/step-00000004.manifest.json", manifest)
    capsys.readouterr()
    fit(tmp_path, url, "b", max_steps=5, checkpoint_every=2, resume="auto")
    out = capsys.readouterr().out
    assert "resumed after step 2" in out and "step-00000004.manifest.json is unreadable" in out, out


def test_fsdp_shards_go_to_the_url_from_two_processes_and_come_back(tmp_path, s3, capsys):
    """Each rank writes its shards to the URL; the run resumes from them in place (resume auto, another
    machine) and a branch reads them by the checkpoint's URL (typed with a trailing slash), both as one
    process (gathered: the 2-process resume is tests/distributed/test_fsdp.py's, on the same reading code)."""
    from tests.distributed.tasks import sum_task

    url = f"s3://{BUCKET}/sharded"
    flags = ["fit", "--task", "tests.distributed.tasks:sum_task", "--global-batch-size", "16",
             "--micro-batch-size", "4", "--progress", "plain", "--logger", "none", "--strategy", "fsdp",
             "--checkpoint-every", "2", "--out", url, "--max-steps", "4",
             "--staging-dir", str(tmp_path / "a")]  # fmt: skip
    with capsys.disabled():  # torchrun's error handler needs the real standard error's descriptor
        launch_here("--nproc-per-node", "2", *flags)
    shards = [name for name in objects(s3, "sharded") if name.startswith("checkpoints/step-00000004.dcp/")]
    assert "checkpoints/step-00000004.dcp/.metadata" in shards and len(shards) >= 3  # each rank's file
    settings = dict(global_batch_size=16, micro_batch_size=16, max_steps=6, logger="none")
    one = Trainer(TrainConfig(out_dir=str(tmp_path / "one"), **settings)).fit(sum_task())
    expected = load_file(one.out_dir / "model.safetensors")
    resumed = TrainConfig(out_dir=url, staging_dir=str(tmp_path / "b"), resume="auto", **settings)
    branch = TrainConfig(out_dir=f"s3://{BUCKET}/branch", staging_dir=str(tmp_path / "c"),
                         resume=f"{url}/checkpoints/step-00000004.pt/", **settings)  # fmt: skip
    for config, key in ((resumed, "sharded"), (branch, "branch")):
        capsys.readouterr()
        Trainer(config).fit(sum_task())
        assert "resumed after step 4" in capsys.readouterr().out, key  # same weights if it started afresh
        weights = weights_at(s3, f"{key}/model.safetensors")
        assert all(float((weights[name] - expected[name]).abs().max()) <= 1e-10 for name in expected), key
    # the branch fetched that checkpoint and its shards, not the other checkpoints beside them
    assert not [path for path in (tmp_path / "c").rglob("*step-00000002*")]


def test_a_bucket_that_does_not_exist_is_one_line_and_nothing_trains(tmp_path, s3, capsys):
    url = "s3://no-such-bucket/run"
    flags = ["--max-steps", "2", "--out", url, "--staging-dir", str(tmp_path / "s"), "--logger", "none"]
    code = cli.main(["fit", *flags])
    error = capsys.readouterr().err.strip()
    assert code == cli.EXIT_STORAGE, error
    assert error.startswith("leantrain: error: s3://no-such-bucket/run") and "\n" not in error


def test_a_bucket_that_refuses_writes_is_one_line_saying_what_is_safe(tmp_path, s3, capsys, monkeypatch):
    """Credentials the store does not accept: every write refused (moto then checks signatures)."""
    import moto.settings

    url = f"s3://{BUCKET}/denied"
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    flags = ["--max-steps", "2", "--out", url, "--staging-dir", str(tmp_path / "s"), "--logger", "none"]
    code = cli.main(["fit", *flags])
    error = capsys.readouterr().err.strip()
    assert code == cli.EXIT_STORAGE, error
    assert "refused" in error and "permission" in error and "\n" not in error


def test_a_store_that_never_answers_is_an_error_within_the_bound(monkeypatch):
    """A server that accepts connections and never answers: the call ends after its timeouts."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.extend(listener.accept() for _ in range(8)), daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setattr(remote, "READ_SECONDS", 1)
    monkeypatch.setattr(remote, "ATTEMPTS", 1)
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"^s3://silent/run: could not list \(.*[Tt]imeout"):
        remote.RemoteFolder("s3://silent/run").sizes()
    assert time.monotonic() - started < 30  # botocore's own defaults: 60 s a read, retried 4 times
    listener.close()


def test_a_cache_at_a_url_is_built_once_uploaded_and_read_on_another_machine(
    tmp_path, s3, monkeypatch, capsys
):
    url = f"s3://{BUCKET}/cache"
    settings = dict(global_batch_size=8, micro_batch_size=4, max_steps=4, logger="none")
    reference = Trainer(TrainConfig(out_dir=str(tmp_path / "plain"), **settings)).fit(RegressionTask())
    for machine in ("a", "b"):  # a builds and uploads it; b (another local cache folder) fetches it
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / machine))
        cfg = TrainConfig(out_dir=str(tmp_path / f"run-{machine}"), cache=url, **settings)
        result = Trainer(cfg).fit(RegressionTask())
        weights = result.model.state_dict()
        assert all(torch.equal(weights[n], v) for n, v in reference.model.state_dict().items())
        log = capsys.readouterr().out  # the run's notes
        assert (" built in " in log) == (machine == "a") and (", fetched" in log) == (machine == "b"), log
    held = objects(s3, "cache")
    assert "train/cache.json" in held and any(n.endswith(".npy") for n in held)


def test_a_staging_folder_holding_other_files_is_refused_and_left_alone(tmp_path, s3, capsys, monkeypatch):
    """Staging removes files that never reached the URL: a mistyped --staging-dir must not lose any."""
    monkeypatch.chdir(tmp_path)  # a short path: the line shows a value of up to 80 characters whole
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    flags = ["--max-steps", "2", "--out", f"s3://{BUCKET}/notes", "--staging-dir", "notes"]
    assert cli.main(["fit", *flags, "--logger", "none"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("leantrain: error: invalid staging_dir='notes': holds files that are not a")
    assert [p.name for p in folder.iterdir()] == ["thesis.tex"] and objects(s3, "notes") == []


class RevokeWritesAfter:
    """A callback: from step ``step`` on, moto checks signatures, and the test's credentials fail."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, stats) -> None:
        import moto.settings

        if stats.step >= self.step:
            moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0


def test_a_store_that_starts_refusing_mid_run_ends_it_in_one_line(tmp_path, s3, monkeypatch):
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    config = TrainConfig(global_batch_size=8, micro_batch_size=4, logger="none", max_steps=6,
                         checkpoint_every=2, out_dir=f"s3://{BUCKET}/revoked", async_checkpoint=False,
                         staging_dir=str(tmp_path / "s"))  # fmt: skip
    with pytest.raises(StorageError) as refused:
        Trainer(config, callbacks=[RevokeWritesAfter(3)]).fit(RegressionTask())
    message = str(refused.value)
    assert "\n" not in message and "refused" in message and "step-00000004" in message, message
    assert message.endswith(
        "the checkpoints already written stay where they are: restore access, then --resume auto"
    )
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    assert "checkpoints/step-00000002.manifest.json" in objects(s3, "revoked")


def test_gcs_requests_are_bounded_per_read_not_in_total():
    """gcsfs hands its requests_timeout to aiohttp: a number there is a total per request, which a large
    upload part on a slow link outlasts; the bound must be on connecting and on each wait for bytes."""
    options = remote._bounded_options("gs")["requests_timeout"]
    assert options.total is None and options.sock_read == remote.READ_SECONDS
    assert options.sock_connect == remote.CONNECT_SECONDS


def test_a_run_at_a_url_is_staged_in_one_cache_folder_per_url(tmp_path, monkeypatch):
    """Without --staging-dir: under $XDG_CACHE_HOME/leantrain/staging, the same folder for the same URL
    (a run resumed on this machine finds its files), another for another URL."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    staging = default_staging("s3://runs/exp-1")
    assert staging.parent == tmp_path / "leantrain" / "staging" and staging.name.startswith("exp-1-")
    assert default_staging("s3://runs/exp-1/") == staging
    assert default_staging("s3://other/exp-1") != staging


def test_a_urls_local_copy_is_named_after_its_last_part_under_the_users_cache(tmp_path, monkeypatch):
    from leantrain.remote import local_copy_folder

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    copy = local_copy_folder("s3://bucket/Team Data@v2//", "caches")
    assert copy.parent == tmp_path / ".cache" / "leantrain" / "caches"
    name, _, digest = copy.name.rpartition("-")
    assert (
        name == "Team-Data-v2" and len(digest) == 12 and int(digest, 16) >= 0
    )  # letters of either case kept
    assert local_copy_folder("s3://bucket/Team Data@v2", "caches") == copy  # the same URL
    assert local_copy_folder("s3://other/Team Data@v2", "caches").name != copy.name
    assert local_copy_folder("///", "caches").name.startswith("root-")
    assert local_copy_folder("s3://bucket/runX/", "caches").name.startswith("runX-")  # only slashes go


def test_the_checkpoints_of_a_run_at_a_url_are_its_complete_ones_oldest_first(tmp_path):
    """What the line after a refused write names as the last good checkpoint: the newest whose manifest
    is at the URL, as the URL says it."""
    url = "s3://runs/exp"
    mirror = SimpleNamespace(staging=tmp_path, complete_steps=lambda: [2, 6],
                             remote=SimpleNamespace(url_of=lambda name: f"{url}/{name}"))  # fmt: skip
    checkpoints = MirroredCheckpoints(mirror, keep=2)
    saved = checkpoints.files()
    assert saved == [tmp_path / "checkpoints" / f"step-0000000{step}.pt" for step in (2, 6)]
    assert checkpoints.describe(saved[-1]) == f"{url}/checkpoints/step-00000006.pt"


def test_an_export_that_writes_a_folder_to_a_url_uploads_its_files_and_names_the_folder(tmp_path, s3):
    """`--format transformers` writes a folder: every file of it goes to the URL, which the line names."""

    def write_folder(source: Path, out: Path) -> Path:
        (out / "config.json").write_text("{}")
        (out / "weights").mkdir()
        (out / "weights" / "model.safetensors").write_bytes(b"weights")
        return out

    url = f"s3://{BUCKET}/exports/folder"
    assert exported(str(tmp_path / "step-00000001.pt"), url, write_folder) == url
    assert objects(s3, "exports/folder") == ["config.json", "weights/model.safetensors"]
