#!/usr/bin/env bash
# Latency side by side in one run (BENCHMARKS.md): bench 1 (`added-latency`: codex-fleet, HAProxy
# and the floor relay in front of the same worker socket), then bench 5 (`edge-latency`: the edge
# hop against HAProxy in TCP/TLS mode as the same second hop), then bench 4 (`fleet-load` at its
# default size once per run, where the through/direct ratio and codex-fleet's against both floors,
# the floor proper and the routing floor, come from; a few seconds a run).
# Installs HAProxy (Debian) and the pinned codex if missing, builds release binaries, runs.
# codex-fleet itself is the profile-guided build laid out by llvm-bolt (ops/bench/pgo.sh, as the
# image ships it), and so is the floor relay (`pgo.sh --floor`: the same training, so the floor
# gets what codex-fleet gets); about 30 minutes when the code changed: three release builds, the
# training runs and llvm-bolt. --no-pgo measures the plain release builds of both instead.
#
# Options: --rounds N --runs N (both latency benches; default 2000 and 3), --include-turns (bench
# 1), --sessions N (bench 5's edge memory, default 500; 0 skips it), --no-fleet-load (skip
# bench 4), --no-pgo (the plain release builds). The smoke run in CI
# (ops/bench/smoke.sh) runs the same bench binaries at a tiny size on the debug build.
# BENCH_PROFILE=debug uses the debug build instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
added=() edge=() fleet_load=1 runs=3 pgo=1
while [ $# -gt 0 ]; do
    case "$1" in
    --rounds | --runs)
        [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; }
        added+=("$1" "$2") edge+=("$1" "$2")
        if [ "$1" = --runs ]; then
            runs="$2"
        fi
        shift 2
        ;;
    --sessions)
        [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; }
        edge+=("$1" "$2")
        shift 2
        ;;
    --include-turns)
        added+=("$1")
        shift
        ;;
    --no-fleet-load)
        fleet_load=0
        shift
        ;;
    --no-pgo)
        pgo=0
        shift
        ;;
    *)
        echo "unknown option $1 (see the head of $0)" >&2
        exit 2
        ;;
    esac
done
# shellcheck source=ops/debian.sh
. ops/debian.sh
need_debian haproxy haproxy "the latency benches' anchor"
HAPROXY="$(command -v haproxy)"
CODEX_BIN="${CODEX_BIN:-$(bash ops/install-codex.sh)}"
export CODEX_BIN
PROFILE="${BENCH_PROFILE:-release}"
build=(cargo build --locked -p codex-fleet-bench -p codex-fleet-sim --bins)
if [ "$PROFILE" = release ]; then
    build+=(--release)
fi
if [ "$PROFILE" != release ] || [ "$pgo" = 0 ]; then
    build+=(-p codex-fleet)
fi
"${build[@]}"
BIN="target/$PROFILE"
if [ "$PROFILE" = release ] && [ "$pgo" = 1 ]; then
    CODEX_FLEET_BIN="$(bash ops/bench/pgo.sh --floor)"
    FLOOR_RELAY_BIN="$(dirname "$CODEX_FLEET_BIN")/floor-relay"
    export FLOOR_RELAY_BIN
    echo "== codex-fleet and the floor relay: the profile-guided builds, $CODEX_FLEET_BIN, $FLOOR_RELAY_BIN"
else
    CODEX_FLEET_BIN="$BIN/codex-fleet"
    echo "== codex-fleet: the plain $PROFILE build"
fi
export CODEX_FLEET_BIN
echo "== bench 1: added latency (codex-fleet, HAProxy, the floor relay)"
"$BIN/added-latency" --haproxy "$HAPROXY" "${added[@]}"
echo "== bench 5: the edge hop against HAProxy as a second hop"
"$BIN/edge-latency" --haproxy "$HAPROXY" "${edge[@]}"
if [ "$fleet_load" = 1 ]; then
    out="$(mktemp)"
    trap 'rm -f "$out"' EXIT
    ratios=() floors=() floor_direct=() routed=() routed_direct=()
    # ratio NAME: the `turns/s NAME = X` of the run just made.
    ratio() { grep -o "turns/s $1 = [0-9.]*" "$out" | head -1 | awk '{print $NF}'; }
    for ((i = 1; i <= runs; i++)); do
        echo "== bench 4: fleet-load (default size), run $i of $runs"
        "$BIN/fleet-load" | tee "$out"
        ratios+=("$(ratio through/direct)")
        floors+=("$(ratio through/floor)")
        floor_direct+=("$(ratio floor/direct)")
        routed+=("$(ratio 'through/routing floor')")
        routed_direct+=("$(ratio 'routing floor/direct')")
    done
    echo "fleet-load turns/s through/direct per run: ${ratios[*]}"
    echo "fleet-load turns/s floor/direct per run: ${floor_direct[*]}"
    echo "fleet-load turns/s routing floor/direct per run: ${routed_direct[*]}"
    echo "fleet-load turns/s through/floor per run: ${floors[*]}"
    echo "fleet-load turns/s through/routing floor per run: ${routed[*]}"
fi
