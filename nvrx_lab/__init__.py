"""nvrx_lab — resilient PyTorch training, built step by step.

Three layers, each adoptable on its own, plus the glue that measures them:

* :mod:`nvrx_lab.checkpoint` — async checkpointing (notebook 01)
* :mod:`nvrx_lab.inprocess`  — in-process restart (notebook 02)
* :mod:`nvrx_lab.launcher`   — in-job restart launcher with rank heartbeats (notebook 03)
* :mod:`nvrx_lab.eks`        — Kubernetes manifests and submission for EKS p5 (notebooks 05, 06)

The trainer (:mod:`nvrx_lab.train`) composes them; :mod:`nvrx_lab.observe.events` is the one event
stream everything writes and everything that measures reads. Start with
``notebooks/00_overview.ipynb``.
"""

import warnings

__version__ = "0.1.0"

# The peers extra (NVRx 0.4.1) installs the old ``pynvml`` wrapper, which warns on every ``import torch``
# (torch.cuda imports it); every command of ours would print two lines of noise before its own output.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
