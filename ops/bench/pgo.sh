#!/usr/bin/env bash
# Builds codex-fleet with profile-guided optimization (BENCHMARKS.md, "Profile-guided build") and
# lays its code out by the same training (BOLT; BENCHMARKS.md, "Hot code laid out together"), and
# prints the optimized binary's path on stdout (everything else goes to stderr):
#   1. an instrumented release build (`-Cprofile-generate`), in target/pgo/gen;
#   2. a training run: `fleet-load` through it (simulated workers: sessions, turns, streamed
#      deltas, thread/read, the shutdown), and the same sessions through an edge in front of it
#      (`fleet-load --edge`), so both roles' paths are in the profile. The latency benches
#      themselves are never the training;
#   3. the profile merged by llvm-profdata, and the release build that uses it
#      (`-Cprofile-use`, linked with its relocations kept for step 4), in target/pgo/use;
#   4. that build instrumented by llvm-bolt, the same training run through it, and llvm-bolt
#      rewriting it with the profile: the code each request runs placed together, the code it
#      does not run moved out of its way, in target/pgo/codex-fleet.
# The profile lives in target/pgo and is made afresh whenever the code changes (any tracked
# *.rs, *.toml or Cargo.lock, committed or not), this script or the toolchain does, so it always matches the source; with no change
# since the last run, the last optimized build is reused as it is.
#
# llvm-profdata: $LLVM_PROFDATA, else llvm-profdata-19 from Debian's llvm-19; llvm-bolt and
# merge-fdata: $LLVM_BOLT_DIR (the directory holding both), else Debian's bolt-19's (each
# installed when missing and running as root). Their LLVM need not be rustc's: llvm-profdata must
# read the raw profile of rustc's instrumentation (llvm-19 reads rustc 1.95's; llvm-14's does not).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=ops/debian.sh
. ops/debian.sh
profdata="${LLVM_PROFDATA:-}"
if [ -z "$profdata" ]; then
    need_debian llvm-profdata-19 llvm-19 "llvm-profdata; or set LLVM_PROFDATA"
    profdata="$(command -v llvm-profdata-19)"
fi
bolt_dir="${LLVM_BOLT_DIR:-}"
if [ -z "$bolt_dir" ]; then
    need_debian llvm-bolt-19 bolt-19 "llvm-bolt; or set LLVM_BOLT_DIR"
    # Run from LLVM's own directory, llvm-bolt finds its instrumentation runtime beside it.
    bolt_dir=/usr/lib/llvm-19/bin
fi
out="$PWD/target/pgo"
code="" # outside a git checkout (an image build), always built afresh
if git rev-parse --git-dir >/dev/null 2>&1; then
    code="$({ rustc -vV; git ls-files -s -- '*.rs' '*.toml' Cargo.lock ops/bench/pgo.sh; git diff HEAD -- '*.rs' '*.toml' Cargo.lock ops/bench/pgo.sh; } | sha256sum | cut -d' ' -f1)"
fi
if [ -n "$code" ] && [ -x "$out/codex-fleet" ] && [ "$(cat "$out/code" 2>/dev/null)" = "$code" ]; then
    echo "== pgo: no code changed since the last optimized build; reusing it" >&2
    echo "$out/codex-fleet"
    exit 0
fi
rm -f "$out/code" "$out/codex-fleet"
rm -rf "$out/profiles" "$out/bolt"
mkdir -p "$out/profiles" "$out/bolt"
echo "== pgo: the instrumented build" >&2
RUSTFLAGS="-Cprofile-generate=$out/profiles" \
    cargo build --locked --release -p codex-fleet --bin codex-fleet --target-dir "$out/gen" >&2
echo "== pgo: the trainers (fleet-load, the simulator)" >&2
cargo build --locked --release -p codex-fleet-bench -p codex-fleet-sim --bins >&2
# The training: both roles' paths, through the build at $1 (it writes its profile as it exits).
train() {
    for edge in "" --edge; do
        # shellcheck disable=SC2086 # no edge: no argument
        CODEX_FLEET_BIN="$1" target/release/fleet-load $edge >&2
    done
}
echo "== pgo: training" >&2
train "$out/gen/release/codex-fleet"
ls "$out/profiles"/*.profraw >/dev/null
"$profdata" merge -o "$out/codex-fleet.profdata" "$out/profiles"/*.profraw >&2
echo "== pgo: the optimized build" >&2
RUSTFLAGS="-Cprofile-use=$out/codex-fleet.profdata -Clink-args=-Wl,--emit-relocs" \
    cargo build --locked --release -p codex-fleet --bin codex-fleet --target-dir "$out/use" >&2
echo "== pgo: its layout (llvm-bolt): instrumented, trained, rewritten" >&2
"$bolt_dir/llvm-bolt" "$out/use/release/codex-fleet" -instrument -o "$out/bolt/instrumented" \
    -instrumentation-file="$out/bolt/profile" -instrumentation-file-append-pid >&2
train "$out/bolt/instrumented"
"$bolt_dir/merge-fdata" "$out/bolt"/profile.*.fdata >"$out/bolt/profile.fdata"
# The hot blocks of each function in the order they run, cold ones split off (error paths,
# unwinding), functions that run together placed together, identical ones folded; the line
# tables kept (and moved with the code), so backtraces still name files and lines.
"$bolt_dir/llvm-bolt" "$out/use/release/codex-fleet" -o "$out/codex-fleet" \
    -data="$out/bolt/profile.fdata" -reorder-blocks=ext-tsp -reorder-functions=cdsort \
    -split-functions -split-all-cold -split-eh -icf=1 -use-gnu-stack \
    -update-debug-sections >&2
echo "$code" >"$out/code"
echo "$out/codex-fleet"
