"""What the launcher's agent changes in torch's c10d rendezvous handler, each a wrapper around one of its methods.

* :func:`republish_bootstrap` — a node that joins in a later round (a replaced pod) finds rank 0's address there;
* :func:`wait_only_with_room` — hot spares wait without restarting the groups that train;
* :func:`round_number` — which round admitted this node (a later one: it took a lost node's place);
* :func:`serve_reachable` — a node that becomes group rank 0 serves torch's shared store where it can be reached;
* :func:`left_out` — a node waiting when the rendezvous closed was a spare: the job ended without needing it.

:func:`handler` builds torch's c10d handler itself: a keep-alive that may be a fraction of a second, and a shorter
poll while a round forms (:func:`timing`).
"""

from __future__ import annotations

from nvrx_lab.sizing import TORCH_POLL_S, timing


def handler(params):
    """The rendezvous handler of ``params``: for c10d, torch's own ``DynamicRendezvousHandler`` built as torch's
    registry builds it, except for :func:`timing`: a keep-alive that may be a fraction of a second (torch's parser
    takes whole seconds, its handler a ``timedelta``) and, with ``poll_interval``, :func:`poll_every`. Together they
    are most of a hot spare's takeover: the lost node's keep-alive expiry, then two polls. Other backends: torch's."""
    import torch.distributed.elastic.rendezvous.registry as registry

    if params.backend != "c10d":
        return registry.get_rendezvous_handler(params)
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    interval, attempts, poll = timing(params.config)
    seconds = [params.config.get(f"{k}_timeout") for k in ("join", "last_call", "close", "heartbeat")]
    timeout = RendezvousTimeout(*(None if s in (None, "") else timedelta(seconds=float(s)) for s in seconds))
    backend, store = create_backend(params)
    made = DynamicRendezvousHandler.from_backend(params.run_id, store, backend, params.min_nodes, params.max_nodes,
                                                 params.local_addr, timeout, keep_alive_interval=interval,
                                                 keep_alive_max_attempt=attempts)
    if poll < TORCH_POLL_S:
        poll_every(made, poll)
    return made


def poll_every(made, poll: float) -> None:
    """``made`` reads the rendezvous state every ``poll`` seconds while a round forms, where torch reads it once a second:
    two private settings of torch 2.x, its executor's fixed ``_delay(seconds=1)`` between reads (replaced in this
    process: the launcher holds one handler) and its state holder's one-second cache. Each read is one store request
    for the whole state (about 130 bytes a node, :mod:`nvrx_lab.sizing`): N nodes read N / ``poll`` times a second,
    only while a round forms. ``RuntimeError`` when this torch lacks either (the setting would do nothing)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    holder, torch_delay = getattr(made, "_state_holder", None), getattr(dynamic_rendezvous, "_delay", None)
    if torch_delay is None or not hasattr(holder, "_cache_duration"):
        raise RuntimeError("--rdzv-conf poll_interval: this torch's c10d handler has no _delay or state cache to set")
    inner = getattr(torch_delay, "torch_delay", torch_delay)

    def delay(seconds: float | tuple[float, float]) -> None:  # torch calls it with seconds=
        inner(seconds=poll if seconds == TORCH_POLL_S else seconds)  # the first round's random skew stays

    delay.torch_delay = inner
    dynamic_rendezvous._delay = delay
    holder._cache_duration = poll


def republish_bootstrap(handler) -> None:
    """After each round, group rank 0 writes its bootstrap address into that round's store, where a node that
    joins in that round (its first) reads it (``RendezvousStoreInfo.build``); the other nodes ignore it."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    inner = handler.next_rendezvous

    def next_rendezvous():
        info = inner()
        boot = info.bootstrap_store_info
        if info.rank == 0 and boot is not None:
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, boot.master_addr)
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(boot.master_port))
        return info

    handler.next_rendezvous = next_rendezvous


def wait_only_with_room(handler) -> None:
    """torch's agents restart their workers whenever a node waits for the next round (``num_nodes_waiting``), but a
    node that lost the race for a full round stays on the wait list (only newcomers go to the redundancy list): with
    hot spares the groups restarted over and over (seen: 6 rounds in 10 s, then stuck). A waiting node counts only
    when the round has room for it: a lost node's place, once its keep-alive expired."""
    inner = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        waiting = inner()  # syncs the state
        if waiting and len(handler._state_holder.state.participants) >= handler.settings.max_nodes:
            return 0  # a spare: it takes the next free place
        return waiting

    handler.num_nodes_waiting = num_nodes_waiting


def round_number(handler) -> int | None:
    """The round torch's c10d handler is in (0: the first; later: after a failure), or None for another handler."""
    holder = getattr(handler, "_state_holder", None)
    return None if holder is None else holder.state.round


def reachable(addr: str) -> str:
    """Where a node listens: its ``--local-addr``, or the part after ``@`` of a sort key
    (``<index 0's host>/node-00003@<pod IP>``, :mod:`nvrx_lab.eks.commands`)."""
    return addr.rsplit("@", 1)[1] if "@" in addr else addr


def serve_reachable(handler) -> None:
    """torch's handler starts its shared store server on the node's ``--local-addr`` when the node first becomes
    group rank 0; a sort key is no host to bind (seen: the spare's round stuck there, resolving it, while index 0
    waited): the server binds to :func:`reachable` of it."""
    inner = getattr(handler, "_create_tcp_store_server", None)
    if inner is not None:
        handler._create_tcp_store_server = lambda addr, port: inner(reachable(addr), port)


def left_out(handler) -> bool:
    """Whether the last round the handler saw was full without this node: it waited as a hot spare (never admitted, or
    its place taken by a spare in a later round) when the rendezvous closed, so the job ended without needing it."""
    holder, me = getattr(handler, "_state_holder", None), getattr(handler, "_this_node", None)
    if holder is None or me is None:
        return False
    return me not in holder.state.participants and len(holder.state.participants) >= handler.settings.max_nodes
