"""GPU readiness checks: ``python -m nvrx_lab.gpucheck`` (:mod:`.__main__`); the device-side assert and the NCCL
abort path run as their own processes (:mod:`.device`)."""
