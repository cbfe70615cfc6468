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
# --floor treats the floor relay the benches measure codex-fleet against (`floor-relay`) the same
# way, trained by the same `fleet-load` runs (their floor phase, and one more with the floor
# reading frames as a router must, `--route`), into target/pgo/floor-relay:
# a floor built plainly would flatter a ratio to it. `latency.sh` passes it; the image does not.
# About 10 minutes more (a second profile-use build).
# The profile lives in target/pgo and is made afresh whenever the code changes (any tracked
# *.rs, *.toml or Cargo.lock, committed or not), this script or the toolchain does, so it always
# matches the source; with no change since the last run, the last optimized builds are reused.
#
# llvm-profdata: $LLVM_PROFDATA, else llvm-profdata-19 from Debian's llvm-19; llvm-bolt and
# merge-fdata: $LLVM_BOLT_DIR (the directory holding both), else Debian's bolt-19's (each
# installed when missing and running as root). Their LLVM need not be rustc's: llvm-profdata must
# read the raw profile of rustc's instrumentation (llvm-19 reads rustc 1.95's; llvm-14's does not).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
floor=0
case "${1:-}" in
--floor) floor=1 ;;
"") ;;
*)
    echo "unknown option $1 (see the head of $0)" >&2
    exit 2
    ;;
esac
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
# The floor's build is reused only with the same key; a build without it leaves none behind.
if [ -n "$code" ] && [ -x "$out/codex-fleet" ] && [ "$(cat "$out/code" 2>/dev/null)" = "$code" ] &&
    { [ "$floor" = 0 ] || { [ -x "$out/floor-relay" ] && [ "$(cat "$out/floor-code" 2>/dev/null)" = "$code" ]; }; }; then
    echo "== pgo: no code changed since the last optimized build; reusing it" >&2
    echo "$out/codex-fleet"
    exit 0
fi
rm -f "$out/code" "$out/codex-fleet" "$out/floor-code" "$out/floor-relay"
rm -rf "$out/profiles" "$out/floor-profiles" "$out/bolt"
mkdir -p "$out/profiles" "$out/floor-profiles" "$out/bolt"
# Both instrumented binaries come from one build; each training run points the one it trains at
# its own profile directory.
targets=(-p codex-fleet --bin codex-fleet)
if [ "$floor" = 1 ]; then
    targets+=(-p codex-fleet-bench --bin floor-relay)
fi
echo "== pgo: the instrumented build" >&2
RUSTFLAGS="-Cprofile-generate=$out/profiles" \
    cargo build --locked --release "${targets[@]}" --target-dir "$out/gen" >&2
echo "== pgo: the trainers (fleet-load, the simulator)" >&2
cargo build --locked --release -p codex-fleet-bench -p codex-fleet-sim --bins >&2
# The training: both roles' paths, through codex-fleet at $1 and the floor relay at $2 (an
# instrumented build writes its profile as it exits, under $3 when given). Each `fleet-load` run
# has the floor relay run as the floor proper and then reading frames as a router must, so with
# --floor the routing floor that `added-latency` measures beside the floor proper is trained too.
train() {
    for edge in "" --edge; do
        # shellcheck disable=SC2086 # no edge: no argument
        env CODEX_FLEET_BIN="$1" FLOOR_RELAY_BIN="$2" ${3:+"LLVM_PROFILE_FILE=$3/%p-%m.profraw"} \
            target/release/fleet-load $edge >&2
    done
}
# optimize NAME PACKAGE: the profile-use build of binary NAME from $out/NAME.profdata, linked
# with its relocations kept for llvm-bolt, in $out/use (codex-fleet) or $out/NAME-use.
optimize() {
    local dir="$out/use"
    [ "$1" = codex-fleet ] || dir="$out/$1-use"
    RUSTFLAGS="-Cprofile-use=$out/$1.profdata -Clink-args=-Wl,--emit-relocs" \
        cargo build --locked --release -p "$2" --bin "$1" --target-dir "$dir" >&2
    echo "$dir/release/$1"
}
echo "== pgo: training codex-fleet" >&2
train "$out/gen/release/codex-fleet" "$PWD/target/release/floor-relay"
ls "$out/profiles"/*.profraw >/dev/null
"$profdata" merge -o "$out/codex-fleet.profdata" "$out/profiles"/*.profraw >&2
echo "== pgo: the optimized build" >&2
fleet="$(optimize codex-fleet codex-fleet)"
floor_bin="$PWD/target/release/floor-relay"
if [ "$floor" = 1 ]; then
    echo "== pgo: training the floor relay (codex-fleet: the build just made)" >&2
    train "$fleet" "$out/gen/release/floor-relay" "$out/floor-profiles"
    ls "$out/floor-profiles"/*.profraw >/dev/null
    "$profdata" merge -o "$out/floor-relay.profdata" "$out/floor-profiles"/*.profraw >&2
    echo "== pgo: the floor relay's optimized build" >&2
    floor_bin="$(optimize floor-relay codex-fleet-bench)"
fi
echo "== pgo: the layout (llvm-bolt): instrumented, trained, rewritten" >&2
# instrument BIN NAME: llvm-bolt's instrumented copy of BIN, writing $out/bolt/NAME.<pid>.fdata.
instrument() {
    "$bolt_dir/llvm-bolt" "$1" -instrument -o "$out/bolt/$2" \
        -instrumentation-file="$out/bolt/$2" -instrumentation-file-append-pid >&2
    echo "$out/bolt/$2"
}
bolted_fleet="$(instrument "$fleet" codex-fleet)"
bolted_floor="$floor_bin"
if [ "$floor" = 1 ]; then
    bolted_floor="$(instrument "$floor_bin" floor-relay)"
fi
train "$bolted_fleet" "$bolted_floor"
# The hot blocks of each function in the order they run, cold ones split off (error paths,
# unwinding), functions that run together placed together, identical ones folded; the line
# tables kept (and moved with the code), so backtraces still name files and lines.
layout() {
    "$bolt_dir/merge-fdata" "$out/bolt/$2".*.fdata >"$out/bolt/$2.fdata"
    "$bolt_dir/llvm-bolt" "$1" -o "$out/$2" \
        -data="$out/bolt/$2.fdata" -reorder-blocks=ext-tsp -reorder-functions=cdsort \
        -split-functions -split-all-cold -split-eh -icf=1 -use-gnu-stack \
        -update-debug-sections >&2
}
layout "$fleet" codex-fleet
echo "$code" >"$out/code"
if [ "$floor" = 1 ]; then
    layout "$floor_bin" floor-relay
    echo "$code" >"$out/floor-code"
fi
echo "$out/codex-fleet"
