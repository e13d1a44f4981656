from __future__ import annotations

import pytest

from leantrain.cluster import ClusterEnv, detect, first_host
from leantrain.errors import LeantrainError


def test_no_variables_is_a_single_process():
    env = detect({})
    assert env == ClusterEnv("single") and not env.distributed and env.is_main


def test_torchrun_variables():
    env = detect(
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    )  # fmt: skip
    assert env == ClusterEnv(
        "torchrun",
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        master_addr="10.0.0.5",
        master_port=1234,
    )
    assert env.distributed and not env.is_main


def test_slurm_variables_with_the_master_from_the_node_list():
    env = detect(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[07-09,12]",
        }
    )
    assert (env.source, env.rank, env.local_rank, env.world_size) == ("slurm", 5, 1, 8)
    assert env.master_addr == "gpu07" and env.master_port == 29500
    assert env.local_world_size == 1  # neither tasks-per-node variable is set


@pytest.mark.parametrize(
    ("variables", "local"),
    [({"SLURM_NTASKS_PER_NODE": "4"}, 4), ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, 2)],
)
def test_slurm_tasks_per_node(variables, local):
    env = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", **variables})
    assert env.local_world_size == local


def test_torchrun_takes_precedence_over_slurm():
    # srun starts torchrun on each node; torchrun's variables describe its workers.
    env = detect(
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2"}
    )
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("torchrun", 6, 8, 2)


@pytest.mark.parametrize(
    ("nodes", "first"),
    [
        ("node1", "node1"), ("node1,node2", "node1"), ("gpu[07-09,12],cpu1", "gpu07"),
        ("gpu[12,07-09]", "gpu12"), ("a-b[3]", "a-b3"),
    ],
)  # fmt: skip
def test_first_host_of_a_node_list(nodes, first):
    assert first_host(nodes) == first


def test_a_node_list_with_no_host_is_a_one_line_error():
    with pytest.raises(LeantrainError, match=r"^cannot read the SLURM node list ',node2'$"):
        first_host(",node2")


def test_a_malformed_variable_is_a_clear_error():
    with pytest.raises(LeantrainError, match="environment variable RANK='x' is not an integer"):
        detect({"RANK": "x", "WORLD_SIZE": "2"})
