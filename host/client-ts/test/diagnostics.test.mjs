// Language servers in the guest and diagnostics for a proposed change, from the client's
// `session.languages`, against a real umbrad and a guest of the standard image (pylsp).

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { before, test } from "node:test";

import { Umbra } from "../dist/index.js";
import { TestDaemon, cleanUpAfter, nextEvent, standardBundle } from "./daemon.mjs";

/** @type {TestDaemon} */
let daemon;
/** @type {Umbra} */
let client;
/** @type {import("../dist/index.js").Session} */
let session;
let work;

before(async () => {
  daemon = await TestDaemon.start("diagnostics", { bundle: standardBundle(), memory_mib: 768 });
  work = path.join(daemon.dir, "work");
  fs.mkdirSync(work);
  fs.writeFileSync(path.join(work, "util.py"), "def helper(x):\n    return x + 1\n");
  fs.writeFileSync(path.join(work, "main.py"), "from util import helper\n\nprint(helper(1))\n");
  client = await Umbra.connect({ socketPath: daemon.socket });
  session = await client.sessions.start({ name: "lint", folders: [{ path: work, mode: "shadow" }] });
});

cleanUpAfter(() => ({ daemon, client }));

test("forChange: an introduced error comes back, a fix resolves it, nothing is written", async () => {
  // A loaded CI machine runs other guests beside this one: a generous wait for the servers.
  const broken = await session.languages.forChange(
    "work",
    { "main.py": "from util import helper\n\nprint(helper(oops))\n" },
    { timeoutMs: 120_000 },
  );
  assert.equal(broken.complete, true);
  assert.deepEqual(
    broken.diagnostics.map((d) => [d.path, d.range.start.line, d.message, d.source]),
    [["main.py", 2, "undefined name 'oops'", "pyflakes"]],
  );
  const gone = await session.languages.forChange("work", { "main.py": "print(1)\n" }, { timeoutMs: 120_000 });
  assert.deepEqual(gone.resolved, [], "nothing was wrong before");
  assert.deepEqual(
    gone.diagnostics.map((d) => d.message),
    [],
    "dropping the import is fine: pyflakes does not see unused names across files",
  );
  assert.equal(fs.readFileSync(path.join(work, "main.py"), "utf8"), "from util import helper\n\nprint(helper(1))\n");
  assert.deepEqual((await session.shadow.diff("work")).changes, []);
});

test("a language server of one's own: notifications as events, requests, stop", async () => {
  const server = await session.languages.start("work", { language: "python" });
  assert.equal(server.info.folder, "work");
  const root = `file://${server.info.root}`;
  const published = nextEvent(client, "lsp-notification", (e) => e.server === server.id && e.method === "textDocument/publishDiagnostics");
  await server.notify("textDocument/didOpen", {
    textDocument: { uri: `${root}/main.py`, languageId: "python", version: 1, text: "import util\n\nutil.helper(2)\n" },
  });
  const event = await published;
  assert.match(event.params.uri, /main\.py$/);
  const hover = await server.request("textDocument/hover", { textDocument: { uri: `${root}/main.py` }, position: { line: 2, character: 6 } });
  assert.match(JSON.stringify(hover), /helper/);
  assert.equal((await session.languages.list()).length, 1);
  await server.stop();
  assert.deepEqual(await session.languages.list(), []);
});
