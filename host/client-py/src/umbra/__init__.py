"""``umbra``: the Python client of umbrad, Umbra's microVM session daemon.

Blocking (``umbra.Umbra``) and asyncio (``umbra.aio.Umbra``) clients with the same surface as
the TypeScript client: sessions, processes with streamed output and flow control, stdin,
files, folders, shadow folders, ports, events, reconnection. The wire protocol: docs/ipc.md.

.. code-block:: python

    from umbra import Umbra

    with Umbra.connect() as client:
        s = client.sessions.start("demo")
        r = s.exec(["uname", "-a"])
        print(r.stdout.decode(), r.exit.code)
"""

from . import aio, errors, types
from ._generated import API_VERSION, MAX_FILE_CHUNK, OUTPUT_WINDOW
from .aio import ExecResult, default_socket_path
from .errors import *  # noqa: F403 (every error class, listed in errors.__all__)
from .errors import __all__ as _errors
from .process import SIGNALS, ExitInfo, signal_name, signal_number
from .sync import Process, Session, Umbra

__all__ = [
    "API_VERSION",
    "MAX_FILE_CHUNK",
    "OUTPUT_WINDOW",
    "ExecResult",
    "ExitInfo",
    "Process",
    "Session",
    "Umbra",
    "aio",
    "default_socket_path",
    "errors",
    "SIGNALS",
    "signal_name",
    "signal_number",
    "types",
    *_errors,
]
