"""Reconnection: umbrad killed and started again, and a connection cut while umbrad runs."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest

import umbra
from umbra import Umbra

from .conftest import Daemon


def wait_for(pred: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds} s")
        time.sleep(0.02)


def test_after_umbrad_restarts_the_client_reconnects_and_running_processes_end_lost() -> None:
    d = Daemon("reconnect")
    try:
        client = Umbra.connect(d.socket, backoff=(0.05, 0.5))
        events: list[tuple[str, dict[str, object]]] = []
        client.on("disconnected", lambda e: events.append(("disconnected", e)))
        client.on("reconnected", lambda e: events.append(("reconnected", e)))
        s = client.sessions.start("r")
        first_pid = client.daemon["pid"]
        p = s.spawn(["sleep", "1000"])
        d.kill9()
        e = p.wait(30)
        assert e.lost and e.code is None and e.signal is None and e.status == 125
        assert "connection to umbrad was lost" in (e.reason or "")
        wait_for(lambda: any(k == "disconnected" for k, _ in events), 10, "a disconnected event")
        assert events[0][1]["will_reconnect"] is True
        assert not client.connected
        with pytest.raises(umbra.UnavailableError, match="reconnecting"):
            client.sessions.list()
        d.assert_no_helpers_within(5)

        d.launch()
        wait_for(lambda: any(k == "reconnected" for k, _ in events), 30, "a reconnected event")
        r = next(v for k, v in events if k == "reconnected")
        assert r["daemon"]["pid"] == d.pid != first_pid  # type: ignore[index]
        assert client.connected and client.daemon["pid"] == d.pid
        [listed] = client.sessions.list()
        assert listed.status == "stopped"
        s.resume()
        assert s.exec(["echo", "back"]).stdout == b"back\n"
        client.close()
    finally:
        d.stop()


def test_with_reconnect_off_the_client_stays_disconnected_and_says_so() -> None:
    d = Daemon("noreconnect")
    try:
        client = Umbra.connect(d.socket, reconnect=False)
        gone = threading.Event()
        client.on("disconnected", lambda e: gone.set() if e["will_reconnect"] is False else None)
        d.kill9()
        assert gone.wait(10)
        with pytest.raises(umbra.UnavailableError, match="reconnection is off"):
            client.call("daemon.info")
        client.close()
    finally:
        d.stop()


class Relay:
    """A socket in front of umbrad's: cutting its connections cuts the client's while umbrad
    runs on."""

    def __init__(self, target: str, path: str) -> None:
        self.target = target
        self.path = path
        self.live: list[socket.socket] = []
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        os.chmod(path, 0o600)
        self.server.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.server.accept()
            except OSError:
                return
            u = socket.socket(socket.AF_UNIX)
            u.connect(self.target)
            self.live += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        for s in self.live:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.live.clear()

    def close(self) -> None:
        self.cut()
        self.server.close()


def test_a_detached_process_outlives_a_lost_connection_and_stdin_is_not_repeated() -> None:
    d = Daemon("kept")
    relay = Relay(d.socket, os.path.join(d.dir, "run/umbra/relay.sock"))
    try:
        client = Umbra.connect(relay.path, backoff=(0.05, 0.2))
        s = client.sessions.start("k")
        script = "i=0; while [ $i -lt 200 ]; do echo n-$i; i=$((i+1)); sleep 0.02; done; exit 5"
        p = s.spawn(["sh", "-c", script], detach=True)
        cat = s.spawn(["sh", "-c", "cat > /tmp/in; wc -c < /tmp/in"], detach=True)
        got = p.stdout.read(5)
        reconnected = threading.Event()
        client.on("reconnected", lambda e: reconnected.set())
        failures: list[BaseException] = []

        def writer() -> None:
            try:
                for _ in range(50):
                    cat.stdin.write(b"x" * 20_000)
                    time.sleep(0.01)
                cat.stdin.close()
            except BaseException as e:  # reported below
                failures.append(e)
                try:
                    cat.stdin.close()  # so cat ends and the reads below do not wait forever
                except umbra.UmbraError:
                    pass

        # Writes go on while the connection is cut: those cut off are sent again after the
        # client attached again, and umbrad takes each byte once.
        w = threading.Thread(target=writer)
        w.start()
        time.sleep(0.15)
        relay.cut()
        assert reconnected.wait(30), "the client reconnected by itself"
        w.join(60)
        assert not w.is_alive(), "the writer finished"
        assert not failures, failures
        rest = p.stdout.read()
        expected = "".join(f"n-{i}\n" for i in range(200)).encode()
        assert got + rest == expected, "the stream went on where it was, nothing lost or repeated"
        assert p.missed == {"stdout": 0, "stderr": 0}
        assert p.wait(60).code == 5
        assert cat.stdout.read().strip() == b"1000000", "each stdin byte once"
        assert cat.wait(60).code == 0
        client.close()
    finally:
        relay.close()
        d.stop()
