"""The launching process starts a thread that keeps running, then launches ranks.

The launcher must refuse to fork beside it, and name it, before any rank starts.
"""

import os
import sys
import threading

import torch.distributed as dist
from rank_launcher import UnsafeToForkError, run_on_ranks

kind = os.environ["THREAD_LEFT_RUNNING"]
if kind == "python":
    threading.Thread(target=threading.Event().wait, name="left-running", daemon=True).start()
elif kind == "tcp-store":
    # What the launcher itself once did: a store whose server runs on a thread of its own.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
else:  # numpy's OpenBLAS thread pool, which parks itself whenever the process forks
    print("threads before the launch:", len(os.listdir("/proc/self/task")))


def a_rank():
    print("a rank started")


try:
    run_on_ranks(a_rank)
except UnsafeToForkError as error:
    print(f"refused: {error}")
    sys.exit(3)
