"""The official E2B Python SDK (`e2b` from PyPI, unmodified) against umbrad's E2B endpoint.

Run by host/client-ts/test/e2b.test.mjs with the SDK's documented settings in the environment:
E2B_API_URL and E2B_SANDBOX_URL (umbrad --e2b-listen) and E2B_API_KEY (from e2b.json). Each
check that fails is printed; the last line is a JSON summary; the exit status is 1 on any
failure.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from e2b import AsyncSandbox, CommandExitException, FilesystemEventType, Sandbox

failures: list[str] = []
summary: dict[str, object] = {}


def check(name: str, ok: bool, detail: object = "") -> None:
    if not ok:
        failures.append(f"{name}: {detail}")
        print(f"FAIL {name}: {detail}", file=sys.stderr)


sbx = Sandbox.create(timeout=300, metadata={"from": "python"}, envs={"GREETING": "hello"})
summary["sandbox"] = sbx.sandbox_id
try:
    # A foreground command: output streamed to the callbacks, its exit code raised.
    out: list[str] = []
    err: list[str] = []
    try:
        sbx.commands.run("echo hi; echo err >&2; exit 3", on_stdout=out.append, on_stderr=err.append)
        check("exit 3 raises", False, "no CommandExitException")
    except CommandExitException as e:
        check("exit code", e.exit_code == 3, e.exit_code)
        check("stdout", e.stdout == "hi\n", repr(e.stdout))
        check("stderr", e.stderr == "err\n", repr(e.stderr))
    check("streamed stdout", "".join(out) == "hi\n", out)
    check("streamed stderr", "".join(err) == "err\n", err)
    r = sbx.commands.run("echo $GREETING from $(pwd)", envs={"EXTRA": "1"})
    check("env and cwd", r.exit_code == 0 and r.stdout == "hello from /home/user\n", repr(r))
    summary["stdout"] = r.stdout

    # Output that comes over time reaches the callback before the command ends.
    seen_at: list[float] = []
    started = time.monotonic()
    sbx.commands.run("echo one; sleep 2; echo two", on_stdout=lambda _: seen_at.append(time.monotonic() - started))
    check("streamed as it comes", len(seen_at) == 2 and seen_at[1] - seen_at[0] > 1.0, seen_at)

    # A background command, found by its pid, connected to, fed stdin, and killed.
    bg = sbx.commands.run("cat", background=True, stdin=True)
    check("background pid", bg.pid > 0, bg.pid)
    check("listed", bg.pid in [p.pid for p in sbx.commands.list()], "pid not in commands.list()")
    sbx.commands.send_stdin(bg.pid, "typed\n")
    attached = sbx.commands.connect(bg.pid)
    check("connect", attached.pid == bg.pid, attached.pid)
    check("kill", sbx.commands.kill(bg.pid) is True, "kill returned False")
    try:
        attached.wait()
        check("killed", False, "a killed process ended well")
    except CommandExitException as e:
        check("killed", e.exit_code == -1 and "killed" in (e.error or ""), (e.exit_code, e.error))
    check("kill unknown pid", sbx.commands.kill(999999) is False, "True")

    # Files.
    d = "/home/user/py"
    check("make_dir", sbx.files.make_dir(d) is True, "False")
    check("make_dir again", sbx.files.make_dir(d) is False, "True")
    info = sbx.files.write(f"{d}/a.txt", "hello file")
    check("write", info.path == f"{d}/a.txt", info)
    check("read", sbx.files.read(f"{d}/a.txt") == "hello file", "content differs")
    blob = bytes(range(256)) * 8192  # 2 MiB, every byte value: three requests each way
    sbx.files.write(f"{d}/blob.bin", blob)
    check("binary round trip", bytes(sbx.files.read(f"{d}/blob.bin", format="bytes")) == blob, "bytes differ")
    names = sorted(e.name for e in sbx.files.list(d))
    check("list", names == ["a.txt", "blob.bin"], names)
    summary["listed"] = names
    check("exists", sbx.files.exists(f"{d}/a.txt") and not sbx.files.exists(f"{d}/nope"), "exists wrong")
    check("get_info", sbx.files.get_info(f"{d}/a.txt").size == 10, sbx.files.get_info(f"{d}/a.txt"))
    moved = sbx.files.rename(f"{d}/a.txt", f"{d}/b.txt")
    check("rename", moved.path == f"{d}/b.txt" and not sbx.files.exists(f"{d}/a.txt"), moved)
    sbx.files.remove(f"{d}/b.txt")
    check("remove", not sbx.files.exists(f"{d}/b.txt"), "still there")

    # watch_dir: the blocking SDK polls (CreateWatcher, GetWatcherEvents) ...
    w = sbx.files.watch_dir(d)
    sbx.files.write(f"{d}/w1.txt", "x")
    events = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not any(e.name == "w1.txt" for e in events):
        events += w.get_new_events()
        time.sleep(0.2)
    w.stop()
    check("watch_dir (polled)", any(e.name == "w1.txt" and e.type == FilesystemEventType.CREATE for e in events), events)

    # ... and the asyncio SDK streams (WatchDir), after connecting to the sandbox by id.
    async def watch_async() -> list[object]:
        asbx = await AsyncSandbox.connect(sbx.sandbox_id)
        got = asyncio.Event()
        seen: list[object] = []

        def on_event(ev: object) -> None:
            seen.append(ev)
            if getattr(ev, "name", "") == "w2.txt":
                got.set()

        handle = await asbx.files.watch_dir(d, on_event=on_event)
        await asbx.files.write(f"{d}/w2.txt", "y")
        try:
            await asyncio.wait_for(got.wait(), 15)
        finally:
            await handle.stop()
        return seen

    seen = asyncio.run(watch_async())
    check("watch_dir (streamed)", any(getattr(e, "name", "") == "w2.txt" for e in seen), seen)
    summary["watched"] = True

    listed = [s.sandbox_id for s in Sandbox.list(query=None).next_items()]
    check("Sandbox.list", sbx.sandbox_id in listed, listed)
    check("get_info", sbx.get_info().metadata.get("from") == "python", sbx.get_info())
finally:
    check("kill", sbx.kill() is True, "False")
    check("kill again", Sandbox.kill(sbx.sandbox_id) is False, "True")

summary["failures"] = failures
print(json.dumps(summary))
sys.exit(1 if failures else 0)
