"""The asyncio client against a real umbrad: streams, concurrent processes, the events
iterator, and exec."""

from __future__ import annotations

import asyncio

import umbra
from umbra.aio import Umbra

from .conftest import Daemon


def test_the_asyncio_client_streams_runs_concurrently_and_iterates_events(daemon: Daemon) -> None:
    async def run() -> None:
        async with await Umbra.connect(daemon.socket) as client:
            events = client.events(kinds=["status"])
            s = await client.sessions.start("aio")
            statuses = []
            async for e in events:
                if e.get("session") == "aio":
                    statuses.append(e["status"])
                    if e["status"] == "ready":
                        break
            assert statuses[0] == "starting" and statuses[-1] == "ready", statuses
            await events.aclose()

            # Several processes at once, each with its own stream.
            procs = [await s.spawn(["sh", "-c", f"for i in $(seq 1 200); do echo {n}-$i; done"]) for n in range(4)]
            outs = await asyncio.gather(*(p.stdout.read() for p in procs))
            for n, out in enumerate(outs):
                assert out.decode().split() == [f"{n}-{i}" for i in range(1, 201)]
            assert [(await p.wait()).code for p in procs] == [0, 0, 0, 0]

            chunks = []
            p = await s.spawn(["sh", "-c", "echo a; sleep 0.2; echo b"])
            async for chunk in p.stdout:
                chunks.append(chunk)
            assert b"".join(chunks) == b"a\nb\n"

            r = await s.exec(["sh", "-c", "read x; echo got-$x; exit 7"], input="it\n")
            assert (r.stdout, r.exit.code) == (b"got-it\n", 7)
            try:
                await client.sessions.get("absent")
            except umbra.SessionNotFoundError as e:
                assert e.code == "session_not_found"
            else:
                raise AssertionError("no such session")
            await s.delete()

    asyncio.run(run())
