"""A process in a session: its output streams (with flow control), its stdin, its exit."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import NotFoundError, UmbraError, UnavailableError

if TYPE_CHECKING:
    from ._connection import Connection

#: ``process.stdin`` requests of one write in flight at once.
STDIN_QUEUE = 16
#: Bytes of stdin in one ``process.stdin`` request.
STDIN_PIECE = 64 * 1024
#: Bytes an output stream holds for a consumer that is behind before it stops acknowledging:
#: umbrad then stops sending and the process pauses in the guest. Memory per stream stays
#: below this plus one output window.
HIGH_WATER = 1 << 20

Signal = str | int


#: Linux signal numbers by name: the guest is Linux whatever the host runs (Python's own
#: ``signal`` module numbers them as the host does: SIGUSR1 is 30 on macOS, 10 here).
SIGNALS: dict[str, int] = {
    "SIGHUP": 1,
    "SIGINT": 2,
    "SIGQUIT": 3,
    "SIGILL": 4,
    "SIGTRAP": 5,
    "SIGABRT": 6,
    "SIGBUS": 7,
    "SIGFPE": 8,
    "SIGKILL": 9,
    "SIGUSR1": 10,
    "SIGSEGV": 11,
    "SIGUSR2": 12,
    "SIGPIPE": 13,
    "SIGALRM": 14,
    "SIGTERM": 15,
    "SIGCHLD": 17,
    "SIGCONT": 18,
    "SIGSTOP": 19,
    "SIGTSTP": 20,
    "SIGTTIN": 21,
    "SIGTTOU": 22,
    "SIGWINCH": 28,
}


def signal_number(sig: Signal) -> int:
    """``"SIGTERM"``, ``"TERM"`` or 15 → 15 (Linux numbering, as the guest uses)."""
    if isinstance(sig, bool) or not isinstance(sig, (int, str)):
        raise TypeError(f"a signal is a name or a number, not {sig!r}")
    if isinstance(sig, int):
        if not 1 <= sig <= 64:
            raise ValueError(f"no signal numbered {sig}")
        return sig
    name = sig.upper()
    n = SIGNALS.get(name if name.startswith("SIG") else f"SIG{name}")
    if n is None:
        raise ValueError(f"unknown signal {sig!r}")
    return n


def signal_name(n: int) -> str | None:
    """The Linux name of signal ``n``, when it has one here."""
    return next((k for k, v in SIGNALS.items() if v == n), None)


@dataclass(frozen=True)
class ExitInfo:
    """How a process ended."""

    process: int
    #: Its exit code, when it exited by itself.
    code: int | None
    #: The signal that ended it (9 when its VM went away).
    signal: int | None
    duration_ms: int
    #: It ended because its VM or this client's connection went away.
    lost: bool
    #: Its ``timeout_secs`` ran out.
    timed_out: bool
    #: Why, for a lost or timed-out process.
    reason: str | None
    #: The signal the session's approval or an interrupt sent first, if one did.
    interrupted: int | None = None

    @property
    def signal_name(self) -> str | None:
        return None if self.signal is None else signal_name(self.signal)

    @property
    def status(self) -> int:
        """A shell's ``$?``: 125 when lost, 124 when timed out, else the code or 128 + the
        signal (128 + ``interrupted`` when an interrupt ended it)."""
        if self.lost:
            return 125
        if self.timed_out:
            return 124
        own = self.code if self.code is not None else (128 + self.signal if self.signal is not None else 125)
        return 128 + self.interrupted if self.interrupted is not None and own != 0 else own

    @classmethod
    def from_event(cls, e: dict[str, Any]) -> ExitInfo:
        return cls(
            process=int(e.get("process", 0)),
            code=e.get("code"),
            signal=e.get("signal"),
            duration_ms=int(e.get("duration_ms", 0)),
            lost=bool(e.get("lost", False)),
            timed_out=bool(e.get("timed_out", False)),
            reason=e.get("reason"),
            interrupted=e.get("interrupted"),
        )


def decode_data(d: dict[str, Any]) -> bytes:
    data = d.get("data", "")
    if d.get("encoding") == "base64":
        return base64.b64decode(data)
    return str(data).encode()


class OutputStream:
    """One output stream of a process, read with ``await read()``, ``readline()`` or
    ``async for chunk in stream``.

    umbrad sends at most one output window ahead of this client's acks. A chunk is acknowledged
    at once while this stream holds less than ``HIGH_WATER`` bytes, else when the consumer reads:
    a consumer that reads slowly slows the process, end to end, and memory stays bounded.
    """

    def __init__(self, ack: Any, high_water: int = HIGH_WATER) -> None:
        self._ack = ack
        self._high_water = high_water
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._unacked = 0
        self._eof = False
        self._discarding = False
        self._changed = asyncio.Event()
        #: Gaps (``(from, to)`` offsets) in what this client received of a detached process.
        self.gaps: list[tuple[int, int]] = []

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read."""
        return self._size

    def _deliver(self, data: bytes) -> None:
        if self._discarding or self._eof:
            self._ack(len(data))
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size <= self._high_water:
            self._ack(len(data))
        else:
            self._unacked += len(data)
        self._changed.set()

    def _end(self) -> None:
        self._eof = True
        self._changed.set()

    def _consumed(self, n: int) -> None:
        self._size -= n
        if self._unacked > 0 and self._size <= self._high_water:
            # Room again: everything held back is released at once.
            n, self._unacked = self._unacked, 0
            self._ack(n)

    async def _wait(self) -> None:
        while not self._chunks and not self._eof:
            self._changed.clear()
            await self._changed.wait()

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (at least one, unless the stream ended: then ``b""``); with
        ``n < 0``, everything to the end."""
        if n < 0:
            parts: list[bytes] = []
            while True:
                await self._wait()
                if not self._chunks:
                    return b"".join(parts)
                chunk = self._chunks.popleft()
                parts.append(chunk)
                self._consumed(len(chunk))
        await self._wait()
        if not self._chunks or n == 0:
            return b""
        chunk = self._chunks.popleft()
        if len(chunk) > n:
            self._chunks.appendleft(chunk[n:])
            chunk = chunk[:n]
        self._consumed(len(chunk))
        return chunk

    async def readline(self) -> bytes:
        """One line with its ``\\n`` (the rest at the end of the stream)."""
        parts: list[bytes] = []
        while True:
            await self._wait()
            if not self._chunks:
                return b"".join(parts)
            chunk = self._chunks.popleft()
            i = chunk.find(b"\n")
            if i >= 0:
                if i + 1 < len(chunk):
                    self._chunks.appendleft(chunk[i + 1 :])
                chunk = chunk[: i + 1]
                parts.append(chunk)
                self._consumed(len(chunk))
                return b"".join(parts)
            parts.append(chunk)
            self._consumed(len(chunk))

    def discard(self) -> None:
        """Stops keeping this stream's output: what is held is released, and the process is
        never paused for this stream again."""
        self._discarding = True
        n = self._size
        self._chunks.clear()
        self._consumed(n)
        self._changed.set()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self.read(1 << 20)
        if not chunk:
            raise StopAsyncIteration
        return chunk


class InputStream:
    """A process's stdin: ``await write(data)`` returns when the guest took the bytes;
    ``await close()`` closes it after everything written before."""

    def __init__(self, proc: Process) -> None:
        self._proc = proc
        self._lock = asyncio.Lock()

    async def write(self, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        async with self._lock:
            await self._proc._send_stdin(bytes(data))

    async def close(self) -> None:
        async with self._lock:
            await self._proc._close_stdin()


class Process:
    """A process spawned by ``Session.spawn`` (or attached with ``Session.attach``).

    Unless spawned with ``detach``, it belongs to this client's connection: if the connection
    is lost, umbrad kills it and ``wait()`` returns an ``ExitInfo`` with ``lost`` set. A
    detached process is kept by its session: after a reconnect the client attaches to it again
    from the last byte it received, and its streams go on where they were.
    """

    def __init__(
        self,
        connection: Connection,
        session: str,
        pid_info: dict[str, Any],
        argv: list[str],
        detached: bool = False,
        start: dict[str, int] | None = None,
        numbered_stdin: bool = False,
    ) -> None:
        self._connection = connection
        #: umbrad's id for it.
        self.id: int = int(pid_info["id"])
        #: Its pid in the guest.
        self.pid: int = int(pid_info.get("pid", 0))
        self.session = session
        self.argv = list(argv)
        self.detached = detached
        self._received = {"stdout": 0, "stderr": 0, **(start or {})}
        self._skipped = {"stdout": 0, "stderr": 0}
        self._writer = str(uuid.uuid4()) if numbered_stdin else None
        self._stdin_next = 0
        self._attachment = 0
        self._reattached = asyncio.Event()
        self._started = time.monotonic()
        self._exit: ExitInfo | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self.stdout = OutputStream(self._acker("stdout"))
        self.stderr = OutputStream(self._acker("stderr"))
        self.stdin = InputStream(self)

    def _acker(self, stream: str) -> Any:
        def ack(n: int) -> None:
            if self._exit is None and n > 0:
                self._connection.notify(
                    "process.ack", {"session": self.session, "process": self.id, "stream": stream, "bytes": n}
                )

        return ack

    @property
    def exit_info(self) -> ExitInfo | None:
        """How it ended, once it did."""
        return self._exit

    @property
    def running(self) -> bool:
        return self._exit is None

    @property
    def offsets(self) -> dict[str, int]:
        """Bytes of each stream received so far (for a detached process: since it started)."""
        return dict(self._received)

    @property
    def missed(self) -> dict[str, int]:
        """Bytes of each stream this client never received (umbrad keeps 1 MiB per stream of a
        detached process; what went before when this client attached is gone)."""
        return dict(self._skipped)

    async def wait(self, timeout: float | None = None) -> ExitInfo:
        """Waits for it to end (``asyncio.TimeoutError`` after ``timeout`` seconds; the process
        keeps running)."""
        result: ExitInfo = await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        return result

    async def kill(self, sig: Signal = "SIGTERM") -> None:
        """Sends ``sig`` to its process group. A process that already ended is not an error."""
        n = signal_number(sig)
        if self._exit is not None:
            return
        try:
            await self._connection.request("process.kill", {"session": self.session, "process": self.id, "signal": n})
        except NotFoundError:
            if self._exit is None:
                raise

    async def resize(self, cols: int, rows: int) -> None:
        """Resizes its terminal (a process spawned with ``tty``)."""
        await self._connection.request(
            "process.resize", {"session": self.session, "process": self.id, "cols": cols, "rows": rows}
        )

    # ---- internal

    def _on_event(self, e: dict[str, Any]) -> None:
        kind = e.get("event")
        if kind in ("stdout", "stderr"):
            data = decode_data(e)
            out = self.stdout if kind == "stdout" else self.stderr
            offset = e.get("offset")
            if isinstance(offset, int):
                if offset > self._received[kind]:
                    # umbrad no longer keeps what lies between: say so rather than splice.
                    out.gaps.append((self._received[kind], offset))
                    self._skipped[kind] += offset - self._received[kind]
                    self._received[kind] = offset
                # A re-attach may replay what this client has: only the rest is new.
                skip = min(max(0, self._received[kind] - offset), len(data))
                if skip:
                    self._connection.notify(
                        "process.ack", {"session": self.session, "process": self.id, "stream": kind, "bytes": skip}
                    )
                    data = data[skip:]
                self._received[kind] = max(self._received[kind], offset + skip + len(data))
            else:
                self._received[kind] += len(data)
            if data:
                out._deliver(data)
        elif kind == "exit":
            self._finish(ExitInfo.from_event(e))

    def _rebind(self, connection: Connection) -> None:
        self._connection = connection
        # A new attachment starts a new window: what the old one held back is not owed to it.
        self.stdout._unacked = 0
        self.stderr._unacked = 0
        self._attachment += 1
        self._reattached.set()
        self._reattached = asyncio.Event()

    def _on_connection_lost(self, why: str) -> None:
        reason = (
            f"this client's view of the detached process ended: {why}"
            if self.detached
            else f"the connection to umbrad was lost before the process ended: {why}; "
            "a process ends with the connection that spawned it"
        )
        self._finish(
            ExitInfo(
                process=self.id,
                code=None,
                signal=None,
                duration_ms=int((time.monotonic() - self._started) * 1000),
                lost=True,
                timed_out=False,
                reason=reason,
            )
        )

    def _finish(self, e: ExitInfo) -> None:
        if self._exit is not None:
            return
        self._exit = e
        self._reattached.set()
        self.stdout._end()
        self.stderr._end()
        if not self._exited.done():
            self._exited.set_result(e)

    async def _send_again(self, error: BaseException, attachment: int) -> bool:
        """After a request failed with a lost connection: whether to send it again (a detached
        process attached again since, or once it is)."""
        if not isinstance(error, UnavailableError) or not self.detached or self._exit is not None:
            return False
        if self._writer is None:
            return False
        if self._attachment != attachment:
            return True
        event = self._reattached
        await event.wait()
        return self._exit is None

    async def _send_stdin(self, data: bytes) -> None:
        if self._exit is not None:
            raise NotFoundError(f"process {self.id} has ended; its stdin is closed")
        pieces = []
        for at in range(0, len(data), STDIN_PIECE):
            piece = data[at : at + STDIN_PIECE]
            pieces.append((piece, self._stdin_next))
            self._stdin_next += len(piece)
        answered = [False] * len(pieces)
        try:
            await self._send_pieces(pieces, answered)
        finally:
            if not all(answered):
                # Not all taken (an error, or the caller gave up): the next write starts where
                # the guest's stdin is, not after bytes it never got. umbrad skips any that did
                # arrive, by writer and offset.
                self._stdin_next = min(o for (_, o), done in zip(pieces, answered) if not done)

    async def _send_pieces(self, pieces: list[tuple[bytes, int]], answered: list[bool]) -> None:
        while not all(answered):
            attachment = self._attachment
            failure: BaseException | None = None
            in_flight: deque[tuple[int, asyncio.Future[Any]]] = deque()

            async def settle_one() -> None:
                nonlocal failure
                i, future = in_flight.popleft()
                try:
                    await future
                    answered[i] = True
                except UmbraError as e:
                    failure = failure or e

            try:
                # Written in order (umbrad applies process.stdin in arrival order), at most
                # STDIN_QUEUE unanswered at once.
                for i in [i for i, done in enumerate(answered) if not done]:
                    while len(in_flight) >= STDIN_QUEUE and failure is None:
                        await settle_one()
                    if failure is not None:
                        break
                    piece, offset = pieces[i]
                    params: dict[str, Any] = {
                        "session": self.session,
                        "process": self.id,
                        "data": base64.b64encode(piece).decode(),
                        "encoding": "base64",
                    }
                    if self._writer is not None:
                        params["writer"] = self._writer
                        params["offset"] = offset
                    try:
                        in_flight.append((i, self._connection.start("process.stdin", params)))
                    except UmbraError as e:
                        failure = e
                        break
                while in_flight:
                    await settle_one()
            except BaseException:
                # Cancelled: the answers still in flight are nobody's.
                for _, future in in_flight:
                    future.cancel()
                raise
            if failure is not None and not await self._send_again(failure, attachment):
                raise failure

    async def _close_stdin(self) -> None:
        if self._exit is not None:
            return
        while True:
            attachment = self._attachment
            try:
                await self._connection.request("process.close_stdin", {"session": self.session, "process": self.id})
                return
            except NotFoundError:
                return
            except UmbraError as e:
                if not await self._send_again(e, attachment):
                    raise
