"""The exit codes a job's processes end with besides 0 and 1, in one place: the rendered ``podFailurePolicy``
(:func:`nvrx_lab.eks.render.pod_failure_policy`) and the launcher act on them.

==  =================  ==================================================================================
2   usage error        a bad flag or value: the same on every attempt, never restarted (argparse's code)
3   rendezvous closed  the launcher's rendezvous was closed by another node before this one finished
4   no progress        restarts resumed from the same checkpoint too often (launcher or in-process)
5   unhealthy          this node failed a health check and left before the rendezvous
==  =================  ==================================================================================
"""

USAGE_ERROR = 2
RENDEZVOUS_CLOSED = 3
NO_PROGRESS = 4
UNHEALTHY = 5
