"""Which sockets does an attempt's abort cut? (2 ranks, gloo, CPU)

Each rank calls :meth:`CallWrapper.init_process_group` with a ``device_id``, as the trainer does
for ``cpu:gloo,cuda:nccl`` on GPUs. The accelerator connect step (``call_wrapper.connect_device``,
where NCCL's communicator, its bootstrap and proxy sockets are made) is replaced by a fake that
opens a connected TCP pair of its own. Each rank prints one JSON line::

    {"rank", "gloo_tracked": connected sockets the tracker holds (gloo's pairs),
     "fake_tracked": fake NCCL sockets the tracker holds (must be 0),
     "store_tracked": store-client sockets held after initialisation (must be 0),
     "fake_alive_after_cut": the fake connection still works after tracker.cut(),
     "gloo_error_after_cut": what an all_reduce raised after the cut}
"""

import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from nvrx_lab.inprocess import call_wrapper
from nvrx_lab.inprocess.interrupt import SocketTracker
from nvrx_lab.inprocess.state import State
from nvrx_lab.sockets import socket_fds

FAKE: list[socket.socket] = []


def emit(row: dict) -> None:
    """One JSON line in one write: the ranks share the launcher's stdout."""
    os.write(1, (json.dumps(row) + "\n").encode())


def fake_connect_device(pg, device) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    FAKE.extend([listener, client, server_side])


class FakeMonitor:
    last_ping = 0.0


def connected(fds) -> int:
    n = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.getpeername()
            n += s.type == socket.SOCK_STREAM
        except OSError:
            pass
        finally:
            s.close()
    return n


def main() -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    before = socket_fds()
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), ws, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    store_fds = socket_fds() - before
    call_wrapper.connect_device = fake_connect_device
    tracker = SocketTracker()
    cw = call_wrapper.CallWrapper(State(rank, ws, 0, rank, ws, tuple(range(ws)), {r: r for r in range(ws)}),
                                  store, store_fds, FakeMonitor(), tracker, None,
                                  call_wrapper.GroupSettings(30.0, gloo_max_timeout=9.0))
    cw.init_process_group("gloo", device_id=torch.device("cuda", 0))
    owned = tracker.owned
    gloo_timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    gloo_tracked = connected(owned)  # before the cut: a shut-down socket has no peer
    fake_fds = {s.fileno() for s in FAKE}
    dist.all_reduce(torch.ones(2))
    tracker.cut()
    FAKE[1].sendall(b"x")
    fake_alive = FAKE[2].recv(1) == b"x"
    error = None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except Exception as e:
        error = f"{type(e).__name__} after {time.monotonic() - t0:.2f} s"
    emit({"rank": rank, "gloo_tracked": gloo_tracked, "gloo_timeout_s": gloo_timeout, "fake_tracked": len(owned & fake_fds),
                      "store_tracked": len(owned & store_fds), "fake_alive_after_cut": fake_alive,
                      "gloo_error_after_cut": error})
    dist.destroy_process_group()
    store.add("done", 1)
    while store.add("done", 0) < ws:
        time.sleep(0.01)
    time.sleep(0.3)  # rank 0 hosts the store
    os._exit(0)


if __name__ == "__main__":
    main()
