/**
 * The events {@link Umbra} emits. Every kind of the daemon's {@link SessionEvent} has its own
 * event name, its `event` tag in kebab-case (`heartbeat_failure` → `'heartbeat-failure'`), except
 * two: `status` is `'session-status'` and `error` is `'session-error'` (Node's emitters treat
 * `'error'` specially: one without a listener would throw). Every daemon event also goes to the
 * catch-all `'event'`. The names are derived from the generated types: a kind added to the Rust
 * types gets its event here by itself.
 */

import type { DaemonInfo, SessionEvent, SessionEventKind } from "./generated/types";
import type { UmbraError } from "./errors";

/** The `event` tag of every kind of {@link SessionEvent}. */
export type EventKindName = SessionEventKind["event"];

/** The {@link SessionEvent} of one kind: `EventOf<"exit">` has the exit's fields. */
export type EventOf<K extends EventKindName> = Extract<SessionEvent, { event: K }>;

/** `heartbeat_failure` → `heartbeat-failure`. */
export type KebabCase<S extends string> = S extends `${infer Head}_${infer Tail}` ? `${Head}-${KebabCase<Tail>}` : S;

/** The name {@link Umbra} emits an event kind under. */
export type EmitterName<K extends EventKindName> = K extends "status"
  ? "session-status"
  : K extends "error"
    ? "session-error"
    : KebabCase<K>;

/** The event names of daemon events, one per kind. */
export type DaemonEventName = EmitterName<EventKindName>;

/** What `'disconnected'` carries. */
export interface DisconnectedInfo {
  /** Why the connection ended (an {@link UnavailableError} when umbrad went away). */
  error: UmbraError;
  /** Whether the client is trying to connect again (false after `close()` or with `reconnect: false`). */
  willReconnect: boolean;
}

/** What `'reconnected'` carries. */
export interface ReconnectedInfo {
  /** The daemon now connected (a new `pid` after a restart). */
  daemon: DaemonInfo;
  /** Connection attempts it took. */
  attempts: number;
  /** Milliseconds without a connection. */
  downtimeMs: number;
}

/** What `'events-lost'` carries: umbrad dropped events because this client read too slowly. */
export interface EventsLostInfo {
  /** How many were dropped; re-read state (`sessions.list()`) if it matters. */
  count: number;
}

/**
 * Every event of {@link Umbra}, with its listener's arguments:
 *
 * - one per daemon event kind (`'session-status'`, `'ready'`, `'heartbeat-failure'`,
 *   `'download-progress'`, `'outputs-file-created'`, `'exit'`, …), with that {@link SessionEvent};
 * - `'event'`: every daemon event, whatever its kind;
 * - `'events-lost'`: umbrad dropped events for this client;
 * - `'disconnected'` and `'reconnected'`: the connection to umbrad ended, and came back.
 *
 * Daemon events arrive while the client is subscribed: by default from `connect()` on (see
 * {@link ConnectOptions.subscribe}), and again after each reconnection.
 */
export type UmbraEvents = {
  [K in EventKindName as EmitterName<K>]: [event: EventOf<K>];
} & {
  event: [event: SessionEvent];
  "events-lost": [info: EventsLostInfo];
  disconnected: [info: DisconnectedInfo];
  reconnected: [info: ReconnectedInfo];
};

/** The name an event of kind `kind` is emitted under (see {@link EmitterName}). */
export function emitterName(kind: string): string {
  if (kind === "status") {
    return "session-status";
  }
  if (kind === "error") {
    return "session-error";
  }
  return kind.replace(/_/g, "-");
}
