"""The workbook's papermill engine: ``python -m nvrx_lab.workbook.papermill`` takes papermill's own command line
(``IN.ipynb OUT.ipynb -p NAME VALUE --cwd DIR -k python3 …``) and runs it with two changes to the kernel's
connection; ``register()`` does the same for papermill's Python API (``engine_name="nvrx_lab"``).

**Encrypted channels.** ipykernel (7.4 here) logs, for every kernel whose manager gave it no CurveZMQ keys::

    [IPKernelApp] WARNING | Kernel is running over TCP without encryption. …

jupyter_client's ``KernelManager.transport_encryption`` decides that, and it defaults to ``"disabled"``; papermill
(2.7) has no option or environment variable for it, only the ``config`` its engine hands the notebook client,
which creates the kernel manager with it. Here it is ``"auto"``: the manager provisions keys for a kernelspec
that declares ``"supported_encryption": ["curve"]`` (ipykernel's own, the ``python3`` kernel of ``make setup``),
the kernel binds its sockets with them and has nothing to warn about. Where pyzmq has no CurveZMQ it stays off
(and the kernel still warns). nbval starts its kernels with stderr sent to ``/dev/null``: ``make test`` shows no
warning either way.

**No endless wait.** nbclient waits for a cell's ``execute_reply`` with ``get_msg(timeout=None)``, one
``poll`` without a timeout on the asyncio zmq socket. On this box (pyzmq 27.3, nbclient 0.11) that wait misses
the reply now and then and never returns, while the kernel sits idle: a one-cell ``ipywidgets.interact``
notebook hung in 4 of 60 plain papermill runs, over TCP, IPC and CurveZMQ alike (nbclient#312, papermill#723;
notebooks 01 and 04 have such a cell). Here every such wait polls in one-second slices, and a reply the first
poll missed is read by the next: 0 hangs in 180 runs.

**No interrupt at shutdown.** jupyter_client's ``shutdown_kernel`` sends the kernel SIGINT before its
``shutdown_request``; a kernel still inside a message handler (after a failed cell, on a loaded box) logs
``[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel.`` on the run's stderr: 1 run in 4 beside two busy loops,
and a CI run's one-line error became two. Here the shutdown goes straight to the request; a kernel that does not
stop still gets jupyter_client's SIGTERM and SIGKILL after ``shutdown_wait_time``.
"""

from __future__ import annotations

import sys
from queue import Empty

import zmq
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from papermill.engines import NBClientEngine, papermill_engines
from traitlets import Type
from traitlets.config import Config

ENGINE = "nvrx_lab"
"""The engine's name for ``papermill --engine`` and ``papermill.execute_notebook(engine_name=…)``."""
POLL_SLICE_S = 1.0
"""Longest single poll of a wait without a timeout: a missed wake-up costs at most this."""


class SlicedPollChannel(AsyncZMQSocketChannel):
    """A kernel channel whose wait without a timeout is a loop of :data:`POLL_SLICE_S` polls."""

    async def get_msg(self, timeout: float | None = None) -> dict:
        if timeout is not None:
            return await super().get_msg(timeout)
        while True:
            try:
                return await super().get_msg(POLL_SLICE_S)
            except Empty:
                continue


class WorkbookKernelClient(AsyncKernelClient):
    """nbclient's kernel client, with :class:`SlicedPollChannel` for the shell and IOPub channels it waits on."""

    shell_channel_class = Type(SlicedPollChannel)
    iopub_channel_class = Type(SlicedPollChannel)


class WorkbookKernelManager(AsyncKernelManager):
    """nbclient's kernel manager, whose shutdown does not interrupt the kernel first (see the module docs)."""

    async def _async_interrupt_kernel(self) -> None:
        if self.shutting_down:
            return
        await super()._async_interrupt_kernel()


def kernel_config() -> Config:
    """The notebook client's config: encrypted channels where the kernel supports them, sliced waits, a shutdown
    without an interrupt."""
    config = Config()
    config.NotebookClient.kernel_manager_class = f"{__name__}.{WorkbookKernelManager.__name__}"
    config.AsyncKernelManager.client_class = f"{__name__}.{WorkbookKernelClient.__name__}"
    if zmq.has("curve"):
        config.KernelManager.transport_encryption = "auto"
    return config


class WorkbookEngine(NBClientEngine):
    """Papermill's nbclient engine with :func:`kernel_config` (see the module docs)."""

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
        kwargs.setdefault("config", kernel_config())
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)


def register(as_default: bool = True) -> None:
    """Make this engine available as ``--engine nvrx_lab`` in this process, and papermill's default engine."""
    papermill_engines.register(ENGINE, WorkbookEngine)
    if as_default:
        papermill_engines.register(None, WorkbookEngine)


def main(argv: list[str] | None = None) -> int:
    """papermill's command line; a notebook parameter of the wrong type or range is one ``error:`` line and exit 2
    (its check cell's :class:`~nvrx_lab.workbook.ParameterError`), not papermill's 50-line traceback."""
    from papermill.cli import papermill as cli
    from papermill.exceptions import PapermillExecutionError

    register()
    try:
        cli.main(args=argv, prog_name="python -m nvrx_lab.workbook.papermill")  # exits with papermill's status
    except PapermillExecutionError as e:
        if e.ename != "ParameterError":
            raise
        print(f"error: {e.evalue}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
