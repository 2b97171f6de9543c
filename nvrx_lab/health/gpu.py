"""GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``): what a GPU reports about its own health.

Per device: uncorrectable ECC errors since the driver loaded (volatile), retired pages waiting for a reset
(``RetiredPagesPendingStatus``, pre-Ampere), row remapping (Ampere and later: a remap that failed, or one pending a
reset) and NVLink links that are not up. XID events need an event set watched over time and are not read here.
``nvml`` may be any object with pynvml's functions (the tests pass a fake); without NVML the check says so.
"""

from __future__ import annotations

from nvrx_lab.health import Verdict, failed, ok, skipped


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def gpu(nvml=None) -> Verdict:
    nvml = nvml or _nvml()
    if nvml is None:
        return skipped("gpu", "NVML not installed (pip install nvidia-ml-py)")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return skipped("gpu", f"NVML did not start ({exc}): no NVIDIA driver here")
    try:
        count = nvml.nvmlDeviceGetCount()
        problems = [p for i in range(count) for p in _device_or_lost(nvml, i)]
    except Exception as exc:  # noqa: BLE001 - NVML up but not answering: the node is not healthy
        return failed("gpu", f"NVML could not list the GPUs ({exc})")
    finally:
        nvml.nvmlShutdown()
    if problems:
        return failed("gpu", "; ".join(problems[:4]))
    return ok("gpu", f"{count} GPUs: no uncorrectable ECC errors, no failed or pending row remaps, NVLink up")


def _device_or_lost(nvml, i: int) -> list[str]:
    """:func:`_device`, or the NVML error of a GPU that does not answer (``GPU is lost``: fallen off the bus)."""
    try:
        return _device(nvml, i)
    except Exception as exc:  # noqa: BLE001
        return [f"GPU {i}: NVML error ({exc})"]


def _device(nvml, i: int) -> list[str]:
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    out = []
    ecc = _try(lambda: nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                        nvml.NVML_VOLATILE_ECC))
    if ecc:
        out.append(f"GPU {i}: {ecc} uncorrectable ECC errors")
    if _try(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)):
        out.append(f"GPU {i}: retired pages pending a reset")
    remap = _try(lambda: nvml.nvmlDeviceGetRemappedRows(h))  # (corrected, uncorrected, pending, failure)
    if remap and remap[3]:
        out.append(f"GPU {i}: row remapping failed")
    elif remap and remap[2]:
        out.append(f"GPU {i}: row remapping pending a reset")
    links = [link for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
             if _try(lambda link=link: nvml.nvmlDeviceGetNvLinkState(h, link)) == 0]  # 0: inactive, None: no link
    if links:
        out.append(f"GPU {i}: NVLink link(s) {', '.join(map(str, links))} down")
    return out


def _try(fn):
    """``fn()``, or None where the device does not support the query (NVMLError_NotSupported, ...)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None
