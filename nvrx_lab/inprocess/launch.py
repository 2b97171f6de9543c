"""What the launcher told this process: torchrun's environment, read once
========================================================================

``torchrun`` (or :mod:`.spawn`, or the in-job launcher) tells each process who it is through its
environment. The wrapper reads it in one place, where it starts (:meth:`.loop.RestartLoop.run`), into a
:class:`Launch`, and hands the values down: no component of the in-process layer reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = env.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"in-process Wrapper: {name}={value!r} is not an integer") from None


@dataclass(frozen=True)
class Launch:
    """Who this process is in the job, as its launcher said."""

    rank: int = 0
    """``RANK``: this process's rank at launch (0 when unset: a world of one)."""
    world_size: int = 1
    """``WORLD_SIZE`` at launch (1 when unset)."""
    master_addr: str = "127.0.0.1"
    """``MASTER_ADDR``: the default host of the wrapper's store."""
    master_port: int | None = None
    """``MASTER_PORT``: the wrapper's store listens on its successor unless ``Wrapper(store_port=...)``."""
    gloo_transport: str = "TCP"
    """``GLOO_DEVICE_TRANSPORT``: gloo's transport (only TCP's sockets can be counted and cut)."""
    gloo_interfaces: tuple[str, ...] = ()
    """``GLOO_SOCKET_IFNAME``, split at commas: gloo opens one connection per peer and interface."""
    trace_dump_prefix: str | None = None
    """``TORCH_FR_DUMP_TEMP_FILE``: an abort first dumps this rank's flight recorder to ``<prefix><rank>``."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Launch:
        """Parse a launcher's environment (the process's, where the wrapper starts); a value that is not an integer
        is an error naming the variable."""
        return cls(rank=_int(env, "RANK", 0), world_size=_int(env, "WORLD_SIZE", 1),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", None),
                   gloo_transport=env.get("GLOO_DEVICE_TRANSPORT", "TCP"),
                   gloo_interfaces=tuple(n for n in env.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()),
                   trace_dump_prefix=env.get("TORCH_FR_DUMP_TEMP_FILE") or None)

    def store_address(self, host: str | None, port: int | None) -> tuple[str, int]:
        """The wrapper's store: ``host``/``port`` where given, else ``MASTER_ADDR`` and ``MASTER_PORT + 1``."""
        if port is None:
            if self.master_port is None:
                raise RuntimeError("in-process Wrapper: environment variable MASTER_PORT is not set; launch with "
                                   "torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
            port = self.master_port + 1
        return host or self.master_addr, port
