"""Rank 1 is killed by SIGKILL (as the OOM killer would) while rank 0 waits for it."""

import os
import signal

import torch.distributed as dist
from rank_launcher import run_on_ranks


def train():
    print(f"rank {dist.get_rank()} started")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 fails here once its peer is gone


run_on_ranks(train)
