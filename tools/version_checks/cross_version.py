"""Checkpoints across torch versions: save with one release, load with another.

``make versions CROSS=1`` (``tools/versions.py --cross``) runs ``save DIR`` in every measured
release's venv, then ``load DIR`` of every release's checkpoint in every venv, and records
each pair in ``_versions/results.json`` (``checkpoints``). The checkpoint is a model's and
its Adam optimizer's state dict, after one step, saved with ``dcp.save`` in one process;
``load`` loads it into a fresh model and optimizer with ``dcp.load`` and compares every
tensor. Exit status 0: loaded back equal. It needs torch only.
"""

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn


def model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(8, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def state(model, optimizer):
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat(value, f"{prefix}{key}.")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from flat(value, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), tree


def main(mode, directory):
    saved = state(*model_and_optimizer(seed=0))
    if mode == "save":
        dcp.save(saved, checkpoint_id=directory)
        print(f"torch {torch.__version__} saved {directory}")
        return 0
    loaded = state(*model_and_optimizer(seed=1))  # other values, same structure
    dcp.load(loaded, checkpoint_id=directory)
    want, got = dict(flat(saved)), dict(flat(loaded))
    differ = [
        key
        for key, value in want.items()
        if not (torch.equal(value, got[key]) if torch.is_tensor(value) else value == got[key])
    ]
    if differ:
        print(f"torch {torch.__version__} loaded {directory}: {len(differ)} values differ")
        return 1
    print(f"torch {torch.__version__} loaded {directory}: {len(want)} values equal")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], os.path.abspath(sys.argv[2])))
