#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs the pinned codex, checks formatting and lints,
# builds the binary and runs every test (unit, crate and end-to-end with real workers).
# Run it as root: the per-tenant uid tests (tests/tests/containment.rs, worker/tests/run_as.rs)
# fail when not root, unless CODEX_FLEET_SKIP_ROOT_TESTS=1 skips them knowingly.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# One build from a clean tree: incremental caches would only cost disk (several GiB) and time.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The build and the suite need about DISK_NEEDED_GIB free where cargo builds (target/, or
# CARGO_TARGET_DIR); say so before starting rather than fail with "No space left on device"
# half way through.
DISK_NEEDED_GIB=8
target_dir="${CARGO_TARGET_DIR:-target}"
mkdir -p "$target_dir"
avail_gib=$(( $(df -Pk "$target_dir" | awk 'NR == 2 { print $4 }') / 1048576 ))
if (( avail_gib < DISK_NEEDED_GIB )); then
  echo "warning: ${avail_gib} GiB free under ${target_dir}/; the suite needs about ${DISK_NEEDED_GIB} GiB" >&2
fi
# The fast lane first: a formatting slip, a lint or a unit test fails here, in the first
# minutes, before anything is installed or any worker starts.
cargo fmt --all -- --check
cargo clippy --locked --workspace --all-targets -- -D warnings
# Doc links resolve, and public docs link only to what they show.
RUSTDOCFLAGS="-D warnings" cargo doc --locked --workspace --no-deps
# Then every unit test (in-memory sessions, the config, the fake legs): needs no worker.
cargo test --locked --workspace --exclude codex-fleet-testkit --lib --bins
CODEX_BIN="$(bash ops/install-codex.sh)"
export CODEX_BIN
# shellcheck source=ops/debian.sh
. ops/debian.sh
# tests/tests/ops.rs checks the alert rules with promtool (Debian's prometheus package ships it).
need_debian promtool prometheus "promtool, for the alert rules"
# tests/tests/tui.rs drives the real Codex TUI in tmux.
need_debian tmux tmux "the TUI test"
echo "using $("$CODEX_BIN" --version) at $CODEX_BIN"
cargo build --locked --bins
# The Helm chart, offline: helm lint and a real Helm render of both modes with every values file
# of charts/codex-fleet/ci/, each object validated against the Kubernetes OpenAPI schema, values
# that must be refused, and the tenant pod the built binary renders (ops/chart-check.py).
bash ops/chart-check.sh
# Every benchmark at a tiny size on the debug build just made: each must run and print its numbers.
bash ops/bench/smoke.sh
# The crates' own integration tests (some start the real worker) and doc tests.
cargo test --locked --workspace --exclude codex-fleet-testkit --test '*'
cargo test --locked --workspace --exclude codex-fleet-testkit --doc
# End-to-end tests one at a time: several of them measure latency or timing against a baseline
# taken in the same test, which other tests' real workers running at once would distort.
cargo test --locked -p codex-fleet-testkit -- --test-threads=1
# The opt-in real-cluster test: with KUBECONFIG set it installs the chart and runs a turn through
# it (docs/kubernetes.md, "Kubernetes: a node per tenant"); without, it says it skips.
bash ops/k8s-smoke.sh
