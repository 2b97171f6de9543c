"""Security: monitor channels only the job's user can open, stores that listen on one address only."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import psutil
import pytest

from nvrx_lab.inprocess import store
from nvrx_lab.launcher.monitor import MonitorServer, socket_path
from nvrx_lab.launcher.timeouts import Timeouts
from nvrx_lab.net import free_port

NOBODY = 65534
CONNECT = (f"import os, socket, sys; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); "
           "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print('connected')")


def as_nobody(*args: str) -> subprocess.CompletedProcess:
    """Python that turns into another user once started (CI runs as root, whom file modes do not stop;
    the interpreter itself may live where that user cannot read)."""
    return subprocess.run([sys.executable, "-I", "-S", *args], capture_output=True, text=True, timeout=30, cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
@pytest.mark.timeout(60)
def test_another_user_cannot_reach_a_rank_monitor():
    server = MonitorServer(1, Timeouts())
    try:
        assert stat.S_IMODE(os.stat(server.dir).st_mode) == 0o700
        path = socket_path(server.dir, 0)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        os.chmod(server.dir, 0o711)  # control: the same stranger gets in where the modes let it
        os.chmod(path, 0o666)
        assert "connected" in as_nobody("-c", CONNECT, path).stdout
        os.chmod(server.dir, 0o700)
        os.chmod(path, 0o600)
        res = as_nobody("-c", CONNECT, path)
        assert res.returncode != 0 and "PermissionError" in res.stderr, res
        os.chmod(server.dir, 0o711)  # with the folder opened up, the socket's own mode refuses
        res = as_nobody("-c", CONNECT, path)
        assert res.returncode != 0 and "PermissionError" in res.stderr, res
    finally:
        server.close()


def listening_addresses(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.timeout(60)
def test_the_inprocess_store_listens_on_loopback_only():
    port = free_port()
    server = store.host(port)
    client = store.connect("127.0.0.1", port, timeout=10)
    client.set("k", "v")
    assert server.get("k") == b"v"
    assert listening_addresses(port) == {"127.0.0.1"}
    # control: TCPStore on its own listens on every interface
    import datetime

    import torch.distributed as dist

    other = free_port()
    bare = dist.TCPStore("127.0.0.1", other, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))
    assert listening_addresses(other) - {"127.0.0.1"}, listening_addresses(other)
    del bare, client, server
