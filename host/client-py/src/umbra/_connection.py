"""One connection to umbrad: JSON-RPC 2.0 over a Unix socket, one JSON value per line.

Requests are matched to responses by id; notifications (lines without id) go to a callback.
A response's ``on_result`` hook runs in the reader before the next line is read, so a
process registered there sees every ``process.event`` that follows its ``process.spawn``.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Callable
from typing import Any

from ._base import UmbraError
from ._generated import ERROR_CLASSES, ERROR_CODES
from .errors import UnauthorizedError, UnavailableError

#: ``on_result``: runs in the reader with a call's result, before the next line is read.
#: ``on_late``: runs instead when the call was cancelled before its answer came (a spawn whose
#: caller gave up must not leave its process running with nobody holding it).
Pending = tuple[asyncio.Future[Any], str, Callable[[Any], None] | None, Callable[[Any], None] | None]

#: Longest line accepted from umbrad (a 1 MiB file read is about 1.4 MiB of base64).
LINE_LIMIT = 16 << 20


def error_from(obj: Any, method: str | None = None) -> UmbraError:
    """The exception for a JSON-RPC ``error`` object: the class of its ``data.code``; without
    one, the class of its number when that is one of ours; else ``UnknownError`` (a newer
    daemon's code is kept in ``daemon_code``)."""
    e = obj if isinstance(obj, dict) else {}
    message = e.get("message")
    if not isinstance(message, str):
        message = f"umbrad reported an error without a message: {obj!r}"
    rpc = e.get("code")
    if not isinstance(rpc, int) or isinstance(rpc, bool):
        rpc = ERROR_CODES["unknown"]
    data = e.get("data")
    named = data.get("code") if isinstance(data, dict) else None
    daemon_code = named if isinstance(named, str) else None
    if isinstance(named, str) and named in ERROR_CLASSES:
        code = named
        daemon_code = None
    elif named is None:
        code = next((c for c, n in ERROR_CODES.items() if n == rpc), "unknown")
    else:
        code = "unknown"
    return ERROR_CLASSES[code](message, code=code, rpc_code=rpc, method=method, daemon_code=daemon_code)


def _lstat(path: str, missing: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError as e:
        raise UnavailableError(f"umbrad is not running: {missing}") from e
    except OSError as e:
        raise UnavailableError(f"cannot look at {path}: {e.strerror or e}") from e


def check_socket(path: str) -> None:
    """Refuses a socket that another user could have put there: its directory must be a real
    directory of this uid with mode 0700, the socket a socket of this uid (not a symlink)."""
    uid = os.geteuid()
    directory = os.path.dirname(path) or "."
    d = _lstat(directory, f"{directory} does not exist")
    if not stat.S_ISDIR(d.st_mode):
        raise UnauthorizedError(f"{directory} is not a directory (a symlink?): refusing to talk to {path}")
    if d.st_uid != uid:
        raise UnauthorizedError(f"{directory} belongs to uid {d.st_uid}, not to uid {uid}: refusing to talk to {path}")
    if stat.S_IMODE(d.st_mode) != 0o700:
        raise UnauthorizedError(
            f"{directory} has mode {stat.S_IMODE(d.st_mode):04o}, not 0700: refusing to talk to {path}"
        )
    s = _lstat(path, f"no socket at {path}")
    if not stat.S_ISSOCK(s.st_mode):
        raise UnauthorizedError(f"{path} is not a socket: refusing to talk to it")
    if s.st_uid != uid:
        raise UnauthorizedError(f"{path} belongs to uid {s.st_uid}, not to uid {uid}: refusing to talk to it")


class Connection:
    """One socket to umbrad."""

    def __init__(
        self,
        path: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_notification: Callable[[Connection, str, Any], None],
        on_close: Callable[[Connection, UmbraError], None],
    ) -> None:
        self.path = path
        self._reader = reader
        self._writer = writer
        self._on_notification = on_notification
        self._on_close = on_close
        self._next_id = 1
        self._pending: dict[int, Pending] = {}
        self._closed: UmbraError | None = None
        #: Why umbrad is about to close the connection (an ``"id": null`` refusal), when it said.
        self._reason: UmbraError | None = None
        self._done = asyncio.get_running_loop().create_future()
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(
        cls,
        path: str,
        on_notification: Callable[[Connection, str, Any], None],
        on_close: Callable[[Connection, UmbraError], None],
    ) -> Connection:
        check_socket(path)
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=LINE_LIMIT)
        except (OSError, ValueError) as e:
            raise UnavailableError(
                f"cannot connect to umbrad at {path}: {getattr(e, 'strerror', None) or e}; start it with `umbrad`"
            ) from e
        return cls(path, reader, writer, on_notification, on_close)

    @property
    def is_closed(self) -> bool:
        return self._closed is not None

    @property
    def error(self) -> UmbraError | None:
        """Why it closed, once it did."""
        return self._closed

    async def wait_closed(self) -> None:
        await asyncio.shield(self._done)

    def _send(self, message: dict[str, Any]) -> None:
        if self._closed is not None:
            raise self._closed
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    def start(
        self,
        method: str,
        params: Any = None,
        on_result: Callable[[Any], None] | None = None,
        on_late: Callable[[Any], None] | None = None,
    ) -> asyncio.Future[Any]:
        """Writes a request now (in call order) and returns the future of its answer."""
        if self._closed is not None:
            raise UnavailableError(f"{method}: {self._closed.message}", method=method)
        rid = self._next_id
        self._next_id += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (future, method, on_result, on_late)
        try:
            self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        except OSError as e:
            self._pending.pop(rid, None)
            self.close(UnavailableError(f"the connection to umbrad at {self.path} was lost: {e}"))
            raise UnavailableError(f"{method}: the connection to umbrad at {self.path} was lost: {e}") from e
        return future

    async def request(
        self,
        method: str,
        params: Any = None,
        on_result: Callable[[Any], None] | None = None,
        on_late: Callable[[Any], None] | None = None,
    ) -> Any:
        """Sends a request and waits for its answer; raises the daemon's error as its class.
        Cancelled, it is forgotten: ``on_result`` never runs, ``on_late`` does if the answer
        comes."""
        future = self.start(method, params, on_result, on_late)
        try:
            # The socket's buffer is bounded too: a daemon that stops reading slows us down.
            await self._writer.drain()
        except OSError as e:
            # The reader may still have umbrad's last words (a refusal is written, then the
            # socket closed): let it read them before closing with this less telling error.
            try:
                await asyncio.wait_for(asyncio.shield(self._done), 1)
            except asyncio.TimeoutError:
                pass
            self.close(UnavailableError(f"the connection to umbrad at {self.path} was lost: {e}"))
        try:
            return await future
        except asyncio.CancelledError:
            future.cancel()
            raise

    def notify(self, method: str, params: Any) -> None:
        """Sends a notification (no answer); dropped quietly on a closed connection."""
        if self._closed is None:
            try:
                self._send({"jsonrpc": "2.0", "method": method, "params": params})
            except (OSError, UmbraError):
                pass

    def close(self, error: UmbraError | None = None) -> None:
        if self._closed is not None:
            return
        self._closed = self._reason or error or UnavailableError(f"the connection to umbrad at {self.path} was closed")
        try:
            self._writer.close()
        except OSError:
            pass
        # A refusal keeps its class (BusyError, UnauthorizedError); any other end is unavailable.
        kind = type(self._reason) if self._reason is not None else UnavailableError
        for future, method, _, _ in self._pending.values():
            if not future.done():
                future.set_exception(
                    kind(f"{method}: {self._closed.message}", rpc_code=self._closed.rpc_code, method=method)
                )
        self._pending.clear()
        if not self._done.done():
            self._done.set_result(None)
        try:
            self._on_close(self, self._closed)
        finally:
            if self._task is not asyncio.current_task():
                self._task.cancel()

    async def _read_loop(self) -> None:
        why: UmbraError | None = None
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except (asyncio.LimitOverrunError, ValueError) as e:
                    why = UnavailableError(f"umbrad at {self.path} sent a line longer than {LINE_LIMIT} bytes: {e}")
                    break
                if not line:
                    why = self._reason or UnavailableError(f"umbrad at {self.path} closed the connection")
                    break
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # not ours to answer; a newer daemon's oddity
                try:
                    self._dispatch(msg)
                except Exception as e:  # a bug here must end the connection, not hang its calls
                    why = UmbraError(f"the client failed on a message from umbrad at {self.path}: {e!r}", code="internal")
                    break
        except asyncio.CancelledError:
            return
        except OSError as e:
            why = UnavailableError(f"the connection to umbrad at {self.path} was lost: {e}")
        self.close(why)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, list):
            for m in msg:
                self._dispatch(m)
            return
        if not isinstance(msg, dict):
            return
        rid = msg.get("id")
        method = msg.get("method")
        if isinstance(method, str) and rid is None:
            self._on_notification(self, method, msg.get("params"))
            return
        if rid is None:
            # `"id": null`: about the connection, not a call (a refused client, too many
            # clients, a line umbrad could not read). A refusal is followed by the close.
            if msg.get("error") is not None:
                error = error_from(msg["error"])
                if error.code in ("unauthorized", "busy") and self._reason is None:
                    self._reason = error
            return
        entry = self._pending.pop(rid, None) if isinstance(rid, int) and not isinstance(rid, bool) else None
        if entry is None:
            return
        future, method, on_result, on_late = entry
        if msg.get("error") is not None:
            if not future.done():
                future.set_exception(error_from(msg["error"], method))
            return
        result = msg.get("result")
        if future.done():
            # Cancelled by its caller before the answer: nobody will see this result.
            if on_late is not None:
                on_late(result)
            return
        if on_result is not None:
            try:
                on_result(result)
            except Exception as e:
                future.set_exception(
                    UmbraError(f"{method}: umbrad's answer could not be used: {e!r}", code="internal", method=method)
                )
                return
        future.set_result(result)
