// 100 MiB of stdout read slowly: the consumer's pace reaches the guest (umbrad's output window
// and this client's acks), so neither this Node process nor umbrad buffers the output.
//
// The consumer takes 2 MiB/s, slower than the guest writes here (~4-6 MiB/s through umbrad under
// QEMU emulation), so without flow control the output would pile up in this process: measured
// with acks sent on receipt instead, the stream held 41 MiB and RSS grew by 143 MiB.
//
// Bounds, and why:
// - `stdout.readableLength` (bytes held for the consumer) stays within the stream's
//   highWaterMark + one OUTPUT_WINDOW (1 MiB, what umbrad may send ahead of acks) + one chunk
//   (64 KiB): a chunk is acknowledged only once the stream took it below its highWaterMark.
// - what the process retains (heap + Buffers, read after a full GC every 8 MiB) grows by less
//   than 8 MiB: the ~1 MiB held, the next window on its way (1 MiB, 1.4 MiB as base64 text) and
//   the line being parsed (measured: +2.3 MiB; with acks on receipt: +97 MiB).
// - its RSS peaks less than 64 MiB above where it started. The test runs the GC every 8 MiB so
//   that RSS shows what is held rather than when V8 frees garbage: Buffers a slow consumer held
//   long enough to be promoted are freed only by a full GC, which V8 starts once external memory
//   grew by 64 MiB (its soft limit); without the forced GCs RSS peaks ~75 MiB above its start,
//   the same for any amount of output (still bounded, just lazily collected).
// - umbrad's peak RSS (VmHWM) grows by less than 64 MiB, as in the Rust daemon test: umbrad
//   holds at most one window per stream for this client.

import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { test } from "node:test";
import * as v8 from "node:v8";
import * as vm from "node:vm";

import { OUTPUT_WINDOW, Umbra } from "../dist/index.js";
import { TestDaemon, procStatusKiB, cleanUpAfter } from "./daemon.mjs";

const MIB = 1 << 20;
const TOTAL = 100 * MIB;
const RATE = 2 * MIB; // bytes per second the consumer takes
const BOUND = 64 * MIB;

v8.setFlagsFromString("--expose-gc");
const gc = vm.runInNewContext("gc");

/** @type {TestDaemon | undefined} */
let daemon;
/** @type {Umbra | undefined} */
let client;

cleanUpAfter(() => ({ daemon, client }));

/** Heap and Buffers in use after full GCs (the second after V8 finished freeing Buffers' memory). */
async function retained() {
  gc();
  await sleep(20);
  gc();
  const m = process.memoryUsage();
  return m.heapUsed + m.arrayBuffers;
}

test("100 MiB of stdout read slowly keeps this process's and umbrad's memory bounded", async () => {
  daemon = await TestDaemon.start("backpressure");
  client = await Umbra.connect({ socketPath: daemon.socket });
  const session = await client.sessions.start({ name: "big" });

  const retainedBefore = await retained();
  const rssBefore = process.memoryUsage().rss;
  const hwmBefore = procStatusKiB(daemon.pid, "VmHWM") * 1024;
  let rssPeak = rssBefore;
  let retainedPeak = retainedBefore;
  let heldPeak = 0;
  let p;
  const sampler = setInterval(() => {
    rssPeak = Math.max(rssPeak, process.memoryUsage().rss);
    if (p) heldPeak = Math.max(heldPeak, p.stdout.readableLength);
  }, 10);

  const started = Date.now();
  p = await session.spawn(["head", "-c", String(TOTAL), "/dev/zero"]);
  let received = 0;
  let allZero = true;
  let debt = 0;
  let nextCheck = 8 * MIB;
  for await (const chunk of p.stdout) {
    received += chunk.length;
    if (allZero && chunk.some((b) => b !== 0)) allZero = false;
    heldPeak = Math.max(heldPeak, p.stdout.readableLength);
    debt += chunk.length;
    if (debt >= 256 * 1024) {
      await sleep((debt / RATE) * 1000); // reading at RATE: the rest waits, in the stream or in the guest
      debt = 0;
      heldPeak = Math.max(heldPeak, p.stdout.readableLength);
    }
    if (received >= nextCheck) {
      nextCheck += 8 * MIB;
      retainedPeak = Math.max(retainedPeak, await retained());
    }
  }
  const exit = await p.exited;
  clearInterval(sampler);
  const tookMs = Date.now() - started;
  rssPeak = Math.max(rssPeak, process.memoryUsage().rss);
  const hwmAfter = procStatusKiB(daemon.pid, "VmHWM") * 1024;

  const mib = (n) => (n / MIB).toFixed(1);
  console.log(
    `100 MiB at ${mib(RATE)} MiB/s in ${(tookMs / 1000).toFixed(1)} s; ` +
      `held by the stream at most ${mib(heldPeak)} MiB (highWaterMark ${p.stdout.readableHighWaterMark} B); ` +
      `retained after GC ${mib(retainedBefore)} -> peak ${mib(retainedPeak)} MiB (+${mib(retainedPeak - retainedBefore)}); ` +
      `node RSS ${mib(rssBefore)} -> peak ${mib(rssPeak)} MiB (+${mib(rssPeak - rssBefore)}); ` +
      `umbrad VmHWM ${mib(hwmBefore)} -> ${mib(hwmAfter)} MiB (+${mib(hwmAfter - hwmBefore)})`,
  );

  assert.equal(received, TOTAL);
  assert.ok(allZero, "the bytes are /dev/zero's");
  assert.equal(exit.code, 0);
  assert.ok(tookMs >= (TOTAL / RATE) * 1000, "the consumer set the pace");
  // Whole windows waited for the consumer: the guest wrote faster than it read, so the bounds
  // below are flow control at work rather than a slow producer.
  assert.ok(heldPeak >= OUTPUT_WINDOW / 2, `the stream never held more than ${heldPeak} bytes: the producer did not outrun the consumer`);
  assert.ok(
    heldPeak <= p.stdout.readableHighWaterMark + OUTPUT_WINDOW + 64 * 1024,
    `the stream held ${heldPeak} bytes: more than highWaterMark + OUTPUT_WINDOW + a chunk`,
  );
  assert.ok(retainedPeak - retainedBefore < 8 * MIB, `retained memory grew by ${mib(retainedPeak - retainedBefore)} MiB`);
  assert.ok(rssPeak - rssBefore < BOUND, `node's RSS grew by ${mib(rssPeak - rssBefore)} MiB`);
  assert.ok(hwmAfter - hwmBefore < BOUND, `umbrad's peak RSS grew by ${mib(hwmAfter - hwmBefore)} MiB`);
});
