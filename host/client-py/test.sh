#!/usr/bin/env bash
# The Python client's tests: the package installed from this checkout with pip into a cached
# venv (scripts/client-py, pinned pytest and mypy), mypy --strict over it, then pytest: unit
# tests, and a real umbrad booting real VMs (stream, stdin byte for byte, kill, errors, files,
# shadow, events, asyncio, reconnection, backpressure with bounded memory).
# Needs `cargo build --workspace` and the minimal bundle, as host/client-ts/test.sh does.
set -euo pipefail
cd "$(dirname "$0")"
export UMBRA_BOOT_TIMEOUT_SECS="${UMBRA_BOOT_TIMEOUT_SECS:-120}"
python=$(../../scripts/client-py)
echo "== client-py: mypy --strict"
"$python" -m mypy
echo "== client-py: pytest (the installed package, not the source tree)"
# --import-mode=importlib with the tests' rootdir: `umbra` comes from the venv's site-packages.
timeout 900 "$python" -m pytest -q -p no:cacheprovider --import-mode=importlib "$@"
