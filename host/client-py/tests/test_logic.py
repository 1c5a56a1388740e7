"""The client's logic on paths a healthy umbrad seldom takes, with a scripted peer on a Unix
socket (or a stand-in for the connection): stdin resent after a reconnect and rolled back
after a failure or a cancel, a refusal sent with ``"id": null``, a spawn given up before its
answer, a malformed answer, the blocking client after close."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import umbra
from umbra import _generated as g
from umbra._connection import Connection
from umbra.process import STDIN_PIECE, Process
from umbra.sync import _Loop


class Link:
    """A stand-in for a Connection: records requests; the test answers them."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any], asyncio.Future[Any]]] = []
        self.notified: list[tuple[str, Any]] = []

    def start(self, method: str, params: Any = None, on_result: Any = None, on_late: Any = None) -> asyncio.Future[Any]:
        f: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append((method, params, f))
        return f

    async def request(self, method: str, params: Any = None, on_result: Any = None, on_late: Any = None) -> Any:
        return await self.start(method, params)

    def notify(self, method: str, params: Any) -> None:
        self.notified.append((method, params))


def process(link: Link, detached: bool = True) -> Process:
    return Process(link, "s", {"id": 7, "pid": 70}, ["cat"], detached, numbered_stdin=True)  # type: ignore[arg-type]


async def until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def test_stdin_cut_off_by_a_lost_connection_is_sent_again_with_the_same_offsets() -> None:
    async def run() -> None:
        old, new = Link(), Link()
        p = process(old)
        data = bytes(range(256)) * ((2 * STDIN_PIECE) // 256 + 1)
        write = asyncio.ensure_future(p.stdin.write(data))
        await until(lambda: len(old.sent) == 3)
        assert [m["offset"] for _, m, _ in old.sent] == [0, STDIN_PIECE, 2 * STDIN_PIECE]
        old.sent[0][2].set_result({})
        for _, _, f in old.sent[1:]:
            f.set_exception(umbra.UnavailableError("lost"))
        await asyncio.sleep(0)
        assert not write.done(), "it waits for the process to be attached again"
        p._rebind(new)  # type: ignore[arg-type]
        await until(lambda: len(new.sent) == 2)
        assert [m["offset"] for _, m, _ in new.sent] == [STDIN_PIECE, 2 * STDIN_PIECE]
        assert {m["writer"] for _, m, _ in old.sent + new.sent} == {p._writer}
        for _, _, f in new.sent:
            f.set_result({})
        await write
        assert p._stdin_next == len(data)

    asyncio.run(run())


def test_a_refused_stdin_write_rolls_back_so_the_next_starts_where_the_guest_is() -> None:
    async def run() -> None:
        link = Link()
        p = process(link, detached=False)
        write = asyncio.ensure_future(p.stdin.write(b"a" * (2 * STDIN_PIECE)))
        await until(lambda: len(link.sent) == 2)
        link.sent[0][2].set_result({})
        link.sent[1][2].set_exception(umbra.InvalidStateError("refused"))
        with pytest.raises(umbra.InvalidStateError):
            await write
        assert p._stdin_next == STDIN_PIECE
        again = asyncio.ensure_future(p.stdin.write(b"b"))
        await until(lambda: len(link.sent) == 3)
        assert link.sent[2][1]["offset"] == STDIN_PIECE
        link.sent[2][2].set_result({})
        await again

    asyncio.run(run())


def test_a_cancelled_stdin_write_gives_up_its_requests_and_rolls_back() -> None:
    async def run() -> None:
        link = Link()
        p = process(link, detached=False)
        write = asyncio.ensure_future(p.stdin.write(b"a" * (3 * STDIN_PIECE)))
        await until(lambda: len(link.sent) == 3)
        link.sent[0][2].set_result({})
        await asyncio.sleep(0)
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        assert all(f.cancelled() for _, _, f in link.sent[1:])
        assert p._stdin_next == STDIN_PIECE

    asyncio.run(run())


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def with_peer(script: Script, body: Callable[[str], Awaitable[None]]) -> None:
    """Runs ``body`` with the path of a socket whose every connection ``script`` serves."""
    d = tempfile.mkdtemp(prefix="umbra-py-peer-")
    os.chmod(d, 0o700)
    path = os.path.join(d, "umbrad.sock")
    server = await asyncio.start_unix_server(script, path)
    try:
        await body(path)
    finally:
        server.close()
        await server.wait_closed()
        os.unlink(path)
        os.rmdir(d)


async def read_request(r: asyncio.StreamReader) -> dict[str, Any]:
    line = await r.readline()
    assert line, "the client hung up"
    msg: dict[str, Any] = json.loads(line)
    return msg


def send(w: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    w.write(json.dumps(msg).encode() + b"\n")


def info(rid: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": {"api_version": g.API_VERSION, "version": "x", "pid": 1}}


def test_a_refusal_with_a_null_id_is_why_the_connection_closed() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        code = g.ERROR_CODES["busy"]
        send(w, {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": "too many clients (64)", "data": {"code": "busy"}}})
        await w.drain()
        w.close()

    async def body(path: str) -> None:
        with pytest.raises(umbra.BusyError) as e:
            await umbra.aio.Umbra.connect(path, reconnect=False)
        assert "too many clients" in str(e.value)

    asyncio.run(with_peer(script, body))


def test_a_spawn_given_up_before_its_answer_is_killed_and_never_tracked() -> None:
    killed: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, info((await read_request(r))["id"]))
        spawn = await read_request(r)
        assert spawn["method"] == "process.spawn"
        await asyncio.sleep(0.2)  # the caller gives up meanwhile
        send(w, {"jsonrpc": "2.0", "id": spawn["id"], "result": {"process": 42, "pid": 420}})
        kill = await read_request(r)
        await killed.put(kill)
        send(w, {"jsonrpc": "2.0", "id": kill["id"], "result": {}})
        await r.read()

    async def body(path: str) -> None:
        c = await umbra.aio.Umbra.connect(path, reconnect=False, subscribe=False)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(c.sessions.session("s").spawn(["sleep", "600"]), 0.05)
        kill = await asyncio.wait_for(killed.get(), 5)
        assert (kill["method"], kill["params"]) == ("process.kill", {"session": "s", "process": 42, "signal": 9})
        assert c._processes == {}
        await c.close()

    asyncio.run(with_peer(script, body))


def test_an_answer_the_client_cannot_use_fails_its_call_not_the_connection() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, info((await read_request(r))["id"]))
        spawn = await read_request(r)
        send(w, {"jsonrpc": "2.0", "id": spawn["id"], "result": {"no": "process"}})
        get = await read_request(r)
        send(w, {"jsonrpc": "2.0", "id": get["id"], "result": {"name": "s", "status": "ready"}})
        await r.read()

    async def body(path: str) -> None:
        c = await umbra.aio.Umbra.connect(path, reconnect=False, subscribe=False)
        with pytest.raises(umbra.UmbraError) as e:
            await c.sessions.session("s").spawn(["true"])
        assert e.value.method == "process.spawn" and "could not be used" in str(e.value)
        assert c.connected
        assert (await c.call("session.get", {"name": "s"}))["status"] == "ready"
        await c.close()

    asyncio.run(with_peer(script, body))


def test_a_connection_that_closes_during_the_handshake_is_an_error_not_a_client() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.close()

    async def body(path: str) -> None:
        with pytest.raises(umbra.UnavailableError):
            await umbra.aio.Umbra.connect(path, reconnect=False)

    asyncio.run(with_peer(script, body))


def test_the_blocking_loop_after_stop_and_a_coroutines_own_timeout() -> None:
    loop = _Loop()

    async def own_timeout() -> None:
        raise TimeoutError("the coroutine's own")

    with pytest.raises(TimeoutError, match="the coroutine's own"):
        loop.run(own_timeout(), timeout=5)

    async def slow() -> None:
        await asyncio.sleep(30)

    with pytest.raises(TimeoutError, match="no answer within"):
        loop.run(slow(), timeout=0.05)
    loop.stop()
    assert loop.loop.is_closed()

    async def anything() -> int:
        return 1

    with pytest.raises(umbra.UnavailableError):
        loop.run(anything())
    loop.stop()  # twice: nothing


def test_a_connection_object_never_outlives_its_close() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()

    async def body(path: str) -> None:
        seen: list[umbra.UmbraError] = []
        c = await Connection.open(path, lambda *_: None, lambda _, e: seen.append(e))
        pending = c.start("daemon.info", {})
        c.close()
        with pytest.raises(umbra.UnavailableError):
            await pending
        with pytest.raises(umbra.UnavailableError):
            c.start("daemon.info", {})
        assert len(seen) == 1 and c.error is seen[0]

    asyncio.run(with_peer(script, body))
