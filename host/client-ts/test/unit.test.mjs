// The client against a scripted fake umbrad (a Unix socket in this process): framing, flow
// control, ordered stdin, errors, version checks and reconnection, exactly and fast. The real
// daemon is in the other test files.

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { after, test } from "node:test";

import {
  API_VERSION,
  ERROR_CLASSES,
  ERROR_CODES,
  METHOD_NAMES,
  OUTPUT_WINDOW,
  SESSION_EVENT_KINDS,
  InvalidParamsError,
  SessionNotFoundError,
  UnauthorizedError,
  UnavailableError,
  UnknownError,
  UnsupportedError,
  Umbra,
  UmbraError,
  defaultSocketPath,
  emitterName,
  errorFromRpc,
  snakeCase,
} from "../dist/index.js";

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "umbra-ts-unit-"));
/** Clients and fake daemons to close however a test ends. */
const open = [];
after(async () => {
  for (const o of open.reverse()) await o.close();
  fs.rmSync(dir, { recursive: true, force: true });
});
let n = 0;

/**
 * A fake umbrad: answers `daemon.info` and `events.subscribe` itself, hands every other
 * request (and notification) to `handler(message, conn)`, and records what it received.
 */
async function fakeDaemon({ apiVersion = API_VERSION, handler = () => {}, onConnect, socketPath } = {}) {
  socketPath ??= path.join(dir, `d${n++}.sock`);
  const fake = { socketPath, received: [], conns: new Set(), server: null, accepted: 0 };
  fake.send = (conn, message) => conn.write(JSON.stringify(message) + "\n");
  fake.listen = () =>
    new Promise((resolve) => {
      fake.server = net.createServer((conn) => {
        fake.accepted++;
        fake.conns.add(conn);
        conn.on("close", () => fake.conns.delete(conn));
        if (onConnect?.(conn, fake) === false) return;
        let buf = "";
        conn.on("data", (d) => {
          buf += d.toString();
          let i;
          while ((i = buf.indexOf("\n")) >= 0) {
            const m = JSON.parse(buf.slice(0, i));
            buf = buf.slice(i + 1);
            fake.received.push(m);
            if (m.method === "daemon.info") {
              fake.send(conn, {
                jsonrpc: "2.0",
                id: m.id,
                result: { api_version: apiVersion, version: "0.0.0", pid: 1, uid: 0, socket: socketPath },
              });
            } else if (m.method === "events.subscribe") {
              fake.send(conn, { jsonrpc: "2.0", id: m.id, result: { subscription: 1 } });
            } else {
              handler(m, conn, fake);
            }
          }
        });
      });
      fake.server.listen(socketPath, resolve);
    });
  fake.close = () =>
    new Promise((resolve) => {
      for (const c of fake.conns) c.destroy();
      if (!fake.server.listening) return resolve();
      fake.server.close(() => resolve());
    });
  await fake.listen();
  open.push(fake);
  return fake;
}

function track(client) {
  open.push(client);
  return client;
}

const reply = (fake, conn, m, result) => fake.send(conn, { jsonrpc: "2.0", id: m.id, result });

test("the socket path follows umbrad's rule", () => {
  assert.equal(defaultSocketPath({ UMBRA_SOCKET: "/x/u.sock", XDG_RUNTIME_DIR: "/run/user/5" }), "/x/u.sock");
  assert.equal(defaultSocketPath({ XDG_RUNTIME_DIR: "/run/user/5" }), "/run/user/5/umbra/umbrad.sock");
  assert.equal(defaultSocketPath({ UMBRA_SOCKET: "", XDG_RUNTIME_DIR: "" }), `/tmp/umbra-${process.getuid()}/umbrad.sock`);
});

test("before connecting, the client checks who could have made the socket", async () => {
  // Node has no SO_PEERCRED: the socket and its directory must be ours, the directory 0700,
  // neither a symlink. Refusals happen before the connect, so the daemon never sees them.
  const sub = fs.mkdtempSync(path.join(dir, "private-"));
  const fake = await fakeDaemon({ socketPath: path.join(sub, "umbrad.sock") });
  const refused = async (socketPath, pattern) => {
    const e = await Umbra.connect({ socketPath, reconnect: false }).catch((x) => x);
    assert.ok(e instanceof UnauthorizedError, String(e));
    assert.match(e.message, pattern);
  };
  // The control: as made (mkdtemp is 0700), it is accepted.
  const client = track(await Umbra.connect({ socketPath: fake.socketPath, reconnect: false, subscribe: false }));
  await client.close();
  assert.equal(fake.accepted, 1);

  fs.chmodSync(sub, 0o755);
  await refused(fake.socketPath, /its directory .* has mode 0755, not 0700/);
  fs.chmodSync(sub, 0o700);
  const linkedDir = path.join(dir, `linked-${n++}`);
  fs.symlinkSync(sub, linkedDir);
  await refused(path.join(linkedDir, "umbrad.sock"), /its directory .* is a symlink/);
  const linkedSocket = path.join(sub, "link.sock");
  fs.symlinkSync(fake.socketPath, linkedSocket);
  await refused(linkedSocket, /: it is a symlink/);
  const notASocket = path.join(sub, "file.sock");
  fs.writeFileSync(notASocket, "");
  await refused(notASocket, /it is not a socket/);
  if (process.geteuid() === 0) {
    // Another user's directory (we are root: hand it to nobody).
    fs.chownSync(sub, 65534, 65534);
    await refused(fake.socketPath, /belongs to uid 65534, not to uid 0/);
    fs.chownSync(sub, 0, 0);
    fs.chownSync(fake.socketPath, 65534, 65534);
    await refused(fake.socketPath, /: it belongs to uid 65534, not to uid 0/);
  }
  assert.equal(fake.accepted, 1, "no refused client reached the daemon");
  await fake.close();
});

test("camelCase options map to the wire's snake_case", () => {
  assert.equal(snakeCase("memoryMiB"), "memory_mib");
  assert.equal(snakeCase("diskSizeMiB"), "disk_size_mib");
  assert.equal(snakeCase("idleTimeoutSecs"), "idle_timeout_secs");
  assert.equal(snakeCase("bundleUrl"), "bundle_url");
  assert.equal(snakeCase("cpus"), "cpus");
});

test("generated constants and names", () => {
  assert.match(API_VERSION, /^\d+\.\d+$/);
  assert.equal(OUTPUT_WINDOW, 1 << 20);
  assert.ok(METHOD_NAMES.includes("session.start") && METHOD_NAMES.includes("process.ack"));
  assert.equal(emitterName("status"), "session-status");
  assert.equal(emitterName("error"), "session-error");
  assert.equal(emitterName("outputs_file_created"), "outputs-file-created");
  assert.ok(SESSION_EVENT_KINDS.includes("heartbeat_failure"));
  for (const [code, number] of Object.entries(ERROR_CODES)) {
    const Class = ERROR_CLASSES[code];
    const e = new Class("m");
    assert.ok(e instanceof UmbraError);
    assert.deepEqual([e.code, e.rpcCode], [code, number]);
  }
});

test("JSON-RPC errors become the class of their code", () => {
  const e = errorFromRpc({ code: -32001, message: "no session", data: { code: "session_not_found" } }, "session.get");
  assert.ok(e instanceof SessionNotFoundError);
  assert.deepEqual([e.code, e.rpcCode, e.method, e.message], ["session_not_found", -32001, "session.get", "no session"]);
  const future = errorFromRpc({ code: -32050, message: "new", data: { code: "from_the_future" } });
  assert.ok(future instanceof UnknownError);
  assert.deepEqual([future.code, future.daemonCode, future.rpcCode], ["unknown", "from_the_future", -32050]);
  assert.ok(errorFromRpc({ code: -32602, message: "bad" }) instanceof InvalidParamsError, "by number without a name");
});

test("no daemon: UnavailableError naming the socket and how to start umbrad", async () => {
  const e = await Umbra.connect({ socketPath: path.join(dir, "none.sock") }).catch((x) => x);
  assert.ok(e instanceof UnavailableError, String(e));
  assert.match(e.message, /none\.sock.*start it with `umbrad`/);
});

test("another major API version is refused on connect", async () => {
  const fake = await fakeDaemon({ apiVersion: "2.0" });
  const e = await Umbra.connect({ socketPath: fake.socketPath }).catch((x) => x);
  assert.ok(e instanceof UnsupportedError, String(e));
  assert.match(e.message, /speaks API 2\.0/);
  await fake.close();
});

test("a refused client gets the daemon's unauthorized error", async () => {
  const fake = await fakeDaemon({
    onConnect(conn, f) {
      f.send(conn, {
        jsonrpc: "2.0",
        id: null,
        error: { code: -32019, message: "uid 1001 may not use this umbrad", data: { code: "unauthorized" } },
      });
      conn.end();
      return false;
    },
  });
  const e = await Umbra.connect({ socketPath: fake.socketPath, reconnect: false }).catch((x) => x);
  assert.ok(e instanceof UnauthorizedError, String(e));
  await fake.close();
});

test("output is acknowledged only as the consumer takes it; events right after the spawn's answer are kept", async () => {
  const CHUNK = 512 * 1024;
  const fake = await fakeDaemon({
    handler(m, conn, f) {
      if (m.method === "process.spawn") {
        // The response and the process's first events in one write, as umbrad may send them.
        const lines = [
          { jsonrpc: "2.0", id: m.id, result: { process: 7, pid: 42 } },
          { jsonrpc: "2.0", method: "process.event", params: { event: "spawned", process: 7, pid: 42, argv: m.params.argv, session: "s", time_ms: 1 } },
        ];
        for (let i = 0; i < 3; i++) {
          const data = Buffer.alloc(CHUNK, i + 1).toString("base64");
          lines.push({ jsonrpc: "2.0", method: "process.event", params: { event: "stdout", process: 7, data, encoding: "base64", session: "s", time_ms: 1 } });
        }
        lines.push({ jsonrpc: "2.0", method: "process.event", params: { event: "stderr", process: 7, data: "warn\n", session: "s", time_ms: 1 } });
        conn.write(lines.map((l) => JSON.stringify(l) + "\n").join(""));
      }
    },
  });
  const client = track(await Umbra.connect({ socketPath: fake.socketPath }));
  const p = await client.sessions.session("s").spawn(["x"]);
  const acks = () =>
    fake.received.filter((m) => m.method === "process.ack" && m.params.stream === "stdout").reduce((a, m) => a + m.params.bytes, 0);
  await sleep(100);
  assert.equal(acks(), 0, "nothing read yet: nothing acknowledged (the first chunk already exceeds the highWaterMark)");
  assert.ok(fake.received.every((m) => m.method !== "process.ack" || m.id === undefined), "acks are notifications");
  assert.equal(p.stdout.readableLength, 3 * CHUNK, "held for the consumer");

  const first = p.stdout.read(CHUNK);
  assert.equal(first.length, CHUNK);
  await sleep(50);
  assert.equal(acks(), 0, "still above the highWaterMark: still nothing acknowledged");
  const chunks = [first];
  p.stdout.on("data", (c) => chunks.push(c));
  await sleep(50);
  assert.equal(acks(), 3 * CHUNK, "drained: what the stream took is acknowledged");
  const all = Buffer.concat(chunks);
  assert.equal(all.length, 3 * CHUNK);
  assert.ok(all.subarray(2 * CHUNK).every((b) => b === 3));
  assert.equal(p.stderr.read().toString(), "warn\n");

  for (const conn of fake.conns) {
    fake.send(conn, { jsonrpc: "2.0", method: "process.event", params: { event: "exit", process: 7, code: 0, signal: null, duration_ms: 5, session: "s", time_ms: 2 } });
  }
  const exit = await p.exited;
  assert.deepEqual([exit.code, exit.lost, exit.status], [0, false, 0]);
  await client.close();
  await fake.close();
});

test("stdin goes in order with at most 16 writes unanswered", async () => {
  let unanswered = 0;
  let most = 0;
  const got = [];
  const fake = await fakeDaemon({
    handler(m, conn, f) {
      if (m.method === "process.spawn") reply(f, conn, m, { process: 1, pid: 2 });
      if (m.method === "process.stdin") {
        got.push(Buffer.from(m.params.data, m.params.encoding === "base64" ? "base64" : "utf8"));
        unanswered++;
        most = Math.max(most, unanswered);
        setTimeout(() => {
          unanswered--;
          reply(f, conn, m, {});
        }, 5);
      }
      if (m.method === "process.close_stdin") reply(f, conn, m, {});
    },
  });
  const client = track(await Umbra.connect({ socketPath: fake.socketPath }));
  const p = await client.sessions.session("s").spawn(["cat"]);
  const data = Buffer.alloc(3 << 20);
  for (let i = 0; i < data.length; i++) data[i] = (i * 31) & 0xff;
  await new Promise((resolve, reject) => p.stdin.end(data, (e) => (e ? reject(e) : resolve())));
  assert.ok(Buffer.concat(got).equals(data), "every byte, in order");
  assert.ok(most <= 16 && most > 1, `at most 16 unanswered, pipelined (saw ${most})`);
  assert.equal(fake.received.at(-1).method, "process.close_stdin", "end() closes stdin after the data");
  await client.close();
  await fake.close();
});

test("a lost connection ends processes, fails calls, and the client reconnects and resubscribes", async () => {
  let heldCall;
  const fake = await fakeDaemon({
    handler(m, conn, f) {
      if (m.method === "process.spawn") reply(f, conn, m, { process: 3, pid: 4 });
      if (m.method === "session.list") heldCall = m; // never answered
    },
  });
  const client = track(await Umbra.connect({ socketPath: fake.socketPath, reconnect: { initialDelayMs: 20, maxDelayMs: 100 } }));
  const events = [];
  for (const name of ["disconnected", "reconnected"]) client.on(name, (info) => events.push([name, info]));
  const p = await client.sessions.session("s").spawn(["sleep", "9"]);
  const pending = client.sessions.list();
  while (!heldCall) await sleep(5);
  await fake.close();
  const e = await pending.catch((x) => x);
  assert.ok(e instanceof UnavailableError, String(e));
  const exit = await p.exited;
  assert.equal(exit.lost, true);
  assert.match(exit.reason, /connection to umbrad was lost/);
  assert.equal(events[0][0], "disconnected");
  assert.equal(events[0][1].willReconnect, true);

  const subscribes = fake.received.filter((m) => m.method === "events.subscribe").length;
  await sleep(150); // a few failed attempts
  await fake.listen();
  while (!client.connected) await sleep(10);
  assert.equal(events.at(-1)[0], "reconnected");
  assert.ok(events.at(-1)[1].attempts >= 2);
  assert.equal(fake.received.filter((m) => m.method === "events.subscribe").length, subscribes + 1, "subscribed again");
  await client.close();
  assert.equal(client.connected, false);
  const closed = await client.call("daemon.info", {}).catch((x) => x);
  assert.ok(closed instanceof UnavailableError && /closed/.test(closed.message));
  await fake.close();
});
