#!/usr/bin/env bash
# Opt-in test against a real Kubernetes cluster (docs/kubernetes.md, "Kubernetes: a node per
# tenant"): installs the chart in mode: kubernetes into a fresh namespace, waits for the edges, then
# runs a real turn with `codex exec --remote` through a port-forward to the wss Service; the
# tenant's node pod is created on demand by an edge. Skipped, with a message, when KUBECONFIG is not
# set: CI has no cluster, and nothing here has been run against one yet.
#
# Needs: helm, kubectl, cert-manager in the cluster (the link certificates), openssl, an image built
# from ops/image/Dockerfile and pushed where the cluster pulls from (CODEX_FLEET_IMAGE=repo:tag),
# and a model key for the tenant (OPENAI_API_KEY), handed to its pod through the Secret
# <prefix>-model-<tenant>. KEEP_NAMESPACE=1 leaves the namespace for a look afterwards.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -z "${KUBECONFIG:-}" ]; then
  echo "k8s-smoke: KUBECONFIG is not set: skipped (no cluster to install the chart into)"
  exit 0
fi
for tool in helm kubectl openssl; do
  command -v "$tool" >/dev/null || { echo "k8s-smoke: $tool is required" >&2; exit 1; }
done
: "${CODEX_FLEET_IMAGE:?k8s-smoke: set CODEX_FLEET_IMAGE=registry/codex-fleet:tag (ops/image/Dockerfile)}"
: "${OPENAI_API_KEY:?k8s-smoke: set OPENAI_API_KEY: the tenant node runs a real turn against the model}"
codex="${CODEX_BIN:-$(bash ops/install-codex.sh)}"

ns="codex-fleet-smoke-$(date +%s)"
release=smoke
fullname="$release-codex-fleet"
work="$(mktemp -d)"
pf_pid=""
cleanup() {
  [ -n "$pf_pid" ] && kill "$pf_pid" 2>/dev/null || true
  if [ "${KEEP_NAMESPACE:-0}" = 1 ]; then
    echo "k8s-smoke: namespace $ns kept (kubectl delete namespace $ns)"
  else
    kubectl delete namespace "$ns" --wait=false >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

# The wss certificate for the port-forwarded address, and a tenant token with its digest.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
  -subj /CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 \
  -keyout "$work/tls.key" -out "$work/tls.crt" 2>/dev/null
token="$(openssl rand -hex 32)"
digest="$(printf %s "$token" | sha256sum | cut -d' ' -f1)"

kubectl create namespace "$ns" >/dev/null
kubectl -n "$ns" create secret tls codex-fleet-tls --cert="$work/tls.crt" --key="$work/tls.key" >/dev/null
kubectl -n "$ns" create secret generic "$fullname-model-smoke" \
  --from-literal=OPENAI_API_KEY="$OPENAI_API_KEY" >/dev/null
cat > "$work/values.yaml" <<EOF
mode: kubernetes
image:
  repository: "${CODEX_FLEET_IMAGE%:*}"
  tag: "${CODEX_FLEET_IMAGE##*:}"
workers:
  pass_env: [OPENAI_API_KEY]
  worker_idle_secs: 120
networkPolicy:
  monitoring:
    namespaceSelector:
      matchLabels: {kubernetes.io/metadata.name: "$ns"}
tenants:
  - id: smoke
    token_sha256: ["$digest"]
EOF
echo "k8s-smoke: installing the chart into namespace $ns"
helm install "$release" charts/codex-fleet --namespace "$ns" -f "$work/values.yaml" --wait --timeout 10m
kubectl -n "$ns" rollout status "deploy/$fullname" --timeout=5m

port=18443
kubectl -n "$ns" port-forward "svc/$fullname" "$port:8443" >"$work/port-forward.log" 2>&1 &
pf_pid=$!
sleep 3

echo "k8s-smoke: a turn through the edges (the tenant's node pod starts on demand)"
mkdir -p "$work/client"
started=$(date +%s)
out="$(cd "$work/client" && SSL_CERT_FILE="$work/tls.crt" CODEX_HOME="$work/client" \
  CODEX_FLEET_TOKEN="$token" timeout 600 "$codex" exec --skip-git-repo-check \
  --remote "wss://localhost:$port/" --remote-auth-token-env CODEX_FLEET_TOKEN \
  "Reply with the single word: pong" </dev/null 2>&1)" || {
  echo "$out"
  kubectl -n "$ns" get pods,pvc -o wide || true
  kubectl -n "$ns" logs "deploy/$fullname" --tail=100 || true
  echo "k8s-smoke: FAILED: codex exec --remote did not complete" >&2
  exit 1
}
echo "$out" | tail -5
pod="$(kubectl -n "$ns" get pods -l app.kubernetes.io/component=tenant-node,codex-fleet.io/tenant=smoke -o name)"
[ -n "$pod" ] || { echo "k8s-smoke: FAILED: no tenant node pod for tenant smoke" >&2; exit 1; }
kubectl -n "$ns" get pvc "$fullname-home-smoke" >/dev/null
echo "k8s-smoke: ok: a turn in $(( $(date +%s) - started )) s through $pod (first session included the pod's start)"
