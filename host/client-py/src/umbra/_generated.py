# Generated from the Rust types in host/api (through the JSON Schema
# host/api/schema/umbrad-ipc.json) by host/api/src/python.rs: do not edit.
# `UMBRA_UPDATE_SCHEMA=1 cargo test -p umbra-api` rewrites it; a test fails when it is stale.
# The wire protocol and what every field means: docs/ipc.md.
"""The IPC's types, constants and error classes (generated)."""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypeAlias, TypedDict

from ._base import UmbraError

#: The IPC contract's version (`major.minor`) these types describe.
API_VERSION = "1.11"
#: Bytes of each output stream umbrad sends before it waits for `process.ack`.
OUTPUT_WINDOW = 1048576
#: Largest read or write of `file.read` / `file.write` in one request.
MAX_FILE_CHUNK = 1048576

class AckParams(TypedDict):
    """Flow control: the client has consumed `bytes` of a process's output and can take that much
    more. Each stream starts with [`OUTPUT_WINDOW`] bytes of credit; without acks the process
    blocks in the guest once its credit is spent. Usually sent as a notification (no id)."""

    session: str
    process: int
    stream: Stream
    bytes: int


class ApiError(TypedDict):
    """An error as a client sees it: a stable code and a message for people."""

    code: ErrorCode
    message: str


#: When commands run without asking (seed 003's auto-run modes).
ApprovalMode: TypeAlias = Literal["ask_every_time", "allowlist", "auto", "run_everything"]


#: Which programs approval sees.
ApprovalScope: TypeAlias = Literal["command", "guest"]


#: The approval settings of a session (merged from wherever they come from by the caller).
ApprovalSettings: TypeAlias = dict[str, Any]


#: Params of `process.attach`.
AttachParams = TypedDict(
    "AttachParams",
    {
        "session": "str",
        "process": "int",
        "from": "NotRequired[OutputOffsets]",
    },
)


class Attached(TypedDict):
    """The result of `process.attach` and `terminal.attach`: `process.event` notifications follow,
    output from the offsets asked for (each event's `offset` is its first byte's), then the
    exit. Until the client detaches or goes, it owns a view of the process like a spawner:
    `process.stdin`, `process.ack`, `process.kill` and `process.resize` act on it."""

    process: int
    pid: int
    stdout: KeptRange
    stderr: KeptRange
    #: Its exit, if it already ended (the event follows the output too).
    exit: NotRequired[ProcessExit | None]


#: Which VM backend to use.
BackendChoice: TypeAlias = Literal["auto", "kvm", "qemu", "vz"]


class BundleStatus(TypedDict):
    installed: list[InstalledInfo]
    #: Where the store lives.
    root: str
    #: The version sessions boot from `current`, if one is installed.
    current: NotRequired[str | None]
    #: Downloads in progress (the latest progress event of each).
    downloading: NotRequired[list[Progress]]
    #: The configured bundle URL.
    url: NotRequired[str | None]


ChangeKind: TypeAlias = Literal["added", "modified", "deleted"]


class ConfigPatch(TypedDict):
    """A `config.set`: the fields to change."""

    #: Command approval settings.
    approval: NotRequired[ApprovalSettings | None]
    #: Whether to download `bundle_url` into the warm slot in the background.
    auto_download: NotRequired[bool | None]
    #: Whether ports guest programs listen on are exposed as they appear.
    auto_expose: NotRequired[bool | None]
    #: The VM backend.
    backend: NotRequired[BackendChoice | None]
    #: Seconds a boot may take once admitted.
    boot_timeout_secs: NotRequired[int | None]
    #: The bundle to boot.
    bundle: NotRequired[str | None]
    #: The default download URL; an empty string clears it.
    bundle_url: NotRequired[str | None]
    #: Guest vCPUs (1 to 64).
    cpus: NotRequired[int | None]
    #: Size of the session disk; 0 for none.
    disk_size_mib: NotRequired[int | None]
    #: Seconds between heartbeats.
    heartbeat_interval_secs: NotRequired[int | None]
    #: Seconds a heartbeat may take.
    heartbeat_timeout_secs: NotRequired[int | None]
    #: What the idle timeout does: `stop` or `suspend`.
    idle_action: NotRequired[IdleAction | None]
    #: Idle seconds before the session stops; 0 never.
    idle_timeout_secs: NotRequired[int | None]
    #: Boots at once (0: twice the CPU count); takes effect at once.
    max_concurrent_boots: NotRequired[int | None]
    #: Failures allowed within the restart window.
    max_restarts: NotRequired[int | None]
    #: Guest memory (64 to 65536).
    memory_mib: NotRequired[int | None]
    #: The network policy (replaces the whole policy).
    network: NotRequired[NetworkPolicy | None]
    #: Replaces the list reached without the upstream proxy.
    no_proxy: NotRequired[list[str] | None]
    #: The sandbox policy, as JSON: `{"type": "workspace_readonly", "ignore": [".env"]}`.
    policy: NotRequired[SandboxPolicy | None]
    #: The guest memory the pool's idle VMs may hold together, in MiB.
    pool_memory_mib: NotRequired[int | None]
    #: VMs kept booted ahead of session starts (0: none); takes effect at once.
    pool_size: NotRequired[int | None]
    #: Whether exposed ports may bind beyond loopback (ports exposed already keep their bind).
    ports_beyond_loopback: NotRequired[bool | None]
    #: Whether exposed ports may use host ports below 1024.
    ports_privileged: NotRequired[bool | None]
    #: The restart window, in seconds.
    restart_window_secs: NotRequired[int | None]
    #: Replaces the list of extra upstream CA files.
    trust_ca: NotRequired[list[str] | None]
    #: The upstream HTTP proxy; `""` goes back to umbrad's environment.
    upstream_proxy: NotRequired[str | None]


class DaemonConfig(TypedDict):
    """umbrad's configuration (`config.get`), persisted in `$XDG_CONFIG_HOME/umbra/umbrad.json`.
    The session fields (flattened: one flat object) are the defaults a `session.start` uses for
    what it does not set."""

    #: Command approval for `process.spawn`; absent, every command runs. `session.start` merges its settings with the daemon's (the stricter mode, both deny lists, both hooks).
    approval: NotRequired[ApprovalSettings | None]
    #: Download `bundle_url` into the warm slot in the background when umbrad starts and when this is switched on; the next session start promotes it.
    auto_download: NotRequired[bool]
    #: Expose every port a guest program starts listening on (loopback or wildcard) on a free host port of 127.0.0.1, and take it away when the program stops listening.
    auto_expose: NotRequired[bool]
    #: Which VM backend runs it.
    backend: NotRequired[BackendChoice]
    #: How long a boot may take once it has a slot.
    boot_timeout_secs: NotRequired[int]
    #: Which bundle boots it: an installed version, `current`, or a built flavor (`minimal`, `standard`) or bundle directory. `current` with nothing installed is the flavor this machine built (`minimal` first).
    bundle: NotRequired[str]
    #: Where `bundle.download` fetches from when it is not given a URL.
    bundle_url: NotRequired[str | None]
    #: Guest vCPUs.
    cpus: NotRequired[int]
    #: Size of the writable session disk (sparse: only what the guest writes takes space); 0 keeps the guest's writes in its RAM, lost when the VM ends.
    disk_size_mib: NotRequired[int]
    #: How often the agent is pinged.
    heartbeat_interval_secs: NotRequired[int]
    #: How long a ping may take before the VM counts as failed and is restarted.
    heartbeat_timeout_secs: NotRequired[int]
    #: What the idle timeout does: `stop`, or `suspend` (a snapshot the next call restores; the kvm backend only, others stop).
    idle_action: NotRequired[IdleAction]
    #: Stop the session after this long with no running process and no client activity; 0 never stops it.
    idle_timeout_secs: NotRequired[int]
    #: Boots at once; further starts queue. 0: twice the host's CPU count.
    max_concurrent_boots: NotRequired[int]
    #: A session that fails more than this many times within `restart_window_secs` becomes `failed` instead of restarting again.
    max_restarts: NotRequired[int]
    #: Guest memory.
    memory_mib: NotRequired[int]
    #: What the guest may connect to (through the host's egress proxy; the guest has no network interface of its own).
    network: NotRequired[NetworkPolicy]
    #: Names (with the names below them), addresses and CIDRs reached directly, not through `upstream_proxy`; `*` for all. Unset: umbrad's `NO_PROXY`.
    no_proxy: NotRequired[list[str] | None]
    #: The sandbox policy, enforced on the host when the VM boots: the workspace folders' mode, extra paths, read-only `.git` and `/tmp`, hidden files and (when it has one) the network. `session.start` merges its policy with the daemon's default, field by field, the most restrictive winning.
    policy: NotRequired[SandboxPolicy]
    #: The most guest memory the pool's idle VMs may hold together; the pool keeps fewer VMs than `pool_size` when `pool_size × memory_mib` would exceed it.
    pool_memory_mib: NotRequired[int]
    #: VMs kept booted ahead of session starts, with the session defaults (bundle, backend, memory, cpus, disk size): a start whose settings match takes one instead of booting, and a replacement boots in the background. 0: no pool.
    pool_size: NotRequired[int]
    #: Whether `session.expose` may bind an address other than loopback (`0.0.0.0`, a LAN address), making a guest's port reachable from other machines.
    ports_beyond_loopback: NotRequired[bool]
    #: Whether `session.expose` may listen on a host port below 1024.
    ports_privileged: NotRequired[bool]
    #: The window `max_restarts` counts failures in.
    restart_window_secs: NotRequired[int]
    #: CA certificates (PEM files) the egress proxy trusts upstream besides the host's trust store, when it reads a request to give it a secret: a company's TLS-inspecting proxy.
    trust_ca: NotRequired[list[str]]
    #: Public keys (`umbra-ed25519 <base64>` lines) a downloaded bundle may be signed by, besides the `*.pub` files in `$XDG_CONFIG_HOME/umbra/trusted-keys/`. A system policy with `trusted_keys` replaces both. Not settable by `config.set`: whom to trust is the file's owner's decision, not any client's.
    trusted_keys: NotRequired[list[str]]
    #: The HTTP proxy every guest connection goes out through, as `CONNECT` tunnels: `http://[user:password@]host:port`. Unset: umbrad's `HTTPS_PROXY` (or `HTTP_PROXY`) when it has one, else none.
    upstream_proxy: NotRequired[str | None]


class DaemonInfo(TypedDict):
    #: umbrad's version.
    version: str
    #: The IPC contract's version (`major.minor`): a client should refuse a daemon of another major version.
    api_version: str
    pid: int
    uid: int
    socket: str
    #: The machine's system policy, when it has one (`docs/policy.md`). Since API 1.8.
    system_policy: NotRequired[SystemPolicyInfo | None]


class DecidedBy(TypedDict):
    """Which sources decided each field of a merged policy: those whose value is the result (for
    the type, the network mode and the flags), or that narrowed it (extra paths: each source
    that set them; ignore: each source that added patterns). Empty: no source set the field and
    the default applies."""

    type: list[PolicySource]
    network: list[PolicySource]
    #: Both `additional_readwrite_paths` and `additional_readonly_paths`.
    paths: list[PolicySource]
    block_git_writes: list[PolicySource]
    disable_tmp_write: list[PolicySource]
    ignore: list[PolicySource]


class Decision(TypedDict):
    """A decision: the verdict, the rule, and the commands the line was split into (the candidates
    a front end offers for the allow list)."""

    verdict: Verdict
    reason: Reason
    parts: list[list[str]]


class Diagnostic(TypedDict):
    """An LSP diagnostic of a file in the folder."""

    #: The file, relative to the folder (or the server's URI, for a file outside it).
    path: str
    #: LSP's range: 0-based lines and UTF-16 columns, in the changed file.
    range: Range
    message: str
    code: NotRequired[Any]
    #: 1 error, 2 warning, 3 information, 4 hint.
    severity: NotRequired[int | None]
    #: Which tool said it: `pyflakes`, `clang`, ...
    source: NotRequired[str | None]


class DirEntry(TypedDict):
    name: str
    kind: FileKind
    size: int


class DirList(TypedDict):
    entries: list[DirEntry]
    truncated: bool


#: The result of methods that only succeed or fail (`{}`).
Done: TypeAlias = dict[str, Any]


class DownloadParams(TypedDict):
    #: `https://` or `file://` of a bundle's `manifest.json` (or its directory); default: the configured `bundle_url`. The bundle must be signed by a trusted key (`bundle_error` otherwise, naming the signer).
    url: NotRequired[str | None]
    #: Into the warm slot: the next session start promotes it.
    warm: NotRequired[bool]


class Downloaded(TypedDict):
    version: str
    how: PulledHow
    #: Compressed bytes transferred.
    downloaded: int


class EgressProcess(TypedDict):
    """The agent's answer to [`EgressQuery::Process`]: the process holding the guest end of the
    connection, as the guest reports it — something to show a person, never to decide on (a
    guest's root can make any process claim anything). Empty when it cannot be known (the
    socket is gone, or belongs to no process the agent can see)."""

    #: Its command line, arguments joined by spaces: at most 256 bytes, every control and invisible format character shown as `?` (it is printed on people's terminals).
    command: NotRequired[str]
    #: Its process id in the guest.
    pid: NotRequired[int | None]


#: How the connection reached the agent (for the host's events and decisions' records).
EgressVia: TypeAlias = Literal["transparent", "http", "socks", "dns"]


Encoding: TypeAlias = Literal["utf8", "base64"]


#: What kind of failure an error is. The snake_case names are stable; new codes may be added,
#: and a client that does not know one sees [`ErrorCode::Unknown`].
ErrorCode: TypeAlias = Literal["parse_error", "invalid_request", "method_not_found", "invalid_params", "internal", "session_not_found", "session_exists", "invalid_state", "not_found", "permission_denied", "already_exists", "spawn_failed", "boot_failed", "session_lost", "guest_error", "timeout", "too_large", "busy", "bundle_error", "io", "unsupported", "unauthorized", "unavailable", "disabled_by_admin", "unknown"]


class EventsLost(TypedDict):
    """Params of [`NOTIFY_LOST`]."""

    #: Events dropped since the last one this client received.
    count: int


class ExportParams(TypedDict):
    session: str
    folder: str
    #: A host path for the tar; default: a new file in the session's storage directory.
    dest: NotRequired[str | None]


class Exported(TypedDict):
    path: str
    bytes: int


class ExposeParams(TypedDict):
    """Params of `session.expose`."""

    session: str
    #: The port a server listens on in the guest (on its loopback, or on every address).
    guest_port: int
    #: The host address to listen on: 127.0.0.1 unless given. Any other address (`0.0.0.0`, a LAN address) needs umbrad's `ports_beyond_loopback`; a host port below 1024, its `ports_privileged`.
    bind: NotRequired[str | None]
    #: The host port to listen on; unset or 0: a free one, chosen by the host.
    host_port: NotRequired[int | None]


class FileData(TypedDict):
    """Bytes in JSON: `data` holds UTF-8 text as it is (`encoding` absent or `utf8`) or base64
    (`encoding: base64`). Output uses text where it is valid UTF-8 without many control
    characters; a chunk boundary can split a character, so one stream may mix both, and
    decoding each chunk and concatenating gives the exact bytes. File contents are base64."""

    data: str
    #: The read reached the end of the file.
    eof: bool
    encoding: NotRequired[Encoding]


FileKind: TypeAlias = Literal["file", "dir", "symlink", "other"]


class FileStat(TypedDict):
    kind: FileKind
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ms: int


class FolderInfo(TypedDict):
    """A folder shared with a session."""

    name: str
    host_path: str
    mode: ShareMode
    #: `/sessions/<session>/mnt/<name>`.
    guest_path: str


class FolderSpec(TypedDict):
    """A host folder to share with a session."""

    #: Absolute host path of a directory.
    path: str
    #: `ro`, `rw` (no deletes), `rwd` or `shadow` (copy-on-write in the guest). Default `rw`.
    mode: NotRequired[ShareMode]
    #: The name under `/sessions/<session>/mnt/` (default: the folder's own name).
    name: NotRequired[str | None]


class ForChange(TypedDict):
    """What a change does to the diagnostics (`diagnostics.for_change`)."""

    #: Diagnostics the change brings: in the changed files afterwards, and not there before.
    diagnostics: list[Diagnostic]
    #: Diagnostics the change takes away: there before, and not afterwards.
    resolved: list[Diagnostic]
    #: Every diagnostic of the changed files afterwards.
    after: list[Diagnostic]
    #: Every server said it was done (a diagnostics report for each file, then no work in progress and a quiet period); false when `timeout_ms` ran out first, with what had come.
    complete: bool
    #: The languages whose servers were asked.
    languages: list[str]
    elapsed_ms: int


class ForChangeParams(TypedDict):
    """Params of `diagnostics.for_change`."""

    session: str
    #: The folder (by name) the change is to: a shadow or read-only folder, or any other.
    folder: str
    #: Path in the folder → its new content, or `null` for a deletion. Nothing is written: the change lives in the language server's open documents for the request's length.
    changes: dict[str, str | None]
    #: The language of every changed file; default: each file's, by its extension.
    language: NotRequired[str | None]
    #: How long the servers may take to answer once they are free and started (default 20 000, at most 300 000); waiting for them and starting them (on first use) is bounded apart (90 s).
    timeout_ms: NotRequired[int | None]


class ForkParams(TypedDict):
    """Params of `session.fork`."""

    #: The session to fork: its snapshot, or one taken of it as it runs on (kvm: a live fork).
    source: str
    #: The new session's name.
    name: str


class HookSpec(TypedDict):
    """An executable asked about each command."""

    #: Path of the executable.
    command: str
    #: Its arguments.
    args: NotRequired[list[str]]
    #: How long it may take to answer (default 5000).
    timeout_ms: NotRequired[int]


#: What an idle session's VM does at its idle timeout.
IdleAction: TypeAlias = Literal["stop", "suspend"]


class InSession(TypedDict):
    """Params of `process.list` and `terminal.list`."""

    session: str


#: Where in a request the proxy looks for a secret's placeholder.
Inject: TypeAlias = Literal["header", "basic", "query"]


class InstalledInfo(TypedDict):
    """One installed (or warm) bundle, as `vmctl bundle ls` shows it."""

    version: str
    flavor: str
    #: Uncompressed bytes of its artifacts.
    bytes: int
    #: Seconds since the epoch when it was completed.
    installed: int
    current: bool
    #: In the warm slot: downloaded ahead, not yet promoted.
    warm: bool
    dir: str


class KeptRange(TypedDict):
    """The output a session holds for a kept process, per stream: bytes `[start, end)`."""

    #: The offset of the oldest byte still kept.
    start: int
    #: Bytes written so far.
    end: int


class KillAllParams(TypedDict):
    session: str
    #: Default 9 (SIGKILL).
    signal: NotRequired[int]


class KillParams(TypedDict):
    session: str
    process: int
    #: Default 15 (SIGTERM).
    signal: NotRequired[int]


class ListParams(TypedDict):
    session: str
    path: str
    #: `path` is a host path inside a shared folder.
    host: NotRequired[bool]
    limit: NotRequired[int | None]


class LogsParams(TypedDict):
    name: str
    #: Lines of each log to return (default 100, at most 10000).
    lines: NotRequired[int | None]


class LspList(TypedDict):
    """A session's language servers (`lsp.list`)."""

    servers: list[LspServerInfo]


class LspNotifyParams(TypedDict):
    """Params of `lsp.notify`."""

    session: str
    server: int
    #: `textDocument/didOpen`, `textDocument/didChange`, ...
    method: str
    params: NotRequired[Any]


class LspRef(TypedDict):
    """A language server of a session (`lsp.stop`)."""

    session: str
    server: int


class LspRequestParams(TypedDict):
    """Params of `lsp.request`."""

    session: str
    server: int
    #: An LSP method: `textDocument/definition`, `textDocument/hover`, ...
    method: str
    params: NotRequired[Any]
    #: How long to wait for its answer (default 30 000, at most 300 000); past it the request is cancelled (`$/cancelRequest`) and the error is `timeout`.
    timeout_ms: NotRequired[int | None]


class LspResult(TypedDict):
    """The server's answer to `lsp.request` (an LSP error answer is the call's error instead:
    `guest_error`, with the server's code and message)."""

    result: NotRequired[Any]


class LspServerInfo(TypedDict):
    """A running language server."""

    #: Names it in `lsp.request`, `lsp.notify`, `lsp.stop` and `lsp_notification` events.
    server: int
    folder: str
    #: Its workspace root in the guest (`file://` + this is its `rootUri`).
    root: str
    command: list[str]
    #: What it answered `initialize` with: `capabilities` and `serverInfo`.
    initialize: NotRequired[Any]


class LspStartParams(TypedDict):
    """Params of `lsp.start`."""

    session: str
    #: The folder (by name) the server works on: its root is the folder's guest path.
    folder: str
    #: Another server to run instead (argv in the guest, speaking LSP on stdin and stdout).
    command: NotRequired[list[str] | None]
    #: The `initializationOptions` of its `initialize` request.
    initialization_options: NotRequired[Any]
    #: `python` (pylsp), `c` or `cpp` (clangd): the servers the standard image carries.
    language: NotRequired[str | None]


class MountParams(TypedDict):
    """A host folder to share with a session."""

    session: str
    #: Absolute host path of a directory.
    path: str
    #: `ro`, `rw` (no deletes), `rwd` or `shadow` (copy-on-write in the guest). Default `rw`.
    mode: NotRequired[ShareMode]
    #: The name under `/sessions/<session>/mnt/` (default: the folder's own name).
    name: NotRequired[str | None]


#: How much network a session gets. Every connection the guest opens is decided on the host,
#: by the name it was opened for.
NetworkMode: TypeAlias = Literal["none", "allowlist", "ask", "any"]


class NetworkPolicy(TypedDict):
    """A session's network policy."""

    #: Address ranges (`10.0.0.0/8`, `127.0.0.1/32`, `::1/128`) the guest may reach even though they are private, loopback or link-local, and that an address literal may name in `allowlist` mode.
    allow_cidrs: NotRequired[list[str]]
    #: Names the guest may connect to in `allowlist` mode: `example.com` (that name only) or `*.example.com` (any name below it, not `example.com` itself).
    allow_domains: NotRequired[list[str]]
    #: In `ask` mode, how long a connection waits for the user's answer (default 60 s, at most 3600); silence denies.
    ask_timeout_secs: NotRequired[int | None]
    mode: NotRequired[NetworkMode]
    #: Names the host resolves to a fixed address instead of asking DNS (like curl's `--resolve`): `{"allowed.test": "127.0.0.1"}`.
    resolve: NotRequired[dict[str, str]]
    #: Names whose TLS the host never opens (`pinned.example.com`, `*.example.com`), even when a secret is bound to them — say inside a `*.example.com` binding, for a client that pins its server's certificate. A secret's placeholder then reaches such a host unchanged.
    tls_passthrough: NotRequired[list[str]]


#: Params of methods that take none (`{}` or absent).
NoParams: TypeAlias = dict[str, Any]


class OutputOffsets(TypedDict):
    """Offsets into a kept process's output streams: bytes since it started."""

    stderr: NotRequired[int]
    stdout: NotRequired[int]


class PathParams(TypedDict):
    """A path in the session: a guest path (absolute, no `..`), or with `host` a host path inside
    one of the session's shared folders, translated to its guest path."""

    session: str
    path: str
    #: `path` is a host path inside a shared folder.
    host: NotRequired[bool]


#: An answer to a `permission_request`, as one word (`permission.respond`'s `decision`).
PermissionDecision: TypeAlias = Literal["deny", "allow_once", "allow_always"]


#: What a `permission_request` asks for.
PermissionKind: TypeAlias = Literal["command", "network"]


#: How far a `permission.respond` approval reaches.
PermissionScope: TypeAlias = Literal["once", "session", "always"]


Phase: TypeAlias = Literal["done", "manifest", "waiting", "download", "retry", "install", "promote"]


#: Where a policy came from, from the widest authority to the narrowest.
PolicySource: TypeAlias = Literal["system", "admin", "user", "session", "command"]


#: How much of the workspace a command may change. Ordered from the most restrictive
#: (`WorkspaceReadonly`) to the least (`InsecureNone`): `Ord` is the restriction order, which
#: merging relies on.
PolicyType: TypeAlias = Literal["workspace_readonly", "workspace_readwrite", "insecure_none"]


class PoolStatus(TypedDict):
    """The warm pool (`pool.status`): VMs booted ahead of session starts."""

    #: How many VMs the pool keeps (`pool_size`, within `pool_memory_mib`).
    target: int
    #: Booted VMs waiting for a session.
    ready: int
    #: VMs booting for the pool now.
    booting: int
    #: Sessions that started from the pool since umbrad started.
    taken: int
    #: The backend they run on.
    backend: NotRequired[str | None]
    #: The bundle version the pool's VMs run, once it has resolved one.
    bundle_version: NotRequired[str | None]
    #: Why the last refill failed, until one succeeds.
    last_error: NotRequired[str | None]
    #: The pool restores its VMs from a snapshot of one VM taken right after its agent announced itself, instead of booting each (the kvm backend).
    restores: NotRequired[bool]
    #: Why the pool boots its VMs although its backend could restore them: taking or restoring its snapshot failed.
    snapshot_error: NotRequired[str | None]


class PortInfo(TypedDict):
    """An exposed port."""

    guest_port: int
    #: Where the host listens for it.
    host_port: int
    bind: str
    #: Connections carried now.
    connections: NotRequired[int]


class PortList(TypedDict):
    """A session's exposed ports (`session.ports`)."""

    ports: list[PortInfo]


class PortSpec(TypedDict):
    """A port to expose, as `session.start {ports}` and `session.expose` take it."""

    #: The port a server listens on in the guest (on its loopback, or on every address).
    guest_port: int
    #: The host address to listen on: 127.0.0.1 unless given. Any other address (`0.0.0.0`, a LAN address) needs umbrad's `ports_beyond_loopback`; a host port below 1024, its `ports_privileged`.
    bind: NotRequired[str | None]
    #: The host port to listen on; unset or 0: a free one, chosen by the host.
    host_port: NotRequired[int | None]


class Position(TypedDict):
    line: int
    character: int


class ProcessExit(TypedDict):
    """How a process ended."""

    process: int
    duration_ms: int
    #: The exit code, when it exited by itself.
    code: NotRequired[int | None]
    #: The first signal the host forwarded to it (Ctrl-C in `vmctl`), if any.
    interrupted: NotRequired[int | None]
    #: Its end was not reported by the guest: the VM failed, restarted or stopped. `reason` says which.
    lost: NotRequired[bool]
    reason: NotRequired[str | None]
    #: The signal that ended it. A process whose VM went away is reported killed by SIGKILL (9) with `lost` set.
    signal: NotRequired[int | None]
    #: It was stopped because its timeout passed.
    timed_out: NotRequired[bool]


class ProcessInfo(TypedDict):
    """A process as `process.list` reports it."""

    process: int
    #: Its pid in the guest.
    pid: int
    argv: list[str]
    #: Kept by the session when its client goes (`detach`, or a terminal): it can be attached.
    detached: bool
    #: A terminal (`terminal.open`).
    terminal: bool
    #: Its exit, once it ended (kept processes only, for a while after).
    exit: NotRequired[ProcessExit | None]
    stderr: NotRequired[KeptRange | None]
    #: What of its output the session holds (kept processes only).
    stdout: NotRequired[KeptRange | None]


class ProcessList(TypedDict):
    processes: list[ProcessInfo]


class ProcessRef(TypedDict):
    session: str
    process: int


class Progress(TypedDict):
    phase: Phase
    version: str
    #: Compressed bytes received or found already on disk, over all artifacts.
    done: int
    #: Compressed bytes of all artifacts.
    total: int
    #: Bytes per second over the last few seconds.
    rate: float
    #: The artifact being downloaded, in `download` and `retry`.
    artifact: NotRequired[str | None]
    eta_secs: NotRequired[float | None]
    #: What went wrong before a retry, or other detail.
    message: NotRequired[str | None]


PulledHow: TypeAlias = Literal["downloaded", "already_installed", "promoted_warm", "warmed"]


class Range(TypedDict):
    start: Position
    end: Position


class ReadParams(TypedDict):
    session: str
    path: str
    #: `path` is a host path inside a shared folder.
    host: NotRequired[bool]
    #: At most [`MAX_FILE_CHUNK`] bytes (the default).
    len: NotRequired[int | None]
    offset: NotRequired[int]


class DenyListReason(TypedDict):
    """A part matched a deny pattern."""

    pattern: str
    part: str
    rule: Literal["deny_list"]


class UnparseableReason(TypedDict):
    """The line could not be split into commands; the error says why."""

    error: str
    rule: Literal["unparseable"]


class NoCommandReason(TypedDict):
    """The line runs no command."""

    rule: Literal["no_command"]


class DynamicProgramReason(TypedDict):
    """A part's program is an expansion, known only when the shell runs it."""

    part: str
    rule: Literal["dynamic_program"]


class PrivilegeReason(TypedDict):
    """`sudo` and the like."""

    program: str
    part: str
    rule: Literal["privilege"]


class RmRecursiveRootReason(TypedDict):
    """`rm -r` on `/`, a top-level directory, a home directory or a workspace folder itself."""

    path: str
    part: str
    rule: Literal["rm_recursive_root"]


class RmOutsideWorkspaceReason(TypedDict):
    """`rm` of a path outside every workspace folder."""

    path: str
    part: str
    rule: Literal["rm_outside_workspace"]


class RmUnknownTargetReason(TypedDict):
    """`rm` of a path only known when the shell runs (`"$DIR"`)."""

    target: str
    part: str
    rule: Literal["rm_unknown_target"]


class DotfileWriteReason(TypedDict):
    """With `protect_dotfiles`: `part` writes the dotfile `path` in a writable folder (or one
    whose place is only known when the shell runs)."""

    path: str
    part: str
    rule: Literal["dotfile_write"]


class AskEveryTimeReason(TypedDict):
    """The mode is ask-every-time."""

    rule: Literal["ask_every_time"]


class NotAllowlistedReason(TypedDict):
    """A part matched no allow pattern."""

    part: str
    rule: Literal["not_allowlisted"]


class EnvNotAllowedReason(TypedDict):
    """A part's words matched an allow pattern, but it runs with a variable that changes what
    runs (`variable`, as `NAME=value`) and that the pattern does not permit."""

    variable: str
    part: str
    rule: Literal["env_not_allowed"]


class AllowlistedReason(TypedDict):
    """Every part matched an allow pattern (these)."""

    patterns: list[str]
    rule: Literal["allowlisted"]


class RunEverythingReason(TypedDict):
    """The mode is run-everything."""

    rule: Literal["run_everything"]


class ContainedReason(TypedDict):
    """Mode `auto`: `part` matched no allow pattern, and runs because the sandbox contains it
    (`how`)."""

    how: str
    part: str
    rule: Literal["contained"]


class HookReason(TypedDict):
    """A hook answered."""

    hook: str
    permission: Verdict
    message: NotRequired[str | None]
    rule: Literal["hook"]


class HookFailedReason(TypedDict):
    """A hook failed or did not answer in time; a person decides instead."""

    hook: str
    error: str
    rule: Literal["hook_failed"]


#: The rule behind a verdict.
#:
#: The `rule` field tells the kinds apart.
Reason: TypeAlias = DenyListReason | UnparseableReason | NoCommandReason | DynamicProgramReason | PrivilegeReason | RmRecursiveRootReason | RmOutsideWorkspaceReason | RmUnknownTargetReason | DotfileWriteReason | AskEveryTimeReason | NotAllowlistedReason | EnvNotAllowedReason | AllowlistedReason | RunEverythingReason | ContainedReason | HookReason | HookFailedReason


#: Every value of Reason's `rule` field, in declaration order.
REASON_KINDS = (
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
)


class ReinstallParams(TypedDict):
    """Params of `bundle.delete_and_reinstall`."""

    #: `https://` or `file://` of the bundle to download again; default: the configured `bundle_url`.
    url: NotRequired[str | None]


class ResizeParams(TypedDict):
    session: str
    process: int
    rows: int
    cols: int


class RespondPermissionParams(TypedDict):
    """Params of `permission.respond`."""

    #: The `request_id` of a `permission_request` event.
    request_id: str
    #: Whether it may run (or connect); `decision`, when given, says it instead.
    approved: NotRequired[bool]
    #: `allow_once`, `allow_always` (its commands join the session's allow list) or `deny`: `approved` and `scope` in one word. Since API 1.8.
    decision: NotRequired[PermissionDecision | None]
    #: With `allow_always`: the commands also join the allow list of umbrad's configuration, so every new session allows them (the configuration must have approval settings). Since API 1.8.
    remember: NotRequired[bool]
    #: How far an approval reaches: `once` (the default) or `session` (a network name for the rest of the session).
    scope: NotRequired[PermissionScope]


class ResumeParams(TypedDict):
    """Params of `session.resume`."""

    name: str
    #: Deletes the session's snapshot and boots it from its disk instead: for a snapshot this host cannot restore (another umbra version, another CPU, its bundle gone). What the snapshot's memory held (processes, shadow changes not yet applied) is lost; the disk, outputs, uploads and folders stay.
    discard_snapshot: NotRequired[bool]


#: A sandbox policy as one source writes it. JSON example:
#: `{"type": "workspace_readwrite", "block_git_writes": true, "ignore": [".env"]}`.
SandboxPolicy: TypeAlias = dict[str, Any]


class SecretInfo(TypedDict):
    """A secret as `session.get` reports it: never its value."""

    name: str
    #: What the guest's processes see in `$name`.
    placeholder: str
    hosts: list[str]
    inject: list[Inject]
    #: Whether the host holds a value (a value given inline is gone after umbrad restarts, until `session.set_secret` gives it again).
    has_value: bool
    #: The variable of umbrad's environment it comes from, when it does.
    from_env: NotRequired[str | None]


class SecretSpec(TypedDict):
    """A secret as `session.start` and `session.set_secret` take it."""

    #: The environment variable the guest's processes see it as (holding the placeholder): letters, digits and `_`, not starting with a digit, at most 64 bytes.
    name: str
    #: The hosts that receive the value: `api.example.com` or `*.example.com` (any name below it). A request to any other host carries the placeholder unchanged.
    hosts: list[str]
    #: The name of a variable of umbrad's own environment holding the value.
    from_env: NotRequired[str | None]
    #: Where the placeholder is replaced: `header` and `basic` unless given.
    inject: NotRequired[list[Inject]]
    #: The value. Exactly one of `value` and `from_env`.
    value: NotRequired[SecretValue | None]


#: A secret's value. Its `Debug` never shows it; it is never part of a record, a log or an
#: event (the only things that serialize it are a client's request and its parse).
SecretValue: TypeAlias = str


class StatusEvent(TypedDict):
    """The session's status changed."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    status: SessionStatus
    reason: NotRequired[str | None]
    event: Literal["status"]


class BootQueuedEvent(TypedDict):
    """The boot waits for a slot: `position` boots are ahead of it (1 = next)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    position: int
    event: Literal["boot_queued"]


class ReadyEvent(TypedDict):
    """The VM is up and its agent answers."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    backend: str
    #: Why this backend (what `auto` saw).
    why: str
    boot_ms: int
    bundle: str
    event: Literal["ready"]


class StartupErrorEvent(TypedDict):
    """Starting (or restarting) failed."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    error: ApiError
    event: Literal["startup_error"]


class HeartbeatFailureEvent(TypedDict):
    """The VM stopped answering or went away; a restart follows unless the session gives up."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    reason: str
    event: Literal["heartbeat_failure"]


class RestartingEvent(TypedDict):
    """The VM is being booted again after a failure."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    #: 1 for the first restart in the current window.
    attempt: int
    reason: str
    #: Back-off before this boot.
    delay_ms: int
    event: Literal["restarting"]


class FailedEvent(TypedDict):
    """The session gave up after too many failures."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    reason: str
    #: The last console lines of the VM that failed.
    console: str
    event: Literal["failed"]


class IdleStopEvent(TypedDict):
    """Stopped after `idle_secs` with no running process and no client activity."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    idle_secs: int
    event: Literal["idle_stop"]


class IdleSuspendEvent(TypedDict):
    """Suspended into a snapshot after `idle_secs` idle (`idle_action: suspend`); the next call
    naming the session restores it. Since API 1.8."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    idle_secs: int
    event: Literal["idle_suspend"]


class ConfigChangedEvent(TypedDict):
    """umbrad's configuration or the machine's system policy changed: `what` is
    `configuration` (by `config.set`, or its file edited) or `system_policy` (its file
    edited); `path` is the file. Host event. Since API 1.8."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    what: str
    path: str
    event: Literal["config_changed"]


class FolderMountedEvent(TypedDict):
    """A folder is shared (at start, after a restart or resume, or by `folder.mount`)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    name: str
    host_path: str
    guest_path: str
    mode: ShareMode
    event: Literal["folder_mounted"]


class FolderUnmountedEvent(TypedDict):
    """`event`: `folder_unmounted`."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    name: str
    event: Literal["folder_unmounted"]


class ShadowExportedEvent(TypedDict):
    """Unapplied shadow changes saved before the VM was replaced."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    folder: str
    #: A tar with the changed files and a list of deletions.
    path: str
    event: Literal["shadow_exported"]


class ShadowLostEvent(TypedDict):
    """Unapplied shadow changes could not be saved (the agent did not answer): they are lost."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    folder: str
    reason: str
    event: Literal["shadow_lost"]


class ShadowDiffEvent(TypedDict):
    """What a shadow folder's guest side changed (`vmctl run --shadow-diff`), as captured in
    change-set `changeset`."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    folder: str
    changeset: str
    changes: list[ShadowEntry]
    event: Literal["shadow_diff"]


class ShadowAppliedEvent(TypedDict):
    """A shadow folder's changes were written to the host folder (`vmctl run --shadow-apply`)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    folder: str
    report: ShadowApplyReport
    event: Literal["shadow_applied"]


class OutputsFileCreatedEvent(TypedDict):
    """A file appeared in the session's outputs folder. `path` is relative to it."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    path: str
    host_path: str
    event: Literal["outputs_file_created"]


class OutputsFileDeletedEvent(TypedDict):
    """`event`: `outputs_file_deleted`."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    path: str
    host_path: str
    event: Literal["outputs_file_deleted"]


class SpawnedEvent(TypedDict):
    """A process started."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    process: int
    #: Its pid in the guest.
    pid: int
    argv: list[str]
    event: Literal["spawned"]


class SpawnFailedEvent(TypedDict):
    """A process could not be started."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    process: int
    error: ApiError
    event: Literal["spawn_failed"]


class StdoutEvent(TypedDict):
    """Output of a process (to its owner only)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    process: int
    data: str
    encoding: NotRequired[Encoding]
    #: Where in the stream `data` starts, for a kept process (`process.attach`).
    offset: NotRequired[int | None]
    event: Literal["stdout"]


class StderrEvent(TypedDict):
    """Error output of a process (to its owner only)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    process: int
    data: str
    encoding: NotRequired[Encoding]
    #: Where in the stream `data` starts, for a kept process (`process.attach`).
    offset: NotRequired[int | None]
    event: Literal["stderr"]


class ExitEvent(ProcessExit):
    """A process ended. Its output all came before this; nothing about it follows."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    event: Literal["exit"]


class EgressEvent(TypedDict):
    """The host decided on a connection (or a DNS lookup) the guest asked for."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    #: The name asked for (or an address literal).
    name: str
    #: 0 for a DNS lookup.
    port: int
    #: How it reached the guest agent.
    via: EgressVia
    allowed: bool
    #: The address the host connected to (or that the name resolved to).
    address: NotRequired[str | None]
    #: Why it was refused (or failed), when it was.
    reason: NotRequired[str | None]
    event: Literal["egress"]


class EgressClosedEvent(TypedDict):
    """An allowed connection closed."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    name: str
    port: int
    #: Bytes from the guest to the destination.
    bytes_sent: int
    #: Bytes from the destination to the guest.
    bytes_received: int
    duration_ms: int
    event: Literal["egress_closed"]


class PermissionRequestEvent(TypedDict):
    """A command needs a person's approval before it runs (the session's approval settings,
    or a hook, said `ask`): answer with `permission.respond`. No answer within
    `timeout_secs` denies it."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    request_id: str
    #: Seconds until silence counts as denied.
    timeout_secs: int
    #: The command line as the rules saw it (argv, shell-quoted). Commands only.
    command: NotRequired[str]
    #: Its working directory in the guest. Commands only.
    cwd: NotRequired[str]
    #: What the rules decided and why; `parts` are the simple commands it runs (the candidates for an allow list). Commands only.
    decision: NotRequired[Decision | None]
    #: The variables it would run with on top of the guest's defaults (the spawn's `env`).
    env: NotRequired[dict[str, str]]
    #: The names in `env` that change what runs (`PATH`, `LD_PRELOAD`, `BASH_ENV`, `GIT_*`, `PYTHONPATH`, `NODE_OPTIONS`, …): worth a person's look before approving.
    env_changes_what_runs: NotRequired[list[str]]
    #: The name (or address) the guest wants to connect to. Network only.
    host: NotRequired[str | None]
    #: What is asked for: a command to run (`process.spawn` under approval settings), or a connection to a name outside a session's allowlist (network mode `ask`).
    kind: NotRequired[PermissionKind]
    #: Its port. Network only.
    port: NotRequired[int | None]
    #: The guest process that opened the connection, where the guest's agent could tell (`pid`, `command`): what the guest reports, so something to show, not to trust. Network only.
    process: NotRequired[EgressProcess | None]
    #: How the connection reached the agent (`http`, `socks`, `transparent`). Network only.
    via: NotRequired[EgressVia | None]
    event: Literal["permission_request"]


class PortOpenedEvent(TypedDict):
    """A guest program started listening on a TCP port an exposed port reaches (loopback or
    wildcard). `exposed`: where the host listens for it, when it is exposed (at once, with
    the session's `auto_expose`)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    port: int
    exposed: NotRequired[PortInfo | None]
    process: NotRequired[EgressProcess | None]
    event: Literal["port_opened"]


class PortClosedEvent(TypedDict):
    """Nothing in the guest listens on `port` any more (an automatic exposure of it ends)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    port: int
    event: Literal["port_closed"]


class SecretUsedEvent(TypedDict):
    """The proxy put a secret's value in place of its placeholder, in a request to a host the
    secret is bound to. Never the value."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    name: str
    host: str
    event: Literal["secret_used"]


class SecretWithheldEvent(TypedDict):
    """A secret's placeholder went to a host it is not bound to: it was passed on as the
    placeholder, never the value."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    name: str
    host: str
    event: Literal["secret_withheld"]


class SshSignedEvent(TypedDict):
    """The session's SSH agent signed a login with key `key` to `host`."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    key: str
    host: str
    event: Literal["ssh_signed"]


class SshRefusedEvent(TypedDict):
    """The session's SSH agent refused to sign with key `key`, saying why (another server, no
    session binding, a forwarded agent)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    key: str
    reason: str
    event: Literal["ssh_refused"]


class TlsInterceptedEvent(TypedDict):
    """The proxy terminated the guest's TLS to `host` (a host a secret is bound to) and made
    its own verified connection upstream; `error` when that failed (the guest got a 502)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    host: str
    port: int
    error: NotRequired[str | None]
    event: Literal["tls_intercepted"]


class PermissionResolvedEvent(TypedDict):
    """A permission request was answered (or timed out)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    request_id: str
    approved: bool
    #: `approved`, `denied by the user`, or `no answer within N s`.
    reason: str
    event: Literal["permission_resolved"]


class LspNotificationEvent(TypedDict):
    """A language server started with `lsp.start` sent a notification (`window/logMessage`,
    `textDocument/publishDiagnostics`, `$/progress`, ...), as it sent it."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    #: The server's id (`lsp.start`).
    server: int
    method: str
    params: NotRequired[Any]
    event: Literal["lsp_notification"]


class DownloadProgressEvent(Progress):
    """A bundle download made progress."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    event: Literal["download_progress"]


class ErrorEvent(TypedDict):
    """Something failed outside any one request (`vmctl run` reports its own errors so)."""

    #: Milliseconds since the epoch.
    time_ms: int
    session: NotRequired[str | None]
    error: ApiError
    event: Literal["error"]


#: One event. `session` is absent for events about the host (bundle downloads).
#:
#: The `event` field tells the kinds apart.
SessionEvent: TypeAlias = StatusEvent | BootQueuedEvent | ReadyEvent | StartupErrorEvent | HeartbeatFailureEvent | RestartingEvent | FailedEvent | IdleStopEvent | IdleSuspendEvent | ConfigChangedEvent | FolderMountedEvent | FolderUnmountedEvent | ShadowExportedEvent | ShadowLostEvent | ShadowDiffEvent | ShadowAppliedEvent | OutputsFileCreatedEvent | OutputsFileDeletedEvent | SpawnedEvent | SpawnFailedEvent | StdoutEvent | StderrEvent | ExitEvent | EgressEvent | EgressClosedEvent | PermissionRequestEvent | PortOpenedEvent | PortClosedEvent | SecretUsedEvent | SecretWithheldEvent | SshSignedEvent | SshRefusedEvent | TlsInterceptedEvent | PermissionResolvedEvent | LspNotificationEvent | DownloadProgressEvent | ErrorEvent


#: Every value of SessionEvent's `event` field, in declaration order.
SESSION_EVENT_KINDS = (
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
)


class SessionInfo(TypedDict):
    """A session as `session.get` and `session.list` report it."""

    name: str
    status: SessionStatus
    settings: SessionSettings
    #: The user's folders, then `outputs` and `uploads`.
    folders: list[FolderInfo]
    #: `$XDG_DATA_HOME/umbra/sessions/<name>`: holds `outputs/`, `uploads/` and `disk.img`.
    storage_dir: str
    #: Processes running in the session now.
    processes: int
    #: VM restarts since the session was last started or resumed.
    restarts: int
    #: Milliseconds since the epoch.
    created_ms: int
    #: Why the session last stopped or failed.
    last_error: NotRequired[str | None]
    #: Which source decided each field of its sandbox policy at its start: `system` (the machine's system policy), `admin` (umbrad's configuration), `session` (the start's). Since API 1.8.
    policy_decided_by: NotRequired[DecidedBy | None]
    #: Its exposed ports.
    ports: NotRequired[list[PortInfo]]
    #: Its secrets: names, placeholders and hosts, never a value.
    secrets: NotRequired[list[SecretInfo]]
    #: The session's snapshot (`session.snapshot`, or the one it was forked from), if any.
    snapshot: NotRequired[SnapshotInfo | None]
    #: Its SSH keys: names, fingerprints and hosts.
    ssh_keys: NotRequired[list[SshKeyInfo]]
    #: Stopped by `idle_action: suspend`: the next call naming it restores its snapshot, with its detached processes and terminals. Since API 1.8.
    suspended: NotRequired[bool]
    #: The running VM, when there is one.
    vm: NotRequired[VmInfo | None]


class SessionList(TypedDict):
    sessions: list[SessionInfo]


class SessionLogs(TypedDict):
    #: The session's recent lifecycle events (status, restarts, folders, process starts and exits), oldest first.
    events: list[SessionEvent]
    #: The last lines of the running (or last) VM's console.
    console: list[str]


class SessionRef(TypedDict):
    name: str


class SessionSettings(TypedDict):
    """How a session's VM is sized and watched. A session keeps the values it was started with;
    what a start does not set comes from the daemon's configuration."""

    #: Command approval for `process.spawn`; absent, every command runs. `session.start` merges its settings with the daemon's (the stricter mode, both deny lists, both hooks).
    approval: NotRequired[ApprovalSettings | None]
    #: Expose every port a guest program starts listening on (loopback or wildcard) on a free host port of 127.0.0.1, and take it away when the program stops listening.
    auto_expose: NotRequired[bool]
    #: Which VM backend runs it.
    backend: NotRequired[BackendChoice]
    #: Which bundle boots it: an installed version, `current`, or a built flavor (`minimal`, `standard`) or bundle directory. `current` with nothing installed is the flavor this machine built (`minimal` first).
    bundle: NotRequired[str]
    #: Guest vCPUs.
    cpus: NotRequired[int]
    #: Size of the writable session disk (sparse: only what the guest writes takes space); 0 keeps the guest's writes in its RAM, lost when the VM ends.
    disk_size_mib: NotRequired[int]
    #: How often the agent is pinged.
    heartbeat_interval_secs: NotRequired[int]
    #: How long a ping may take before the VM counts as failed and is restarted.
    heartbeat_timeout_secs: NotRequired[int]
    #: What the idle timeout does: `stop`, or `suspend` (a snapshot the next call restores; the kvm backend only, others stop).
    idle_action: NotRequired[IdleAction]
    #: Stop the session after this long with no running process and no client activity; 0 never stops it.
    idle_timeout_secs: NotRequired[int]
    #: Guest memory.
    memory_mib: NotRequired[int]
    #: What the guest may connect to (through the host's egress proxy; the guest has no network interface of its own).
    network: NotRequired[NetworkPolicy]
    #: The sandbox policy, enforced on the host when the VM boots: the workspace folders' mode, extra paths, read-only `.git` and `/tmp`, hidden files and (when it has one) the network. `session.start` merges its policy with the daemon's default, field by field, the most restrictive winning.
    policy: NotRequired[SandboxPolicy]


#: Where a session is in its life. `starting → ready → (restarting → ready)* → stopping →
#: stopped | failed`; a stopped or failed session can be resumed (back to `starting`).
SessionStatus: TypeAlias = Literal["starting", "ready", "restarting", "stopping", "stopped", "failed"]


class SetNetworkParams(TypedDict):
    """Params of `session.set_network`."""

    name: str
    network: NetworkPolicy


class SetSecretParams(TypedDict):
    """Params of `session.set_secret`."""

    name: str
    #: Replaces the secret of this name (its placeholder stays, so running processes keep working) or adds one (processes spawned from now on see it).
    secret: SecretSpec


class SettingsPatch(TypedDict):
    """Session settings to change: only the fields given. `session.start` takes one (over the
    daemon's defaults), and so does `config.set` (the defaults themselves)."""

    #: Command approval settings.
    approval: NotRequired[ApprovalSettings | None]
    #: Whether ports guest programs listen on are exposed as they appear.
    auto_expose: NotRequired[bool | None]
    #: The VM backend.
    backend: NotRequired[BackendChoice | None]
    #: The bundle to boot.
    bundle: NotRequired[str | None]
    #: Guest vCPUs (1 to 64).
    cpus: NotRequired[int | None]
    #: Size of the session disk; 0 for none.
    disk_size_mib: NotRequired[int | None]
    #: Seconds between heartbeats.
    heartbeat_interval_secs: NotRequired[int | None]
    #: Seconds a heartbeat may take.
    heartbeat_timeout_secs: NotRequired[int | None]
    #: What the idle timeout does: `stop` or `suspend`.
    idle_action: NotRequired[IdleAction | None]
    #: Idle seconds before the session stops; 0 never.
    idle_timeout_secs: NotRequired[int | None]
    #: Guest memory (64 to 65536).
    memory_mib: NotRequired[int | None]
    #: The network policy (replaces the whole policy).
    network: NotRequired[NetworkPolicy | None]
    #: The sandbox policy, as JSON: `{"type": "workspace_readonly", "ignore": [".env"]}`.
    policy: NotRequired[SandboxPolicy | None]


#: When `shadow.apply` writes an entry.
ShadowApplies: TypeAlias = Literal["by_default", "when_named", "never"]


class ShadowApplyError(TypedDict):
    path: str
    message: str


class ShadowApplyParams(TypedDict):
    session: str
    #: The shadow folder's name.
    folder: str
    #: The change-set `shadow.diff` returned: required (an apply without one is refused).
    changeset: NotRequired[str | None]
    #: Apply only these paths of the change-set (each must be in it). `.git` and ignored paths are applied only when named here. Default: every entry that applies by default.
    paths: NotRequired[list[str] | None]


class ShadowApplyReport(TypedDict):
    """What applying a shadow folder's changes did."""

    #: Paths written to (or deleted from) the host folder.
    applied: list[str]
    #: Paths the host changed since the share started: left alone.
    conflicts: list[ShadowConflict]
    errors: list[ShadowApplyError]
    #: Entries of the change-set not applied: not named although they must be, or never applied (see [`ShadowApplies`]).
    skipped: NotRequired[list[ShadowSkipped]]


class ShadowConflict(TypedDict):
    path: str
    reason: str


class ShadowDiffResult(TypedDict):
    """A shadow folder's changes, captured on the host as change-set `changeset`."""

    #: What `shadow.apply` takes: it applies these entries' captured bytes and nothing else. Valid until the folder's next `shadow.diff`, `shadow.reset` or unmount, or a restart.
    changeset: str
    changes: list[ShadowEntry]


class ShadowEntry(TypedDict):
    """One entry of a shadow folder's change-set: what the guest changed, as captured on the host
    when the diff was taken. `shadow.apply` writes exactly these bytes (the `sha256`), never
    what the guest holds by then."""

    #: Relative to the folder, `/`-separated.
    path: str
    kind: ChangeKind
    #: Whether `shadow.apply` writes it without being told to.
    applies: ShadowApplies
    #: What the guest has at `path`: absent for a deletion.
    file_kind: NotRequired[FileKind | None]
    #: The entry is (for a deletion: was) a directory.
    is_dir: NotRequired[bool]
    #: Why a reviewer should look twice (empty: nothing special).
    risks: NotRequired[list[ShadowRisk]]
    #: Lowercase hex SHA-256 of the captured bytes, for an added or modified file.
    sha256: NotRequired[str | None]
    #: Bytes captured, for an added or modified file.
    size: NotRequired[int | None]


class ShadowParams(TypedDict):
    session: str
    #: The shadow folder's name.
    folder: str


#: What makes a shadow change worth a second look.
ShadowRisk: TypeAlias = Literal["git", "git_hook", "dotfile", "executable", "symlink", "special", "ignored"]


class ShadowSkipped(TypedDict):
    path: str
    reason: str


#: How a shared folder is mounted in the guest.
ShareMode: TypeAlias = Literal["ro", "rw", "rwd", "shadow"]


class SnapshotInfo(TypedDict):
    """A session's snapshot: its VM paused into the session's storage (memory, devices, disk,
    folder table), which `session.resume` restores and `session.fork` copies."""

    #: Milliseconds since the epoch.
    taken_ms: int
    #: The session that took it (a fork's snapshot names its source).
    source: str
    bundle_version: str
    #: Bytes of guest memory the snapshot holds (a sparse file: untouched pages take no room).
    memory_bytes: int
    #: How long the guest was paused while its state and memory were written.
    pause_ms: int
    #: Whether the next `session.resume` restores it (memory, detached processes, disk) rather than booting: true from the snapshot until a resume restored it.
    resumes: bool


class SpawnParams(TypedDict):
    session: str
    #: The command; `argv[0]` is looked up in the guest's PATH.
    argv: list[str]
    #: Working directory in the guest (absolute).
    cwd: NotRequired[str | None]
    #: Keep the process when this client goes: the session holds its output (bounded) and its exit, and any client can `process.attach` to it.
    detach: NotRequired[bool]
    env: NotRequired[dict[str, str]]
    #: SIGTERM after this many seconds, SIGKILL 3 s later; the exit says `timed_out`.
    timeout_secs: NotRequired[int | None]
    #: Run on a pseudo-terminal of this size (output then arrives as stdout only).
    tty: NotRequired[TtySize | None]


class Spawned(TypedDict):
    #: The process's id in this daemon (events name it).
    process: int
    #: Its pid in the guest.
    pid: int


class SshHostSpec(TypedDict):
    """A server an SSH key may be used for."""

    #: Its name, for events and for finding its keys in `~/.ssh/known_hosts`.
    name: str
    #: Its host keys, OpenSSH public-key lines (`ssh-ed25519 AAAA…`); when absent, the unhashed lines of umbrad's user's `~/.ssh/known_hosts` that name it.
    host_keys: NotRequired[list[str]]


class SshKeyInfo(TypedDict):
    """An SSH key as `session.get` reports it."""

    name: str
    #: `SHA256:…`, as `ssh-add -l` shows it.
    fingerprint: str
    hosts: list[str]


class SshKeySpec(TypedDict):
    """An SSH key the session's agent holds on the host (the guest's `SSH_AUTH_SOCK` reaches it;
    the private key never enters the guest), usable only for logins to `hosts`."""

    #: What events and `ssh-add -l` call it (the key's comment in the agent).
    name: str
    #: The servers it may log in to, each known by its host keys (as `ssh-add -h` restricts a key). At least one.
    hosts: list[SshHostSpec]
    #: A file of umbrad's user holding it (read at start and after umbrad restarts).
    from_file: NotRequired[str | None]
    #: The private key, OpenSSH format, unencrypted. Exactly one of this and `from_file`.
    private_key: NotRequired[SecretValue | None]


class StartParams(TypedDict):
    """Params of `session.start`."""

    #: The session's name: `[A-Za-z0-9._-]`, at most 64 bytes.
    name: str
    #: Command approval settings.
    approval: NotRequired[ApprovalSettings | None]
    #: Whether ports guest programs listen on are exposed as they appear.
    auto_expose: NotRequired[bool | None]
    #: The VM backend.
    backend: NotRequired[BackendChoice | None]
    #: The bundle to boot.
    bundle: NotRequired[str | None]
    #: Guest vCPUs (1 to 64).
    cpus: NotRequired[int | None]
    #: Size of the session disk; 0 for none.
    disk_size_mib: NotRequired[int | None]
    #: Host folders to share at `/sessions/<name>/mnt/<folder>`.
    folders: NotRequired[list[FolderSpec]]
    #: Seconds between heartbeats.
    heartbeat_interval_secs: NotRequired[int | None]
    #: Seconds a heartbeat may take.
    heartbeat_timeout_secs: NotRequired[int | None]
    #: What the idle timeout does: `stop` or `suspend`.
    idle_action: NotRequired[IdleAction | None]
    #: Idle seconds before the session stops; 0 never.
    idle_timeout_secs: NotRequired[int | None]
    #: Since 1.11: boot an OCI image (`python:3.12-slim`, `ghcr.io/org/tool@sha256:…`) instead of `bundle`: pulled and converted into a bundle first unless it was before (`images.md`); its `Env`, `WorkingDir` and `User` become every process's defaults.
    image: NotRequired[str | None]
    #: Guest memory (64 to 65536).
    memory_mib: NotRequired[int | None]
    #: The network policy (replaces the whole policy).
    network: NotRequired[NetworkPolicy | None]
    #: The sandbox policy, as JSON: `{"type": "workspace_readonly", "ignore": [".env"]}`.
    policy: NotRequired[SandboxPolicy | None]
    #: Guest ports to reach from the host from the start (`session.expose`).
    ports: NotRequired[list[PortSpec]]
    #: Credentials the guest sees only as placeholders (`docs/network.md`, "Secrets").
    secrets: NotRequired[list[SecretSpec]]
    #: SSH keys the session's agent holds on the host, each for the servers it names.
    ssh_keys: NotRequired[list[SshKeySpec]]


class StdinParams(TypedDict):
    """Bytes in JSON: `data` holds UTF-8 text as it is (`encoding` absent or `utf8`) or base64
    (`encoding: base64`). Output uses text where it is valid UTF-8 without many control
    characters; a chunk boundary can split a character, so one stream may mix both, and
    decoding each chunk and concatenating gives the exact bytes. File contents are base64."""

    session: str
    process: int
    data: str
    encoding: NotRequired[Encoding]
    #: With `writer`: where this piece's first byte falls among the bytes that writer has written. umbrad writes only what lies past the bytes it already took from the writer, so a piece sent again after a lost connection is written once; a piece starting past them is refused (`invalid_params`): the bytes between are missing. Since API 1.9.
    offset: NotRequired[int | None]
    #: With `offset`: a name the client picks for its stream of stdin to this process (at most 64 bytes; a random one per process and client), kept across its reconnections. Since API 1.9.
    writer: NotRequired[str | None]


#: Which output stream.
Stream: TypeAlias = Literal["stdout", "stderr"]


class SubscribeParams(TypedDict):
    #: Only this session's events (default: every session's, and the host's).
    session: NotRequired[str | None]


class Subscribed(TypedDict):
    subscription: int


#: An administrator's ceilings. Unknown fields are refused: a misspelt ceiling must not be a
#: silently absent one.
SystemPolicy: TypeAlias = dict[str, Any]


class SystemPolicyInfo(TypedDict):
    """What `daemon.info` says of the system policy."""

    #: The file it was read from.
    path: str
    policy: SystemPolicy


#: Params of `terminal.attach`.
TerminalAttachParams = TypedDict(
    "TerminalAttachParams",
    {
        "session": "str",
        "terminal": "int",
        "from": "NotRequired[int]",
    },
)


class TerminalInfo(TypedDict):
    """A terminal: a kept process on a pseudo-terminal. Its id is a process id: write to it with
    `process.stdin`, acknowledge its output with `process.ack`."""

    terminal: int
    pid: int
    shell: list[str]
    size: TtySize
    #: Its scrollback: what the session holds of its output.
    output: KeptRange
    #: The shell's exit, once it ended.
    exit: NotRequired[ProcessExit | None]


class TerminalList(TypedDict):
    terminals: list[TerminalInfo]


class TerminalOpenParams(TypedDict):
    """Params of `terminal.open`."""

    session: str
    #: The terminal's size.
    size: TtySize
    #: Its working directory in the guest (absolute).
    cwd: NotRequired[str | None]
    env: NotRequired[dict[str, str]]
    #: The shell's argv; default a login shell: `bash -l` where the image has bash, else `sh -l`.
    shell: NotRequired[list[str]]


class TerminalRef(TypedDict):
    session: str
    terminal: int


class TerminalResizeParams(TypedDict):
    session: str
    terminal: int
    rows: int
    cols: int


class TerminalRunParams(TypedDict):
    """Params of `terminal.run`."""

    session: str
    terminal: int
    #: A command line for the terminal's shell, run in the shell itself (so `cd` and variables stay for the next): it may hold several lines, at most 64 KiB.
    command: str
    #: Give up waiting after this many seconds, counted from the call (the command keeps running); default: no limit.
    timeout_secs: NotRequired[int | None]


class TerminalRunResult(TypedDict):
    """What `terminal.run`'s command left: its exit status and the shell's working directory
    after it, reported by the shell itself through a marker with a nonce of this run (its
    output went to the terminal, and to its attached clients, as any other)."""

    exit_code: int
    cwd: str


class TtySize(TypedDict):
    rows: int
    cols: int


class UnexposeParams(TypedDict):
    """Params of `session.unexpose`."""

    session: str
    guest_port: int


class UnmountParams(TypedDict):
    session: str
    name: str


class UnsubscribeParams(TypedDict):
    subscription: int


class UpdateParams(TypedDict):
    """Params of `session.update`."""

    name: str
    #: The settings to change (only those given), as `session.start` takes them.
    settings: SettingsPatch


class Updated(TypedDict):
    """What `session.update` changed."""

    session: SessionInfo
    #: Fields in force at once on the running session (`approval`, `network`, `idle_timeout_secs`, `idle_action`, `auto_expose`).
    applied: list[str]
    #: Fields recorded that take effect at its next boot (stop and resume): the VM's size, heartbeat, bundle, backend and sandbox policy (its folders' modes are set at a boot).
    next_boot: list[str]


#: The answer; `Ord` is the order of strictness (`Deny` strictest).
Verdict: TypeAlias = Literal["allow", "ask", "deny"]


class VmInfo(TypedDict):
    """The VM behind a running session."""

    #: `kvm` or `qemu`.
    backend: str
    #: Why `auto` chose it.
    backend_reason: str
    bundle_version: str
    #: Launch → agent ready.
    boot_ms: int
    #: Host pids of the VMM and its helper processes.
    pids: list[int]
    #: The VM's private run directory on the host (sockets, console log).
    run_dir: str
    #: The VM came booted from the warm pool (`boot_ms` is then its boot there).
    from_pool: NotRequired[bool]
    #: Host memory the VM holds now, in KiB: the proportional set size (PSS) of the VMM and its helpers, so guest memory they all map counts once. Absent for an in-process VM or where `/proc` cannot tell. Since API 1.9.
    host_memory_kib: NotRequired[int | None]


class WriteParams(TypedDict):
    """Bytes in JSON: `data` holds UTF-8 text as it is (`encoding` absent or `utf8`) or base64
    (`encoding: base64`). Output uses text where it is valid UTF-8 without many control
    characters; a chunk boundary can split a character, so one stream may mix both, and
    decoding each chunk and concatenating gives the exact bytes. File contents are base64."""

    session: str
    path: str
    data: str
    #: Append instead of replacing the file.
    append: NotRequired[bool]
    create_dirs: NotRequired[bool]
    encoding: NotRequired[Encoding]
    #: `path` is a host path inside a shared folder.
    host: NotRequired[bool]
    #: Write at this offset instead (the file is not truncated).
    offset: NotRequired[int | None]
    #: Permission bits of a file this creates (default 0644).
    permissions: NotRequired[int | None]


class Written(TypedDict):
    bytes: int


#: Every method umbrad serves, in documentation order.
METHOD_NAMES = (
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
)

#: A method's name.
MethodName: TypeAlias = Literal[
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
]

#: Each method's params and result types, by name.
METHOD_TYPES: dict[str, tuple[str, str]] = {
    "daemon.info": ("NoParams", "DaemonInfo"),
    "config.get": ("NoParams", "DaemonConfig"),
    "config.set": ("ConfigPatch", "DaemonConfig"),
    "pool.status": ("NoParams", "PoolStatus"),
    "bundle.status": ("NoParams", "BundleStatus"),
    "bundle.download": ("DownloadParams", "Downloaded"),
    "bundle.delete_and_reinstall": ("ReinstallParams", "Downloaded"),
    "session.start": ("StartParams", "SessionInfo"),
    "session.resume": ("ResumeParams", "SessionInfo"),
    "session.stop": ("SessionRef", "SessionInfo"),
    "session.snapshot": ("SessionRef", "SessionInfo"),
    "session.fork": ("ForkParams", "SessionInfo"),
    "session.delete": ("SessionRef", "Done"),
    "session.set_network": ("SetNetworkParams", "SessionInfo"),
    "session.update": ("UpdateParams", "Updated"),
    "session.set_secret": ("SetSecretParams", "SessionInfo"),
    "session.expose": ("ExposeParams", "PortInfo"),
    "session.unexpose": ("UnexposeParams", "Done"),
    "session.ports": ("SessionRef", "PortList"),
    "session.list": ("NoParams", "SessionList"),
    "session.get": ("SessionRef", "SessionInfo"),
    "session.logs": ("LogsParams", "SessionLogs"),
    "process.spawn": ("SpawnParams", "Spawned"),
    "process.stdin": ("StdinParams", "Done"),
    "process.close_stdin": ("ProcessRef", "Done"),
    "process.kill": ("KillParams", "Done"),
    "process.kill_all": ("KillAllParams", "Done"),
    "process.resize": ("ResizeParams", "Done"),
    "permission.respond": ("RespondPermissionParams", "Done"),
    "process.ack": ("AckParams", "Done"),
    "process.list": ("InSession", "ProcessList"),
    "process.attach": ("AttachParams", "Attached"),
    "terminal.open": ("TerminalOpenParams", "TerminalInfo"),
    "terminal.attach": ("TerminalAttachParams", "Attached"),
    "terminal.list": ("InSession", "TerminalList"),
    "terminal.resize": ("TerminalResizeParams", "Done"),
    "terminal.close": ("TerminalRef", "Done"),
    "lsp.start": ("LspStartParams", "LspServerInfo"),
    "lsp.request": ("LspRequestParams", "LspResult"),
    "lsp.notify": ("LspNotifyParams", "Done"),
    "lsp.stop": ("LspRef", "Done"),
    "lsp.list": ("InSession", "LspList"),
    "diagnostics.for_change": ("ForChangeParams", "ForChange"),
    "terminal.run": ("TerminalRunParams", "TerminalRunResult"),
    "folder.mount": ("MountParams", "FolderInfo"),
    "folder.unmount": ("UnmountParams", "Done"),
    "file.read": ("ReadParams", "FileData"),
    "file.write": ("WriteParams", "Written"),
    "file.stat": ("PathParams", "FileStat"),
    "file.list": ("ListParams", "DirList"),
    "shadow.diff": ("ShadowParams", "ShadowDiffResult"),
    "shadow.apply": ("ShadowApplyParams", "ShadowApplyReport"),
    "shadow.export": ("ExportParams", "Exported"),
    "shadow.reset": ("ShadowParams", "Done"),
    "events.subscribe": ("SubscribeParams", "Subscribed"),
    "events.unsubscribe": ("UnsubscribeParams", "Done"),
}

#: Every error code's JSON-RPC number (`error.code`), by its stable name (`error.data.code`).
ERROR_CODES: dict[str, int] = {
    "parse_error": -32700,
    "invalid_request": -32600,
    "method_not_found": -32601,
    "invalid_params": -32602,
    "internal": -32603,
    "session_not_found": -32001,
    "session_exists": -32002,
    "invalid_state": -32003,
    "not_found": -32004,
    "permission_denied": -32005,
    "already_exists": -32006,
    "spawn_failed": -32007,
    "boot_failed": -32010,
    "session_lost": -32011,
    "guest_error": -32012,
    "timeout": -32013,
    "too_large": -32014,
    "busy": -32015,
    "bundle_error": -32016,
    "io": -32017,
    "unsupported": -32018,
    "unauthorized": -32019,
    "unavailable": -32020,
    "disabled_by_admin": -32021,
    "unknown": -32099,
}


class ParseError(UmbraError):
    """parse_error"""

    code = "parse_error"


class InvalidRequestError(UmbraError):
    """invalid_request"""

    code = "invalid_request"


class MethodNotFoundError(UmbraError):
    """method_not_found"""

    code = "method_not_found"


class InvalidParamsError(UmbraError):
    """invalid_params"""

    code = "invalid_params"


class InternalError(UmbraError):
    """internal"""

    code = "internal"


class SessionNotFoundError(UmbraError):
    """session_not_found"""

    code = "session_not_found"


class SessionExistsError(UmbraError):
    """session_exists"""

    code = "session_exists"


class InvalidStateError(UmbraError):
    """invalid_state"""

    code = "invalid_state"


class NotFoundError(UmbraError):
    """not_found"""

    code = "not_found"


class PermissionDeniedError(UmbraError):
    """permission_denied"""

    code = "permission_denied"


class AlreadyExistsError(UmbraError):
    """already_exists"""

    code = "already_exists"


class SpawnFailedError(UmbraError):
    """spawn_failed"""

    code = "spawn_failed"


class BootFailedError(UmbraError):
    """boot_failed"""

    code = "boot_failed"


class SessionLostError(UmbraError):
    """session_lost"""

    code = "session_lost"


class GuestError(UmbraError):
    """guest_error"""

    code = "guest_error"


class UmbraTimeoutError(UmbraError):
    """timeout"""

    code = "timeout"


class TooLargeError(UmbraError):
    """too_large"""

    code = "too_large"


class BusyError(UmbraError):
    """busy"""

    code = "busy"


class BundleError(UmbraError):
    """bundle_error"""

    code = "bundle_error"


class IoError(UmbraError):
    """io"""

    code = "io"


class UnsupportedError(UmbraError):
    """unsupported"""

    code = "unsupported"


class UnauthorizedError(UmbraError):
    """unauthorized"""

    code = "unauthorized"


class UnavailableError(UmbraError):
    """unavailable"""

    code = "unavailable"


class DisabledByAdminError(UmbraError):
    """disabled_by_admin"""

    code = "disabled_by_admin"


class UnknownError(UmbraError):
    """unknown"""

    code = "unknown"


#: The exception class of each error code.
ERROR_CLASSES: dict[str, type[UmbraError]] = {
    "parse_error": ParseError,
    "invalid_request": InvalidRequestError,
    "method_not_found": MethodNotFoundError,
    "invalid_params": InvalidParamsError,
    "internal": InternalError,
    "session_not_found": SessionNotFoundError,
    "session_exists": SessionExistsError,
    "invalid_state": InvalidStateError,
    "not_found": NotFoundError,
    "permission_denied": PermissionDeniedError,
    "already_exists": AlreadyExistsError,
    "spawn_failed": SpawnFailedError,
    "boot_failed": BootFailedError,
    "session_lost": SessionLostError,
    "guest_error": GuestError,
    "timeout": UmbraTimeoutError,
    "too_large": TooLargeError,
    "busy": BusyError,
    "bundle_error": BundleError,
    "io": IoError,
    "unsupported": UnsupportedError,
    "unauthorized": UnauthorizedError,
    "unavailable": UnavailableError,
    "disabled_by_admin": DisabledByAdminError,
    "unknown": UnknownError,
}
