// `npm pack` gives a package that a fresh TypeScript project can install and compile against:
// only dist/ and the README ship, with .d.ts types; no runtime dependencies; the README's
// example type-checks; `require` and `import` both load it; and the README's example, pasted
// into `demo.mjs`, runs as the README says against a real umbrad. Offline: the fresh project
// installs nothing but the tarball (`npm install --offline`), and compiles with the typescript
// and @types/node this package's `npm ci` installed (the versions it pins).

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import * as fs from "node:fs";
import * as os from "node:os";
import * as path from "node:path";
import { after, test } from "node:test";
import { fileURLToPath } from "node:url";

import { TestDaemon } from "./daemon.mjs";

const pkgDir = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const pkg = JSON.parse(fs.readFileSync(path.join(pkgDir, "package.json"), "utf8"));
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "umbra-ts-pack-"));
after(() => fs.rmSync(tmp, { recursive: true, force: true }));

const npmCache = process.env.UMBRA_NPM_CACHE || path.join(os.homedir(), ".cache/umbra/npm");
const npmEnv = {
  ...process.env,
  npm_config_cache: npmCache,
  npm_config_update_notifier: "false",
  npm_config_offline: "true",
  npm_config_audit: "false",
  npm_config_fund: "false",
};
const ownModules = path.join(pkgDir, "node_modules");
const run = (cmd, args, cwd, env = npmEnv) =>
  execFileSync(cmd, args, { cwd, env, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
/** The fresh project, once the first test made it. */
let project;

/** The README's first ```ts block: the example a newcomer pastes. */
function readmeExample() {
  const readme = fs.readFileSync(path.join(pkgDir, "README.md"), "utf8");
  const m = readme.match(/```ts\n([\s\S]*?)```/);
  assert.ok(m, "the README has a ```ts example");
  return m[1];
}

test("npm pack ships dist/ with types, and a fresh TypeScript project compiles against it", () => {
  const [packed] = JSON.parse(run("npm", ["pack", "--json", "--pack-destination", tmp], pkgDir));
  const files = packed.files.map((f) => f.path).sort();
  assert.ok(files.includes("dist/index.d.ts") && files.includes("dist/index.js"), files.join(" "));
  assert.ok(files.includes("dist/generated/types.d.ts"));
  assert.ok(files.includes("README.md") && files.includes("package.json"));
  assert.deepEqual(
    files.filter((f) => !f.startsWith("dist/") && f !== "README.md" && f !== "package.json"),
    [],
    "nothing but dist/, the README and package.json",
  );
  assert.equal(pkg.dependencies, undefined, "no runtime dependencies");

  project = path.join(tmp, "consumer");
  fs.mkdirSync(path.join(project, "src"), { recursive: true });
  fs.writeFileSync(
    path.join(project, "package.json"),
    JSON.stringify(
      {
        name: "umbra-client-consumer",
        private: true,
        type: "module",
        dependencies: { "@umbra/client": `file:${path.join(tmp, packed.filename)}` },
      },
      null,
      2,
    ),
  );
  fs.writeFileSync(
    path.join(project, "tsconfig.json"),
    JSON.stringify({
      compilerOptions: {
        target: "ES2022",
        module: "nodenext",
        moduleResolution: "nodenext",
        strict: true,
        exactOptionalPropertyTypes: true,
        noUncheckedIndexedAccess: true,
        noEmit: true,
        types: ["node"],
        // @types/node from this package's own node_modules: nothing else is downloaded.
        typeRoots: [path.join(ownModules, "@types")],
      },
      include: ["src"],
    }),
  );
  fs.writeFileSync(path.join(project, "src/readme.ts"), readmeExample());
  // The rest of the surface, typed as an app would use it.
  fs.writeFileSync(
    path.join(project, "src/app.ts"),
    `import {
  Umbra, UmbraError, SessionNotFoundError, UnavailableError, AbortError,
  type Session, type SessionEvent, type EventOf, type ExitInfo, type SessionInfo, type Methods,
} from "@umbra/client";

export async function app(signal: AbortSignal): Promise<void> {
  const client = await Umbra.connect({ socketPath: "/tmp/x.sock", reconnect: { maxDelayMs: 1000 } });
  client.on("heartbeat-failure", (e) => console.log(e.session, e.reason));
  client.on("download-progress", (e) => console.log(e.done, e.total));
  client.on("outputs-file-created", (e) => console.log(e.path, e.host_path));
  client.on("session-status", (e) => { const s: SessionInfo["status"] = e.status; console.log(s); });
  client.on("event", (e: SessionEvent) => { if (e.event === "exit") console.log(e.code, e.lost); });
  client.on("disconnected", ({ error, willReconnect }) => console.log(error.code, willReconnect));
  client.on("reconnected", ({ daemon }) => console.log(daemon.pid));
  const s: Session = await client.sessions.start({ name: "x", memoryMiB: 512, cpus: 2, idleTimeoutSecs: 0, signal });
  const p = await s.spawn(["cat"], { cwd: "/", env: { A: "b" }, tty: false, timeoutSecs: 5 });
  p.stdin.end("hi");
  p.stdout.pipe(process.stdout);
  await p.resize(80, 24).catch(() => undefined);
  await p.kill("SIGINT");
  const exit: ExitInfo = await p.wait({ signal });
  const code: number | null = exit.code;
  const text: string = await s.files.read("/etc/hostname", { encoding: "utf8", signal });
  const bytes: Buffer = await s.files.read("/etc/hostname");
  await s.files.write("/tmp/x", bytes, { createDirs: true });
  await s.folders.mount({ path: "/srv", mode: "shadow", name: "srv" });
  const { changeset, changes } = await s.shadow.diff("srv");
  await s.shadow.apply("srv", changeset, { paths: changes.map((c) => c.path) });
  await s.shadow.export("srv", { dest: "/tmp/srv.tar" });
  await s.shadow.reset("srv");
  await client.bundles.download({ url: "file:///b", onProgress: (pr) => console.log(pr.phase), signal });
  await client.config.set({ memoryMiB: 1024, autoDownload: true, bundleUrl: "" });
  const list: Methods["session.list"]["result"] = await client.call("session.list", {});
  const ready: EventOf<"ready"> | undefined = undefined;
  try { await client.sessions.get("nope"); } catch (e) {
    if (e instanceof SessionNotFoundError) { const c: "session_not_found" = e.code; console.log(c, e.rpcCode); }
    else if (e instanceof UnavailableError || e instanceof AbortError) throw e;
    else if (e instanceof UmbraError) console.log(e.code);
  }
  console.log(code, text, changes.length, list.sessions.length, ready);
  await client.close();
}
`,
  );
  run("npm", ["install", "--offline", "--loglevel=error"], project);
  const installed = JSON.parse(fs.readFileSync(path.join(project, "node_modules/@umbra/client/package.json"), "utf8"));
  assert.equal(installed.version, pkg.version);
  assert.deepEqual(fs.readdirSync(path.join(project, "node_modules")).filter((n) => !n.startsWith(".")), ["@umbra"], "the tarball alone");
  const tsc = path.join(ownModules, "typescript/bin/tsc");
  assert.ok(fs.existsSync(tsc), `${tsc}: run npm ci first`);
  try {
    run(process.execPath, [tsc, "-p", "."], project);
  } catch (e) {
    assert.fail(`the fresh project does not compile:\n${e.stdout}${e.stderr}`);
  }

  // It loads both ways, without dependencies.
  const viaRequire = run("node", ["-e", "const u = require('@umbra/client'); console.log(typeof u.Umbra.connect, u.API_VERSION)"], project);
  assert.match(viaRequire, /^function \d+\.\d+/);
  const viaImport = run("node", ["--input-type=module", "-e", "import { Umbra, SessionNotFoundError } from '@umbra/client'; console.log(typeof Umbra, SessionNotFoundError.code)"], project);
  assert.equal(viaImport.trim(), "function session_not_found");
});

test("the README's example, pasted into demo.mjs, runs against a real umbrad", async (t) => {
  assert.ok(project, "the fresh project of the previous test");
  fs.writeFileSync(path.join(project, "demo.mjs"), readmeExample());
  const daemon = await TestDaemon.start("readme");
  t.after(() => daemon.stop());
  let out;
  try {
    // `node demo.mjs`, with the socket found the documented way ($UMBRA_SOCKET).
    out = run(process.execPath, ["demo.mjs"], project, { ...process.env, UMBRA_SOCKET: daemon.socket });
  } catch (e) {
    assert.fail(`node demo.mjs failed:\n${e.stdout}${e.stderr}\n--- umbrad's log:\n${daemon.logTail()}`);
  }
  console.log(out.trimEnd().replace(/^/gm, "demo.mjs| "));
  assert.match(out, /^\[demo\] ready$/m);
  assert.match(out, /^consumer$/m, "ls of the shared folders names the current directory");
  assert.match(out, /^Linux /m, "uname -a");
  assert.match(out, /^HELLO FROM THE HOST$/m, "stdin reached tr");
  assert.match(out, /^exited with 0$/m);
  assert.match(out, /^not_found \(-\d+\): /m);
  assert.match(out, /^\[demo\] stopped$/m, "deleted (a delete stops it first)");
});
