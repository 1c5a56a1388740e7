import * as path from "node:path";

/**
 * umbrad's socket by the daemon's own rule (`umbra_api::paths::default_socket`):
 * `$UMBRA_SOCKET`, else `$XDG_RUNTIME_DIR/umbra/umbrad.sock`, else
 * `/tmp/umbra-<uid>/umbrad.sock` (with `$TMPDIR` for `/tmp` when it is set, as umbrad does).
 */
export function defaultSocketPath(env: NodeJS.ProcessEnv = process.env): string {
  const explicit = env["UMBRA_SOCKET"];
  if (explicit) {
    return explicit;
  }
  const runtime = env["XDG_RUNTIME_DIR"];
  if (runtime) {
    return path.join(runtime, "umbra", "umbrad.sock");
  }
  const uid = typeof process.getuid === "function" ? process.getuid() : 0;
  return path.join(env["TMPDIR"] || "/tmp", `umbra-${uid}`, "umbrad.sock");
}
