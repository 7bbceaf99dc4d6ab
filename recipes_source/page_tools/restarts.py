"""How often do workers that ``torchrun --max-restarts`` starts again form their group?

``start(restarts)`` runs two minimal jobs in the background, each under torch's elastic
agent (what ``torchrun --standalone --nproc-per-node=2 --max-restarts=<restarts>`` runs),
and ``finish(probe)`` waits for them and counts. In every attempt but the last, rank 1 is
killed with SIGKILL once the group has formed and passed a barrier, so that every restart
has to form the group again. One job creates it with a plain
``dist.init_process_group("gloo")`` (``env://``: the agent's store, which keeps the keys of
every earlier attempt), the other on that store under the prefix ``attempt-<N>/``, as the
recipe's ``init_process_group_for_this_attempt()`` does. Whether a plain restart finds a
stale address is a race: the counts are what one run measured.

The agent starts the workers from a fork server that has imported torch once, instead of
a new Python per worker and attempt as ``torchrun script.py`` does: a restart takes a
fraction of a second, and the probe mostly waits for the plain job's failed connects. The
page's process runs no thread for it: each job is a child process.
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

MODES = ("plain", "prefixed")
# A restart that finds a stale address fails at gloo's connect timeout: short, so that the
# probe waits little, but long enough for two workers to start on a loaded machine.
CONNECT_TIMEOUT_S = 5
# Now and then both workers of a plain restart wait for each other's connection far longer
# than that (gloo's own connect timeout): the probe ends such an attempt, and counts it as
# hung, after this many seconds.
HANG_S = 15
FORMED = re.compile(r"probe attempt (\d+): the group formed")


@dataclasses.dataclass
class Probe:
    restarts: int
    jobs: dict  # mode -> (Popen, log path, start time)
    directory: str


def start(restarts: int = 3) -> Probe:
    """Start both jobs; they run while the page goes on."""
    directory = tempfile.mkdtemp(prefix="page-tools-restarts-")
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    jobs = {}
    for mode in MODES:
        log = os.path.join(directory, f"{mode}.log")
        code = f"from page_tools import restarts; restarts._launch({mode!r}, {restarts})"
        path = os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        with open(log, "w") as out:
            job = subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        jobs[mode] = (job, log, time.monotonic())
    return Probe(restarts, jobs, directory)


def _launch(mode: str, restarts: int) -> None:
    """One probe job: the elastic agent with two workers and ``restarts`` restarts."""
    import uuid

    import torch.multiprocessing as mp
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    mp.set_forkserver_preload(["torch.distributed", __name__])
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",  # torchrun --standalone
        rdzv_endpoint="localhost:0",
        max_restarts=restarts,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    try:
        elastic_launch(config, _worker)(mode)
    except ChildFailedError:
        sys.exit(1)  # as torchrun exits when the last attempt failed too


def finish(probe: Probe, timeout_s: float = 150.0) -> dict:
    """Wait for both jobs; per mode: restarts that formed the group, gloo's failed connects,
    attempts ended after ``HANG_S`` seconds without a group, the job's exit and seconds."""
    counts = {}
    for mode, (job, log, started) in probe.jobs.items():
        try:
            job.wait(timeout=max(timeout_s - (time.monotonic() - started), 1))
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        with open(log) as out:
            output = out.read()
        formed = [int(attempt) for attempt in FORMED.findall(output)]
        counts[mode] = {
            "restarts": probe.restarts,
            "formed_after_restart": sum(attempt >= 1 for attempt in formed),
            "connect_failed": output.count("Gloo connectFullMesh failed"),
            "hung": len(re.findall(r"probe attempt \d+: no group after", output)),
            "exit": job.returncode,
            "seconds": round(time.monotonic() - started, 1),
        }
    for _, log, _ in probe.jobs.values():
        os.remove(log)
    os.rmdir(probe.directory)
    return counts


def _hung(attempt: int) -> None:
    print(f"probe attempt {attempt}: no group after {HANG_S} s", flush=True)
    os._exit(1)


def _worker(mode: str) -> None:
    """One worker of a probe job, forked by the elastic agent's fork server."""
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    last = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=CONNECT_TIMEOUT_S)
    watchdog = threading.Timer(HANG_S, _hung, (attempt,))
    watchdog.daemon = True
    watchdog.start()
    if mode == "plain":
        dist.init_process_group("gloo", timeout=timeout)
    else:
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"attempt-{attempt}", store)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    dist.barrier()
    watchdog.cancel()
    if rank == 0:
        print(f"probe attempt {attempt}: the group formed", flush=True)
    if attempt < last and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()
