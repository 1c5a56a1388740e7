/**
 * `@umbra/client`: a TypeScript client for umbrad, Umbra's microVM session daemon.
 *
 * ```ts
 * import { Umbra } from "@umbra/client";
 * const client = await Umbra.connect();
 * const session = await client.sessions.start({ name: "demo" });
 * const p = await session.spawn(["echo", "hello"]);
 * p.stdout.pipe(process.stdout);
 * await p.exited;
 * await client.close();
 * ```
 *
 * @packageDocumentation
 */

export {
  Umbra,
  Sessions,
  Bundles,
  Config,
  type ConnectOptions,
  type ReconnectOptions,
  type CallOptions,
  type StartOptions,
  type ConfigOptions,
  type DownloadOptions,
} from "./client";
export {
  Session,
  SessionFiles,
  SessionFolders,
  SessionShadow,
  SessionLanguages,
  LanguageServer,
  Terminal,
  type TerminalOptions,
  type SpawnOptions,
  type ResumeOptions,
  type ExecOptions,
  type ExecResult,
  type PathOptions,
  type ReadOptions,
  type WriteOptions,
  type FolderOptions,
} from "./session";
export { UmbraProcess, SIGNALS, signalNumber, signalName, shellStatus, type ExitInfo, type Signal } from "./process";
export * from "./errors";
export {
  emitterName,
  type UmbraEvents,
  type EventKindName,
  type EventOf,
  type EmitterName,
  type KebabCase,
  type DaemonEventName,
  type DisconnectedInfo,
  type ReconnectedInfo,
  type EventsLostInfo,
} from "./events";
export { type CamelCase, type CamelCased, snakeCase } from "./options";
export { defaultSocketPath } from "./paths";
export * from "./generated/types";
