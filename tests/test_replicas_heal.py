"""A heal of a real size (issue 41): 512 MB of state from a donor to a joiner over the quorum's own gloo group, in two
real processes; the joiner holds the donor's bytes exactly, and a donor that dies mid-heal ends the joiner's receive at
once with a clear error, not at the data plane's timeout."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from nvrx_lab.net import free_port
from nvrx_lab.replicas.heal import CHUNK_BYTES

WORKER = Path(__file__).parent / "workers" / "heal_large.py"
MB = 512


def _heals(die_after: int, timeout: float = 240) -> dict[str, list[dict]]:
    """Both sides' results, heal by heal (the donor's second one: its exit code, if it died)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))  # the coordinator's
    procs = {role: subprocess.Popen([sys.executable, str(WORKER), role, str(port), str(MB), "--die-after",
                                     str(die_after)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for role in ("donor", "joiner")}
    out = {}
    try:
        for role, p in procs.items():
            text, _ = p.communicate(timeout=timeout)
            out[role] = [json.loads(ln[7:]) for ln in text.splitlines() if ln.startswith("RESULT ")]
            out[role].append({"exit": p.returncode, "output": text[-2000:]})
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        del store
    return out


@pytest.mark.timeout(300)
def test_a_512_mb_heal_arrives_whole_and_a_donor_killed_mid_heal_ends_the_receive_at_once():
    got = _heals(die_after=3)
    (donor, donor_exit), (joiner, cut, _) = got["donor"], got["joiner"]
    # a whole heal: the joiner holds the donor's bytes exactly, every chunk a unit of progress of its own
    assert "error" not in joiner and joiner["digest"] == donor["digest"], got
    assert joiner["step"] == 7 and joiner["lr"] == 3e-3 and donor["bytes"] >= MB * 1e6 * 0.99, got
    assert joiner["chunks"] == donor["chunks"] >= MB * (1 << 20) // CHUNK_BYTES, got
    print(f"{MB} MB healed in {joiner['seconds']:.2f} s ({donor['bytes'] / joiner['seconds'] / 1e6:.0f} MB/s)")
    # the donor SIGKILLed after the third chunk of the next: the joiner's receive ends with the reason, not at the
    # data plane's 60 s timeout (timed from the last chunk received: the donor's hashing and randn before are its own)
    assert donor_exit["exit"] == -9, got
    assert "quorum 1: a receive from member 0 failed" in cut.get("error", ""), got
    assert 3 <= cut["chunks"] < joiner["chunks"] and cut["after_last_s"] < 30, got
