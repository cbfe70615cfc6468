#!/usr/bin/env bash
# Smoke run of the six benchmarks (BENCHMARKS.md) at a tiny size, a few seconds each: checks that
# every tool runs to the end and prints its numbers, never the numbers themselves. Uses the debug
# build that `ops/test.sh` has just made (`cargo build --bins`), since a release build would cost
# CI minutes for numbers nobody reads; `BENCH_PROFILE=release` uses release binaries instead.
# Needs CODEX_BIN (ops/test.sh exports it); latency.sh (benches 1 and 5) installs HAProxy from
# Debian when missing and fails if it cannot.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PROFILE="${BENCH_PROFILE:-debug}"
BIN="target/$PROFILE"
: "${CODEX_BIN:?CODEX_BIN must name the pinned codex binary (ops/install-codex.sh prints it)}"

# run NAME PATTERN... -- COMMAND...: runs COMMAND, shows its output, and fails unless it exited 0
# and printed a line matching every PATTERN.
run() {
    local name="$1"
    shift
    local patterns=()
    while [ "$1" != "--" ]; do
        patterns+=("$1")
        shift
    done
    shift
    local out started=$SECONDS
    echo "== bench smoke: $name"
    if ! out="$("$@" 2>&1)"; then
        printf '%s\n' "$out"
        echo "bench smoke: $name failed" >&2
        exit 1
    fi
    printf '%s\n' "$out"
    for p in "${patterns[@]}"; do
        if ! grep -Eq -- "$p" <<<"$out"; then
            echo "bench smoke: $name printed no line matching /$p/" >&2
            exit 1
        fi
    done
    echo "== bench smoke: $name ok ($((SECONDS - started)) s)"
}

run "1 and 5: added latency and the edge hop (ops/bench/latency.sh)" \
    'added by codex-fleet: +-?[0-9]+' 'added by HAProxy: +-?[0-9]+' 'added by the floor: +-?[0-9]+' \
    'codex-fleet added median / HAProxy added median = (-?[0-9.]+|-?inf|NaN)' \
    'codex-fleet added median / floor added median = (-?[0-9.]+|-?inf|NaN); 90% of 1000 resamples within' \
    'added by the routing floor: +-?[0-9]+' \
    'codex-fleet added median / routing floor added median = (-?[0-9.]+|-?inf|NaN)' \
    'CPU per round trip, .*: codex-fleet [0-9.]+; HAProxy [0-9.]+; floor [0-9.]+; floor, 1 thread [0-9.]+; routing floor [0-9.]+;' \
    'added by the node \(one hop, as serve\): p50 +-?[0-9]+' 'added by the edge hop alone: +p50 +-?[0-9]+' \
    'added by the HAProxy hop alone: +p50 +-?[0-9]+' \
    'edge hop median / HAProxy hop median = (-?[0-9.]+|-?inf|NaN); 90% of 1000 resamples within' \
    'edge memory: .* KiB per session' -- \
    env BENCH_PROFILE="$PROFILE" bash ops/bench/latency.sh --rounds 20 --runs 1 --sessions 20 --no-fleet-load
run "2 notify-rate" \
    'through codex-fleet .* = [0-9]+ notifications/s' 'direct on .* = [0-9]+ notifications/s' \
    'through/direct = [0-9.]+' 'CPU s per 100k notifications' -- \
    "$BIN/notify-rate" --duration-secs 1 --warmup-secs 0.5 --sessions 2 --workers 1 --deltas 100 --words 20
run "3 idle-memory" \
    '50 idle authenticated connections .* KiB per connection' -- \
    "$BIN/idle-memory" --connections 20,50
run "4 fleet-load" \
    'through codex-fleet .*: 4 sessions ok, 0 failed' 'turns/s through/direct = [0-9.]+' \
    'through the floor relay .*: 4 sessions ok, 0 failed' 'turns/s through/floor = [0-9.]+' \
    'floor relay CPU during the turns' \
    'through the routing floor .*: 4 sessions ok, 0 failed' 'turns/s through/routing floor = [0-9.]+' \
    'routing floor CPU during the turns' \
    'machine CPU per turn through codex-fleet: [0-9.]+ ms = clients [0-9.]+ \+ proxy [0-9.]+ \+ simulators [0-9.]+ \+ the rest -?[0-9.]+' \
    'request latency .* p50 .* p99' -- \
    "$BIN/fleet-load" --tenants 2 --workers 1 --sessions 4 --turns 2
run "4 fleet-load through an edge (the profile-guided build's training, ops/bench/pgo.sh)" \
    'an edge in front of it: wss://' \
    'through an edge and codex-fleet as its node .*: 4 sessions ok, 0 failed' -- \
    "$BIN/fleet-load" --tenants 2 --workers 1 --sessions 4 --turns 2 --edge
run "6 spawn-stall" \
    'nothing starting: +[0-9]+ round trips: p50 +[0-9]+ µs, p99 +[0-9]+, p99.9 +[0-9]+, max +[0-9]+' \
    '2 workers a second: +[0-9]+ round trips: p50 +[0-9]+ µs' \
    "a burst's workers ready a second after its reload: at least 2 of 2" -- \
    "$BIN/spawn-stall" --connections 20 --burst 2 --bursts 2 --quiet-secs 1
