#!/usr/bin/env bash
# Added latency of codex-fleet against HAProxy, side by side in one run (BENCHMARKS.md, bench 1).
# Installs HAProxy (Debian) and the pinned codex if missing, builds release binaries, runs.
# Arguments go to the bench, e.g. `--rounds 600 --runs 3` (the default) or `--rounds 20 --runs 1`
# (the smoke run, ops/bench/smoke.sh). BENCH_PROFILE=debug uses the debug build instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if ! command -v haproxy >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        if ! { apt-get install -y haproxy >/dev/null 2>&1 ||
            { apt-get update >/dev/null && apt-get install -y haproxy >/dev/null; }; }; then
            echo "installing Debian's haproxy failed: bench 1 needs it" >&2
            exit 1
        fi
    else
        echo "haproxy is missing: install Debian's haproxy package" >&2
        exit 1
    fi
fi
CODEX_BIN="${CODEX_BIN:-$(bash ops/install-codex.sh)}"
export CODEX_BIN
PROFILE="${BENCH_PROFILE:-release}"
if [ "$PROFILE" = release ]; then
    cargo build --locked --release -p codex-fleet -p codex-fleet-bench --bins
else
    cargo build --locked -p codex-fleet -p codex-fleet-bench --bins
fi
exec "target/$PROFILE/added-latency" --haproxy "$(command -v haproxy)" "$@"
