"""``python -m nvrx_lab.eks``: render, validate, submit and delete jobs from the command line.

    python -m nvrx_lab.eks render --out manifests/ [--nodes 2] [--image IMG] [--fsx-id fs-… …]
    python -m nvrx_lab.eks validate manifests/*.yaml
    python -m nvrx_lab.eks preflight --cluster C --region R --name N --image IMG [--nodes 16 --model llama3.1-8b …]
    python -m nvrx_lab.eks submit --cluster C --region R --name N --image IMG --mode ft_launcher [--no-dry-run] [--replace]
    python -m nvrx_lab.eks delete --cluster C --region R --name N

Bad input is one line on stderr, ``error: …``, naming the flag, file or field and what is allowed, exit code 2
(the usage text only with ``--help``; flags are never abbreviated: ``--name`` is not ``--namespace``); a
file that cannot be read or written is one ``error:`` line naming its path, exit code 1, as is a cluster
problem; a schema violation exits 2. ``render`` writes nothing unless every file is valid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from nvrx_lab.eks.auth import EksError
from nvrx_lab.eks.kueue import API as KUEUE_API
from nvrx_lab.eks.modes import MODES
from nvrx_lab.eks.preflight import PreflightFailed
from nvrx_lab.eks.spec import JobSpec
from nvrx_lab.eks.submit import Access, check_cluster, delete, submit
from nvrx_lab.eks.validate import ManifestError, validate
from nvrx_lab.eks.yamlio import EXAMPLE, manifest_files, write_files

FSX_FLAGS = {"fsx_volume_handle": "--fsx-id", "fsx_dns_name": "--fsx-dns", "fsx_mount_name": "--fsx-mount-name"}


class UsageError(ValueError):
    """A bad command line: printed as one ``error:`` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse without abbreviations, whose errors are one line (``UsageError``) instead of usage + exit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str):
        cmd = self.prog.removeprefix("python -m nvrx_lab.eks").strip()
        raise UsageError(f"{cmd + ': ' if cmd else ''}{message} (see --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m nvrx_lab.eks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="{render,validate,submit,delete}")
    r = sub.add_parser("render", help="write namespace, FSx storage and per mode one Job and one JobSet file")
    r.add_argument("--out", default="manifests/", help="output directory (default: manifests/)")
    r.add_argument("--nodes", type=int, default=2, help="nodes per job (default: 2)")
    r.add_argument("--image", default=EXAMPLE["image"], help="training image")
    r.add_argument("--instance-type", default="p5.48xlarge", help="EC2 instance type of the nodes")
    r.add_argument("--model", default="tiny", help="model preset of the modes' jobs (default: tiny; the Llama 3.1 8B "
                                                   "16-node job is rendered beside them)")
    r.add_argument("--data", default="", help="token file on FSx the modes' jobs train on (default: synthetic tokens)")
    r.add_argument("--queue-name", default="", help="Kueue LocalQueue of every job (label kueue.x-k8s.io/queue-name; "
                                                    "default: none)")
    r.add_argument("--namespace", default="nvrx-lab", help="namespace of the jobs")
    fsx = "; all three FSx flags together, or none for the example values"
    r.add_argument("--fsx-id", dest="fsx_volume_handle", help="FSx for Lustre file system id (fs-…)" + fsx)
    r.add_argument("--fsx-dns", dest="fsx_dns_name", help="FSx DNS name" + fsx)
    r.add_argument("--fsx-mount-name", dest="fsx_mount_name", help="FSx Lustre mount name" + fsx)
    v = sub.add_parser("validate", help="validate YAML files against the Kubernetes schemas (strict)")
    v.add_argument("files", nargs="+")
    for name in ("submit", "preflight", "delete"):
        s = sub.add_parser(name, help=f"{name} a job on an EKS cluster" if name != "preflight" else
                           "check what would leave a job's nodes idle (image, volume, nodes, Pod Security, example values)")
        s.add_argument("--cluster", required=True)
        s.add_argument("--region", required=True)
        s.add_argument("--name", required=True, help="job name")
        s.add_argument("--namespace", default="nvrx-lab")
        s.add_argument("--api-server", default=None, help="override the cluster endpoint (tunnel/proxy)")
        if name in ("submit", "preflight"):
            s.add_argument("--image", required=True)
            s.add_argument("--mode", choices=list(MODES), default="ft_launcher")
            s.add_argument("--nodes", type=int, default=2)
            s.add_argument("--spare-nodes", type=int, default=0, help="hot spare pods that wait in the rendezvous and take "
                                                                       "a lost node's place (launcher modes)")
            s.add_argument("--no-mark-nodes", dest="mark_unhealthy_nodes", action="store_false",
                           help="no RBAC to label and taint a node whose health check fails")
            s.add_argument("--workload", choices=("auto", "job", "jobset"), default="auto",
                           help="an Indexed Job or a JobSet (default auto: a JobSet from 4 nodes up)")
            s.add_argument("--instance-type", default="p5.48xlarge")
            s.add_argument("--model", default="tiny", help="model preset: tiny, llama3.2-1b, llama3.1-8b, llama3.1-70b")
            s.add_argument("--data", default="", help="token file on FSx (python -m nvrx_lab.data prepare); "
                                                      "default: synthetic tokens")
            s.add_argument("--steps", type=int, default=1000)
            s.add_argument("--ckpt-interval", type=int, default=100)
            s.add_argument("--faults", default="")
            s.add_argument("--fsx-claim", default="fsx-claim")
            s.add_argument("--queue-name", default="", help="Kueue LocalQueue: admitted when all pods fit (default: none)")
            s.add_argument("--fsx-id", dest="fsx_volume_handle", default="", help="FSx file system id (fs-…) when this "
                           "submit creates the volume and claim (with --fsx-dns and --fsx-mount-name)")
            s.add_argument("--fsx-dns", dest="fsx_dns_name", default="")
            s.add_argument("--fsx-mount-name", dest="fsx_mount_name", default="")
        if name == "submit":
            s.add_argument("--no-preflight", action="store_true", help="skip the preflight checks (said on the console)")
            s.add_argument("--gate", action="store_true", help="run the EFA gate first (an NCCL all-reduce across two of "
                                                               "the job's nodes); stop if it fails")
            s.add_argument("--no-dry-run", action="store_true", help="really submit (default: render and validate only)")
            s.add_argument("--replace", action="store_true",
                           help="delete an existing Job of this name (and its pods) first; it resumes from its checkpoints")
    return p


def _job(args: argparse.Namespace) -> JobSpec:
    """The JobSpec of ``submit``'s and ``preflight``'s flags."""
    return JobSpec(name=args.name, image=args.image, nodes=args.nodes, mode=args.mode, namespace=args.namespace,
                   workload=args.workload, spare_nodes=args.spare_nodes, mark_unhealthy_nodes=args.mark_unhealthy_nodes,
                   instance_type=args.instance_type, model=args.model, data=args.data, steps=args.steps,
                   ckpt_interval=args.ckpt_interval, faults=args.faults, fsx_claim=args.fsx_claim,
                   queue_name=args.queue_name, fsx_volume_handle=args.fsx_volume_handle, fsx_dns_name=args.fsx_dns_name,
                   fsx_mount_name=args.fsx_mount_name)


def _fsx(args: argparse.Namespace) -> dict[str, str]:
    """The three FSx values: all given, or none (the example values); one or two is an error naming the rest."""
    given = {k: getattr(args, k) for k in FSX_FLAGS if getattr(args, k) is not None}
    if given and len(given) < len(FSX_FLAGS):
        missing = [flag for k, flag in FSX_FLAGS.items() if k not in given]
        raise ValueError(f"render: {', '.join(FSX_FLAGS[k] for k in given)} also needs {' and '.join(missing)}; "
                         "allowed: all three FSx flags together, or none (example values to replace)")
    return given or {k: EXAMPLE[k] for k in FSX_FLAGS}


def _load(path: str) -> list[dict]:
    """The Kubernetes objects in one YAML file; ``ValueError`` with one line for anything else."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc}); allowed: a readable YAML file") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    for i, doc in enumerate(docs, 1):
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: document {i} is a {type(doc).__name__}, not a Kubernetes object; "
                             "allowed: mappings with apiVersion, kind and metadata")
    if not docs:
        raise ValueError(f"{path}: no Kubernetes objects in it")
    return docs


def main(argv: list[str] | None = None) -> int:
    try:
        args, extra = _parser().parse_known_args(argv)
        if extra:
            raise UsageError(f"{args.cmd}: unrecognized arguments: {' '.join(extra)} (see --help)")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (ValueError, ManifestError, EksError, OSError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line; a file-system error names its path."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, ManifestError):
        return f"{len(exc.errors)} schema violation(s): " + "; ".join(exc.errors)
    return " ".join(str(exc).split())


def _run(args: argparse.Namespace) -> int:
    """The command ``args.cmd``; exceptions go to :func:`main`, which prints them as one line."""
    if args.cmd == "render":
        files = manifest_files(nodes=args.nodes, image=args.image, instance_type=args.instance_type,
                               namespace=args.namespace, model=args.model, data=args.data, queue_name=args.queue_name,
                               **_fsx(args))
        counts = {}
        for name, text in files.items():  # validate everything before writing anything
            docs = [d for d in yaml.safe_load_all(text) if d]
            validate(docs)
            kueue = all(d["apiVersion"] == KUEUE_API for d in docs)
            counts[name] = f"{len(docs)} objects, " + ("Kueue's: their shape only, no vendored schema" if kueue else "valid")
        for path in write_files(args.out, files):
            print(f"wrote {path} ({counts[path.name]})")
    elif args.cmd == "validate":
        for f in args.files:
            try:
                validate(_load(f))
            except ManifestError as exc:
                raise ManifestError([f"{f}: {e}" for e in exc.errors]) from None
            print(f"{f}: valid")
    elif args.cmd == "preflight":
        try:
            findings = check_cluster(_job(args), args.cluster, args.region, access=Access(api_server=args.api_server))
        except PreflightFailed as failed:
            for f in failed.findings:
                print(f"{'ok' if f.ok else 'error'}: {f.line}", file=sys.stdout if f.ok else sys.stderr)
            return 1
        print("\n".join(f"ok: {f.line}" for f in findings))
    elif args.cmd == "submit":
        res = submit(_job(args), args.cluster, args.region, dry_run=not args.no_dry_run, replace=args.replace,
                     access=Access(api_server=args.api_server, preflight=not args.no_preflight, gate=args.gate))
        print("\n".join(res.actions) or f"dry run: {len(res.manifests)} objects valid (pass --no-dry-run to submit)")
        print(f"status: {res.status}; goodput: {res.goodput}")
        return 0 if res.status in ("dry-run", "submitted", "Succeeded") else 1
    else:
        spec = JobSpec(name=args.name, image="unused", namespace=args.namespace)
        print("\n".join(delete(spec, args.cluster, args.region, access=Access(api_server=args.api_server)))
              or "nothing to delete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
