"""The asyncio client of umbrad.

.. code-block:: python

    from umbra.aio import Umbra

    async with await Umbra.connect() as client:
        session = await client.sessions.start("demo")
        p = await session.spawn(["echo", "hello"])
        print(await p.stdout.read())
        print((await p.wait()).code)
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from . import _generated as t
from ._connection import Connection
from .errors import UmbraError, UnavailableError, UnsupportedError
from .process import ExitInfo, Process, Signal, decode_data, signal_number


def default_socket_path() -> str:
    """umbrad's socket by the rule every client shares: ``$UMBRA_SOCKET``, else
    ``$XDG_RUNTIME_DIR/umbra/umbrad.sock``, else ``/tmp/umbra-<uid>/umbrad.sock``."""
    if os.environ.get("UMBRA_SOCKET"):
        return os.environ["UMBRA_SOCKET"]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "umbra", "umbrad.sock")
    return f"/tmp/umbra-{os.getuid()}/umbrad.sock"


def _folder(f: Mapping[str, Any] | str) -> dict[str, Any]:
    if isinstance(f, str):
        return {"path": f}
    return {k: v for k, v in f.items() if v is not None}


@dataclass(frozen=True)
class ExecResult:
    """What ``Session.exec`` gives: all the output, and how it ended."""

    stdout: bytes
    stderr: bytes
    exit: ExitInfo


Listener = Callable[[dict[str, Any]], Any]


class SessionFiles:
    """Files in the session, through its guest agent (``file.*``)."""

    def __init__(self, s: Session) -> None:
        self._s = s

    async def read(self, path: str, *, host: bool = False, offset: int = 0, length: int | None = None) -> bytes:
        """A file (or part of it), in requests of at most ``MAX_FILE_CHUNK`` bytes."""
        parts: list[bytes] = []
        left = length if length is not None else -1
        while left != 0:
            n = t.MAX_FILE_CHUNK if left < 0 else min(left, t.MAX_FILE_CHUNK)
            r = await self._s.client.call(
                "file.read", {"session": self._s.name, "path": path, "host": host, "offset": offset, "len": n}
            )
            data = decode_data(r)
            parts.append(data)
            offset += len(data)
            if left > 0:
                left -= len(data)
            if r.get("eof") or not data:
                break
        return b"".join(parts)

    async def read_text(self, path: str, *, host: bool = False, encoding: str = "utf-8") -> str:
        return (await self.read(path, host=host)).decode(encoding)

    async def write(
        self,
        path: str,
        data: bytes | str,
        *,
        host: bool = False,
        append: bool = False,
        offset: int | None = None,
        create_dirs: bool = False,
        mode: int | None = None,
    ) -> int:
        """Replaces the file (or appends, or writes at ``offset``); returns the bytes written."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        written = 0
        while True:
            piece = raw[written : written + t.MAX_FILE_CHUNK]
            params: dict[str, Any] = {
                "session": self._s.name,
                "path": path,
                "host": host,
                "data": base64.b64encode(piece).decode(),
                "encoding": "base64",
                "create_dirs": create_dirs,
            }
            if mode is not None:
                params["permissions"] = mode
            if offset is not None:
                params["offset"] = offset + written
            elif append:
                params["append"] = True
            elif written > 0:
                params["offset"] = written
            r = await self._s.client.call("file.write", params)
            written += int(r["bytes"])
            if written >= len(raw) or (r["bytes"] == 0 and piece):
                return written

    async def stat(self, path: str, *, host: bool = False) -> t.FileStat:
        return cast(t.FileStat, await self._s.client.call("file.stat", {"session": self._s.name, "path": path, "host": host}))

    async def list(self, path: str, *, host: bool = False, limit: int | None = None) -> t.DirList:
        params: dict[str, Any] = {"session": self._s.name, "path": path, "host": host}
        if limit is not None:
            params["limit"] = limit
        return cast(t.DirList, await self._s.client.call("file.list", params))


class SessionFolders:
    """Folders shared with the session (``folder.*``)."""

    def __init__(self, s: Session) -> None:
        self._s = s

    async def mount(self, path: str, *, mode: t.ShareMode | None = None, name: str | None = None) -> t.FolderInfo:
        spec = _folder({"path": path, "mode": mode, "name": name})
        return cast(t.FolderInfo, await self._s.client.call("folder.mount", {"session": self._s.name, **spec}))

    async def unmount(self, name: str) -> None:
        await self._s.client.call("folder.unmount", {"session": self._s.name, "name": name})

    async def list(self) -> list[t.FolderInfo]:
        return (await self._s.refresh())["folders"]


class SessionShadow:
    """Shadow folders: changes stay in the guest until the host applies them (``shadow.*``)."""

    def __init__(self, s: Session) -> None:
        self._s = s

    async def diff(self, folder: str) -> t.ShadowDiffResult:
        """What the guest changed, captured as a change-set to review."""
        return cast(t.ShadowDiffResult, await self._s.client.call("shadow.diff", {"session": self._s.name, "folder": folder}))

    async def apply(self, folder: str, changeset: str, *, paths: Sequence[str] | None = None) -> t.ShadowApplyReport:
        """Writes the reviewed change-set ``changeset`` (from ``diff``) to the host folder."""
        params: dict[str, Any] = {"session": self._s.name, "folder": folder, "changeset": changeset}
        if paths is not None:
            params["paths"] = list(paths)
        return cast(t.ShadowApplyReport, await self._s.client.call("shadow.apply", params))

    async def reset(self, folder: str) -> None:
        await self._s.client.call("shadow.reset", {"session": self._s.name, "folder": folder})

    async def export(self, folder: str, *, dest: str | None = None) -> t.Exported:
        params: dict[str, Any] = {"session": self._s.name, "folder": folder}
        if dest is not None:
            params["dest"] = dest
        return cast(t.Exported, await self._s.client.call("shadow.export", params))


class SessionLanguages:
    """Language servers in the guest (``lsp.*``) and the diagnostics a proposed change would
    bring (``diagnostics.for_change``); see docs/diagnostics.md."""

    def __init__(self, s: Session) -> None:
        self._s = s

    async def start(
        self,
        folder: str,
        *,
        language: str | None = None,
        command: Sequence[str] | None = None,
        initialization_options: Any = None,
    ) -> LanguageServer:
        """Starts and initializes a language server on ``folder``: ``language`` (``python``,
        ``c``, ``cpp``) or a ``command`` of your own. Its notifications arrive as
        ``lsp_notification`` events."""
        params: dict[str, Any] = {"session": self._s.name, "folder": folder}
        if language is not None:
            params["language"] = language
        if command is not None:
            params["command"] = list(command)
        if initialization_options is not None:
            params["initialization_options"] = initialization_options
        info = cast(t.LspServerInfo, await self._s.client.call("lsp.start", params))
        return LanguageServer(self._s, info)

    async def list(self) -> list[t.LspServerInfo]:
        return cast(t.LspList, await self._s.client.call("lsp.list", {"session": self._s.name}))["servers"]

    async def for_change(
        self,
        folder: str,
        changes: Mapping[str, str | None],
        *,
        language: str | None = None,
        timeout_ms: int | None = None,
    ) -> t.ForChange:
        """What ``changes`` (path in the folder -> new content, or None to delete) would bring
        (``diagnostics``) and take away (``resolved``); nothing is written."""
        params: dict[str, Any] = {"session": self._s.name, "folder": folder, "changes": dict(changes)}
        if language is not None:
            params["language"] = language
        if timeout_ms is not None:
            params["timeout_ms"] = timeout_ms
        return cast(t.ForChange, await self._s.client.call("diagnostics.for_change", params))


class LanguageServer:
    """A language server started with ``session.languages.start``."""

    def __init__(self, s: Session, info: t.LspServerInfo) -> None:
        self._s = s
        self.info = info
        self.id = info["server"]

    async def request(self, method: str, params: Any, *, timeout_ms: int | None = None) -> Any:
        """An LSP request: the server's result (its error answer raises)."""
        p: dict[str, Any] = {"session": self._s.name, "server": self.id, "method": method, "params": params}
        if timeout_ms is not None:
            p["timeout_ms"] = timeout_ms
        return cast(t.LspResult, await self._s.client.call("lsp.request", p))["result"]

    async def notify(self, method: str, params: Any) -> None:
        await self._s.client.call("lsp.notify", {"session": self._s.name, "server": self.id, "method": method, "params": params})

    async def stop(self) -> None:
        await self._s.client.call("lsp.stop", {"session": self._s.name, "server": self.id})


class Session:
    """A session, by name: from ``client.sessions.start/get/list/resume`` or
    ``client.sessions.session(name)``."""

    def __init__(self, client: Umbra, name: str, info: t.SessionInfo | None = None) -> None:
        self.client = client
        self.name = name
        self._info = info
        self.files = SessionFiles(self)
        self.folders = SessionFolders(self)
        self.shadow = SessionShadow(self)
        self.languages = SessionLanguages(self)

    def __repr__(self) -> str:
        return f"Session({self.name!r}, status={self.status!r})"

    @property
    def info(self) -> t.SessionInfo | None:
        """Its state as last fetched."""
        return self._info

    @property
    def status(self) -> t.SessionStatus | None:
        return None if self._info is None else self._info["status"]

    async def _set(self, method: str, params: dict[str, Any]) -> t.SessionInfo:
        self._info = cast(t.SessionInfo, await self.client.call(method, params))
        return self._info

    async def refresh(self) -> t.SessionInfo:
        return await self._set("session.get", {"name": self.name})

    async def stop(self) -> t.SessionInfo:
        return await self._set("session.stop", {"name": self.name})

    async def snapshot(self) -> t.SessionInfo:
        return await self._set("session.snapshot", {"name": self.name})

    async def resume(self, *, discard_snapshot: bool = False) -> t.SessionInfo:
        params: dict[str, Any] = {"name": self.name}
        if discard_snapshot:
            params["discard_snapshot"] = True
        return await self._set("session.resume", params)

    async def fork(self, name: str) -> Session:
        return await self.client.sessions.fork(self.name, name)

    async def set_network(self, network: t.NetworkPolicy) -> t.SessionInfo:
        return await self._set("session.set_network", {"name": self.name, "network": network})

    async def update(self, **settings: Any) -> t.Updated:
        updated = cast(t.Updated, await self.client.call("session.update", {"name": self.name, "settings": settings}))
        self._info = updated["session"]
        return updated

    async def set_secret(self, secret: t.SecretSpec) -> t.SessionInfo:
        return await self._set("session.set_secret", {"name": self.name, "secret": secret})

    async def expose(self, guest_port: int, *, host_port: int | None = None, bind: str | None = None) -> t.PortInfo:
        params: dict[str, Any] = {"session": self.name, "guest_port": guest_port}
        if host_port is not None:
            params["host_port"] = host_port
        if bind is not None:
            params["bind"] = bind
        return cast(t.PortInfo, await self.client.call("session.expose", params))

    async def unexpose(self, guest_port: int) -> None:
        await self.client.call("session.unexpose", {"session": self.name, "guest_port": guest_port})

    async def ports(self) -> list[t.PortInfo]:
        return cast(list[t.PortInfo], (await self.client.call("session.ports", {"name": self.name}))["ports"])

    async def delete(self) -> None:
        await self.client.call("session.delete", {"name": self.name})

    async def logs(self, *, lines: int | None = None) -> t.SessionLogs:
        return await self.client.sessions.logs(self.name, lines=lines)

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        tty: bool | tuple[int, int] = False,
        timeout_secs: int | None = None,
        detach: bool = False,
    ) -> Process:
        """Starts a process; returns once the guest started it. ``argv[0]`` is looked up in the
        guest's ``PATH``; a command that is not found raises ``NotFoundError``."""
        return await self.client._spawn(self.name, argv, cwd, env, tty, timeout_secs, detach)

    async def exec(
        self,
        argv: Sequence[str],
        *,
        input: bytes | str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_secs: int | None = None,
    ) -> ExecResult:
        """Runs a command to its end and collects its output (in memory)."""
        p = await self.spawn(argv, cwd=cwd, env=env, timeout_secs=timeout_secs)
        out = asyncio.ensure_future(p.stdout.read())
        err = asyncio.ensure_future(p.stderr.read())
        try:
            if input:
                await p.stdin.write(input)
            await p.stdin.close()
        except UmbraError:
            pass  # it may end without reading its input
        exit_info = await p.wait()
        return ExecResult(await out, await err, exit_info)

    async def processes(self) -> list[t.ProcessInfo]:
        r = await self.client.call("process.list", {"session": self.name})
        return cast(list[t.ProcessInfo], r["processes"])

    async def attach(self, process: int, *, start: Mapping[str, int] | None = None) -> Process:
        """Attaches to a detached process: its output from ``start`` (default: all the session
        keeps), then as it comes, then its exit."""
        frm = {"stdout": 0, "stderr": 0, **(start or {})}
        argv = next((p["argv"] for p in await self.processes() if p["process"] == process), [])
        return await self.client._attach(self.name, {"session": self.name, "process": process, "from": frm}, argv)

    async def kill_all(self, sig: Signal = "SIGKILL") -> None:
        await self.client.call("process.kill_all", {"session": self.name, "signal": signal_number(sig)})


class Sessions:
    """``client.sessions``: start, list, get, stop, resume, snapshot, fork, delete, logs."""

    def __init__(self, client: Umbra) -> None:
        self._c = client

    async def start(
        self,
        name: str,
        *,
        folders: Sequence[Mapping[str, Any] | str] = (),
        **settings: Any,
    ) -> Session:
        """Creates and boots a session; returns once it is ready. ``settings`` are
        ``session.start``'s (``memory_mib``, ``cpus``, ``network``, …)."""
        params = {**settings, "name": name, "folders": [_folder(f) for f in folders]}
        info = cast(t.SessionInfo, await self._c.call("session.start", params))
        return Session(self._c, name, info)

    async def list(self) -> list[Session]:
        r = await self._c.call("session.list", {})
        return [Session(self._c, i["name"], i) for i in r["sessions"]]

    async def get(self, name: str) -> Session:
        return Session(self._c, name, await self._c.call("session.get", {"name": name}))

    def session(self, name: str) -> Session:
        """A handle without asking umbrad."""
        return Session(self._c, name)

    async def stop(self, name: str) -> Session:
        return Session(self._c, name, await self._c.call("session.stop", {"name": name}))

    async def resume(self, name: str, *, discard_snapshot: bool = False) -> Session:
        s = Session(self._c, name)
        await s.resume(discard_snapshot=discard_snapshot)
        return s

    async def snapshot(self, name: str) -> Session:
        return Session(self._c, name, await self._c.call("session.snapshot", {"name": name}))

    async def fork(self, source: str, name: str) -> Session:
        return Session(self._c, name, await self._c.call("session.fork", {"source": source, "name": name}))

    async def delete(self, name: str) -> None:
        await self._c.call("session.delete", {"name": name})

    async def logs(self, name: str, *, lines: int | None = None) -> t.SessionLogs:
        params: dict[str, Any] = {"name": name}
        if lines is not None:
            params["lines"] = lines
        return cast(t.SessionLogs, await self._c.call("session.logs", params))


class Bundles:
    """``client.bundles``: status, download, delete_and_reinstall."""

    def __init__(self, client: Umbra) -> None:
        self._c = client

    async def status(self) -> t.BundleStatus:
        return cast(t.BundleStatus, await self._c.call("bundle.status", {}))

    async def download(
        self,
        url: str | None = None,
        *,
        warm: bool = False,
        on_progress: Callable[[dict[str, Any]], Any] | None = None,
    ) -> t.Downloaded:
        params: dict[str, Any] = {"warm": warm}
        if url is not None:
            params["url"] = url
        return cast(t.Downloaded, await self._with_progress("bundle.download", params, on_progress))

    async def delete_and_reinstall(
        self, url: str | None = None, *, on_progress: Callable[[dict[str, Any]], Any] | None = None
    ) -> t.Downloaded:
        params = {} if url is None else {"url": url}
        return cast(t.Downloaded, await self._with_progress("bundle.delete_and_reinstall", params, on_progress))

    async def _with_progress(self, method: str, params: dict[str, Any], on_progress: Any) -> Any:
        if on_progress is None:
            return await self._c.call(method, params)

        def listener(e: dict[str, Any]) -> None:
            on_progress({k: v for k, v in e.items() if k not in ("event", "time_ms", "session")})

        self._c.on("download_progress", listener)
        self._c._event_users += 1
        try:
            await self._c._ensure_subscribed()
            return await self._c.call(method, params)
        finally:
            self._c.off("download_progress", listener)
            self._c._event_users -= 1
            await self._c._unsubscribe_unless_needed()


class Config:
    """``client.config``: get, set, pool."""

    def __init__(self, client: Umbra) -> None:
        self._c = client

    async def get(self) -> t.DaemonConfig:
        return cast(t.DaemonConfig, await self._c.call("config.get", {}))

    async def set(self, **changes: Any) -> t.DaemonConfig:
        return cast(t.DaemonConfig, await self._c.call("config.set", changes))

    async def pool(self) -> t.PoolStatus:
        return cast(t.PoolStatus, await self._c.call("pool.status", {}))


class EventStream:
    """What ``Umbra.events`` returns: listening from its creation, not its first iteration."""

    def __init__(self, client: Umbra, kinds: Sequence[str], max_queue: int) -> None:
        self._client = client
        self._kinds = set(kinds)
        self._max = max_queue
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._dropped = 0
        client.on("event", self._put)
        client.on("events_lost", self._lost)

    def _lost(self, e: dict[str, Any]) -> None:
        # umbrad dropped events for this client (it read too slowly): this stream missed them too.
        self._dropped += int(e.get("count", 0))

    def _put(self, e: dict[str, Any]) -> None:
        if self._kinds and e.get("event") not in self._kinds:
            return
        if self._queue.qsize() >= self._max:
            self._queue.get_nowait()
            self._dropped += 1
        self._queue.put_nowait(e)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._dropped:
            n, self._dropped = self._dropped, 0
            return {"event": "events_lost", "count": n}
        return await self._queue.get()

    async def aclose(self) -> None:
        self._client.off("event", self._put)
        self._client.off("events_lost", self._lost)


class Umbra:
    """A client of umbrad. ``await Umbra.connect()``; ``await client.close()`` (or ``async
    with``). Events: ``client.on(kind, fn)`` with an event kind (``"status"``, ``"exit"``, …),
    ``"event"`` for every event, ``"disconnected"``, ``"reconnected"`` and ``"events_lost"``;
    or ``async for e in client.events()``."""

    def __init__(self, socket_path: str, reconnect: bool, subscribe: bool, backoff: tuple[float, float]) -> None:
        self.socket_path = socket_path
        self.sessions = Sessions(self)
        self.bundles = Bundles(self)
        self.config = Config(self)
        self._reconnect = reconnect
        self._subscribe = subscribe
        self._backoff = backoff
        self._connection: Connection | None = None
        self._state = "connected"
        self._info: t.DaemonInfo | None = None
        self._processes: dict[int, Process] = {}
        self._subscription: int | None = None
        self._listeners: dict[str, list[Listener]] = {}
        self._reconnecting: asyncio.Future[None] | None = None
        self._opening: Connection | None = None
        self._subscribing = asyncio.Lock()
        #: Calls that need events on a client connected with ``subscribe=False``.
        self._event_users = 0

    @classmethod
    async def connect(
        cls,
        socket_path: str | None = None,
        *,
        reconnect: bool = True,
        subscribe: bool = True,
        backoff: tuple[float, float] = (0.1, 2.0),
    ) -> Umbra:
        """Connects, checks that umbrad speaks this client's API major version, and (unless
        ``subscribe=False``) subscribes to its events. Raises ``UnavailableError`` when umbrad
        is not running, ``UnsupportedError`` when it speaks another major version."""
        client = cls(socket_path or default_socket_path(), reconnect, subscribe, backoff)
        await client._open()
        return client

    async def __aenter__(self) -> Umbra:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def daemon(self) -> t.DaemonInfo:
        """The daemon as of the last (re)connection."""
        if self._info is None:
            raise UnavailableError(f"not connected to umbrad at {self.socket_path}")
        return self._info

    @property
    def connected(self) -> bool:
        return self._state == "connected" and self._connection is not None and not self._connection.is_closed

    # ---- events

    def on(self, name: str, listener: Listener) -> None:
        self._listeners.setdefault(name, []).append(listener)

    def off(self, name: str, listener: Listener) -> None:
        if listener in self._listeners.get(name, []):
            self._listeners[name].remove(listener)

    def events(self, *, kinds: Sequence[str] = (), max_queue: int = 1024) -> EventStream:
        """Every event (of ``kinds``, if given) from this call on, as an async iterator (``async
        for e in client.events()``; ``aclose()`` it when done). At most ``max_queue`` wait for a
        slow consumer; older ones are dropped and an ``events_lost`` item says how many."""
        return EventStream(self, kinds, max_queue)

    def _emit(self, name: str, arg: dict[str, Any]) -> None:
        for listener in list(self._listeners.get(name, [])):
            try:
                r = listener(arg)
                if asyncio.iscoroutine(r):
                    asyncio.ensure_future(r)
            except Exception as e:  # a listener's bug must not break the reader
                asyncio.get_running_loop().call_exception_handler(
                    {"message": f"an umbra {name!r} listener ({listener!r}) raised", "exception": e}
                )

    # ---- calls

    async def call(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        """Calls any method by name with its wire params and result (docs/ipc.md)."""
        return await self._live().request(method, dict(params or {}))

    async def daemon_info(self) -> t.DaemonInfo:
        self._info = cast(t.DaemonInfo, await self.call("daemon.info", {}))
        return self._info

    async def respond_permission(self, request_id: str, approved: bool, scope: str = "once") -> None:
        params: dict[str, Any] = {"request_id": request_id, "approved": approved}
        if scope != "once":
            params["scope"] = scope
        await self.call("permission.respond", params)

    async def close(self) -> None:
        """Disconnects for good: umbrad kills this client's processes (their ``wait()``
        returns with ``lost``)."""
        if self._state == "closed":
            return
        self._state = "closed"
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        c, self._connection = self._connection, None
        if c is not None and not c.is_closed:
            c.close(UnavailableError(f"the client closed its connection to umbrad at {self.socket_path}"))
            await c.wait_closed()
        self._lose_processes("the client was closed")

    # ---- processes (internal)

    def _numbered_stdin(self) -> bool:
        major, _, minor = (self._info["api_version"] if self._info else "0.0").partition(".")
        return major == "1" and int(minor or 0) >= 9

    def _track(self, p: Process) -> Process:
        self._processes[p.id] = p

        def forget(_: Any) -> None:
            if self._processes.get(p.id) is p:
                del self._processes[p.id]

        p._exited.add_done_callback(forget)
        return p

    async def _spawn(
        self,
        session: str,
        argv: Sequence[str],
        cwd: str | None,
        env: Mapping[str, str] | None,
        tty: bool | tuple[int, int],
        timeout_secs: int | None,
        detach: bool,
    ) -> Process:
        connection = self._live()
        params: dict[str, Any] = {"session": session, "argv": list(argv)}
        if cwd is not None:
            params["cwd"] = cwd
        if env is not None:
            params["env"] = dict(env)
        if isinstance(tty, tuple):
            params["tty"] = {"cols": tty[0], "rows": tty[1]}
        elif tty:
            params["tty"] = {"cols": 80, "rows": 24}
        if timeout_secs is not None:
            params["timeout_secs"] = timeout_secs
        if detach:
            params["detach"] = True
        made: list[Process] = []

        def on_result(r: Any) -> None:
            # Registered before the next line is read: the process's events follow its answer.
            made.append(
                self._track(
                    Process(connection, session, {"id": r["process"], "pid": r["pid"]}, list(argv), detach,
                            numbered_stdin=self._numbered_stdin())
                )
            )

        def on_late(r: Any) -> None:
            # The caller gave up before the answer: nobody holds this process, so it ends.
            if isinstance(r, dict) and isinstance(r.get("process"), int):
                kill = {"session": session, "process": r["process"], "signal": 9}
                connection.start("process.kill", kill).add_done_callback(lambda f: f.cancelled() or f.exception())

        await connection.request("process.spawn", params, on_result, on_late)
        return made[0]

    async def _attach(self, session: str, params: dict[str, Any], argv: Sequence[str]) -> Process:
        connection = self._live()
        existing = self._processes.get(params["process"])
        made: list[Process] = []

        def on_result(r: Any) -> None:
            if existing is not None:
                existing._on_connection_lost("attached again: this client's earlier view of it ends")
            made.append(
                self._track(
                    Process(connection, session, {"id": r["process"], "pid": r.get("pid", 0)}, list(argv), True,
                            start=dict(params["from"]), numbered_stdin=self._numbered_stdin())
                )
            )

        await connection.request("process.attach", params, on_result)
        return made[0]

    # ---- connection (internal)

    def _live(self) -> Connection:
        if self._state == "closed":
            raise UnavailableError(f"this client of umbrad at {self.socket_path} was closed")
        c = self._connection
        if c is None or c.is_closed:
            raise UnavailableError(
                f"not connected to umbrad at {self.socket_path} (the connection was lost; "
                f"{'reconnecting' if self._reconnect else 'reconnection is off'}); start it with `umbrad`"
            )
        return c

    async def _ensure_subscribed(self) -> None:
        async with self._subscribing:  # one subscription, however many ask at once
            c = self._connection
            if self._subscription is None and c is not None and not c.is_closed:
                r = await c.request("events.subscribe", {})
                if c is self._connection:
                    self._subscription = int(r["subscription"])

    async def _unsubscribe_unless_needed(self) -> None:
        async with self._subscribing:
            c, sub = self._connection, self._subscription
            if self._subscribe or self._event_users > 0 or sub is None or c is None or c.is_closed:
                return
            self._subscription = None
            try:
                await c.request("events.unsubscribe", {"subscription": sub})
            except UmbraError:
                pass  # gone with its connection

    async def _open(self) -> None:
        connection = await Connection.open(self.socket_path, self._on_notification, self._on_close)
        self._opening = connection
        try:
            self._connection = connection
            info = await connection.request("daemon.info", {})
            theirs = str(info["api_version"]).split(".")[0]
            ours = t.API_VERSION.split(".")[0]
            if theirs != ours:
                raise UnsupportedError(
                    f"umbrad at {self.socket_path} speaks API {info['api_version']}, and this client speaks "
                    f"{t.API_VERSION}: use a client for API {theirs}.x (umbrad {info.get('version')})"
                )
            self._info = cast(t.DaemonInfo, info)
            self._subscription = None
            if self._subscribe or self._event_users > 0:
                await self._ensure_subscribed()
            if connection.is_closed:
                raise connection.error or UnavailableError(
                    f"umbrad at {self.socket_path} closed the connection while it was being set up"
                )
        except BaseException as e:
            self._connection = None
            connection.close(e if isinstance(e, UmbraError) else None)
            raise
        finally:
            self._opening = None

    def _on_notification(self, source: Connection, method: str, params: Any) -> None:
        if source is not self._connection or not isinstance(params, dict):
            return
        if method == "process.event":
            pid = params.get("process")
            p = self._processes.get(pid) if isinstance(pid, int) else None
            if p is not None:
                p._on_event(params)
        elif method == "event":
            self._emit(str(params.get("event")), params)
            self._emit("event", params)
        elif method == "events.lost":
            self._emit("events_lost", {"count": params.get("count", 0)})

    def _lose_processes(self, why: str, keep_detached: bool = False) -> None:
        for p in [p for p in self._processes.values() if not (keep_detached and p.detached)]:
            self._processes.pop(p.id, None)
            p._on_connection_lost(f"{why}; the process runs on in its session: attach to it again" if p.detached else why)

    def _on_close(self, source: Connection, error: UmbraError) -> None:
        if source is not self._connection or source is self._opening:
            return
        self._connection = None
        self._subscription = None
        will = self._reconnect and self._state != "closed"
        self._lose_processes(error.message, keep_detached=will)
        if self._state == "closed":
            return
        # Not "closed": that is the caller's close(); calls now say the connection was lost.
        self._state = "reconnecting" if will else "disconnected"
        self._emit("disconnected", {"error": error, "will_reconnect": will})
        if will and self._reconnecting is None:
            self._reconnecting = asyncio.ensure_future(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        """The one reconnection under way: it ends when a connection is made (or the client
        closed); a connection lost after that starts a new one."""
        since = time.monotonic()
        attempt = 0
        initial, most = self._backoff
        while self._state == "reconnecting":
            attempt += 1
            await asyncio.sleep(min(most, initial * 2 ** min(attempt - 1, 16)))
            try:
                await self._open()
            except UnsupportedError as e:
                self._reconnecting = None
                self._state = "closed"
                self._lose_processes(e.message)
                self._emit("disconnected", {"error": e, "will_reconnect": False})
                return
            except Exception:  # not there yet (refused, busy, a half-open socket): again
                continue
            connection = self._connection
            if self._state == "closed" or connection is None:
                if connection is not None:
                    connection.close()
                return
            # From here a lost connection is a new disconnection with a reconnection of its own.
            self._reconnecting = None
            self._state = "connected"
            await self._reattach(connection)
            if connection is self._connection and not connection.is_closed:
                self._emit(
                    "reconnected",
                    {"daemon": self._info, "attempts": attempt, "downtime_ms": int((time.monotonic() - since) * 1000)},
                )
            return
        self._reconnecting = None

    async def _reattach(self, connection: Connection) -> None:
        async def one(p: Process) -> None:
            params = {"session": p.session, "process": p.id, "from": p.offsets}
            try:
                await connection.request("process.attach", params, lambda _: p._rebind(connection))
            except UmbraError as e:
                if connection.is_closed:
                    return  # lost again: the next reconnection attaches it
                self._processes.pop(p.id, None)
                p._on_connection_lost(f"it could not be attached again after a reconnect: {e.message}")

        await asyncio.gather(*(one(p) for p in list(self._processes.values()) if p.detached and p.running))
