"""Node health checks against fixture trees (a fake sysfs, a fake NVML, a fake /proc/meminfo) and real files; a check
that cannot run here says so (skipped, with the reason); the launcher leaves the rendezvous with exit 5 on a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from nvrx_lab.exit_codes import UNHEALTHY
from nvrx_lab.health.gpu import gpu
from nvrx_lab.health.mark import ANNOTATION, LABEL, TAINT
from nvrx_lab.health.nic import nic
from nvrx_lab.health.node import disk, memory, storage
from nvrx_lab.observe.events import read_events


def sysfs(root: Path, ports: dict[str, tuple[str, str]]) -> str:
    for dev, (state, phys) in ports.items():
        port = root / dev / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "phys_state").write_text(phys + "\n")
    return str(root)


UP = ("4: ACTIVE", "5: LinkUp")


def test_rdma_ports_active_down_missing_and_too_few(tmp_path):
    assert nic(sysfs(tmp_path / "a", {f"rdmap{i}s0": UP for i in range(4)}), expected=4).status == "ok"
    down = nic(sysfs(tmp_path / "b", {"rdmap0s0": UP, "rdmap1s0": ("1: DOWN", "3: Disabled")}))
    assert down.failed and down.evidence == "1 port(s) not active: rdmap1s0 port 1 1: DOWN (3: Disabled)"
    few = nic(sysfs(tmp_path / "c", {"rdmap0s0": UP}), expected=32)
    assert few.failed and few.evidence.startswith("1 RDMA devices, 32 expected")
    none = nic(str(tmp_path / "nothing"))
    assert none.status == "skipped" and "no RDMA devices" in none.evidence  # said, never a silent pass


class FakeNvml(SimpleNamespace):
    """pynvml's functions over a table per GPU: ecc, pending, remap (corr, uncorr, pending, failure), links."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_NVLINK_MAX_LINKS = 1, 0, 4

    def nvmlInit(self):
        if getattr(self, "broken", False):
            raise RuntimeError("Driver Not Loaded")

    def nvmlShutdown(self): ...
    def nvmlDeviceGetCount(self): return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i): return self.gpus[i]
    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter): return h.get("ecc", 0)
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h): return h.get("pending", 0)
    def nvmlDeviceGetRemappedRows(self, h): return h.get("remap", (0, 0, 0, 0))

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 2:
            raise RuntimeError("Not Supported")  # a link this GPU does not have
        return 0 if link in h.get("down", ()) else 1


def test_gpu_health_through_nvml():
    healthy = [{} for _ in range(8)]
    assert gpu(FakeNvml(gpus=healthy)).status == "ok"
    sick = gpu(FakeNvml(gpus=[{}, {"ecc": 2}, {"remap": (0, 1, 0, 1)}, {"down": (1,)}, {"pending": 1}]))
    assert sick.failed and sick.evidence == ("GPU 1: 2 uncorrectable ECC errors; GPU 2: row remapping failed; "
                                             "GPU 3: NVLink link(s) 1 down; GPU 4: retired pages pending a reset")
    lost = FakeNvml(gpus=[{}, {}])
    lost.nvmlDeviceGetHandleByIndex = lambda i: (_ for _ in ()).throw(RuntimeError("GPU is lost")) if i else {}
    assert gpu(lost).evidence == "GPU 1: NVML error (GPU is lost)" and gpu(lost).failed  # fallen off the bus
    off = gpu(FakeNvml(gpus=[], broken=True))
    assert off.status == "skipped" and "NVML did not start (Driver Not Loaded)" in off.evidence


def test_storage_memory_and_disk(tmp_path):
    assert storage(str(tmp_path)).status == "ok" and not list(tmp_path.iterdir())  # nothing left behind
    (tmp_path / "file").write_text("x")
    bad = storage(str(tmp_path / "file" / "ckpt"))  # under a file: no folder can be made
    assert bad.failed and bad.evidence.startswith(f"{tmp_path / 'file' / 'ckpt'}: cannot write")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2097152 kB\nMemAvailable: 1048576 kB\n")  # 1 GiB
    assert memory(str(meminfo), min_gib=4).failed and memory(str(meminfo), min_gib=0.5).status == "ok"
    assert disk(str(tmp_path), min_gib=0.001).status == "ok" and disk(str(tmp_path), min_gib=1e9).failed


@pytest.mark.timeout(90)
def test_a_node_with_a_down_port_leaves_before_the_rendezvous_with_exit_5(tmp_path):
    metrics = tmp_path / "m.jsonl"
    root = sysfs(tmp_path / "sys", {"rdmap0s0": UP, "rdmap1s0": ("1: DOWN", "3: Disabled")})
    cmd = [sys.executable, "-m", "nvrx_lab.launcher", "--standalone", "--nproc-per-node", "1", "--no-standby",
           "--health-sysfs", root, "--metrics-file", str(metrics), "--no-python", "/bin/echo", "trained"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=tmp_path)
    assert out.returncode == UNHEALTHY == 5, out.stdout + out.stderr
    assert "trained" not in out.stdout  # no worker started
    assert ("health check failed: nic: 1 port(s) not active: rdmap1s0 port 1 1: DOWN (3: Disabled); this node leaves "
            "the rendezvous (exit 5)") in out.stderr
    assert {e["check"]: e["status"] for e in read_events(metrics, "health")}["nic"] == "failed"
    ok = subprocess.run([*cmd[:8], sysfs(tmp_path / "up", {"rdmap0s0": UP}), *cmd[9:]], capture_output=True, text=True,
                        timeout=80, cwd=tmp_path)
    assert ok.returncode == 0 and "trained" in ok.stdout, ok.stdout + ok.stderr


class _Nodes(ThreadingHTTPServer):
    """The node part of the Kubernetes API: GET and PATCH ``/api/v1/nodes/NAME``, every request recorded; ``refuse``:
    answer 403 to a PATCH, as for a service account without the rendered ClusterRole."""

    def __init__(self, refuse: bool = False):
        super().__init__(("127.0.0.1", 0), _NodeHandler)
        self.refuse, self.requests = refuse, []
        self.node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "ip-10-0-0-7", "labels": {}},
                     "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}


class _NodeHandler(BaseHTTPRequestHandler):
    server: _Nodes

    def log_message(self, *_):
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.server.requests.append(("GET", self.path, self.headers.get("Authorization"), None))
        self._send(200, self.server.node)

    def do_PATCH(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(("PATCH", self.path, self.headers.get("Content-Type"), body))
        if self.server.refuse:
            return self._send(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                    "reason": "Forbidden", "message": 'nodes "ip-10-0-0-7" is forbidden'})
        self.server.node["metadata"]["labels"].update(body["metadata"]["labels"])
        self.server.node["spec"] = body.get("spec", self.server.node["spec"])
        return self._send(200, self.server.node)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("refuse", [False, True])
def test_a_failed_check_marks_the_node_on_kubernetes_so_the_pods_avoid_it(tmp_path, refuse):
    server = _Nodes(refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "u", "user": {"token": "pod-token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    root = sysfs(tmp_path / "sys", {"rdmap0s0": ("1: DOWN", "3: Disabled")})
    cmd = [sys.executable, "-m", "nvrx_lab.launcher", "--standalone", "--nproc-per-node", "1", "--no-standby",
           "--health-sysfs", root, "--mark-node", "ip-10-0-0-7", "--no-python", "/bin/echo", "trained"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=tmp_path,
                             env={**os.environ, "KUBECONFIG": str(kubeconfig)})
    finally:
        server.shutdown()
    assert out.returncode == UNHEALTHY, out.stdout + out.stderr  # marked or not, the node leaves
    patch = [r for r in server.requests if r[0] == "PATCH"]
    assert [r[1] for r in patch] == ["/api/v1/nodes/ip-10-0-0-7"] and patch[0][2].endswith("merge-patch+json")
    body = patch[0][3]
    assert body["metadata"]["labels"] == {LABEL: "failed"}
    assert "health nic: failed: 1 port(s) not active: rdmap0s0" in body["metadata"]["annotations"][ANNOTATION]
    assert body["spec"]["taints"] == [{"key": "nvidia.com/gpu", "effect": "NoSchedule"},  # the node's own kept
                                      {"key": TAINT, "value": "health-check", "effect": "NoSchedule"}]
    if refuse:
        assert "health: could not mark node ip-10-0-0-7 (ForbiddenException: Forbidden)" in out.stderr, out.stderr
        assert "the pod's service account needs get and patch on nodes" in out.stderr
    else:
        assert (f"health: marked node ip-10-0-0-7: label {LABEL}=failed (this job's pods avoid it), taint "
                f"{TAINT}:NoSchedule") in out.stderr, out.stderr
