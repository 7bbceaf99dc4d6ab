"""How often do workers that ``torchrun --max-restarts`` starts again form their group?

``start(restarts)`` runs two minimal jobs under ``torchrun --standalone --nproc-per-node=2
--max-restarts=<restarts>`` in the background (no thread in the page's process: two child
processes), and ``finish(probe)`` waits for them and counts. In every attempt but the last,
rank 1 is killed with SIGKILL once the group has formed and passed a barrier, so that
every restart has to form the group again. One job creates it with a plain
``dist.init_process_group("gloo")`` (``env://``: the agent's store, which keeps the keys of
every earlier attempt), the other on that store under the prefix ``attempt-<N>/``, as the
recipe's ``init_process_group_for_this_attempt()`` does. Whether a plain restart finds a
stale address is a race: the counts are what one run measured.

This file is also the jobs' worker: ``python restarts.py plain|prefixed`` under torchrun.
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
import time

MODES = ("plain", "prefixed")
# A restart that finds a stale address fails at gloo's connect timeout: short, so that the
# probe waits little, but long enough for two workers to start on a loaded machine.
CONNECT_TIMEOUT_S = 5
FORMED = re.compile(r"probe attempt (\d+): the group formed")


@dataclasses.dataclass
class Probe:
    restarts: int
    jobs: dict  # mode -> (Popen, log path, start time)
    directory: str


def start(restarts: int = 3) -> Probe:
    """Start both jobs; they run while the page goes on."""
    directory = tempfile.mkdtemp(prefix="page-tools-restarts-")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", f"--max-restarts={restarts}", os.path.abspath(__file__)]
    jobs = {}
    for mode in MODES:
        log = os.path.join(directory, f"{mode}.log")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)  # the worker needs torch only
        with open(log, "w") as out:
            job = subprocess.Popen(
                [*command, mode], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        jobs[mode] = (job, log, time.monotonic())
    return Probe(restarts, jobs, directory)


def finish(probe: Probe, timeout_s: float = 150.0) -> dict:
    """Wait for both jobs; per mode: restarts that formed the group, gloo's refused
    connections, the job's exit status and seconds."""
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
            "exit": job.returncode,
            "seconds": round(time.monotonic() - started, 1),
        }
    for _, log, _ in probe.jobs.values():
        os.remove(log)
    os.rmdir(probe.directory)
    return counts


def _worker(mode: str) -> None:
    """One worker of a probe job (under torchrun)."""
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    last = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=CONNECT_TIMEOUT_S)
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
    if rank == 0:
        print(f"probe attempt {attempt}: the group formed", flush=True)
    if attempt < last and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
