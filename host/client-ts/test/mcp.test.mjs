// `vmctl mcp` against a real umbrad, driven by the official MCP SDKs as an agent's framework
// would: the TypeScript SDK (@modelcontextprotocol/sdk) here, the Python SDK (`mcp` from PyPI)
// through tests/mcp/python_client.py. Tools listed, a session started with an offered folder,
// a command run with its output streamed as progress, a file written and read, a shadow change
// applied with its reviewed change-set (and refused without one), a session's logs as a
// resource, and a command that needs approval put to the client (elicitation) or refused
// with a clear error when the client cannot be asked.

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import { after, before, test } from "node:test";

import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";

import { Umbra } from "../dist/index.js";
import { REPO, TestDaemon, cleanUpAfter } from "./daemon.mjs";

/** @type {TestDaemon} */
let daemon;
/** @type {Umbra} */
let umbra;
let work;

const vmctl = process.env.UMBRA_VMCTL_BIN || path.join(REPO, "target/debug/vmctl");

before(async () => {
  work = fs.mkdtempSync(path.join(os.tmpdir(), "umbra-mcp-work-"));
  fs.writeFileSync(path.join(work, "notes"), "host\n");
  // Its MCP endpoint too (streamable HTTP on a free loopback port), offering the same folder.
  daemon = await TestDaemon.start("mcp", {}, ["--mcp-listen", "127.0.0.1:0", "--mcp-folder", `${work}:work:shadow`]);
  umbra = await Umbra.connect({ socketPath: daemon.socket });
});

cleanUpAfter(() => ({ daemon, client: umbra }));
after(() => fs.rmSync(work, { recursive: true, force: true }));

/** An MCP client on a new `vmctl mcp` offering `work` as "work" (shadow); `elicit` answers approvals. */
async function connect(elicit) {
  const client = new Client({ name: "umbra-test", version: "1.0.0" }, { capabilities: elicit ? { elicitation: {} } : {} });
  if (elicit) client.setRequestHandler(ElicitRequestSchema, elicit);
  const transport = new StdioClientTransport({
    command: vmctl,
    args: ["mcp", "--folder", `${work}:work:shadow`],
    env: { ...process.env, UMBRA_SOCKET: daemon.socket },
    stderr: "inherit",
  });
  await client.connect(transport);
  return client;
}

const text = (result) => result.content.map((c) => c.text ?? "").join("");

test("the TypeScript SDK lists the tools and runs a session through them", async () => {
  const mcp = await connect();
  try {
    const tools = (await mcp.listTools()).tools.map((t) => t.name).sort();
    assert.deepEqual(tools, [
      "file_list", "file_read", "file_write", "port_expose", "run",
      "session_list", "session_start", "session_stop", "shadow_apply", "shadow_diff",
    ]);
    const start = (await mcp.listTools()).tools.find((t) => t.name === "session_start");
    assert.deepEqual(start.inputSchema.required, ["name"], "the schema comes from the server's own type");

    const unknown = await mcp.callTool({ name: "session_start", arguments: { name: "x", folders: ["home"] } });
    assert.equal(unknown.isError, true);
    assert.match(text(unknown), /no folder "home" was offered/);

    const started = await mcp.callTool({ name: "session_start", arguments: { name: "m", folders: ["work"] } });
    assert.notEqual(started.isError, true, text(started));
    assert.equal(started.structuredContent.status, "ready");

    const progress = [];
    const ran = await mcp.callTool(
      { name: "run", arguments: { session: "m", argv: ["sh", "-c", "echo out; echo err >&2; exit 3"] } },
      undefined,
      { onprogress: (p) => progress.push(p.message) },
    );
    assert.notEqual(ran.isError, true, text(ran));
    assert.equal(ran.structuredContent.exit_code, 3);
    assert.equal(ran.structuredContent.stdout, "out\n");
    assert.equal(ran.structuredContent.stderr, "err\n");
    assert.match(progress.join(""), /out\n/, "the output streamed as progress");

    const wrote = await mcp.callTool({ name: "file_write", arguments: { session: "m", path: "/root/f.txt", data: "hello mcp\n" } });
    assert.notEqual(wrote.isError, true, text(wrote));
    const read = await mcp.callTool({ name: "file_read", arguments: { session: "m", path: "/root/f.txt" } });
    assert.deepEqual([read.structuredContent.data, read.structuredContent.eof], ["hello mcp\n", true]);
    const listed = await mcp.callTool({ name: "file_list", arguments: { session: "m", path: "/root" } });
    assert.ok(listed.structuredContent.entries.some((e) => e.name === "f.txt"), text(listed));

    // A shadow change reaches the host only through its reviewed change-set.
    await mcp.callTool({ name: "run", arguments: { session: "m", argv: ["sh", "-c", "echo edited > /sessions/m/mnt/work/notes"] } });
    const diff = await mcp.callTool({ name: "shadow_diff", arguments: { session: "m", folder: "work" } });
    assert.equal(diff.structuredContent.changes.length, 1, text(diff));
    assert.equal(fs.readFileSync(path.join(work, "notes"), "utf8"), "host\n", "nothing applied yet");
    const without = await mcp.callTool({ name: "shadow_apply", arguments: { session: "m", folder: "work" } }).catch((e) => e);
    assert.ok(without instanceof Error || without.isError, "an apply without its change-set is refused");
    assert.equal(fs.readFileSync(path.join(work, "notes"), "utf8"), "host\n");
    const applied = await mcp.callTool({
      name: "shadow_apply",
      arguments: { session: "m", folder: "work", changeset: diff.structuredContent.changeset },
    });
    assert.notEqual(applied.isError, true, text(applied));
    assert.equal(fs.readFileSync(path.join(work, "notes"), "utf8"), "edited\n");

    // A call the client cancels takes its command with it.
    const sleeping = async () => {
      const script = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | grep -c '^sleep 600' || true";
      const ps = await mcp.callTool({ name: "run", arguments: { session: "m", argv: ["sh", "-c", script] } });
      return Number(ps.structuredContent.stdout.trim());
    };
    const abort = new AbortController();
    let begun;
    const running = new Promise((resolve) => (begun = resolve));
    const long = mcp.callTool(
      { name: "run", arguments: { session: "m", argv: ["sh", "-c", "echo started; exec sleep 600"] } },
      undefined,
      { signal: abort.signal, onprogress: () => begun() },
    );
    await running;
    assert.equal(await sleeping(), 1, "the command runs");
    abort.abort();
    await assert.rejects(long, /abort/i);
    let left = 1;
    for (let i = 0; i < 50 && left > 0; i++) {
      left = await sleeping();
      if (left > 0) await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(left, 0, "the cancelled command was killed");

    // The session's logs, as a resource.
    const resources = (await mcp.listResources()).resources.map((r) => r.uri);
    assert.ok(resources.includes("umbra://sessions/m/logs"), JSON.stringify(resources));
    const logs = await mcp.readResource({ uri: "umbra://sessions/m/logs" });
    assert.match(logs.contents[0].text, /--- console/);
    const listed2 = await mcp.callTool({ name: "session_list", arguments: {} });
    assert.ok(listed2.structuredContent.sessions.some((s) => s.name === "m"));
  } finally {
    await mcp.close();
  }
});

test("a command that needs approval is put to the client, or refused with why; only its own sessions", async () => {
  const approval = { approval: { mode: "allowlist", allow: ["sh -c"], timeout_secs: 30 } };
  const asked = [];
  const mcp = await connect(async (request) => {
    asked.push(request.params.message);
    return { action: "accept", content: { allow: true } };
  });
  try {
    const started = await mcp.callTool({ name: "session_start", arguments: { name: "ap" } });
    assert.notEqual(started.isError, true, text(started));
    await (await umbra.sessions.get("ap")).update(approval);
    const ran = await mcp.callTool({
      name: "run",
      arguments: { session: "ap", argv: ["uname", "-s"], env: { BASH_ENV: "/tmp/x" } },
    });
    assert.notEqual(ran.isError, true, text(ran));
    assert.equal(ran.structuredContent.stdout, "Linux\n");
    assert.equal(asked.length, 1);
    assert.match(asked[0], /uname -s/);
    assert.match(asked[0], /BASH_ENV/, "the question names what changes what runs");
  } finally {
    await mcp.close();
  }
  const blind = await connect();
  try {
    // Another server's session (and the operator's) is out of reach, by any tool.
    const foreign = await blind.callTool({ name: "run", arguments: { session: "ap", argv: ["true"] } });
    assert.equal(foreign.isError, true);
    assert.match(text(foreign), /not_found: no session "ap" was started through this MCP server/);
    const taken = await blind.callTool({ name: "session_start", arguments: { name: "ap" } });
    assert.match(text(taken), /session_exists/);
    const mine = (await blind.callTool({ name: "session_list", arguments: {} })).structuredContent.sessions;
    assert.deepEqual(mine, [], "it lists none of the others'");

    await blind.callTool({ name: "session_start", arguments: { name: "ap2" } });
    await (await umbra.sessions.get("ap2")).update(approval);
    const refused = await blind.callTool({ name: "run", arguments: { session: "ap2", argv: ["uname", "-s"] } });
    assert.equal(refused.isError, true);
    assert.match(text(refused), /permission_denied.*could not be asked/s);
  } finally {
    await blind.close();
  }
});

test("the Python SDK runs a session through the same tools", async () => {
  const python = process.env.UMBRA_MCP_PYTHON;
  assert.ok(python, "UMBRA_MCP_PYTHON names a Python with the `mcp` SDK (scripts/mcp-python makes one)");
  const run = spawnSync(python, [path.join(REPO, "tests/mcp/python_client.py")], {
    env: { ...process.env, UMBRA_SOCKET: daemon.socket, UMBRA_VMCTL_BIN: vmctl, UMBRA_MCP_WORK: work },
    encoding: "utf8",
    timeout: 240_000,
  });
  assert.equal(run.status, 0, `python_client.py: ${run.stderr}\n${run.stdout}`);
  const seen = JSON.parse(run.stdout.trim().split("\n").pop());
  assert.ok(seen.tools.includes("run") && seen.tools.includes("shadow_apply"), JSON.stringify(seen));
  assert.equal(seen.status, "ready");
  assert.deepEqual([seen.exit_code, seen.stdout], [0, "from python\n"]);
  assert.ok(seen.progress.includes("from python"), JSON.stringify(seen));
  assert.equal(seen.read, "written by python\n");
  assert.equal(seen.changes, 1);
  assert.equal(fs.readFileSync(path.join(work, "py.txt"), "utf8"), "py-edited\n");
});

test("umbrad's MCP endpoint serves the same tools on HTTP, to the bearer of its token only", async () => {
  const { url, token } = JSON.parse(fs.readFileSync(path.join(path.dirname(daemon.socket), "mcp.json"), "utf8"));
  assert.match(url, /^http:\/\/127\.0\.0\.1:\d+\/mcp$/);
  const stat = fs.statSync(path.join(path.dirname(daemon.socket), "mcp.json"));
  assert.equal(stat.mode & 0o777, 0o600, "the token is the user's alone");

  const bare = await fetch(url, { method: "POST", headers: { "content-type": "application/json" }, body: "{}" });
  assert.equal(bare.status, 401);
  const wrong = new Client({ name: "umbra-test", version: "1.0.0" });
  await assert.rejects(
    wrong.connect(new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers: { Authorization: "Bearer nope-nope-nope-nope" } } })),
  );

  const mcp = new Client({ name: "umbra-test", version: "1.0.0" });
  await mcp.connect(new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers: { Authorization: `Bearer ${token}` } } }));
  try {
    assert.ok((await mcp.listTools()).tools.some((t) => t.name === "run"));
    const started = await mcp.callTool({ name: "session_start", arguments: { name: "h", folders: ["work"] } });
    assert.notEqual(started.isError, true, text(started));
    const progress = [];
    const ran = await mcp.callTool(
      { name: "run", arguments: { session: "h", argv: ["sh", "-c", "ls /sessions/h/mnt/work; echo over-http"] } },
      undefined,
      { onprogress: (p) => progress.push(p.message) },
    );
    assert.equal(ran.structuredContent.exit_code, 0, text(ran));
    assert.match(ran.structuredContent.stdout, /notes\n(py\.txt\n)?over-http\n/);
    assert.match(progress.join(""), /over-http/);
    const stopped = await mcp.callTool({ name: "session_stop", arguments: { name: "h" } });
    assert.equal(stopped.structuredContent.status, "stopped");
  } finally {
    await mcp.close();
  }
});
