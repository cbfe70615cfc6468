#!/usr/bin/env bash
# Offline checks of charts/codex-fleet (ops/chart-check.py says what): installs its tools once into
# .tools/chart-check (a Python venv, pinned versions) and runs them. Needs Python >= 3.12 (pyenv's,
# or the system's); it fails, rather than skips, without one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${CODEX_FLEET_TOOLS:-$root/.tools}"
# helm-python-sdk embeds Helm's Go SDK (v4.2.3): the engine of `helm template` and `helm lint`,
# no helm binary or cluster needed. kubernetes-validate ships the Kubernetes OpenAPI schemas.
requirements="helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 PyYAML==6.0.2"
venv="$tools/chart-check"

python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
find_python() {
  local p
  if command -v pyenv >/dev/null; then
    for v in $(pyenv versions --bare 2>/dev/null | sort -rV); do
      p="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$p" ] && python_ok "$p"; then echo "$p"; return 0; fi
    done
  fi
  for p in "$HOME"/.pyenv/versions/*/bin/python3 python3.13 python3.12 python3; do
    p="$(command -v "$p" 2>/dev/null || true)"
    if [ -n "$p" ] && python_ok "$p"; then echo "$p"; return 0; fi
  done
  return 1
}

if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/requirements" 2>/dev/null)" != "$requirements" ]; then
  python="$(find_python)" || {
    echo "chart-check: needs Python >= 3.12 (tomllib, helm-python-sdk); install one, e.g. pyenv install 3.12" >&2
    exit 1
  }
  echo "chart-check: installing $requirements into $venv (Python $("$python" -c 'import platform; print(platform.python_version())'))" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check $requirements
  echo "$requirements" > "$venv/requirements"
fi
exec "$venv/bin/python" "$root/ops/chart-check.py" "$@"
