"""Issue 57: a type checker in ``make test``. ``python -m mypy`` over ``nvrx_lab`` with pyproject.toml's ``[tool.mypy]``:

* the modules no CPU test can run (:data:`STRICT`: GPU checks, node health, EKS, the process group runner, the flight
  recorder, checkpoint staging's GPU branches, the replicas' group) are checked in full and have no error;
* the rest of the package is checked with mypy's defaults and may not gain an error: each file's count may only fall
  from :data:`BASELINE` (recorded at the commit that added this test; lower an entry when you fix errors there).

mypy keeps its cache in the repository's ``.mypy_cache`` (mypy writes a ``.gitignore`` there): a second run takes
seconds, a cold one a minute or two (three on a loaded 2-core box).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRICT = ("nvrx_lab/gpucheck/", "nvrx_lab/health/", "nvrx_lab/eks/", "nvrx_lab/process_group.py",
          "nvrx_lab/flight_recorder.py", "nvrx_lab/checkpoint/staging.py", "nvrx_lab/replicas/group.py")
"""Files that must type-check with no error (pyproject's ``check_untyped_defs`` override names the same modules)."""
BASELINE = {
    "bench/_checkpoint_methods.py": 7, "bench/_replicas_torchft.py": 1, "bench/_scale_commit.py": 1,
    "bench/_scale_model.py": 1, "bench/_scale_procs.py": 3, "bench/_scale_replicas.py": 3,
    "bench/_scale_restart.py": 2, "bench/_torchft_replica.py": 2, "bench/checkpoint.py": 2, "bench/efficiency.py": 3,
    "bench/goodput.py": 3, "bench/local.py": 2, "bench/nodes.py": 2, "bench/reliability.py": 2, "bench/replicas.py": 1,
    "bench/stability.py": 1, "bench/straggler.py": 2, "checkpoint/checkpointer.py": 6, "checkpoint/commit.py": 1,
    "checkpoint/direct_read.py": 2, "checkpoint/loading.py": 1, "checkpoint/local.py": 14, "checkpoint/manager.py": 3,
    "checkpoint/planning.py": 6, "checkpoint/replication.py": 1, "checkpoint/shards.py": 3, "checkpoint/writer.py": 4,
    "checkpoint/writer_main.py": 2, "cli.py": 4, "data/indexed.py": 9, "data/tokens.py": 7,
    "demo/checkpointed_worker.py": 1, "demo/state.py": 1, "dist.py": 1, "inprocess/call_wrapper.py": 5,
    "inprocess/interrupt.py": 1, "inprocess/launch.py": 2, "inprocess/loop.py": 1, "inprocess/monitor.py": 2,
    "inprocess/monitor_process.py": 1, "inprocess/rank_assignment.py": 2, "inprocess/rendezvous.py": 5,
    "inprocess/store.py": 5, "inprocess/teardown.py": 1, "inprocess/where.py": 1, "inprocess/wrap.py": 6,
    "launcher/__main__.py": 5, "launcher/agent.py": 11, "launcher/attach.py": 1, "launcher/cli.py": 3,
    "launcher/monitor.py": 8, "launcher/progress.py": 1, "launcher/rounds.py": 2, "launcher/standby.py": 5,
    "liveness.py": 1, "observe/advisor.py": 1, "observe/attribute_judges.py": 2, "observe/attribute_rules.py": 1,
    "observe/goodput.py": 3, "observe/timeline.py": 1, "reliability/__init__.py": 1, "reliability/bad_input.py": 1,
    "reliability/checkpoint_child.py": 1, "reliability/checkpoint_crash.py": 7, "reliability/local_child.py": 8,
    "reliability/local_replica.py": 1, "reliability/restarts.py": 5, "reliability/trainer.py": 1,
    "replicas/admission.py": 2, "replicas/client.py": 8, "replicas/coordinator.py": 1, "replicas/fingerprint.py": 1,
    "replicas/loop.py": 4, "replicas/plane.py": 1, "replicas/protocol.py": 1, "replicas/server.py": 6,
    "replicas/step.py": 1, "runner.py": 5, "shapes.py": 12, "straggler/hooks.py": 2, "straggler/timers.py": 3,
    "train/attempts.py": 1, "train/data.py": 3, "train/hooks.py": 1, "train/loop.py": 3, "train/model.py": 27,
    "train/replicas.py": 1, "train/resume.py": 3, "train/runs.py": 1, "train/state.py": 1, "workbook/__init__.py": 11,
    "workbook/papermill.py": 1,
}
"""Errors per file of ``nvrx_lab/`` (prefix left off) outside STRICT, under mypy's defaults: an upper bound."""
ERROR = re.compile(r"^(nvrx_lab/[^:]+\.py):\d+: error: ", re.M)


def _mypy() -> subprocess.CompletedProcess:
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.fail("mypy is missing from this environment: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=840)


@pytest.mark.timeout(900)
def test_mypy_strict_modules_clean_and_no_new_errors_elsewhere():
    res = _mypy()
    output = res.stdout + res.stderr
    if res.returncode not in (0, 1):  # 2: mypy itself failed (a bad config, a crash)
        pytest.fail(f"mypy exited {res.returncode}:\n{output[-6000:]}")
    found = Counter(ERROR.findall(res.stdout))
    strict = {f: n for f, n in found.items() if f.startswith(STRICT) and n}
    grown = {f: n for f, n in found.items()
             if not f.startswith(STRICT) and n > BASELINE.get(f.removeprefix("nvrx_lab/"), 0)}
    bad = [ln for ln in res.stdout.splitlines() if ln.split(":", 1)[0] in {*strict, *grown}]
    problems = [f"{f}: {n} error(s), none allowed (checked in full)" for f, n in sorted(strict.items())]
    problems += [f"{f}: {n} error(s), {BASELINE.get(f.removeprefix('nvrx_lab/'), 0)} recorded" for f, n in sorted(grown.items())]
    fallen = sorted(f"{f}: {found.get('nvrx_lab/' + f, 0)} (recorded {n})" for f, n in BASELINE.items()
                    if found.get("nvrx_lab/" + f, 0) < n)
    if fallen:  # shown with -rP or on a failure: lower these entries
        print("fewer errors than recorded, lower BASELINE:", *fallen, sep="\n  ")
    assert not problems, "\n".join(problems + ["", *bad])
