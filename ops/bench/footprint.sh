#!/usr/bin/env bash
# Code and data footprint per round trip (BENCHMARKS.md, bench 1, "What a cold round trip
# touches"): codex-fleet, the floor relay and the routing floor (the floor with --route) run
# under callgrind's cache simulator inside the same `added-latency` bench, with caches so small
# (32 KiB L1s, a 64 KiB last level) that none of codex-fleet's survives from one round trip to the
# next, as in the interleaved bench where six other proxies, the worker and the client run between
# two of codex-fleet's round trips. Each last-level miss is then a distinct cache line the round trip
# touches: the work a cold CPU fetches from memory. It moves far less than a latency median from
# run to run, but not nothing: two runs of one binary differed by about 25 data lines and 25 code
# lines (BENCHMARKS.md, 2026-12-05), so a change needs to move more than that to show in one pair.
# The premise holds for codex-fleet, not quite for the floor: its round trip (about 52 KiB) nearly
# fits the simulated 64 KiB, so part of it survives to its next round trip and its counts are low
# (tokio's `pow`, called more often by the floor, costs it half the lines). Compare a
# binary with itself before and after; the fleet/floor ratios overstate (BENCHMARKS.md, 2026-12-05,
# "footprint.sh undercounts the floor").
#
# Two bench runs (200 and 1,200 rounds); the difference over the 1,000 extra rounds is one round
# trip's, without start-up and shutdown. Under a minute once the release binaries exist (35 s
# here), plus the release build when they do not.
#
# Usage: [FOOTPRINT_KEEP=DIR] bash ops/bench/footprint.sh [--fleet BIN] [--floor BIN]
#   (default: target/release/codex-fleet and target/release/floor-relay, built when missing).
# Installs Debian's valgrind when missing (as root), and the pinned codex.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
fleet="" floor=""
while [ $# -gt 0 ]; do
    case "$1" in
    --fleet | --floor)
        [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; }
        if [ "$1" = --fleet ]; then fleet="$(realpath "$2")"; else floor="$(realpath "$2")"; fi
        shift 2
        ;;
    *)
        echo "unknown option $1 (see the head of $0)" >&2
        exit 2
        ;;
    esac
done
# shellcheck source=ops/debian.sh
. ops/debian.sh
need_debian valgrind valgrind "the cache simulator"
need_debian haproxy haproxy "the bench's anchor"
CODEX_BIN="${CODEX_BIN:-$(bash ops/install-codex.sh)}"
export CODEX_BIN
cargo build --locked --release -p codex-fleet-bench -p codex-fleet-sim --bins >&2
if [ -z "$fleet" ] || [ -z "$floor" ]; then
    cargo build --locked --release -p codex-fleet >&2
fi
fleet="${fleet:-$PWD/target/release/codex-fleet}"
floor="${floor:-$PWD/target/release/floor-relay}"
# FOOTPRINT_KEEP=DIR keeps callgrind's outputs there (per function: callgrind_annotate on the
# 1,200-round and the 200-round output, the difference over 1,000; whose code each line is:
# `python3 ops/bench/footprint_by_source.py DIR`); else they are removed.
if [ -n "${FOOTPRINT_KEEP:-}" ]; then
    work="$(realpath -m "$FOOTPRINT_KEEP")"
    rm -rf "$work" && mkdir -p "$work"
    trap 'pkill -TERM -f "callgrind-out-file=$work/" 2>/dev/null || true' EXIT
else
    work="$(mktemp -d)"
    trap 'pkill -TERM -f "callgrind-out-file=$work/" 2>/dev/null || true; rm -rf "$work"' EXIT
fi

# The bench kills what it starts with SIGKILL, which would lose callgrind's output: each wrapper
# runs valgrind as its child (no exec), so the kill takes the wrapper and valgrind is stopped with
# SIGTERM afterwards, when it writes its counts. The one-thread floor runs unwrapped; the floor
# started with --route (the routing floor) is counted as floor-route.
for who in fleet floor; do
    bin="$fleet"
    [ "$who" = floor ] && bin="$floor"
    cat >"$work/$who" <<EOF
#!/usr/bin/env bash
case "\$*" in *worker-threads*) exec "$bin" "\$@" ;; esac
name=$who
case "\$*" in *--route*) name=$who-route ;; esac
# Under valgrind /proc/self/exe is valgrind: workers start through codex-fleet's binary by name.
CODEX_FLEET_EXEC_SHIM="$bin" valgrind --tool=callgrind --cache-sim=yes --I1=32768,8,64 --D1=32768,8,64 --LL=65536,8,64 \
    --log-file="$work/vg.%p.log" --callgrind-out-file="$work/\$name.\$(cat "$work/rounds").%p.out" \
    "$bin" "\$@"
EOF
    chmod +x "$work/$who"
done
for rounds in 200 1200; do
    echo "$rounds" >"$work/rounds"
    echo "== added-latency, $rounds rounds, codex-fleet and the floor under callgrind" >&2
    CODEX_FLEET_BIN="$work/fleet" FLOOR_RELAY_BIN="$work/floor" \
        target/release/added-latency --haproxy "$(command -v haproxy)" --rounds "$rounds" \
        --runs 1 >"$work/bench.$rounds.txt" 2>&1 </dev/null || {
        cat "$work/bench.$rounds.txt" >&2
        exit 1
    }
    pkill -TERM -f "callgrind-out-file=$work/" || true
    for _ in $(seq 1 100); do
        pgrep -f "callgrind-out-file=$work/" >/dev/null || break
        sleep 0.2
    done
done
python3 - "$work" <<'EOF'
import glob, sys
work = sys.argv[1]
def totals(who, rounds):
    [path] = glob.glob(f"{work}/{who}.{rounds}.*.out")
    events = summary = None
    for line in open(path):
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:"):
            summary = [int(x) for x in line.split()[1:]]
    return dict(zip(events, summary))
rows = {}
for who in ("fleet", "floor", "floor-route"):
    a, b = totals(who, 200), totals(who, 1200)
    d = {k: (b[k] - a[k]) / 1000 for k in b}
    rows[who] = (d["Ir"], d["ILmr"], d["DLmr"] + d["DLmw"])
print("per round trip (1,200 rounds minus 200, over 1,000), cold: 64 KiB last level")
print("| | instructions | code lines touched | data lines touched | KiB fetched |")
print("|---|---|---|---|---|")
for who, name in (("fleet", "codex-fleet"), ("floor", "floor relay"),
                  ("floor-route", "routing floor (--route)")):
    ir, il, dl = rows[who]
    print(f"| {name} | {ir:,.0f} | {il:,.0f} | {dl:,.0f} | {(il + dl) * 64 / 1024:,.0f} |")
for (a, an), (b, bn) in ((("fleet", "codex-fleet"), ("floor", "floor")),
                         (("fleet", "codex-fleet"), ("floor-route", "routing floor")),
                         (("floor-route", "routing floor"), ("floor", "floor"))):
    f, g = rows[a], rows[b]
    print(f"{an} / {bn}: instructions {f[0] / g[0]:.2f}, code lines {f[1] / g[1]:.2f}, "
          f"data lines {f[2] / g[2]:.2f}")
EOF
