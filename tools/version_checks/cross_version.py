"""Checkpoints across torch versions: save with one release, load with another.

``make versions CROSS=1`` (``tools/versions.py --cross``) runs ``save DIR`` in every measured
release's venv, then ``load DIR`` of every release's checkpoint in every venv, and records
each pair in ``_versions/results.json`` (``checkpoints``). The checkpoint is a model's and
its Adam optimizer's state dict, after one step, saved with ``dcp.save`` in one process;
``load`` loads it into a fresh model and optimizer with ``dcp.load`` and compares every
tensor. Exit status 0: loaded back equal. It needs torch only.

Where a release cannot load another's checkpoint, the way through is measured too: the
release that saved it converts it to one ``torch.save`` file
(``convert DIR FILE``: ``dcp_to_torch_save``), and the other loads that with ``torch.load``
(``load-torch-save FILE``), every value compared.
"""

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


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


def same(value, other):
    if torch.is_tensor(value) or torch.is_tensor(other):
        return torch.is_tensor(value) and torch.is_tensor(other) and torch.equal(value, other)
    return value == other


def main(mode, path, *more):
    saved = state(*model_and_optimizer(seed=0))
    if mode == "save":
        dcp.save(saved, checkpoint_id=path)
        print(f"torch {torch.__version__} saved {path}")
        return 0
    if mode == "convert":
        dcp_to_torch_save(path, more[0])
        print(f"torch {torch.__version__} converted {path} to {more[0]}")
        return 0
    if mode == "load-torch-save":
        loaded = torch.load(path, weights_only=True)
    else:
        loaded = state(*model_and_optimizer(seed=1))  # other values, same structure
        dcp.load(loaded, checkpoint_id=path)
    want, got = dict(flat(saved)), dict(flat(loaded))
    differ = [key for key, value in want.items() if not same(value, got.get(key))]
    if differ:
        print(f"torch {torch.__version__} loaded {path}: {len(differ)} values differ: {differ[:3]}")
        return 1
    print(f"torch {torch.__version__} loaded {path}: {len(want)} values equal")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *map(os.path.abspath, sys.argv[2:])))
