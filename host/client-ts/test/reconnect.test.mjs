// umbrad restarts under a connected client: running processes end with a clear reason, the
// client says it lost the daemon, reconnects by itself, says so, and its subscription is back.

import assert from "node:assert/strict";
import { test } from "node:test";

import { Umbra, UnavailableError } from "../dist/index.js";
import { TestDaemon, nextEvent, cleanUpAfter } from "./daemon.mjs";

/** @type {TestDaemon | undefined} */
let daemon;
/** @type {Umbra | undefined} */
let client;

cleanUpAfter(() => ({ daemon, client }));

/**
 * A relay in front of `d`'s socket: the client connects through it, and destroying the sockets
 * in `live` cuts the client's connection while umbrad runs on.
 */
async function startRelay(d) {
  const net = await import("node:net");
  const path = await import("node:path");
  const relaySocket = path.join(d.dir, "relay.sock");
  const live = new Set();
  const relay = net.createServer((c) => {
    const u = net.connect(d.socket);
    live.add(c);
    c.on("close", () => live.delete(c));
    c.pipe(u).pipe(c);
    c.on("error", () => u.destroy());
    u.on("error", () => c.destroy());
    u.on("close", () => c.destroy());
    c.on("close", () => u.destroy());
  });
  await new Promise((r) => relay.listen(relaySocket, r));
  return { relaySocket, live, relay };
}

test("after umbrad restarts, the client reconnects and subscribes again; running processes end lost", async () => {
  daemon = await TestDaemon.start("reconnect");
  client = await Umbra.connect({ socketPath: daemon.socket, reconnect: { initialDelayMs: 50, maxDelayMs: 500 } });
  const session = await client.sessions.start({ name: "r" });
  const firstPid = client.daemon.pid;

  // 1. umbrad dies (SIGKILL): its VMs die with it.
  const p = await session.spawn(["sleep", "1000"]);
  const disconnected = nextEvent(client, "disconnected");
  await daemon.kill9();
  const exit = await p.exited;
  assert.equal(exit.lost, true);
  assert.match(exit.reason, /connection to umbrad was lost/);
  assert.equal(exit.status, 125);
  console.log(`after SIGKILL of umbrad, the process's exit: ${JSON.stringify(exit)}`);
  const d = await disconnected;
  assert.ok(d.error instanceof UnavailableError, String(d.error));
  assert.equal(d.willReconnect, true);
  assert.equal(client.connected, false);
  const e = await client.sessions.list().catch((x) => x);
  assert.ok(e instanceof UnavailableError && /reconnecting/.test(e.message), String(e));
  await daemon.assertNoHelpersWithin(5_000);

  // 2. A new umbrad: the client finds it by itself.
  const reconnected = nextEvent(client, "reconnected");
  await daemon.launch();
  const r = await reconnected;
  assert.equal(r.daemon.pid, daemon.pid);
  assert.notEqual(r.daemon.pid, firstPid);
  assert.ok(r.attempts >= 1 && r.downtimeMs >= 0);
  assert.equal(client.connected, true);
  assert.equal(client.daemon.pid, daemon.pid);

  // 3. The subscription is back: resuming the session is heard as events.
  const [listed] = await client.sessions.list();
  assert.equal(listed.status, "stopped");
  const ready = nextEvent(client, "session-status", (ev) => ev.session === "r" && ev.status === "ready");
  await client.sessions.resume("r");
  await ready;
  const { stdout } = await session.exec(["echo", "back"]);
  assert.equal(stdout.toString(), "back\n");

  // 4. A graceful restart (SIGTERM): umbrad stops its sessions, the process still ends with a reason.
  const q = await session.spawn(["sleep", "1000"]);
  const again = nextEvent(client, "reconnected");
  await daemon.terminate();
  const qexit = await q.exited;
  console.log(`after SIGTERM of umbrad, the process's exit: ${JSON.stringify(qexit)}`);
  assert.match(qexit.reason ?? "", /session was stopped|connection to umbrad was lost/, JSON.stringify(qexit));
  assert.equal(qexit.code, null);
  await daemon.launch();
  await again;
  assert.equal((await client.sessions.get("r")).status, "stopped");
});

test("with reconnect off, the client stays disconnected and says so", async () => {
  const d2 = await TestDaemon.start("noreconnect");
  try {
    const c = await Umbra.connect({ socketPath: d2.socket, reconnect: false });
    const disconnected = nextEvent(c, "disconnected");
    await d2.kill9();
    const info = await disconnected;
    assert.equal(info.willReconnect, false);
    const e = await c.call("daemon.info", {}).catch((x) => x);
    assert.ok(e instanceof UnavailableError, String(e));
    await c.close();
  } finally {
    await d2.stop();
  }
});

test("a detached process and a terminal outlive a lost connection: the client attaches again by itself", async () => {
  const d3 = await TestDaemon.start("kept");
  // The client reaches umbrad through a relay that can cut its connection while umbrad runs on.
  const { relaySocket, live, relay } = await startRelay(d3);
  const c = await Umbra.connect({ socketPath: relaySocket, reconnect: { initialDelayMs: 50, maxDelayMs: 200 } });
  try {
    const session = await c.sessions.start({ name: "k" });
    const script = "i=0; while [ $i -lt 200 ]; do echo n-$i; i=$((i+1)); sleep 0.02; done; exit 5";
    const expected = Array.from({ length: 200 }, (_, i) => `n-${i}\n`).join("");
    const p = await session.spawn(["sh", "-c", script], { detach: true });
    assert.equal(p.detached, true);
    const chunks = [];
    p.stdout.on("data", (b) => chunks.push(b));
    const term = await session.openTerminal({ size: { cols: 100, rows: 30 } });
    term.process.stdout.resume();
    const r = await term.run("cd /tmp && WHO=kept");
    assert.deepEqual(r, { exit_code: 0, cwd: "/tmp" });
    while (Buffer.concat(chunks).length < 20) {
      await new Promise((res) => setTimeout(res, 20));
    }
    // The connection drops; umbrad and the session stay.
    const reconnected = nextEvent(c, "reconnected");
    for (const s of live) s.destroy();
    await reconnected;
    const exit = await p.exited;
    assert.equal(exit.code, 5, JSON.stringify(exit));
    assert.equal(Buffer.concat(chunks).toString(), expected, "every byte once, across the reconnect");
    const listed = await session.processes();
    assert.ok(listed.some((x) => x.process === p.id && x.detached && x.exit?.code === 5), JSON.stringify(listed));
    // The terminal too: attached again, its shell kept its variable and directory.
    assert.equal(term.process.running, true);
    assert.deepEqual(await term.run('[ "$WHO" = kept ]'), { exit_code: 0, cwd: "/tmp" });
    assert.deepEqual((await session.terminals()).map((t) => t.terminal), [term.id]);
    const again = await session.attachTerminal(term.id);
    const scrollback = [];
    again.process.stdout.on("data", (b) => scrollback.push(b));
    await term.close();
    await again.process.exited;
    // From its start: the marker of the first run, printed before the reconnect.
    assert.match(Buffer.concat(scrollback).toString(), /\]6973;[0-9a-f]+;0;\/tmp\x07/, "the scrollback came back");
  } finally {
    await c.close();
    relay.close();
    await d3.stop();
  }
});

test("stdin of a detached process goes on across a lost connection, every byte once", async () => {
  const crypto = await import("node:crypto");
  const d4 = await TestDaemon.start("stdin");
  const { relaySocket, live, relay } = await startRelay(d4);
  const c = await Umbra.connect({ socketPath: relaySocket, reconnect: { initialDelayMs: 50, maxDelayMs: 200 } });
  try {
    const session = await c.sessions.start({ name: "s" });
    const p = await session.spawn(["sh", "-c", "sleep 1; exec md5sum"], { detach: true });
    const out = [];
    p.stdout.on("data", (b) => out.push(b));
    const data = crypto.randomBytes(3_000_000);
    const written = new Promise((resolve, reject) => {
      p.stdin.on("error", reject);
      p.stdin.on("finish", resolve);
    });
    for (let at = 0; at < data.length; at += 100_000) {
      p.stdin.write(data.subarray(at, at + 100_000));
    }
    p.stdin.end();
    let finished = false;
    void written.then(() => (finished = true));
    // The connection drops while pieces are in flight (umbrad answers a piece once the guest
    // took it, and the process reads nothing for a second); umbrad and the session stay.
    await new Promise((r) => setTimeout(r, 150));
    assert.equal(finished, false, "the writes were still going on at the cut");
    const reconnected = nextEvent(c, "reconnected");
    assert.ok(live.size > 0);
    for (const s of live) s.destroy();
    await reconnected;
    await written;
    const exit = await p.exited;
    assert.equal(exit.code, 0, JSON.stringify(exit));
    const want = crypto.createHash("md5").update(data).digest("hex");
    assert.equal(Buffer.concat(out).toString().split(/\s/)[0], want, "3 MB of stdin, once, in order");
  } finally {
    await c.close();
    relay.close();
    await d4.stop();
  }
});
