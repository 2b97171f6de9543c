"""Straggler detection (``nvrx_lab.straggler``)
=============================================

At 1,024 GPUs one slow GPU, a throttled node or a noisy neighbour slows every synchronous step to its
pace, and nothing fails: no exception, no missed heartbeat. This layer finds the rank that is alive but
slow, says how slow, and optionally acts on it. Mirrors NVRx's ``straggler`` package and its names
(``Detector``, sections, ``relative_perf_scores``, ``individual_perf_scores``), built on plain
``torch.distributed``; it imports no other layer.

* :mod:`.timers` — :class:`ComputeTimer`: each rank times its own compute per step in sections
  (``forward`` of leaf modules, ``optimizer``), excluding the time spent waiting in collectives;
  CPU time on CPU, CUDA events on GPUs;
* :mod:`.scores` — the scores, pure functions of every rank's mean section times;
* :mod:`.detector` — :class:`Detector`: every ``interval`` steps one all-gather of a few floats per
  rank over the CPU group, then the same :class:`Report` on every rank;
* :mod:`.hooks` — :class:`StragglerHooks`, the trainer's side (``--straggler-interval``,
  ``--straggler-threshold``, ``--straggler-action report|restart``): ``straggler`` events, a
  ``STRAGGLER`` console line, and a health check that makes a persistent straggler leave at an
  in-process restart.

Introduced in ``notebooks/08_stragglers.ipynb``; ``python -m nvrx_lab.bench straggler`` measures it.
"""

from .detector import Detector
from .hooks import ACTIONS, StragglerDetected, StragglerError, StragglerHooks
from .scores import Report, Straggler, identify_stragglers, individual_perf_scores, relative_perf_scores
from .timers import SECTIONS, ComputeTimer

__all__ = ["ACTIONS", "SECTIONS", "ComputeTimer", "Detector", "Report", "Straggler", "StragglerDetected",
           "StragglerError", "StragglerHooks", "identify_stragglers", "individual_perf_scores",
           "relative_perf_scores"]
