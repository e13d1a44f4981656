from __future__ import annotations

import pytest

from leantrain.errors import LeantrainError
from leantrain.launch.torchrun import LaunchOptions, torchrun_arguments


def test_one_node_uses_a_standalone_rendezvous():
    args = torchrun_arguments(LaunchOptions(nproc_per_node=2), ["--max-steps", "5"])
    assert args[:5] == ["--nproc-per-node", "2", "--max-restarts", "0", "--standalone"]
    assert args[-5:] == ["--module", "leantrain", "fit", "--max-steps", "5"]


def test_node_rank_selects_a_static_rendezvous_on_node_0():
    options = LaunchOptions(nproc_per_node=4, nnodes="2", node_rank=1, rdzv_endpoint="10.1.2.3:29400")
    args = torchrun_arguments(options, [])
    joined = " ".join(args)
    assert "--nnodes 2 --node-rank 1 --master-addr 10.1.2.3 --master-port 29400" in joined
    assert "--standalone" not in args


def test_without_node_rank_an_elastic_c10d_rendezvous():
    options = LaunchOptions(nnodes="2:4", rdzv_endpoint="head:29500", rdzv_id="job7", max_restarts=3)
    joined = " ".join(torchrun_arguments(options, []))
    assert "--nnodes 2:4 --rdzv-backend c10d --rdzv-endpoint head:29500 --rdzv-id job7" in joined
    assert "--max-restarts 3" in joined


def test_sigusr1_is_forwarded_to_the_workers_when_torchrun_can():
    args = torchrun_arguments(LaunchOptions(), [])
    if "--signals-to-handle" in args:
        assert "SIGUSR1" in args[args.index("--signals-to-handle") + 1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (LaunchOptions(nproc_per_node=0), "nproc_per_node=0: must be 1 or more"),
        (LaunchOptions(max_restarts=-1), "max_restarts=-1: must be 0 or more"),
        (LaunchOptions(nnodes="2"), "nnodes=2 needs --rdzv-endpoint"),
        (LaunchOptions(nnodes="2", rdzv_endpoint="nohost"), "invalid rdzv_endpoint='nohost'"),
    ],
)
def test_bad_launch_options(options, message):
    with pytest.raises(LeantrainError, match=message):
        torchrun_arguments(options, [])
