"""A page's object store in a process of its own: requests counted per save, the server
killed after an upload (the save fails), restarted with its data; then the "page" raises,
as a failing cell would, and leaves it to atexit to stop the server. Prints one JSON line."""

import json
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from page_tools import object_store
from torch.distributed.checkpoint import _fsspec_filesystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
store = object_store.start(sys.argv[1])
options = {"endpoint_url": store.endpoint, "key": store.key, "secret": store.secret}
options["config_kwargs"] = {"connect_timeout": 2, "retries": {"max_attempts": 1}}
store.client().put_object(Bucket="dcp-recipes", Key="run/x", Body=b"12345")
in_bucket = store.objects("run/")
original = _fsspec_filesystem.FileSystem.create_stream, dcp.save
with object_store.requests_per_save(store) as per_save:
    dcp.save({"w": torch.arange(8.0)}, storage_writer=FsspecWriter("s3://dcp-recipes/a", **options))
with object_store.killed_after_writing(store, "b/__0_0") as killed:
    try:
        dcp.save({"w": torch.ones(8)}, storage_writer=FsspecWriter("s3://dcp-recipes/b", **options))
        error = None
    except BaseException as err:  # CheckpointException
        error = str(err).strip().splitlines()[-1]
down = not store.answers()
store.restart()
loaded = {"w": torch.zeros(8)}
dcp.load(loaded, storage_reader=FsspecReader("s3://dcp-recipes/a", **options), no_dist=True)
report = {
    "pid": store.process.pid,
    "ports": store.bound_ports(),
    "requests": per_save.by_rank[0][0]["requests"],
    "killed": killed.by_rank,
    "error": error,
    "down_after_kill": down,
    "objects": sorted(set(store.objects()) - {"run/x"}),
    "loaded": loaded["w"].tolist(),
    "restored": (_fsspec_filesystem.FileSystem.create_stream, dcp.save) == original,
    "starts": len(store.starts),
    "env": os.environ["AWS_ENDPOINT_URL"],
    "endpoint": store.endpoint,
    "in_bucket": in_bucket,
}
print(json.dumps(report), flush=True)
raise RuntimeError("a cell of the page failed")
