"""The coordinator's socket side: accept every rank's connection, read its messages into
:class:`~nvrx_lab.replicas.coordinator.Coordinator`'s decisions, and host the ``TCPStore`` where every quorum's
process group meets (:mod:`.group`). ``python -m nvrx_lab.replicas.coordinator`` runs it."""

from __future__ import annotations

import json
import secrets
import socket
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from nvrx_lab.net import listen

if TYPE_CHECKING:
    from .coordinator import Coordinator


def _serve_connection(coord: Coordinator, conn: socket.socket) -> None:
    replica, nonce = None, None
    try:
        if coord.secret is not None:  # the hello must prove the shared secret (protocol.proof)
            nonce = secrets.token_hex(16)
            coord._send(conn, {"op": "challenge", "nonce": nonce})
        for line in conn.makefile("rb"):
            msg = json.loads(line)
            op = msg.get("op")
            if op == "hello":
                if not coord.hello(conn, msg, nonce):
                    break
                replica = msg["replica"]
            elif op == "join":
                coord.join(replica, msg["step"], msg.get("done"), msg.get("layout"))
            elif op == "stuck":
                coord.probes.stuck(replica, msg["qid"])
            elif op == "beat":
                coord.beat(replica)
            elif op == "progress":
                coord.probes.answer(replica, msg["rank"], msg["id"], msg)
            elif op == "fail":
                coord.lost(replica, conn, f"it failed ({msg['why']})", evict=False)  # it exits by itself
            elif op == "bye":
                coord.bye(replica)
    except (OSError, ValueError):
        pass
    finally:
        if replica is not None:
            coord.lost(replica, conn)
        conn.close()


def serve(coord: Coordinator, host: str, port: int, ready: threading.Event | None = None,
          stop: threading.Event | None = None, store_port: int = 0, server: socket.socket | None = None) -> None:
    """Accept ranks on ``host:port`` (or on ``server``, a listening socket of the caller's) and host the groups' store
    beside it, until ``stop`` is set or ``server`` is shut down."""
    server = server or listen(host, port)
    store_sock = listen(host, store_port)  # 0: any free port (a pod's Service names a fixed one)
    coord.store_port = store_sock.getsockname()[1]
    store = dist.TCPStore(host, coord.store_port, is_master=True, wait_for_workers=False,  # noqa: F841 - held open
                          timeout=timedelta(seconds=60), master_listen_fd=store_sock.detach())
    server.settimeout(0.2)
    if ready is not None:
        ready.set()
    stop = stop or threading.Event()
    while not stop.is_set():
        coord.check_beats()
        coord.check_first_quorum()
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:  # the listening socket was shut down: the coordinator is gone
            break
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve_connection, args=(coord, conn), daemon=True).start()
    server.close()

