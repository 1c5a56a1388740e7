// umbrad's E2B endpoint (`--e2b-listen`) driven by the official, unmodified E2B SDKs through
// their documented settings (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY): the JavaScript SDK
// (`e2b` from npm) here, the Python SDK (`e2b` from PyPI) through tests/e2b/python_sdk.py.
// Sandboxes are sessions of the standard image (the SDKs run commands with /bin/bash).

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import * as fs from "node:fs";
import * as http from "node:http";
import * as path from "node:path";
import { before, test } from "node:test";

import { Umbra } from "../dist/index.js";
import { REPO, TestDaemon, cleanUpAfter, helpersMentioning, standardBundle } from "./daemon.mjs";

/** @type {TestDaemon} */
let daemon;
/** @type {{ url: string, api_key: string }} */
let endpoint;
/** @type {typeof import("e2b")} */
let e2b;

before(async () => {
  // A network policy other than the default `none`, so what allow_internet_access changes shows.
  const network = { mode: "allowlist", allow_domains: ["allowed.test"] };
  daemon = await TestDaemon.start("e2b", { bundle: standardBundle(), memory_mib: 512, network }, [
    "--e2b-listen",
    "127.0.0.1:0",
  ]);
  const info = path.join(path.dirname(daemon.socket), "e2b.json");
  assert.equal(fs.statSync(info).mode & 0o777, 0o600, "e2b.json holds the key: this user's only");
  endpoint = JSON.parse(fs.readFileSync(info, "utf8"));
  // The SDKs read these when each call is made: set before the first one.
  process.env.E2B_API_URL = endpoint.url;
  process.env.E2B_SANDBOX_URL = endpoint.url;
  process.env.E2B_API_KEY = endpoint.api_key;
  delete process.env.E2B_DEBUG;
  e2b = await import("e2b");
});

cleanUpAfter(() => ({ daemon }));

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

test("the JavaScript SDK runs commands, files and watches in a sandbox, and kills it", async () => {
  const { Sandbox, CommandExitError, FilesystemEventType } = e2b;
  const sbx = await Sandbox.create({ timeoutMs: 300_000, metadata: { from: "js" } });
  try {
    // Streamed output, and the exit code as CommandExitError.
    const out = [];
    const err = [];
    await assert.rejects(
      sbx.commands.run("echo hi; echo err >&2; exit 3", { onStdout: (d) => out.push(d), onStderr: (d) => err.push(d) }),
      (e) => e instanceof CommandExitError && e.exitCode === 3 && e.stdout === "hi\n" && e.stderr === "err\n",
    );
    assert.deepEqual([out.join(""), err.join("")], ["hi\n", "err\n"]);
    const ok = await sbx.commands.run("uname -s; pwd", { envs: { A: "1" } });
    assert.deepEqual([ok.exitCode, ok.stdout], [0, "Linux\n/home/user\n"]);

    // A background command: listed, connected to by pid, given stdin, killed.
    const bg = await sbx.commands.run("cat; echo never", { background: true, stdin: true });
    assert.ok(bg.pid > 0);
    assert.ok((await sbx.commands.list()).some((p) => p.pid === bg.pid && p.cmd === "/bin/bash"));
    const lines = [];
    const attached = await sbx.commands.connect(bg.pid, { onStdout: (d) => lines.push(d) });
    await sbx.commands.sendStdin(bg.pid, "echoed back\n");
    for (let i = 0; i < 100 && !lines.join("").includes("echoed back"); i++) await sleep(100);
    assert.equal(lines.join(""), "echoed back\n", "stdin reached the process; its output reached the new view");
    assert.equal(await sbx.commands.kill(bg.pid), true);
    await assert.rejects(attached.wait(), (e) => e instanceof CommandExitError && e.exitCode === -1 && /killed/.test(e.error));
    await bg.disconnect();
    assert.equal(await sbx.commands.kill(bg.pid), false, "gone: nothing to kill");

    // Files: written, read (text and bytes), listed, and the directory watched.
    const d = "/home/user/js";
    assert.equal(await sbx.files.makeDir(d), true);
    const info = await sbx.files.write(`${d}/a.txt`, "hello js");
    assert.equal(info.path, `${d}/a.txt`);
    assert.equal(await sbx.files.read(`${d}/a.txt`), "hello js");
    const blob = new Uint8Array(3 * 1024 * 1024 + 7).map((_, i) => (i * 7) & 0xff);
    await sbx.files.write(`${d}/blob.bin`, blob.buffer);
    assert.deepEqual(await sbx.files.read(`${d}/blob.bin`, { format: "bytes" }), blob);
    assert.deepEqual((await sbx.files.list(d)).map((e) => [e.name, e.type]).sort(), [["a.txt", "file"], ["blob.bin", "file"]]);
    const seen = [];
    const handle = await sbx.files.watchDir(d, (ev) => seen.push(ev));
    await sbx.files.write(`${d}/w.txt`, "x");
    for (let i = 0; i < 150 && !seen.some((e) => e.name === "w.txt"); i++) await sleep(100);
    await handle.stop();
    assert.ok(seen.some((e) => e.name === "w.txt" && e.type === FilesystemEventType.CREATE), JSON.stringify(seen));

    // The sandbox's files are the guest's: a path on the host is a path in the guest.
    const hostFile = path.join(daemon.dir, "host-secret");
    fs.writeFileSync(hostFile, "the host's\n");
    await assert.rejects(sbx.files.read(hostFile), (e) => e.name === "FileNotFoundError", "not the host's file");

    const listed = await Sandbox.list().nextItems();
    assert.ok(listed.some((s) => s.sandboxId === sbx.sandboxId && s.metadata.from === "js"));
  } finally {
    assert.equal(await sbx.kill(), true);
  }
  assert.equal(await Sandbox.kill(sbx.sandboxId), false, "killed already");
  for (let i = 0; i < 100 && helpersMentioning(sbx.sandboxId).length; i++) await sleep(100);
  assert.deepEqual(helpersMentioning(sbx.sandboxId), [], "no VM or helper left behind");
});

test("the Python SDK does the same, with its polling and streaming watches", async () => {
  const python = process.env.UMBRA_E2B_PYTHON;
  assert.ok(python, "UMBRA_E2B_PYTHON names a Python with the `e2b` SDK (scripts/e2b-python makes one)");
  const run = spawnSync(python, [path.join(REPO, "tests/e2b/python_sdk.py")], {
    env: { ...process.env },
    encoding: "utf8",
    timeout: 280_000,
  });
  assert.equal(run.status, 0, `python_sdk.py: ${run.stderr}\n${run.stdout}`);
  const summary = JSON.parse(run.stdout.trim().split("\n").pop());
  assert.deepEqual(summary.failures, []);
  assert.equal(summary.stdout, "hello from /home/user\n");
  assert.deepEqual(summary.listed, ["a.txt", "blob.bin"]);
});

test("allow_internet_access: false takes the network away; the default keeps umbrad's policy", async () => {
  const { Sandbox } = e2b;
  const client = await Umbra.connect({ socketPath: daemon.socket });
  try {
    const closed = await Sandbox.create({ timeoutMs: 60_000, allowInternetAccess: false });
    const open = await Sandbox.create({ timeoutMs: 60_000 });
    const mode = async (sbx) => (await client.sessions.get(sbx.sandboxId)).info.settings.network;
    assert.deepEqual(await mode(closed), { mode: "none" });
    assert.deepEqual(await mode(open), { mode: "allowlist", allow_domains: ["allowed.test"] });
    await Promise.all([closed.kill(), open.kill()]);
  } finally {
    await client.close();
  }
});

test("keys, tokens and hosts are checked; what is not supported says so in E2B's shapes", async () => {
  const { Sandbox, AuthenticationError } = e2b;
  await assert.rejects(Sandbox.create({ apiKey: "not-the-key" }), (e) => e instanceof AuthenticationError);
  const sbx = await Sandbox.create({ timeoutMs: 4_000 });
  const rest = (method, p, headers = {}) =>
    fetch(`${endpoint.url}${p}`, { method, headers: { "x-api-key": endpoint.api_key, ...headers } });
  // envd calls need the sandbox's own access token.
  const envd = await fetch(`${endpoint.url}/process.Process/List`, {
    method: "POST",
    headers: { "content-type": "application/json", "e2b-sandbox-id": sbx.sandboxId, "x-access-token": "wrong" },
    body: "{}",
  });
  assert.equal(envd.status, 401);
  assert.equal((await envd.json()).code, "unauthenticated");
  // A page elsewhere cannot reach the endpoint through a name it rebinds to 127.0.0.1.
  // (fetch will not send another Host: node:http does.)
  const rebound = await new Promise((resolve, reject) => {
    const req = http.request(`${endpoint.url}/v2/sandboxes`, { headers: { host: "evil.example", "x-api-key": endpoint.api_key } });
    req.on("response", (res) => {
      res.resume();
      resolve(res.statusCode);
    });
    req.on("error", reject);
    req.end();
  });
  assert.equal(rebound, 403);
  // Pause is a snapshot: on a backend that cannot take one, a clear 501 in E2B's shape.
  const paused = await rest("POST", `/sandboxes/${sbx.sandboxId}/pause`);
  if (paused.status === 204) {
    await Sandbox.connect(sbx.sandboxId, { timeoutMs: 4_000 }); // resumed: its timeout runs again
  } else {
    const body = await paused.json();
    assert.deepEqual([paused.status, body.code], [501, 501]);
    assert.match(body.message, /snapshot/);
  }
  const templates = await rest("GET", "/templates");
  assert.deepEqual([templates.status, (await templates.json()).code], [501, 501]);
  await assert.rejects(Sandbox.create({ template: "no-such-template" }), /not known here/);
  // Its timeout (4 s) passes: the sandbox is killed.
  for (let i = 0; i < 100 && (await rest("GET", `/sandboxes/${sbx.sandboxId}`)).status !== 404; i++) await sleep(200);
  assert.equal((await rest("GET", `/sandboxes/${sbx.sandboxId}`)).status, 404);
  assert.equal(await Sandbox.kill(sbx.sandboxId), false);
});

test("sandboxes outlive an umbrad restart: listed paused, resumed by connect with their files", async () => {
  const { Sandbox } = e2b;
  const rest = (method, p) => fetch(`${endpoint.url}${p}`, { method, headers: { "x-api-key": endpoint.api_key } });
  const sbx = await Sandbox.create({ timeoutMs: 120_000, metadata: { kept: "yes" } });
  await sbx.files.write("kept.txt", "still here\n");
  const id = sbx.sandboxId;

  await daemon.terminate();
  await daemon.launch();
  // A new port (127.0.0.1:0), the same key: it was kept.
  const info = JSON.parse(fs.readFileSync(path.join(path.dirname(daemon.socket), "e2b.json"), "utf8"));
  assert.equal(info.api_key, endpoint.api_key, "the key is kept across the restart");
  endpoint = info;
  process.env.E2B_API_URL = endpoint.url;
  process.env.E2B_SANDBOX_URL = endpoint.url;

  const kept = await rest("GET", `/sandboxes/${id}`);
  assert.equal(kept.status, 200);
  const detail = await kept.json();
  assert.deepEqual([detail.state, detail.metadata], ["paused", { kept: "yes" }]);
  const again = await Sandbox.connect(id, { timeoutMs: 60_000 });
  assert.equal(await again.files.read("kept.txt"), "still here\n", "its disk came back");
  assert.equal((await again.commands.run("pwd")).stdout, "/home/user\n");
  assert.equal(await Sandbox.kill(id), true);
  assert.equal((await rest("GET", `/sandboxes/${id}`)).status, 404);
});
