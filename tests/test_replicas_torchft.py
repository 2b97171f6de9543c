"""torchft 0.2.0's peer row of ``python -m nvrx_lab.bench replicas`` (:mod:`nvrx_lab.bench._replicas_torchft`): a
replica group SIGKILLed mid-run, its survivors train on, torchrun-style supervision starts a replacement that heals
from them. Skipped without the peers extra (``pip install -e '.[peers]'``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (the peers extra: pip install -e '.[peers]')")

from nvrx_lab.bench._replicas_torchft import run_torchft  # noqa: E402

KEYS = {"system", "fault", "survivor_stall_x", "steps_lost", "heal_s", "samples_lost", "samples_duplicated", "goodput",
        "samples_per_s", "median_step_s", "wall_s", "log_dir"}


@pytest.mark.timeout(150)
def test_survivors_of_a_sigkill_train_on_and_the_replacement_heals(tmp_path):
    row = run_torchft("sigkill", tmp_path, replicas=3, steps=24, fault_step=8, timeout_s=60)
    assert set(row) == KEYS
    assert row["system"] == "torchft 0.2.0 (README)" and row["fault"] == "sigkill" and row["goodput"] is None
    assert row["steps_lost"] <= 1, row  # the survivors redo at most the step the fault broke
    assert row["heal_s"] > 0 and row["survivor_stall_x"] > 1 and row["samples_per_s"] > 0, row
    assert row["samples_duplicated"] > 0, row  # the replacement's sampler starts its shard over (torchft/data.py)
