"""A one-node SLURM cluster on this machine, for the tests of `leantrain slurm` against SLURM itself.

Needs root and Debian's ``slurmctld slurmd slurm-client munge`` (``make test-slurm`` installs them).
The configuration lives in its own folder (``SLURM_CONF`` points the commands at it), the node is
this host with its CPUs, and one partition holds it:

    python tests/slurm/local_cluster.py     # start it (idempotent); prints the SLURM_CONF to export

Why each setting: ``proctrack/linuxproc`` and ``task/none`` need no cgroups (containers often
lack them), ``ReturnToService=2`` brings the node back after a restart of the daemons,
``select/cons_tres`` with ``CR_Core`` lets several jobs share the node's cores, and job
accounting is off (no database).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

HOME = Path("/tmp/leantrain-slurm")
CONF = HOME / "slurm.conf"
DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol")


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "starting SLURM's daemons needs root"
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): run `make test-slurm`"
    return None


def environment() -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(CONF)}


def node_state() -> str:
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=environment())
    return done.stdout.strip() if done.returncode == 0 else ""


def config_text() -> str:
    host = socket.gethostname().split(".")[0]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    return "\n".join(
        [
            "ClusterName=local",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            f"StateSaveLocation={HOME / 'state'}",
            f"SlurmdSpoolDir={HOME / 'spool'}",
            f"SlurmctldPidFile={HOME / 'slurmctld.pid'}",
            f"SlurmdPidFile={HOME / 'slurmd.pid'}",
            f"SlurmctldLogFile={HOME / 'slurmctld.log'}",
            f"SlurmdLogFile={HOME / 'slurmd.log'}",
            f"NodeName={host} CPUs={os.cpu_count()} RealMemory={int(memory * 0.8)} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def start_munge() -> None:
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.write_bytes(os.urandom(1024))
    munge = pwd.getpwnam("munge")
    for path in (key, Path("/etc/munge"), Path("/var/lib/munge"), Path("/var/log/munge"), Path("/run/munge")):
        path.mkdir(parents=True, exist_ok=True) if path != key else None
        os.chown(path, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)
    subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True)


def start(timeout: float = 60) -> None:
    """Start munge, slurmctld and slurmd (unless running) and wait for the node to be idle."""
    if node_state() in ("idle", "mixed", "allocated"):
        return
    for folder in ("state", "spool"):
        (HOME / folder).mkdir(parents=True, exist_ok=True)
    CONF.write_text(config_text())
    start_munge()
    env = environment()
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run(["pkill", "-x", daemon], capture_output=True)
    time.sleep(0.5)
    subprocess.run(["slurmctld", "-f", str(CONF)], check=True, env=env)
    subprocess.run(["slurmd", "-f", str(CONF)], check=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = node_state()
        if state == "idle":
            return
        if state.startswith("down") or state.startswith("drain"):
            host = socket.gethostname().split(".")[0]
            subprocess.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"], env=env)
        time.sleep(1)
    raise RuntimeError(f"the SLURM node did not become idle (state {node_state()!r}); see {HOME}/*.log")


if __name__ == "__main__":
    reason = missing()
    if reason is not None:
        sys.exit(f"cannot start SLURM: {reason}")
    start()
    print(f"export SLURM_CONF={CONF}")
