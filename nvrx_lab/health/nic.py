"""EFA and InfiniBand ports from sysfs: every port of every RDMA device ACTIVE and LinkUp.

``/sys/class/infiniband/<device>/ports/<n>/state`` reads ``4: ACTIVE`` on a working port (``1: DOWN``,
``2: INIT`` otherwise) and ``phys_state`` ``5: LinkUp``; EFA devices are named ``rdmap…`` (``efa_…`` on older
drivers). ``root`` lets the tests read a fixture tree.
"""

from __future__ import annotations

from pathlib import Path

from nvrx_lab.health import Verdict, failed, ok, skipped

SYSFS = "/sys/class/infiniband"


def nic(root: str = SYSFS, expected: int | None = None) -> Verdict:
    """Every RDMA port ACTIVE; ``expected`` devices when given (32 on a p5: the EFA interfaces the pod asked for)."""
    base = Path(root)
    devices = sorted(p for p in base.iterdir()) if base.is_dir() else []
    if not devices:
        return skipped("nic", f"no RDMA devices under {root} (no EFA or InfiniBand here)")
    down = []
    for dev in devices:
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            state = _read(port / "state")
            phys = _read(port / "phys_state")
            if "ACTIVE" not in state or (phys and "LinkUp" not in phys):
                down.append(f"{dev.name} port {port.name} {state or '?'} ({phys or '?'})")
    if down:
        return failed("nic", f"{len(down)} port(s) not active: {'; '.join(down[:4])}")
    if expected is not None and len(devices) < expected:
        return failed("nic", f"{len(devices)} RDMA devices, {expected} expected (an interface missing from the node)")
    return ok("nic", f"{len(devices)} RDMA devices, every port ACTIVE")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
