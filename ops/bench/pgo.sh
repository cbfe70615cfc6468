#!/usr/bin/env bash
# Builds codex-fleet with profile-guided optimization (BENCHMARKS.md, "Profile-guided build") and
# prints the optimized binary's path on stdout (everything else goes to stderr):
#   1. an instrumented release build (`-Cprofile-generate`), in target/pgo/gen;
#   2. a training run: `fleet-load` through it (simulated workers: sessions, turns, streamed
#      deltas, thread/read, the shutdown), and the same sessions through an edge in front of it
#      (`fleet-load --edge`), so both roles' paths are in the profile. The latency benches
#      themselves are never the training;
#   3. the profile merged by llvm-profdata, and the release build that uses it
#      (`-Cprofile-use`), in target/pgo/use.
# The profile lives in target/pgo and is made afresh whenever the code changes (any tracked
# *.rs, *.toml or Cargo.lock, committed or not) or the toolchain does, so it always matches the source; with no change
# since the last run, the last optimized build is reused as it is.
#
# llvm-profdata: $LLVM_PROFDATA, else llvm-profdata-19 from Debian's llvm-19 (installed when
# missing and running as root). Its LLVM need not be rustc's: it must read the raw profile of
# rustc's instrumentation (llvm-19 reads rustc 1.95's; llvm-14's does not).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
profdata="${LLVM_PROFDATA:-}"
if [ -z "$profdata" ]; then
    # shellcheck source=ops/debian.sh
    . ops/debian.sh
    need_debian llvm-profdata-19 llvm-19 "llvm-profdata; or set LLVM_PROFDATA"
    profdata="$(command -v llvm-profdata-19)"
fi
out="$PWD/target/pgo"
code="" # outside a git checkout (an image build), always built afresh
if git rev-parse --git-dir >/dev/null 2>&1; then
    code="$({ rustc -vV; git ls-files -s -- '*.rs' '*.toml' Cargo.lock; git diff HEAD -- '*.rs' '*.toml' Cargo.lock; } | sha256sum | cut -d' ' -f1)"
fi
if [ -n "$code" ] && [ -x "$out/use/release/codex-fleet" ] && [ "$(cat "$out/code" 2>/dev/null)" = "$code" ]; then
    echo "== pgo: no code changed since the last optimized build; reusing it" >&2
    echo "$out/use/release/codex-fleet"
    exit 0
fi
rm -f "$out/code"
rm -rf "$out/profiles"
mkdir -p "$out/profiles"
echo "== pgo: the instrumented build" >&2
RUSTFLAGS="-Cprofile-generate=$out/profiles" \
    cargo build --locked --release -p codex-fleet --bin codex-fleet --target-dir "$out/gen" >&2
echo "== pgo: the trainers (fleet-load, the simulator)" >&2
cargo build --locked --release -p codex-fleet-bench -p codex-fleet-sim --bins >&2
echo "== pgo: training" >&2
for edge in "" --edge; do
    # shellcheck disable=SC2086 # no edge: no argument
    CODEX_FLEET_BIN="$out/gen/release/codex-fleet" target/release/fleet-load $edge >&2
done
ls "$out/profiles"/*.profraw >/dev/null
"$profdata" merge -o "$out/codex-fleet.profdata" "$out/profiles"/*.profraw >&2
echo "== pgo: the optimized build" >&2
RUSTFLAGS="-Cprofile-use=$out/codex-fleet.profdata" \
    cargo build --locked --release -p codex-fleet --bin codex-fleet --target-dir "$out/use" >&2
echo "$code" >"$out/code"
echo "$out/use/release/codex-fleet"
