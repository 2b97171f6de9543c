"""Amazon EKS: generated, validated manifests for p5 training jobs, submission, and local runs.

:mod:`nvrx_lab.eks` turns a :class:`JobSpec` into the Kubernetes objects of one job — an Indexed
Job whose pods find rank 0 at ``<job>-0.<job>`` through a headless Service (2 nodes or 128), the
launcher's ConfigMap, the FSx for Lustre volume; or the same pods as a JobSet (``workload="jobset"``) —
validates them against the Kubernetes schemas (a JobSet against its CRD's),
submits them with boto3 and the kubernetes client, and runs the very same container command lines
as local processes on CPU so CI exercises what ships::

    from nvrx_lab.eks import JobSpec, render, validate, local_run
    spec = JobSpec(name="llama-ft", image="…/nvrx-lab:0.1.0", nodes=2, mode="ft_launcher")
    manifests = render(spec)     # list of dicts, ready for the Kubernetes API or YAML
    validate(manifests)          # raises with the path of every schema violation

``python -m nvrx_lab.eks render --out manifests/`` regenerates the committed manifests.
Introduced in ``notebooks/05_eks_manifests.ipynb``; submission in ``notebooks/06_submit_p5_job.ipynb``.
One concept per module: :mod:`.instances`, :mod:`.modes`, :mod:`.spec`, :mod:`.checks`, :mod:`.commands`,
:mod:`.render`, :mod:`.jobset`, :mod:`.yamlio`, :mod:`.validate`, :mod:`.crd`, :mod:`.auth`, :mod:`.submit`,
:mod:`.watch`, :mod:`.local_plan`, :mod:`.local_job`, :mod:`.local`; :mod:`.replicas` and :mod:`.local_replicas`
render and run the replicas mode's coordinator StatefulSet and group Jobs; :mod:`.torchrun` is what the torchrun
modes' pods run (torchrun, with a worker's usage error kept as exit code 2).
"""

from nvrx_lab.eks.auth import EksError, eks_token
from nvrx_lab.eks.instances import INSTANCE_TYPES, InstanceType
from nvrx_lab.eks.local import LocalRun, local_run, plan
from nvrx_lab.eks.modes import MODES, Mode
from nvrx_lab.eks.preflight import Finding, PreflightFailed, preflight
from nvrx_lab.eks.render import render
from nvrx_lab.eks.spec import JobSpec, pod_launcher
from nvrx_lab.eks.submit import Access, SubmitResult, Watch, delete, submit
from nvrx_lab.eks.validate import K8S_VERSION, ManifestError, validate
from nvrx_lab.eks.watch import parse_goodput, waiting_reason
from nvrx_lab.eks.yamlio import comments_for, to_yaml, write_manifests

__all__ = ["JobSpec", "pod_launcher", "Access", "Watch",
           "render", "validate", "submit", "delete", "local_run", "plan", "to_yaml", "write_manifests",
           "comments_for", "parse_goodput", "waiting_reason", "eks_token", "EksError", "ManifestError", "SubmitResult",
           "LocalRun", "preflight", "Finding", "PreflightFailed",
           "MODES", "Mode", "INSTANCE_TYPES", "InstanceType", "K8S_VERSION"]
