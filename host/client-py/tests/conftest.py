"""A real umbrad for the tests: started from target/debug (or $UMBRA_UMBRAD_BIN) with its own
XDG directories under a temporary one, booting the minimal bundle, stopped after its tests
with every VM helper gone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
HELPERS = ("qemu-system", "vhost-device-vsock", "virtiofsd", "umbra-fsd", "umbra-vmm")


def built_bundle(flavor: str) -> str:
    """A bundle `vmctl bundle build --flavor FLAVOR` made (or $UMBRA_TEST_BUNDLE_<FLAVOR>)."""
    cache = os.environ.get("UMBRA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "umbra"
    )
    d = os.environ.get(f"UMBRA_TEST_BUNDLE_{flavor.upper()}") or os.path.join(cache, f"bundles/{flavor}")
    if not os.path.exists(os.path.join(d, "manifest.json")):
        raise RuntimeError(f"no {flavor} bundle at {d} (run: target/debug/vmctl bundle build --flavor {flavor})")
    return d


def minimal_bundle() -> str:
    return built_bundle("minimal")


def helpers_mentioning(marker: str) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(h in cmd for h in HELPERS) and marker in cmd:
            found.append((int(entry), cmd))
    return found


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


class Daemon:
    """One umbrad process (it can be killed and launched again over the same state)."""

    def __init__(self, tag: str, **config: object) -> None:
        self.dir = tempfile.mkdtemp(prefix=f"umbra-py-{tag}-")
        self.socket = os.path.join(self.dir, "run/umbra/umbrad.sock")
        self.log_path = os.path.join(self.dir, "umbrad.log")
        self.proc: subprocess.Popen[bytes] | None = None
        RUNNING.append(self)
        config = {
            "bundle": minimal_bundle(),
            "memory_mib": 256,
            "idle_timeout_secs": 0,
            "disk_size_mib": 256,
            "boot_timeout_secs": int(os.environ.get("UMBRA_BOOT_TIMEOUT_SECS", "120")),
            **config,
        }
        os.makedirs(os.path.join(self.dir, "config/umbra"))
        Path(self.dir, "config/umbra/umbrad.json").write_text(json.dumps(config))
        self.launch()

    def launch(self) -> None:
        env = {
            **os.environ,
            "XDG_RUNTIME_DIR": os.path.join(self.dir, "run"),
            "XDG_STATE_HOME": os.path.join(self.dir, "state"),
            "XDG_DATA_HOME": os.path.join(self.dir, "data"),
            "XDG_CONFIG_HOME": os.path.join(self.dir, "config"),
            "RUST_LOG": "info,umbrad=debug",
        }
        env.pop("UMBRA_DATA_DIR", None)
        env.pop("UMBRA_SOCKET", None)
        binary = os.environ.get("UMBRA_UMBRAD_BIN") or str(REPO / "target/debug/umbrad")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([binary], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"umbrad exited ({self.proc.returncode}) before serving:\n{self.log_tail()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.socket)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"umbrad did not serve {self.socket} within 20 s") from None
                time.sleep(0.02)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def terminate(self, grace: float = 40) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def assert_no_helpers_within(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while left := helpers_mentioning(self.dir):
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {seconds} s: {left}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.terminate()
        try:
            self.assert_no_helpers_within(10)
        finally:
            for pid, _ in helpers_mentioning(self.dir):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if self in RUNNING:
                RUNNING.remove(self)
            shutil.rmtree(self.dir, ignore_errors=True)


#: The daemons of the tests running now, whose logs a failure report shows.
RUNNING: list[Daemon] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for d in RUNNING:
            report.sections.append((f"umbrad log ({d.dir})", d.log_tail(120)))
    return report


@pytest.fixture(scope="module")
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    d = Daemon(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))
    try:
        yield d
    finally:
        d.stop()
