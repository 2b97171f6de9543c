"""What a model's training state weighs on each rank, by arithmetic (torch-free): the trainer's ``MODEL`` line at start, the EKS
pod's ``/dev/shm`` and the check that a job fits its nodes (:mod:`nvrx_lab.eks.checks`); and how often the
launchers' rendezvous beats and polls for a job's size (below).

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


# The launchers' c10d rendezvous: how often it beats and polls. The rules (:func:`timing`, the launcher's
# ``--rdzv-conf``) and the sizes a job renders (:func:`for_nodes`, :func:`problem`).
#
# Two settings make most of a hot spare's takeover (``python -m nvrx_lab.bench nodes``): the keep-alive (a lost node
# leaves the round ``KEEP_ALIVE_ATTEMPTS`` of them after its last beat) and the poll (a node reads the state this often
# while a round forms; the takeover waits for two reads). Both cost index 0's store: every beat and every read moves the
# whole state, about ``STATE_BYTES_PER_NODE`` a node, so N nodes at an interval T move N² x 130 B x 2 / T a second.
#
# Measured here (a ``TCPStore`` on loopback, 4 clients of ``get`` + ``compare_set``): 15,000 requests/s of a 20 kB state
# (150 nodes), 3,300 of a 130 kB state (1,000 nodes), about 850 MB/s. ``STORE_BUDGET_MBPS`` keeps the rendezvous
# under a quarter of that: a 0.2 s poll up to 392 nodes and a 0.5 s keep-alive up to 620, longer above; at 2,048
# nodes a 5.5 s keep-alive, about torch's own default (5 s).

KEEP_ALIVE_ATTEMPTS = 3
"""torch's ``keep_alive_max_attempt``."""
FAST_KEEP_ALIVE_S, FAST_POLL_S = 0.5, 0.2
STATE_BYTES_PER_NODE = 130
"""The c10d state pickled (98-110 bytes a node for 16 to 1,024 nodes with the rendered sort keys), then base64."""
STORE_BUDGET_MBPS = 200.0
TORCH_POLL_S = 1.0
"""torch's c10d handler: a node in a forming round reads the shared state once a second (``_delay(seconds=1)``), and
its state holder serves a cached copy younger than a second."""


def timing(config: dict) -> tuple[float, int, float]:
    """``--rdzv-conf``'s ``keep_alive_interval`` (seconds, a fraction allowed; torch's 5), ``keep_alive_max_attempt``
    (torch's 3) and ``poll_interval`` (ours: seconds between reads of the state while a round forms; torch's 1). A node
    whose last keep-alive is older than interval x attempts is dropped; in a forming round a node beats once a poll,
    so that product must be at least two polls. ``ValueError`` naming the keys otherwise."""
    raw = {k: config.get(k, d) for k, d in (("keep_alive_interval", 5), ("keep_alive_max_attempt", 3),
                                            ("poll_interval", TORCH_POLL_S))}
    try:
        interval, attempts, poll = float(raw["keep_alive_interval"]), int(raw["keep_alive_max_attempt"]), \
            float(raw["poll_interval"])
    except (TypeError, ValueError):
        interval = attempts = poll = 0
    given = ",".join(f"{k}={v}" for k, v in raw.items())
    if not (interval > 0 and attempts >= 1 and 0.01 <= poll <= TORCH_POLL_S):
        raise ValueError(f"--rdzv-conf {given}: keep_alive_interval takes seconds > 0 (e.g. 0.5), "
                         f"keep_alive_max_attempt a whole number >= 1, poll_interval seconds from 0.01 to 1")
    if interval * attempts < 2 * poll:
        raise ValueError(f"--rdzv-conf {given}: a node beats once a poll while a round forms, so keep_alive_interval x "
                         f"keep_alive_max_attempt ({interval * attempts:g} s) must be at least 2 x poll_interval "
                         f"({2 * poll:g} s), or live nodes are dropped")
    return interval, attempts, poll


def store_mbps(nodes: int, every_s: float) -> float:
    """MB/s through index 0's store when ``nodes`` each read and write the whole state every ``every_s``."""
    return nodes * nodes * STATE_BYTES_PER_NODE * 2 / every_s / 1e6


def for_nodes(nodes: int, keep_alive_s: float | None = None, poll_s: float | None = None) -> tuple[float, float]:
    """The keep-alive and the poll (seconds) for ``nodes`` (spares included): the ones given, else the fastest that
    keeps the store within ``STORE_BUDGET_MBPS`` (rounded up to a tenth of a second)."""
    least = -(-store_mbps(nodes, 1.0) * 10 // STORE_BUDGET_MBPS) / 10  # the shortest interval within budget
    poll = poll_s if poll_s is not None else min(TORCH_POLL_S, max(FAST_POLL_S, least))
    keep = keep_alive_s if keep_alive_s is not None else max(FAST_KEEP_ALIVE_S, poll, least)
    return keep, poll


def problem(nodes: int, keep_alive_s: float, poll_s: float) -> tuple[str, str] | None:
    """``(field, what is wrong)`` for settings the launcher would refuse or the store could not carry, else None."""
    try:
        timing({"keep_alive_interval": keep_alive_s, "keep_alive_max_attempt": KEEP_ALIVE_ATTEMPTS,
                "poll_interval": poll_s})
    except ValueError as e:
        return ("rdzv_poll_s" if not 0.01 <= poll_s <= TORCH_POLL_S else "rdzv_keep_alive_s"), f"{e} (as rendered)"
    for name, every in (("rdzv_keep_alive_s", keep_alive_s), ("rdzv_poll_s", poll_s)):
        if (mbps := store_mbps(nodes, every)) > STORE_BUDGET_MBPS and not (name == "rdzv_poll_s" and every == TORCH_POLL_S):
            return name, (f"{every:g} s: {nodes} nodes each moving the {nodes * STATE_BYTES_PER_NODE / 1e3:,.1f} kB "
                          f"rendezvous state that often put {mbps:,.0f} MB/s on index 0's store; allowed: >= "
                          f"{for_nodes(nodes)[0 if name == 'rdzv_keep_alive_s' else 1]:g} s (<= {STORE_BUDGET_MBPS:g} MB/s), "
                          f"or None (chosen from the job's size)")
    return None
