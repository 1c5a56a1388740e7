/**
 * Errors: every failure the daemon reports (and every failure to reach it) is an
 * {@link UmbraError} whose `code` is the daemon's stable snake_case name and whose `rpcCode` is
 * the JSON-RPC number. Each code has its own subclass, so `instanceof SessionNotFoundError`
 * and `err.code === "session_not_found"` both work.
 */

import { ERROR_CODES, type ErrorCode } from "./generated/types";

export type { ErrorCode };

/** Options of {@link UmbraError}'s constructor. */
export interface UmbraErrorOptions {
  /** The stable name; by default the subclass's own. */
  code?: ErrorCode;
  /** The JSON-RPC number; by default the one of `code`. */
  rpcCode?: number;
  /** The method whose call failed, if any. */
  method?: string;
  /** The name the daemon sent when it is not one this client knows (then `code` is `"unknown"`). */
  daemonCode?: string;
  /** The underlying error. */
  cause?: unknown;
}

/** An error of umbrad or of the connection to it. Decide by `code`, never by `message`. */
export class UmbraError extends Error {
  /** The code instances of this class carry. */
  static readonly code: ErrorCode = "unknown";
  /** The stable snake_case name (`"session_not_found"`), as in docs/ipc.md. */
  readonly code: ErrorCode;
  /** The JSON-RPC error number (`-32001`). */
  readonly rpcCode: number;
  /** The method whose call failed (`"session.start"`), when the error answers a call. */
  readonly method: string | undefined;
  /** The code name as the daemon sent it, when this client does not know it (`code` is then `"unknown"`). */
  readonly daemonCode: string | undefined;

  constructor(message: string, options: UmbraErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    const own = new.target as typeof UmbraError;
    this.code = options.code ?? own.code;
    this.rpcCode = options.rpcCode ?? ERROR_CODES[this.code];
    this.method = options.method;
    this.daemonCode = options.daemonCode;
    this.name = own.name;
  }
}

/** The request line was not valid JSON. */
export class ParseError extends UmbraError {
  static override readonly code = "parse_error";
  declare readonly code: "parse_error";
}
/** Valid JSON, but not a JSON-RPC 2.0 request (or a line longer than the limit). */
export class InvalidRequestError extends UmbraError {
  static override readonly code = "invalid_request";
  declare readonly code: "invalid_request";
}
/** No method of that name: the daemon is older than this client. */
export class MethodNotFoundError extends UmbraError {
  static override readonly code = "method_not_found";
  declare readonly code: "method_not_found";
}
/** The parameters do not match the method, or a value is out of range. */
export class InvalidParamsError extends UmbraError {
  static override readonly code = "invalid_params";
  declare readonly code: "invalid_params";
}
/** A bug or an unexpected condition in umbrad. */
export class InternalError extends UmbraError {
  static override readonly code = "internal";
  declare readonly code: "internal";
}
/** No session of that name. */
export class SessionNotFoundError extends UmbraError {
  static override readonly code = "session_not_found";
  declare readonly code: "session_not_found";
}
/** A session of that name exists already (and is not running: resume or delete it). */
export class SessionExistsError extends UmbraError {
  static override readonly code = "session_exists";
  declare readonly code: "session_exists";
}
/** The session is not in a state that allows this (for example, not running). */
export class InvalidStateError extends UmbraError {
  static override readonly code = "invalid_state";
  declare readonly code: "invalid_state";
}
/** A file, folder, process or command does not exist (a shell would exit 127 for a command). */
export class NotFoundError extends UmbraError {
  static override readonly code = "not_found";
  declare readonly code: "not_found";
}
/** The guest or the host refused access (a shell would exit 126 for a command). */
export class PermissionDeniedError extends UmbraError {
  static override readonly code = "permission_denied";
  declare readonly code: "permission_denied";
}
/** Something of that name exists already (a shared folder, for example). */
export class AlreadyExistsError extends UmbraError {
  static override readonly code = "already_exists";
  declare readonly code: "already_exists";
}
/** The command could not be started for another reason. */
export class SpawnFailedError extends UmbraError {
  static override readonly code = "spawn_failed";
  declare readonly code: "spawn_failed";
}
/** The VM did not boot: the message carries the reason and the last console lines. */
export class BootFailedError extends UmbraError {
  static override readonly code = "boot_failed";
  declare readonly code: "boot_failed";
}
/** The VM or its agent went away during the call (the session restarts or has failed). */
export class SessionLostError extends UmbraError {
  static override readonly code = "session_lost";
  declare readonly code: "session_lost";
}
/** The guest agent refused the request for a reason not covered by another code. */
export class GuestError extends UmbraError {
  static override readonly code = "guest_error";
  declare readonly code: "guest_error";
}
/** The guest did not answer in time. */
export class TimeoutError extends UmbraError {
  static override readonly code = "timeout";
  declare readonly code: "timeout";
}
/** A request, a file or an output exceeds a limit. */
export class TooLargeError extends UmbraError {
  static override readonly code = "too_large";
  declare readonly code: "too_large";
}
/** A limit on clients, sessions or concurrent work was reached; try again later. */
export class BusyError extends UmbraError {
  static override readonly code = "busy";
  declare readonly code: "busy";
}
/** A bundle could not be downloaded, verified or found. */
export class BundleError extends UmbraError {
  static override readonly code = "bundle_error";
  declare readonly code: "bundle_error";
}
/** A host I/O error (disk full, permissions on the host's own directories). */
export class IoError extends UmbraError {
  static override readonly code = "io";
  declare readonly code: "io";
}
/** Not possible with this session, host, build or daemon version. */
export class UnsupportedError extends UmbraError {
  static override readonly code = "unsupported";
  declare readonly code: "unsupported";
}
/** The connecting user is not allowed to use this daemon. */
export class UnauthorizedError extends UmbraError {
  static override readonly code = "unauthorized";
  declare readonly code: "unauthorized";
}
/** umbrad is not running, or the connection to it dropped. */
export class UnavailableError extends UmbraError {
  static override readonly code = "unavailable";
  declare readonly code: "unavailable";
}
/** The machine's system policy turns sessions off (`enabled: false`). */
export class DisabledByAdminError extends UmbraError {
  static override readonly code = "disabled_by_admin";
  declare readonly code: "disabled_by_admin";
}
/** A code this client does not know (from a newer daemon): see `daemonCode`. */
export class UnknownError extends UmbraError {
  static override readonly code = "unknown";
  declare readonly code: "unknown";
}

/** A subclass of {@link UmbraError}. */
export type UmbraErrorClass = (new (message: string, options?: UmbraErrorOptions) => UmbraError) & {
  readonly code: ErrorCode;
};

/**
 * The class of each code. Typed over the generated {@link ErrorCode}: a code added to the Rust
 * types fails this package's build until it has a class here.
 */
export const ERROR_CLASSES: { readonly [K in ErrorCode]: UmbraErrorClass } = {
  parse_error: ParseError,
  invalid_request: InvalidRequestError,
  method_not_found: MethodNotFoundError,
  invalid_params: InvalidParamsError,
  internal: InternalError,
  session_not_found: SessionNotFoundError,
  session_exists: SessionExistsError,
  invalid_state: InvalidStateError,
  not_found: NotFoundError,
  permission_denied: PermissionDeniedError,
  already_exists: AlreadyExistsError,
  spawn_failed: SpawnFailedError,
  boot_failed: BootFailedError,
  session_lost: SessionLostError,
  guest_error: GuestError,
  timeout: TimeoutError,
  too_large: TooLargeError,
  busy: BusyError,
  bundle_error: BundleError,
  io: IoError,
  unsupported: UnsupportedError,
  unauthorized: UnauthorizedError,
  unavailable: UnavailableError,
  disabled_by_admin: DisabledByAdminError,
  unknown: UnknownError,
};

function isErrorCode(name: unknown): name is ErrorCode {
  return typeof name === "string" && Object.prototype.hasOwnProperty.call(ERROR_CODES, name);
}

/** The error of a JSON-RPC error object (`{ code, message, data: { code } }`). */
export function errorFromRpc(error: unknown, method?: string): UmbraError {
  const e = (typeof error === "object" && error !== null ? error : {}) as {
    code?: unknown;
    message?: unknown;
    data?: { code?: unknown } | null;
  };
  const rpcCode = typeof e.code === "number" ? e.code : ERROR_CODES.unknown;
  const message = typeof e.message === "string" ? e.message : "umbrad reported an error without a message";
  const named = e.data?.code;
  let code: ErrorCode;
  let daemonCode: string | undefined;
  if (isErrorCode(named)) {
    code = named;
  } else {
    // No name (or one from a newer daemon): the number, if it is a known one, else unknown.
    const byNumber = (Object.keys(ERROR_CODES) as ErrorCode[]).find((c) => ERROR_CODES[c] === rpcCode);
    code = named === undefined && byNumber !== undefined ? byNumber : "unknown";
    daemonCode = typeof named === "string" ? named : undefined;
  }
  const Class = ERROR_CLASSES[code];
  return new Class(message, { code, rpcCode, ...(method === undefined ? {} : { method }), ...(daemonCode === undefined ? {} : { daemonCode }) });
}

/**
 * A wait was given up because its `AbortSignal` fired. Like Node's own: `name` is
 * `"AbortError"`, `code` is `"ABORT_ERR"`, and `cause` is the signal's reason.
 */
export class AbortError extends Error {
  readonly code = "ABORT_ERR";
  constructor(message = "The operation was aborted", options?: { cause?: unknown }) {
    super(message, options);
    this.name = "AbortError";
  }
}

/** Throws an {@link AbortError} if `signal` has fired. */
export function throwIfAborted(signal: AbortSignal | undefined): void {
  if (signal?.aborted) {
    throw new AbortError(undefined, { cause: signal.reason });
  }
}
