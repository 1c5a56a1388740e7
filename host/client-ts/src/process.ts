/**
 * A process running in a session, shaped like Node's `ChildProcess`: `stdout` and `stderr` are
 * `Readable` streams under umbrad's flow control, `stdin` is a `Writable` whose writes complete
 * when the guest took them, and `exited` resolves with how it ended.
 */

import { randomUUID } from "node:crypto";
import { Readable, Writable } from "node:stream";

import type { Connection } from "./connection";
import { AbortError, NotFoundError, UmbraError, UnavailableError } from "./errors";
import type { ProcessExit, SessionEvent } from "./generated/types";

/** Stdin writes umbrad queues per process; one more is answered `busy` (docs/ipc.md, ordered stdin). */
export const STDIN_QUEUE = 16;
/** Bytes of stdin per `process.stdin` request. */
const STDIN_PIECE = 64 * 1024;

/** Linux signal numbers by name (the guest is Linux, whatever the host runs). */
export const SIGNALS = {
  SIGHUP: 1,
  SIGINT: 2,
  SIGQUIT: 3,
  SIGILL: 4,
  SIGTRAP: 5,
  SIGABRT: 6,
  SIGBUS: 7,
  SIGFPE: 8,
  SIGKILL: 9,
  SIGUSR1: 10,
  SIGSEGV: 11,
  SIGUSR2: 12,
  SIGPIPE: 13,
  SIGALRM: 14,
  SIGTERM: 15,
  SIGCHLD: 17,
  SIGCONT: 18,
  SIGSTOP: 19,
  SIGTSTP: 20,
  SIGTTIN: 21,
  SIGTTOU: 22,
  SIGWINCH: 28,
} as const;

/** A signal by name (`"SIGTERM"`) or Linux number (15). */
export type Signal = keyof typeof SIGNALS | number;

/** A signal's Linux number. */
export function signalNumber(signal: Signal): number {
  if (typeof signal === "number") {
    return signal;
  }
  const n = SIGNALS[signal];
  if (n === undefined) {
    throw new TypeError(`unknown signal ${JSON.stringify(signal)}`);
  }
  return n;
}

/** A signal's name, when it has one here. */
export function signalName(n: number): keyof typeof SIGNALS | undefined {
  return (Object.keys(SIGNALS) as (keyof typeof SIGNALS)[]).find((k) => SIGNALS[k] === n);
}

/**
 * How a process ended: the daemon's {@link ProcessExit} with every field present, plus the
 * status a shell would report.
 */
export interface ExitInfo extends ProcessExit {
  /** The exit code, when it exited by itself; else `null`. */
  code: number | null;
  /** The signal that ended it, else `null` (9 when its VM went away). */
  signal: number | null;
  /** `signal`'s name (`"SIGKILL"`), when it has one. */
  signalName: keyof typeof SIGNALS | null;
  /** The guest never reported the end: the VM went away, or the connection to umbrad was lost. */
  lost: boolean;
  /** Its timeout passed. */
  timed_out: boolean;
  /** Why it ended, when it did not end by itself (lost, stopped session, lost connection). */
  reason: string | null;
  /**
   * The status a shell would give (`ProcessExit::shell_status`): the code; 128 + signal; 124
   * timed out; 125 lost.
   */
  status: number;
}

/** The status a shell gives an exit (docs/ipc.md, "Exit fields"). */
export function shellStatus(e: Pick<ProcessExit, "code" | "signal" | "lost" | "timed_out" | "interrupted">): number {
  if (e.lost) {
    return 125;
  }
  if (e.timed_out) {
    return 124;
  }
  const own = e.code ?? (e.signal !== null && e.signal !== undefined ? 128 + e.signal : 125);
  return e.interrupted !== null && e.interrupted !== undefined && own !== 0 ? 128 + e.interrupted : own;
}

function exitInfo(event: ProcessExit): ExitInfo {
  // The exit's own fields, without those of the event around it (`event`, `session`, `time_ms`).
  const { event: _kind, session: _session, time_ms: _time, ...e } = event as ProcessExit & {
    event?: unknown;
    session?: unknown;
    time_ms?: unknown;
  };
  const signal = e.signal ?? null;
  return {
    ...e,
    code: e.code ?? null,
    signal,
    signalName: signal === null ? null : (signalName(signal) ?? null),
    lost: e.lost ?? false,
    timed_out: e.timed_out ?? false,
    reason: e.reason ?? null,
    status: shellStatus(e),
  };
}

/** Bytes of a `data` + `encoding` pair. */
export function decodeData(d: { data: string; encoding?: "utf8" | "base64" | null | undefined }): Buffer {
  return d.encoding === "base64" ? Buffer.from(d.data, "base64") : Buffer.from(d.data, "utf8");
}

/**
 * One output stream of a process. umbrad sends at most {@link OUTPUT_WINDOW} bytes ahead of
 * this client's acks; a chunk is acknowledged once the stream took it without going over its
 * `highWaterMark`, else when the consumer asks for more (`_read`). So a consumer that reads
 * slowly slows the process, end to end, and memory stays bounded: at most `highWaterMark` plus
 * one window per stream here, and nothing unbounded in umbrad.
 */
class OutputStream extends Readable {
  /** Bytes taken but not acknowledged, because the consumer is behind. */
  private unacked = 0;

  constructor(private readonly ack: (bytes: number) => void) {
    super();
  }

  deliver(bytes: Buffer): void {
    if (this.destroyed || this.readableEnded) {
      // Nobody will read it: let the process carry on.
      this.ack(bytes.length);
      return;
    }
    if (this.push(bytes)) {
      this.ack(bytes.length);
    } else {
      this.unacked += bytes.length;
    }
  }

  override _read(): void {
    if (this.unacked > 0) {
      const n = this.unacked;
      this.unacked = 0;
      this.ack(n);
    }
  }

  override _destroy(error: Error | null, callback: (error?: Error | null) => void): void {
    // Whatever was held back is released: the consumer gave up on this stream.
    this._read();
    callback(error);
  }
}

/** A process's stdin: writes complete when the guest took them; `end()` closes it. */
class InputStream extends Writable {
  constructor(private readonly proc: UmbraProcess) {
    super({ decodeStrings: true });
  }

  override _write(chunk: Buffer, _encoding: BufferEncoding, callback: (error?: Error | null) => void): void {
    this.proc._sendStdin(chunk).then(() => callback(), callback);
  }

  override _writev(chunks: { chunk: Buffer }[], callback: (error?: Error | null) => void): void {
    this.proc._sendStdin(Buffer.concat(chunks.map((c) => c.chunk))).then(() => callback(), callback);
  }

  override _final(callback: (error?: Error | null) => void): void {
    this.proc._closeStdin().then(() => callback(), callback);
  }
}

/** Where a process came from: internal. */
export interface ProcessOrigin {
  connection: Connection;
  session: string;
  id: number;
  pid: number;
  argv: string[];
  /** Kept by its session when this client goes: re-attached after a reconnect. */
  detached?: boolean;
  /** Where its streams start for this client (an attach from an offset). */
  from?: { stdout: number; stderr: number };
  /**
   * umbrad takes numbered stdin from a named writer (API 1.9): pieces lost with a connection
   * are then sent again. Without it they are not (a resend could repeat bytes).
   */
  numberedStdin?: boolean;
}

/**
 * A process spawned by {@link Session.spawn} (or attached with {@link Session.attach}). Unless
 * spawned with `detach`, it belongs to this client's connection: if the connection is lost
 * (umbrad restarts, say), umbrad kills it and `exited` resolves with `lost: true` and a reason
 * saying so. A detached process is kept by its session: after a reconnect, the client attaches
 * to it again from the last byte it received, and its streams go on where they were.
 */
export class UmbraProcess {
  /** umbrad's id for it (unique while this umbrad runs). */
  readonly id: number;
  /** Its pid in the guest. */
  readonly pid: number;
  /** The session it runs in. */
  readonly session: string;
  /** The command. */
  readonly argv: readonly string[];
  /** Kept by its session when this client goes (`detach`, a terminal). */
  readonly detached: boolean;
  /** Its standard output (with `tty`, everything the terminal shows). Consume it, or `resume()` it: a full stream pauses the process. */
  readonly stdout: Readable;
  /** Its standard error (empty with `tty`). */
  readonly stderr: Readable;
  /** Its standard input: `write()` completes when the guest took the bytes, `end()` closes it. */
  readonly stdin: Writable;
  /** Resolves once it ended, with how; never rejects. Its output may still be buffered in `stdout`/`stderr`. */
  readonly exited: Promise<ExitInfo>;

  private connection: Connection;
  /** Where each stream's next byte is, for a detached process (to attach again from there). */
  private readonly received: { stdout: number; stderr: number };
  /** Bytes umbrad no longer kept when this client (re)attached: never delivered. */
  private readonly skipped = { stdout: 0, stderr: 0 };
  /**
   * This client's stream of stdin to it (`process.stdin`'s `writer`, a random name, and
   * `offset`, where the next byte falls in it), when umbrad numbers stdin; else `null`.
   */
  private readonly stdinWriter: string | null;
  private stdinNext = 0;
  /** Bumped at each re-attach after a lost connection; a write that failed before it is sent again. */
  private attachment = 0;
  private reattached: Array<(again: boolean) => void> = [];
  private readonly out: OutputStream;
  private readonly err: OutputStream;
  private readonly started = Date.now();
  private exit: ExitInfo | null = null;
  private resolveExit!: (e: ExitInfo) => void;

  /** @internal Use {@link Session.spawn}. */
  constructor(origin: ProcessOrigin) {
    this.connection = origin.connection;
    this.id = origin.id;
    this.pid = origin.pid;
    this.session = origin.session;
    this.argv = Object.freeze([...origin.argv]);
    this.detached = origin.detached ?? false;
    this.received = { stdout: origin.from?.stdout ?? 0, stderr: origin.from?.stderr ?? 0 };
    this.stdinWriter = origin.numberedStdin ? randomUUID() : null;
    const ack = (stream: "stdout" | "stderr") => (bytes: number) => {
      if (this.exit === null && bytes > 0) {
        this.connection.notify("process.ack", { session: this.session, process: this.id, stream, bytes });
      }
    };
    this.out = new OutputStream(ack("stdout"));
    this.err = new OutputStream(ack("stderr"));
    this.stdout = this.out;
    this.stderr = this.err;
    this.stdin = new InputStream(this);
    this.exited = new Promise((resolve) => {
      this.resolveExit = resolve;
    });
  }

  /** How it ended, once it did; `null` while it runs. */
  get exitInfo(): ExitInfo | null {
    return this.exit;
  }

  /** Whether it is still running (as far as this client knows). */
  get running(): boolean {
    return this.exit === null;
  }

  /**
   * Sends `signal` (default SIGTERM) to its process group, once. A process that already ended
   * is not an error.
   */
  async kill(signal: Signal = "SIGTERM"): Promise<void> {
    const n = signalNumber(signal);
    if (this.exit !== null) {
      return;
    }
    try {
      await this.connection.request("process.kill", { session: this.session, process: this.id, signal: n });
    } catch (e) {
      if (!(e instanceof NotFoundError && this.exit !== null)) {
        throw e;
      }
    }
  }

  /** Resizes its terminal (only for a process spawned with `tty`). */
  async resize(cols: number, rows: number): Promise<void> {
    await this.connection.request("process.resize", { session: this.session, process: this.id, cols, rows });
  }

  /**
   * Waits for it to end, like `exited`, but gives up when `signal` fires (rejecting with an
   * AbortError; the process keeps running: `kill()` it if that is what you want).
   */
  wait(options: { signal?: AbortSignal } = {}): Promise<ExitInfo> {
    const { signal } = options;
    if (!signal) {
      return this.exited;
    }
    if (signal.aborted) {
      return Promise.reject(new AbortError("waiting for the process was aborted", { cause: signal.reason }));
    }
    return new Promise((resolve, reject) => {
      const onAbort = () => reject(new AbortError("waiting for the process was aborted", { cause: signal.reason }));
      signal.addEventListener("abort", onAbort, { once: true });
      void this.exited.then((e) => {
        signal.removeEventListener("abort", onAbort);
        resolve(e);
      });
    });
  }

  /** Bytes of each stream received so far (for a detached process: offsets since it started). */
  get offsets(): { stdout: number; stderr: number } {
    return { ...this.received };
  }

  /**
   * Bytes of each stream this client never received: a detached process's output is kept up to
   * 1 MiB per stream, and what went before that when this client (re)attached is gone. Each such
   * gap is also a `gap` event on the stream, `{ from, to }` (offsets since the process started).
   */
  get missed(): { stdout: number; stderr: number } {
    return { ...this.skipped };
  }

  /** @internal A `process.event` of this process. */
  _onEvent(event: SessionEvent): void {
    switch (event.event) {
      case "stdout":
      case "stderr": {
        let bytes = decodeData(event);
        const stream = event.event;
        const offset = (event as { offset?: number | null }).offset;
        if (typeof offset === "number" && offset > this.received[stream]) {
          // umbrad no longer keeps what lies between: say so, rather than splice the stream.
          const gap = { from: this.received[stream], to: offset };
          this.skipped[stream] += gap.to - gap.from;
          this.received[stream] = offset;
          (stream === "stdout" ? this.out : this.err).emit("gap", gap);
        }
        if (typeof offset === "number") {
          // A re-attach may replay what this client already has: only the rest is new.
          const skip = Math.min(Math.max(0, this.received[stream] - offset), bytes.length);
          if (skip > 0) {
            this.connection.notify("process.ack", { session: this.session, process: this.id, stream, bytes: skip });
            bytes = bytes.subarray(skip);
          }
          this.received[stream] = Math.max(this.received[stream], offset + skip + bytes.length);
        } else {
          this.received[stream] += bytes.length;
        }
        if (bytes.length > 0) {
          (stream === "stdout" ? this.out : this.err).deliver(bytes);
        }
        break;
      }
      case "exit":
        this.finish(exitInfo(event));
        break;
      default:
        break;
    }
  }

  /** @internal A detached process, attached again on a new connection. */
  _rebind(connection: Connection): void {
    this.connection = connection;
    this.attachment++;
    for (const wake of this.reattached.splice(0)) {
      wake(true);
    }
  }

  /**
   * After a request failed at `attachment` because the connection was lost: whether to send
   * it again (a detached process attached again since, or once it is), or give up.
   */
  private async sendAgain(error: unknown, attachment: number): Promise<boolean> {
    if (!(error instanceof UnavailableError) || !this.detached || this.exit !== null || this.stdinWriter === null) {
      return false;
    }
    if (this.attachment !== attachment) {
      return true;
    }
    return new Promise((resolve) => this.reattached.push(resolve));
  }

  /** @internal The connection this process belonged to was lost. */
  _onConnectionLost(why: string): void {
    this.finish(
      exitInfo({
        process: this.id,
        code: null,
        signal: null,
        duration_ms: Date.now() - this.started,
        lost: true,
        timed_out: false,
        reason: this.detached
          ? `this client's view of the detached process ended: ${why}`
          : `the connection to umbrad was lost before the process ended: ${why}; a process ends with the connection that spawned it`,
      }),
    );
  }

  private finish(e: ExitInfo): void {
    if (this.exit !== null) {
      return;
    }
    this.exit = e;
    for (const wake of this.reattached.splice(0)) {
      wake(false);
    }
    this.out.push(null);
    this.err.push(null);
    // Writes after the end fail quietly, as they would on a closed pipe with nobody listening.
    if (!this.stdin.writableFinished) {
      this.stdin.destroy();
    }
    this.resolveExit(e);
  }

  /**
   * @internal Sends stdin in pieces, at most {@link STDIN_QUEUE} unanswered at once, in order.
   * Each piece says where it falls in the stream (`offset`), so that a detached process's
   * pieces lost with a connection are sent again once the client has attached again, and
   * umbrad writes each byte once.
   */
  _sendStdin(bytes: Buffer): Promise<void> {
    if (this.exit !== null) {
      return Promise.reject(new NotFoundError(`process ${this.id} has ended; its stdin is closed`));
    }
    const pieces: { data: Buffer; offset: number }[] = [];
    for (let at = 0; at < bytes.length; at += STDIN_PIECE) {
      const data = bytes.subarray(at, at + STDIN_PIECE);
      pieces.push({ data, offset: this.stdinNext });
      this.stdinNext += data.length;
    }
    if (pieces.length === 0) {
      return Promise.resolve();
    }
    return new Promise((resolve, reject) => {
      const answered = new Array<boolean>(pieces.length).fill(false);
      let answeredCount = 0;
      let next = 0;
      let inFlight = 0;
      let failed = false;
      // The first failure of a round, acted on once every request of the round has settled.
      let failure: { error: unknown; attachment: number } | null = null;
      let waiting = false;
      const settle = () => {
        if (failure === null || inFlight > 0 || waiting) {
          return;
        }
        const { error, attachment } = failure;
        waiting = true;
        void this.sendAgain(error, attachment).then((again) => {
          waiting = false;
          failure = null;
          if (!again) {
            failed = true;
            reject(error instanceof Error ? error : new UmbraError(String(error)));
            return;
          }
          // From the first piece not answered: umbrad skips what it already took.
          next = answered.indexOf(false);
          pump();
        });
      };
      const pump = () => {
        while (!failed && failure === null && inFlight < STDIN_QUEUE && next < pieces.length) {
          const index = next++;
          const piece = pieces[index]!;
          const attachment = this.attachment;
          inFlight++;
          const params: Record<string, unknown> = {
            session: this.session,
            process: this.id,
            data: piece.data.toString("base64"),
            encoding: "base64",
          };
          if (this.stdinWriter !== null) {
            params.writer = this.stdinWriter;
            params.offset = piece.offset;
          }
          this.connection.request("process.stdin", params).then(
            () => {
              inFlight--;
              if (!answered[index]) {
                answered[index] = true;
                answeredCount++;
              }
              if (answeredCount === pieces.length) {
                resolve();
              } else if (failure !== null) {
                settle();
              } else {
                pump();
              }
            },
            (error: unknown) => {
              inFlight--;
              if (failed) {
                return;
              }
              failure ??= { error, attachment };
              settle();
            },
          );
        }
      };
      pump();
    });
  }

  /** @internal Closes stdin after everything written before. */
  async _closeStdin(): Promise<void> {
    if (this.exit !== null) {
      return;
    }
    for (;;) {
      const attachment = this.attachment;
      try {
        await this.connection.request("process.close_stdin", { session: this.session, process: this.id });
        return;
      } catch (e) {
        if (e instanceof NotFoundError) {
          return;
        }
        if (!(await this.sendAgain(e, attachment))) {
          throw e;
        }
      }
    }
  }
}
