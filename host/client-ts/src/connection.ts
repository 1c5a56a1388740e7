/**
 * One connection to umbrad: JSON-RPC 2.0, one JSON value per line each way. Requests get an id
 * and wait for their response; notifications (`process.ack`) get none; lines from umbrad without
 * an `id` are notifications and go to `onNotification`. Internal: the public API is
 * {@link Umbra}.
 */

import * as fs from "node:fs";
import * as net from "node:net";
import * as path from "node:path";

import { AbortError, UmbraError, UnauthorizedError, UnavailableError, errorFromRpc } from "./errors";

/** Longest line accepted from umbrad (a 1 MiB file read is about 1.4 MiB of base64). */
const MAX_LINE = 8 << 20;

/** What a connection tells its owner. */
export interface ConnectionHandlers {
  onNotification(method: string, params: unknown): void;
  /** The connection ended (for whatever reason, `close()` included); called once. */
  onClose(error: UmbraError): void;
}

/** Options of one request. */
export interface RequestOptions {
  /** Stops waiting (the promise rejects with an AbortError); umbrad still carries the call out. */
  signal?: AbortSignal | undefined;
  /**
   * Runs synchronously when the result arrives, before any later line is handled: a spawn
   * registers its process here, so the process's events that follow find it.
   */
  onResult?: ((result: unknown) => void) | undefined;
}

interface Pending {
  method: string;
  resolve(value: unknown): void;
  reject(error: Error): void;
  onResult: ((result: unknown) => void) | undefined;
  cleanup: (() => void) | undefined;
}

/** Describes a socket error for a person. */
function describe(error: unknown): string {
  if (error instanceof Error) {
    const code = (error as NodeJS.ErrnoException).code;
    return code && !error.message.includes(code) ? `${code}: ${error.message}` : error.message;
  }
  return String(error);
}

/** The error for a daemon that cannot be reached at `socketPath`. */
export function unreachable(socketPath: string, why: string, cause?: unknown): UnavailableError {
  return new UnavailableError(
    `umbrad is not reachable at ${socketPath} (${why}); start it with \`umbrad\` (or \`systemctl --user start umbrad\`)`,
    cause === undefined ? {} : { cause },
  );
}

/**
 * Who serves `socketPath`, as far as Node can tell without a native addon: Node exposes no
 * `SO_PEERCRED`, so the server's uid cannot be read from the connection. Instead the socket's
 * directory must be a real directory (not a symlink) owned by our uid with mode 0700, and the
 * socket a socket (not a symlink) owned by our uid. No other user (root aside) can then have
 * put a socket there, nor swap it before the connect. Resolves when the checks pass; rejects
 * with an {@link UnauthorizedError} saying what failed, or an {@link UnavailableError} when there
 * is no socket. Where the platform has no uids (`process.geteuid` missing), checks nothing.
 */
export async function checkSocket(socketPath: string): Promise<void> {
  const uid = typeof process.geteuid === "function" ? process.geteuid() : undefined;
  if (uid === undefined) {
    return;
  }
  const refuse = (why: string) =>
    new UnauthorizedError(`refusing to connect to ${socketPath}: ${why} (another user could pose as umbrad)`);
  const dir = path.dirname(path.resolve(socketPath));
  let dirStat: fs.Stats;
  try {
    dirStat = await fs.promises.lstat(dir);
  } catch (error) {
    throw unreachable(socketPath, describe(error), error);
  }
  if (dirStat.isSymbolicLink()) {
    throw refuse(`its directory ${dir} is a symlink`);
  }
  if (!dirStat.isDirectory()) {
    throw refuse(`${dir} is not a directory`);
  }
  if (dirStat.uid !== uid) {
    throw refuse(`its directory ${dir} belongs to uid ${dirStat.uid}, not to uid ${uid}`);
  }
  if ((dirStat.mode & 0o777) !== 0o700) {
    throw refuse(`its directory ${dir} has mode ${(dirStat.mode & 0o7777).toString(8).padStart(4, "0")}, not 0700`);
  }
  let sockStat: fs.Stats;
  try {
    sockStat = await fs.promises.lstat(socketPath);
  } catch (error) {
    throw unreachable(socketPath, describe(error), error);
  }
  if (sockStat.isSymbolicLink()) {
    throw refuse("it is a symlink");
  }
  if (!sockStat.isSocket()) {
    throw refuse("it is not a socket");
  }
  if (sockStat.uid !== uid) {
    throw refuse(`it belongs to uid ${sockStat.uid}, not to uid ${uid}`);
  }
}

export class Connection {
  private readonly pending = new Map<number, Pending>();
  private nextId = 1;
  private partial: Buffer[] = [];
  private partialBytes = 0;
  private ended = false;
  /** Why the connection ends, once known (an error line umbrad sent before closing, say). */
  private closeReason: UmbraError | undefined;
  private resolveClosed!: () => void;
  /** Resolves once the connection has ended. */
  readonly closed: Promise<void> = new Promise((resolve) => {
    this.resolveClosed = resolve;
  });

  private constructor(
    private readonly socket: net.Socket,
    readonly socketPath: string,
    private readonly handlers: ConnectionHandlers,
  ) {
    socket.on("data", (data: Buffer) => this.onData(data));
    socket.on("error", (error) => {
      this.closeReason ??= unreachable(socketPath, `the connection failed: ${describe(error)}`, error);
    });
    socket.on("close", () => this.finish());
  }

  /**
   * Connects to `socketPath` once {@link checkSocket} passes; rejects with an
   * {@link UnavailableError} saying how to start umbrad, or an {@link UnauthorizedError}.
   */
  static async open(socketPath: string, handlers: ConnectionHandlers): Promise<Connection> {
    // Before a byte goes out: who could have made this socket.
    await checkSocket(socketPath);
    return new Promise((resolve, reject) => {
      const socket = net.createConnection({ path: socketPath });
      const onError = (error: NodeJS.ErrnoException) => {
        socket.destroy();
        if (error.code === "EACCES") {
          reject(
            new UmbraError(`may not connect to umbrad at ${socketPath} (${describe(error)}): it serves only its own user`, {
              code: "unauthorized",
              cause: error,
            }),
          );
        } else {
          reject(unreachable(socketPath, describe(error), error));
        }
      };
      socket.once("error", onError);
      socket.once("connect", () => {
        socket.off("error", onError);
        resolve(new Connection(socket, socketPath, handlers));
      });
    });
  }

  get isClosed(): boolean {
    return this.ended;
  }

  /** Calls `method` and resolves with its result (rejects with the daemon's error as an {@link UmbraError}). */
  request(method: string, params: object, options: RequestOptions = {}): Promise<unknown> {
    const { signal, onResult } = options;
    if (signal?.aborted) {
      return Promise.reject(new AbortError(`${method} was aborted`, { cause: signal.reason }));
    }
    if (this.ended) {
      return Promise.reject(this.lostError());
    }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      let cleanup: (() => void) | undefined;
      if (signal) {
        const onAbort = () => {
          if (this.pending.delete(id)) {
            reject(new AbortError(`${method} was aborted`, { cause: signal.reason }));
          }
        };
        signal.addEventListener("abort", onAbort, { once: true });
        cleanup = () => signal.removeEventListener("abort", onAbort);
      }
      this.pending.set(id, { method, resolve, reject, onResult, cleanup });
      this.write({ jsonrpc: "2.0", id, method, params });
    });
  }

  /** Sends `method` as a notification: no response comes, not even an error. */
  notify(method: string, params: object): void {
    if (!this.ended) {
      this.write({ jsonrpc: "2.0", method, params });
    }
  }

  /** Closes the connection; pending calls fail with `reason`. */
  close(reason?: UmbraError): void {
    if (reason) {
      this.closeReason ??= reason;
    }
    this.socket.destroy();
  }

  private lostError(): UmbraError {
    return (
      this.closeReason ??
      new UnavailableError(
        `umbrad at ${this.socketPath} closed the connection (it stopped or restarted)`,
      )
    );
  }

  private write(message: object): void {
    this.socket.write(JSON.stringify(message) + "\n");
  }

  private onData(data: Buffer): void {
    let start = 0;
    let newline = data.indexOf(10, start);
    while (newline !== -1) {
      let line: Buffer;
      if (this.partial.length > 0) {
        this.partial.push(data.subarray(start, newline));
        line = Buffer.concat(this.partial);
        this.partial = [];
        this.partialBytes = 0;
      } else {
        line = data.subarray(start, newline);
      }
      this.onLine(line);
      if (this.ended) {
        return;
      }
      start = newline + 1;
      newline = data.indexOf(10, start);
    }
    if (start < data.length) {
      this.partial.push(data.subarray(start));
      this.partialBytes += data.length - start;
      if (this.partialBytes > MAX_LINE) {
        this.close(new UmbraError(`umbrad sent a line longer than ${MAX_LINE} bytes`, { code: "invalid_request" }));
      }
    }
  }

  private onLine(line: Buffer): void {
    const text = line.toString("utf8");
    if (text.trim() === "") {
      return;
    }
    let message: unknown;
    try {
      message = JSON.parse(text);
    } catch (error) {
      this.close(new UmbraError(`umbrad sent a line that is not JSON: ${describe(error)}`, { code: "parse_error" }));
      return;
    }
    const messages = Array.isArray(message) ? message : [message];
    for (const m of messages) {
      if (typeof m !== "object" || m === null) {
        continue;
      }
      const o = m as { id?: unknown; method?: unknown; params?: unknown; result?: unknown; error?: unknown };
      if (typeof o.method === "string" && (o.id === undefined || o.id === null)) {
        this.handlers.onNotification(o.method, o.params);
      } else if (typeof o.id === "number") {
        this.onResponse(o.id, o.result, o.error);
      } else if (o.error !== undefined) {
        // `"id": null`: about the connection, not a call (a refused client, too many clients,
        // or a line of ours umbrad could not read). umbrad closes the connection after a refusal.
        const error = errorFromRpc(o.error);
        if (error.code === "unauthorized" || error.code === "busy") {
          this.closeReason ??= error;
        }
      }
    }
  }

  private onResponse(id: number, result: unknown, error: unknown): void {
    const p = this.pending.get(id);
    if (!p) {
      return; // aborted by the caller
    }
    this.pending.delete(id);
    p.cleanup?.();
    if (error !== undefined && error !== null) {
      p.reject(errorFromRpc(error, p.method));
      return;
    }
    try {
      p.onResult?.(result);
    } catch (e) {
      p.reject(e instanceof Error ? e : new Error(String(e)));
      return;
    }
    p.resolve(result ?? {});
  }

  private finish(): void {
    if (this.ended) {
      return;
    }
    this.ended = true;
    const error = this.lostError();
    const waiting = [...this.pending.values()];
    this.pending.clear();
    for (const p of waiting) {
      p.cleanup?.();
      p.reject(error);
    }
    this.resolveClosed();
    this.handlers.onClose(error);
  }
}
