// Generated from the Rust types in host/api (through the JSON Schema
// host/api/schema/umbrad-ipc.json) by host/api/src/typescript.rs: do not edit.
// `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` rewrites it; a test fails when it is stale.
// The wire protocol and what every field means: docs/ipc.md.

/** The IPC contract's version (`major.minor`) these types describe. */
export const API_VERSION = "1.11";

/** Bytes of each output stream umbrad sends before it waits for `process.ack`. */
export const OUTPUT_WINDOW = 1048576;

/** Largest read or write of `file.read` / `file.write` in one request. */
export const MAX_FILE_CHUNK = 1048576;

/**
 * Flow control: the client has consumed `bytes` of a process's output and can take that much
 * more. Each stream starts with {@link OUTPUT_WINDOW} bytes of credit; without acks the process
 * blocks in the guest once its credit is spent. Usually sent as a notification (no id).
 */
export interface AckParams {
  session: string;
  process: number;
  stream: Stream;
  bytes: number;
}

/** An error as a client sees it: a stable code and a message for people. */
export interface ApiError {
  code: ErrorCode;
  message: string;
}

/**
 * When commands run without asking (seed 003's auto-run modes).
 *
 * - `"ask_every_time"`: Every command waits for a person.
 * - `"allowlist"`: Commands whose every part matches the allow list run; others wait.
 * - `"auto"`: As `allowlist`, and a command it does not allow runs all the same when the session's sandbox makes it harmless (no network, `.git` read-only, every workspace folder read-only or shadow: `CommandRequest.contained`); the decision says so. The protections (`sudo`, `rm` outside the workspace, …) still ask.
 * - `"run_everything"`: Everything runs, except what the deny list, the protections or a hook stop.
 */
export type ApprovalMode = "ask_every_time" | "allowlist" | "auto" | "run_everything";

/**
 * Which programs approval sees.
 *
 * - `"command"`: The commands clients run in the session (`session.exec`, `process.spawn`, terminals); what those commands start in the guest is theirs.
 * - `"guest"`: Every program the session's commands execute, down their whole process tree — an agent running in the guest included — is checked before it runs (the guest agent's exec gate). Allowlisted programs run at once; the others ask as a command would. This is policy on top of the VM, not the boundary: see `docs/policy.md`.
 */
export type ApprovalScope = "command" | "guest";

/** The approval settings of a session (merged from wherever they come from by the caller). */
export type ApprovalSettings = {
  /**
   * Command prefixes, as words: `git status`, `cargo`, `npm test`. Variables that change
   * what runs (`PATH`, `LD_PRELOAD`, `GIT_*`, …) set for a command must be listed before the
   * words to be allowed: `LD_PRELOAD=* git status`, `PATH=/usr/bin:/bin make`.
   *
   * @defaultValue `[]`
   */
  allow?: string[];
  /**
   * Command prefixes that refuse a command outright; they win over everything. Leading
   * `NAME=value` (or `NAME=*`) words refuse only when the command runs with that variable;
   * `LD_PRELOAD=*` alone refuses every command run with it.
   *
   * @defaultValue `[]`
   */
  deny?: string[];
  /**
   * Executables asked in turn after the rules (see {@link HookSpec}).
   *
   * @defaultValue `[]`
   */
  hooks?: HookSpec[];
  /** @defaultValue `"ask_every_time"` */
  mode?: ApprovalMode;
  /**
   * Ask, in every mode, before a command writes a dotfile (`.env`, `.git/config`,
   * `.github/…`, `.bashrc`) in a folder it can change on the host directly (`rw`, `rwd`):
   * through a redirection or as the file operand of `tee`, `touch`, `truncate`, `cp`, `mv`,
   * `install`, `ln`, `sed -i`, `perl -i`, `dd of=`. A heuristic on the line's words.
   *
   * @defaultValue `false`
   */
  protect_dotfiles?: boolean;
  /**
   * Which programs are checked: the commands clients run, or every exec in the guest.
   *
   * @defaultValue `"command"`
   */
  scope?: ApprovalScope;
  /**
   * How long a command waits for a person's answer before it counts as denied.
   *
   * @defaultValue `300`
   */
  timeout_secs?: number;
};

/** Params of `process.attach`. */
export interface AttachParams {
  session: string;
  process: number;
  /**
   * Where to start each stream (default: the start, or what is kept of it).
   *
   * @defaultValue `{"stderr":0,"stdout":0}`
   */
  from?: OutputOffsets;
}

/**
 * The result of `process.attach` and `terminal.attach`: `process.event` notifications follow,
 * output from the offsets asked for (each event's `offset` is its first byte's), then the
 * exit. Until the client detaches or goes, it owns a view of the process like a spawner:
 * `process.stdin`, `process.ack`, `process.kill` and `process.resize` act on it.
 */
export interface Attached {
  process: number;
  pid: number;
  stdout: KeptRange;
  stderr: KeptRange;
  /** Its exit, if it already ended (the event follows the output too). */
  exit?: ProcessExit | null;
}

/**
 * Which VM backend to use.
 *
 * - `"auto"`: Linux: the Umbra VMM where the CPU has VT-x/AMD-V, QEMU elsewhere. macOS: `vz`. A bundle for another architecture than the host's: QEMU, emulated.
 * - `"kvm"`: Umbra's own VMM on KVM (Linux).
 * - `"qemu"`: QEMU (KVM acceleration where the host has it, emulation otherwise).
 * - `"vz"`: Apple's Virtualization.framework (macOS). Since API 1.1.
 */
export type BackendChoice = "auto" | "kvm" | "qemu" | "vz";

export interface BundleStatus {
  installed: InstalledInfo[];
  /** Where the store lives. */
  root: string;
  /** The version sessions boot from `current`, if one is installed. */
  current?: string | null;
  /**
   * Downloads in progress (the latest progress event of each).
   *
   * @defaultValue `[]`
   */
  downloading?: Progress[];
  /** The configured bundle URL. */
  url?: string | null;
}

export type ChangeKind = "added" | "modified" | "deleted";

/** A `config.set`: the fields to change. */
export interface ConfigPatch {
  /** Command approval settings. */
  approval?: ApprovalSettings | null;
  /** Whether to download `bundle_url` into the warm slot in the background. */
  auto_download?: boolean | null;
  /** Whether ports guest programs listen on are exposed as they appear. */
  auto_expose?: boolean | null;
  /** The VM backend. */
  backend?: BackendChoice | null;
  /** Seconds a boot may take once admitted. */
  boot_timeout_secs?: number | null;
  /** The bundle to boot. */
  bundle?: string | null;
  /** The default download URL; an empty string clears it. */
  bundle_url?: string | null;
  /** Guest vCPUs (1 to 64). */
  cpus?: number | null;
  /** Size of the session disk; 0 for none. */
  disk_size_mib?: number | null;
  /** Seconds between heartbeats. */
  heartbeat_interval_secs?: number | null;
  /** Seconds a heartbeat may take. */
  heartbeat_timeout_secs?: number | null;
  /** What the idle timeout does: `stop` or `suspend`. */
  idle_action?: IdleAction | null;
  /** Idle seconds before the session stops; 0 never. */
  idle_timeout_secs?: number | null;
  /** Boots at once (0: twice the CPU count); takes effect at once. */
  max_concurrent_boots?: number | null;
  /** Failures allowed within the restart window. */
  max_restarts?: number | null;
  /** Guest memory (64 to 65536). */
  memory_mib?: number | null;
  /** The network policy (replaces the whole policy). */
  network?: NetworkPolicy | null;
  /** Replaces the list reached without the upstream proxy. */
  no_proxy?: string[] | null;
  /** The sandbox policy, as JSON: `{"type": "workspace_readonly", "ignore": [".env"]}`. */
  policy?: SandboxPolicy | null;
  /** The guest memory the pool's idle VMs may hold together, in MiB. */
  pool_memory_mib?: number | null;
  /** VMs kept booted ahead of session starts (0: none); takes effect at once. */
  pool_size?: number | null;
  /** Whether exposed ports may bind beyond loopback (ports exposed already keep their bind). */
  ports_beyond_loopback?: boolean | null;
  /** Whether exposed ports may use host ports below 1024. */
  ports_privileged?: boolean | null;
  /** The restart window, in seconds. */
  restart_window_secs?: number | null;
  /** Replaces the list of extra upstream CA files. */
  trust_ca?: string[] | null;
  /** The upstream HTTP proxy; `""` goes back to umbrad's environment. */
  upstream_proxy?: string | null;
}

/**
 * umbrad's configuration (`config.get`), persisted in `$XDG_CONFIG_HOME/umbra/umbrad.json`.
 * The session fields (flattened: one flat object) are the defaults a `session.start` uses for
 * what it does not set.
 */
export interface DaemonConfig {
  /**
   * Command approval for `process.spawn`; absent, every command runs. `session.start`
   * merges its settings with the daemon's (the stricter mode, both deny lists, both hooks).
   */
  approval?: ApprovalSettings | null;
  /**
   * Download `bundle_url` into the warm slot in the background when umbrad starts and when
   * this is switched on; the next session start promotes it.
   *
   * @defaultValue `false`
   */
  auto_download?: boolean;
  /**
   * Expose every port a guest program starts listening on (loopback or wildcard) on a free
   * host port of 127.0.0.1, and take it away when the program stops listening.
   */
  auto_expose?: boolean;
  /**
   * Which VM backend runs it.
   *
   * @defaultValue `"auto"`
   */
  backend?: BackendChoice;
  /**
   * How long a boot may take once it has a slot.
   *
   * @defaultValue `30`
   */
  boot_timeout_secs?: number;
  /**
   * Which bundle boots it: an installed version, `current`, or a built flavor (`minimal`,
   * `standard`) or bundle directory. `current` with nothing installed is the flavor this
   * machine built (`minimal` first).
   *
   * @defaultValue `"current"`
   */
  bundle?: string;
  /** Where `bundle.download` fetches from when it is not given a URL. */
  bundle_url?: string | null;
  /**
   * Guest vCPUs.
   *
   * @defaultValue `1`
   */
  cpus?: number;
  /**
   * Size of the writable session disk (sparse: only what the guest writes takes space); 0
   * keeps the guest's writes in its RAM, lost when the VM ends.
   *
   * @defaultValue `8192`
   */
  disk_size_mib?: number;
  /**
   * How often the agent is pinged.
   *
   * @defaultValue `5`
   */
  heartbeat_interval_secs?: number;
  /**
   * How long a ping may take before the VM counts as failed and is restarted.
   *
   * @defaultValue `15`
   */
  heartbeat_timeout_secs?: number;
  /**
   * What the idle timeout does: `stop`, or `suspend` (a snapshot the next call restores;
   * the kvm backend only, others stop).
   */
  idle_action?: IdleAction;
  /**
   * Stop the session after this long with no running process and no client activity; 0
   * never stops it.
   *
   * @defaultValue `900`
   */
  idle_timeout_secs?: number;
  /**
   * Boots at once; further starts queue. 0: twice the host's CPU count.
   *
   * @defaultValue `0`
   */
  max_concurrent_boots?: number;
  /**
   * A session that fails more than this many times within `restart_window_secs` becomes
   * `failed` instead of restarting again.
   *
   * @defaultValue `3`
   */
  max_restarts?: number;
  /**
   * Guest memory.
   *
   * @defaultValue `512`
   */
  memory_mib?: number;
  /**
   * What the guest may connect to (through the host's egress proxy; the guest has no
   * network interface of its own).
   *
   * @defaultValue `{"mode":"none"}`
   */
  network?: NetworkPolicy;
  /**
   * Names (with the names below them), addresses and CIDRs reached directly, not through
   * `upstream_proxy`; `*` for all. Unset: umbrad's `NO_PROXY`.
   */
  no_proxy?: string[] | null;
  /**
   * The sandbox policy, enforced on the host when the VM boots: the workspace folders' mode,
   * extra paths, read-only `.git` and `/tmp`, hidden files and (when it has one) the
   * network. `session.start` merges its policy with the daemon's default, field by field,
   * the most restrictive winning.
   */
  policy?: SandboxPolicy;
  /**
   * The most guest memory the pool's idle VMs may hold together; the pool keeps fewer VMs
   * than `pool_size` when `pool_size × memory_mib` would exceed it.
   *
   * @defaultValue `4096`
   */
  pool_memory_mib?: number;
  /**
   * VMs kept booted ahead of session starts, with the session defaults (bundle, backend,
   * memory, cpus, disk size): a start whose settings match takes one instead of booting, and
   * a replacement boots in the background. 0: no pool.
   *
   * @defaultValue `0`
   */
  pool_size?: number;
  /**
   * Whether `session.expose` may bind an address other than loopback (`0.0.0.0`, a LAN
   * address), making a guest's port reachable from other machines.
   *
   * @defaultValue `false`
   */
  ports_beyond_loopback?: boolean;
  /**
   * Whether `session.expose` may listen on a host port below 1024.
   *
   * @defaultValue `false`
   */
  ports_privileged?: boolean;
  /**
   * The window `max_restarts` counts failures in.
   *
   * @defaultValue `300`
   */
  restart_window_secs?: number;
  /**
   * CA certificates (PEM files) the egress proxy trusts upstream besides the host's trust
   * store, when it reads a request to give it a secret: a company's TLS-inspecting proxy.
   */
  trust_ca?: string[];
  /**
   * Public keys (`umbra-ed25519 <base64>` lines) a downloaded bundle may be signed by,
   * besides the `*.pub` files in `$XDG_CONFIG_HOME/umbra/trusted-keys/`. A system policy
   * with `trusted_keys` replaces both. Not settable by `config.set`: whom to trust is the
   * file's owner's decision, not any client's.
   */
  trusted_keys?: string[];
  /**
   * The HTTP proxy every guest connection goes out through, as `CONNECT` tunnels:
   * `http://[user:password@]host:port`. Unset: umbrad's `HTTPS_PROXY` (or `HTTP_PROXY`) when
   * it has one, else none.
   */
  upstream_proxy?: string | null;
}

export interface DaemonInfo {
  /** umbrad's version. */
  version: string;
  /**
   * The IPC contract's version (`major.minor`): a client should refuse a daemon of another
   * major version.
   */
  api_version: string;
  pid: number;
  uid: number;
  socket: string;
  /** The machine's system policy, when it has one (`docs/policy.md`). Since API 1.8. */
  system_policy?: SystemPolicyInfo | null;
}

/**
 * Which sources decided each field of a merged policy: those whose value is the result (for
 * the type, the network mode and the flags), or that narrowed it (extra paths: each source
 * that set them; ignore: each source that added patterns). Empty: no source set the field and
 * the default applies.
 */
export interface DecidedBy {
  type: PolicySource[];
  network: PolicySource[];
  /** Both `additional_readwrite_paths` and `additional_readonly_paths`. */
  paths: PolicySource[];
  block_git_writes: PolicySource[];
  disable_tmp_write: PolicySource[];
  ignore: PolicySource[];
}

/**
 * A decision: the verdict, the rule, and the commands the line was split into (the candidates
 * a front end offers for the allow list).
 */
export interface Decision {
  verdict: Verdict;
  reason: Reason;
  parts: string[][];
}

/** An LSP diagnostic of a file in the folder. */
export interface Diagnostic {
  /** The file, relative to the folder (or the server's URI, for a file outside it). */
  path: string;
  /** LSP's range: 0-based lines and UTF-16 columns, in the changed file. */
  range: Range;
  message: string;
  code?: unknown;
  /** 1 error, 2 warning, 3 information, 4 hint. */
  severity?: number | null;
  /** Which tool said it: `pyflakes`, `clang`, ... */
  source?: string | null;
}

export interface DirEntry {
  name: string;
  kind: FileKind;
  size: number;
}

export interface DirList {
  entries: DirEntry[];
  truncated: boolean;
}

/** The result of methods that only succeed or fail (`{}`). */
export type Done = Record<string, never>;

export interface DownloadParams {
  /**
   * `https://` or `file://` of a bundle's `manifest.json` (or its directory); default: the
   * configured `bundle_url`. The bundle must be signed by a trusted key (`bundle_error`
   * otherwise, naming the signer).
   */
  url?: string | null;
  /**
   * Into the warm slot: the next session start promotes it.
   *
   * @defaultValue `false`
   */
  warm?: boolean;
}

export interface Downloaded {
  version: string;
  how: PulledHow;
  /** Compressed bytes transferred. */
  downloaded: number;
}

/**
 * The agent's answer to `EgressQuery.Process`: the process holding the guest end of the
 * connection, as the guest reports it — something to show a person, never to decide on (a
 * guest's root can make any process claim anything). Empty when it cannot be known (the
 * socket is gone, or belongs to no process the agent can see).
 */
export interface EgressProcess {
  /**
   * Its command line, arguments joined by spaces: at most 256 bytes, every control and
   * invisible format character shown as `?` (it is printed on people's terminals).
   */
  command?: string;
  /** Its process id in the guest. */
  pid?: number | null;
}

/**
 * How the connection reached the agent (for the host's events and decisions' records).
 *
 * - `"transparent"`: A TCP connection redirected by the guest's netfilter rule.
 * - `"http"`: The agent's HTTP proxy (CONNECT, or a plain `http://` request).
 * - `"socks"`: The agent's SOCKS5 proxy.
 * - `"dns"`: The agent's DNS server (`resolve` requests).
 */
export type EgressVia = "transparent" | "http" | "socks" | "dns";

export type Encoding = "utf8" | "base64";

/**
 * What kind of failure an error is. The snake_case names are stable; new codes may be added,
 * and a client that does not know one sees `"unknown"`.
 *
 * - `"parse_error"`: The request line was not valid JSON.
 * - `"invalid_request"`: Valid JSON, but not a JSON-RPC 2.0 request (or a line longer than the limit).
 * - `"method_not_found"`: No method of that name (see `daemon.info`'s `api_version`).
 * - `"invalid_params"`: The parameters do not match the method's schema, or a value is out of range.
 * - `"internal"`: A bug or an unexpected condition in umbrad.
 * - `"session_not_found"`: No session of that name.
 * - `"session_exists"`: A session of that name exists already (and is not running: resume or delete it).
 * - `"invalid_state"`: The session is not in a state that allows this (for example, not running).
 * - `"not_found"`: A file, folder, process or command does not exist. Spawning a command that is not found is this code (a shell would exit 127).
 * - `"permission_denied"`: The guest or the host refused access (a shell would exit 126 for a command).
 * - `"already_exists"`: Something of that name exists already (a shared folder, for example).
 * - `"spawn_failed"`: The command could not be started for another reason.
 * - `"boot_failed"`: The VM did not boot: the message carries the reason and the last console lines.
 * - `"session_lost"`: The VM or its agent went away during the call (the session restarts or has failed).
 * - `"guest_error"`: The guest agent refused the request for a reason not covered above.
 * - `"timeout"`: The guest did not answer in time.
 * - `"too_large"`: A request, a file or an output exceeds a limit.
 * - `"busy"`: A limit on clients, sessions or concurrent work was reached; try again later.
 * - `"bundle_error"`: A bundle could not be downloaded, verified or found.
 * - `"io"`: A host I/O error (disk full, permissions on the host's own directories).
 * - `"unsupported"`: Not possible with this session, host or build (for example, a session without storage).
 * - `"unauthorized"`: The connecting user is not allowed to use this daemon.
 * - `"unavailable"`: umbrad is not running, or the connection to it dropped (clients report this; the daemon never sends it).
 * - `"disabled_by_admin"`: The machine's system policy turns sessions off (`enabled: false`). Since API 1.8.
 * - `"unknown"`: A code from a newer daemon.
 */
export type ErrorCode = "parse_error" | "invalid_request" | "method_not_found" | "invalid_params" | "internal" | "session_not_found" | "session_exists" | "invalid_state" | "not_found" | "permission_denied" | "already_exists" | "spawn_failed" | "boot_failed" | "session_lost" | "guest_error" | "timeout" | "too_large" | "busy" | "bundle_error" | "io" | "unsupported" | "unauthorized" | "unavailable" | "disabled_by_admin" | "unknown";

/** Params of `events.lost`. */
export interface EventsLost {
  /** Events dropped since the last one this client received. */
  count: number;
}

export interface ExportParams {
  session: string;
  folder: string;
  /** A host path for the tar; default: a new file in the session's storage directory. */
  dest?: string | null;
}

export interface Exported {
  path: string;
  bytes: number;
}

/** Params of `session.expose`. */
export interface ExposeParams {
  session: string;
  /** The port a server listens on in the guest (on its loopback, or on every address). */
  guest_port: number;
  /**
   * The host address to listen on: 127.0.0.1 unless given. Any other address (`0.0.0.0`,
   * a LAN address) needs umbrad's `ports_beyond_loopback`; a host port below 1024, its
   * `ports_privileged`.
   */
  bind?: string | null;
  /** The host port to listen on; unset or 0: a free one, chosen by the host. */
  host_port?: number | null;
}

/**
 * Bytes in JSON: `data` holds UTF-8 text as it is (`encoding` absent or `utf8`) or base64
 * (`encoding: base64`). Output uses text where it is valid UTF-8 without many control
 * characters; a chunk boundary can split a character, so one stream may mix both, and
 * decoding each chunk and concatenating gives the exact bytes. File contents are base64.
 */
export interface FileData {
  data: string;
  /** The read reached the end of the file. */
  eof: boolean;
  encoding?: Encoding;
}

export type FileKind = "file" | "dir" | "symlink" | "other";

export interface FileStat {
  kind: FileKind;
  size: number;
  mode: number;
  uid: number;
  gid: number;
  mtime_ms: number;
}

/** A folder shared with a session. */
export interface FolderInfo {
  name: string;
  host_path: string;
  mode: ShareMode;
  /** `/sessions/<session>/mnt/<name>`. */
  guest_path: string;
}

/** A host folder to share with a session. */
export interface FolderSpec {
  /** Absolute host path of a directory. */
  path: string;
  /**
   * `ro`, `rw` (no deletes), `rwd` or `shadow` (copy-on-write in the guest). Default `rw`.
   *
   * @defaultValue `"rw"`
   */
  mode?: ShareMode;
  /** The name under `/sessions/<session>/mnt/` (default: the folder's own name). */
  name?: string | null;
}

/** What a change does to the diagnostics (`diagnostics.for_change`). */
export interface ForChange {
  /** Diagnostics the change brings: in the changed files afterwards, and not there before. */
  diagnostics: Diagnostic[];
  /** Diagnostics the change takes away: there before, and not afterwards. */
  resolved: Diagnostic[];
  /** Every diagnostic of the changed files afterwards. */
  after: Diagnostic[];
  /**
   * Every server said it was done (a diagnostics report for each file, then no work in
   * progress and a quiet period); false when `timeout_ms` ran out first, with what had come.
   */
  complete: boolean;
  /** The languages whose servers were asked. */
  languages: string[];
  elapsed_ms: number;
}

/** Params of `diagnostics.for_change`. */
export interface ForChangeParams {
  session: string;
  /** The folder (by name) the change is to: a shadow or read-only folder, or any other. */
  folder: string;
  /**
   * Path in the folder → its new content, or `null` for a deletion. Nothing is written: the
   * change lives in the language server's open documents for the request's length.
   */
  changes: Record<string, string | null>;
  /** The language of every changed file; default: each file's, by its extension. */
  language?: string | null;
  /**
   * How long the servers may take to answer once they are free and started (default 20 000,
   * at most 300 000); waiting for them and starting them (on first use) is bounded apart
   * (90 s).
   */
  timeout_ms?: number | null;
}

/** Params of `session.fork`. */
export interface ForkParams {
  /** The session to fork: its snapshot, or one taken of it as it runs on (kvm: a live fork). */
  source: string;
  /** The new session's name. */
  name: string;
}

/** An executable asked about each command. */
export interface HookSpec {
  /** Path of the executable. */
  command: string;
  /** Its arguments. */
  args?: string[];
  /**
   * How long it may take to answer (default 5000).
   *
   * @defaultValue `5000`
   */
  timeout_ms?: number;
}

/**
 * What an idle session's VM does at its idle timeout.
 *
 * - `"stop"`: Stops: its processes end; resuming boots it again (or restores its snapshot).
 * - `"suspend"`: Snapshots the VM and stops it (the kvm backend; others stop): the next call naming the session restores it, with its detached processes and terminals running on. Detached processes and terminals do not keep it awake. Since API 1.8.
 */
export type IdleAction = "stop" | "suspend";

/** Params of `process.list` and `terminal.list`. */
export interface InSession {
  session: string;
}

/**
 * Where in a request the proxy looks for a secret's placeholder.
 *
 * - `"header"`: Any request header's value (`Authorization: Bearer …`, `X-Api-Key: …`).
 * - `"basic"`: The user or password of an `Authorization: Basic` header, decoded (what `git` sends).
 * - `"query"`: The request target: its path and query (`?key=…`). Off unless asked: servers log URLs.
 */
export type Inject = "header" | "basic" | "query";

/** One installed (or warm) bundle, as `vmctl bundle ls` shows it. */
export interface InstalledInfo {
  version: string;
  flavor: string;
  /** Uncompressed bytes of its artifacts. */
  bytes: number;
  /** Seconds since the epoch when it was completed. */
  installed: number;
  current: boolean;
  /** In the warm slot: downloaded ahead, not yet promoted. */
  warm: boolean;
  dir: string;
}

/** The output a session holds for a kept process, per stream: bytes `[start, end)`. */
export interface KeptRange {
  /** The offset of the oldest byte still kept. */
  start: number;
  /** Bytes written so far. */
  end: number;
}

export interface KillAllParams {
  session: string;
  /**
   * Default 9 (SIGKILL).
   *
   * @defaultValue `9`
   */
  signal?: number;
}

export interface KillParams {
  session: string;
  process: number;
  /**
   * Default 15 (SIGTERM).
   *
   * @defaultValue `15`
   */
  signal?: number;
}

export interface ListParams {
  session: string;
  path: string;
  /**
   * `path` is a host path inside a shared folder.
   *
   * @defaultValue `false`
   */
  host?: boolean;
  limit?: number | null;
}

export interface LogsParams {
  name: string;
  /** Lines of each log to return (default 100, at most 10000). */
  lines?: number | null;
}

/** A session's language servers (`lsp.list`). */
export interface LspList {
  servers: LspServerInfo[];
}

/** Params of `lsp.notify`. */
export interface LspNotifyParams {
  session: string;
  server: number;
  /** `textDocument/didOpen`, `textDocument/didChange`, ... */
  method: string;
  /** @defaultValue `null` */
  params?: unknown;
}

/** A language server of a session (`lsp.stop`). */
export interface LspRef {
  session: string;
  server: number;
}

/** Params of `lsp.request`. */
export interface LspRequestParams {
  session: string;
  server: number;
  /** An LSP method: `textDocument/definition`, `textDocument/hover`, ... */
  method: string;
  /** @defaultValue `null` */
  params?: unknown;
  /**
   * How long to wait for its answer (default 30 000, at most 300 000); past it the request
   * is cancelled (`$/cancelRequest`) and the error is `timeout`.
   */
  timeout_ms?: number | null;
}

/**
 * The server's answer to `lsp.request` (an LSP error answer is the call's error instead:
 * `guest_error`, with the server's code and message).
 */
export interface LspResult {
  /** @defaultValue `null` */
  result?: unknown;
}

/** A running language server. */
export interface LspServerInfo {
  /** Names it in `lsp.request`, `lsp.notify`, `lsp.stop` and `lsp_notification` events. */
  server: number;
  folder: string;
  /** Its workspace root in the guest (`file://` + this is its `rootUri`). */
  root: string;
  command: string[];
  /**
   * What it answered `initialize` with: `capabilities` and `serverInfo`.
   *
   * @defaultValue `null`
   */
  initialize?: unknown;
}

/** Params of `lsp.start`. */
export interface LspStartParams {
  session: string;
  /** The folder (by name) the server works on: its root is the folder's guest path. */
  folder: string;
  /** Another server to run instead (argv in the guest, speaking LSP on stdin and stdout). */
  command?: string[] | null;
  /** The `initializationOptions` of its `initialize` request. */
  initialization_options?: unknown;
  /** `python` (pylsp), `c` or `cpp` (clangd): the servers the standard image carries. */
  language?: string | null;
}

/** A host folder to share with a session. */
export interface MountParams {
  session: string;
  /** Absolute host path of a directory. */
  path: string;
  /**
   * `ro`, `rw` (no deletes), `rwd` or `shadow` (copy-on-write in the guest). Default `rw`.
   *
   * @defaultValue `"rw"`
   */
  mode?: ShareMode;
  /** The name under `/sessions/<session>/mnt/` (default: the folder's own name). */
  name?: string | null;
}

/**
 * How much network a session gets. Every connection the guest opens is decided on the host,
 * by the name it was opened for.
 *
 * - `"none"`: No connection leaves the guest (DNS answers nothing).
 * - `"allowlist"`: Only the names in `allow_domains` (exact, or `*.suffix` for names below a domain), and addresses in `allow_cidrs`.
 * - `"ask"`: As `allowlist`, and a connection to any other name waits while the user is asked (`permission_request` with `kind: "network"`): allowed once, for the session, or denied; silence denies after `ask_timeout_secs`.
 * - `"any"`: Any public address; private, loopback and link-local ones still only through `allow_cidrs`.
 */
export type NetworkMode = "none" | "allowlist" | "ask" | "any";

/** A session's network policy. */
export interface NetworkPolicy {
  /**
   * Address ranges (`10.0.0.0/8`, `127.0.0.1/32`, `::1/128`) the guest may reach even though
   * they are private, loopback or link-local, and that an address literal may name in
   * `allowlist` mode.
   */
  allow_cidrs?: string[];
  /**
   * Names the guest may connect to in `allowlist` mode: `example.com` (that name only) or
   * `*.example.com` (any name below it, not `example.com` itself).
   */
  allow_domains?: string[];
  /**
   * In `ask` mode, how long a connection waits for the user's answer (default 60 s, at
   * most 3600); silence denies.
   */
  ask_timeout_secs?: number | null;
  /** @defaultValue `"none"` */
  mode?: NetworkMode;
  /**
   * Names the host resolves to a fixed address instead of asking DNS (like curl's
   * `--resolve`): `{"allowed.test": "127.0.0.1"}`.
   */
  resolve?: Record<string, string>;
  /**
   * Names whose TLS the host never opens (`pinned.example.com`, `*.example.com`), even when
   * a secret is bound to them — say inside a `*.example.com` binding, for a client that
   * pins its server's certificate. A secret's placeholder then reaches such a host unchanged.
   */
  tls_passthrough?: string[];
}

/** Params of methods that take none (`{}` or absent). */
export type NoParams = Record<string, never>;

/** Offsets into a kept process's output streams: bytes since it started. */
export interface OutputOffsets {
  /** @defaultValue `0` */
  stderr?: number;
  /** @defaultValue `0` */
  stdout?: number;
}

/**
 * A path in the session: a guest path (absolute, no `..`), or with `host` a host path inside
 * one of the session's shared folders, translated to its guest path.
 */
export interface PathParams {
  session: string;
  path: string;
  /**
   * `path` is a host path inside a shared folder.
   *
   * @defaultValue `false`
   */
  host?: boolean;
}

/**
 * An answer to a `permission_request`, as one word (`permission.respond`'s `decision`).
 *
 * - `"allow_once"`: Approved, this request only.
 * - `"allow_always"`: Approved, and allowed from now on (scope `always`).
 */
export type PermissionDecision = "deny" | "allow_once" | "allow_always";

/**
 * What a `permission_request` asks for.
 *
 * - `"command"`: A command, before it runs.
 * - `"network"`: A connection to a name outside the session's allowlist, held while the user decides.
 */
export type PermissionKind = "command" | "network";

/**
 * How far a `permission.respond` approval reaches.
 *
 * - `"once"`: This request only (every connection waiting on it).
 * - `"session"`: A network request: the name for the rest of the session in this umbrad; later connections to it are not asked again. (For a command, the same as `once`.)
 * - `"always"`: A command: it runs, and its commands (the request's `decision.parts`) join the session's allow list, so they run without asking from now on. A network request: as `session`. Since API 1.8.
 */
export type PermissionScope = "once" | "session" | "always";

/**
 * - `"manifest"`: Fetching and checking `manifest.json`.
 * - `"waiting"`: Another pull of the same version holds its lock; this one waits and then reuses its work.
 * - `"download"`: Compressed bytes are arriving (and being decompressed and verified on the way).
 * - `"retry"`: A network error or 5xx: waiting `message`'s delay before resuming.
 * - `"install"`: Every artifact verified: renaming into place and switching `current`.
 * - `"promote"`: A warm bundle is being renamed into place instead of downloaded.
 */
export type Phase = "done" | "manifest" | "waiting" | "download" | "retry" | "install" | "promote";

/**
 * Where a policy came from, from the widest authority to the narrowest.
 *
 * - `"system"`: The machine's system policy (`/etc/umbra/policy.json`), which no user can loosen.
 * - `"admin"`: The machine's administrator (umbrad's configuration).
 * - `"user"`: The user's own defaults.
 * - `"session"`: The session's policy (`session.start`).
 * - `"command"`: One command's policy (a spawn).
 */
export type PolicySource = "system" | "admin" | "user" | "session" | "command";

/**
 * How much of the workspace a command may change. Ordered from the most restrictive
 * (`WorkspaceReadonly`) to the least (`InsecureNone`): `Ord` is the restriction order, which
 * merging relies on.
 *
 * - `"workspace_readonly"`: The workspace folders are read-only: commands can read and build elsewhere, never change the user's files. The most restrictive type (Cursor's level function forgets it and ranks it as unsandboxed; here it ranks first).
 * - `"workspace_readwrite"`: The workspace folders are read-write; the rest of the policy still holds.
 * - `"insecure_none"`: No workspace restriction (the folders keep the modes the session gave them). The VM remains the boundary; the other fields still hold.
 */
export type PolicyType = "workspace_readonly" | "workspace_readwrite" | "insecure_none";

/** The warm pool (`pool.status`): VMs booted ahead of session starts. */
export interface PoolStatus {
  /** How many VMs the pool keeps (`pool_size`, within `pool_memory_mib`). */
  target: number;
  /** Booted VMs waiting for a session. */
  ready: number;
  /** VMs booting for the pool now. */
  booting: number;
  /** Sessions that started from the pool since umbrad started. */
  taken: number;
  /** The backend they run on. */
  backend?: string | null;
  /** The bundle version the pool's VMs run, once it has resolved one. */
  bundle_version?: string | null;
  /** Why the last refill failed, until one succeeds. */
  last_error?: string | null;
  /**
   * The pool restores its VMs from a snapshot of one VM taken right after its agent
   * announced itself, instead of booting each (the kvm backend).
   *
   * @defaultValue `false`
   */
  restores?: boolean;
  /**
   * Why the pool boots its VMs although its backend could restore them: taking or restoring
   * its snapshot failed.
   */
  snapshot_error?: string | null;
}

/** An exposed port. */
export interface PortInfo {
  guest_port: number;
  /** Where the host listens for it. */
  host_port: number;
  bind: string;
  /**
   * Connections carried now.
   *
   * @defaultValue `0`
   */
  connections?: number;
}

/** A session's exposed ports (`session.ports`). */
export interface PortList {
  ports: PortInfo[];
}

/** A port to expose, as `session.start {ports}` and `session.expose` take it. */
export interface PortSpec {
  /** The port a server listens on in the guest (on its loopback, or on every address). */
  guest_port: number;
  /**
   * The host address to listen on: 127.0.0.1 unless given. Any other address (`0.0.0.0`,
   * a LAN address) needs umbrad's `ports_beyond_loopback`; a host port below 1024, its
   * `ports_privileged`.
   */
  bind?: string | null;
  /** The host port to listen on; unset or 0: a free one, chosen by the host. */
  host_port?: number | null;
}

export interface Position {
  line: number;
  character: number;
}

/** How a process ended. */
export interface ProcessExit {
  process: number;
  duration_ms: number;
  /** The exit code, when it exited by itself. */
  code?: number | null;
  /** The first signal the host forwarded to it (Ctrl-C in `vmctl`), if any. */
  interrupted?: number | null;
  /**
   * Its end was not reported by the guest: the VM failed, restarted or stopped. `reason`
   * says which.
   *
   * @defaultValue `false`
   */
  lost?: boolean;
  reason?: string | null;
  /**
   * The signal that ended it. A process whose VM went away is reported killed by SIGKILL (9)
   * with `lost` set.
   */
  signal?: number | null;
  /**
   * It was stopped because its timeout passed.
   *
   * @defaultValue `false`
   */
  timed_out?: boolean;
}

/** A process as `process.list` reports it. */
export interface ProcessInfo {
  process: number;
  /** Its pid in the guest. */
  pid: number;
  argv: string[];
  /** Kept by the session when its client goes (`detach`, or a terminal): it can be attached. */
  detached: boolean;
  /** A terminal (`terminal.open`). */
  terminal: boolean;
  /** Its exit, once it ended (kept processes only, for a while after). */
  exit?: ProcessExit | null;
  stderr?: KeptRange | null;
  /** What of its output the session holds (kept processes only). */
  stdout?: KeptRange | null;
}

export interface ProcessList {
  processes: ProcessInfo[];
}

export interface ProcessRef {
  session: string;
  process: number;
}

export interface Progress {
  phase: Phase;
  version: string;
  /** Compressed bytes received or found already on disk, over all artifacts. */
  done: number;
  /** Compressed bytes of all artifacts. */
  total: number;
  /** Bytes per second over the last few seconds. */
  rate: number;
  /** The artifact being downloaded, in `download` and `retry`. */
  artifact?: string | null;
  eta_secs?: number | null;
  /** What went wrong before a retry, or other detail. */
  message?: string | null;
}

/**
 * - `"downloaded"`: Downloaded, verified, installed and made current.
 * - `"already_installed"`: Already installed (perhaps by a concurrent pull); made current.
 * - `"promoted_warm"`: Found complete in the warm slot; renamed into place and made current.
 * - `"warmed"`: Downloaded into (or already in) the warm slot; `current` unchanged.
 */
export type PulledHow = "downloaded" | "already_installed" | "promoted_warm" | "warmed";

export interface Range {
  start: Position;
  end: Position;
}

export interface ReadParams {
  session: string;
  path: string;
  /**
   * `path` is a host path inside a shared folder.
   *
   * @defaultValue `false`
   */
  host?: boolean;
  /** At most {@link MAX_FILE_CHUNK} bytes (the default). */
  len?: number | null;
  /** @defaultValue `0` */
  offset?: number;
}

/**
 * The rule behind a verdict.
 *
 * The `rule` field tells the kinds apart ({@link ReasonKind}); narrow on it with `switch` or `===`.
 */
export type Reason = ReasonKind;

/** The kinds of {@link Reason}, by their `rule` field. */
export type ReasonKind =
  | DenyListReason
  | UnparseableReason
  | NoCommandReason
  | DynamicProgramReason
  | PrivilegeReason
  | RmRecursiveRootReason
  | RmOutsideWorkspaceReason
  | RmUnknownTargetReason
  | DotfileWriteReason
  | AskEveryTimeReason
  | NotAllowlistedReason
  | EnvNotAllowedReason
  | AllowlistedReason
  | RunEverythingReason
  | ContainedReason
  | HookReason
  | HookFailedReason;

/** Every value of {@link Reason}'s `rule` field, in declaration order. */
export const REASON_KINDS = [
  "deny_list",
  "unparseable",
  "no_command",
  "dynamic_program",
  "privilege",
  "rm_recursive_root",
  "rm_outside_workspace",
  "rm_unknown_target",
  "dotfile_write",
  "ask_every_time",
  "not_allowlisted",
  "env_not_allowed",
  "allowlisted",
  "run_everything",
  "contained",
  "hook",
  "hook_failed",
] as const;

/** A part matched a deny pattern. */
export interface DenyListReason {
  rule: "deny_list";
  pattern: string;
  part: string;
}

/** The line could not be split into commands; the error says why. */
export interface UnparseableReason {
  rule: "unparseable";
  error: string;
}

/** The line runs no command. */
export interface NoCommandReason {
  rule: "no_command";
}

/** A part's program is an expansion, known only when the shell runs it. */
export interface DynamicProgramReason {
  rule: "dynamic_program";
  part: string;
}

/** `sudo` and the like. */
export interface PrivilegeReason {
  rule: "privilege";
  program: string;
  part: string;
}

/** `rm -r` on `/`, a top-level directory, a home directory or a workspace folder itself. */
export interface RmRecursiveRootReason {
  rule: "rm_recursive_root";
  path: string;
  part: string;
}

/** `rm` of a path outside every workspace folder. */
export interface RmOutsideWorkspaceReason {
  rule: "rm_outside_workspace";
  path: string;
  part: string;
}

/** `rm` of a path only known when the shell runs (`"$DIR"`). */
export interface RmUnknownTargetReason {
  rule: "rm_unknown_target";
  target: string;
  part: string;
}

/**
 * With `protect_dotfiles`: `part` writes the dotfile `path` in a writable folder (or one
 * whose place is only known when the shell runs).
 */
export interface DotfileWriteReason {
  rule: "dotfile_write";
  path: string;
  part: string;
}

/** The mode is ask-every-time. */
export interface AskEveryTimeReason {
  rule: "ask_every_time";
}

/** A part matched no allow pattern. */
export interface NotAllowlistedReason {
  rule: "not_allowlisted";
  part: string;
}

/**
 * A part's words matched an allow pattern, but it runs with a variable that changes what
 * runs (`variable`, as `NAME=value`) and that the pattern does not permit.
 */
export interface EnvNotAllowedReason {
  rule: "env_not_allowed";
  variable: string;
  part: string;
}

/** Every part matched an allow pattern (these). */
export interface AllowlistedReason {
  rule: "allowlisted";
  patterns: string[];
}

/** The mode is run-everything. */
export interface RunEverythingReason {
  rule: "run_everything";
}

/**
 * Mode `auto`: `part` matched no allow pattern, and runs because the sandbox contains it
 * (`how`).
 */
export interface ContainedReason {
  rule: "contained";
  how: string;
  part: string;
}

/** A hook answered. */
export interface HookReason {
  rule: "hook";
  hook: string;
  permission: Verdict;
  message?: string | null;
}

/** A hook failed or did not answer in time; a person decides instead. */
export interface HookFailedReason {
  rule: "hook_failed";
  hook: string;
  error: string;
}

/** Params of `bundle.delete_and_reinstall`. */
export interface ReinstallParams {
  /**
   * `https://` or `file://` of the bundle to download again; default: the configured
   * `bundle_url`.
   */
  url?: string | null;
}

export interface ResizeParams {
  session: string;
  process: number;
  rows: number;
  cols: number;
}

/** Params of `permission.respond`. */
export interface RespondPermissionParams {
  /** The `request_id` of a `permission_request` event. */
  request_id: string;
  /**
   * Whether it may run (or connect); `decision`, when given, says it instead.
   *
   * @defaultValue `false`
   */
  approved?: boolean;
  /**
   * `allow_once`, `allow_always` (its commands join the session's allow list) or `deny`:
   * `approved` and `scope` in one word. Since API 1.8.
   */
  decision?: PermissionDecision | null;
  /**
   * With `allow_always`: the commands also join the allow list of umbrad's configuration,
   * so every new session allows them (the configuration must have approval settings).
   * Since API 1.8.
   */
  remember?: boolean;
  /**
   * How far an approval reaches: `once` (the default) or `session` (a network name for the
   * rest of the session).
   */
  scope?: PermissionScope;
}

/** Params of `session.resume`. */
export interface ResumeParams {
  name: string;
  /**
   * Deletes the session's snapshot and boots it from its disk instead: for a snapshot this
   * host cannot restore (another umbra version, another CPU, its bundle gone). What the
   * snapshot's memory held (processes, shadow changes not yet applied) is lost; the disk,
   * outputs, uploads and folders stay.
   */
  discard_snapshot?: boolean;
}

/**
 * A sandbox policy as one source writes it. JSON example:
 * `{"type": "workspace_readwrite", "block_git_writes": true, "ignore": [".env"]}`.
 */
export type SandboxPolicy = {
  /** Absolute host paths shared read-only beyond the workspace. */
  additional_readonly_paths?: string[] | null;
  /**
   * Absolute host paths shared read-write beyond the workspace. Where paths nest, the most
   * specific entry decides (read-only `/a/b` inside read-write `/a` is read-only); a path in
   * both lists is read-only.
   */
  additional_readwrite_paths?: string[] | null;
  /** Every `.git` in a writable folder is read-only: `git status`/`log` work, commits fail. */
  block_git_writes?: boolean | null;
  /** `/tmp` is read-only for the command. */
  disable_tmp_write?: boolean | null;
  /**
   * gitignore-syntax patterns (relative to each workspace folder) whose files never reach the
   * guest: `.env`, `*.pem`, `secrets/**`.
   */
  ignore?: string[] | null;
  /** What the guest may connect to (`mode`: `none`, `allowlist` with `allow_domains`, `any`). */
  network?: NetworkPolicy | null;
  /** How much of the workspace a command may change. */
  type?: PolicyType | null;
};

/** A secret as `session.get` reports it: never its value. */
export interface SecretInfo {
  name: string;
  /** What the guest's processes see in `$name`. */
  placeholder: string;
  hosts: string[];
  inject: Inject[];
  /**
   * Whether the host holds a value (a value given inline is gone after umbrad restarts,
   * until `session.set_secret` gives it again).
   */
  has_value: boolean;
  /** The variable of umbrad's environment it comes from, when it does. */
  from_env?: string | null;
}

/** A secret as `session.start` and `session.set_secret` take it. */
export interface SecretSpec {
  /**
   * The environment variable the guest's processes see it as (holding the placeholder):
   * letters, digits and `_`, not starting with a digit, at most 64 bytes.
   */
  name: string;
  /**
   * The hosts that receive the value: `api.example.com` or `*.example.com` (any name below
   * it). A request to any other host carries the placeholder unchanged.
   */
  hosts: string[];
  /** The name of a variable of umbrad's own environment holding the value. */
  from_env?: string | null;
  /**
   * Where the placeholder is replaced: `header` and `basic` unless given.
   *
   * @defaultValue `["header","basic"]`
   */
  inject?: Inject[];
  /** The value. Exactly one of `value` and `from_env`. */
  value?: SecretValue | null;
}

/**
 * A secret's value. Its `Debug` never shows it; it is never part of a record, a log or an
 * event (the only things that serialize it are a client's request and its parse).
 */
export type SecretValue = string;

/**
 * One event. `session` is absent for events about the host (bundle downloads).
 *
 * The `event` field tells the kinds apart ({@link SessionEventKind}); narrow on it with `switch` or `===`.
 */
export type SessionEvent = SessionEventBase & SessionEventKind;

/** The fields every {@link SessionEvent} has, whatever its kind. */
export interface SessionEventBase {
  /** Milliseconds since the epoch. */
  time_ms: number;
  session?: string | null;
}

/** The kinds of {@link SessionEvent}, by their `event` field. */
export type SessionEventKind =
  | StatusEvent
  | BootQueuedEvent
  | ReadyEvent
  | StartupErrorEvent
  | HeartbeatFailureEvent
  | RestartingEvent
  | FailedEvent
  | IdleStopEvent
  | IdleSuspendEvent
  | ConfigChangedEvent
  | FolderMountedEvent
  | FolderUnmountedEvent
  | ShadowExportedEvent
  | ShadowLostEvent
  | ShadowDiffEvent
  | ShadowAppliedEvent
  | OutputsFileCreatedEvent
  | OutputsFileDeletedEvent
  | SpawnedEvent
  | SpawnFailedEvent
  | StdoutEvent
  | StderrEvent
  | ExitEvent
  | EgressEvent
  | EgressClosedEvent
  | PermissionRequestEvent
  | PortOpenedEvent
  | PortClosedEvent
  | SecretUsedEvent
  | SecretWithheldEvent
  | SshSignedEvent
  | SshRefusedEvent
  | TlsInterceptedEvent
  | PermissionResolvedEvent
  | LspNotificationEvent
  | DownloadProgressEvent
  | ErrorEvent;

/** Every value of {@link SessionEvent}'s `event` field, in declaration order. */
export const SESSION_EVENT_KINDS = [
  "status",
  "boot_queued",
  "ready",
  "startup_error",
  "heartbeat_failure",
  "restarting",
  "failed",
  "idle_stop",
  "idle_suspend",
  "config_changed",
  "folder_mounted",
  "folder_unmounted",
  "shadow_exported",
  "shadow_lost",
  "shadow_diff",
  "shadow_applied",
  "outputs_file_created",
  "outputs_file_deleted",
  "spawned",
  "spawn_failed",
  "stdout",
  "stderr",
  "exit",
  "egress",
  "egress_closed",
  "permission_request",
  "port_opened",
  "port_closed",
  "secret_used",
  "secret_withheld",
  "ssh_signed",
  "ssh_refused",
  "tls_intercepted",
  "permission_resolved",
  "lsp_notification",
  "download_progress",
  "error",
] as const;

/** The session's status changed. */
export interface StatusEvent {
  event: "status";
  status: SessionStatus;
  reason?: string | null;
}

/** The boot waits for a slot: `position` boots are ahead of it (1 = next). */
export interface BootQueuedEvent {
  event: "boot_queued";
  position: number;
}

/** The VM is up and its agent answers. */
export interface ReadyEvent {
  event: "ready";
  backend: string;
  /** Why this backend (what `auto` saw). */
  why: string;
  boot_ms: number;
  bundle: string;
}

/** Starting (or restarting) failed. */
export interface StartupErrorEvent {
  event: "startup_error";
  error: ApiError;
}

/** The VM stopped answering or went away; a restart follows unless the session gives up. */
export interface HeartbeatFailureEvent {
  event: "heartbeat_failure";
  reason: string;
}

/** The VM is being booted again after a failure. */
export interface RestartingEvent {
  event: "restarting";
  /** 1 for the first restart in the current window. */
  attempt: number;
  reason: string;
  /** Back-off before this boot. */
  delay_ms: number;
}

/** The session gave up after too many failures. */
export interface FailedEvent {
  event: "failed";
  reason: string;
  /** The last console lines of the VM that failed. */
  console: string;
}

/** Stopped after `idle_secs` with no running process and no client activity. */
export interface IdleStopEvent {
  event: "idle_stop";
  idle_secs: number;
}

/**
 * Suspended into a snapshot after `idle_secs` idle (`idle_action: suspend`); the next call
 * naming the session restores it. Since API 1.8.
 */
export interface IdleSuspendEvent {
  event: "idle_suspend";
  idle_secs: number;
}

/**
 * umbrad's configuration or the machine's system policy changed: `what` is
 * `configuration` (by `config.set`, or its file edited) or `system_policy` (its file
 * edited); `path` is the file. Host event. Since API 1.8.
 */
export interface ConfigChangedEvent {
  event: "config_changed";
  what: string;
  path: string;
}

/** A folder is shared (at start, after a restart or resume, or by `folder.mount`). */
export interface FolderMountedEvent {
  event: "folder_mounted";
  name: string;
  host_path: string;
  guest_path: string;
  mode: ShareMode;
}

/** `event`: `folder_unmounted`. */
export interface FolderUnmountedEvent {
  event: "folder_unmounted";
  name: string;
}

/** Unapplied shadow changes saved before the VM was replaced. */
export interface ShadowExportedEvent {
  event: "shadow_exported";
  folder: string;
  /** A tar with the changed files and a list of deletions. */
  path: string;
}

/** Unapplied shadow changes could not be saved (the agent did not answer): they are lost. */
export interface ShadowLostEvent {
  event: "shadow_lost";
  folder: string;
  reason: string;
}

/**
 * What a shadow folder's guest side changed (`vmctl run --shadow-diff`), as captured in
 * change-set `changeset`.
 */
export interface ShadowDiffEvent {
  event: "shadow_diff";
  folder: string;
  changeset: string;
  changes: ShadowEntry[];
}

/** A shadow folder's changes were written to the host folder (`vmctl run --shadow-apply`). */
export interface ShadowAppliedEvent {
  event: "shadow_applied";
  folder: string;
  report: ShadowApplyReport;
}

/** A file appeared in the session's outputs folder. `path` is relative to it. */
export interface OutputsFileCreatedEvent {
  event: "outputs_file_created";
  path: string;
  host_path: string;
}

/** `event`: `outputs_file_deleted`. */
export interface OutputsFileDeletedEvent {
  event: "outputs_file_deleted";
  path: string;
  host_path: string;
}

/** A process started. */
export interface SpawnedEvent {
  event: "spawned";
  process: number;
  /** Its pid in the guest. */
  pid: number;
  argv: string[];
}

/** A process could not be started. */
export interface SpawnFailedEvent {
  event: "spawn_failed";
  process: number;
  error: ApiError;
}

/** Output of a process (to its owner only). */
export interface StdoutEvent {
  event: "stdout";
  process: number;
  data: string;
  encoding?: Encoding;
  /** Where in the stream `data` starts, for a kept process (`process.attach`). */
  offset?: number | null;
}

/** Error output of a process (to its owner only). */
export interface StderrEvent {
  event: "stderr";
  process: number;
  data: string;
  encoding?: Encoding;
  /** Where in the stream `data` starts, for a kept process (`process.attach`). */
  offset?: number | null;
}

/** A process ended. Its output all came before this; nothing about it follows. */
export interface ExitEvent extends ProcessExit {
  event: "exit";
}

/** The host decided on a connection (or a DNS lookup) the guest asked for. */
export interface EgressEvent {
  event: "egress";
  /** The name asked for (or an address literal). */
  name: string;
  /** 0 for a DNS lookup. */
  port: number;
  /** How it reached the guest agent. */
  via: EgressVia;
  allowed: boolean;
  /** The address the host connected to (or that the name resolved to). */
  address?: string | null;
  /** Why it was refused (or failed), when it was. */
  reason?: string | null;
}

/** An allowed connection closed. */
export interface EgressClosedEvent {
  event: "egress_closed";
  name: string;
  port: number;
  /** Bytes from the guest to the destination. */
  bytes_sent: number;
  /** Bytes from the destination to the guest. */
  bytes_received: number;
  duration_ms: number;
}

/**
 * A command needs a person's approval before it runs (the session's approval settings,
 * or a hook, said `ask`): answer with `permission.respond`. No answer within
 * `timeout_secs` denies it.
 */
export interface PermissionRequestEvent {
  event: "permission_request";
  request_id: string;
  /** Seconds until silence counts as denied. */
  timeout_secs: number;
  /** The command line as the rules saw it (argv, shell-quoted). Commands only. */
  command?: string;
  /** Its working directory in the guest. Commands only. */
  cwd?: string;
  /**
   * What the rules decided and why; `parts` are the simple commands it runs (the
   * candidates for an allow list). Commands only.
   */
  decision?: Decision | null;
  /** The variables it would run with on top of the guest's defaults (the spawn's `env`). */
  env?: Record<string, string>;
  /**
   * The names in `env` that change what runs (`PATH`, `LD_PRELOAD`, `BASH_ENV`, `GIT_*`,
   * `PYTHONPATH`, `NODE_OPTIONS`, …): worth a person's look before approving.
   */
  env_changes_what_runs?: string[];
  /** The name (or address) the guest wants to connect to. Network only. */
  host?: string | null;
  /**
   * What is asked for: a command to run (`process.spawn` under approval settings), or a
   * connection to a name outside a session's allowlist (network mode `ask`).
   *
   * @defaultValue `"command"`
   */
  kind?: PermissionKind;
  /** Its port. Network only. */
  port?: number | null;
  /**
   * The guest process that opened the connection, where the guest's agent could tell
   * (`pid`, `command`): what the guest reports, so something to show, not to trust.
   * Network only.
   */
  process?: EgressProcess | null;
  /** How the connection reached the agent (`http`, `socks`, `transparent`). Network only. */
  via?: EgressVia | null;
}

/**
 * A guest program started listening on a TCP port an exposed port reaches (loopback or
 * wildcard). `exposed`: where the host listens for it, when it is exposed (at once, with
 * the session's `auto_expose`).
 */
export interface PortOpenedEvent {
  event: "port_opened";
  port: number;
  exposed?: PortInfo | null;
  process?: EgressProcess | null;
}

/** Nothing in the guest listens on `port` any more (an automatic exposure of it ends). */
export interface PortClosedEvent {
  event: "port_closed";
  port: number;
}

/**
 * The proxy put a secret's value in place of its placeholder, in a request to a host the
 * secret is bound to. Never the value.
 */
export interface SecretUsedEvent {
  event: "secret_used";
  name: string;
  host: string;
}

/**
 * A secret's placeholder went to a host it is not bound to: it was passed on as the
 * placeholder, never the value.
 */
export interface SecretWithheldEvent {
  event: "secret_withheld";
  name: string;
  host: string;
}

/** The session's SSH agent signed a login with key `key` to `host`. */
export interface SshSignedEvent {
  event: "ssh_signed";
  key: string;
  host: string;
}

/**
 * The session's SSH agent refused to sign with key `key`, saying why (another server, no
 * session binding, a forwarded agent).
 */
export interface SshRefusedEvent {
  event: "ssh_refused";
  key: string;
  reason: string;
}

/**
 * The proxy terminated the guest's TLS to `host` (a host a secret is bound to) and made
 * its own verified connection upstream; `error` when that failed (the guest got a 502).
 */
export interface TlsInterceptedEvent {
  event: "tls_intercepted";
  host: string;
  port: number;
  error?: string | null;
}

/** A permission request was answered (or timed out). */
export interface PermissionResolvedEvent {
  event: "permission_resolved";
  request_id: string;
  approved: boolean;
  /** `approved`, `denied by the user`, or `no answer within N s`. */
  reason: string;
}

/**
 * A language server started with `lsp.start` sent a notification (`window/logMessage`,
 * `textDocument/publishDiagnostics`, `$/progress`, ...), as it sent it.
 */
export interface LspNotificationEvent {
  event: "lsp_notification";
  /** The server's id (`lsp.start`). */
  server: number;
  method: string;
  /** @defaultValue `null` */
  params?: unknown;
}

/** A bundle download made progress. */
export interface DownloadProgressEvent extends Progress {
  event: "download_progress";
}

/** Something failed outside any one request (`vmctl run` reports its own errors so). */
export interface ErrorEvent {
  event: "error";
  error: ApiError;
}

/** A session as `session.get` and `session.list` report it. */
export interface SessionInfo {
  name: string;
  status: SessionStatus;
  settings: SessionSettings;
  /** The user's folders, then `outputs` and `uploads`. */
  folders: FolderInfo[];
  /** `$XDG_DATA_HOME/umbra/sessions/<name>`: holds `outputs/`, `uploads/` and `disk.img`. */
  storage_dir: string;
  /** Processes running in the session now. */
  processes: number;
  /** VM restarts since the session was last started or resumed. */
  restarts: number;
  /** Milliseconds since the epoch. */
  created_ms: number;
  /** Why the session last stopped or failed. */
  last_error?: string | null;
  /**
   * Which source decided each field of its sandbox policy at its start: `system` (the
   * machine's system policy), `admin` (umbrad's configuration), `session` (the start's).
   * Since API 1.8.
   */
  policy_decided_by?: DecidedBy | null;
  /** Its exposed ports. */
  ports?: PortInfo[];
  /** Its secrets: names, placeholders and hosts, never a value. */
  secrets?: SecretInfo[];
  /** The session's snapshot (`session.snapshot`, or the one it was forked from), if any. */
  snapshot?: SnapshotInfo | null;
  /** Its SSH keys: names, fingerprints and hosts. */
  ssh_keys?: SshKeyInfo[];
  /**
   * Stopped by `idle_action: suspend`: the next call naming it restores its snapshot, with
   * its detached processes and terminals. Since API 1.8.
   */
  suspended?: boolean;
  /** The running VM, when there is one. */
  vm?: VmInfo | null;
}

export interface SessionList {
  sessions: SessionInfo[];
}

export interface SessionLogs {
  /**
   * The session's recent lifecycle events (status, restarts, folders, process starts and
   * exits), oldest first.
   */
  events: SessionEvent[];
  /** The last lines of the running (or last) VM's console. */
  console: string[];
}

export interface SessionRef {
  name: string;
}

/**
 * How a session's VM is sized and watched. A session keeps the values it was started with;
 * what a start does not set comes from the daemon's configuration.
 */
export interface SessionSettings {
  /**
   * Command approval for `process.spawn`; absent, every command runs. `session.start`
   * merges its settings with the daemon's (the stricter mode, both deny lists, both hooks).
   */
  approval?: ApprovalSettings | null;
  /**
   * Expose every port a guest program starts listening on (loopback or wildcard) on a free
   * host port of 127.0.0.1, and take it away when the program stops listening.
   */
  auto_expose?: boolean;
  /**
   * Which VM backend runs it.
   *
   * @defaultValue `"auto"`
   */
  backend?: BackendChoice;
  /**
   * Which bundle boots it: an installed version, `current`, or a built flavor (`minimal`,
   * `standard`) or bundle directory. `current` with nothing installed is the flavor this
   * machine built (`minimal` first).
   *
   * @defaultValue `"current"`
   */
  bundle?: string;
  /**
   * Guest vCPUs.
   *
   * @defaultValue `1`
   */
  cpus?: number;
  /**
   * Size of the writable session disk (sparse: only what the guest writes takes space); 0
   * keeps the guest's writes in its RAM, lost when the VM ends.
   *
   * @defaultValue `8192`
   */
  disk_size_mib?: number;
  /**
   * How often the agent is pinged.
   *
   * @defaultValue `5`
   */
  heartbeat_interval_secs?: number;
  /**
   * How long a ping may take before the VM counts as failed and is restarted.
   *
   * @defaultValue `15`
   */
  heartbeat_timeout_secs?: number;
  /**
   * What the idle timeout does: `stop`, or `suspend` (a snapshot the next call restores;
   * the kvm backend only, others stop).
   */
  idle_action?: IdleAction;
  /**
   * Stop the session after this long with no running process and no client activity; 0
   * never stops it.
   *
   * @defaultValue `900`
   */
  idle_timeout_secs?: number;
  /**
   * Guest memory.
   *
   * @defaultValue `512`
   */
  memory_mib?: number;
  /**
   * What the guest may connect to (through the host's egress proxy; the guest has no
   * network interface of its own).
   *
   * @defaultValue `{"mode":"none"}`
   */
  network?: NetworkPolicy;
  /**
   * The sandbox policy, enforced on the host when the VM boots: the workspace folders' mode,
   * extra paths, read-only `.git` and `/tmp`, hidden files and (when it has one) the
   * network. `session.start` merges its policy with the daemon's default, field by field,
   * the most restrictive winning.
   */
  policy?: SandboxPolicy;
}

/**
 * Where a session is in its life. `starting → ready → (restarting → ready)* → stopping →
 * stopped | failed`; a stopped or failed session can be resumed (back to `starting`).
 *
 * - `"starting"`: Waiting for a boot slot, booting, or mounting its folders.
 * - `"ready"`: The agent answers and every folder is mounted: commands can run.
 * - `"restarting"`: The VM failed (missed heartbeat, lost agent, VMM exit) and is being booted again.
 * - `"stopping"`: Its processes and VM are being ended.
 * - `"stopped"`: No VM; the session's folders, outputs and disk are kept, and it can be resumed.
 * - `"failed"`: It could not be (re)started; the last error says why. It can be resumed.
 */
export type SessionStatus = "starting" | "ready" | "restarting" | "stopping" | "stopped" | "failed";

/** Params of `session.set_network`. */
export interface SetNetworkParams {
  name: string;
  network: NetworkPolicy;
}

/** Params of `session.set_secret`. */
export interface SetSecretParams {
  name: string;
  /**
   * Replaces the secret of this name (its placeholder stays, so running processes keep
   * working) or adds one (processes spawned from now on see it).
   */
  secret: SecretSpec;
}

/**
 * Session settings to change: only the fields given. `session.start` takes one (over the
 * daemon's defaults), and so does `config.set` (the defaults themselves).
 */
export interface SettingsPatch {
  /** Command approval settings. */
  approval?: ApprovalSettings | null;
  /** Whether ports guest programs listen on are exposed as they appear. */
  auto_expose?: boolean | null;
  /** The VM backend. */
  backend?: BackendChoice | null;
  /** The bundle to boot. */
  bundle?: string | null;
  /** Guest vCPUs (1 to 64). */
  cpus?: number | null;
  /** Size of the session disk; 0 for none. */
  disk_size_mib?: number | null;
  /** Seconds between heartbeats. */
  heartbeat_interval_secs?: number | null;
  /** Seconds a heartbeat may take. */
  heartbeat_timeout_secs?: number | null;
  /** What the idle timeout does: `stop` or `suspend`. */
  idle_action?: IdleAction | null;
  /** Idle seconds before the session stops; 0 never. */
  idle_timeout_secs?: number | null;
  /** Guest memory (64 to 65536). */
  memory_mib?: number | null;
  /** The network policy (replaces the whole policy). */
  network?: NetworkPolicy | null;
  /** The sandbox policy, as JSON: `{"type": "workspace_readonly", "ignore": [".env"]}`. */
  policy?: SandboxPolicy | null;
}

/**
 * When `shadow.apply` writes an entry.
 *
 * - `"by_default"`: Applied unless `paths` leaves it out.
 * - `"when_named"`: Applied only when `paths` names it (`.git` and ignored paths).
 * - `"never"`: Never: a symlink or special file, or `.git` under the policy's `block_git_writes`.
 */
export type ShadowApplies = "by_default" | "when_named" | "never";

export interface ShadowApplyError {
  path: string;
  message: string;
}

export interface ShadowApplyParams {
  session: string;
  /** The shadow folder's name. */
  folder: string;
  /** The change-set `shadow.diff` returned: required (an apply without one is refused). */
  changeset?: string | null;
  /**
   * Apply only these paths of the change-set (each must be in it). `.git` and ignored
   * paths are applied only when named here. Default: every entry that applies by default.
   */
  paths?: string[] | null;
}

/** What applying a shadow folder's changes did. */
export interface ShadowApplyReport {
  /** Paths written to (or deleted from) the host folder. */
  applied: string[];
  /** Paths the host changed since the share started: left alone. */
  conflicts: ShadowConflict[];
  errors: ShadowApplyError[];
  /**
   * Entries of the change-set not applied: not named although they must be, or never
   * applied (see {@link ShadowApplies}).
   *
   * @defaultValue `[]`
   */
  skipped?: ShadowSkipped[];
}

export interface ShadowConflict {
  path: string;
  reason: string;
}

/** A shadow folder's changes, captured on the host as change-set `changeset`. */
export interface ShadowDiffResult {
  /**
   * What `shadow.apply` takes: it applies these entries' captured bytes and nothing else.
   * Valid until the folder's next `shadow.diff`, `shadow.reset` or unmount, or a restart.
   */
  changeset: string;
  changes: ShadowEntry[];
}

/**
 * One entry of a shadow folder's change-set: what the guest changed, as captured on the host
 * when the diff was taken. `shadow.apply` writes exactly these bytes (the `sha256`), never
 * what the guest holds by then.
 */
export interface ShadowEntry {
  /** Relative to the folder, `/`-separated. */
  path: string;
  kind: ChangeKind;
  /** Whether `shadow.apply` writes it without being told to. */
  applies: ShadowApplies;
  /** What the guest has at `path`: absent for a deletion. */
  file_kind?: FileKind | null;
  /**
   * The entry is (for a deletion: was) a directory.
   *
   * @defaultValue `false`
   */
  is_dir?: boolean;
  /** Why a reviewer should look twice (empty: nothing special). */
  risks?: ShadowRisk[];
  /** Lowercase hex SHA-256 of the captured bytes, for an added or modified file. */
  sha256?: string | null;
  /** Bytes captured, for an added or modified file. */
  size?: number | null;
}

export interface ShadowParams {
  session: string;
  /** The shadow folder's name. */
  folder: string;
}

/**
 * What makes a shadow change worth a second look.
 *
 * - `"git"`: In a `.git` directory (any depth): git runs what its config and hooks name.
 * - `"git_hook"`: A git hook (`.git/hooks/...`).
 * - `"dotfile"`: A path component starts with `.` (shell, editor and tool configuration).
 * - `"executable"`: An executable file: new and executable, made executable, or replacing the contents of a host file that is executable (an apply keeps the host file's permissions).
 * - `"symlink"`: A symlink in the guest (never applied).
 * - `"special"`: Neither a regular file, a directory nor a symlink in the guest (never applied).
 * - `"ignored"`: Matched by the policy's `ignore` patterns: hidden from the guest, so a guest's version would replace a host file it never saw. For a deleted directory: one below it matches.
 */
export type ShadowRisk = "git" | "git_hook" | "dotfile" | "executable" | "symlink" | "special" | "ignored";

export interface ShadowSkipped {
  path: string;
  reason: string;
}

/**
 * How a shared folder is mounted in the guest.
 *
 * - `"ro"`: Read-only (enforced by the host, and by a read-only bind in the guest).
 * - `"rw"`: Create and modify; spawned processes may not unlink, rmdir or rename (landlock).
 * - `"rwd"`: Read, write and delete.
 * - `"shadow"`: The host folder read-only under an overlay whose writable layer lives in the guest.
 */
export type ShareMode = "ro" | "rw" | "rwd" | "shadow";

/**
 * A session's snapshot: its VM paused into the session's storage (memory, devices, disk,
 * folder table), which `session.resume` restores and `session.fork` copies.
 */
export interface SnapshotInfo {
  /** Milliseconds since the epoch. */
  taken_ms: number;
  /** The session that took it (a fork's snapshot names its source). */
  source: string;
  bundle_version: string;
  /** Bytes of guest memory the snapshot holds (a sparse file: untouched pages take no room). */
  memory_bytes: number;
  /** How long the guest was paused while its state and memory were written. */
  pause_ms: number;
  /**
   * Whether the next `session.resume` restores it (memory, detached processes, disk) rather
   * than booting: true from the snapshot until a resume restored it.
   */
  resumes: boolean;
}

export interface SpawnParams {
  session: string;
  /** The command; `argv[0]` is looked up in the guest's PATH. */
  argv: string[];
  /** Working directory in the guest (absolute). */
  cwd?: string | null;
  /**
   * Keep the process when this client goes: the session holds its output (bounded) and its
   * exit, and any client can `process.attach` to it.
   */
  detach?: boolean;
  /** @defaultValue `{}` */
  env?: Record<string, string>;
  /** SIGTERM after this many seconds, SIGKILL 3 s later; the exit says `timed_out`. */
  timeout_secs?: number | null;
  /** Run on a pseudo-terminal of this size (output then arrives as stdout only). */
  tty?: TtySize | null;
}

export interface Spawned {
  /** The process's id in this daemon (events name it). */
  process: number;
  /** Its pid in the guest. */
  pid: number;
}

/** A server an SSH key may be used for. */
export interface SshHostSpec {
  /** Its name, for events and for finding its keys in `~/.ssh/known_hosts`. */
  name: string;
  /**
   * Its host keys, OpenSSH public-key lines (`ssh-ed25519 AAAA…`); when absent, the
   * unhashed lines of umbrad's user's `~/.ssh/known_hosts` that name it.
   */
  host_keys?: string[];
}

/** An SSH key as `session.get` reports it. */
export interface SshKeyInfo {
  name: string;
  /** `SHA256:…`, as `ssh-add -l` shows it. */
  fingerprint: string;
  hosts: string[];
}

/**
 * An SSH key the session's agent holds on the host (the guest's `SSH_AUTH_SOCK` reaches it;
 * the private key never enters the guest), usable only for logins to `hosts`.
 */
export interface SshKeySpec {
  /** What events and `ssh-add -l` call it (the key's comment in the agent). */
  name: string;
  /**
   * The servers it may log in to, each known by its host keys (as `ssh-add -h` restricts a
   * key). At least one.
   */
  hosts: SshHostSpec[];
  /** A file of umbrad's user holding it (read at start and after umbrad restarts). */
  from_file?: string | null;
  /** The private key, OpenSSH format, unencrypted. Exactly one of this and `from_file`. */
  private_key?: SecretValue | null;
}

/** Params of `session.start`. */
export interface StartParams {
  /** The session's name: `[A-Za-z0-9._-]`, at most 64 bytes. */
  name: string;
  /** Command approval settings. */
  approval?: ApprovalSettings | null;
  /** Whether ports guest programs listen on are exposed as they appear. */
  auto_expose?: boolean | null;
  /** The VM backend. */
  backend?: BackendChoice | null;
  /** The bundle to boot. */
  bundle?: string | null;
  /** Guest vCPUs (1 to 64). */
  cpus?: number | null;
  /** Size of the session disk; 0 for none. */
  disk_size_mib?: number | null;
  /**
   * Host folders to share at `/sessions/<name>/mnt/<folder>`.
   *
   * @defaultValue `[]`
   */
  folders?: FolderSpec[];
  /** Seconds between heartbeats. */
  heartbeat_interval_secs?: number | null;
  /** Seconds a heartbeat may take. */
  heartbeat_timeout_secs?: number | null;
  /** What the idle timeout does: `stop` or `suspend`. */
  idle_action?: IdleAction | null;
  /** Idle seconds before the session stops; 0 never. */
  idle_timeout_secs?: number | null;
  /**
   * Since 1.11: boot an OCI image (`python:3.12-slim`, `ghcr.io/org/tool@sha256:…`) instead
   * of `bundle`: pulled and converted into a bundle first unless it was before (`images.md`);
   * its `Env`, `WorkingDir` and `User` become every process's defaults.
   */
  image?: string | null;
  /** Guest memory (64 to 65536). */
  memory_mib?: number | null;
  /** The network policy (replaces the whole policy). */
  network?: NetworkPolicy | null;
  /** The sandbox policy, as JSON: `{"type": "workspace_readonly", "ignore": [".env"]}`. */
  policy?: SandboxPolicy | null;
  /** Guest ports to reach from the host from the start (`session.expose`). */
  ports?: PortSpec[];
  /** Credentials the guest sees only as placeholders (`docs/network.md`, "Secrets"). */
  secrets?: SecretSpec[];
  /** SSH keys the session's agent holds on the host, each for the servers it names. */
  ssh_keys?: SshKeySpec[];
}

/**
 * Bytes in JSON: `data` holds UTF-8 text as it is (`encoding` absent or `utf8`) or base64
 * (`encoding: base64`). Output uses text where it is valid UTF-8 without many control
 * characters; a chunk boundary can split a character, so one stream may mix both, and
 * decoding each chunk and concatenating gives the exact bytes. File contents are base64.
 */
export interface StdinParams {
  session: string;
  process: number;
  data: string;
  encoding?: Encoding;
  /**
   * With `writer`: where this piece's first byte falls among the bytes that writer has
   * written. umbrad writes only what lies past the bytes it already took from the writer,
   * so a piece sent again after a lost connection is written once; a piece starting past
   * them is refused (`invalid_params`): the bytes between are missing. Since API 1.9.
   */
  offset?: number | null;
  /**
   * With `offset`: a name the client picks for its stream of stdin to this process (at
   * most 64 bytes; a random one per process and client), kept across its reconnections.
   * Since API 1.9.
   */
  writer?: string | null;
}

/** Which output stream. */
export type Stream = "stdout" | "stderr";

export interface SubscribeParams {
  /** Only this session's events (default: every session's, and the host's). */
  session?: string | null;
}

export interface Subscribed {
  subscription: number;
}

/**
 * An administrator's ceilings. Unknown fields are refused: a misspelt ceiling must not be a
 * silently absent one.
 */
export type SystemPolicy = {
  /**
   * Command approval every session has, at least this strict (its own allow and deny lists
   * and hooks still apply).
   */
  approval_mode?: ApprovalMode | null;
  /** Git metadata (`.git`) read-only in every shared folder. */
  block_git_writes?: boolean | null;
  /**
   * Where bundles may come from: URL prefixes (`https://bundles.example.com/`) that
   * `bundle.download` and `vmctl bundle pull` may fetch from, and directories beneath which a
   * session's `bundle` may name a bundle directory. Every redirect a download meets is held
   * to them too, before it is followed. Installed versions, `current` and the flavors this
   * machine built are always allowed. Unset: every source.
   */
  bundle_sources?: string[] | null;
  /**
   * False: every `session.start` (and resume, and fork) is refused with `disabled_by_admin`.
   *
   * @defaultValue `true`
   */
  enabled?: boolean;
  /** The most vCPUs a session may have. */
  max_cpus?: number | null;
  /** The largest session disk, in MiB. */
  max_disk_mib?: number | null;
  /** The most guest memory a session may have, in MiB. */
  max_memory_mib?: number | null;
  /** The network ceiling: what sessions may connect to, at most. */
  network?: NetworkPolicy | null;
  /**
   * The only public keys (`umbra-ed25519 <base64>` lines) downloaded bundles may be signed
   * by: the user's own trusted keys (umbrad's `trusted_keys`, the trusted-keys directory,
   * `vmctl --trusted-key`) are not consulted. Unset: the user's keys.
   */
  trusted_keys?: string[] | null;
  /**
   * Only folders beneath one of these absolute directories may be shared (after symlinks
   * are resolved). Unset: every folder.
   */
  trusted_roots?: string[] | null;
};

/** What `daemon.info` says of the system policy. */
export interface SystemPolicyInfo {
  /** The file it was read from. */
  path: string;
  policy: SystemPolicy;
}

/** Params of `terminal.attach`. */
export interface TerminalAttachParams {
  session: string;
  terminal: number;
  /**
   * Where to start (default: the start of the scrollback).
   *
   * @defaultValue `0`
   */
  from?: number;
}

/**
 * A terminal: a kept process on a pseudo-terminal. Its id is a process id: write to it with
 * `process.stdin`, acknowledge its output with `process.ack`.
 */
export interface TerminalInfo {
  terminal: number;
  pid: number;
  shell: string[];
  size: TtySize;
  /** Its scrollback: what the session holds of its output. */
  output: KeptRange;
  /** The shell's exit, once it ended. */
  exit?: ProcessExit | null;
}

export interface TerminalList {
  terminals: TerminalInfo[];
}

/** Params of `terminal.open`. */
export interface TerminalOpenParams {
  session: string;
  /** The terminal's size. */
  size: TtySize;
  /** Its working directory in the guest (absolute). */
  cwd?: string | null;
  /** @defaultValue `{}` */
  env?: Record<string, string>;
  /** The shell's argv; default a login shell: `bash -l` where the image has bash, else `sh -l`. */
  shell?: string[];
}

export interface TerminalRef {
  session: string;
  terminal: number;
}

export interface TerminalResizeParams {
  session: string;
  terminal: number;
  rows: number;
  cols: number;
}

/** Params of `terminal.run`. */
export interface TerminalRunParams {
  session: string;
  terminal: number;
  /**
   * A command line for the terminal's shell, run in the shell itself (so `cd` and variables
   * stay for the next): it may hold several lines, at most 64 KiB.
   */
  command: string;
  /**
   * Give up waiting after this many seconds, counted from the call (the command keeps
   * running); default: no limit.
   */
  timeout_secs?: number | null;
}

/**
 * What `terminal.run`'s command left: its exit status and the shell's working directory
 * after it, reported by the shell itself through a marker with a nonce of this run (its
 * output went to the terminal, and to its attached clients, as any other).
 */
export interface TerminalRunResult {
  exit_code: number;
  cwd: string;
}

export interface TtySize {
  rows: number;
  cols: number;
}

/** Params of `session.unexpose`. */
export interface UnexposeParams {
  session: string;
  guest_port: number;
}

export interface UnmountParams {
  session: string;
  name: string;
}

export interface UnsubscribeParams {
  subscription: number;
}

/** Params of `session.update`. */
export interface UpdateParams {
  name: string;
  /** The settings to change (only those given), as `session.start` takes them. */
  settings: SettingsPatch;
}

/** What `session.update` changed. */
export interface Updated {
  session: SessionInfo;
  /**
   * Fields in force at once on the running session (`approval`, `network`,
   * `idle_timeout_secs`, `idle_action`, `auto_expose`).
   */
  applied: string[];
  /**
   * Fields recorded that take effect at its next boot (stop and resume): the VM's size,
   * heartbeat, bundle, backend and sandbox policy (its folders' modes are set at a boot).
   */
  next_boot: string[];
}

/** The answer; `Ord` is the order of strictness (`Deny` strictest). */
export type Verdict = "allow" | "ask" | "deny";

/** The VM behind a running session. */
export interface VmInfo {
  /** `kvm` or `qemu`. */
  backend: string;
  /** Why `auto` chose it. */
  backend_reason: string;
  bundle_version: string;
  /** Launch → agent ready. */
  boot_ms: number;
  /** Host pids of the VMM and its helper processes. */
  pids: number[];
  /** The VM's private run directory on the host (sockets, console log). */
  run_dir: string;
  /**
   * The VM came booted from the warm pool (`boot_ms` is then its boot there).
   *
   * @defaultValue `false`
   */
  from_pool?: boolean;
  /**
   * Host memory the VM holds now, in KiB: the proportional set size (PSS) of the VMM and
   * its helpers, so guest memory they all map counts once. Absent for an in-process VM or
   * where `/proc` cannot tell. Since API 1.9.
   */
  host_memory_kib?: number | null;
}

/**
 * Bytes in JSON: `data` holds UTF-8 text as it is (`encoding` absent or `utf8`) or base64
 * (`encoding: base64`). Output uses text where it is valid UTF-8 without many control
 * characters; a chunk boundary can split a character, so one stream may mix both, and
 * decoding each chunk and concatenating gives the exact bytes. File contents are base64.
 */
export interface WriteParams {
  session: string;
  path: string;
  data: string;
  /**
   * Append instead of replacing the file.
   *
   * @defaultValue `false`
   */
  append?: boolean;
  /** @defaultValue `false` */
  create_dirs?: boolean;
  encoding?: Encoding;
  /**
   * `path` is a host path inside a shared folder.
   *
   * @defaultValue `false`
   */
  host?: boolean;
  /** Write at this offset instead (the file is not truncated). */
  offset?: number | null;
  /** Permission bits of a file this creates (default 0644). */
  permissions?: number | null;
}

export interface Written {
  bytes: number;
}

/** Every method umbrad serves, with the types of its params and result. */
export interface Methods {
  /** What this daemon is: versions, pid, uid and socket. */
  "daemon.info": { params: NoParams; result: DaemonInfo };
  /** The configuration (session defaults, bundle source). */
  "config.get": { params: NoParams; result: DaemonConfig };
  /** Changes some settings; returns the whole new configuration. */
  "config.set": { params: ConfigPatch; result: DaemonConfig };
  /** The warm pool: its target, its ready and booting VMs. */
  "pool.status": { params: NoParams; result: PoolStatus };
  /** Installed bundles, the current one and any download in progress. */
  "bundle.status": { params: NoParams; result: BundleStatus };
  /** Downloads, verifies and installs a bundle (progress as `download_progress` events). */
  "bundle.download": { params: DownloadParams; result: Downloaded };
  /**
   * Downloads a bundle again from scratch even if it is installed; the installed copy is replaced only once the new one is verified.
   */
  "bundle.delete_and_reinstall": { params: ReinstallParams; result: Downloaded };
  /**
   * Creates and boots a session; returns once it is ready. Starting a session that is already starting waits for that start.
   */
  "session.start": { params: StartParams; result: SessionInfo };
  /**
   * Boots a stopped or failed session again, with its folders, outputs and disk; a session paused by `session.snapshot` is restored instead (with `discard_snapshot`, booted).
   */
  "session.resume": { params: ResumeParams; result: SessionInfo };
  /** Ends a session's processes and destroys its VM; its folders, outputs and disk stay. */
  "session.stop": { params: SessionRef; result: SessionInfo };
  /**
   * Pauses a running session into a snapshot in its storage (memory, devices, disk, folder table) and stops it; `session.resume` restores it. Its processes get a `lost` exit now and are ended at the restore; detached ones run on. The kvm backend only: elsewhere the error is `unsupported`.
   */
  "session.snapshot": { params: SessionRef; result: SessionInfo };
  /**
   * A new session restored from another's snapshot, with its own disk, outputs, uploads, entropy and hostname; a running source on kvm runs on, paused only while the fork's snapshot is captured (a live fork); on another backend it is snapshotted and resumed first (so its processes end as at a snapshot; detached ones run on).
   */
  "session.fork": { params: ForkParams; result: SessionInfo };
  /** Stops a session and removes it with its outputs, uploads and disk. */
  "session.delete": { params: SessionRef; result: Done };
  /**
   * Replaces a session's network policy; new connections follow it at once (open ones are not cut), and restarts and resumes keep it.
   */
  "session.set_network": { params: SetNetworkParams; result: SessionInfo };
  /**
   * Changes a session's settings, running or not: approval, network (within its policy's ceiling), the idle timeout and action and `auto_expose` take effect at once; the rest at its next boot, as the answer says. Since API 1.8.
   */
  "session.update": { params: UpdateParams; result: Updated };
  /**
   * Adds a secret to a session or gives one a new value (rotation), effective for the next request through the proxy; the value is never sent to the guest.
   */
  "session.set_secret": { params: SetSecretParams; result: SessionInfo };
  /**
   * Listens on a host port and carries each connection to a port of the session's guest, while the session lives (kept across its restarts, resumes and umbrad's).
   */
  "session.expose": { params: ExposeParams; result: PortInfo };
  /** Stops listening for a guest port; connections already carried end. */
  "session.unexpose": { params: UnexposeParams; result: Done };
  /** A session's exposed ports. */
  "session.ports": { params: SessionRef; result: PortList };
  /** Every session. */
  "session.list": { params: NoParams; result: SessionList };
  /** One session. */
  "session.get": { params: SessionRef; result: SessionInfo };
  /** A session's recent lifecycle events and console lines. */
  "session.logs": { params: LogsParams; result: SessionLogs };
  /** Starts a process; its output and exit arrive as `process.event` notifications. */
  "process.spawn": { params: SpawnParams; result: Spawned };
  /** Writes to a process's stdin (waits while the guest has no room). */
  "process.stdin": { params: StdinParams; result: Done };
  /** Closes a process's stdin after what was written. */
  "process.close_stdin": { params: ProcessRef; result: Done };
  /** Signals a process's process group. */
  "process.kill": { params: KillParams; result: Done };
  /** Signals every process of a session. */
  "process.kill_all": { params: KillAllParams; result: Done };
  /** Resizes a process's pseudo-terminal. */
  "process.resize": { params: ResizeParams; result: Done };
  /**
   * Answers a `permission_request` event: the waiting `process.spawn` runs the command, or fails with `permission_denied`.
   */
  "permission.respond": { params: RespondPermissionParams; result: Done };
  /** Grants more output credit (see `OUTPUT_WINDOW`); usually a notification. */
  "process.ack": { params: AckParams; result: Done };
  /** The session's processes: running ones, and kept ones for a while after they ended. */
  "process.list": { params: InSession; result: ProcessList };
  /** Attaches to a kept process: its output from an offset, then as it comes, then its exit. */
  "process.attach": { params: AttachParams; result: Attached };
  /**
   * Opens a terminal: a login shell on a pseudo-terminal that keeps running when the client goes. Its output follows as `process.event`s to this client.
   */
  "terminal.open": { params: TerminalOpenParams; result: TerminalInfo };
  /** Attaches to a terminal: its scrollback, then its output as it comes. */
  "terminal.attach": { params: TerminalAttachParams; result: Attached };
  /** The session's terminals. */
  "terminal.list": { params: InSession; result: TerminalList };
  /** Changes a terminal's size. */
  "terminal.resize": { params: TerminalResizeParams; result: Done };
  /** Closes a terminal: its shell gets SIGHUP (SIGKILL if it has not ended 3 s later). */
  "terminal.close": { params: TerminalRef; result: Done };
  /**
   * Starts a language server in the guest on a folder and initializes it; it runs until `lsp.stop` or the VM's end. Its notifications arrive as `lsp_notification` events. Since API 1.10.
   */
  "lsp.start": { params: LspStartParams; result: LspServerInfo };
  /** Sends a language server a request (`textDocument/definition`, ...) and returns its answer. */
  "lsp.request": { params: LspRequestParams; result: LspResult };
  /** Sends a language server a notification (`textDocument/didOpen`, ...). */
  "lsp.notify": { params: LspNotifyParams; result: Done };
  /** Shuts a language server down (`shutdown`, `exit`; SIGKILL if it lingers). */
  "lsp.stop": { params: LspRef; result: Done };
  /** A session's language servers. */
  "lsp.list": { params: InSession; result: LspList };
  /**
   * The diagnostics a change to a folder's files would bring and take away, from the folder's language servers, without writing the change anywhere. Since API 1.10.
   */
  "diagnostics.for_change": { params: ForChangeParams; result: ForChange };
  /** Runs a command in a terminal's shell; answers with its exit status and the shell's working directory after it. */
  "terminal.run": { params: TerminalRunParams; result: TerminalRunResult };
  /** Shares a host folder with a running session. */
  "folder.mount": { params: MountParams; result: FolderInfo };
  /** Stops sharing a folder. */
  "folder.unmount": { params: UnmountParams; result: Done };
  /** Reads part of a file. */
  "file.read": { params: ReadParams; result: FileData };
  /** Writes (or appends to) a file. */
  "file.write": { params: WriteParams; result: Written };
  /** A file's metadata. */
  "file.stat": { params: PathParams; result: FileStat };
  /** A directory's entries. */
  "file.list": { params: ListParams; result: DirList };
  /** What the guest changed in a shadow folder, captured on the host as a change-set. */
  "shadow.diff": { params: ShadowParams; result: ShadowDiffResult };
  /** Writes a change-set's captured bytes to the host folder (conflicts are left alone). */
  "shadow.apply": { params: ShadowApplyParams; result: ShadowApplyReport };
  /** Writes a shadow folder's changes to a tar on the host. */
  "shadow.export": { params: ExportParams; result: Exported };
  /** Throws away a shadow folder's changes. */
  "shadow.reset": { params: ShadowParams; result: Done };
  /** Receive lifecycle events (as `event` notifications) of one session or all. */
  "events.subscribe": { params: SubscribeParams; result: Subscribed };
  /** Stops a subscription. */
  "events.unsubscribe": { params: UnsubscribeParams; result: Done };
}

/** A method's name. */
export type MethodName = keyof Methods;

/** Every method's name, in documentation order. */
export const METHOD_NAMES = [
  "daemon.info",
  "config.get",
  "config.set",
  "pool.status",
  "bundle.status",
  "bundle.download",
  "bundle.delete_and_reinstall",
  "session.start",
  "session.resume",
  "session.stop",
  "session.snapshot",
  "session.fork",
  "session.delete",
  "session.set_network",
  "session.update",
  "session.set_secret",
  "session.expose",
  "session.unexpose",
  "session.ports",
  "session.list",
  "session.get",
  "session.logs",
  "process.spawn",
  "process.stdin",
  "process.close_stdin",
  "process.kill",
  "process.kill_all",
  "process.resize",
  "permission.respond",
  "process.ack",
  "process.list",
  "process.attach",
  "terminal.open",
  "terminal.attach",
  "terminal.list",
  "terminal.resize",
  "terminal.close",
  "lsp.start",
  "lsp.request",
  "lsp.notify",
  "lsp.stop",
  "lsp.list",
  "diagnostics.for_change",
  "terminal.run",
  "folder.mount",
  "folder.unmount",
  "file.read",
  "file.write",
  "file.stat",
  "file.list",
  "shadow.diff",
  "shadow.apply",
  "shadow.export",
  "shadow.reset",
  "events.subscribe",
  "events.unsubscribe",
] as const;

/** Notifications umbrad sends (lines without `id`): method → params. */
export interface Notifications {
  /** A lifecycle event of a subscribed session (or of the host). */
  "event": SessionEvent;
  /** Subscribed events were dropped because this client read too slowly. */
  "events.lost": EventsLost;
  /** Events of a process this connection spawned: spawned, stdout, stderr, then exit. */
  "process.event": SessionEvent;
}

/** Every error code's JSON-RPC number (`error.code`), by its stable name (`error.data.code`). */
export const ERROR_CODES = {
  parse_error: -32700,
  invalid_request: -32600,
  method_not_found: -32601,
  invalid_params: -32602,
  internal: -32603,
  session_not_found: -32001,
  session_exists: -32002,
  invalid_state: -32003,
  not_found: -32004,
  permission_denied: -32005,
  already_exists: -32006,
  spawn_failed: -32007,
  boot_failed: -32010,
  session_lost: -32011,
  guest_error: -32012,
  timeout: -32013,
  too_large: -32014,
  busy: -32015,
  bundle_error: -32016,
  io: -32017,
  unsupported: -32018,
  unauthorized: -32019,
  unavailable: -32020,
  disabled_by_admin: -32021,
  unknown: -32099,
} as const;
