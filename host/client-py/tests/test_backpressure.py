"""Output read slowly keeps memory bounded, here and in umbrad: the stream stops acknowledging,
umbrad stops sending, the process pauses in the guest."""

from __future__ import annotations

import threading
import time

import umbra
from umbra import Umbra
from umbra.process import HIGH_WATER

from .conftest import Daemon, status_kib

MIB = 1 << 20
TOTAL = 48 * MIB
RATE = 8 * MIB  # bytes per second this consumer takes
BOUND = 64 * MIB


def rss(pid: str | int = "self") -> int:
    return status_kib(pid if isinstance(pid, int) else __import__("os").getpid(), "VmRSS") * 1024


def test_output_read_slowly_keeps_this_process_and_umbrad_bounded(daemon: Daemon) -> None:
    with Umbra.connect(daemon.socket) as client:
        s = client.sessions.start("big")
        rss_before = rss()
        hwm_before = status_kib(daemon.pid, "VmHWM") * 1024
        p = s.spawn(["head", "-c", str(TOTAL), "/dev/zero"])
        held_peak = 0
        rss_peak = rss_before
        stop = threading.Event()

        def sample() -> None:
            nonlocal held_peak, rss_peak
            while not stop.is_set():
                held_peak = max(held_peak, p.stdout.buffered)
                rss_peak = max(rss_peak, rss())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        received = 0
        all_zero = True
        started = time.monotonic()
        try:
            while chunk := p.stdout.read(256 << 10):
                received += len(chunk)
                all_zero = all_zero and not chunk.strip(b"\0")
                # Keep to RATE: sleep off whatever this read got ahead.
                ahead = received / RATE - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        finally:
            stop.set()
            sampler.join()
        exit_info = p.wait(60)
        hwm_after = status_kib(daemon.pid, "VmHWM") * 1024
        print(
            f"{received} bytes in {time.monotonic() - started:.1f} s; held at most {held_peak} bytes; "
            f"RSS +{(rss_peak - rss_before) >> 20} MiB here, umbrad's peak +{(hwm_after - hwm_before) >> 20} MiB"
        )
        assert (received, all_zero, exit_info.code) == (TOTAL, True, 0)
        assert held_peak <= HIGH_WATER + umbra.OUTPUT_WINDOW, held_peak
        assert rss_peak - rss_before < BOUND, rss_peak - rss_before
        assert hwm_after - hwm_before < BOUND, hwm_after - hwm_before
        s.delete()
