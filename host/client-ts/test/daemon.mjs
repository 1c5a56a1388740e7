// A real umbrad for tests (the approach of tests/src/daemon.rs): the built binary, in a private
// set of XDG directories (runtime, state, data, config) under a fresh temp dir, with a config
// file that suits tests. Helpers of its VMs carry that directory in their command lines, which
// is how a test checks that none are left.

import { spawn } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { after } from "node:test";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
/** The workspace root. */
export const REPO = path.resolve(here, "../../..");

/** umbrad: `$UMBRA_UMBRAD_BIN`, else `<repo>/target/debug/umbrad`. */
export function umbradBin() {
  const bin = process.env.UMBRA_UMBRAD_BIN || path.join(REPO, "target/debug/umbrad");
  if (!fs.existsSync(bin)) {
    throw new Error(`${bin} not found: build it first (cargo build --workspace), or set UMBRA_UMBRAD_BIN`);
  }
  return bin;
}

/** The minimal bundle: `$UMBRA_TEST_BUNDLE_MINIMAL`, else where `vmctl bundle build` puts it. */
/** The public key `vmctl bundle build` signed the built bundles with (docs/bundle.md). */
export function buildSigningKey() {
  const secret =
    process.env.UMBRA_BUNDLE_SIGNING_KEY ||
    path.join(process.env.XDG_CONFIG_HOME || path.join(os.homedir(), ".config"), "umbra/bundle-signing.key");
  return fs.readFileSync(`${secret}.pub`, "utf8");
}

export function minimalBundle() {
  const cache =
    process.env.UMBRA_CACHE_DIR ||
    path.join(process.env.XDG_CACHE_HOME || path.join(os.homedir(), ".cache"), "umbra");
  const dir = process.env.UMBRA_TEST_BUNDLE_MINIMAL || path.join(cache, "bundles/minimal");
  if (!fs.existsSync(path.join(dir, "manifest.json"))) {
    throw new Error(
      `no minimal bundle at ${dir} (set UMBRA_TEST_BUNDLE_MINIMAL or run: target/debug/vmctl bundle build --flavor minimal)`,
    );
  }
  return dir;
}

/** The standard bundle: `$UMBRA_TEST_BUNDLE_STANDARD`, else where `vmctl bundle build` puts it. */
export function standardBundle() {
  const cache =
    process.env.UMBRA_CACHE_DIR ||
    path.join(process.env.XDG_CACHE_HOME || path.join(os.homedir(), ".cache"), "umbra");
  const dir = process.env.UMBRA_TEST_BUNDLE_STANDARD || path.join(cache, "bundles/standard");
  if (!fs.existsSync(path.join(dir, "manifest.json"))) {
    throw new Error(`no standard bundle at ${dir} (vmctl bundle build --flavor standard)`);
  }
  return dir;
}

/** The boot timeout guests get: `UMBRA_BOOT_TIMEOUT_SECS`, else 120 s (emulation on a loaded 2-core host). */
export function bootTimeoutSecs() {
  const n = Number.parseInt(process.env.UMBRA_BOOT_TIMEOUT_SECS ?? "", 10);
  return Number.isFinite(n) && n > 0 ? n : 120;
}

const HELPERS = ["qemu-system", "vhost-device-vsock", "virtiofsd", "umbra-fsd", "umbra-vmm"];

/** Processes whose command line names a VM helper and contains `marker`. */
export function helpersMentioning(marker) {
  const found = [];
  for (const entry of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    let cmd;
    try {
      cmd = fs.readFileSync(`/proc/${entry}/cmdline`, "utf8").replace(/\0/g, " ");
    } catch {
      continue;
    }
    if (HELPERS.some((h) => cmd.includes(h)) && cmd.includes(marker)) {
      found.push({ pid: Number(entry), cmd });
    }
  }
  return found;
}

/** A field of /proc/<pid>/status in KiB (`VmHWM`, `VmRSS`). */
export function procStatusKiB(pid, field) {
  const status = fs.readFileSync(`/proc/${pid}/status`, "utf8");
  const line = status.split("\n").find((l) => l.startsWith(`${field}:`));
  if (!line) throw new Error(`no ${field} in /proc/${pid}/status`);
  return Number.parseInt(line.split(/\s+/)[1], 10);
}

function canConnect(socketPath) {
  return new Promise((resolve) => {
    const s = net.createConnection({ path: socketPath });
    s.once("connect", () => {
      s.destroy();
      resolve(true);
    });
    s.once("error", () => resolve(false));
  });
}

export class TestDaemon {
  /**
   * Starts umbrad with `config` merged over test defaults (the minimal bundle, 256 MiB guests,
   * no idle stop, a small disk).
   */
  static async start(tag, config = {}, args = []) {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), `umbra-ts-${tag}-`));
    const base = {
      bundle: minimalBundle(),
      memory_mib: 256,
      idle_timeout_secs: 0,
      disk_size_mib: 256,
      boot_timeout_secs: bootTimeoutSecs(),
      ...config,
    };
    fs.mkdirSync(path.join(dir, "config/umbra"), { recursive: true });
    fs.writeFileSync(path.join(dir, "config/umbra/umbrad.json"), JSON.stringify(base, null, 2));
    const d = new TestDaemon(dir, args);
    await d.launch();
    return d;
  }

  constructor(dir, args = []) {
    this.dir = dir;
    /** umbrad's command-line arguments. */
    this.args = args;
    this.socket = path.join(dir, "run/umbra/umbrad.sock");
    this.logPath = path.join(dir, "umbrad.log");
    this.child = null;
  }

  /** Starts the daemon process (again) and waits until it serves. */
  async launch() {
    const env = {
      ...process.env,
      XDG_RUNTIME_DIR: path.join(this.dir, "run"),
      XDG_STATE_HOME: path.join(this.dir, "state"),
      XDG_DATA_HOME: path.join(this.dir, "data"),
      XDG_CONFIG_HOME: path.join(this.dir, "config"),
      RUST_LOG: "info,umbrad=debug",
    };
    delete env.UMBRA_DATA_DIR;
    delete env.UMBRA_SOCKET;
    const log = fs.openSync(this.logPath, "a");
    const child = spawn(umbradBin(), this.args, { env, stdio: ["ignore", "ignore", log] });
    fs.closeSync(log);
    this.child = child;
    let exited = null;
    child.once("exit", (code, signal) => {
      exited = { code, signal };
    });
    const deadline = Date.now() + 20_000;
    while (!(await canConnect(this.socket))) {
      if (exited) {
        throw new Error(`umbrad exited (${JSON.stringify(exited)}) before serving; its log:\n${this.log()}`);
      }
      if (Date.now() > deadline) {
        throw new Error(`umbrad did not serve ${this.socket} within 20 s`);
      }
      await sleep(20);
    }
  }

  get pid() {
    return this.child?.pid;
  }

  log() {
    try {
      return fs.readFileSync(this.logPath, "utf8");
    } catch {
      return "";
    }
  }

  /** The last lines of its log (for failure messages). */
  logTail(lines = 60) {
    return this.log().split("\n").slice(-lines).join("\n");
  }

  /** Whether `child` exited within `ms`. */
  waitExit(child, ms) {
    if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve(true);
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        child.off("exit", onExit);
        resolve(false);
      }, ms);
      const onExit = () => {
        clearTimeout(timer);
        resolve(true);
      };
      child.once("exit", onExit);
    });
  }

  /** SIGKILLs the daemon and reaps it. */
  async kill9() {
    const child = this.child;
    this.child = null;
    if (child) {
      child.kill("SIGKILL");
      await this.waitExit(child, 10_000);
    }
  }

  /** SIGTERM (umbrad stops its sessions), then SIGKILL after `graceMs`. */
  async terminate(graceMs = 40_000) {
    const child = this.child;
    this.child = null;
    if (!child) return;
    child.kill("SIGTERM");
    if (!(await this.waitExit(child, graceMs))) {
      child.kill("SIGKILL");
      await this.waitExit(child, 10_000);
    }
  }

  helpers() {
    return helpersMentioning(this.dir);
  }

  /** Waits until no helper of this daemon's VMs is left; throws with the survivors. */
  async assertNoHelpersWithin(ms) {
    const deadline = Date.now() + ms;
    for (;;) {
      const left = this.helpers();
      if (left.length === 0) return;
      if (Date.now() > deadline) {
        throw new Error(`still running after ${ms} ms: ${JSON.stringify(left, null, 2)}`);
      }
      await sleep(50);
    }
  }

  /** Stops the daemon, checks that its VMs are gone, removes its directory (keeps it on `keep`). */
  async stop({ keep = false } = {}) {
    await this.terminate();
    try {
      await this.assertNoHelpersWithin(10_000);
    } finally {
      // Whatever is left is killed, so a failed test leaves no processes behind.
      for (const { pid } of this.helpers()) {
        try {
          process.kill(pid, "SIGKILL");
        } catch {
          // gone already
        }
      }
      if (!keep) {
        fs.rmSync(this.dir, { recursive: true, force: true });
      }
    }
  }
}

/** Resolves with the next `name` event of `emitter` that satisfies `pred`, or rejects after `ms`. */
export function nextEvent(emitter, name, pred = () => true, ms = 60_000) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      emitter.off(name, listener);
      reject(new Error(`no ${name} event within ${ms} ms`));
    }, ms);
    const listener = (ev) => {
      if (pred(ev)) {
        clearTimeout(timer);
        emitter.off(name, listener);
        resolve(ev);
      }
    };
    emitter.on(name, listener);
  });
}

/** Collects a readable stream into one Buffer. */
export async function collect(stream) {
  const parts = [];
  for await (const chunk of stream) parts.push(chunk);
  return Buffer.concat(parts);
}

/**
 * After the file's tests: close the client and stop the daemon that `current()` names, printing
 * the daemon's log when a test failed.
 */
export function cleanUpAfter(current) {
  after(async () => {
    const { daemon, client } = current();
    await client?.close();
    if (daemon) {
      if (process.exitCode) console.error(`--- umbrad's log:\n${daemon.logTail()}`);
      await daemon.stop();
    }
  });
}
