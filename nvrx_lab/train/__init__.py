"""The trainer (``python -m nvrx_lab.train``): a small Llama-style decoder sharded with FSDP2, on synthetic
deterministic data, that composes the layers.

One concept a file: :mod:`.config` (every flag), :mod:`.model` and :mod:`.data`, :mod:`.state` (the sharded
model and what a resume needs), :mod:`.loop` (one attempt: :func:`train`), :mod:`.hooks` (the moments a
layer joins), :mod:`.layers` (the layers the flags ask for), :mod:`.attempts` (plainly or inside the
in-process restart wrapper), :mod:`.runs` (a new run or the continuation of one), :mod:`.resume` (what a
(re)start says), :mod:`.main` (the command line). Introduced in ``notebooks/00_overview.ipynb``.
"""

from nvrx_lab.train.config import TrainConfig
from nvrx_lab.train.loop import train
from nvrx_lab.train.main import main
from nvrx_lab.train.state import TrainState, build_model

__all__ = ["TrainConfig", "TrainState", "build_model", "main", "train"]
