#!/usr/bin/env bash
# Runs codex-fleet on its embedded default: a local dev tenant, self-signed TLS, a printed token,
# and the offline mock model when the tenant has no credentials. Installs the pinned codex first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CODEX_BIN="$(bash ops/install-codex.sh)"
export CODEX_BIN
exec cargo run --locked --release --bin codex-fleet -- dev "$@"
