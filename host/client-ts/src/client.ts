/**
 * {@link Umbra}: a connection to umbrad with typed calls, sessions, bundles, configuration and
 * events, which reconnects by itself when umbrad restarts.
 */

import { EventEmitter } from "node:events";

import { Connection, type RequestOptions } from "./connection";
import { AbortError, UmbraError, UnavailableError, UnsupportedError, throwIfAborted } from "./errors";
import { emitterName, type UmbraEvents } from "./events";
import {
  API_VERSION,
  type BundleStatus,
  type ConfigPatch,
  type DaemonConfig,
  type DaemonInfo,
  type Downloaded,
  type MethodName,
  type Methods,
  type PoolStatus,
  type Progress,
  type SessionEvent,
  type SessionLogs,
  type PermissionScope,
  type StartParams,
} from "./generated/types";
import { type CallOptions, type CamelCased, toWire } from "./options";
import { type ProcessOrigin, UmbraProcess } from "./process";
import { type FolderOptions, type ResumeOptions, Session, type SpawnOptions, folderSpec, resumeParams } from "./session";
import { defaultSocketPath } from "./paths";

/** How {@link Umbra} reconnects after losing umbrad. */
export interface ReconnectOptions {
  /** The first retry's delay. @defaultValue 100 */
  initialDelayMs?: number;
  /** Delays double up to this. @defaultValue 2000 */
  maxDelayMs?: number;
}

/** Options of {@link Umbra.connect}. */
export interface ConnectOptions {
  /** umbrad's socket. Default: `$UMBRA_SOCKET`, else `$XDG_RUNTIME_DIR/umbra/umbrad.sock`, else `/tmp/umbra-<uid>/umbrad.sock`. */
  socketPath?: string;
  /**
   * Receive the lifecycle events of every session (and bundle downloads) as this client's
   * events, from now on and again after each reconnection. With `false`, only
   * `bundles.download`'s `onProgress` subscribes, while it runs. @defaultValue true
   */
  subscribe?: boolean;
  /** Reconnect after umbrad went away (`false`: stay disconnected). @defaultValue true */
  reconnect?: boolean | ReconnectOptions;
  /** Gives up connecting when it fires. */
  signal?: AbortSignal;
}

export type { CallOptions };

/** Options of {@link Sessions.start}: the session's name, folders, and settings that differ from the daemon's defaults. */
export interface StartOptions extends CamelCased<Omit<StartParams, "name" | "folders">> {
  /** The session's name: `[A-Za-z0-9._-]`, at most 64 bytes. */
  name: string;
  /** Host folders to share at `/sessions/<name>/mnt/<folder>`. */
  folders?: FolderOptions[];
  /**
   * Stops waiting for the boot and cancels it (`session.stop`): the promise rejects with an
   * AbortError and the session is left `stopped`.
   */
  signal?: AbortSignal;
}

/** Settings to change with {@link Config.set}, in camelCase (`memoryMiB`, `bundleUrl`, `autoDownload`, …). */
export type ConfigOptions = CamelCased<ConfigPatch>;

/** Options of {@link Bundles.download}. */
export interface DownloadOptions {
  /** `http(s)://` or `file://` of a bundle's `manifest.json` (or its directory); default: the configured `bundle_url`. */
  url?: string;
  /** Into the warm slot: the next session start promotes it. */
  warm?: boolean;
  /** Called with each progress event of the download(s) in progress. */
  onProgress?: (progress: Progress) => void;
  /** Stops waiting (the download itself carries on in umbrad). */
  signal?: AbortSignal;
}

/** The sessions of this daemon (`session.*`). */
export class Sessions {
  /** @internal */
  constructor(private readonly client: Umbra) {}

  /**
   * Creates and boots a session; resolves once it is ready. Starting a name that is already
   * starting or running waits for that session (its own folders and settings apply).
   *
   * ```ts
   * const s = await client.sessions.start({ name: "dev", folders: [{ path: "/home/me/proj", mode: "ro" }], memoryMiB: 1024 });
   * ```
   */
  async start(options: StartOptions): Promise<Session> {
    const { name, folders, signal } = options;
    const params = {
      ...toWire(options, ["name", "folders", "signal"]),
      name,
      folders: (folders ?? []).map(folderSpec),
    } as StartParams;
    const info = await this._boot("session.start", params, name, signal);
    return new Session(this.client, name, info);
  }

  /** Every session. */
  async list(): Promise<Session[]> {
    const { sessions } = await this.client.call("session.list", {});
    return sessions.map((info) => new Session(this.client, info.name, info));
  }

  /** One session; rejects with a {@link SessionNotFoundError} if there is none of that name. */
  async get(name: string): Promise<Session> {
    return new Session(this.client, name, await this.client.call("session.get", { name }));
  }

  /** A handle on session `name` without asking umbrad (calls on it fail if there is no such session). */
  session(name: string): Session {
    return new Session(this.client, name);
  }

  /** Stops a session: processes end, the VM goes; folders, outputs and disk stay. */
  async stop(name: string): Promise<Session> {
    return new Session(this.client, name, await this.client.call("session.stop", { name }));
  }

  /**
   * Boots a stopped or failed session again (a snapshotted one is restored); resolves once it
   * is ready (aborting cancels the boot). `discardSnapshot` deletes its snapshot and boots it
   * from its disk instead: for a snapshot this host cannot restore.
   */
  async resume(name: string, options: ResumeOptions = {}): Promise<Session> {
    return new Session(this.client, name, await this._boot("session.resume", resumeParams(name, options), name, options.signal));
  }

  /**
   * Pauses a running session into a snapshot in its storage and stops it; `resume` restores it.
   * Its processes exit now (`lost`) and are ended at the restore; detached ones run on. The kvm
   * backend only: elsewhere it rejects with an `UnsupportedError`.
   */
  async snapshot(name: string): Promise<Session> {
    return new Session(this.client, name, await this.client.call("session.snapshot", { name }));
  }

  /**
   * Starts session `name` from the snapshot of `source` (a running source is snapshotted and
   * resumed first, its processes ending as at a snapshot): the same settings and folders, its
   * own disk, outputs, uploads and hostname.
   */
  async fork(source: string, name: string): Promise<Session> {
    return new Session(this.client, name, await this.client.call("session.fork", { source, name }));
  }

  /** Stops a session and removes it with its outputs, uploads and disk. */
  async delete(name: string): Promise<void> {
    await this.client.call("session.delete", { name });
  }

  /** A session's recent lifecycle events and console lines. */
  logs(name: string, options: { lines?: number } = {}): Promise<SessionLogs> {
    return this.client.call("session.logs", { name, ...(options.lines === undefined ? {} : { lines: options.lines }) });
  }

  /** @internal A start or resume: aborting it cancels the boot. */
  async _boot<M extends "session.start" | "session.resume">(
    method: M,
    params: Methods[M]["params"],
    name: string,
    signal: AbortSignal | undefined,
  ): Promise<Methods[M]["result"]> {
    try {
      return await this.client.call(method, params, { signal });
    } catch (e) {
      if (e instanceof AbortError) {
        // A stop cancels a boot in progress rather than waiting for it.
        this.client.call("session.stop", { name }).catch(() => undefined);
      }
      throw e;
    }
  }
}

/** The bundle store: what sessions boot (`bundle.*`). */
export class Bundles {
  /** @internal */
  constructor(private readonly client: Umbra) {}

  /** Installed bundles, the current one, and downloads in progress. */
  status(): Promise<BundleStatus> {
    return this.client.call("bundle.status", {});
  }

  /** Downloads, verifies and installs a bundle and makes it current (or warm); progress goes to `onProgress`. */
  download(options: DownloadOptions = {}): Promise<Downloaded> {
    const { url, warm, onProgress, signal } = options;
    const params = { ...(url === undefined ? {} : { url }), ...(warm === undefined ? {} : { warm }) };
    return this.withProgress(onProgress, () => this.client.call("bundle.download", params, { signal }));
  }

  /** Downloads a bundle again even if it is installed; the installed copy is replaced only once the new one is verified. */
  deleteAndReinstall(options: Omit<DownloadOptions, "warm"> = {}): Promise<Downloaded> {
    const { url, onProgress, signal } = options;
    return this.withProgress(onProgress, () =>
      this.client.call("bundle.delete_and_reinstall", url === undefined ? {} : { url }, { signal }),
    );
  }

  private async withProgress<T>(onProgress: ((p: Progress) => void) | undefined, run: () => Promise<T>): Promise<T> {
    if (!onProgress) {
      return run();
    }
    const listener = (event: Extract<SessionEvent, { event: "download_progress" }>) => {
      const { event: _kind, time_ms: _time, session: _session, ...progress } = event;
      onProgress(progress);
    };
    this.client.on("download-progress", listener);
    await this.client._holdSubscription();
    try {
      return await run();
    } finally {
      this.client.off("download-progress", listener);
      this.client._releaseSubscription();
    }
  }
}

/** umbrad's configuration: defaults for new sessions, bundle source (`config.*`). */
export class Config {
  /** @internal */
  constructor(private readonly client: Umbra) {}

  /** The whole configuration. */
  get(): Promise<DaemonConfig> {
    return this.client.call("config.get", {});
  }

  /** Changes some settings (checked as a whole, saved, then applied); resolves with the whole new configuration. */
  set(changes: ConfigOptions): Promise<DaemonConfig> {
    return this.client.call("config.set", toWire(changes) as ConfigPatch);
  }

  /** The warm pool set by `poolSize` and `poolMemoryMiB`: its target, ready and booting VMs. */
  pool(): Promise<PoolStatus> {
    return this.client.call("pool.status", {});
  }
}

type ConnectionState = "connected" | "reconnecting" | "closed";

/**
 * A client of umbrad. Connect with {@link Umbra.connect}; it is an `EventEmitter` of
 * {@link UmbraEvents}.
 *
 * ```ts
 * const client = await Umbra.connect();
 * client.on("session-status", (e) => console.log(e.session, e.status));
 * const session = await client.sessions.start({ name: "demo" });
 * const p = await session.spawn(["uname", "-a"]);
 * p.stdout.pipe(process.stdout);
 * console.log((await p.exited).code);
 * await client.close();
 * ```
 */
export class Umbra extends EventEmitter<UmbraEvents> {
  /** The socket this client talks to. */
  readonly socketPath: string;
  /** Sessions: `start`, `list`, `get`, `stop`, `resume`, `snapshot`, `fork`, `delete`, `logs`. */
  readonly sessions: Sessions;
  /** Bundles: `status`, `download`, `deleteAndReinstall`. */
  readonly bundles: Bundles;
  /** Configuration: `get`, `set`, and the warm pool it sets (`pool`). */
  readonly config: Config;

  private connection: Connection | null = null;
  private state: ConnectionState = "connected";
  private info: DaemonInfo | null = null;
  private readonly processes = new Map<number, UmbraProcess>();
  private readonly reconnect: Required<ReconnectOptions> | null;
  /** Reasons to be subscribed: the `subscribe` option, and downloads waiting for progress. */
  private subscriptionHolds = 0;
  private subscription: number | null = null;
  private subscribing: Promise<void> | null = null;
  private reconnectTimer: NodeJS.Timeout | null = null;
  private opening: Connection | null = null;

  private constructor(socketPath: string, options: ConnectOptions) {
    super();
    this.socketPath = socketPath;
    this.sessions = new Sessions(this);
    this.bundles = new Bundles(this);
    this.config = new Config(this);
    const r = options.reconnect ?? true;
    this.reconnect =
      r === false ? null : { initialDelayMs: 100, maxDelayMs: 2000, ...(typeof r === "object" ? r : {}) };
    if (options.subscribe ?? true) {
      this.subscriptionHolds = 1;
    }
  }

  /**
   * Connects to umbrad, checks that it speaks this client's API major version, and (unless
   * `subscribe: false`) subscribes to its events. Rejects with an {@link UnavailableError}
   * when umbrad is not running, an {@link UnsupportedError} when it speaks another major
   * version.
   */
  static async connect(options: ConnectOptions = {}): Promise<Umbra> {
    const socketPath = options.socketPath ?? defaultSocketPath();
    throwIfAborted(options.signal);
    const client = new Umbra(socketPath, options);
    await client.open(options.signal);
    return client;
  }

  /** The daemon as of the last (re)connection: version, pid, uid, socket. */
  get daemon(): DaemonInfo {
    if (this.info === null) {
      throw new UnavailableError(`not connected to umbrad at ${this.socketPath}`);
    }
    return this.info;
  }

  /** Whether the client is connected now (false while it reconnects, and after `close()`). */
  get connected(): boolean {
    return this.state === "connected" && this.connection !== null && !this.connection.isClosed;
  }

  /**
   * Calls any method by name, with its wire params and result (snake_case, as in docs/ipc.md):
   * the typed escape hatch under the rest of this API.
   */
  async call<M extends MethodName>(
    method: M,
    params: Methods[M]["params"],
    options: CallOptions = {},
  ): Promise<Methods[M]["result"]> {
    return (await this.live().request(method, params, { signal: options.signal })) as Methods[M]["result"];
  }

  /**
   * Answers a `'permission-request'` event (Cowork's `respondToToolPermission`). For a command
   * (`kind: "command"`), the command waiting on it runs (its `spawn`/`exec` resolves), or its
   * `spawn`/`exec` rejects with a `PermissionDeniedError` naming the rule. For a connection
   * (`kind: "network"`, a session in network mode `ask`: `host`, `port`), the guest's connection
   * goes ahead or is refused; `scope: "session"` allows the name for the rest of the session.
   * For a command, `scope: "always"` also adds the line's simple commands to the session's allow
   * list, so they run without asking from then on.
   * Rejects with a `NotFoundError` when the request is no longer waiting (answered, or timed
   * out: silence denies).
   *
   * ```ts
   * client.on("permission-request", async (e) => {
   *   if (e.kind === "network") {
   *     const ok = await askTheUser(`connect to ${e.host}:${e.port}?`);
   *     await client.respondPermission(e.request_id, ok, "session");
   *   } else {
   *     await client.respondPermission(e.request_id, await askTheUser(e.command, e.decision?.reason));
   *   }
   * });
   * ```
   */
  async respondPermission(requestId: string, approved: boolean, scope: PermissionScope = "once"): Promise<void> {
    await this.call("permission.respond", { request_id: requestId, approved, ...(scope === "once" ? {} : { scope }) });
  }

  /** What this daemon is (`daemon.info`). */
  async daemonInfo(): Promise<DaemonInfo> {
    this.info = await this.call("daemon.info", {});
    return this.info;
  }

  /**
   * Disconnects for good: stops reconnecting, and umbrad kills this client's processes (their
   * `exited` resolve with `lost: true`).
   */
  async close(): Promise<void> {
    if (this.state === "closed") {
      return;
    }
    this.state = "closed";
    if (this.reconnectTimer) {
      clearTimeout(this.reconnectTimer);
      this.reconnectTimer = null;
    }
    const c = this.connection;
    this.connection = null;
    if (c && !c.isClosed) {
      c.close(new UnavailableError(`the client closed its connection to umbrad at ${this.socketPath}`));
      await c.closed;
    }
    this.loseProcesses("the client was closed");
  }

  /** @internal */
  async _spawn(session: string, argv: readonly string[], options: SpawnOptions): Promise<UmbraProcess> {
    const connection = this.live();
    const tty = options.tty === true ? { cols: 80, rows: 24 } : options.tty || undefined;
    const params = {
      session,
      argv: [...argv],
      ...(options.cwd === undefined ? {} : { cwd: options.cwd }),
      ...(options.env === undefined ? {} : { env: options.env }),
      ...(tty === undefined ? {} : { tty: { cols: tty.cols, rows: tty.rows } }),
      ...(options.timeoutSecs === undefined ? {} : { timeout_secs: options.timeoutSecs }),
      ...(options.detach ? { detach: true } : {}),
    };
    let proc: UmbraProcess | undefined;
    const onResult = (result: unknown) => {
      // Registered before the next line is read: the process's events follow its response.
      const r = result as Methods["process.spawn"]["result"];
      proc = this.track({
        connection,
        session,
        id: r.process,
        pid: r.pid,
        argv: params.argv,
        detached: options.detach === true,
        numberedStdin: this.numbersStdin(),
      });
    };
    await connection.request("process.spawn", params, { onResult } satisfies RequestOptions);
    return proc!;
  }

  /**
   * @internal Attaches to a kept process (`process.attach`, or `terminal.open`/`terminal.attach`
   * by `method`): its output from the start of what the session keeps, then as it comes.
   */
  async _attach(
    session: string,
    method: "process.attach" | "terminal.attach" | "terminal.open",
    params: Record<string, unknown>,
    argv: readonly string[] = [],
  ): Promise<{ proc: UmbraProcess; result: unknown }> {
    const connection = this.live();
    const target = params.process ?? params.terminal;
    const existing = typeof target === "number" ? this.processes.get(target) : undefined;
    let proc: UmbraProcess | undefined;
    const onResult = (result: unknown) => {
      const r = result as { process?: number; terminal?: number; pid: number; shell?: string[] };
      const id = (r.process ?? r.terminal)!;
      existing?._onConnectionLost("attached again: this client's earlier view of it ends");
      const from = params.from;
      const offsets =
        typeof from === "number"
          ? { stdout: from, stderr: 0 }
          : typeof from === "object" && from !== null
            ? (from as { stdout: number; stderr: number })
            : undefined;
      proc = this.track({
        connection,
        session,
        id,
        pid: r.pid,
        argv: [...(r.shell ?? argv)],
        detached: true,
        ...(offsets === undefined ? {} : { from: offsets }),
        numberedStdin: this.numbersStdin(),
      });
    };
    const result = await connection.request(method, params, { onResult } satisfies RequestOptions);
    return { proc: proc!, result };
  }

  /** Whether umbrad takes numbered stdin from a named writer (API 1.9). */
  private numbersStdin(): boolean {
    const [major, minor] = (this.info?.api_version ?? "0.0").split(".").map(Number);
    return major === 1 && (minor ?? 0) >= 9;
  }

  private track(origin: ProcessOrigin): UmbraProcess {
    const proc = new UmbraProcess(origin);
    this.processes.set(origin.id, proc);
    void proc.exited.then(() => {
      if (this.processes.get(origin.id) === proc) {
        this.processes.delete(origin.id);
      }
    });
    return proc;
  }

  /** After a reconnect: attaches again to each detached process, from what it received. */
  private async reattach(connection: Connection): Promise<void> {
    const detached = [...this.processes.values()].filter((p) => p.detached && p.running);
    await Promise.all(
      detached.map(async (p) => {
        const params = { session: p.session, process: p.id, from: p.offsets };
        const onResult = () => p._rebind(connection);
        try {
          await connection.request("process.attach", params, { onResult } satisfies RequestOptions);
        } catch (e) {
          this.processes.delete(p.id);
          p._onConnectionLost(`it could not be attached again after a reconnect: ${(e as Error).message}`);
        }
      }),
    );
  }

  /** @internal Subscribes (if not yet) and keeps the subscription until released. */
  async _holdSubscription(): Promise<void> {
    this.subscriptionHolds++;
    await this.ensureSubscribed();
  }

  /** @internal */
  _releaseSubscription(): void {
    this.subscriptionHolds = Math.max(0, this.subscriptionHolds - 1);
    if (this.subscriptionHolds === 0 && this.subscription !== null && this.connected) {
      const id = this.subscription;
      this.subscription = null;
      this.call("events.unsubscribe", { subscription: id }).catch(() => undefined);
    }
  }

  private live(): Connection {
    if (this.state === "closed") {
      throw new UnavailableError(`this client of umbrad at ${this.socketPath} was closed`);
    }
    const c = this.connection;
    if (c === null || c.isClosed) {
      throw new UnavailableError(
        `not connected to umbrad at ${this.socketPath} (the connection was lost; ${
          this.reconnect ? "reconnecting" : "reconnection is off"
        }); start it with \`umbrad\` (or \`systemctl --user start umbrad\`)`,
      );
    }
    return c;
  }

  private async ensureSubscribed(): Promise<void> {
    if (this.subscription !== null || this.subscriptionHolds === 0 || !this.connection || this.connection.isClosed) {
      return;
    }
    this.subscribing ??= this.call("events.subscribe", {})
      .then((r) => {
        this.subscription = r.subscription;
      })
      .finally(() => {
        this.subscribing = null;
      });
    await this.subscribing;
  }

  /** One connection attempt: socket, version check, subscription. */
  private async open(signal?: AbortSignal): Promise<void> {
    const connection = await Connection.open(this.socketPath, {
      onNotification: (method, params) => this.onNotification(connection, method, params),
      onClose: (error) => this.onClose(connection, error),
    });
    // Until the handshake is done, a close is this attempt's failure, not a disconnection.
    this.opening = connection;
    try {
      throwIfAborted(signal);
      this.connection = connection;
      const info = (await connection.request("daemon.info", {}, { signal })) as DaemonInfo;
      const theirs = info.api_version.split(".")[0];
      const ours = API_VERSION.split(".")[0];
      if (theirs !== ours) {
        throw new UnsupportedError(
          `umbrad at ${this.socketPath} speaks API ${info.api_version}, and this @umbra/client speaks ${API_VERSION}: ` +
            `use a client for API ${theirs}.x (umbrad ${info.version})`,
        );
      }
      this.info = info;
      this.subscription = null;
      await this.ensureSubscribed();
      if (connection.isClosed) {
        throw new UnavailableError(`the connection to umbrad at ${this.socketPath} closed during the handshake`);
      }
    } catch (e) {
      this.connection = null;
      connection.close(e instanceof UmbraError ? e : undefined);
      throw e;
    } finally {
      this.opening = null;
    }
  }

  private onNotification(from: Connection, method: string, params: unknown): void {
    if (from !== this.connection || typeof params !== "object" || params === null) {
      return;
    }
    switch (method) {
      case "process.event": {
        const event = params as SessionEvent;
        const id = (event as { process?: unknown }).process;
        if (typeof id === "number") {
          this.processes.get(id)?._onEvent(event);
        }
        break;
      }
      case "event": {
        const event = params as SessionEvent;
        // Listeners that throw must not break the connection's reader.
        this.safeEmit(emitterName(event.event), event);
        this.safeEmit("event", event);
        break;
      }
      case "events.lost": {
        const count = (params as { count?: unknown }).count;
        this.safeEmit("events-lost", { count: typeof count === "number" ? count : 0 });
        break;
      }
      default:
        break; // a notification of a newer daemon
    }
  }

  private safeEmit(name: string, arg: unknown): void {
    try {
      (this.emit as (name: string, arg: unknown) => boolean)(name, arg);
    } catch (e) {
      // Surface a listener's exception the way Node does for other async callbacks.
      process.nextTick(() => {
        throw e;
      });
    }
  }

  /** The connection is gone: processes end as lost; detached ones wait for a reconnect. */
  private loseProcesses(why: string, keepDetached = false): void {
    const lost = [...this.processes.values()].filter((p) => !(keepDetached && p.detached));
    for (const p of lost) {
      this.processes.delete(p.id);
      p._onConnectionLost(p.detached ? `${why}; the process runs on in its session: attach to it again` : why);
    }
  }

  private onClose(from: Connection, error: UmbraError): void {
    if (from !== this.connection || from === this.opening) {
      return; // a failed attempt: open() reports it
    }
    this.connection = null;
    this.subscription = null;
    const willReconnect = this.reconnect !== null && this.state !== "closed";
    this.loseProcesses(error.message, willReconnect);
    if (this.state === "closed") {
      return;
    }
    this.state = willReconnect ? "reconnecting" : "closed";
    this.safeEmit("disconnected", { error, willReconnect });
    if (willReconnect) {
      this.scheduleReconnect(1, Date.now());
    }
  }

  private scheduleReconnect(attempt: number, since: number): void {
    const r = this.reconnect!;
    const delay = Math.min(r.maxDelayMs, r.initialDelayMs * 2 ** Math.min(attempt - 1, 16));
    this.reconnectTimer = setTimeout(() => {
      this.reconnectTimer = null;
      if (this.state === "closed") {
        return;
      }
      this.open().then(
        () => {
          if (this.state === "closed") {
            this.connection?.close();
            return;
          }
          this.state = "connected";
          const connection = this.connection;
          if (connection !== null) {
            void this.reattach(connection);
          }
          this.safeEmit("reconnected", { daemon: this.info!, attempts: attempt, downtimeMs: Date.now() - since });
        },
        (error: unknown) => {
          if (this.state === "closed") {
            return;
          }
          if (error instanceof UnsupportedError) {
            // Another major version: retrying will not help.
            this.state = "closed";
            this.loseProcesses(error.message);
            this.safeEmit("disconnected", { error, willReconnect: false });
            return;
          }
          this.scheduleReconnect(attempt + 1, since);
        },
      );
    }, delay);
  }
}
