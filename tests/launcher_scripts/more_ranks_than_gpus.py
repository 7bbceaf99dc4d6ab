"""A machine with one GPU, as the launcher sees it, asked for DCP_RECIPES_WORLD_SIZE ranks."""

import torch
from rank_launcher import run_on_ranks

# This machine has no GPU: tell the launcher it has one (nothing here touches CUDA for real,
# because the launcher refuses before it starts any rank).
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1


def train():
    print("a rank started")


run_on_ranks(train)
