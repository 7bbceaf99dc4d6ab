"""A single-process step starts a thread that never ends, as library thread pools do.

The step runs in a process of its own, so the launching process forks the next ranks
without that thread (forking a process whose threads hold locks can deadlock the ranks).
"""

import os
import threading

import torch.distributed as dist
from rank_launcher import run_on_one_process, run_on_ranks


def start_a_thread_that_stays():
    threading.Thread(target=threading.Event().wait, daemon=True, name="stays").start()
    print("one-process step: threads running here:", threading.active_count())
    return os.getpid()


def threads_in_a_rank():
    print(f"rank {dist.get_rank()}: threads {sorted(t.name for t in threading.enumerate())}")


step_pid = run_on_one_process(start_a_thread_that_stays)
print(f"the step ran in another process: {step_pid != os.getpid()}")
print(f"threads in the launching process: {sorted(t.name for t in threading.enumerate())}")
run_on_ranks(threads_in_a_rank)
