"""The blocking client of umbrad: the asyncio client (``umbra.aio``) driven from a thread of its
own, so scripts and test harnesses call it like any function.

.. code-block:: python

    from umbra import Umbra

    with Umbra.connect() as client:
        session = client.sessions.start("demo")
        p = session.spawn(["echo", "hello"])
        print(p.stdout.read(), p.wait().code)

Listeners given to ``on`` run on the client's thread: keep them short, and do not call the
client from them (hand the work to another thread).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from . import _generated as t
from . import aio
from .aio import ExecResult
from . import process as _p
from .errors import UnavailableError
from .process import ExitInfo, Signal

T = TypeVar("T")


class _Loop:
    """An event loop on a daemon thread; ``run`` blocks the caller until a coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="umbra-client", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("the blocking umbra client was called from one of its own listeners")
        if self._closed:
            coro.close()
            raise UnavailableError("this client of umbrad was closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            if future.done():  # the coroutine's own TimeoutError, not ours
                return future.result()
            future.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None
        except BaseException:
            # KeyboardInterrupt in the caller: the call is given up in the loop too.
            future.cancel()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self._closed:
            self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def settle() -> None:
            # Whatever still runs (a call given up by its caller) ends before the loop does.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(settle(), self.loop).result(5)
        except Exception:
            pass  # a task that will not end: the loop stops anyway
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class OutputStream:
    """A process's stdout or stderr: ``read()``, ``readline()``, iteration over chunks."""

    def __init__(self, loop: _Loop, inner: _p.OutputStream) -> None:
        self._loop = loop
        self._inner = inner

    @property
    def gaps(self) -> list[tuple[int, int]]:
        return list(self._inner.gaps)

    @property
    def buffered(self) -> int:
        return int(self._inner.buffered)

    def read(self, n: int = -1) -> bytes:
        return self._loop.run(self._inner.read(n))

    def readline(self) -> bytes:
        return self._loop.run(self._inner.readline())

    def discard(self) -> None:
        self._loop.call_soon(self._inner.discard)

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read(1 << 20):
            yield chunk


class InputStream:
    def __init__(self, loop: _Loop, inner: _p.InputStream) -> None:
        self._loop = loop
        self._inner = inner

    def write(self, data: bytes | str) -> None:
        """Returns when the guest took the bytes."""
        self._loop.run(self._inner.write(data))

    def close(self) -> None:
        self._loop.run(self._inner.close())


class Process:
    """A process in a session (see ``umbra.aio.Process``)."""

    def __init__(self, loop: _Loop, inner: _p.Process) -> None:
        self._loop = loop
        self._inner = inner
        self.id = inner.id
        self.pid = inner.pid
        self.session = inner.session
        self.argv = inner.argv
        self.detached = inner.detached
        self.stdout = OutputStream(loop, inner.stdout)
        self.stderr = OutputStream(loop, inner.stderr)
        self.stdin = InputStream(loop, inner.stdin)

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._inner.exit_info

    @property
    def running(self) -> bool:
        return self._inner.running

    @property
    def offsets(self) -> dict[str, int]:
        return self._inner.offsets

    @property
    def missed(self) -> dict[str, int]:
        return self._inner.missed

    def wait(self, timeout: float | None = None) -> ExitInfo:
        """Waits for it to end (``TimeoutError`` after ``timeout`` s; it keeps running)."""
        try:
            return self._loop.run(self._inner.wait(timeout))
        except asyncio.TimeoutError:
            raise TimeoutError(f"process {self.id} still runs after {timeout} s") from None

    def kill(self, sig: Signal = "SIGTERM") -> None:
        self._loop.run(self._inner.kill(sig))

    def resize(self, cols: int, rows: int) -> None:
        self._loop.run(self._inner.resize(cols, rows))


class SessionFiles:
    def __init__(self, loop: _Loop, inner: aio.SessionFiles) -> None:
        self._loop = loop
        self._inner = inner

    def read(self, path: str, *, host: bool = False, offset: int = 0, length: int | None = None) -> bytes:
        return self._loop.run(self._inner.read(path, host=host, offset=offset, length=length))

    def read_text(self, path: str, *, host: bool = False, encoding: str = "utf-8") -> str:
        return self._loop.run(self._inner.read_text(path, host=host, encoding=encoding))

    def write(
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
        return self._loop.run(
            self._inner.write(
                path, data, host=host, append=append, offset=offset, create_dirs=create_dirs, mode=mode
            )
        )

    def stat(self, path: str, *, host: bool = False) -> t.FileStat:
        return self._loop.run(self._inner.stat(path, host=host))

    def list(self, path: str, *, host: bool = False, limit: int | None = None) -> t.DirList:
        return self._loop.run(self._inner.list(path, host=host, limit=limit))


class SessionFolders:
    def __init__(self, loop: _Loop, inner: aio.SessionFolders) -> None:
        self._loop = loop
        self._inner = inner

    def mount(self, path: str, *, mode: t.ShareMode | None = None, name: str | None = None) -> t.FolderInfo:
        return self._loop.run(self._inner.mount(path, mode=mode, name=name))

    def unmount(self, name: str) -> None:
        self._loop.run(self._inner.unmount(name))

    def list(self) -> list[t.FolderInfo]:
        return self._loop.run(self._inner.list())


class SessionShadow:
    def __init__(self, loop: _Loop, inner: aio.SessionShadow) -> None:
        self._loop = loop
        self._inner = inner

    def diff(self, folder: str) -> t.ShadowDiffResult:
        return self._loop.run(self._inner.diff(folder))

    def apply(self, folder: str, changeset: str, *, paths: Sequence[str] | None = None) -> t.ShadowApplyReport:
        return self._loop.run(self._inner.apply(folder, changeset, paths=paths))

    def reset(self, folder: str) -> None:
        self._loop.run(self._inner.reset(folder))

    def export(self, folder: str, *, dest: str | None = None) -> t.Exported:
        return self._loop.run(self._inner.export(folder, dest=dest))


class SessionLanguages:
    """Language servers in the guest and diagnostics for a change (see
    ``umbra.aio.SessionLanguages``)."""

    def __init__(self, loop: _Loop, inner: aio.SessionLanguages) -> None:
        self._loop = loop
        self._inner = inner

    def start(
        self,
        folder: str,
        *,
        language: str | None = None,
        command: Sequence[str] | None = None,
        initialization_options: Any = None,
    ) -> LanguageServer:
        inner = self._loop.run(
            self._inner.start(folder, language=language, command=command, initialization_options=initialization_options)
        )
        return LanguageServer(self._loop, inner)

    def list(self) -> list[t.LspServerInfo]:
        return self._loop.run(self._inner.list())

    def for_change(
        self,
        folder: str,
        changes: Mapping[str, str | None],
        *,
        language: str | None = None,
        timeout_ms: int | None = None,
    ) -> t.ForChange:
        return self._loop.run(self._inner.for_change(folder, changes, language=language, timeout_ms=timeout_ms))


class LanguageServer:
    """A language server (see ``umbra.aio.LanguageServer``)."""

    def __init__(self, loop: _Loop, inner: aio.LanguageServer) -> None:
        self._loop = loop
        self._inner = inner
        self.info = inner.info
        self.id = inner.id

    def request(self, method: str, params: Any, *, timeout_ms: int | None = None) -> Any:
        return self._loop.run(self._inner.request(method, params, timeout_ms=timeout_ms))

    def notify(self, method: str, params: Any) -> None:
        self._loop.run(self._inner.notify(method, params))

    def stop(self) -> None:
        self._loop.run(self._inner.stop())


class Session:
    """A session, by name (see ``umbra.aio.Session``)."""

    def __init__(self, loop: _Loop, inner: aio.Session) -> None:
        self._loop = loop
        self._inner = inner
        self.name = inner.name
        self.files = SessionFiles(loop, inner.files)
        self.folders = SessionFolders(loop, inner.folders)
        self.shadow = SessionShadow(loop, inner.shadow)
        self.languages = SessionLanguages(loop, inner.languages)

    def __repr__(self) -> str:
        return f"Session({self.name!r}, status={self.status!r})"

    @property
    def info(self) -> t.SessionInfo | None:
        return self._inner.info

    @property
    def status(self) -> t.SessionStatus | None:
        return self._inner.status

    def refresh(self) -> t.SessionInfo:
        return self._loop.run(self._inner.refresh())

    def stop(self) -> t.SessionInfo:
        return self._loop.run(self._inner.stop())

    def snapshot(self) -> t.SessionInfo:
        return self._loop.run(self._inner.snapshot())

    def resume(self, *, discard_snapshot: bool = False) -> t.SessionInfo:
        return self._loop.run(self._inner.resume(discard_snapshot=discard_snapshot))

    def fork(self, name: str) -> Session:
        return Session(self._loop, self._loop.run(self._inner.fork(name)))

    def set_network(self, network: t.NetworkPolicy) -> t.SessionInfo:
        return self._loop.run(self._inner.set_network(network))

    def update(self, **settings: Any) -> t.Updated:
        return self._loop.run(self._inner.update(**settings))

    def set_secret(self, secret: t.SecretSpec) -> t.SessionInfo:
        return self._loop.run(self._inner.set_secret(secret))

    def expose(self, guest_port: int, *, host_port: int | None = None, bind: str | None = None) -> t.PortInfo:
        return self._loop.run(self._inner.expose(guest_port, host_port=host_port, bind=bind))

    def unexpose(self, guest_port: int) -> None:
        self._loop.run(self._inner.unexpose(guest_port))

    def ports(self) -> list[t.PortInfo]:
        return self._loop.run(self._inner.ports())

    def delete(self) -> None:
        self._loop.run(self._inner.delete())

    def logs(self, *, lines: int | None = None) -> t.SessionLogs:
        return self._loop.run(self._inner.logs(lines=lines))

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        tty: bool | tuple[int, int] = False,
        timeout_secs: int | None = None,
        detach: bool = False,
    ) -> Process:
        p = self._loop.run(
            self._inner.spawn(argv, cwd=cwd, env=env, tty=tty, timeout_secs=timeout_secs, detach=detach)
        )
        return Process(self._loop, p)

    def exec(
        self,
        argv: Sequence[str],
        *,
        input: bytes | str | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_secs: int | None = None,
    ) -> ExecResult:
        return self._loop.run(self._inner.exec(argv, input=input, cwd=cwd, env=env, timeout_secs=timeout_secs))

    def processes(self) -> list[t.ProcessInfo]:
        return self._loop.run(self._inner.processes())

    def attach(self, process: int, *, start: Mapping[str, int] | None = None) -> Process:
        return Process(self._loop, self._loop.run(self._inner.attach(process, start=start)))

    def kill_all(self, sig: Signal = "SIGKILL") -> None:
        self._loop.run(self._inner.kill_all(sig))


class Sessions:
    def __init__(self, loop: _Loop, inner: aio.Sessions) -> None:
        self._loop = loop
        self._inner = inner

    def start(self, name: str, *, folders: Sequence[Mapping[str, Any] | str] = (), **settings: Any) -> Session:
        return Session(self._loop, self._loop.run(self._inner.start(name, folders=folders, **settings)))

    def list(self) -> list[Session]:
        return [Session(self._loop, s) for s in self._loop.run(self._inner.list())]

    def get(self, name: str) -> Session:
        return Session(self._loop, self._loop.run(self._inner.get(name)))

    def session(self, name: str) -> Session:
        return Session(self._loop, self._inner.session(name))

    def stop(self, name: str) -> Session:
        return Session(self._loop, self._loop.run(self._inner.stop(name)))

    def resume(self, name: str, *, discard_snapshot: bool = False) -> Session:
        return Session(self._loop, self._loop.run(self._inner.resume(name, discard_snapshot=discard_snapshot)))

    def snapshot(self, name: str) -> Session:
        return Session(self._loop, self._loop.run(self._inner.snapshot(name)))

    def fork(self, source: str, name: str) -> Session:
        return Session(self._loop, self._loop.run(self._inner.fork(source, name)))

    def delete(self, name: str) -> None:
        self._loop.run(self._inner.delete(name))

    def logs(self, name: str, *, lines: int | None = None) -> t.SessionLogs:
        return self._loop.run(self._inner.logs(name, lines=lines))


class Bundles:
    def __init__(self, loop: _Loop, inner: aio.Bundles) -> None:
        self._loop = loop
        self._inner = inner

    def status(self) -> t.BundleStatus:
        return self._loop.run(self._inner.status())

    def download(
        self, url: str | None = None, *, warm: bool = False, on_progress: Callable[[dict[str, Any]], Any] | None = None
    ) -> t.Downloaded:
        return self._loop.run(self._inner.download(url, warm=warm, on_progress=on_progress))

    def delete_and_reinstall(
        self, url: str | None = None, *, on_progress: Callable[[dict[str, Any]], Any] | None = None
    ) -> t.Downloaded:
        return self._loop.run(self._inner.delete_and_reinstall(url, on_progress=on_progress))


class Config:
    def __init__(self, loop: _Loop, inner: aio.Config) -> None:
        self._loop = loop
        self._inner = inner

    def get(self) -> t.DaemonConfig:
        return self._loop.run(self._inner.get())

    def set(self, **changes: Any) -> t.DaemonConfig:
        return self._loop.run(self._inner.set(**changes))

    def pool(self) -> t.PoolStatus:
        return self._loop.run(self._inner.pool())


class Umbra:
    """A blocking client of umbrad (see ``umbra.aio.Umbra`` for what each call does)."""

    def __init__(self, loop: _Loop, inner: aio.Umbra) -> None:
        self._loop = loop
        self._inner = inner
        self.socket_path = inner.socket_path
        self.sessions = Sessions(loop, inner.sessions)
        self.bundles = Bundles(loop, inner.bundles)
        self.config = Config(loop, inner.config)

    @classmethod
    def connect(
        cls,
        socket_path: str | None = None,
        *,
        reconnect: bool = True,
        subscribe: bool = True,
        backoff: tuple[float, float] = (0.1, 2.0),
    ) -> Umbra:
        loop = _Loop()
        try:
            inner = loop.run(aio.Umbra.connect(socket_path, reconnect=reconnect, subscribe=subscribe, backoff=backoff))
        except BaseException:
            loop.stop()
            raise
        return cls(loop, inner)

    def __enter__(self) -> Umbra:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def daemon(self) -> t.DaemonInfo:
        return self._inner.daemon

    @property
    def connected(self) -> bool:
        return self._inner.connected

    def on(self, name: str, listener: Callable[[dict[str, Any]], Any]) -> None:
        self._loop.call_soon(self._inner.on, name, listener)

    def off(self, name: str, listener: Callable[[dict[str, Any]], Any]) -> None:
        self._loop.call_soon(self._inner.off, name, listener)

    def call(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        return self._loop.run(self._inner.call(method, params))

    def daemon_info(self) -> t.DaemonInfo:
        return self._loop.run(self._inner.daemon_info())

    def respond_permission(self, request_id: str, approved: bool, scope: str = "once") -> None:
        self._loop.run(self._inner.respond_permission(request_id, approved, scope))

    def close(self) -> None:
        """Disconnects for good and stops the client's thread (a second call does nothing)."""
        if self._loop.closed:
            return
        try:
            self._loop.run(self._inner.close())
        finally:
            self._loop.stop()
