"""The six ways a job runs, and what each needs from Kubernetes, the launcher and NCCL.

========================  =====================  ==========================  ==========================
mode                      launcher               who restarts after a fault  trainer flags
========================  =====================  ==========================  ==========================
baseline                  torchrun               Kubernetes (new pods)       ``--ckpt sync``
async_ckpt                torchrun               Kubernetes (new pods)       ``--ckpt async``
inprocess                 torchrun               the trainer, in-process     ``--restart inprocess``
ft_launcher               nvrx_lab.launcher      the launcher, in the pod    ``--restart launcher``
ft_launcher+inprocess     nvrx_lab.launcher      both (min-healthy)          ``--restart launcher+inprocess``
replicas                  torchrun per group     torchrun, in the group's    ``--restart replicas``
                                                 pods; the others go on
========================  =====================  ==========================  ==========================

``replicas`` is the one mode of several Jobs: R replica groups, each an Indexed Job of its own with
torchrun's c10d rendezvous inside it, plus a coordinator StatefulSet that forms a quorum per step
(:mod:`nvrx_lab.eks.replicas`, :mod:`nvrx_lab.replicas`). A failed group's workers are replaced by its
torchrun (``--max-restarts``) and heal from a live group; the other groups never stop, so no checkpoint
is written or read (the trainer refuses ``--ckpt`` there).

The NCCL settings differ by what must survive an error. Under Kubernetes restarts the process
should die fast so the pod fails (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, PyTorch's default,
written out). Under the launcher it should abort its communicators and exit, so the launcher
sees the exit within its monitor interval (``=1``, what NVRx's ft_launcher sets). In-process
restart must keep the process: the watchdog only aborts the communicator (``=2``), CUDA and NCCL
errors are not rethrown from the watchdog thread (``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``), and
NVLink SHARP is off (``NCCL_NVLS_ENABLE=0``): NVLS multicast buffers are not released by
``ncclCommAbort``, so the re-created communicator of the next attempt would fail or leak memory
(NVRx's in-process usage guide lists both as requirements).
"""

from __future__ import annotations

from dataclasses import dataclass

OFI_NET = "AWS Libfabric"
"""``NCCL_NET`` of the aws-ofi-nccl plugin: its name up to 1.11; later versions are called "Libfabric" but take
this name too when ``NCCL_NET`` asks for it, so one value works with every DLC and EFA installer."""

@dataclass(frozen=True)
class Mode:
    name: str
    """The mode's name, as in ``JobSpec.mode``."""
    launcher: str
    """``torchrun`` (``python -m torch.distributed.run``) or ``launcher`` (``python -m nvrx_lab.launcher``)."""
    restart: str
    """The trainer's ``--restart`` value."""
    ckpt: str
    """The trainer's ``--ckpt`` value unless the spec sets one."""
    restart_policy: str
    """The launcher's ``--restart-policy`` (launcher modes only)."""
    kubernetes_restarts: bool
    """Whether a fault is recovered by Kubernetes replacing pods (large ``backoffLimit``)."""
    summary: str
    """One line for people."""

    @property
    def inprocess(self) -> bool:
        return "inprocess" in self.restart

    @property
    def uses_launcher(self) -> bool:
        return self.launcher == "launcher"

    @property
    def replicated(self) -> bool:
        """Several replica groups (one Indexed Job each) and their coordinator, instead of one Job."""
        return self.restart == "replicas"


MODES: dict[str, Mode] = {m.name: m for m in [
    Mode("baseline", "torchrun", "none", "sync", "", True,
         "torchrun; a fault fails the pod and Kubernetes starts a new one (backoffLimit, podFailurePolicy)"),
    Mode("async_ckpt", "torchrun", "none", "async", "", True,
         "as baseline, with asynchronous checkpoints that overlap training"),
    Mode("inprocess", "torchrun", "inprocess", "sync", "", True,
         "torchrun; Python exceptions are recovered in-process, a dead process falls back to Kubernetes"),
    Mode("ft_launcher", "launcher", "launcher", "sync", "any-failed", False,
         "nvrx_lab.launcher restarts the worker group in the pod on a crash or missed heartbeats"),
    Mode("ft_launcher+inprocess", "launcher", "launcher+inprocess", "sync", "min-healthy", False,
         "exceptions recovered in-process; crashes and hangs by the launcher (min-healthy)"),
    Mode("replicas", "torchrun", "replicas", "none", "", False,
         "replica groups, one Indexed Job each; a failed group's torchrun replaces its workers, which heal from a live "
         "group while the others train on (nvrx_lab.replicas)"),
]}


def mode(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"JobSpec.mode: unknown mode {name!r}; allowed: {', '.join(MODES)}") from None


def flight_recorder_env(entries: int) -> list[tuple[str, str, str]]:
    """(name, value, why) of PyTorch's NCCL flight recorder: the last ``entries`` collectives of every rank, dumped
    on FSx (``$(RUN_DIR)``, which the manifest defines first) when a collective times out; none for 0."""
    if not entries:
        return []
    return [
        ("TORCH_FR_BUFFER_SIZE", str(entries), "NCCL flight recorder (torch 2.13's name of TORCH_NCCL_TRACE_BUFFER_SIZE): "
                                               "the last collectives of each rank, to tell which rank a hang waits for"),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", "a collective that times out dumps every rank's recorder"),
        ("TORCH_FR_DUMP_TEMP_FILE", "$(RUN_DIR)/nccl-trace/rank_", "dumps on FSx, where they outlive the pod (torch "
                                                                   "appends the rank)"),
    ]


def nccl_env(m: Mode, efa: int, efa_rdma: bool, hugepages: bool, nccl_debug: str) -> list[tuple[str, str, str]]:
    """(name, value, why) of the EFA, NCCL and PyTorch variables mode ``m`` needs."""
    env = [
        ("PYTHONUNBUFFERED", "1", "logs reach `kubectl logs` (and the goodput pick-up) line by line"),
        ("NCCL_DEBUG", nccl_debug, "WARN: errors and the transport chosen; INFO to debug EFA set-up"),
        ("NCCL_SOCKET_IFNAME", "^docker,lo,veth", "NCCL's bootstrap sockets on the pod's VPC interface, never loopback or veth"),
    ]
    if efa:
        env += [
            ("NCCL_NET", OFI_NET, "only the aws-ofi-nccl plugin: NCCL fails at start-up if it does not load, never falls "
                                  "back to TCP sockets"),
            ("FI_PROVIDER", "efa", "libfabric uses the EFA provider (aws-ofi-nccl), never its TCP fallback"),
        ]
        if efa_rdma:
            env.append(("FI_EFA_USE_DEVICE_RDMA", "1", "GPUDirect RDMA over EFA (p4d/p5); GPU memory goes to the NIC "
                                                       "without a host copy"))
        if hugepages:
            env.append(("FI_EFA_USE_HUGE_PAGE", "1", "libfabric's bounce buffers on the requested 2 MiB pages; no "
                                                     "FI_EFA_FORK_SAFE, "
                        "which would turn them off (forks are safe anyway on kernels >= 5.13: copy-on-fork of registered "
                        "memory)"))
        else:
            env += [
                ("FI_EFA_FORK_SAFE", "1", "dataloader workers fork after EFA registered memory (the checkpoint writer is a "
                                          "fresh interpreter, not a fork)"),
                ("FI_EFA_USE_HUGE_PAGE", "0", "no hugepages requested: libfabric allocates its buffers from normal pages"),
            ]
    if m.inprocess:
        env += [
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", "in-process restart: the watchdog aborts the communicator but keeps "
                                                     "the process"),
            ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0", "in-process restart: CUDA/NCCL errors are not rethrown from the "
                                                    "watchdog thread (which kills the process)"),
            ("NCCL_NVLS_ENABLE", "0", "in-process restart: NVLS multicast memory is not freed by ncclCommAbort; the next "
                                      "attempt's communicator would fail"),
        ]
    elif m.replicated:
        env.append(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "replicas: tear the process down on an NCCL error, so the "
                                                            "group's torchrun replaces its workers (the others go on)"))
    elif m.uses_launcher:
        env.append(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "launcher: abort the communicator and exit, so the launcher "
                                                            "sees the failure within --monitor-interval"))
    else:
        env.append(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "Kubernetes restarts: tear the process down on an NCCL error so "
                                                            "the pod fails fast"))
    return env
