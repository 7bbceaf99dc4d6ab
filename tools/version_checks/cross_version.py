"""Checkpoints across torch versions: save with one release, load with another.

``make versions CROSS=1`` (``tools/versions.py --cross``) runs ``save DIR`` in every measured
release's venv, then ``load DIR`` of every release's checkpoint in every venv, and records
each pair in ``_versions/results.json``. Three kinds (``--kind``, default ``model``):

* ``model`` (``checkpoints``): a model's and its Adam optimizer's state dict, after one
  step, saved with ``dcp.save`` in one process; ``load`` loads it into a fresh model and
  optimizer with ``dcp.load`` and compares every tensor.
* ``dtensor`` (``checkpoints_dtensor``): the same model sharded with FSDP2 (``fully_shard``)
  on 2 ranks (gloo, 2 processes on a free port), model and optimizer state dicts from
  ``get_state_dict`` (DTensors), saved by the 2 ranks and loaded by 2 ranks into a fresh
  sharded model and optimizer (``set_state_dict``), every rank's shards compared.
* ``hf`` (``checkpoints_hf``): a Hugging Face safetensors export as the site's
  ``hf_interop_recipe`` writes one: 2 FSDP2 ranks, ``HuggingFaceStorageWriter`` with
  ``save_distributed=True, enable_consolidation=True``, the ranks' pieces (``sharded/``)
  removed; ``load`` reads it as ``hf_import_recipe`` does, ``HuggingFaceStorageReader``
  into a fresh 2-rank sharded model, every rank's shards compared.

Exit status 0: loaded back equal. It needs torch only (``hf`` also safetensors).

Where a release cannot load another's checkpoint, the way through is measured too. For
``model`` and ``dtensor`` the release that saved it converts it to one ``torch.save`` file
(``convert DIR FILE``: ``dcp_to_torch_save``, in one process), and the other loads that
with ``torch.load`` (``load-torch-save FILE``; for ``dtensor`` each rank compares the whole
tensors of its sharded state with the file's). For ``hf`` the other release reads the
safetensors files without DCP (``load-safetensors DIR``: ``safetensors.torch.load_file``).
"""

import datetime
import glob
import os
import shutil
import sys
import traceback

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# page_tools.ports is the site's one free-port picker; it needs nothing but the standard library
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes_source"))
from page_tools.ports import free_port  # noqa: E402

WORLD_SIZE = 2
GROUP_TIMEOUT = datetime.timedelta(seconds=120)  # a rank that waits on a failed one gives up


def toy_model(seed):
    """The one model of every kind: the same seed gives the same weights on every release."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def model_and_optimizer(seed):
    model = toy_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(8, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def sharded_model(seed):
    from torch.distributed.fsdp import fully_shard

    model = toy_model(seed)
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    return model


def sharded_model_and_optimizer(seed):
    model = sharded_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.manual_seed(seed)  # the same batch on every rank
    model(torch.rand(8, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def state(model, optimizer):
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def sharded_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat(value, f"{prefix}{key}.")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from flat(value, f"{prefix}{i}.")
    else:
        yield prefix.rstrip("."), tree


def local(value, whole=False):
    """A DTensor's own shard (or, ``whole``, the whole tensor: a collective), else the value."""
    if hasattr(value, "to_local"):
        return value.full_tensor() if whole else value.to_local()
    return value


def same(value, other):
    if torch.is_tensor(value) or torch.is_tensor(other):
        return torch.is_tensor(value) and torch.is_tensor(other) and torch.equal(value, other)
    return value == other


def compare(path, want, got, whole=False):
    want, got = dict(flat(want)), dict(flat(got))
    differ = [k for k, v in want.items() if not same(local(v, whole), local(got.get(k), whole))]
    rank = f" rank {torch.distributed.get_rank()}" if torch.distributed.is_initialized() else ""
    if differ:
        print(f"torch {torch.__version__}{rank} loaded {path}: {len(differ)} differ: {differ[:3]}")
        return 1
    print(f"torch {torch.__version__}{rank} loaded {path}: {len(want)} values equal", flush=True)
    return 0


def convert(path, file):
    """The way through: one ``torch.save`` file, written in one process from every shard."""
    dcp_to_torch_save(path, file)
    print(f"torch {torch.__version__} converted {path} to {file}")
    return 0


def model_kind(mode, path, *more):
    if mode == "convert":
        return convert(path, more[0])
    saved = state(*model_and_optimizer(seed=0))
    if mode == "save":
        dcp.save(saved, checkpoint_id=path)
        print(f"torch {torch.__version__} saved {path}")
        return 0
    if mode == "load-torch-save":
        loaded = torch.load(path, weights_only=True)
    else:
        loaded = state(*model_and_optimizer(seed=1))  # other values, same structure
        dcp.load(loaded, checkpoint_id=path)
    return compare(path, saved, loaded)


def hf_writer(path, names):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    return HuggingFaceStorageWriter(
        path,
        fqn_to_index_mapping={name: 1 for name in names},
        save_distributed=True,
        enable_consolidation=True,
    )


def dtensor_kind(mode, path, *more):
    """One rank's part of the 2-rank kinds: ``dtensor`` and ``hf``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict

    kind = os.environ["CROSS_VERSION_KIND"]
    if kind == "hf":
        saved = {"model": get_model_state_dict(sharded_model(seed=0))}
    else:
        saved = sharded_state(*sharded_model_and_optimizer(seed=0))
    rank = torch.distributed.get_rank()
    if mode == "save" and kind == "hf":
        dcp.save(saved["model"], storage_writer=hf_writer(path, saved["model"]))
        torch.distributed.barrier()
        if rank == 0:  # as the export recipe does before it publishes the folder
            shutil.rmtree(os.path.join(path, "sharded"))
            print(f"torch {torch.__version__} saved {sorted(os.listdir(path))} into {path}")
        return 0
    if mode == "save":
        dcp.save(saved, checkpoint_id=path)
        if rank == 0:
            print(f"torch {torch.__version__} saved {path} from {WORLD_SIZE} ranks")
        return 0
    if mode == "load-torch-save":
        return compare(path, saved, torch.load(path, weights_only=True), whole=True)
    if kind == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        loaded = {"model": get_model_state_dict(sharded_model(seed=1))}
        dcp.load(loaded["model"], storage_reader=HuggingFaceStorageReader(path))
        return compare(path, saved, loaded)
    model, optimizer = sharded_model_and_optimizer(seed=1)  # other values, same structure
    loaded = sharded_state(model, optimizer)
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    return compare(path, saved, sharded_state(model, optimizer))


def rank_main(rank, args):
    """One spawned rank: its group, its part, its exit (gloo's threads outlive the group)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    code = 1
    try:
        torch.distributed.init_process_group("gloo", timeout=GROUP_TIMEOUT)
        code = dtensor_kind(*args)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def on_ranks(kind, mode, path, *more):
    if mode == "convert":  # one process reads every rank's shards
        return convert(path, more[0])
    if mode == "load-safetensors":  # no DCP, no process group: the files themselves
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        loaded = {name: t for file in files for name, t in load_file(file).items()}
        return compare(path, {"model": sharded_model_state_whole()}, {"model": loaded})
    import torch.multiprocessing as mp

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), CROSS_VERSION_KIND=kind
    )
    try:
        mp.start_processes(
            rank_main, args=((mode, path, *more),), nprocs=WORLD_SIZE, start_method="spawn"
        )
    except Exception as error:  # the ranks printed their tracebacks
        print(f"ranks failed: {type(error).__name__}: {error}".splitlines()[0])
        return 1
    return 0


def sharded_model_state_whole():
    """What the 2 ranks' ``hf`` model holds, whole: the same seed, unsharded."""
    return toy_model(seed=0).state_dict()


def main(argv):
    kind = "model"
    if argv and argv[0].startswith("--kind="):
        kind, argv = argv[0].split("=", 1)[1], argv[1:]
    mode, paths = argv[0], [os.path.abspath(p) for p in argv[1:]]
    if kind == "model":
        return model_kind(mode, *paths)
    if kind in ("dtensor", "hf"):
        return on_ranks(kind, mode, *paths)
    raise SystemExit(f"cross_version: unknown kind {kind!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
