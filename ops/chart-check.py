"""Offline checks of the Helm chart (run by ops/chart-check.sh, which installs what this needs).

For every values file in charts/codex-fleet/ci/: `helm lint --strict` and a real Helm render
(the Helm v4 Go SDK embedded in helm-python-sdk, the same engine as `helm template`), then every
rendered object is validated against the Kubernetes OpenAPI schema (kubernetes-validate, strict:
unknown fields are errors). CRDs it has no schema for (cert-manager, prometheus-operator) are
skipped by name only. The tenant pod template (pod.json) is validated as a Pod and checked against
the kubernetes backend's contract (docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md), the
edge and node config.toml are parsed as TOML, and values that must be refused (values.schema.json,
the chart's own checks) are. When the built binary has `render-tenant-pod`, the pod it would create
is validated as a Pod too, carries its tenant's own settings and no credential, and the node it
would start is started and serves the tenant with those settings
(docs/decisions/0017-settings-travel-with-the-tenant.md); every rendered config.toml must pass the
built binary's `check-config` (the edge's too: the binary has the kubernetes backend).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "codex-fleet"
RELEASE, NAMESPACE = "fleet", "codex"
# The newest schema kubernetes-validate ships and the oldest Kubernetes the chart supports
# (autoscaling/v2, policy/v1, seccompProfile, fsGroupChangePolicy are all older than 1.29).
KUBE_VERSIONS = [kubernetes_validate.latest_version(), "1.29.0"]
# Custom resources kubernetes-validate has no schema for: skipped by (apiVersion group, kind).
CRDS = {
    ("cert-manager.io", "Certificate"),
    ("cert-manager.io", "Issuer"),
    ("monitoring.coreos.com", "ServiceMonitor"),
    ("monitoring.coreos.com", "PodMonitor"),
    ("monitoring.coreos.com", "PrometheusRule"),
    ("gateway.networking.k8s.io", "TLSRoute"),
}
# The edge's Role, exactly as the backend's contract gives it
# (docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md).
ROLE_RULES = {
    "pods": {"get", "list", "watch", "create", "delete"},
    "persistentvolumeclaims": {"get", "list", "watch", "create"},
    "events": {"create", "patch"},
}

failures: list[str] = []


def fail(where: str, msg: str) -> None:
    failures.append(f"{where}: {msg}")
    print(f"  FAIL {where}: {msg}")


def merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    try:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    finally:
        chart.close()
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("__source", path)
                docs.append(doc)
    return docs


def validate(where: str, obj: dict) -> None:
    obj = {k: v for k, v in obj.items() if k != "__source"}
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            fail(where, f"Kubernetes {version}: {path}: {e.message}")
            return


def group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def find(docs: list[dict], kind: str, name: str | None = None) -> dict | None:
    for d in docs:
        if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name):
            return d
    return None


def check_kubernetes_contract(where: str, values: dict, docs: list[dict]) -> dict:
    """mode: kubernetes: the objects and shapes the backend's contract fixes
    (docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md). Returns pod.json."""
    full = f"{RELEASE}-codex-fleet"
    pod_cm = find(docs, "ConfigMap", f"{full}-tenant-pod")
    node_cm = find(docs, "ConfigMap", f"{full}-node-config")
    edge_cm = find(docs, "ConfigMap", full)
    if not (pod_cm and node_cm and edge_cm):
        fail(where, "ConfigMaps <fullname>, <fullname>-tenant-pod and <fullname>-node-config")
        return {}
    pod = json.loads(pod_cm["data"]["pod.json"])
    validate(f"{where} pod.json", pod)
    spec = pod["spec"]
    labels = pod["metadata"]["labels"]
    want_labels = {
        "app.kubernetes.io/name": "codex-fleet",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "tenant-node",
    }
    for k, v in want_labels.items():
        if labels.get(k) != v:
            fail(where, f"pod.json label {k}={labels.get(k)!r}, want {v!r}")
    containers = spec["containers"]
    if [c["name"] for c in containers] != ["node"]:
        fail(where, f"pod.json must have exactly one container named node: {containers}")
    c = containers[0]
    sc = c.get("securityContext", {})
    psc = spec.get("securityContext", {})
    checks = {
        "restartPolicy Never": spec.get("restartPolicy") == "Never",
        "automountServiceAccountToken false": spec.get("automountServiceAccountToken") is False,
        "seccomp RuntimeDefault": psc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
        "runAsNonRoot": psc.get("runAsNonRoot") is True or sc.get("runAsNonRoot") is True,
        "readOnlyRootFilesystem": sc.get("readOnlyRootFilesystem") is True,
        "allowPrivilegeEscalation false": sc.get("allowPrivilegeEscalation") is False,
        "capabilities drop ALL": sc.get("capabilities", {}).get("drop") == ["ALL"],
        "uid distinct from the edge's": psc.get("runAsUser") not in (None, 0)
        and psc.get("runAsUser") != values.get("podSecurityContext", {}).get("runAsUser", 10001),
        "readiness GET /readyz on 9464": c.get("readinessProbe", {}).get("httpGet")
        == {"path": "/readyz", "port": 9464},
        "command set, args left to the edge": bool(c.get("command")) and "args" not in c,
        "resources": bool(c.get("resources", {}).get("requests")),
        "no home volume (the edge adds it)": all(v["name"] != "home" for v in spec["volumes"]),
    }
    for what, ok in checks.items():
        if not ok:
            fail(where, f"pod.json: {what}")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    want_mounts = {
        "link-tls": "/etc/codex-fleet/link",
        "node-config": "/etc/codex-fleet/node",
        "tmp": "/tmp",
    }
    if mounts != want_mounts or set(volumes) != set(want_mounts):
        fail(where, f"pod.json volumes {sorted(volumes)} / mounts {mounts}, want {want_mounts}")
    if volumes.get("node-config", {}).get("configMap", {}).get("name") != f"{full}-node-config":
        fail(where, "pod.json node-config volume is not ConfigMap <fullname>-node-config")
    keys = {i["key"] for i in volumes.get("link-tls", {}).get("secret", {}).get("items", [])}
    if keys != {"tls.crt", "tls.key", "ca.crt"}:
        fail(where, f"pod.json link-tls items {keys}")
    tp = values.get("tenantPod", {})
    for field in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if tp.get(field) and spec.get(field) != tp[field]:
            fail(where, f"pod.json {field} is not tenantPod.{field}")

    edge = tomllib.loads(edge_cm["data"]["config.toml"])
    node = tomllib.loads(node_cm["data"]["config.toml"])
    nodes = edge.get("nodes", {})
    kube = nodes.get("kubernetes", {})
    if nodes.get("backend") != "kubernetes" or "workers" in edge:
        fail(where, "edge config.toml: [nodes] backend = kubernetes and no [workers]")
    if kube.get("pod_template") != "/etc/codex-fleet/tenant-pod/pod.json":
        fail(where, f"edge config.toml pod_template {kube.get('pod_template')}")
    link_port = kube.get("link_port")
    if node.get("listen", {}).get("addr") != f"0.0.0.0:{link_port}":
        fail(where, f"node config listens on {node.get('listen')}, edge dials {link_port}")
    if [p["containerPort"] for p in c["ports"] if p["name"] == "link"] != [link_port]:
        fail(where, "pod.json link port differs from nodes.kubernetes.link_port")
    if "tenants" in node or node.get("admin", {}).get("addr") != "0.0.0.0:9464":
        fail(where, "node config.toml: no [[tenants]], admin on 0.0.0.0:9464")
    if node.get("workers", {}).get("state_dir") != "/var/lib/codex-fleet":
        fail(where, "node config.toml: workers.state_dir must be the home mount")
    # Sessions live on the nodes, so the session audit is written there (stdout).
    want_audit = values.get("tenantPod", {}).get("audit", {}).get("path", "-")
    if node.get("audit", {}).get("path") != want_audit:
        fail(where, f"node config.toml: [audit] path {node.get('audit')}, want {want_audit!r}")
    # One tenant cannot fill the machine's disk or take its CPU.
    if not volumes.get("tmp", {}).get("emptyDir", {}).get("sizeLimit"):
        fail(where, "pod.json: the /tmp emptyDir has no sizeLimit")
    limits = c.get("resources", {}).get("limits", {})
    for resource in ("cpu", "memory", "ephemeral-storage"):
        if resource not in limits:
            fail(where, f"pod.json: no {resource} limit on the node container")
    # A changed node config changes the pods' template hash (the edge hashes
    # the spec and annotations), so pods of the old one can be found and replaced.
    if not pod["metadata"].get("annotations", {}).get("checksum/node-config"):
        fail(where, "pod.json: no checksum/node-config annotation")
    # An eviction never kills a node mid-drain (the edges' rule, for nodes).
    if spec.get("terminationGracePeriodSeconds", 30) <= drain_secs(values):
        fail(where, f"pod.json: terminationGracePeriodSeconds {spec.get('terminationGracePeriodSeconds')} "
                    f"is not longer than the node's drain ({drain_secs(values)} s)")
    for t in values.get("tenants", []):
        res = t.get("kubernetes", {}).get("resources")
        got = next((x for x in edge.get("tenants", []) if x["id"] == t["id"]), {})
        if res and got.get("kubernetes", {}).get("resources") != {
            k: {r: str(a) for r, a in v.items()} for k, v in res.items()
        }:
            fail(where, f"tenant {t['id']}: kubernetes.resources not rendered")

    role = find(docs, "Role")
    rules = {}
    for r in (role or {}).get("rules", []):
        for res in r["resources"]:
            rules.setdefault(res, set()).update(r["verbs"])
    if rules != ROLE_RULES:
        fail(where, f"Role rules {rules}, want exactly {ROLE_RULES}")
    binding = find(docs, "RoleBinding")
    sa = find(docs, "ServiceAccount")
    if not binding or not sa or binding["subjects"][0]["name"] != sa["metadata"]["name"]:
        fail(where, "RoleBinding binds the edges' ServiceAccount")
    deploy = find(docs, "Deployment", full)
    if not deploy:
        fail(where, "no edge Deployment")
    else:
        pspec = deploy["spec"]["template"]["spec"]
        if pspec.get("serviceAccountName") != sa["metadata"]["name"]:
            fail(where, "edge Deployment runs as another ServiceAccount")
        if not pspec.get("topologySpreadConstraints"):
            fail(where, "edge Deployment has no topologySpreadConstraints")
        edge_labels = deploy["spec"]["selector"]["matchLabels"]
        for svc in (d for d in docs if d["kind"] == "Service"):
            if svc["spec"]["selector"] != edge_labels:
                fail(where, f"Service {svc['metadata']['name']} does not select exactly the edges")
    if not find(docs, "PodDisruptionBudget"):
        fail(where, "no PodDisruptionBudget for the edges")
    nps = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if values.get("networkPolicy", {}).get("enabled", True):
        tenant_np = next(
            (n for n in nps if n["spec"]["podSelector"]["matchLabels"].get(
                "app.kubernetes.io/component") == "tenant-node"),
            None,
        )
        if not tenant_np:
            fail(where, "no NetworkPolicy for tenant pods")
        else:
            if set(tenant_np["spec"]["policyTypes"]) != {"Ingress", "Egress"}:
                fail(where, "tenant NetworkPolicy must restrict ingress and egress")
            first = tenant_np["spec"]["ingress"][0]
            # The edges: the link, and the admin port they ask whether a node is idle
            # (docs/kubernetes.md).
            want_ports = [{"port": link_port, "protocol": "TCP"}, {"port": 9464, "protocol": "TCP"}]
            if first["ports"] != want_ports or first["from"] != [
                {"podSelector": {"matchLabels": edge_labels}}
            ]:
                fail(where, f"tenant pods' ingress: edges on the link and admin ports only: {first}")
            for rule in tenant_np["spec"]["egress"]:
                for peer in rule["to"]:
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        fail(where, f"tenant egress to pods of this namespace: {peer}")
    return pod


def drain_secs(values: dict) -> int:
    """The longest drain of serve, an edge or a node (templates/_helpers.tpl, terminationGrace)."""
    drain, workers = values.get("drain") or {}, values.get("workers") or {}
    turns = drain.get("timeout_secs") or 300
    settle = drain.get("settle_secs") or 5
    return max(turns, settle) + (workers.get("stop_grace_secs") or 10) + 16


def check_cold_starts(where: str, values: dict, docs: list[dict], pod: dict) -> None:
    """The pre-puller pulls the tenant pods' image where they may run; the
    placeholders reserve a tenant pod's requests below its priority; neither gets a token."""
    full = f"{RELEASE}-codex-fleet"
    spec = pod.get("spec", {})
    tenant_image = spec.get("containers", [{}])[0].get("image")
    ds = find(docs, "DaemonSet", f"{full}-prepuller")
    if bool(ds) != bool((values.get("prePuller") or {}).get("enabled")):
        fail(where, "prePuller.enabled and the DaemonSet disagree")
    for obj, what in ((ds, "pre-puller"), (find(docs, "Deployment", f"{full}-placeholder"), "placeholders")):
        if not obj:
            continue
        p = obj["spec"]["template"]["spec"]
        images = {c["image"] for c in p.get("initContainers", []) + p["containers"]}
        if images != {tenant_image}:
            fail(where, f"{what} images {images}, want the tenant image {tenant_image}")
        for field in ("nodeSelector", "tolerations", "affinity"):
            if p.get(field) != spec.get(field):
                fail(where, f"{what} {field} is not the tenant pods'")
        if p.get("automountServiceAccountToken") is not False:
            fail(where, f"{what} pods get a service-account token")
    ph = find(docs, "Deployment", f"{full}-placeholder")
    if bool(ph) != bool((values.get("placeholders") or {}).get("enabled")):
        fail(where, "placeholders.enabled and the Deployment disagree")
    if ph:
        pc = find(docs, "PriorityClass", f"{full}-placeholder")
        tenant_priority = 0 if not spec.get("priorityClassName") else None
        if not pc or (tenant_priority is not None and pc["value"] >= tenant_priority):
            fail(where, f"placeholder priority {pc and pc['value']} is not below the tenant pods'")
        c = ph["spec"]["template"]["spec"]["containers"][0]
        if c["resources"]["requests"] != spec["containers"][0]["resources"]["requests"]:
            fail(where, "placeholder requests are not a tenant pod's")


def check_tls_route(where: str, values: dict, docs: list[dict]) -> None:
    """tlsRoute renders a Gateway API TLSRoute v1 (Standard since 1.5; v1alpha2 is
    gone from 1.6) that routes to the wss Service's port, and nothing when off."""
    route = find(docs, "TLSRoute")
    want = (values.get("tlsRoute") or {}).get("enabled", False)
    if not want:
        if route:
            fail(where, "a TLSRoute although tlsRoute.enabled is false")
        return
    if not route:
        fail(where, "tlsRoute.enabled renders no TLSRoute")
        return
    svc = find(docs, "Service", f"{RELEASE}-codex-fleet")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "wss")
    refs = [b for r in route["spec"]["rules"] for b in r["backendRefs"]]
    if route["apiVersion"] != "gateway.networking.k8s.io/v1":
        fail(where, f"TLSRoute apiVersion {route['apiVersion']}, want gateway.networking.k8s.io/v1")
    if refs != [{"name": svc["metadata"]["name"], "port": port}]:
        fail(where, f"TLSRoute backendRefs {refs}, want the wss Service on {port}")
    if route["spec"]["parentRefs"] != values["tlsRoute"]["parentRefs"]:
        fail(where, "TLSRoute parentRefs are not tlsRoute.parentRefs")


def check_ingress(where: str, values: dict, docs: list[dict]) -> None:
    """ingress renders an Ingress with TLS passthrough (ingress-nginx's
    annotation) for ingress.host to the wss Service, without a tls section (the controller must
    not terminate), and nothing when off."""
    ing = find(docs, "Ingress")
    want = values.get("ingress") or {}
    if not want.get("enabled", False):
        if ing:
            fail(where, "an Ingress although ingress.enabled is false")
        return
    if not ing:
        fail(where, "ingress.enabled renders no Ingress")
        return
    svc = find(docs, "Service", f"{RELEASE}-codex-fleet")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "wss")
    annotations = ing["metadata"].get("annotations") or {}
    if annotations.get("nginx.ingress.kubernetes.io/ssl-passthrough") != "true":
        fail(where, f"Ingress without ssl-passthrough: {annotations}")
    for k, v in (want.get("annotations") or {}).items():
        if annotations.get(k) != v:
            fail(where, f"Ingress annotation {k} is not ingress.annotations'")
    if ing["spec"].get("ingressClassName") != want.get("className", "nginx"):
        fail(where, f"ingressClassName {ing['spec'].get('ingressClassName')}, want ingress.className")
    if "tls" in ing["spec"]:
        fail(where, "Ingress has spec.tls: the controller would terminate TLS, not pass it through")
    rules = ing["spec"]["rules"]
    backends = [p["backend"] for r in rules for p in r["http"]["paths"]]
    if [r["host"] for r in rules] != [want["host"]]:
        fail(where, f"Ingress hosts {[r['host'] for r in rules]}, want [{want['host']}]")
    if backends != [{"service": {"name": svc["metadata"]["name"], "port": {"number": port}}}]:
        fail(where, f"Ingress backends {backends}, want the wss Service on {port}")
    else:
        print(f"  ok   Ingress: TLS passthrough for {want['host']} to {svc['metadata']['name']}:{port}")


def check_resources(where: str, docs: list[dict]) -> None:
    """Every container, init containers included, has requests and a memory
    limit, so a namespace ResourceQuota without a LimitRange admits every pod."""
    for d in docs:
        if d.get("kind") not in ("Deployment", "StatefulSet", "DaemonSet"):
            continue
        pod = d["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            r = c.get("resources") or {}
            if not r.get("requests") or "memory" not in (r.get("limits") or {}):
                fail(where, f"{d['kind']} {d['metadata']['name']} container {c['name']}: "
                            f"no requests or memory limit: {r}")


def fleet_binary() -> str | None:
    binary = os.environ.get("CODEX_FLEET_BIN") or str(ROOT / "target" / "debug" / "codex-fleet")
    return binary if Path(binary).exists() else None


def has_kubernetes_backend(binary: str) -> bool:
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    return "render-tenant-pod" in help_text


def stand_in_mounts(text: str, values: dict, tmp: Path) -> str:
    """The files config.toml names under an extraVolumeMounts path (credentials from a Secret)
    are not on this machine: a directory stands in for each mount, with a file for each path."""
    for i, m in enumerate(values.get("extraVolumeMounts") or []):
        prefix = m["mountPath"].rstrip("/") + "/"
        local = tmp / f"mount{i}"
        for part in text.split('"')[1::2]:
            if part.startswith(prefix):
                f = local / part[len(prefix):]
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text("stand-in-credential-0123456789abcdef\n")
        text = text.replace(f'"{prefix}', f'"{local}/')
    return text


def config_files(config: dict) -> list[str]:
    """The files a config.toml makes codex-fleet read besides its TLS and link certificates."""
    files = []
    for t in config.get("tenants", []):
        files += t.get("token_files", [])
    for j in config.get("auth", {}).get("jwt", []):
        files += [j[k] for k in ("secret_file", "jwks_file") if k in j]
    return files


def check_mounts(where: str, docs: list[dict]) -> None:
    """Every file config.toml names is mounted in the codex-fleet container
    and in the init container that runs check-config on it."""
    full = f"{RELEASE}-codex-fleet"
    cm = find(docs, "ConfigMap", full)
    if not cm:
        return
    files = config_files(tomllib.loads(cm["data"]["config.toml"]))
    for d in docs:
        if d.get("kind") not in ("Deployment", "StatefulSet") or d["metadata"]["name"] != full:
            continue
        pod = d["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
            for f in files:
                if not any(f.startswith(m) for m in mounts):
                    fail(where, f"{d['kind']} container {c['name']}: {f} (named by config.toml) is not mounted")


def check_config(name: str, docs: list[dict], values: dict | None = None) -> None:
    """Every rendered config.toml passes the built binary's `codex-fleet check-config`."""
    binary = fleet_binary()
    codex = os.environ.get("CODEX_BIN")
    values = values or {}
    if not binary or not codex:
        fail(f"{name} check-config", "needs the built codex-fleet (cargo build --bins) and CODEX_BIN (ops/test.sh has both)")
        return
    full = f"{RELEASE}-codex-fleet"
    with tempfile.TemporaryDirectory() as tmp:
        for doc in docs:
            if doc.get("kind") != "ConfigMap" or "config.toml" not in doc.get("data", {}):
                continue
            cm = doc["metadata"]["name"]
            text = doc["data"]["config.toml"]
            if 'backend = "kubernetes"' in text:
                if not has_kubernetes_backend(binary):
                    fail(f"{name} check-config {cm}", f"{binary} has no kubernetes backend")
                    continue
                pod_json = Path(tmp) / "pod.json"
                pod_json.write_text(find(docs, "ConfigMap", f"{full}-tenant-pod")["data"]["pod.json"])
                text = text.replace("/etc/codex-fleet/tenant-pod/pod.json", str(pod_json))
            # The image's codex is not on this machine: the pinned one stands in for it.
            text = text.replace('"/opt/codex/bin/codex"', json.dumps(codex))
            text = stand_in_mounts(text, values, Path(tmp))
            path = Path(tmp) / f"{cm}.toml"
            path.write_text(text)
            out = subprocess.run([binary, "check-config", str(path)], capture_output=True, text=True)
            if out.returncode != 0:
                fail(f"{name} check-config {cm}", (out.stderr or out.stdout).strip())
            else:
                print(f"  ok   codex-fleet check-config {cm}")


def render_tenant_pod(values: dict, docs: list[dict]) -> None:
    """The pod the edge would create (codex-fleet render-tenant-pod), validated as a Pod."""
    binary = fleet_binary()
    if not binary:
        fail("render-tenant-pod", "no built codex-fleet (cargo build --bins)")
        return
    if not has_kubernetes_backend(binary):
        fail("render-tenant-pod", f"{binary} has no such subcommand")
        return
    full = f"{RELEASE}-codex-fleet"
    with tempfile.TemporaryDirectory() as tmp:
        pod_json = Path(tmp) / "pod.json"
        pod_json.write_text(find(docs, "ConfigMap", f"{full}-tenant-pod")["data"]["pod.json"])
        edge = find(docs, "ConfigMap", full)["data"]["config.toml"]
        edge = edge.replace("/etc/codex-fleet/tenant-pod/pod.json", str(pod_json))
        config = Path(tmp) / "config.toml"
        config.write_text(edge)
        for t in values.get("tenants", []):
            out = subprocess.run(
                [binary, "render-tenant-pod", "--config", str(config), "--tenant", t["id"]],
                capture_output=True,
                text=True,
            )
            where = f"render-tenant-pod --tenant {t['id']}"
            if out.returncode != 0:
                fail(where, f"exit {out.returncode}: {out.stderr.strip()}")
                continue
            # A v1 List of the volume claim and the pod, as the backend's contract says
            # (docs/decisions/0015-on-kubernetes-lean-on-kubernetes.md).
            docs_out = []
            for d in yaml.safe_load_all(out.stdout):
                if d and d.get("kind") == "List":
                    docs_out.extend(d.get("items", []))
                elif d:
                    docs_out.append(d)
            if not any(d.get("kind") == "Pod" for d in docs_out):
                fail(where, f"no Pod in its output: {out.stdout[:200]}")
            before = len(failures)
            for d in docs_out:
                validate(f"{where} {d.get('kind')}", d)
            pod = next((d for d in docs_out if d.get("kind") == "Pod"), None)
            if pod:
                check_tenant_entry(where, values, t, pod)
                start_tenant_node(where, docs, t, pod, Path(tmp))
            if len(failures) == before:
                print(f"  ok   {where}: {', '.join(d.get('kind', '?') for d in docs_out)}")


ENTRY_ENV = "CODEX_FLEET_TENANT_ENTRY"
# What the node takes for a key the tenant's entry leaves out (router/src/config.rs).
TENANT_DEFAULTS = {"max_workers": 4, "min_workers": 0}


def entry_of(pod: dict) -> dict | None:
    env = pod["spec"]["containers"][0].get("env", [])
    value = next((e.get("value") for e in env if e.get("name") == ENTRY_ENV), None)
    return json.loads(value) if value is not None else None


def check_tenant_entry(where: str, values: dict, tenant: dict, pod: dict) -> None:
    """The pod carries its tenant's own settings, and no credential of any
    tenant nor anything of another tenant (a tenant has a shell in its pod)."""
    entry = entry_of(pod)
    if entry is None:
        fail(where, f"the pod has no {ENTRY_ENV}: the tenant's settings never reach its node")
        return
    for key in ("max_workers", "min_workers", "config_overrides", "workspace_roots", "command", "policy"):
        if key in tenant and entry.get(key) != tenant[key]:
            fail(where, f"{ENTRY_ENV} {key} = {entry.get(key)!r}, the tenant's is {tenant[key]!r}")
    text = json.dumps(pod)
    for other in values.get("tenants", []):
        for digest in other.get("token_sha256", []):
            if digest in text:
                fail(where, f"a token digest of tenant {other['id']} is in the pod")
        if other["id"] != tenant["id"] and f'"{other["id"]}"' in text:
            fail(where, f"tenant {other['id']} is named in the pod")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tenant_node(where: str, docs: list[dict], tenant: dict, pod: dict, tmp: Path) -> None:
    """Settings travel with the tenant (docs/decisions/0017-settings-travel-with-the-tenant.md): the
    node the backend would start (the rendered pod's args and env, the rendered node config with its
    paths and addresses moved onto this machine) serves the tenant with the tenant's own settings,
    read from its /metrics."""
    binary, codex = fleet_binary(), os.environ.get("CODEX_BIN")
    if not binary or not codex:
        fail(where, "starting its node needs the built codex-fleet and CODEX_BIN")
        return
    full = f"{RELEASE}-codex-fleet"
    home = tmp / f"home-{tenant['id']}"
    home.mkdir(mode=0o700, exist_ok=True)
    cert, key = tmp / "link.crt", tmp / "link.key"
    if not cert.exists():
        out = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=node",
             "-addext", "subjectAltName=DNS:node.codex-fleet.internal"],
            capture_output=True, text=True)
        if out.returncode != 0:
            fail(where, f"openssl: {out.stderr.strip()}")
            return
    admin = free_port()
    text = find(docs, "ConfigMap", f"{full}-node-config")["data"]["config.toml"]
    node = tomllib.loads(text)
    text = (text.replace("/etc/codex-fleet/link/tls.crt", str(cert))
            .replace("/etc/codex-fleet/link/tls.key", str(key))
            .replace("/etc/codex-fleet/link/ca.crt", str(cert))
            .replace(json.dumps(node["listen"]["addr"]), json.dumps(f"127.0.0.1:{free_port()}"))
            .replace('"0.0.0.0:9464"', json.dumps(f"127.0.0.1:{admin}"))
            .replace('"/var/lib/codex-fleet"', json.dumps(str(home)))
            .replace('"/opt/codex/bin/codex"', json.dumps(codex)))
    config = tmp / f"node-{tenant['id']}.toml"
    config.write_text(text)
    c = pod["spec"]["containers"][0]
    args = [str(config) if a == "/etc/codex-fleet/node/config.toml" else a for a in c["args"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODEX_FLEET")}
    for e in c.get("env", []):
        env[e["name"]] = e["value"].replace("/opt/codex/bin/codex", codex)
    env["CODEX_FLEET_LOG"] = "warn"
    log = tmp / f"node-{tenant['id']}.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen([binary, *args], env=env, stdout=logf, stderr=logf,
                                stdin=subprocess.DEVNULL)
    try:
        metrics = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=2) as r:
                    metrics = r.read().decode()
                break
            except OSError:
                time.sleep(0.2)
        if metrics is None:
            fail(where, f"its node did not start (exit {proc.poll()}): {log.read_text()[-2000:]}")
            return
        def limit(name: str) -> float | None:
            prefix = f'codex_fleet_tenant_limit{{limit="{name}",tenant="{tenant["id"]}"}} '
            alt = f'codex_fleet_tenant_limit{{tenant="{tenant["id"]}",limit="{name}"}} '
            for line in metrics.splitlines():
                if line.startswith(prefix) or line.startswith(alt):
                    return float(line.split()[-1])
            return None
        for key in ("max_workers",):
            want = tenant.get(key, TENANT_DEFAULTS[key])
            got = limit(key)
            if got != want:
                fail(where, f"its node serves {tenant['id']} with {key} {got}, the tenant's is {want}")
            else:
                print(f"  ok   {where}: its node serves {key} = {want:g}")
        others = [l for l in metrics.splitlines() if "tenant=" in l and f'tenant="{tenant["id"]}"' not in l]
        if others:
            fail(where, f"its node serves another tenant: {others[0]}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# Values that must be refused, each with what the refusal must say: on top of a valid file.
INVALID = [
    ("kubernetes-defaults", {"mode": "bogus"}, "value must be one of 'single', 'kubernetes'"),
    ("single-defaults", {"image": {"repository": ""}}, "/image/repository"),
    ("kubernetes-defaults", {"edge": {"replicas": "two"}}, "/edge/replicas"),
    ("kubernetes-defaults", {"networkPolicy": {"tenantEgress": {"mode": "closed"}}}, "/networkPolicy/tenantEgress/mode"),
    ("kubernetes-defaults", {"tenantPod": {"securityContext": {"readOnlyRootFilesystem": False}}}, "readOnlyRootFilesystem"),
    ("kubernetes-defaults", {"tenantPod": {"podSecurityContext": {"runAsUser": 10001}}}, "must differ from the edge's"),
    ("kubernetes-defaults", {"link": {"certManager": {"enabled": False}}}, "is required when link.certManager.enabled is false"),
    ("kubernetes-defaults", {"workers": {"state_dir": "/data"}}, "workers.state_dir must be /var/lib/codex-fleet"),
    ("kubernetes-defaults", {"tlsRoute": {"enabled": True}}, "tlsRoute.parentRefs is required"),
    ("kubernetes-defaults", {"ingress": {"enabled": True}}, "ingress.host is required"),
    ("single-defaults", {"ingress": {"enabled": True, "host": "Not A Host"}}, "/ingress/host"),
    ("kubernetes-defaults", {"tenantPod": {"terminationGracePeriodSeconds": 60}}, "tenantPod.terminationGracePeriodSeconds (60) must be longer than the drain"),
    ("kubernetes-defaults", {"tenants": [{"id": "Bad Id"}]}, "/tenants/0/id"),
    ("single-defaults", {"tenants": [{"id": "acme", "uid": 33}]}, "/tenants/0/uid"),
    ("single-defaults", {"tenants": [{"id": "acme", "gid": 65534}]}, "/tenants/0/gid"),
    ("single-defaults", {"workers": {"uid_range": [500, 2000]}}, "/workers/uid_range/0"),
    ("kubernetes-defaults", {"nodes": {"kubernetes": {"unknown_key": 1}}}, "unknown_key"),
    ("single-defaults", {"audit": {"keep_files": 0}}, "/audit/keep_files"),
]


def main() -> int:
    started = time.monotonic()
    ci = sorted((CHART / "ci").glob("*-values.yaml"))
    if not ci:
        print(f"no values files in {CHART / 'ci'}")
        return 1
    by_name = {}
    modes = set()
    for path in ci:
        values = yaml.safe_load(path.read_text()) or {}
        name = path.name.removesuffix("-values.yaml")
        by_name[name] = values
        mode = values.get("mode", "single")
        modes.add(mode)
        print(f"{path.relative_to(ROOT)} (mode: {mode})")
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + [
            {"error": e} for e in report["errors"]
        ]
        for p in problems:
            fail(f"{name} helm lint", f"{p.get('path', '')} {p['error']}")
        try:
            docs = render(values)
        except helm.HelmError as e:
            fail(f"{name} render", str(e))
            continue
        kinds = {}
        for doc in docs:
            kind = doc.get("kind", "?")
            where = f"{name} {kind}/{doc.get('metadata', {}).get('name')}"
            if (group(doc.get("apiVersion", "")), kind) in CRDS:
                kinds[f"{kind} (CRD, not validated)"] = kinds.get(f"{kind} (CRD, not validated)", 0) + 1
                if not doc.get("metadata", {}).get("name") or "spec" not in doc:
                    fail(where, "custom resource without metadata.name or spec")
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
            validate(where, doc)
        print("  ok   lint, render; validated: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        check_tls_route(name, values, docs)
        check_ingress(name, values, docs)
        check_config(name, docs, values)
        check_resources(name, docs)
        check_mounts(name, docs)
        if mode == "kubernetes":
            pod = check_kubernetes_contract(name, values, docs)
            check_cold_starts(name, values, docs, pod)
            render_tenant_pod(values, docs)
        elif find(docs, "StatefulSet") is None:
            fail(name, "mode: single renders no StatefulSet")
    if modes != {"single", "kubernetes"}:
        fail("ci", f"values files cover modes {modes}, want both")

    print("values that must be refused")
    for base, override, expect in INVALID:
        values = merge(by_name[base], override)
        where = f"{base} + {json.dumps(override)}"
        try:
            render(values)
        except helm.HelmError as e:
            if expect in str(e):
                print(f"  ok   refused: {where}")
            else:
                fail(where, f"refused, but not for {expect!r}: {e}")
            continue
        fail(where, "rendered; it must be refused")

    took = time.monotonic() - started
    if failures:
        print(f"chart-check: {len(failures)} failures ({took:.1f} s)")
        return 1
    print(f"chart-check: ok, {len(ci)} values files, {len(INVALID)} refusals ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
