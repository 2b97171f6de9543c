"""The judges of :mod:`nvrx_lab.observe.attribute`: one per kind of fault evidence (a launcher restart, an in-process
restart, a pod restart or crashes nobody restarted, a failed health check), each a :class:`Verdict` from its
:class:`Group` (the rules they share: :mod:`nvrx_lab.observe.attribute_rules`)."""

from __future__ import annotations

import re

from nvrx_lab.observe.attribute_rules import CONSEQUENCES, Group, Run, Verdict, classify, hang_verdict, verdict, whole_node


def from_crashes(run: Run, group: Group) -> Verdict | None:
    """The verdict the attempt's ``crash`` events give: the first rank's own exception; or, where the only ones are
    collective timeouts, a hang on a rank that did not time out; ``None`` when no rank failed on its own."""
    own = [c for c in group.crashes if not c.get("peer_lost") and c.get("error") not in CONSEQUENCES]
    found = sorted(((c, *classify(str(c.get("error")), str(c.get("message", "")))) for c in own), key=lambda x: x[0]["t"])
    for c, category, detail in found:
        if category != "nccl_timeout":
            return verdict(run, group, c["t"], c["rank"], category, detail + (f" (step {c['step']})" if c.get("step") else ""))
    if not found:
        return None
    c, _, detail = found[0]
    silent = sorted(run.attempt(group) - {x["rank"] for x in group.crashes} - run.ended(group))
    if silent:  # the others waited for it until their collectives timed out
        return hang_verdict(run, group, c["t"], silent[0], f"rank {c['rank']}: {detail}", {}, group.t + 30.0,
                            known=True)
    return verdict(run, group, c["t"], c["rank"], "nccl_timeout", detail)


def from_silence(run: Run, group: Group, t: float) -> Verdict | None:
    """A rank of the attempt that said nothing (no crash, no end, no launcher report) while its peers lost it: killed."""
    reported = {x["rank"] for x in group.crashes} | {e["rank"] for e in group.events if e["kind"] == "launcher_failure"}
    silent = run.attempt(group) - reported - run.ended(group)
    if not silent or not (group.crashes or reported):
        return None
    when = min((c["t"] for c in group.crashes), default=t)
    if (node := whole_node(run, silent, when)) is not None:
        return verdict(run, group, when, min(silent), "node_lost", f"node {node}: ranks {sorted(silent)} gone without a word")
    return verdict(run, group, when, min(silent), "killed", "(no exception, no exit seen: its peers lost it)")


def judge_launcher(run: Run, group: Group) -> Verdict:
    """A launcher restart: its ``launcher_failure`` events, with the crashes, trace dumps and rendezvous lines around."""
    fails = group.events
    if signal := [f for f in fails if f.get("reason") == "signal"]:
        first = max(signal, key=lambda f: f.get("detect_s") or 0.0)
        t, name = first["t"] - (first.get("detect_s") or 0.0), first.get("signal") or "a signal"
        if (node := whole_node(run, {f["rank"] for f in signal}, t)) is not None:
            return verdict(run, group, t, first["rank"], "node_lost", f"node {node}: every rank killed by {name}")
        return verdict(run, group, t, first["rank"], "killed", f"by {name}")
    if (v := from_crashes(run, group)) is not None:
        return v
    if hung := [f for f in fails if f.get("reason") == "hang"]:
        first = max(hung, key=lambda f: f.get("detect_s") or 0.0)
        named = {e["rank"]: e["path"] for e in group.extra if e["kind"] == "trace_dump" and e.get("ok")}
        return hang_verdict(run, group, first["t"] - (first.get("detect_s") or 0.0), first["rank"], first.get("detail", ""),
                            named, first["t"])
    if lost := [m for e in group.extra if (m := re.search(r"store at (\S+?):\d+ stopped answering", e.get("line", "")))]:
        v = verdict(run, group, group.t, None, "node_lost", f"the rendezvous store's node ({lost[0][1]}) stopped answering")
        v.host, v.node = lost[0][1], run.node_of_host(lost[0][1], group.t)
        return v
    if (v := from_silence(run, group, group.t)) is not None:
        return v
    first = min(fails, key=lambda f: (not f.get("exit_code"), f["rank"]))
    return verdict(run, group, group.t, first["rank"], "exit", first.get("detail", "exited"))


def judge_inprocess(run: Run, group: Group) -> Verdict:
    """An in-process restart: every rank's ``restart`` record of it, which name the root cause's rank."""
    r = group.events[0]
    cause, rank, detail, t = r.get("cause"), r.get("fault_rank"), str(r.get("detail", "")), r.get("t_fault") or r["t"]
    named = {e["rank"]: e["trace_dump"] for e in group.events  # every rank's abort dumps its flight recorder
             if isinstance(e.get("trace_dump"), str) and not e["trace_dump"].startswith("not dumped")}
    aborted = t + max(e.get("detect_s") or 0.0 for e in group.events) + 0.5  # the attempt's group, not the next one's
    if cause == "exception":
        error, _, message = detail.partition(": ")
        category, said = classify(error, message)
        if category == "nccl_timeout" and (v := hang_verdict(run, group, t, None, said, named, aborted)).rank is not None:
            return v  # the rank that timed out waited for the one the dumps name
        return verdict(run, group, t, rank, category, said)
    if cause in ("hang", "hard_timeout"):
        return hang_verdict(run, group, t, rank, detail, named, aborted)
    if cause == "dead":
        dead = {x[1] for x in r.get("reports", []) if x[0] == "dead"} | {rank}
        if (node := whole_node(run, dead, t)) is not None:
            return verdict(run, group, t, rank, "node_lost", f"node {node}: ranks {sorted(dead)} gone")
        return verdict(run, group, t, rank, "killed", f"({detail})")
    return verdict(run, group, t, rank, "health" if cause == "unhealthy" else "unknown", detail)


def from_job_log(run: Run, group: Group) -> Verdict | None:
    """What torchrun's log says failed first (the ``job_log`` lines of a ``pod_restart``: rank, exit code, signal)."""
    lines = (group.events[0].get("job_log") or []) if group.events else []
    text = "\n".join(lines)
    if (rank := re.search(r"rank\s*:\s*(\d+)", text)) is None:
        return None
    signal, code = re.search(r"\((SIG[A-Z]+)\)", text), re.search(r"exitcode\s*:\s*(-?\d+)", text)
    said = f"by {signal[1]}" if signal else f"exited with code {code[1] if code else '?'}"
    return verdict(run, group, group.t, int(rank[1]), "killed" if signal else "exit", f"{said} (torchrun's root cause)",
                   evidence=[f"torchrun's root cause: {x}" for x in lines if re.match(r"(host|rank|exitcode|traceback)\b", x)])


def judge_pod(run: Run, group: Group) -> Verdict:
    """A job torn down and started again (``pod_restart``), or crashes no restart layer reported: the crash events,
    then the job's log, then the ranks that said nothing."""
    if (v := from_crashes(run, group) or from_job_log(run, group) or from_silence(run, group, group.t)) is not None:
        return v
    silent = sorted(run.attempt(group) - run.ended(group))
    said = group.events[0].get("reason", "") if group.events else "exited"
    v = verdict(run, group, group.t, None, "exit", f"{said}; no rank raised (silent: ranks {silent})")
    v.sure = False
    return v


def judge_health(run: Run, group: Group) -> Verdict:
    """A node's failed health checks (the launcher's ``health`` events, one host): the node, no rank."""
    host = group.events[0].get("host")
    detail = "; ".join(f"{e.get('check')}: {e.get('evidence')}" for e in group.events)
    v = verdict(run, group, group.t, None, "health", detail)
    v.host, v.node = host, run.node_of_host(host, group.t)
    return v


JUDGES = {"launcher": judge_launcher, "inprocess": judge_inprocess, "pod": judge_pod, "crash": judge_pod,
          "health": judge_health}
