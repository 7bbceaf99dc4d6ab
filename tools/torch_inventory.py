"""Write the intersphinx inventory of PyTorch's Distributed Checkpoint docs that the site keeps.

The build links ``torch.distributed.checkpoint`` names (Sphinx-Gallery's code links, the
prose's roles) to PyTorch's documentation through ``sphinx.ext.intersphinx``, reading this
inventory from the repository (``_inventories/``), never from the network: a build without
one still links. pytorch.org's own ``objects.inv`` cannot be fetched on every machine that
builds the site, so this tool writes one, with Sphinx's own writer
(``sphinx.util.inventory.InventoryFile.dump``), from the names the installed torch exposes:

* every object that PyTorch's page ``distributed.checkpoint`` documents (``DOCUMENTED``,
  read from ``docs/source/distributed.checkpoint.md`` in PyTorch's repository: the
  ``autofunction``/``autoclass`` directives and the ``currentmodule`` they sit under, which
  make the anchors ``#<module>.<name>``), where the installed torch has it;
* the public methods with a docstring of each documented class (what ``:members:`` shows);
* the public re-exports (``torch.distributed.checkpoint.async_save`` is
  ``state_dict_saver.async_save``), pointing at the documented anchor.

Run it with the torch the site is built with, after a torch upgrade:

    .venv/bin/python tools/torch_inventory.py          # writes _inventories/torch.inv
    .venv/bin/python tools/torch_inventory.py --check  # fails if the file is not up to date
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "_inventories" / "torch.inv"
PAGE = "distributed.checkpoint"  # the docs page, distributed.checkpoint.html
DCP = "torch.distributed.checkpoint"

# (module the docs page documents it under, name, kind), in the page's order.
DOCUMENTED = [
    (f"{DCP}.optimizer", "load_sharded_optimizer_state_dict", "function"),
    (f"{DCP}.planner_helpers", "create_read_items_for_chunk_list", "function"),
    (f"{DCP}.default_planner", "create_default_global_load_plan", "function"),
    (f"{DCP}.default_planner", "create_default_global_save_plan", "function"),
    (f"{DCP}.default_planner", "create_default_local_save_plan", "function"),
    (f"{DCP}.state_dict_saver", "AsyncCheckpointerType", "class"),
    (f"{DCP}.state_dict_saver", "AsyncSaveResponse", "class"),
    (f"{DCP}.state_dict_saver", "save", "function"),
    (f"{DCP}.state_dict_saver", "async_save", "function"),
    (f"{DCP}.state_dict_saver", "save_state_dict", "function"),
    (f"{DCP}.state_dict_loader", "load", "function"),
    (f"{DCP}.state_dict_loader", "load_state_dict", "function"),
    (f"{DCP}.staging", "AsyncStager", "class"),
    (f"{DCP}.staging", "DefaultStager", "class"),
    (f"{DCP}.staging", "StagingOptions", "class"),
    (f"{DCP}.staging", "BlockingAsyncStager", "class"),
    (f"{DCP}.stateful", "Stateful", "class"),
    (DCP, "StorageReader", "class"),
    (DCP, "StorageWriter", "class"),
    (f"{DCP}.metadata", "StorageMeta", "class"),
    (f"{DCP}.metadata", "TensorProperties", "class"),
    (f"{DCP}.metadata", "TensorStorageMetadata", "class"),
    (DCP, "LoadPlanner", "class"),
    (DCP, "LoadPlan", "class"),
    (DCP, "ReadItem", "class"),
    (DCP, "SavePlanner", "class"),
    (DCP, "SavePlan", "class"),
    (f"{DCP}.planner", "WriteItem", "class"),
    (f"{DCP}.planner", "BytesIOWriteData", "class"),
    (f"{DCP}.planner", "TensorWriteData", "class"),
    (f"{DCP}.filesystem", "FileSystemBase", "class"),
    (f"{DCP}.filesystem", "FileSystem", "class"),
    (f"{DCP}.filesystem", "SerializationFormat", "class"),
    (DCP, "FileSystemReader", "class"),
    (DCP, "FileSystemWriter", "class"),
    (DCP, "FsspecReader", "class"),  # public from torch 2.15: absent from 2.13's inventory
    (DCP, "FsspecWriter", "class"),
    (DCP, "HuggingFaceStorageReader", "class"),
    (DCP, "HuggingFaceStorageWriter", "class"),
    (DCP, "QuantizedHuggingFaceStorageReader", "class"),
    (DCP, "DefaultSavePlanner", "class"),
    (DCP, "DefaultLoadPlanner", "class"),
    (f"{DCP}.state_dict", "get_state_dict", "function"),
    (f"{DCP}.state_dict", "get_model_state_dict", "function"),
    (f"{DCP}.state_dict", "get_optimizer_state_dict", "function"),
    (f"{DCP}.state_dict", "set_state_dict", "function"),
    (f"{DCP}.state_dict", "set_model_state_dict", "function"),
    (f"{DCP}.state_dict", "set_optimizer_state_dict", "function"),
    (f"{DCP}.state_dict", "StateDictOptions", "class"),
    (f"{DCP}.format_utils", "dcp_to_torch_save", "function"),
    (f"{DCP}.format_utils", "torch_save_to_dcp", "function"),
    (f"{DCP}.format_utils", "BroadcastingTorchSaveReader", "class"),
    (f"{DCP}.format_utils", "DynamicMetaLoadPlanner", "class"),
]
# The page's automodule / py:module directives (anchors #module-<name>); stateful is :noindex:.
MODULES = [
    DCP,
    f"{DCP}.staging",
    f"{DCP}.format_utils",
    f"{DCP}.logger",
    f"{DCP}.logging_handlers",
]


def docs_url(torch_version: str) -> str:
    """The docs of the torch release the site is built with: 2.13.0+cpu -> .../docs/2.13/."""
    major, minor = torch_version.split("+")[0].split(".")[:2]
    return f"https://docs.pytorch.org/docs/{major}.{minor}/"


def objects() -> list[tuple[str, str, str]]:
    """(name, py role, anchor) for every entry, from the installed torch."""
    entries: dict[str, tuple[str, str]] = {}
    documented: dict[int, str] = {}
    for module_name in MODULES:
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue
        entries[module_name] = ("module", f"module-{module_name}")
    for module_name, name, kind in DOCUMENTED:
        obj = getattr(importlib.import_module(module_name), name, None)
        if obj is None:
            continue  # not in this torch
        full = f"{module_name}.{name}"
        entries[full] = (kind, full)
        documented[id(obj)] = full
        if kind == "class":
            for member, value in vars(obj).items():
                function = getattr(value, "__func__", value)
                if member.startswith("_") or not inspect.isfunction(function):
                    continue
                if function.__doc__:
                    entries[f"{full}.{member}"] = ("method", f"{full}.{member}")
    for module_name in sorted({m for m, _, _ in DOCUMENTED} | {DCP}):
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", None) or dir(module):
            target = documented.get(id(getattr(module, name, None)))
            alias = f"{module_name}.{name}"
            if target and alias not in entries and not name.startswith("_"):
                entries[alias] = (entries[target][0], target)
    return sorted((name, kind, anchor) for name, (kind, anchor) in entries.items())


def write(path: Path) -> int:
    """Write the inventory with Sphinx's own writer; return how many entries it holds."""
    import torch
    from sphinx.util.inventory import InventoryFile

    found = objects()
    domain = SimpleNamespace(
        get_objects=lambda: [(name, name, kind, PAGE, anchor, 1) for name, kind, anchor in found]
    )
    env = SimpleNamespace(
        config=SimpleNamespace(project="PyTorch", version=torch.__version__.split("+")[0]),
        domains={"py": domain},
    )
    builder = SimpleNamespace(get_target_uri=lambda docname: f"{docname}.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    InventoryFile.dump(str(path), env, builder)
    return len(found)


def read(path: Path = INVENTORY) -> dict[str, dict[str, str]]:
    """{role: {name: uri relative to the docs}} of an inventory file."""
    from sphinx.util.inventory import InventoryFile

    with open(path, "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    return {
        role: {name: item[2] for name, item in items.items()} for role, items in inventory.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    parser.add_argument("--output", type=Path, default=INVENTORY)
    args = parser.parse_args()
    import torch

    if args.check:
        with tempfile.TemporaryDirectory() as scratch:
            fresh = Path(scratch) / "torch.inv"
            write(fresh)
            if read(fresh) != read(args.output):
                print(f"{args.output} is stale: run tools/torch_inventory.py", file=sys.stderr)
                return 1
        print(f"{args.output} is up to date for torch {torch.__version__}")
        return 0
    count = write(args.output)
    url = docs_url(torch.__version__)
    print(f"wrote {args.output} ({count} names, torch {torch.__version__}, {url})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
