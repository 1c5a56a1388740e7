/**
 * The public API takes options in camelCase (`memoryMiB`, `idleTimeoutSecs`); the wire takes
 * snake_case (`memory_mib`, `idle_timeout_secs`). The option types are derived from the
 * generated wire types, so a field added to the Rust types appears here by itself.
 */

/** `idle_timeout_secs` → `idleTimeoutSecs`, `memory_mib` → `memoryMiB`. */
export type CamelCase<S extends string> = S extends `${infer Head}_mib`
  ? `${CamelCase<Head>}MiB`
  : S extends `${infer Head}_${infer Tail}`
    ? `${Head}${Capitalize<CamelCase<Tail>>}`
    : S;

/** An object's fields under their camelCase names, optional, without `null`. */
export type CamelCased<T> = {
  [K in keyof T as K extends string ? CamelCase<K> : never]?: Exclude<T[K], null | undefined>;
};

/** `memoryMiB` → `memory_mib`, `idleTimeoutSecs` → `idle_timeout_secs` (the inverse of {@link CamelCase}). */
export function snakeCase(name: string): string {
  return name.replace(/MiB/g, "Mib").replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
}

/** `options` with camelCase keys renamed to snake_case; `undefined` values and the keys in `skip` left out. */
export function toWire(options: object, skip: readonly string[] = []): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const [key, value] of Object.entries(options)) {
    if (value !== undefined && !skip.includes(key)) {
      out[snakeCase(key)] = value;
    }
  }
  return out;
}

/** What a call of `Umbra.call` can take besides its params. */
export interface CallOptions {
  /** Stops waiting for the answer (rejects with an AbortError); umbrad still carries the call out. */
  signal?: AbortSignal | undefined;
}
