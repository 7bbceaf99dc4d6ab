"""Each rank starts a process with the spawn method, as DCP's checkpoint process is started.

A spawned child imports the parent's main script unless the launcher says there is none to
import: then this file's top level would run again in every child.
"""

import multiprocessing

import torch.distributed as dist
from rank_launcher import run_on_ranks

print("top level of the script ran", flush=True)


def start_a_spawned_process():
    child = multiprocessing.get_context("spawn").Process(target=print, args=("child ran",))
    child.start()
    child.join(timeout=60)
    print(f"rank {dist.get_rank()}: spawned child exited with {child.exitcode}")


run_on_ranks(start_a_spawned_process)
