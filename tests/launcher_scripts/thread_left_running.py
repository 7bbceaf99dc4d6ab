"""The launching process starts a thread that keeps running, then launches ranks.

The launcher must refuse to fork beside it, and name it, before any rank starts.
"""

import ctypes
import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist
from rank_launcher import UnsafeToForkError, run_on_ranks

kind = os.environ["THREAD_LEFT_RUNNING"]
if kind == "python":
    threading.Thread(target=threading.Event().wait, name="left-running", daemon=True).start()
elif kind == "tcp-store":
    # What the launcher itself once did: a store whose server runs on a thread of its own.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
elif kind.startswith("native:"):
    # A thread no Python code runs on, named as a library names its own: it waits in pause().
    libc = ctypes.CDLL(None, use_errno=True)
    thread_id = ctypes.c_ulong()
    pause = ctypes.cast(libc.pause, ctypes.c_void_p)
    assert libc.pthread_create(ctypes.byref(thread_id), None, pause, None) == 0
    assert libc.pthread_setname_np(thread_id, kind.removeprefix("native:").encode()) == 0
    names = sorted(
        Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()
    )
    print("threads before the launch:", names)
else:  # numpy's OpenBLAS thread pool, which parks itself whenever the process forks
    print("threads before the launch:", len(os.listdir("/proc/self/task")))


def a_rank():
    print("a rank started")


try:
    run_on_ranks(a_rank)
except UnsafeToForkError as error:
    print(f"refused: {error}")
    sys.exit(3)
