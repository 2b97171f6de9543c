"""EC2 instance types the manifests know: GPUs, EFA interfaces, vCPUs and memory per node.

The figures are the instance's own (``aws ec2 describe-instance-types``). A pod cannot ask for all
of a node: the kubelet reserves some CPU and memory and the daemonsets (aws-node, kube-proxy, the
NVIDIA and EFA device plugins, the FSx CSI node driver) need theirs, so :func:`pod_resources`
requests a fixed share (:data:`POD_SHARE`) of the CPU and memory and all of the GPUs and EFA
interfaces the spec asks for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    name: str
    """EC2 instance type, the value of the node label ``node.kubernetes.io/instance-type``."""
    gpus: int
    """NVIDIA GPUs per node (``nvidia.com/gpu``)."""
    gpu: str
    """GPU model, for people."""
    efa: int
    """EFA interfaces per node (``vpc.amazonaws.com/efa``); 0 where the type has none."""
    efa_rdma: bool
    """Whether EFA does GPUDirect RDMA on this type (``FI_EFA_USE_DEVICE_RDMA=1``): p4d and p5 only."""
    vcpus: int
    """vCPUs per node."""
    memory_gib: int
    """Memory per node in GiB."""

    @property
    def gpu_gb(self) -> int:
        """Memory of one GPU in GB (``H100 80GB`` -> 80)."""
        return int(self.gpu.split()[-1].removesuffix("GB"))


def _t(name: str, gpus: int, gpu: str, efa: int, rdma: bool, vcpus: int, mem: int) -> InstanceType:
    return InstanceType(name, gpus, gpu, efa, rdma, vcpus, mem)


INSTANCE_TYPES: dict[str, InstanceType] = {t.name: t for t in [
    _t("p5.48xlarge", 8, "H100 80GB", 32, True, 192, 2048),
    _t("p5e.48xlarge", 8, "H200 141GB", 32, True, 192, 2048),
    _t("p5en.48xlarge", 8, "H200 141GB", 16, True, 192, 2048),
    _t("p4d.24xlarge", 8, "A100 40GB", 4, True, 96, 1152),
    _t("p4de.24xlarge", 8, "A100 80GB", 4, True, 96, 1152),
    *[_t(f"g5.{s}", g, "A10G 24GB", e, False, c, m) for s, g, e, c, m in [
        ("xlarge", 1, 0, 4, 16), ("2xlarge", 1, 0, 8, 32), ("4xlarge", 1, 0, 16, 64), ("8xlarge", 1, 1, 32, 128),
        ("12xlarge", 4, 1, 48, 192), ("16xlarge", 1, 1, 64, 256), ("24xlarge", 4, 1, 96, 384), ("48xlarge", 8, 1, 192, 768)]],
    *[_t(f"g6.{s}", g, "L4 24GB", e, False, c, m) for s, g, e, c, m in [
        ("xlarge", 1, 0, 4, 16), ("2xlarge", 1, 0, 8, 32), ("4xlarge", 1, 0, 16, 64), ("8xlarge", 1, 1, 32, 128),
        ("12xlarge", 4, 1, 48, 192), ("16xlarge", 1, 1, 64, 256), ("24xlarge", 4, 1, 96, 384), ("48xlarge", 8, 1, 192, 768)]],
    *[_t(f"g6e.{s}", g, "L40S 48GB", e, False, c, m) for s, g, e, c, m in [
        ("xlarge", 1, 0, 4, 32), ("2xlarge", 1, 0, 8, 64), ("4xlarge", 1, 0, 16, 128), ("8xlarge", 1, 1, 32, 256),
        ("12xlarge", 4, 1, 48, 384), ("16xlarge", 1, 1, 64, 512), ("24xlarge", 4, 2, 96, 768), ("48xlarge", 8, 4, 192, 1536)]],
]}

POD_SHARE = 0.9
"""Share of a node's vCPUs and memory the training pod requests (the rest: kubelet and daemonsets)."""


def instance_type(name: str) -> InstanceType:
    """The table entry for ``name``; ``ValueError`` listing the known types otherwise."""
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        raise ValueError(f"JobSpec.instance_type: unknown instance type {name!r}; allowed: {', '.join(INSTANCE_TYPES)}") from None


def pod_resources(t: InstanceType, share: float = POD_SHARE) -> tuple[int, int]:
    """(CPU cores, memory GiB) a one-pod-per-node training pod requests on ``t``."""
    return max(1, int(t.vcpus * share)), max(1, int(t.memory_gib * share))
