"""In-process restart (``nvrx_lab.inprocess``)
============================================

Restart a failed or hung training function *inside the same processes*: no new interpreter, no
``import torch``, no new CUDA context. Mirrors NVRx's ``inprocess.Wrapper`` and closes two of its
gaps on CPU/gloo: a rank blocked in a **gloo** collective is unblocked at once (its sockets are
cut, :mod:`.interrupt`), and a rank sitting in ``time.sleep`` or a blocking read is interrupted
by a signal instead of waiting for the hard timeout.

One concept a file: :mod:`.wrap` (the decorator and its settings, and what each component gets of
them), :mod:`.launch` (torchrun's environment, read once), :mod:`.loop` (the attempt loop),
:mod:`.call_wrapper`, :mod:`.store`, :mod:`.monitor` (thread), :mod:`.monitor_process`
(hard timeout, death notice, store host), :mod:`.interrupt`, and the policies :mod:`.abort`,
:mod:`.health_check`, :mod:`.rank_assignment`; :mod:`.teardown` (what an attempt's end
releases, in which order); :mod:`.restart_log`; :mod:`.spawn` (a local
launcher that lets survivors run); ``nvrx_lab.demo.inprocess_worker`` is a small wrapped training
loop with scheduled faults (tests, reliability suite, notebook). Introduced in
``notebooks/02_in_process_restart.ipynb``.
"""

from .abort import Abort, AbortCallback, AbortTorchDistributed
from .call_wrapper import CallWrapper, ConfigError
from .compose import Compose
from .health_check import CudaHealthCheck, FaultCounter, HealthCheck, HealthCheckError, default_health_check
from .interrupt import RankShouldRestart
from .progress import NoProgress, ProgressCount
from .rank_assignment import FillGaps, RankAssignment, ShiftRanks
from .restart_log import RestartLimitError, RestartRecord
from .state import State
from .wrap import Wrapper

__all__ = [
    "Wrapper", "CallWrapper", "ConfigError", "State", "RankShouldRestart", "RestartLimitError", "RestartRecord",
    "NoProgress", "ProgressCount",
    "Abort", "AbortTorchDistributed", "AbortCallback", "Compose",
    "HealthCheck", "CudaHealthCheck", "FaultCounter", "HealthCheckError", "default_health_check",
    "RankAssignment", "ShiftRanks", "FillGaps",
]
