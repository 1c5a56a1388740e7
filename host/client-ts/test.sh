#!/usr/bin/env bash
# @umbra/client's tests, from the lock file: install the pinned toolchain, build with tsc, run
# the node:test suites one file at a time (unit tests against a fake daemon; then a real umbrad
# booting real VMs: sessions and processes, reconnection after a restart, 100 MiB of
# backpressure, the npm-pack tarball compiled in a fresh project and its README example run, and
# `vmctl mcp` driven by the official MCP SDKs, TypeScript and Python; umbrad's E2B endpoint
# driven by the unmodified E2B SDKs, JavaScript and Python, on the standard bundle).
# Needs `cargo build --workspace`, the minimal and standard bundles (`scripts/build-agent`, then
# `target/debug/vmctl bundle build --flavor minimal`); see README.md. The network is used only
# by `npm ci`, for the registry (nothing when ~/.cache/umbra/npm already holds the packages).
set -euo pipefail
cd "$(dirname "$0")"

# One npm cache, kept for CI; test/pack.test.mjs installs from it offline.
export UMBRA_NPM_CACHE="${UMBRA_NPM_CACHE:-$HOME/.cache/umbra/npm}"
export npm_config_update_notifier=false
export UMBRA_BOOT_TIMEOUT_SECS="${UMBRA_BOOT_TIMEOUT_SECS:-120}"

step() { printf '\n== client-ts: %s\n' "$*"; }

# The package needs Node >= 20 (package.json "engines"); Debian bookworm's own nodejs is 18.
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if ((node_major < 20)); then
    echo "client-ts: needs Node >= 20; found $(node --version 2>/dev/null || echo 'no node on PATH')" >&2
    exit 1
fi

step "npm ci"
npm ci --cache "$UMBRA_NPM_CACHE" --prefer-offline --no-audit --no-fund --loglevel=error

step "build (tsc)"
rm -rf dist
npx --no-install tsc -p .

step "the MCP Python SDK (a cached venv, scripts/mcp-python)"
UMBRA_MCP_PYTHON=$(../../scripts/mcp-python)
export UMBRA_MCP_PYTHON

step "the E2B Python SDK (a cached venv, scripts/e2b-python)"
UMBRA_E2B_PYTHON=$(../../scripts/e2b-python)
export UMBRA_E2B_PYTHON

step "tests (node --test, one file at a time)"
# Every test/*.test.mjs (test/daemon.mjs is their helper). A test that hangs fails after
# 5 minutes instead of blocking CI.
node --test --test-concurrency=1 --test-timeout=300000 test/*.test.mjs
