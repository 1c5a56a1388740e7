"""What needs no daemon: the generated module against the checked-in schema, error mapping,
signals, and the output stream's flow control."""

from __future__ import annotations

import asyncio
import json
import typing
from pathlib import Path

import umbra
from umbra import _generated as g
from umbra._connection import error_from
from umbra.process import HIGH_WATER, OutputStream

SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "host/api/schema/umbrad-ipc.json").read_text())


def test_the_generated_module_says_what_the_schema_says() -> None:
    # The Rust test (`cargo test -p umbra-api`) fails when _generated.py is stale; this one
    # fails when the package would install something else than the checkout's schema.
    assert g.API_VERSION == SCHEMA["api_version"]
    assert g.ERROR_CODES == {e["name"]: e["code"] for e in SCHEMA["errors"]}
    assert set(g.METHOD_NAMES) == set(SCHEMA["methods"])
    assert set(g.ERROR_CLASSES) == set(g.ERROR_CODES)
    for name in SCHEMA["$defs"]:
        assert hasattr(g, name), name
    # Every TypedDict's annotations resolve (forward references included).
    for name in ("SessionInfo", "SpawnParams", "ShadowDiffResult", "ExitEvent", "DaemonConfig"):
        assert typing.get_type_hints(getattr(g, name)), name
    assert "status" in g.SESSION_EVENT_KINDS and "exit" in g.SESSION_EVENT_KINDS


def test_errors_map_to_their_classes() -> None:
    e = error_from({"code": -32001, "message": "no session x", "data": {"code": "session_not_found"}}, "session.get")
    assert isinstance(e, umbra.SessionNotFoundError) and isinstance(e, umbra.UmbraError)
    assert (e.code, e.rpc_code, e.method, str(e)) == ("session_not_found", -32001, "session.get", "no session x")
    odd = error_from({"code": -32099, "message": "new", "data": {"code": "brand_new"}}, None)
    assert type(odd) is umbra.UnknownError and odd.code == "unknown" and odd.daemon_code == "brand_new"
    assert odd.rpc_code == -32099
    # No name: the number decides, when it is one of ours.
    bare = error_from({"code": g.ERROR_CODES["busy"], "message": "too many clients"})
    assert type(bare) is umbra.BusyError and bare.code == "busy"
    garbage = error_from("garbage", "m")
    assert type(garbage) is umbra.UnknownError and "garbage" in str(garbage)
    assert garbage.rpc_code == g.ERROR_CODES["unknown"]


def test_signals_are_numbered_as_linux_numbers_them_whatever_the_host() -> None:
    assert umbra.signal_number("SIGTERM") == 15 and umbra.signal_number("KILL") == 9
    assert umbra.signal_number(2) == 2 and umbra.signal_name(9) == "SIGKILL"
    # Where macOS differs: the guest is Linux.
    assert umbra.signal_number("SIGUSR1") == 10 and umbra.signal_number("SIGCHLD") == 17
    assert umbra.signal_number("usr2") == 12 and umbra.signal_name(28) == "SIGWINCH"
    assert umbra.signal_name(30) is None
    for bad in (0, 65, -9):
        try:
            umbra.signal_number(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"signal {bad} is refused")
    try:
        umbra.signal_number("SIGNOPE")
    except ValueError as e:
        assert "SIGNOPE" in str(e)
    else:
        raise AssertionError("an unknown signal is refused")


def test_an_output_stream_acknowledges_only_what_it_has_room_for() -> None:
    async def run() -> None:
        acked: list[int] = []
        s = OutputStream(acked.append, high_water=100)
        s._deliver(b"a" * 60)
        s._deliver(b"b" * 60)  # over the mark: held back
        assert acked == [60] and s.buffered == 120
        assert await s.read(50) == b"a" * 50
        assert acked == [60, 60], "room again: the held bytes are acknowledged"
        s._deliver(b"c\nd")
        assert await s.readline() == b"a" * 10 + b"b" * 60 + b"c\n"
        s._end()
        assert await s.read() == b"d" and await s.read() == b""
        assert sum(acked) == 123

    asyncio.run(run())
    assert HIGH_WATER >= g.OUTPUT_WINDOW
