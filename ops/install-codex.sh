#!/usr/bin/env bash
# Installs the pinned @openai/codex from npm into .tools/codex (once) and prints the path of the
# native binary inside the package. Workers run that binary, never the node launcher.
set -euo pipefail
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${CODEX_FLEET_TOOLS:-$root/.tools}"
# Workers may run under per-tenant uids (when codex-fleet runs as root): every directory on the
# way to the binary must be passable by others. A checkout under a private home is not, so the
# pinned codex then goes to a shared location instead.
passable() {
  local d="$1"
  while [ "$d" != "/" ]; do
    [ -e "$d" ] || { d="$(dirname "$d")"; continue; }
    [ "$(( 0$(stat -c %a "$d") & 01 ))" -ne 0 ] || return 1
    d="$(dirname "$d")"
  done
}
if [ -z "${CODEX_FLEET_TOOLS:-}" ] && [ "$(id -u)" = 0 ] && ! passable "$tools"; then
  tools=/opt/codex-fleet/tools
fi
prefix="$tools/codex-$CODEX_VERSION"

case "$(uname -m)" in
  x86_64) triple=x86_64-unknown-linux-musl; pkg=codex-linux-x64 ;;
  aarch64 | arm64) triple=aarch64-unknown-linux-musl; pkg=codex-linux-arm64 ;;
  *) echo "install-codex: unsupported architecture $(uname -m)" >&2; exit 1 ;;
esac

find_bin() {
  for d in "$prefix/node_modules/@openai/$pkg" "$prefix/node_modules/@openai/codex/node_modules/@openai/$pkg"; do
    if [ -x "$d/vendor/$triple/bin/codex" ]; then
      echo "$d/vendor/$triple/bin/codex"
      return 0
    fi
  done
  return 1
}

if ! bin="$(find_bin)" || [ "$("$bin" --version 2>/dev/null)" != "codex-cli $CODEX_VERSION" ]; then
  command -v npm >/dev/null || { echo "install-codex: npm is required (apt-get install nodejs npm)" >&2; exit 1; }
  mkdir -p "$prefix"
  echo "install-codex: installing @openai/codex@$CODEX_VERSION into $prefix" >&2
  npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "@openai/codex@$CODEX_VERSION" >&2
  bin="$(find_bin)" || { echo "install-codex: native binary not found after install" >&2; exit 1; }
fi
echo "$bin"
