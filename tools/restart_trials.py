"""``make restart-trials``: does a group that ``torchrun --max-restarts`` starts again form?

Not part of ``make test`` (minutes). Each job is real ``torchrun``: one agent with two gloo
workers (``--nodes 1``, ``--standalone``), or two agents on this machine, one gloo worker
each, meeting at a c10d rendezvous on a loopback port (``--nodes 2``: two "nodes"). In each
formed group rank 0 decides, while kills remain, that this attempt loses a worker: on two
nodes, node 1's worker kills itself (SIGKILL) while node 0's worker stays alive and out of
any collective (``--survivor busy``: sleeping, as a rank in a long step is; ``frozen``:
SIGSTOP, as a rank stuck in an NCCL collective is), so that node 0's agent sees healthy
workers and restarts them without counting a retry (``elastic/agent/server/api.py``,
"membership changes do not count as retries"). On one node the second worker is killed.

Ways of creating the group (``--ways``):

* ``attempt-prefix``: the agent's store (``is_master=False``) under the prefix
  ``attempt-$TORCHELASTIC_RESTART_COUNT``;
* ``plain-shared``: ``dist.init_process_group("gloo")`` (``env://``) on the agent's shared
  store, which keeps every earlier attempt's keys;
* ``plain-own-store``: the same plain call, torchrun started with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: each rendezvous round publishes a fresh port,
  and worker rank 0 serves a new store on it.

Every job has a deadline (``--job-timeout``); the group's own timeout is ``--pg-timeout``.
It prints one line per job and a table per way and number of nodes: jobs, jobs that
finished (exit 0 with every planned kill done), restarts planned, restarts the group formed
again after, restarts the agents used (the highest ``TORCHELASTIC_RESTART_COUNT`` seen, so
extra ones show), store timeouts, gloo connect failures, and jobs that hit the deadline. It
writes every job's logs and ``summary.json`` under ``_build/restart-trials/<--tag>``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes_source"))  # the one free-port picker
from page_tools.ports import free_port  # noqa: E402

OUT = ROOT / "_build" / "restart-trials"
WAYS = ("attempt-prefix", "plain-shared", "plain-own-store")
BUSY_S = 90  # a survivor that nobody stops within this long exits 3


def worker(way: str, trial_dir: str, kills: int, survivor: str, pg_timeout: float) -> None:
    """One worker of a trial job, started by torchrun."""
    import torch
    import torch.distributed as dist

    node, local_rank = int(os.environ["TRIAL_NODE"]), int(os.environ["LOCAL_RANK"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    count = os.environ["TORCHELASTIC_RESTART_COUNT"]
    tag = f"node {node} rank {rank} restart-count {count}"
    print(f"trial: start {tag} port {os.environ['MASTER_PORT']}", flush=True)
    timeout = datetime.timedelta(seconds=pg_timeout)
    if way == "attempt-prefix":
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"attempt-{count}", store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)  # fmt: skip
    else:
        dist.init_process_group("gloo", timeout=timeout)
    dist.barrier()
    kill = torch.zeros(1)
    if rank == 0:
        done = len([n for n in os.listdir(trial_dir) if n.startswith("kill-")])
        kill[0] = done < kills
        print(f"trial: formed {tag} kills-done {done}", flush=True)
    dist.broadcast(kill, src=0)
    if kill.item():
        victim = node == 1 if os.environ["TRIAL_NODES"] == "2" else local_rank == 1
        if victim:
            Path(trial_dir, f"kill-{uuid.uuid4().hex}").touch()
            print(f"trial: killing {tag}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if survivor == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(BUSY_S)
        print(f"trial: {tag} was never stopped", flush=True)
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()
    print(f"trial: finished {tag}", flush=True)


def agent_commands(nodes: int, restarts: int, args: list[str]) -> list[list[str]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--max-restarts={restarts}",
                "--monitor-interval=0.1"]  # fmt: skip
    script = [__file__, "--worker", *args]
    if nodes == 1:
        return [torchrun + ["--standalone", "--nproc-per-node=2"] + script]
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    rdzv = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]  # fmt: skip
    return [torchrun + rdzv + [f"--rdzv-conf=is_host={int(node == 0)}"] + script
            for node in range(2)]  # fmt: skip


def run_job(way: str, nodes: int, index: int, opts: argparse.Namespace, out: Path) -> dict:
    trial_dir = out / f"{way}-{nodes}node-{index}"
    trial_dir.mkdir(parents=True, exist_ok=True)
    for stale in trial_dir.iterdir():
        stale.unlink()
    args = [way, str(trial_dir), str(opts.kills), opts.survivor, str(opts.pg_timeout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRIAL_NODES=str(nodes))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if way == "plain-own-store":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agents, logs = [], []
    start = time.monotonic()
    for node, command in enumerate(agent_commands(nodes, opts.restarts, args)):
        log = open(trial_dir / f"agent{node}.log", "w")  # noqa: SIM115
        logs.append(log)
        node_env = dict(env, TRIAL_NODE=str(node))
        agent = subprocess.Popen(
            command, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        agents.append(agent)
    deadline, hit_deadline = start + opts.job_timeout, False
    for agent in agents:
        try:
            agent.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            hit_deadline = True
    for agent in agents:  # every agent's whole session: workers included, frozen ones too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    for log in logs:
        log.close()
    output = "".join((trial_dir / f"agent{n}.log").read_text() for n in range(len(agents)))
    kills = len([n for n in os.listdir(trial_dir) if n.startswith("kill-")])
    counts = [int(c) for c in re.findall(r"trial: start .* restart-count (\d+)", output)]
    exits = [agent.returncode for agent in agents]
    return {
        "way": way,
        "nodes": nodes,
        "job": index,
        "finished": not hit_deadline and exits == [0] * len(agents) and kills == opts.kills,
        "exits": exits,
        "kills": kills,
        "formed_after_kill": len(re.findall(r"trial: formed .* kills-done [1-9]", output)),
        "restarts_used": max(counts, default=0),
        "store_timeouts": len(re.findall(r"wait timeout|Timed out|DistStoreError", output)),
        "connect_failed": output.count("connectFullMesh failed"),
        "deadline": hit_deadline,
        "seconds": round(time.monotonic() - start, 1),
    }


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        way, trial_dir, kills, survivor, pg_timeout = sys.argv[2:7]
        worker(way, trial_dir, int(kills), survivor, float(pg_timeout))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--nodes", default="1,2", help="1, 2 or 1,2")
    parser.add_argument("--jobs", type=int, default=5, help="jobs per way and number of nodes")
    parser.add_argument("--kills", type=int, default=2, help="workers killed per job")
    parser.add_argument("--restarts", type=int, default=3, help="torchrun --max-restarts")
    parser.add_argument("--survivor", choices=("busy", "frozen"), default="busy")
    parser.add_argument("--pg-timeout", type=float, default=10.0)
    parser.add_argument("--job-timeout", type=float, default=150.0)
    parser.add_argument("--tag", default="latest", help="folder under _build/restart-trials")
    opts = parser.parse_args()
    out = OUT / opts.tag
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for nodes in (int(n) for n in opts.nodes.split(",")):
        for way in opts.ways.split(","):
            for index in range(opts.jobs):
                row = run_job(way, nodes, index, opts, out)
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "summary.json").write_text(json.dumps({"options": vars(opts), "jobs": rows}, indent=1))
    print(f"\nsurvivor {opts.survivor}, --max-restarts={opts.restarts}, {opts.kills} kills a job, "
          f"group timeout {opts.pg_timeout:g} s, job deadline {opts.job_timeout:g} s")  # fmt: skip
    head = ("way", "nodes", "jobs", "finished", "kills", "formed again", "restarts used",
            "store timeouts", "connect failed", "deadline")  # fmt: skip
    print(" | ".join(head))
    failed = False
    for nodes in sorted({r["nodes"] for r in rows}):
        for way in opts.ways.split(","):
            mine = [r for r in rows if r["way"] == way and r["nodes"] == nodes]
            total = {k: sum(r[k] for r in mine) for k in
                     ("finished", "kills", "formed_after_kill", "restarts_used",
                      "store_timeouts", "connect_failed", "deadline")}  # fmt: skip
            failed |= total["finished"] < len(mine)
            print(f"{way} | {nodes} | {len(mine)} | " + " | ".join(str(v) for v in total.values()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
