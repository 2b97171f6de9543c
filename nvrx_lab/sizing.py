"""What a model's training state weighs on each rank, by arithmetic (torch-free): the trainer's ``MODEL`` line at start, the EKS
pod's ``/dev/shm`` and the check that a job fits its nodes (:mod:`nvrx_lab.eks.checks`).

Per parameter, kept sharded over the ranks that shard it (FSDP: every rank; HSDP: world / replicate): fp32
weights (4 bytes), fp32 gradients (4) and AdamW's two fp32 moments (8). A checkpoint holds the weights and the
moments, 12 bytes a parameter, and the async checkpoint stages this rank's share of it in shared memory. While the
model computes, FSDP2 holds some of it whole: the root's own weights (the embedding, the head, the final norm) for
the whole step, the block computing and the next one (prefetched), all in the compute dtype; and in the backward a
unit's whole gradient twice (autograd's, in the compute dtype, and the reduce-scatter's fp32 copy of it). Activations
are not counted (they depend on the batch, the sequence and activation checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass

from nvrx_lab.shapes import ModelConfig, parameters, units

WEIGHT, GRAD, MOMENTS = 4, 4, 8
"""Bytes a parameter of fp32 weights, fp32 gradients and AdamW's two fp32 moments."""
CHECKPOINT = WEIGHT + MOMENTS
"""Bytes a parameter a checkpoint holds (weights and moments)."""
GB = 1e9


@dataclass(frozen=True)
class StateSize:
    """One rank's share of the training state of a model sharded over ``shards`` ranks."""

    parameters: int
    """Parameters of the whole model."""
    root: int
    """Parameters of the root's own unit (the embedding, the head unless tied, the final norm)."""
    block: int
    """Parameters of one block."""
    shards: int
    """Ranks each parameter is sharded over."""
    compute_bytes: int = 4
    """Bytes a gathered weight takes: 4 in fp32, 2 in bf16."""
    staged: bool = False
    """Whether the async checkpoint stages this rank's share in shared memory."""

    @property
    def weights(self) -> float:
        return WEIGHT * self.parameters / self.shards

    @property
    def grads(self) -> float:
        return GRAD * self.parameters / self.shards

    @property
    def optimizer(self) -> float:
        return MOMENTS * self.parameters / self.shards

    @property
    def staging(self) -> float:
        return CHECKPOINT * self.parameters / self.shards if self.staged else 0.0

    @property
    def transient(self) -> float:
        """The root's weights and two blocks' gathered, and the largest unit's whole gradient twice."""
        gathered = (self.root + 2 * self.block) * self.compute_bytes
        return gathered + max(self.root, self.block) * (self.compute_bytes + GRAD)

    @property
    def state(self) -> float:
        """What stays for the whole run: weights, gradients, moments and the staging copy."""
        return self.weights + self.grads + self.optimizer + self.staging

    @property
    def on_device(self) -> float:
        """What a GPU holds before activations: weights, gradients, moments and what the model holds whole while it
        computes (the async staging is host memory)."""
        return self.weights + self.grads + self.optimizer + self.transient

    @property
    def peak(self) -> float:
        return self.state + self.transient

    @property
    def checkpoint(self) -> float:
        """Bytes of one checkpoint of the whole model."""
        return CHECKPOINT * self.parameters

    def line(self, preset: str, world: int) -> str:
        """The trainer's one line at start."""
        count = f"{self.parameters / 1e9:.3g} B" if self.parameters >= 1e9 else f"{self.parameters:,}"
        over = f"{self.shards} rank{'s' * (self.shards > 1)}" + \
            (f" ({world // self.shards} replicas)" if world != self.shards else "")
        staged = f", async staging {_gb(self.staging)}" if self.staged else ""
        return (f"MODEL {preset}: {count} parameters sharded over {over}; each rank holds {_gb(self.state)} of state "
                f"(weights {_gb(self.weights)}, gradients {_gb(self.grads)}, AdamW {_gb(self.optimizer)}{staged}) and up "
                f"to {_gb(self.transient)} more while the model computes; a checkpoint is {_gb(self.checkpoint)}")


def _gb(n: float) -> str:
    return f"{n / GB:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def state_size(cfg: ModelConfig, shards: int, bf16: bool = False, staged: bool = False) -> StateSize:
    """``cfg``'s state per rank, sharded over ``shards`` ranks."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return StateSize(parameters(cfg), *units(cfg), shards, 2 if bf16 else 4, staged)
