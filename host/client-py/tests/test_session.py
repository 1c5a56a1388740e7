"""The blocking client against a real umbrad booting real VMs: the cases of the TypeScript
suite (stream, stdin byte for byte, kill, errors) and files, shadow folders, events."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator

import pytest

import umbra
from umbra import Umbra

from .conftest import Daemon


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Umbra]:
    c = Umbra.connect(daemon.socket)
    yield c
    c.close()


@pytest.fixture(scope="module")
def session(client: Umbra, daemon: Daemon) -> umbra.Session:
    work = os.path.join(daemon.dir, "work")
    os.makedirs(work)
    with open(os.path.join(work, "hello.txt"), "w") as f:
        f.write("from the host\n")
    return client.sessions.start("main", folders=[{"path": work, "name": "work", "mode": "shadow"}])


def test_connect_and_daemon_info(client: Umbra, daemon: Daemon) -> None:
    assert client.connected
    assert client.daemon["pid"] == daemon.pid
    assert client.daemon["api_version"].split(".")[0] == umbra.API_VERSION.split(".")[0]


def test_stdout_and_stderr_stream_and_the_exit_code_comes_last(session: umbra.Session) -> None:
    p = session.spawn(["sh", "-c", "cat /sessions/main/mnt/work/hello.txt; echo oops >&2; for i in 1 2 3; do echo line-$i; done; exit 3"])
    assert p.stdout.readline() == b"from the host\n"
    rest = p.stdout.read()
    assert rest == b"line-1\nline-2\nline-3\n"
    assert p.stderr.read() == b"oops\n"
    e = p.wait(60)
    assert (e.code, e.signal, e.lost, e.status) == (3, None, False, 3)


def test_stdin_arrives_byte_for_byte(session: umbra.Session) -> None:
    data = os.urandom(3 << 20) + bytes(range(256)) * 16
    p = session.spawn(["sha256sum"])
    failures: list[BaseException] = []

    def write() -> None:
        try:
            p.stdin.write(data[: 1 << 20])
            p.stdin.write(data[1 << 20 :])
        except BaseException as e:  # reported below
            failures.append(e)
        finally:
            p.stdin.close()  # even after a failure: sha256sum ends, and the read below too

    # Written from another thread while this one waits: write() returns when the guest took it.
    writer = threading.Thread(target=write)
    writer.start()
    out = p.stdout.read()
    writer.join(60)
    assert not writer.is_alive() and not failures, failures
    assert out.split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert p.wait(60).code == 0
    # And echoed back whole: every byte value, in order.
    r = session.exec(["cat"], input=data)
    assert r.stdout == data and r.exit.code == 0


def test_kill_ends_a_process_by_signal_and_a_late_kill_is_not_an_error(session: umbra.Session) -> None:
    p = session.spawn(["sleep", "600"])
    assert any(i["process"] == p.id for i in session.processes())
    p.kill("SIGTERM")
    e = p.wait(60)
    assert (e.code, e.signal, e.signal_name, e.status) == (None, 15, "SIGTERM", 143)
    p.kill()  # it ended: nothing to do
    q = session.spawn(["sleep", "600"], timeout_secs=1)
    e = q.wait(60)
    assert e.timed_out and e.status == 124


def test_errors_are_their_classes(client: Umbra, session: umbra.Session) -> None:
    with pytest.raises(umbra.SessionNotFoundError) as e:
        client.sessions.get("nope")
    assert e.value.code == "session_not_found" and e.value.method == "session.get"
    with pytest.raises(umbra.NotFoundError):
        session.spawn(["no-such-command-here"])
    with pytest.raises(umbra.InvalidParamsError) as p:
        client.call("session.get", {"name": "main", "nmae": 1})
    assert "nmae" in str(p.value)
    with pytest.raises(umbra.MethodNotFoundError):
        client.call("session.frobnicate", {})
    with pytest.raises(umbra.SessionExistsError):
        client.call("session.fork", {"source": "main", "name": "main"})


def test_files_round_trip_in_chunks(session: umbra.Session) -> None:
    data = os.urandom((2 << 20) + 12345)  # three requests each way
    assert session.files.write("/tmp/big.bin", data) == len(data)
    assert session.files.read("/tmp/big.bin") == data
    assert session.files.read("/tmp/big.bin", offset=10, length=5) == data[10:15]
    session.files.write("/tmp/d/e/f.txt", "x", create_dirs=True, mode=0o600)
    session.files.write("/tmp/d/e/f.txt", "yz", append=True)
    assert session.files.read_text("/tmp/d/e/f.txt") == "xyz"
    st = session.files.stat("/tmp/d/e/f.txt")
    assert st["size"] == 3
    names = [e["name"] for e in session.files.list("/tmp/d/e")["entries"]]
    assert names == ["f.txt"]
    with pytest.raises(umbra.NotFoundError):
        session.files.read("/tmp/absent")


def test_a_shadow_change_is_applied_only_as_reviewed(session: umbra.Session, daemon: Daemon) -> None:
    host_file = os.path.join(daemon.dir, "work", "hello.txt")
    r = session.exec(["sh", "-c", "echo changed > /sessions/main/mnt/work/hello.txt && echo new > /sessions/main/mnt/work/new.txt"])
    assert r.exit.code == 0, r.stderr
    with open(host_file) as f:
        assert f.read() == "from the host\n", "a shadow folder leaves the host alone"
    diff = session.shadow.diff("work")
    paths = sorted(e["path"] for e in diff["changes"])
    assert paths == ["hello.txt", "new.txt"]
    report = session.shadow.apply("work", diff["changeset"])
    assert sorted(report["applied"]) == ["hello.txt", "new.txt"]
    with open(host_file) as f:
        assert f.read() == "changed\n"


def test_events_reach_listeners(client: Umbra) -> None:
    seen: list[dict[str, object]] = []
    done = threading.Event()

    def on_status(e: dict[str, object]) -> None:
        seen.append(e)
        if e.get("session") == "ev" and e.get("status") == "stopped":
            done.set()

    client.on("status", on_status)
    s = client.sessions.start("ev")
    assert s.exec(["echo", "hi"]).stdout == b"hi\n"
    s.delete()
    assert done.wait(30), seen
    client.off("status", on_status)
    statuses = [e["status"] for e in seen if e.get("session") == "ev"]
    assert statuses[0] == "starting" and "ready" in statuses and statuses[-1] == "stopped", statuses
