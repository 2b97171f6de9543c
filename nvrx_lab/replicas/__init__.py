"""Replica-level fault tolerance: the survivors never go back (no restart, no checkpoint reload).

The job is R replica groups, each a whole copy of the model (FSDP inside a group). Each step the groups' gradients
are summed across groups over torch's own process groups (:mod:`.group`: gloo here, NCCL on a GPU; made when the
members change, watched so that no failure wedges a rank), and a coordinator forms a quorum per step
(:mod:`.coordinator`, :mod:`.protocol`); a member the others wait for is judged by the work its device completes
(:mod:`.progress`, :mod:`.probe`): hung, dropped; slow, waited for:

* a step commits only when every member of its quorum finished it, so no update is applied half-way;
* a failed group (an exception, a SIGKILL, a hang the others wait for) is dropped; the survivors redo that one step
  with its rows of the batch (:class:`.protocol.StepShares`), so the global batch stays what the config says;
* its launcher starts a replacement, which takes a live group's state over a connection of its own (:mod:`.heal`) and
  joins at a step boundary; nobody reloads a checkpoint;
* a lost coordinator (its process or node) costs a reconnect, not the training: the ranks reach its replacement at
  the same address and it goes on from the last committed step they report (:mod:`.admission`);
* with storage checkpoints (``--ckpt``), the lowest live replica saves every ``--ckpt-interval`` steps, so losing every
  group at once is a resume from the newest checkpoint, not a restart from step 1;
* every rank writes which rows it contributed; :mod:`.ledger` checks every sample of every committed step was
  trained exactly once, and every few steps that the replicas' parameters agree (:mod:`.fingerprint`).

A training loop of one's own runs the same machinery through :class:`.loop.ReplicaLoop` (``from
nvrx_lab.replicas.loop import ReplicaLoop``; its docs show the three things a script gives it;
``nvrx_lab.demo.replica_worker`` is a whole one). This package imports nothing itself: the coordinator's process and
the light tools load only what they use. The trainer's side is
``python -m nvrx_lab.train --restart replicas --coordinator HOST:PORT --replica-id R
--replicas N`` (:mod:`nvrx_lab.train.replicas`); ``python -m nvrx_lab.replicas.local`` runs a coordinator and N
torchrun groups on one machine. Notebook ``09_survivors``; ``python -m nvrx_lab.bench replicas`` measures it against
torchft 0.2.0.
"""
