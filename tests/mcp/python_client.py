"""The official MCP Python SDK (`mcp` from PyPI) as an agent framework's client of `vmctl mcp`.

Run by host/client-ts/test/mcp.test.mjs against its real umbrad: `UMBRA_SOCKET` names the
daemon, `UMBRA_VMCTL_BIN` the vmctl binary, `UMBRA_MCP_WORK` the host folder offered as "work"
(shadow). Lists the tools, starts session "py" with the folder, runs a command (its output
streamed as progress), writes and reads a file, changes the shadow folder and applies the
change-set it reviewed, stops the session; prints what it saw as one JSON line for the test to
check. Any failure raises (a non-zero exit).
"""

import asyncio
import json
import os

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


def check(result):
    """A tool's structured result; a tool error raises with its text."""
    if result.is_error:
        raise RuntimeError(" ".join(getattr(c, "text", "") for c in result.content))
    return result.structured_content


async def main():
    work = os.environ["UMBRA_MCP_WORK"]
    server = StdioServerParameters(
        command=os.environ["UMBRA_VMCTL_BIN"],
        args=["mcp", "--folder", f"{work}:work:shadow"],
        env=dict(os.environ),
    )
    seen = {}
    async with stdio_client(server) as (read, write):
        async with ClientSession(read, write) as mcp:
            await mcp.initialize()
            seen["tools"] = sorted(t.name for t in (await mcp.list_tools()).tools)
            started = check(await mcp.call_tool("session_start", {"name": "py", "folders": ["work"]}))
            seen["status"] = started["status"]

            progress = []

            async def on_progress(done, total, message):
                progress.append(message or "")

            ran = check(
                await mcp.call_tool(
                    "run",
                    {"session": "py", "argv": ["sh", "-c", "echo from python"]},
                    progress_callback=on_progress,
                )
            )
            seen["exit_code"], seen["stdout"] = ran["exit_code"], ran["stdout"]
            seen["progress"] = "".join(progress)

            check(await mcp.call_tool("file_write", {"session": "py", "path": "/tmp/p.txt", "data": "written by python\n"}))
            seen["read"] = check(await mcp.call_tool("file_read", {"session": "py", "path": "/tmp/p.txt"}))["data"]

            check(await mcp.call_tool("run", {"session": "py", "argv": ["sh", "-c", "echo py-edited > /sessions/py/mnt/work/py.txt"]}))
            diff = check(await mcp.call_tool("shadow_diff", {"session": "py", "folder": "work"}))
            seen["changes"] = len(diff["changes"])
            check(await mcp.call_tool("shadow_apply", {"session": "py", "folder": "work", "changeset": diff["changeset"]}))
            check(await mcp.call_tool("session_stop", {"name": "py"}))
    print(json.dumps(seen))


asyncio.run(main())
