// `sessions.start({ image })`: an OCI image made with umoci, pushed with skopeo to Debian's
// docker-registry on 127.0.0.1 (started and stopped here), booted by a real umbrad with its
// config's defaults applied to the session's processes.

import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as path from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { after, test } from "node:test";

import { Umbra } from "../dist/index.js";
import { TestDaemon, cleanUpAfter } from "./daemon.mjs";

/** @type {TestDaemon} */
let daemon;
/** @type {Umbra} */
let client;
let registry;

cleanUpAfter(() => ({ daemon, client }));
after(() => registry?.kill());

async function freePort() {
  const server = net.createServer();
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

async function listening(port) {
  for (let i = 0; i < 400; i++) {
    const ok = await new Promise((resolve) => {
      const s = net.connect(port, "127.0.0.1", () => {
        s.destroy();
        resolve(true);
      });
      s.once("error", () => resolve(false));
    });
    if (ok) return;
    await sleep(50);
  }
  throw new Error(`docker-registry did not listen on ${port}`);
}

test("a session boots an OCI image with its Env, WorkingDir and User", async () => {
  daemon = await TestDaemon.start("images", {}, ["--allow-http-loopback"]);
  const dir = path.join(daemon.dir, "image");
  const port = await freePort();
  fs.mkdirSync(path.join(dir, "storage"), { recursive: true });
  fs.writeFileSync(
    path.join(dir, "registry.yml"),
    `version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: ${dir}/storage\nhttp:\n  addr: 127.0.0.1:${port}\n`,
  );
  registry = spawn("docker-registry", ["serve", path.join(dir, "registry.yml")], { stdio: "ignore" });
  await listening(port);

  // The image: busybox and a user, as umoci writes layers and configs.
  const root = path.join(dir, "root");
  fs.mkdirSync(path.join(root, "bin"), { recursive: true });
  fs.mkdirSync(path.join(root, "etc"));
  fs.mkdirSync(path.join(root, "srv"));
  fs.copyFileSync("/bin/busybox", path.join(root, "bin/busybox"));
  fs.chmodSync(path.join(root, "bin/busybox"), 0o755);
  fs.symlinkSync("busybox", path.join(root, "bin/sh"));
  fs.writeFileSync(path.join(root, "etc/passwd"), "root:x:0:0::/root:/bin/sh\nworker:x:1234:4321::/srv:/bin/sh\n");
  const layout = path.join(dir, "layout");
  const umoci = (...args) => execFileSync("umoci", args, { stdio: "pipe" });
  umoci("init", "--layout", layout);
  umoci("new", "--image", `${layout}:app`);
  umoci("insert", "--image", `${layout}:app`, root, "/");
  umoci(
    "config",
    "--image",
    `${layout}:app`,
    "--config.env",
    "PATH=/bin",
    "--config.env",
    "GREETING=hello from the image",
    "--config.workingdir",
    "/srv",
    "--config.user",
    "worker",
  );
  const reference = `127.0.0.1:${port}/ts/app:1`;
  execFileSync("skopeo", ["copy", "--quiet", "--dest-tls-verify=false", `oci:${layout}:app`, `docker://${reference}`]);

  client = await Umbra.connect({ socketPath: daemon.socket });
  const session = await client.sessions.start({ name: "img", image: reference });
  assert.match(session.info.vm?.bundleVersion ?? session.info.vm?.bundle_version ?? "", /^image-[0-9a-f]{16}$/);
  const { stdout, exit } = await session.exec(["sh", "-c", 'echo "$GREETING"; pwd; id -u; id -g']);
  assert.equal(exit.code, 0);
  assert.equal(stdout.toString(), "hello from the image\n/srv\n1234\n4321\n");
  // A request's own cwd and environment win over the image's.
  const own = await session.exec(["sh", "-c", 'echo "$GREETING"; pwd'], { cwd: "/", env: { GREETING: "mine" } });
  assert.equal(own.stdout.toString(), "mine\n/\n");
  await client.sessions.delete("img");

  // `image` and `bundle` together are refused by name.
  await assert.rejects(
    client.sessions.start({ name: "both", image: reference, bundle: "minimal" }),
    /give `image` or `bundle`, not both/,
  );
});
