/**
 * A session: a microVM with its folders, processes and disk, under a name. {@link Session} is a
 * handle by name (cheap to make, nothing is held open); `info` is the state last fetched.
 */

import { type CallOptions, type CamelCased, toWire } from "./options";
import { AbortError, throwIfAborted } from "./errors";
import type {
  DirList,
  MethodName,
  Methods,
  Exported,
  ExposeParams,
  FileStat,
  FolderInfo,
  ForChange,
  LspServerInfo,
  FolderSpec,
  NetworkPolicy,
  PortInfo,
  ProcessInfo,
  SecretSpec,
  TerminalInfo,
  TerminalRunResult,
  ResumeParams,
  SessionInfo,
  SessionLogs,
  SessionStatus,
  SettingsPatch,
  Updated,
  WriteParams,
  ShadowApplyReport,
  ShadowDiffResult,
  ShareMode,
} from "./generated/types";
import { MAX_FILE_CHUNK } from "./generated/types";
import { decodeData, type ExitInfo, type Signal, signalNumber, UmbraProcess } from "./process";

/** Options of {@link Session.resume} and `Sessions.resume`. */
export interface ResumeOptions {
  /** Aborting stops waiting and cancels the boot (`session.stop`). */
  signal?: AbortSignal;
  /**
   * Deletes the session's snapshot and boots it from its disk instead: for a snapshot this host
   * cannot restore (another umbra version, another CPU). What its memory held is lost; the
   * disk, outputs, uploads and folders stay.
   */
  discardSnapshot?: boolean;
}

/** @internal The `session.resume` params for `options`. */
export function resumeParams(name: string, options: ResumeOptions): ResumeParams {
  return options.discardSnapshot ? { name, discard_snapshot: true } : { name };
}

/** Options of {@link Session.spawn}. */
export interface SpawnOptions {
  /** Working directory in the guest (absolute). */
  cwd?: string;
  /** Variables added to the guest's environment. */
  env?: Record<string, string>;
  /**
   * Run on a pseudo-terminal: `true` for 80×24, or its size. Output then all arrives on
   * `stdout`, with the terminal's `\r\n`.
   */
  tty?: boolean | { cols: number; rows: number };
  /** SIGTERM after this many seconds, SIGKILL 3 s later; the exit then says `timed_out`. */
  timeoutSecs?: number;
  /**
   * Keep the process when this client goes: its session holds its output (bounded) and exit,
   * this client attaches to it again after a reconnect, and any client can
   * {@link Session.attach} to it.
   */
  detach?: boolean;
}

/** Options of {@link Session.openTerminal}. */
export interface TerminalOptions {
  /** Its size (default 80×24). */
  size?: { cols: number; rows: number };
  /** The shell's argv (default a login shell: bash where the image has it, else sh). */
  shell?: string[];
  /** Its working directory in the guest. */
  cwd?: string;
  env?: Record<string, string>;
}

/**
 * A terminal: a shell on a pseudo-terminal that its session keeps when this client goes.
 * `process.stdout` is what it shows; `write()` types into it.
 */
export class Terminal {
  /** @internal Use {@link Session.openTerminal} or {@link Session.attachTerminal}. */
  constructor(
    private readonly s: Session,
    /** The shell's process: its `stdout` is the terminal's output, its `exited` the shell's end. */
    readonly process: UmbraProcess,
  ) {}

  /** The terminal's id (a process id). */
  get id(): number {
    return this.process.id;
  }

  /** Types `data` into the terminal. */
  write(data: string | Uint8Array): Promise<void> {
    return new Promise((resolve, reject) =>
      this.process.stdin.write(typeof data === "string" ? Buffer.from(data) : data, (e) => (e ? reject(e) : resolve())),
    );
  }

  /**
   * Runs a command line in the terminal's shell, as if typed (so `cd` and variables stay);
   * resolves with its exit code and the shell's working directory after it. Its output goes to
   * the terminal like any other.
   */
  async run(command: string, options: { timeoutSecs?: number } = {}): Promise<TerminalRunResult> {
    return this.s.client.call("terminal.run", {
      session: this.s.name,
      terminal: this.id,
      command,
      ...(options.timeoutSecs === undefined ? {} : { timeout_secs: options.timeoutSecs }),
    });
  }

  async resize(cols: number, rows: number): Promise<void> {
    await this.s.client.call("terminal.resize", { session: this.s.name, terminal: this.id, cols, rows });
  }

  /** Closes it: the shell gets SIGHUP (SIGKILL 3 s later). */
  async close(): Promise<void> {
    await this.s.client.call("terminal.close", { session: this.s.name, terminal: this.id });
  }
}

/** Options of {@link Session.exec}. */
export interface ExecOptions extends SpawnOptions {
  /** Written to its stdin, which is then closed (without it, stdin is closed at once). */
  input?: string | Uint8Array;
  /** Kills the process (SIGKILL) and rejects with an AbortError when it fires. */
  signal?: AbortSignal;
}

/** What {@link Session.exec} gives: all the output, and how it ended. */
export interface ExecResult {
  stdout: Buffer;
  stderr: Buffer;
  exit: ExitInfo;
}

/** Where a path is: by default a guest path; with `host`, a host path inside a shared folder. */
export interface PathOptions {
  /** `path` is a host path inside one of the session's shared folders (outputs and uploads included), translated to its guest path. */
  host?: boolean;
}

/** Options of {@link SessionFiles.read}. */
export interface ReadOptions extends PathOptions {
  /** Where to start. @defaultValue 0 */
  offset?: number;
  /** At most this many bytes (default: to the end of the file). */
  length?: number;
  /** Stops reading (between chunks of 1 MiB) and rejects with an AbortError. */
  signal?: AbortSignal;
}

/** Options of {@link SessionFiles.write}. */
export interface WriteOptions extends PathOptions {
  /** Append instead of replacing the file. */
  append?: boolean;
  /** Write at this offset instead (the file is not truncated). */
  offset?: number;
  /** Create missing parent directories. */
  createDirs?: boolean;
  /** Permission bits of a file this creates. @defaultValue 0o644 */
  mode?: number;
  /** Stops writing (between chunks of 1 MiB) and rejects with an AbortError. */
  signal?: AbortSignal;
}

/** A folder to share: a host directory, the mode, and the name under `/sessions/<session>/mnt/`. */
export interface FolderOptions {
  /** Absolute host path of a directory. */
  path: string;
  /** `ro`, `rw` (no deletes), `rwd` or `shadow` (copy-on-write in the guest). @defaultValue "rw" */
  mode?: ShareMode;
  /** Its name in the guest (default: the folder's own name). */
  name?: string;
}

/** The wire form of a folder. */
export function folderSpec(f: FolderOptions): FolderSpec {
  const spec: FolderSpec = { path: f.path };
  if (f.mode !== undefined) {
    spec.mode = f.mode;
  }
  if (f.name !== undefined) {
    spec.name = f.name;
  }
  return spec;
}

/** Files in the session, through its guest agent (`file.*`). */
export class SessionFiles {
  /** @internal */
  constructor(private readonly s: Session) {}

  /** Reads a file (or part of it) as bytes. */
  read(path: string, options?: ReadOptions & { encoding?: undefined }): Promise<Buffer>;
  /** Reads a file (or part of it) as text. */
  read(path: string, options: ReadOptions & { encoding: BufferEncoding }): Promise<string>;
  async read(path: string, options: ReadOptions & { encoding?: BufferEncoding | undefined } = {}): Promise<Buffer | string> {
    const { host = false, offset = 0, length, signal, encoding } = options;
    const parts: Buffer[] = [];
    let at = offset;
    let left = length ?? Number.POSITIVE_INFINITY;
    while (left > 0) {
      throwIfAborted(signal);
      const len = Math.min(left, MAX_FILE_CHUNK);
      const r = await this.s.client.call(
        "file.read",
        { session: this.s.name, path, host, offset: at, len },
        { signal },
      );
      const bytes = decodeData(r);
      parts.push(bytes);
      at += bytes.length;
      left -= bytes.length;
      if (r.eof || bytes.length === 0) {
        break;
      }
    }
    const all = Buffer.concat(parts);
    return encoding === undefined ? all : all.toString(encoding);
  }

  /**
   * Writes a file: replaces it by default, appends with `append`, or writes at `offset`. Data
   * larger than 1 MiB goes in several requests. Resolves with the bytes written.
   */
  async write(path: string, data: string | Uint8Array, options: WriteOptions = {}): Promise<number> {
    const { host = false, append = false, offset, createDirs = false, mode, signal } = options;
    const bytes = typeof data === "string" ? Buffer.from(data, "utf8") : Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    let written = 0;
    do {
      throwIfAborted(signal);
      const piece = bytes.subarray(written, written + MAX_FILE_CHUNK);
      const params: WriteParams = {
        session: this.s.name,
        path,
        host,
        data: piece.toString("base64"),
        encoding: "base64",
        create_dirs: createDirs,
      };
      if (mode !== undefined) {
        params.permissions = mode;
      }
      // The first piece replaces, appends or writes at `offset`; the rest continue after it.
      if (offset !== undefined) {
        params.offset = offset + written;
      } else if (append) {
        params.append = true;
      } else if (written > 0) {
        params.offset = written;
      }
      const r = await this.s.client.call("file.write", params, { signal });
      written += r.bytes;
      if (r.bytes === 0 && piece.length > 0) {
        break;
      }
    } while (written < bytes.length);
    return written;
  }

  /** A file's metadata. */
  stat(path: string, options: PathOptions = {}): Promise<FileStat> {
    return this.s.client.call("file.stat", { session: this.s.name, path, host: options.host ?? false });
  }

  /** A directory's entries (`truncated` when there were more than `limit`, default 10000). */
  list(path: string, options: PathOptions & { limit?: number } = {}): Promise<DirList> {
    return this.s.client.call("file.list", {
      session: this.s.name,
      path,
      host: options.host ?? false,
      ...(options.limit === undefined ? {} : { limit: options.limit }),
    });
  }
}

/** Folders shared with the session (`folder.*`). */
export class SessionFolders {
  /** @internal */
  constructor(private readonly s: Session) {}

  /** Shares another host folder with the running session (kept across restarts and resumes). */
  mount(folder: FolderOptions): Promise<FolderInfo> {
    return this.s.client.call("folder.mount", { session: this.s.name, ...folderSpec(folder) });
  }

  /** Stops sharing a folder (a shadow folder's unapplied changes are exported first). */
  async unmount(name: string): Promise<void> {
    await this.s.client.call("folder.unmount", { session: this.s.name, name });
  }

  /** The folders it has (or will have when resumed): the user's, then `outputs` and `uploads`. */
  async list(): Promise<FolderInfo[]> {
    return (await this.s.refresh()).folders;
  }
}

/** Shadow folders: changes that stay in the guest until the host applies them (`shadow.*`). */
export class SessionShadow {
  /** @internal */
  constructor(private readonly s: Session) {}

  /**
   * What the guest changed in shadow folder `folder`, captured on the host as a change-set:
   * each entry's kind, size, SHA-256 and risks (`git`, `git_hook`, `dotfile`, `executable`,
   * `symlink`, `special`, `ignored`), and whether an apply writes it (`applies`).
   */
  diff(folder: string): Promise<ShadowDiffResult> {
    return this.s.client.call("shadow.diff", { session: this.s.name, folder });
  }

  /**
   * Writes change-set `changeset` (from {@link SessionShadow.diff}) to the host folder: exactly
   * the bytes the diff captured, file by file; paths the host changed meanwhile are left alone
   * (`conflicts`). `paths` applies only those entries; `.git` and ignored paths are applied only
   * when named there (never under the policy's `block_git_writes`), symlinks never (`skipped`).
   */
  apply(folder: string, changeset: string, options: { paths?: string[] } = {}): Promise<ShadowApplyReport> {
    return this.s.client.call("shadow.apply", {
      session: this.s.name,
      folder,
      changeset,
      ...(options.paths === undefined ? {} : { paths: options.paths }),
    });
  }

  /** Throws the changes away. */
  async reset(folder: string): Promise<void> {
    await this.s.client.call("shadow.reset", { session: this.s.name, folder });
  }

  /** Writes the changes to a tar on the host (`dest`, absolute; default: in the session's storage). */
  export(folder: string, options: { dest?: string } = {}): Promise<Exported> {
    return this.s.client.call("shadow.export", {
      session: this.s.name,
      folder,
      ...(options.dest === undefined ? {} : { dest: options.dest }),
    });
  }
}

/**
 * Language servers in the guest (`lsp.*`) and the diagnostics a proposed change would bring
 * (`diagnostics.for_change`): docs/diagnostics.md.
 */
export class SessionLanguages {
  /** @internal */
  constructor(private readonly s: Session) {}

  /**
   * Starts a language server on folder `folder` and initializes it: `language` (`python`: pylsp,
   * `c` or `cpp`: clangd, as the standard image carries them) or a `command` of your own. Its
   * notifications arrive as `lsp_notification` events of the session.
   */
  async start(
    folder: string,
    options: { language?: string; command?: readonly string[]; initializationOptions?: unknown } = {},
  ): Promise<LanguageServer> {
    const info = await this.s.client.call("lsp.start", {
      session: this.s.name,
      folder,
      ...(options.language === undefined ? {} : { language: options.language }),
      ...(options.command === undefined ? {} : { command: [...options.command] }),
      ...(options.initializationOptions === undefined ? {} : { initialization_options: options.initializationOptions }),
    });
    return new LanguageServer(this.s, info);
  }

  /** The session's running language servers. */
  async list(): Promise<LspServerInfo[]> {
    return (await this.s.client.call("lsp.list", { session: this.s.name })).servers;
  }

  /**
   * The diagnostics `changes` (path in the folder → new content, or `null` to delete) would
   * bring (`diagnostics`) and take away (`resolved`). Nothing is written: the folder and its
   * shadow stay as they are. Concurrent calls are independent.
   */
  forChange(
    folder: string,
    changes: Record<string, string | null>,
    options: { language?: string; timeoutMs?: number } = {},
  ): Promise<ForChange> {
    return this.s.client.call("diagnostics.for_change", {
      session: this.s.name,
      folder,
      changes,
      ...(options.language === undefined ? {} : { language: options.language }),
      ...(options.timeoutMs === undefined ? {} : { timeout_ms: options.timeoutMs }),
    });
  }
}

/** A language server started with {@link SessionLanguages.start}. */
export class LanguageServer {
  /** @internal */
  constructor(
    private readonly s: Session,
    /** What `lsp.start` answered: its id, root, command and `initialize` result. */ readonly info: LspServerInfo,
  ) {}

  /** Its id (`lsp_notification` events name it as `server`). */
  get id(): number {
    return this.info.server;
  }

  /** An LSP request (`textDocument/definition`, ...): the server's result; its error answer throws. */
  async request(method: string, params: unknown, options: { timeoutMs?: number } = {}): Promise<unknown> {
    const answer = await this.s.client.call("lsp.request", {
      session: this.s.name,
      server: this.info.server,
      method,
      params,
      ...(options.timeoutMs === undefined ? {} : { timeout_ms: options.timeoutMs }),
    });
    return answer.result;
  }

  /** An LSP notification (`textDocument/didOpen`, `textDocument/didChange`, ...). */
  async notify(method: string, params: unknown): Promise<void> {
    await this.s.client.call("lsp.notify", { session: this.s.name, server: this.info.server, method, params });
  }

  /** Shuts it down (`shutdown`, `exit`; killed if it lingers). */
  async stop(): Promise<void> {
    await this.s.client.call("lsp.stop", { session: this.s.name, server: this.info.server });
  }
}

/**
 * @internal What a session asks of the client that made it: `Umbra` is one. Declared here so
 * this module does not import the client's (which imports this one).
 */
export interface SessionClient {
  call<M extends MethodName>(method: M, params: Methods[M]["params"], options?: CallOptions): Promise<Methods[M]["result"]>;
  _spawn(session: string, argv: readonly string[], options: SpawnOptions): Promise<UmbraProcess>;
  _attach(
    session: string,
    method: "process.attach" | "terminal.attach" | "terminal.open",
    params: Record<string, unknown>,
    argv?: readonly string[],
  ): Promise<{ proc: UmbraProcess; result: unknown }>;
  readonly sessions: {
    fork(source: string, name: string): Promise<Session>;
    _boot<M extends "session.start" | "session.resume">(
      method: M,
      params: Methods[M]["params"],
      name: string,
      signal: AbortSignal | undefined,
    ): Promise<Methods[M]["result"]>;
  };
}

/** A session, by name. Get one from `client.sessions.start/get/list/resume` or `client.sessions.session(name)`. */
export class Session {
  /** Its files (`read`, `write`, `stat`, `list`). */
  readonly files: SessionFiles;
  /** Its shared folders (`mount`, `unmount`, `list`). */
  readonly folders: SessionFolders;
  /** Its shadow folders (`diff`, `apply`, `reset`, `export`). */
  readonly shadow: SessionShadow;
  /** Language servers in it, and diagnostics for a proposed change (`start`, `list`, `forChange`). */
  readonly languages: SessionLanguages;
  private current: SessionInfo | undefined;

  /** @internal Use `client.sessions`. */
  constructor(
    /** @internal */ readonly client: SessionClient,
    /** Its name. */ readonly name: string,
    info?: SessionInfo,
  ) {
    this.current = info;
    this.files = new SessionFiles(this);
    this.folders = new SessionFolders(this);
    this.shadow = new SessionShadow(this);
    this.languages = new SessionLanguages(this);
  }

  /** Its state as last fetched (by the call that gave this handle, or `refresh()`); undefined if never fetched. */
  get info(): SessionInfo | undefined {
    return this.current;
  }

  /** Its status as last fetched. */
  get status(): SessionStatus | undefined {
    return this.current?.status;
  }

  /** Fetches its state again (`session.get`). */
  async refresh(): Promise<SessionInfo> {
    this.current = await this.client.call("session.get", { name: this.name });
    return this.current;
  }

  /** Stops it: processes end, the VM goes; folders, outputs and disk stay. */
  async stop(): Promise<SessionInfo> {
    this.current = await this.client.call("session.stop", { name: this.name });
    return this.current;
  }

  /** Pauses it into a snapshot and stops it (kvm only; see `Sessions.snapshot`). */
  async snapshot(): Promise<SessionInfo> {
    this.current = await this.client.call("session.snapshot", { name: this.name });
    return this.current;
  }

  /** A new session `name` from its snapshot (see `Sessions.fork`). */
  fork(name: string): Promise<Session> {
    return this.client.sessions.fork(this.name, name);
  }

  /**
   * Boots it again (a stopped or failed session; a snapshotted one is restored) and resolves
   * once it is ready. With `signal`, aborting stops waiting and cancels the boot
   * (`session.stop`); `discardSnapshot` boots it from its disk instead of its snapshot.
   */
  async resume(options: ResumeOptions = {}): Promise<SessionInfo> {
    const params = resumeParams(this.name, options);
    this.current = await this.client.sessions._boot("session.resume", params, this.name, options.signal);
    return this.current;
  }

  /**
   * Replaces its network policy (the wire shape: `{ mode, allow_domains, allow_cidrs, resolve }`).
   * New connections of the running VM follow it at once, open ones are not cut, and it is kept
   * across restarts and resumes. A malformed domain or CIDR rejects with an
   * {@link InvalidParamsError} and changes nothing.
   *
   * ```ts
   * await session.setNetwork({ mode: "allowlist", allow_domains: ["pypi.org", "*.pythonhosted.org"] });
   * ```
   */
  async setNetwork(network: NetworkPolicy): Promise<SessionInfo> {
    this.current = await this.client.call("session.set_network", { name: this.name, network });
    return this.current;
  }

  /**
   * Changes its settings, running or not (camelCase, as `sessions.start` takes them):
   * `approval`, `network` (within its policy's ceiling), `idleTimeoutSecs`, `idleAction` and
   * `autoExpose` take effect at once; the rest at its next boot. Resolves with what went
   * where (`applied`, `next_boot`) and the session's info.
   *
   * ```ts
   * const { applied, next_boot } = await session.update({ idleTimeoutSecs: 3600, memoryMiB: 2048 });
   * ```
   */
  async update(settings: CamelCased<SettingsPatch>): Promise<Updated> {
    const updated = await this.client.call("session.update", {
      name: this.name,
      settings: toWire(settings) as SettingsPatch,
    });
    this.current = updated.session;
    return updated;
  }

  /**
   * Gives it a secret, or a secret it has a new value (rotation: its placeholder stays, so
   * running processes keep working). The guest sees only the placeholder, in `$name`; umbrad's
   * egress proxy puts the value in its place in requests to the secret's `hosts` and nowhere
   * else (the wire shape: `{ name, value | from_env, hosts, inject? }`). The value never reaches
   * the guest, a session record, a log or an event.
   *
   * ```ts
   * await session.setSecret({ name: "GITHUB_TOKEN", value: token, hosts: ["github.com", "*.github.com"] });
   * ```
   */
  async setSecret(secret: SecretSpec): Promise<SessionInfo> {
    this.current = await this.client.call("session.set_secret", { name: this.name, secret });
    return this.current;
  }

  /**
   * Reaches guest port `guestPort` from the host: umbrad listens on a host port (a free one
   * on 127.0.0.1 unless `hostPort`/`bind` say otherwise; another address or a port below
   * 1024 needs umbrad's `ports_beyond_loopback`/`ports_privileged`) and carries each
   * connection to the port on the guest's loopback. Kept while the session lives.
   *
   * ```ts
   * const { host_port } = await session.expose(8000);
   * await fetch(`http://127.0.0.1:${host_port}/`);
   * ```
   */
  async expose(guestPort: number, options: { hostPort?: number; bind?: string } = {}): Promise<PortInfo> {
    const params: ExposeParams = { session: this.name, guest_port: guestPort };
    if (options.hostPort !== undefined) params.host_port = options.hostPort;
    if (options.bind !== undefined) params.bind = options.bind;
    return await this.client.call("session.expose", params);
  }

  /** Stops listening for `guestPort`; connections it carries end. */
  async unexpose(guestPort: number): Promise<void> {
    await this.client.call("session.unexpose", { session: this.name, guest_port: guestPort });
  }

  /** Its exposed ports, with the connections each carries now. */
  async ports(): Promise<PortInfo[]> {
    return (await this.client.call("session.ports", { name: this.name })).ports;
  }

  /** Stops it and removes it with its outputs, uploads and disk. */
  async delete(): Promise<void> {
    await this.client.call("session.delete", { name: this.name });
  }

  /** Its recent lifecycle events and console lines (`lines` of each, default 100). */
  logs(options: { lines?: number } = {}): Promise<SessionLogs> {
    return this.client.call("session.logs", {
      name: this.name,
      ...(options.lines === undefined ? {} : { lines: options.lines }),
    });
  }

  /**
   * Starts a process and resolves once the guest started it. `argv[0]` is looked up in the
   * guest's `PATH`; a command that is not found rejects with a {@link NotFoundError}.
   *
   * ```ts
   * const p = await session.spawn(["sh", "-c", "echo hi; exit 3"]);
   * p.stdout.pipe(process.stdout);
   * const { code } = await p.exited; // 3
   * ```
   */
  spawn(argv: readonly string[], options: SpawnOptions = {}): Promise<UmbraProcess> {
    return this.client._spawn(this.name, argv, options);
  }

  /** Runs a command to its end and collects its output (in memory: for commands with modest output). */
  async exec(argv: readonly string[], options: ExecOptions = {}): Promise<ExecResult> {
    const { input, signal, ...spawnOptions } = options;
    throwIfAborted(signal);
    const p = await this.spawn(argv, spawnOptions);
    const onAbort = () => void p.kill("SIGKILL").catch(() => undefined);
    signal?.addEventListener("abort", onAbort, { once: true });
    try {
      const stdout: Buffer[] = [];
      const stderr: Buffer[] = [];
      p.stdout.on("data", (b: Buffer) => stdout.push(b));
      p.stderr.on("data", (b: Buffer) => stderr.push(b));
      const drained = Promise.all([
        new Promise<void>((resolve) => p.stdout.once("end", resolve)),
        new Promise<void>((resolve) => p.stderr.once("end", resolve)),
      ]);
      p.stdin.on("error", () => undefined); // the process may end without reading its input
      p.stdin.end(input === undefined ? undefined : typeof input === "string" ? Buffer.from(input) : input);
      const exit = await p.wait(signal ? { signal } : {});
      await drained;
      return { stdout: Buffer.concat(stdout), stderr: Buffer.concat(stderr), exit };
    } catch (e) {
      if (e instanceof AbortError) {
        onAbort();
      }
      throw e;
    } finally {
      signal?.removeEventListener("abort", onAbort);
    }
  }

  /** The session's processes: running ones, and detached ones for a while after they ended. */
  async processes(): Promise<ProcessInfo[]> {
    return (await this.client.call("process.list", { session: this.name })).processes;
  }

  /**
   * Attaches to a detached process (another client's, or one this client lost): its output
   * from `from` (default: all the session keeps), then as it comes, then its exit.
   */
  async attach(process: number, options: { from?: { stdout?: number; stderr?: number } } = {}): Promise<UmbraProcess> {
    const from = { stdout: options.from?.stdout ?? 0, stderr: options.from?.stderr ?? 0 };
    const info = (await this.processes()).find((p) => p.process === process);
    const params = { session: this.name, process, from };
    return (await this.client._attach(this.name, "process.attach", params, info?.argv ?? [])).proc;
  }

  /** Opens a terminal that keeps running when this client goes. */
  async openTerminal(options: TerminalOptions = {}): Promise<Terminal> {
    const size = options.size ?? { cols: 80, rows: 24 };
    const params = {
      session: this.name,
      size: { cols: size.cols, rows: size.rows },
      ...(options.shell === undefined ? {} : { shell: options.shell }),
      ...(options.cwd === undefined ? {} : { cwd: options.cwd }),
      ...(options.env === undefined ? {} : { env: options.env }),
    };
    return new Terminal(this, (await this.client._attach(this.name, "terminal.open", params)).proc);
  }

  /** The session's terminals. */
  async terminals(): Promise<TerminalInfo[]> {
    return (await this.client.call("terminal.list", { session: this.name })).terminals;
  }

  /** Attaches to a terminal: its scrollback (from `from`, default all of it), then its output. */
  async attachTerminal(terminal: number, options: { from?: number } = {}): Promise<Terminal> {
    const params = { session: this.name, terminal, from: options.from ?? 0 };
    return new Terminal(this, (await this.client._attach(this.name, "terminal.attach", params)).proc);
  }

  /** Signals every process of the session, other clients' included (default SIGKILL). */
  async killAll(signal: Signal = "SIGKILL"): Promise<void> {
    await this.client.call("process.kill_all", { session: this.name, signal: signalNumber(signal) });
  }
}
