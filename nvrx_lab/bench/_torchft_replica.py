"""One torchft 0.2.0 replica group (one rank), run as torchft's README and ``train_ddp.py`` run one.

::

    python -m nvrx_lab.bench._torchft_replica --replica 0 --replicas 3 --lighthouse http://127.0.0.1:PORT \\
        --events OUT/replica0.jsonl --go OUT/go --stop OUT/stop [--fault sigkill --fault-step 15 --victim 1]

Started by :mod:`._replicas_torchft`, one process per replica group: a ``Manager`` on a ``ProcessGroupGloo``
that asks the lighthouse for a quorum every step, torchft's ``DistributedDataParallel`` (with its comm hook's
error path fixed: :class:`FixedDDP`) and ``Optimizer``, and torchft's ``DistributedSampler`` over the replica
groups. The model, data, loss and optimizer are ours (the trainer's :class:`~nvrx_lab.train.model.Transformer`,
unsharded; :class:`~nvrx_lab.train.data.SyntheticTokens`; AdamW), so a step costs what one of ours does.

Sample ``i`` is row ``i % global_batch`` of our global batch ``i // global_batch``. The sampler runs unshuffled
(torch's ``DistributedSampler`` shuffles by default): with every group in the quorum, step ``k`` trains samples
``B(k-1) .. Bk - 1``, the global sequence our trainer trains, so the parent's ledger compares the two. The
checkpoint transport is ``PGTransport`` (10 s, as torchft's DDP examples set it): it sends over the gloo group, on
loopback, where the Manager's default ``HTTPTransport`` serves on every interface
(``checkpointing/http_transport.py:135-144``). The Manager's own server binds ``[::]`` (``manager.py:312``).

Every step attempt appends one ``step`` event to ``--events``: ``step`` (the step it committed, or the one it
tried), ``replica``, ``participating`` (false while healing: its gradients were zeroed), ``committed``,
``sample_ids`` (its batch) and ``loss``. The fault fires once, after the forward pass of the step that would
commit ``--fault-step``, on ``--victim`` (:func:`nvrx_lab.faults.inject`: ``exception``, ``sigkill``, ``hang``).
Training starts when ``--go`` exists and ends at the committed step written to ``--stop``.
"""

# No ``from __future__ import annotations``: DDP checks the comm hook's annotations against the classes themselves.
import argparse
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, Dataset
from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

from nvrx_lab.faults import Fault, inject
from nvrx_lab.net import listen, wait_for
from nvrx_lab.observe.events import EventLog
from nvrx_lab.train.data import SyntheticTokens
from nvrx_lab.train.model import ModelConfig, Transformer

LOOPBACK = "127.0.0.1"


class FixedDDP(DistributedDataParallel):
    """torchft 0.2.0's ``DistributedDataParallel`` with the error path of its comm hook fixed.

    The stock hook (``torchft/ddp.py:66-77``) waits for ``manager.allreduce(bucket)`` and returns
    ``work.get_future()._fut`` after ``assert fut._fut``. When the allreduce fails (a peer died, or gloo timed
    out), ``_ManagedWork.wait`` reports the error to the Manager and returns before it builds that future chain
    (``manager.py:1322-1337``): ``_fut`` is None and the ``AssertionError`` leaves ``loss.backward()``. Once the
    Manager has errored, ``allreduce`` returns a ``_DummyWork`` (``manager.py:436-437``) whose plain future has
    no ``_fut`` at all (``AttributeError``; torchft issue 304). Either way every survivor of a fault crashes,
    and with no one left holding the state training starts over from step 0 (measured here: every exception
    and hang, and each SIGKILL that lands in an allreduce). Upstream main (7eb7087) has the same hook.

    Here a failed bucket's future completes with the bucket as it is: the Manager has recorded the error, so
    ``should_commit()`` votes no and the step is dropped and retried, which is what torchft intends.
    """

    @staticmethod
    def _comm_hook(state: Manager, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        work.wait()
        fut = work.get_future()
        inner = getattr(fut, "_fut", None)
        if inner is not None:
            return inner
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


class TokenSamples(Dataset):
    """Our synthetic token stream as a map-style data set: sample ``i`` = (``i``, inputs, targets) of row
    ``i % global_batch`` of global batch ``i // global_batch`` (``batches`` of them)."""

    def __init__(self, data: SyntheticTokens, batches: int = 100_000):
        self.data, self.batches = data, batches
        self._batch = lru_cache(maxsize=4)(data.global_batch_at)

    def __len__(self) -> int:
        return self.batches * self.data.global_batch

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        row = self._batch(i // self.data.global_batch)[i % self.data.global_batch]
        return i, row[:-1], row[1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m nvrx_lab.bench._torchft_replica", description=__doc__.split("\n")[0])
    ap.add_argument("--replica", type=int, required=True, help="this replica group's index")
    ap.add_argument("--replicas", type=int, required=True, help="replica groups (the sampler's shards)")
    ap.add_argument("--lighthouse", required=True, help="the lighthouse's http://HOST:PORT")
    ap.add_argument("--events", required=True, help="event stream (JSON lines, appended)")
    ap.add_argument("--go", required=True, help="training starts once this file exists")
    ap.add_argument("--stop", required=True, help="a file that will hold the committed step to stop at")
    ap.add_argument("--incarnation", type=int, default=0, help="0 for the first process of this replica, then 1, ...")
    ap.add_argument("--fault", choices=["exception", "sigkill", "hang"], help="the fault --victim injects")
    ap.add_argument("--fault-step", type=int, default=15, help="the step the fault hits")
    ap.add_argument("--victim", type=int, default=1, help="the replica that injects it")
    ap.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo timeout, s")
    ap.add_argument("--manager-timeout", type=float, default=30.0, help="Manager timeout, s")
    ap.add_argument("--quorum-timeout", type=float, default=60.0, help="Manager quorum timeout, s")
    ap.add_argument("--transport-timeout", type=float, default=10.0, help="PGTransport timeout, s")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--n-heads", type=int, default=2)
    ap.add_argument("--hidden-dim", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=12, help="samples per step over all replica groups")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


@dataclass
class Replica:
    """What one replica group trains with."""

    store: TCPStore
    """The group's store (torchrun would serve it): the Manager and each new quorum's process group meet there."""
    manager: Manager
    ddp: FixedDDP
    optimizer: Optimizer
    sampler: DistributedSampler
    loader: DataLoader


def build(a: argparse.Namespace) -> Replica:
    """The Manager and what it wraps, as ``train_ddp.py`` builds them (1 rank per group, so no torchrun: this
    process serves the group's store, on loopback)."""
    cfg = ModelConfig(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, hidden_dim=a.hidden_dim, seq_len=a.seq_len)
    torch.manual_seed(a.seed)
    model = Transformer(cfg)
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    sock = listen(LOOPBACK)
    store = TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                     master_listen_fd=sock.detach())
    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"train_ddp_{a.replica}", timeout=timedelta(seconds=a.manager_timeout),
        quorum_timeout=timedelta(seconds=a.quorum_timeout),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=a.transport_timeout), device=torch.device("cpu")),
        store_addr=LOOPBACK, store_port=store.port, rank=0, world_size=1, lighthouse_addr=a.lighthouse,
        hostname=LOOPBACK)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, a.global_batch, seed=a.seed)
    sampler = DistributedSampler(TokenSamples(data), replica_rank=a.replica, num_replica_groups=a.replicas,
                                 group_rank=0, num_replicas=1, shuffle=False)
    loader = DataLoader(sampler.dataset, batch_size=a.global_batch // a.replicas, sampler=sampler)
    return Replica(store, manager, FixedDDP(manager, model), Optimizer(manager, inner), sampler, loader)


def stop_step(path: Path) -> int | None:
    """The committed step to stop at, once the parent has written it (atomically)."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return None


def train(a: argparse.Namespace, events: EventLog, replica: Replica) -> int:
    """torchft's training loop; one ``step`` event per attempt. Returns the last committed step."""
    manager, ddp, opt = replica.manager, replica.ddp, replica.optimizer
    fault = Fault(a.victim, a.fault_step, a.fault) if a.fault and a.victim == a.replica else None
    stop, epoch, parent = None, 0, os.getppid()
    while True:
        replica.sampler.set_epoch(epoch)
        for ids, inputs, targets in replica.loader:
            if os.getppid() != parent:  # orphaned: no one will write the stop file
                raise SystemExit(f"replica {a.replica}: the process that started it is gone")
            tried = manager.current_step() + 1
            opt.zero_grad()  # starts the quorum (asynchronously)
            logits = ddp(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            if fault is not None and tried >= fault.step:
                events.emit("fault", step=tried, fault=fault.kind, replica=a.replica)
                inject(fault, a.replica)
            loss.backward()  # waits for the quorum, heals if behind, allreduces through the comm hook
            healed_to, participating = manager.current_step(), manager.is_participating()
            opt.step()  # should_commit: the group's vote; on yes the optimizer steps and the step counts
            step = manager.current_step()
            events.emit("step", step=step if step > healed_to else healed_to + 1, replica=a.replica,
                        incarnation=a.incarnation, participating=participating, committed=step > healed_to,
                        sample_ids=ids.tolist(), loss=loss.item())
            stop = stop if stop is not None else stop_step(Path(a.stop))
            if stop is not None and step >= stop:
                return step
        epoch += 1


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    events = EventLog(a.events, rank=a.replica)
    events.emit("start", replica=a.replica, incarnation=a.incarnation)
    replica = build(a)
    events.emit("ready", replica=a.replica, incarnation=a.incarnation)
    wait_for(Path(a.go).exists, a.quorum_timeout, "the go file (every replica group's Manager up)")
    step = train(a, events, replica)
    events.emit("done", replica=a.replica, incarnation=a.incarnation, step=step)
    replica.manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal exit: tearing down the interpreter under torchft's threads (the Rust runtime, a gloo group)
    # sometimes aborts ("terminate called without an active exception", exit -6) after a clean finish.
    os._exit(code)
