"""Kills in forked ranks and in a new process, as a page arms them; what each left behind.

Every block arms one kill, launches two ranks (or one new process) that get there, and
prints what came back: the kill's records, the launcher's error, the file on disk, and
that torch is what it was after the block.
"""

import json
import logging
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from page_tools import faults, results
from rank_launcher import RankFailedError, run_on_ranks
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.optim.optimizer import _global_optimizer_pre_hooks

directory = tempfile.mkdtemp()
before = {
    "create_stream": FileSystem.create_stream,
    "stage": StateDictStager.stage,
    "offload": StateDictStager._offload_tensor,
    "hooks": len(_global_optimizer_pre_hooks),
    "PYTHONPATH": os.environ.get("PYTHONPATH"),
    "level": logging.getLogger("torch.multiprocessing.spawn").level,
}


def restored():
    return (
        before
        == {
            "create_stream": FileSystem.create_stream,
            "stage": StateDictStager.stage,
            "offload": StateDictStager._offload_tensor,
            "hooks": len(_global_optimizer_pre_hooks),
            "PYTHONPATH": os.environ.get("PYTHONPATH"),
            "level": logging.getLogger("torch.multiprocessing.spawn").level,
        }
        and faults.PLAN_ENV not in os.environ
    )


def write_a_file(name):
    path = os.path.join(directory, f"{name}-{dist.get_rank()}.distcp")
    with FileSystem().create_stream(path, "wb") as stream:
        for _ in range(10):
            stream.write(b"x" * 1000)


def stage_twice():
    stager = StateDictStager()
    for _ in range(2):
        stager.stage({f"t{i}": torch.full((4,), float(i)) for i in range(5)})


def take_five_steps():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()


def launch(fn, *args):
    try:
        run_on_ranks(fn, *args)
    except RankFailedError as err:
        return err
    return None


def report(what, kill, failure):
    first = str(failure).splitlines()[0] if failure else "none"
    records = [{k: r[k] for k in sorted(r) if k not in ("pid", "path")} for r in kill.fired]
    print(f"{what}: fired {json.dumps(records)}")
    print(f"{what}: failure {first}")
    print(f"{what}: restored {restored()}")


with faults.kill_in_write(after_bytes=2500, path=r"write-\d\.distcp$") as kill:
    failure = launch(write_a_file, "write")
report("write", kill, failure)
print(
    "write: file sizes",
    {n: os.path.getsize(os.path.join(directory, n)) for n in sorted(os.listdir(directory))},
)
faults.crashed_as_planned("write-claim", kill, failure, directory)

with faults.kill_in_staging(staging=2, after_tensors=3, rank=0) as kill:
    failure = launch(stage_twice)
report("staging", kill, failure)

marker = os.path.join(directory, "marker")
open(marker, "w").close()
with faults.kill_at_step(4, once_exists=marker) as kill:
    failure = launch(take_five_steps)
report("step", kill, failure)
faults.crashed_as_planned("step-claim", kill, failure, directory)

with faults.kill_in_write(after_bytes=10, path=r"no-such-file$") as kill:
    failure = launch(write_a_file, "unmatched")
report("unfired", kill, failure)
try:
    faults.crashed_as_planned("unfired-claim", kill, failure, directory)
except results.ClaimFailed as err:
    print("unfired: claim failed:", "did not fire" in str(err))

child = (
    "import os; from torch.distributed.checkpoint.filesystem import FileSystem\n"
    f"with FileSystem().create_stream(os.path.join({directory!r}, 'child.distcp'), 'wb') as s:\n"
    "    s.write(b'y' * 5000)\n"
    "print('the child wrote it all')\n"
)
with faults.kill_in_write(after_bytes=1000, path=r"child\d\.distcp$", new_processes=True) as kill:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", TORCHELASTIC_RESTART_COUNT="0")
    plain = dict(env, TORCHELASTIC_RESTART_COUNT="1")  # another attempt: not armed there
    killed = subprocess.run([sys.executable, "-c", child.replace("child.", "child0.")], env=env)
    spared = subprocess.run([sys.executable, "-c", child.replace("child.", "child1.")], env=plain)
report("new process", kill, None)
print("new process: exit", killed.returncode, "other attempt exit", spared.returncode)
print(
    "new process: sizes",
    os.path.getsize(os.path.join(directory, "child0.distcp")),
    os.path.getsize(os.path.join(directory, "child1.distcp")),
)

import shutil  # noqa: E402

shutil.rmtree(directory)
