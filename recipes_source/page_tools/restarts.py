"""How often do workers that ``torchrun --max-restarts`` starts again form their group?

``start(restarts)`` runs three minimal jobs in the background, each under torch's elastic
agent as ``torchrun --max-restarts=<restarts>`` runs it, and ``finish(probe)`` waits for them
and counts. In every formed group, while kills remain, rank 0 decides that this attempt
loses a worker: the last agent's last worker kills itself with SIGKILL, the others stay out of
any collective (busy, as a rank in a long step is, or one stuck in an NCCL collective), so
that every restart has to form the group again. The jobs:

* ``plain``: one agent, two workers, ``dist.init_process_group("gloo")`` (``env://``) on
  the agent's shared store, which keeps the keys of every earlier attempt;
* ``own-store``: the same, the agent started with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
  every rendezvous round publishes a fresh ``MASTER_PORT``, where worker rank 0 serves a new
  store;
* ``own-store-2-agents``: the same variable, two agents (two "nodes" on this machine, one
  worker each) meeting at a c10d rendezvous on a loopback port. Node 1's worker is killed;
  node 0's agent sees its worker healthy and restarts it without counting a retry, so the
  agents' ``TORCHELASTIC_RESTART_COUNT`` differ from the first restart on (``finish``
  reports each agent's highest count).

Whether a ``plain`` restart finds a stale address is a race: the counts are what one run
measured. ``tools/restart_trials.py`` runs the same comparison, with real ``torchrun``
processes and many more restarts, outside the build.

The agents start their workers from a fork server that has imported torch once, instead of
a new Python per worker and attempt as ``torchrun script.py`` does: a restart takes a
fraction of a second. The page's process runs no thread for it: each agent is a child
process.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from page_tools.ports import free_port

# mode -> number of agents
MODES = {"plain": 1, "own-store": 1, "own-store-2-agents": 2}
# A restart that finds a stale address fails at gloo's connect timeout: short, so that the
# probe waits little, but long enough for two workers to start on a loaded machine.
CONNECT_TIMEOUT_S = 5
# Now and then both workers of a plain restart wait for each other's connection far longer
# than that (gloo's own connect timeout): the probe ends such an attempt, and counts it as
# hung, after this many seconds. A busy survivor that no agent stops within it also counts.
HANG_S = 15
FORMED = re.compile(r"probe: the group formed after (\d+) kills")


@dataclasses.dataclass
class Probe:
    restarts: int
    jobs: dict  # mode -> ([Popen per agent], [log path per agent], start time)
    directory: str


def start(restarts: int = 3) -> Probe:
    """Start the jobs; they run while the page goes on."""
    directory = tempfile.mkdtemp(prefix="page-tools-restarts-")
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))
    jobs = {}
    for mode, agents in MODES.items():
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        if mode != "plain":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        kills = os.path.join(directory, f"{mode}.kills")
        os.mkdir(kills)
        endpoint, processes, logs = f"127.0.0.1:{free_port()}", [], []
        for node in range(agents):
            log = os.path.join(directory, f"{mode}.{node}.log")
            args = (restarts, agents, node, endpoint, kills)
            code = f"from page_tools import restarts; restarts._launch(*{args!r})"
            with open(log, "w") as out:
                processes.append(subprocess.Popen(
                    [sys.executable, "-c", code], env=env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))  # fmt: skip
            logs.append(log)
        jobs[mode] = (processes, logs, time.monotonic())
    return Probe(restarts, jobs, directory)


def _launch(restarts: int, agents: int, node: int, endpoint: str, kills: str) -> None:
    """One agent of a probe job: ``2 // agents`` workers, ``restarts`` restarts."""
    import torch.multiprocessing as mp
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    mp.set_forkserver_preload(["torch.distributed", __name__])
    config = LaunchConfig(
        min_nodes=agents,
        max_nodes=agents,
        nproc_per_node=2 // agents,
        run_id=os.path.basename(kills),
        rdzv_backend="c10d",  # what torchrun --standalone and --rdzv-backend=c10d use
        rdzv_endpoint=endpoint if agents > 1 else "localhost:0",
        rdzv_configs={"is_host": node == 0},
        max_restarts=restarts,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    try:
        elastic_launch(config, _worker)(restarts, kills, node)
    except ChildFailedError:
        sys.exit(1)  # as torchrun exits when the last attempt failed too


def finish(probe: Probe, timeout_s: float = 150.0) -> dict:
    """Wait for the jobs; per mode: agents, restarts that formed the group, gloo's failed
    connects, attempts ended after ``HANG_S`` seconds, the agents' exits and seconds."""
    counts = {}
    for mode, (processes, logs, started) in probe.jobs.items():
        for process in processes:
            try:
                process.wait(timeout=max(timeout_s - (time.monotonic() - started), 1))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        output = ""
        for log in logs:
            with open(log) as out:
                output += out.read()
        formed = [int(kills) for kills in FORMED.findall(output)]
        seen = re.findall(r"probe: agent (\d+) restart count (\d+)", output)
        counts[mode] = {
            "agents": len(processes),
            "restarts": probe.restarts,
            "formed_after_restart": sum(kills >= 1 for kills in formed),
            "connect_failed": output.count("Gloo connectFullMesh failed"),
            "hung": len(re.findall(r"probe: no group after|probe: not stopped after", output)),
            "exit": max(abs(process.returncode) for process in processes),
            # per agent, the highest TORCHELASTIC_RESTART_COUNT its workers were given
            "restart_counts": [
                max((int(c) for n, c in seen if int(n) == node), default=None)
                for node in range(len(processes))
            ],
            "seconds": round(time.monotonic() - started, 1),
        }
    for _, logs, _ in probe.jobs.values():
        for log in logs:
            os.remove(log)
    for mode in probe.jobs:
        kills = os.path.join(probe.directory, f"{mode}.kills")
        for name in os.listdir(kills) if os.path.isdir(kills) else ():
            os.remove(os.path.join(kills, name))
        if os.path.isdir(kills):
            os.rmdir(kills)
    os.rmdir(probe.directory)
    return counts


def _hung(what: str) -> None:
    print(f"probe: {what} after {HANG_S} s", flush=True)
    os._exit(1)


def _worker(restarts: int, kills: str, node: int) -> None:
    """One worker of a probe job, forked by the elastic agent's fork server."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"probe: agent {node} restart count {count}", flush=True)
    watchdog = threading.Timer(HANG_S, _hung, ("no group",))
    watchdog.daemon = True
    watchdog.start()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
    dist.barrier()
    watchdog.cancel()
    kill = torch.zeros(1)
    if rank == 0:
        done = len(os.listdir(kills))
        print(f"probe: the group formed after {done} kills", flush=True)
        kill[0] = done < restarts
    dist.broadcast(kill, src=0)
    if kill.item():
        last_agent = node == int(os.environ["GROUP_WORLD_SIZE"]) - 1
        if last_agent and os.environ["LOCAL_RANK"] == str(int(os.environ["LOCAL_WORLD_SIZE"]) - 1):
            open(os.path.join(kills, f"kill-{time.monotonic_ns()}"), "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(HANG_S)  # busy: out of any collective until an agent stops this worker
        _hung("not stopped")
    dist.barrier()
    dist.destroy_process_group()
