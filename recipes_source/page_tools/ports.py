"""Free loopback ports, for what a page (or a test, or a tool) starts: a torchrun
rendezvous, an S3 server. The one place that picks them.

A port is free when nothing listens on it now; the kernel picks it (bind to port 0), so
two calls rarely collide, and a server started on it a moment later almost always gets
it (the pages retry where it matters: ``object_store`` checks its ports once started).
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """One loopback port that nothing listens on now."""
    return free_ports(1)[0]


def free_ports(count: int, also_free_at: int | None = None) -> list[int]:
    """``count`` distinct free loopback ports; with ``also_free_at``, each ``port +
    also_free_at`` is free too (SeaweedFS serves gRPC on its HTTP port + 10000), and no
    picked port is another's ``port + also_free_at``: every one of the ``2 * count`` ports
    is distinct (``weed`` refuses a port that is another service's gRPC port)."""
    sockets, ports = [], []
    try:
        while len(ports) < count:
            sock = socket.socket()
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)  # held until all are picked: no port is handed out twice
            port = sock.getsockname()[1]
            if also_free_at is None:
                ports.append(port)
                continue
            taken = set(ports) | {p + also_free_at for p in ports}
            twin = port + also_free_at
            if twin < 65536 and taken.isdisjoint({port, twin}) and port_is_free(twin):
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def port_is_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections of the past, in TIME_WAIT, do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
            return True
        except OSError:
            return False
