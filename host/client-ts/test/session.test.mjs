// The client against a real umbrad booting real VMs: one daemon, one main session, every part of
// the API on it. Tests in this file run in order and share the session.

import assert from "node:assert/strict";
import * as crypto from "node:crypto";
import { randomBytes } from "node:crypto";
import * as fs from "node:fs";
import * as net from "node:net";
import * as path from "node:path";
import { Readable } from "node:stream";
import { pipeline } from "node:stream/promises";
import { before, test } from "node:test";

import {
  AbortError,
  ERROR_CODES,
  InvalidParamsError,
  MethodNotFoundError,
  NotFoundError,
  SessionNotFoundError,
  Umbra,
  UmbraError,
  UnavailableError,
  UnsupportedError,
} from "../dist/index.js";
import { TestDaemon, buildSigningKey, collect, minimalBundle, nextEvent, cleanUpAfter } from "./daemon.mjs";

/** @type {TestDaemon} */
let daemon;
/** @type {Umbra} */
let client;
/** @type {import("../dist/index.js").Session} */
let session;
let work;
/** Every daemon event this client received, in order. */
const events = [];

before(async () => {
  daemon = await TestDaemon.start("session");
  work = path.join(daemon.dir, "work");
  fs.mkdirSync(work);
  fs.writeFileSync(path.join(work, "hello.txt"), "hello from the host\n");
  client = await Umbra.connect({ socketPath: daemon.socket });
  client.on("event", (e) => events.push(e));
});

cleanUpAfter(() => ({ daemon, client }));

test("connect checks the daemon's API version and reports it", () => {
  assert.equal(client.daemon.api_version.split(".")[0], "1");
  assert.equal(client.daemon.pid, daemon.pid);
  assert.equal(client.daemon.socket, daemon.socket);
  assert.equal(client.connected, true);
});

test("start -> spawn -> stream -> exit code", async () => {
  const statuses = [];
  client.on("session-status", (e) => e.session === "main" && statuses.push(e.status));
  const ready = nextEvent(client, "ready", (e) => e.session === "main");
  const mounted = nextEvent(client, "folder-mounted", (e) => e.session === "main" && e.name === "work");
  session = await client.sessions.start({
    name: "main",
    folders: [{ path: work, mode: "rw" }],
    memoryMiB: 256,
    idleTimeoutSecs: 0,
  });
  assert.equal(session.name, "main");
  assert.equal(session.status, "ready");
  assert.equal(session.info.settings.memory_mib, 256);
  assert.equal(session.info.settings.idle_timeout_secs, 0);
  assert.deepEqual(
    session.info.folders.map((f) => f.name),
    ["work", "outputs", "uploads"],
  );
  const r = await ready;
  assert.ok(r.boot_ms > 0 && r.backend, JSON.stringify(r));
  assert.equal((await mounted).guest_path, "/sessions/main/mnt/work");
  assert.deepEqual(statuses.slice(0, 2), ["starting", "ready"]);

  const p = await session.spawn(["sh", "-c", "cat /sessions/main/mnt/work/hello.txt; echo oops >&2; exit 3"]);
  assert.ok(p.pid > 0 && p.id > 0);
  const [out, err, exit] = await Promise.all([collect(p.stdout), collect(p.stderr), p.exited]);
  assert.equal(out.toString(), "hello from the host\n");
  assert.equal(err.toString(), "oops\n");
  assert.equal(exit.code, 3);
  assert.equal(exit.signal, null);
  assert.equal(exit.lost, false);
  assert.equal(exit.reason, null);
  assert.equal(exit.status, 3);
  assert.equal(exit.process, p.id);
  assert.equal(p.running, false);
});

test("spawn options: cwd, env, and a timeout", async () => {
  const { stdout, exit } = await session.exec(["sh", "-c", 'pwd; echo "$GREETING"'], {
    cwd: "/sessions/main/mnt/work",
    env: { GREETING: "hi there" },
  });
  assert.equal(stdout.toString(), "/sessions/main/mnt/work\nhi there\n");
  assert.equal(exit.code, 0);

  const slow = await session.spawn(["sleep", "100"], { timeoutSecs: 1 });
  const ended = await slow.exited;
  assert.equal(ended.timed_out, true);
  assert.equal(ended.status, 124);
});

test("stdin to cat: bytes arrive in order, exactly, and end() closes it", async () => {
  const p = await session.spawn(["cat"]);
  const data = randomBytes((1 << 20) + 12345); // binary: base64 both ways
  const pieces = [];
  for (let at = 0, n = 1; at < data.length; at += n, n = (n * 7) % 200_000 || 1) {
    pieces.push(data.subarray(at, at + n));
  }
  const [out] = await Promise.all([collect(p.stdout), pipeline(Readable.from(pieces), p.stdin)]);
  assert.equal(out.length, data.length);
  assert.ok(out.equals(data), "cat echoed every byte in order");
  assert.equal((await p.exited).code, 0);

  // A write's callback fires once the guest took it.
  const q = await session.spawn(["cat"]);
  const echoed = collect(q.stdout);
  await new Promise((resolve, reject) => q.stdin.write("line 1\n", (e) => (e ? reject(e) : resolve())));
  q.stdin.end("line 2\n");
  assert.equal((await echoed).toString(), "line 1\nline 2\n");
  assert.equal((await q.exited).code, 0);
});

test("exec collects output and feeds input", async () => {
  const r = await session.exec(["sh", "-c", "cat; echo; echo done"], { input: "abc" });
  assert.equal(r.stdout.toString(), "abc\ndone\n");
  assert.equal(r.exit.code, 0);
});

test("attached after umbrad dropped the oldest kept output, a client is told what it missed", async () => {
  const total = 3_000_000 + 4;
  const p = await session.spawn(["sh", "-c", "head -c 3000000 /dev/zero; echo end"], { detach: true });
  p.stdout.resume();
  assert.equal((await p.exited).code, 0);
  assert.deepEqual(p.missed, { stdout: 0, stderr: 0 }, "the spawner saw it all");
  // From the start: umbrad keeps the last MiB or so, and the first event starts past 0.
  const again = await session.attach(p.id);
  const out = await collect(again.stdout);
  assert.equal(out.subarray(-4).toString(), "end\n");
  const { stdout: missed } = again.missed;
  assert.ok(missed > 0 && missed + out.length === total, `missed ${missed}, received ${out.length} of ${total}`);
  assert.equal(again.offsets.stdout, total);
  console.log(`attached from 0 after ${total} bytes: ${missed} missed, ${out.length} received`);
});

test("kill ends a process with the signal; waiting can be aborted", async () => {
  const p = await session.spawn(["sleep", "1000"]);
  await assert.rejects(p.wait({ signal: AbortSignal.timeout(100) }), (e) => e instanceof AbortError && e.name === "AbortError");
  assert.equal(p.running, true, "aborting a wait leaves the process running");
  await p.kill();
  const exit = await p.exited;
  assert.equal(exit.signal, 15);
  assert.equal(exit.signalName, "SIGTERM");
  assert.equal(exit.code, null);
  assert.equal(exit.status, 143);
  await p.kill("SIGKILL"); // after the end: not an error

  const q = await session.spawn(["sh", "-c", "trap '' TERM; sleep 1000"]);
  await q.kill(9);
  assert.equal((await q.exited).signal, 9);
});

test("a terminal: tty output on stdout, resize", async () => {
  const p = await session.spawn(["sh", "-c", "stty size; read line; stty size"], { tty: { cols: 100, rows: 30 } });
  const chunks = [];
  p.stdout.on("data", (b) => chunks.push(b));
  const text = () => Buffer.concat(chunks).toString();
  const until = async (pred) => {
    const deadline = Date.now() + 20_000;
    while (!pred(text())) {
      assert.ok(Date.now() < deadline, `terminal output so far: ${JSON.stringify(text())}`);
      await new Promise((r) => setTimeout(r, 20));
    }
  };
  await until((t) => t.includes("30 100"));
  await p.resize(120, 40);
  p.stdin.write("\n");
  await until((t) => t.includes("40 120"));
  assert.equal((await p.exited).code, 0);
  assert.match(text(), /30 100\r\n/, "the terminal's \\r\\n");
});

test("errors carry the daemon's codes as UmbraError subclasses", async () => {
  const e1 = await client.sessions.get("nope").catch((e) => e);
  assert.ok(e1 instanceof SessionNotFoundError && e1 instanceof UmbraError, String(e1));
  assert.equal(e1.code, "session_not_found");
  assert.equal(e1.rpcCode, -32001);
  assert.equal(e1.rpcCode, ERROR_CODES.session_not_found);
  assert.equal(e1.method, "session.get");
  assert.equal(e1.name, "SessionNotFoundError");
  assert.match(e1.message, /nope/);

  const e2 = await session.spawn(["no-such-command"]).catch((e) => e);
  assert.ok(e2 instanceof NotFoundError, String(e2));
  assert.equal(e2.code, "not_found");

  const e3 = await client.sessions.start({ name: "bad", memoryMiB: 1 }).catch((e) => e);
  assert.ok(e3 instanceof InvalidParamsError, String(e3));
  assert.equal(e3.rpcCode, -32602);

  await assert.rejects(session.files.read("relative/path"), InvalidParamsError);
  await assert.rejects(client.call("no.such.method", {}), MethodNotFoundError);

  const e4 = await Umbra.connect({ socketPath: path.join(daemon.dir, "nothing-here.sock") }).catch((e) => e);
  assert.ok(e4 instanceof UnavailableError, String(e4));
  assert.equal(e4.code, "unavailable");
  assert.match(e4.message, /nothing-here\.sock/);
  assert.match(e4.message, /start it with `umbrad`/);
});

test("files: write, read, stat, list, in chunks past 1 MiB, by guest or host path", async () => {
  const big = randomBytes(2.5 * (1 << 20));
  assert.equal(await session.files.write("/root/big.bin", big), big.length);
  const back = await session.files.read("/root/big.bin");
  assert.ok(back.equals(big), "2.5 MiB round trip");
  assert.equal((await session.files.stat("/root/big.bin")).size, big.length);
  const part = await session.files.read("/root/big.bin", { offset: (1 << 20) - 3, length: 10 });
  assert.ok(part.equals(big.subarray((1 << 20) - 3, (1 << 20) + 7)));
  await assert.rejects(session.files.read("/root/big.bin", { signal: AbortSignal.abort() }), AbortError);

  await session.files.write("/root/dir/note.txt", "one\n", { createDirs: true, mode: 0o600 });
  await session.files.write("/root/dir/note.txt", "two\n", { append: true });
  assert.equal(await session.files.read("/root/dir/note.txt", { encoding: "utf8" }), "one\ntwo\n");
  assert.equal((await session.files.stat("/root/dir/note.txt")).mode & 0o777, 0o600);
  const { entries } = await session.files.list("/root/dir");
  assert.deepEqual(entries.map((e) => [e.name, e.kind]), [["note.txt", "file"]]);

  // A host path inside a shared folder; a file in outputs is an event.
  const outputs = session.info.folders.find((f) => f.name === "outputs").host_path;
  const created = nextEvent(client, "outputs-file-created", (e) => e.session === "main" && e.path === "report.txt");
  await session.files.write(path.join(outputs, "report.txt"), "done\n", { host: true });
  const ev = await created;
  assert.equal(ev.host_path, path.join(outputs, "report.txt"));
  assert.equal(fs.readFileSync(path.join(outputs, "report.txt"), "utf8"), "done\n");
  assert.equal(await session.files.read(path.join(work, "hello.txt"), { host: true, encoding: "utf8" }), "hello from the host\n");
});

test("folders and shadow folders", async () => {
  const proj = path.join(daemon.dir, "proj");
  fs.mkdirSync(path.join(proj, "src"), { recursive: true });
  fs.writeFileSync(path.join(proj, "src/lib.rs"), "old\n");
  const mounted = nextEvent(client, "folder-mounted", (e) => e.name === "proj");
  const info = await session.folders.mount({ path: proj, mode: "shadow" });
  assert.equal(info.guest_path, "/sessions/main/mnt/proj");
  assert.equal((await mounted).mode, "shadow");
  assert.ok((await session.folders.list()).some((f) => f.name === "proj"));

  const r = await session.exec(["sh", "-c", "cd /sessions/main/mnt/proj && echo new > src/lib.rs && echo x > added.txt"]);
  assert.equal(r.exit.code, 0, r.stderr.toString());
  const diff = await session.shadow.diff("proj");
  assert.deepEqual(diff.changes.map((c) => c.path).sort(), ["added.txt", "src/lib.rs"]);
  const lib = diff.changes.find((c) => c.path === "src/lib.rs");
  assert.equal(lib.size, 4);
  assert.equal(lib.sha256, crypto.createHash("sha256").update("new\n").digest("hex"));
  assert.equal(lib.applies, "by_default");
  assert.equal(fs.readFileSync(path.join(proj, "src/lib.rs"), "utf8"), "old\n", "the host is untouched");
  const exported = await session.shadow.export("proj", { dest: path.join(daemon.dir, "proj.tar") });
  assert.ok(exported.bytes > 0 && fs.existsSync(exported.path));
  // The guest changes the file again after the diff: the apply writes what the diff captured.
  await session.exec(["sh", "-c", "echo later > /sessions/main/mnt/proj/src/lib.rs"]);
  await assert.rejects(session.shadow.apply("proj", "cs-not-a-changeset"), NotFoundError);
  await assert.rejects(session.shadow.apply("proj", diff.changeset, { paths: ["nope.txt"] }), InvalidParamsError);
  const report = await session.shadow.apply("proj", diff.changeset, { paths: ["src/lib.rs"] });
  assert.deepEqual(report.applied, ["src/lib.rs"], JSON.stringify(report));
  assert.deepEqual(report.skipped.map((s) => s.path), ["added.txt"]);
  assert.equal(fs.readFileSync(path.join(proj, "src/lib.rs"), "utf8"), "new\n");
  assert.ok(!fs.existsSync(path.join(proj, "added.txt")));
  await session.shadow.reset("proj");
  assert.deepEqual((await session.shadow.diff("proj")).changes, []);

  const unmounted = nextEvent(client, "folder-unmounted", (e) => e.name === "proj");
  await session.folders.unmount("proj");
  await unmounted;
  assert.ok(!(await session.folders.list()).some((f) => f.name === "proj"));
});

test("a VM failure: heartbeat-failure and restart events; running processes end lost, with the reason", async () => {
  const failure = nextEvent(client, "heartbeat-failure", (e) => e.session === "main");
  const restarting = nextEvent(client, "restarting", (e) => e.session === "main");
  const readyAgain = nextEvent(client, "session-status", (e) => e.session === "main" && e.status === "ready", 180_000);
  const sleeper = await session.spawn(["sleep", "600"]);
  // Everything written so far reaches the session disk, then the guest kernel panics.
  const breaker = await session.spawn(["sh", "-c", "sync; echo c > /proc/sysrq-trigger"]);
  const exit = await sleeper.exited;
  console.log(`the VM failed: ${JSON.stringify(await failure)}; a running process's exit: ${JSON.stringify(exit)}`);
  assert.equal(exit.lost, true);
  assert.equal(exit.signal, 9);
  assert.equal(exit.status, 125);
  assert.match(exit.reason ?? "", /restart/, "the exit names the restart");
  assert.equal((await breaker.exited).lost, true);
  assert.ok((await restarting).attempt >= 1);
  await readyAgain;
  const info = await session.refresh();
  assert.equal(info.restarts, 1);
  assert.equal((await session.exec(["cat", "/sessions/main/mnt/work/hello.txt"])).stdout.toString(), "hello from the host\n");
});

test("configuration: get and set in camelCase", async () => {
  const config = await client.config.get();
  assert.equal(config.memory_mib, 256);
  const changed = await client.config.set({ memoryMiB: 300, maxRestarts: 5, bundleUrl: "file:///nowhere" });
  assert.equal(changed.memory_mib, 300);
  assert.equal(changed.max_restarts, 5);
  assert.equal(changed.bundle_url, "file:///nowhere");
  await assert.rejects(client.config.set({ cpus: 0 }), InvalidParamsError);
  const back = await client.config.set({ memoryMiB: 256, bundleUrl: "" });
  assert.equal(back.memory_mib, 256);
  assert.equal(back.bundle_url ?? null, null);
});

test("warm pool: a start takes a booted VM; poolSize 0 empties the pool", async () => {
  await client.config.set({ poolSize: 1, poolMemoryMiB: 1024 });
  const deadline = Date.now() + 120_000;
  let status = await client.config.pool();
  while (status.ready < 1) {
    assert.ok(Date.now() < deadline, `the pool never filled: ${JSON.stringify(status)}`);
    await new Promise((r) => setTimeout(r, 50));
    status = await client.config.pool();
  }
  assert.equal(status.target, 1);
  // QEMU cannot snapshot: its pool boots each VM, and says so without an error.
  assert.equal(status.restores, false);
  assert.equal(status.snapshot_error, undefined);
  const warm = await client.sessions.start({ name: "pooled" });
  assert.equal(warm.info.vm?.from_pool, true);
  assert.equal((await warm.exec(["echo", "warm"])).stdout.toString(), "warm\n");
  await client.config.set({ poolSize: 0 });
  assert.equal((await client.config.pool()).target, 0);
  await warm.delete();
});

test("bundles: download with progress, status, delete and reinstall", async () => {
  const url = `file://${minimalBundle()}`;
  // The daemon trusts no key yet: the built bundle is refused, by its signer's name.
  const refused = await client.bundles.download({ url }).catch((e) => e);
  assert.ok(refused instanceof UmbraError, String(refused));
  assert.equal(refused.code, "bundle_error");
  assert.match(refused.message, /is signed only by ed25519:[0-9a-f]{16}, which this host does not trust/);
  assert.equal((await client.bundles.status()).current ?? null, null, "nothing was installed");
  // Trusted from the next download on: a .pub file in its trusted-keys directory.
  const keys = path.join(daemon.dir, "config/umbra/trusted-keys");
  fs.mkdirSync(keys, { recursive: true });
  fs.writeFileSync(path.join(keys, "build.pub"), buildSigningKey());
  const progress = [];
  const seen = [];
  const onEvent = (e) => seen.push(e);
  client.on("download-progress", onEvent);
  const got = await client.bundles.download({ url, onProgress: (p) => progress.push(p) });
  assert.equal(got.how, "downloaded");
  assert.ok(progress.length > 0, "progress was reported");
  assert.ok(progress.every((p) => !("event" in p) && !("time_ms" in p)), "progress is the Progress fields");
  // Events travel apart from responses: the last ones may come after the answer.
  assert.ok(progress.some((p) => p.version === got.version && p.total > 0), JSON.stringify(progress));
  assert.ok(seen.length > 0, "download-progress events too");
  client.off("download-progress", onEvent);
  const status = await client.bundles.status();
  assert.equal(status.current, got.version);
  assert.ok(status.installed.some((b) => b.version === got.version && b.current));
  const again = await client.bundles.deleteAndReinstall({ url });
  assert.equal(again.version, got.version);
  await assert.rejects(client.bundles.download({ url, signal: AbortSignal.abort() }), AbortError);
});

test("aborting a start cancels the boot", async () => {
  const controller = new AbortController();
  const starting = nextEvent(client, "session-status", (e) => e.session === "aborted" && e.status === "starting");
  const start = client.sessions.start({ name: "aborted", signal: controller.signal });
  await starting;
  controller.abort(new Error("the user cancelled"));
  const e = await start.catch((x) => x);
  assert.ok(e instanceof AbortError, String(e));
  assert.equal(e.cause?.message, "the user cancelled");
  await nextEvent(client, "session-status", (ev) => ev.session === "aborted" && ev.status === "stopped");
  await client.sessions.delete("aborted");
  await assert.rejects(client.sessions.get("aborted"), SessionNotFoundError);
});

test("network: the policy is set on a running session and kept; bad ones are refused", async () => {
  assert.equal(session.info.settings.network.mode, "none", "sessions start with no network");
  const network = { mode: "allowlist", allow_domains: ["pypi.org", "*.pythonhosted.org"], allow_cidrs: ["10.0.0.0/8"] };
  const info = await session.setNetwork(network);
  assert.deepEqual(info.settings.network, network);
  await assert.rejects(session.setNetwork({ mode: "any", allow_cidrs: ["10.0.0.0/99"] }), InvalidParamsError);
  assert.deepEqual((await session.refresh()).settings.network, network, "unchanged by the refusal");
  await session.setNetwork({ mode: "none" });
});

test("update: what a running session takes at once, and what waits for its next boot", async () => {
  const updated = await session.update({ idleTimeoutSecs: 3600, idleAction: "suspend", memoryMiB: 300 });
  assert.deepEqual(updated.applied, ["idle_timeout_secs", "idle_action"]);
  assert.deepEqual(updated.next_boot, ["memory_mib"]);
  assert.equal(session.info.settings.idle_timeout_secs, 3600, "the handle's info follows");
  assert.equal(session.info.status, "ready", "still running");
  await assert.rejects(session.update({ cpus: 0 }), InvalidParamsError);
  await session.update({ idleTimeoutSecs: 0, idleAction: "stop", memoryMiB: session.info.settings.memory_mib });
});

test("secrets: the guest sees a placeholder, a rotation keeps it, the value is never reported", async () => {
  const value = `value-${randomBytes(8).toString("hex")}`;
  const secrets = client.sessions.start({
    name: "secrets",
    memoryMiB: 256,
    idleTimeoutSecs: 0,
    secrets: [{ name: "API_TOKEN", value, hosts: ["api.example.com"] }],
  });
  const s = await secrets;
  const [info] = s.info.secrets;
  assert.equal(info.name, "API_TOKEN");
  assert.match(info.placeholder, /^umbra-secret-[0-9a-f]{32}$/);
  assert.deepEqual(info.hosts, ["api.example.com"]);
  assert.equal(info.has_value, true);
  const env = await s.exec(["sh", "-c", "echo $API_TOKEN; echo $SSL_CERT_FILE; head -1 /run/umbra/session-ca.pem"]);
  assert.equal(env.stdout.toString(), `${info.placeholder}\n/run/umbra/ca-bundle.pem\n-----BEGIN CERTIFICATE-----\n`);
  // A rotation: the same placeholder, another value, more hosts.
  const rotated = await s.setSecret({ name: "API_TOKEN", value: `${value}-2`, hosts: ["api.example.com", "*.example.org"] });
  assert.equal(rotated.secrets[0].placeholder, info.placeholder);
  assert.deepEqual(rotated.secrets[0].hosts, ["api.example.com", "*.example.org"]);
  await assert.rejects(s.setSecret({ name: "BAD", value: "v\r\nX: y", hosts: ["a.example"] }), InvalidParamsError);
  await assert.rejects(s.setSecret({ name: "NOHOST", value: "v", hosts: [] }), InvalidParamsError);
  // Nothing a client sees holds the value: not the session, not its events or logs.
  const logs = await s.logs();
  for (const seen of [JSON.stringify(await s.refresh()), JSON.stringify(events), JSON.stringify(logs)]) {
    assert.ok(!seen.includes(value), "the value is in what the daemon reports");
  }
  await s.delete();
});

test("network ask mode: allow once, for the session, deny, and silence, each as the guest sees it", async () => {
  const server = net.createServer((c) => c.once("data", (d) => c.end(`pong ${d}`)));
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = server.address().port;
  try {
    const s = await client.sessions.start({
      name: "ask",
      memoryMiB: 256,
      idleTimeoutSecs: 0,
      network: {
        mode: "ask",
        allow_cidrs: ["127.0.0.1/32"],
        resolve: { "asked.test": "127.0.0.1", "other.test": "127.0.0.1" },
        ask_timeout_secs: 2,
      },
    });
    const connect = (name) => s.exec(["sh", "-c", `echo ping | nc -w 20 ${name} ${port}`]);
    /** Runs `name`'s connection, answering its question with `answer` (or not at all). */
    const asked = async (name, answer) => {
      const request = nextEvent(client, "permission-request", (e) => e.session === "ask" && e.kind === "network");
      const run = connect(name);
      const e = await request;
      assert.equal(e.host, name);
      assert.equal(e.port, port);
      assert.equal(e.timeout_secs, 2);
      // The guest process that asked, by its command line.
      assert.ok(e.process?.pid > 1, JSON.stringify(e));
      assert.ok(e.process.command.startsWith(`nc -w 20 ${name}`), JSON.stringify(e));
      if (answer) await client.respondPermission(e.request_id, ...answer);
      return (await run).stdout.toString();
    };
    assert.equal(await asked("asked.test", [true]), "pong ping\n", "allowed once");
    assert.equal(await asked("asked.test", [true, "session"]), "pong ping\n", "allowed for the session");
    assert.equal((await connect("asked.test")).stdout.toString(), "pong ping\n", "not asked again");
    assert.equal(await asked("other.test", [false]), "", "denied: the connection closes");
    const resolved = nextEvent(client, "permission-resolved", (e) => e.session === "ask");
    assert.equal(await asked("other.test", null), "", "silence denies");
    assert.equal((await resolved).reason, "no answer within 2 s");
    await s.delete();
  } finally {
    server.close();
  }
});

test("ports: a guest's web server through an exposed port, announced as it starts", async () => {
  const opened = nextEvent(client, "port-opened", (e) => e.session === "main" && e.port === 8000);
  const server = await session.spawn([
    "sh",
    "-c",
    "mkdir -p /tmp/www && echo hi-from-the-guest > /tmp/www/index.html && exec httpd -f -p 127.0.0.1:8000 -h /tmp/www",
  ]);
  const e = await opened;
  assert.ok(e.process?.command.startsWith("httpd -f -p 127.0.0.1:8000"), JSON.stringify(e));
  const info = await session.expose(8000);
  assert.equal(info.guest_port, 8000);
  assert.equal(info.bind, "127.0.0.1");
  const body = await (await fetch(`http://127.0.0.1:${info.host_port}/index.html`)).text();
  assert.equal(body, "hi-from-the-guest\n");
  assert.deepEqual(
    (await session.ports()).map((p) => [p.guest_port, p.host_port]),
    [[8000, info.host_port]],
  );
  await session.unexpose(8000);
  await assert.rejects(fetch(`http://127.0.0.1:${info.host_port}/index.html`));
  assert.deepEqual(await session.ports(), []);
  await server.kill("SIGKILL");
  await server.wait();
});

test("snapshot and fork on qemu: refused by name, and the session runs on", async () => {
  const e = await session.snapshot().catch((x) => x);
  assert.ok(e instanceof UnsupportedError, String(e));
  assert.match(e.message, /qemu backend, which cannot snapshot/);
  assert.equal((await session.refresh()).status, "ready", "a refused snapshot leaves the session running");
  assert.equal((await session.exec(["echo", "still"])).stdout.toString(), "still\n");
  // Forking a running session snapshots it first: the same refusal, and no fork is left behind.
  const f = await session.fork("branch").catch((x) => x);
  assert.ok(f instanceof UnsupportedError, String(f));
  await assert.rejects(client.sessions.get("branch"), SessionNotFoundError);
  // A snapshot is discarded only from a stopped session.
  const d = await session.resume({ discardSnapshot: true }).catch((x) => x);
  assert.equal(d.code, "invalid_state", String(d));
  assert.match(d.message, /cannot discard its snapshot \(stop it first\)/);
});

test("lifecycle: list, stop, resume, logs, delete", async () => {
  const names = (await client.sessions.list()).map((s) => s.name);
  assert.deepEqual(names, ["main"]);
  const stopped = nextEvent(client, "session-status", (e) => e.session === "main" && e.status === "stopped");
  assert.equal((await session.stop()).status, "stopped");
  await stopped;
  const e = await session.exec(["true"]).catch((x) => x);
  assert.equal(e.code, "invalid_state");
  // With no snapshot to discard, `discardSnapshot` boots it as any resume does.
  assert.equal((await session.resume({ discardSnapshot: true })).status, "ready");
  assert.equal((await session.exec(["cat", "/root/big.bin"])).stdout.length, 2.5 * (1 << 20), "the disk survived");
  const logs = await session.logs({ lines: 500 });
  assert.ok(logs.events.some((ev) => ev.event === "status" && ev.status === "stopped"));
  await client.sessions.delete("main");
  await assert.rejects(session.refresh(), SessionNotFoundError);
});

test("events: one per kind, and the catch-all", () => {
  const kinds = new Set(events.map((e) => e.event));
  for (const kind of [
    "status",
    "ready",
    "folder_mounted",
    "folder_unmounted",
    "spawned",
    "exit",
    "outputs_file_created",
    "download_progress",
    "heartbeat_failure",
    "restarting",
  ]) {
    assert.ok(kinds.has(kind), `saw a ${kind} event (saw ${[...kinds].join(", ")})`);
  }
  assert.ok(events.every((e) => typeof e.time_ms === "number"));
});
