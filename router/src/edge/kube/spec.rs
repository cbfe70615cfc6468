//! The tenant's PersistentVolumeClaim and Pod, built from the chart's pod template: the one
//! builder both the backend and `codex-fleet render-tenant-pod` use.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use serde_json::{json, Value};

use crate::config::nodes::{KubernetesNodes, Nodes};
use crate::config::Tenant;

/// The label that names a pod's or volume's tenant (the watch selects on it).
pub const TENANT_LABEL: &str = "codex-fleet.io/tenant";
/// The label of a tenant pod that names what it was made from: a hash of its spec (the
/// template, the tenant's entry and resources), so pods of an old template can be found.
pub const TEMPLATE_HASH_LABEL: &str = "codex-fleet.io/template-hash";
/// Where the node config's `workers.state_dir` is in the pod (the tenant volume).
pub const HOME_MOUNT: &str = "/var/lib/codex-fleet";
/// The node config the chart mounts into every tenant pod.
pub const NODE_CONFIG: &str = "/etc/codex-fleet/node/config.toml";
/// The one container of a tenant pod.
pub const CONTAINER: &str = "node";
/// The environment variable that carries the tenant's own `[[tenants]]` entry (JSON, without
/// credentials) to its node: `codex-fleet node --tenant ID` serves the tenant with it.
pub const TENANT_ENTRY_ENV: &str = "CODEX_FLEET_TENANT_ENTRY";
/// Where the service account's namespace is mounted in a pod.
const SA_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// A tenant's object names: `<prefix>-node-<tenant>`, `<prefix>-home-<tenant>`,
/// `<prefix>-model-<tenant>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// The pod.
    pub pod: String,
    /// The volume claim.
    pub pvc: String,
    /// The model credentials Secret (optional: it may not exist).
    pub secret: String,
}

impl Names {
    /// The names for `tenant` under `prefix`.
    pub fn of(prefix: &str, tenant: &str) -> Names {
        Names {
            pod: format!("{prefix}-node-{tenant}"),
            pvc: format!("{prefix}-home-{tenant}"),
            secret: format!("{prefix}-model-{tenant}"),
        }
    }
}

/// The pod template (a full Pod manifest in JSON), checked for what the edge relies on.
#[derive(Debug, Clone)]
pub struct Template(Value);

impl Template {
    /// Reads and checks `path`.
    pub fn load(path: &Path) -> anyhow::Result<Template> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("pod template {}", path.display()))?;
        Template::parse(&text).with_context(|| format!("pod template {}", path.display()))
    }

    /// Parses and checks a template: a v1 Pod with exactly one container named `node`.
    pub fn parse(text: &str) -> anyhow::Result<Template> {
        let v: Value = serde_json::from_str(text).context("not JSON")?;
        if v["kind"] != "Pod" || v["apiVersion"] != "v1" {
            anyhow::bail!("not a v1 Pod manifest (apiVersion v1, kind Pod)");
        }
        let _typed: Pod = serde_json::from_value(v.clone()).context("not a valid Pod")?;
        let containers = v["spec"]["containers"]
            .as_array()
            .context("spec.containers missing")?;
        if containers.len() != 1 || containers[0]["name"] != CONTAINER {
            anyhow::bail!("spec.containers must be exactly one container named {CONTAINER:?}");
        }
        Ok(Template(v))
    }

    /// The node's admin port, where the kubelet asks whether it is ready: the `node`
    /// container's readiness probe's `httpGet` port (a number, or the name of one of its
    /// ports). The edge asks the same port whether the node is idle.
    pub fn admin_port(&self) -> Option<u16> {
        let c = &self.0["spec"]["containers"][0];
        let port = &c["readinessProbe"]["httpGet"]["port"];
        if let Some(n) = port.as_u64() {
            return u16::try_from(n).ok();
        }
        let name = port.as_str()?;
        if let Ok(n) = name.parse() {
            return Some(n);
        }
        c["ports"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .and_then(|n| u16::try_from(n).ok())
    }
}

/// The namespace tenant pods live in: the configured one, else the service account's.
pub fn namespace(k: &KubernetesNodes) -> Option<String> {
    k.namespace.clone().or_else(|| {
        std::fs::read_to_string(SA_NAMESPACE)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    })
}

/// The labels of a tenant's objects: the template's, and the tenant label.
fn labels(template: &Template, tenant: &str) -> serde_json::Map<String, Value> {
    let mut labels = template.0["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    labels.insert(TENANT_LABEL.into(), json!(tenant));
    labels
}

/// The tenant's entry as its node needs it (docs/decisions/0017-settings-travel-with-the-tenant.md:
/// settings travel with the tenant), as one line of JSON: every key of the edge's `[[tenants]]`
/// entry except what only an edge uses — the credentials (`token_sha256`, `token_files`: a node
/// never authenticates a client; and a tenant with a shell in its pod reads this), the pod's own
/// `kubernetes` table and `node`. Unset keys are left out, so the node applies its defaults as for
/// a file.
pub fn node_entry(tenant: &Tenant) -> anyhow::Result<String> {
    let mut t = tenant.clone();
    t.token_sha256.clear();
    t.token_files.clear();
    t.kubernetes = None;
    t.node = None;
    let mut v = serde_json::to_value(&t).context("tenant entry")?;
    if let Some(o) = v.as_object_mut() {
        o.remove("token_sha256");
        o.remove("token_files");
    }
    fn prune(v: &mut Value) {
        if let Some(o) = v.as_object_mut() {
            o.retain(|_, x| !x.is_null());
            o.values_mut().for_each(prune);
        }
    }
    prune(&mut v);
    Ok(v.to_string())
}

/// The tenant's volume claim: ReadWriteOnce, `storage_size`, `storage_class`.
pub fn tenant_pvc(
    template: &Template,
    k: &KubernetesNodes,
    ns: &str,
    tenant: &str,
) -> anyhow::Result<PersistentVolumeClaim> {
    let names = Names::of(&k.name_prefix, tenant);
    let mut spec = json!({
        "accessModes": ["ReadWriteOnce"],
        "resources": { "requests": { "storage": k.storage_size } },
    });
    if let Some(class) = &k.storage_class {
        spec["storageClassName"] = json!(class);
    }
    let v = json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": { "name": names.pvc, "namespace": ns, "labels": labels(template, tenant) },
        "spec": spec,
    });
    serde_json::from_value(v).context("tenant volume claim")
}

/// The tenant's pod: the template with its name, labels, args, its entry ([`node_entry`]),
/// home volume, model Secret and (when the tenant sets them) resources.
pub fn tenant_pod(
    template: &Template,
    k: &KubernetesNodes,
    ns: &str,
    tenant: &Tenant,
) -> anyhow::Result<Pod> {
    let names = Names::of(&k.name_prefix, &tenant.id);
    let mut v = template.0.clone();
    let meta = &mut v["metadata"];
    if let Some(m) = meta.as_object_mut() {
        // A template from `kubectl get` may carry server-set fields; none may reach a create.
        for server_set in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "generateName",
            "managedFields",
        ] {
            m.remove(server_set);
        }
    }
    meta["name"] = json!(names.pod);
    meta["namespace"] = json!(ns);
    meta["labels"] = Value::Object(labels(template, &tenant.id));
    v.as_object_mut().map(|o| o.remove("status"));
    let spec = &mut v["spec"];
    let volumes = spec["volumes"].as_array().cloned().unwrap_or_default();
    let mut volumes: Vec<Value> = volumes
        .into_iter()
        .filter(|v| v["name"] != "home")
        .collect();
    volumes.push(json!({ "name": "home", "persistentVolumeClaim": { "claimName": names.pvc } }));
    spec["volumes"] = json!(volumes);
    let c = &mut spec["containers"][0];
    c["args"] = json!([
        "node",
        "--config",
        NODE_CONFIG,
        "--tenant",
        tenant.id,
        "--exit-when-idle"
    ]);
    let mounts = c["volumeMounts"].as_array().cloned().unwrap_or_default();
    let mut mounts: Vec<Value> = mounts.into_iter().filter(|m| m["name"] != "home").collect();
    mounts.push(json!({ "name": "home", "mountPath": HOME_MOUNT }));
    c["volumeMounts"] = json!(mounts);
    let env = c["env"].as_array().cloned().unwrap_or_default();
    let mut env: Vec<Value> = env
        .into_iter()
        .filter(|e| e["name"] != TENANT_ENTRY_ENV)
        .collect();
    env.push(json!({ "name": TENANT_ENTRY_ENV, "value": node_entry(tenant)? }));
    c["env"] = json!(env);
    let env_from = c["envFrom"].as_array().cloned().unwrap_or_default();
    let mut env_from: Vec<Value> = env_from
        .into_iter()
        .filter(|e| e["secretRef"]["name"] != json!(names.secret))
        .collect();
    env_from.push(json!({ "secretRef": { "name": names.secret, "optional": true } }));
    c["envFrom"] = json!(env_from);
    if let Some(r) = tenant
        .kubernetes
        .as_ref()
        .and_then(|k| k.resources.as_ref())
    {
        for (what, map) in [("requests", &r.requests), ("limits", &r.limits)] {
            for (resource, q) in map {
                c["resources"][what][resource] = json!(q);
            }
        }
    }
    let hash = spec_hash(&json!([v["spec"], v["metadata"]["annotations"]]));
    v["metadata"]["labels"][TEMPLATE_HASH_LABEL] = json!(hash);
    serde_json::from_value(v).context("tenant pod")
}

/// The first 10 hex digits of the SHA-256 of a pod's spec and annotations as JSON (keys in
/// order: serde_json's maps are sorted), a valid label value. The annotations count so that a
/// template can carry a checksum of what its pods mount (the chart's node config).
fn spec_hash(spec: &Value) -> String {
    use sha2::{Digest, Sha256};
    let digest = hex::encode(Sha256::digest(spec.to_string().as_bytes()));
    digest[..10].to_owned()
}

/// The requests of a tenant's pod as numbers: `cpu` in cores, `memory` in bytes.
pub fn requests(pod: &Pod) -> BTreeMap<&'static str, f64> {
    let mut out = BTreeMap::new();
    let Some(requests) = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
    else {
        return out;
    };
    if let Some(v) = requests
        .get("cpu")
        .and_then(|q| crate::config::quantity::cores(&q.0))
    {
        out.insert("cpu", v);
    }
    if let Some(v) = requests
        .get("memory")
        .and_then(|q| crate::config::quantity::bytes(&q.0))
    {
        out.insert("memory", v);
    }
    out
}

/// `codex-fleet render-tenant-pod`: the volume claim and pod the backend would create for
/// `tenant` of `tenants` with the configuration's `[nodes]`, as a `v1/List`.
pub fn render(nodes: Option<&Nodes>, tenants: &[Tenant], tenant: &str) -> anyhow::Result<Value> {
    let k = nodes.and_then(|n| n.kubernetes.as_ref()).context(
        "the configuration has no [nodes.kubernetes] (an edge on the kubernetes backend)",
    )?;
    let t = tenants
        .iter()
        .find(|t| t.id == tenant)
        .with_context(|| format!("no tenant {tenant:?} in the configuration"))?;
    let template = Template::load(&k.pod_template)?;
    let ns = namespace(k).unwrap_or_else(|| "default".into());
    let pvc = tenant_pvc(&template, k, &ns, &t.id)?;
    let pod = tenant_pod(&template, k, &ns, t)?;
    Ok(json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [serde_json::to_value(pvc)?, serde_json::to_value(pod)?],
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const TEMPLATE: &str = r#"{"apiVersion":"v1","kind":"Pod",
        "metadata":{"name":"template","labels":{"app.kubernetes.io/name":"codex-fleet","app.kubernetes.io/component":"tenant-node"}},
        "spec":{"restartPolicy":"Never","automountServiceAccountToken":false,
          "containers":[{"name":"node","image":"codex-fleet:1","command":["codex-fleet"],
            "resources":{"requests":{"cpu":"250m","memory":"512Mi"}},
            "volumeMounts":[{"name":"tmp","mountPath":"/tmp"}]}],
          "volumes":[{"name":"tmp","emptyDir":{}}]}}"#;

    fn edge(template: &Path, extra_tenant: &str, kube_extra: &str) -> String {
        format!(
            r#"[listen]
addr = "127.0.0.1:8443"
tls_cert = "/etc/c.crt"
tls_key = "/etc/c.key"

[nodes]
backend = "kubernetes"
ca = "/l/ca.pem"
client_cert = "/l/e.crt"
client_key = "/l/e.key"

[nodes.kubernetes]
namespace = "codex"
pod_template = {:?}
{kube_extra}

[[tenants]]
id = "acme"
token_sha256 = ["{}"]
{extra_tenant}
"#,
            template.display(),
            "ab".repeat(32)
        )
    }

    #[test]
    fn the_pod_is_the_template_plus_the_tenants_parts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pod.json");
        std::fs::write(&path, TEMPLATE).expect("write");
        let cfg = Config::parse(&edge(
            &path,
            "[tenants.kubernetes.resources]\nlimits = { cpu = \"2\", memory = \"4Gi\" }\nrequests = { memory = \"1Gi\" }",
            "storage_class = \"fast\"",
        ))
        .expect("valid");
        let list = render(cfg.nodes.as_ref(), &cfg.tenants, "acme").expect("render");
        assert_eq!(list["kind"], "List");
        let (pvc, pod) = (&list["items"][0], &list["items"][1]);
        assert_eq!(pvc["kind"], "PersistentVolumeClaim");
        assert_eq!(pvc["metadata"]["name"], "codex-fleet-home-acme");
        assert_eq!(pvc["spec"]["resources"]["requests"]["storage"], "10Gi");
        assert_eq!(pvc["spec"]["storageClassName"], "fast");
        assert_eq!(pod["metadata"]["name"], "codex-fleet-node-acme");
        assert_eq!(pod["metadata"]["namespace"], "codex");
        assert_eq!(pod["metadata"]["labels"][TENANT_LABEL], "acme");
        assert_eq!(
            pod["metadata"]["labels"]["app.kubernetes.io/component"],
            "tenant-node"
        );
        let c = &pod["spec"]["containers"][0];
        assert_eq!(
            c["args"],
            json!([
                "node",
                "--config",
                NODE_CONFIG,
                "--tenant",
                "acme",
                "--exit-when-idle"
            ])
        );
        assert_eq!(c["resources"]["requests"]["cpu"], "250m");
        assert_eq!(c["resources"]["requests"]["memory"], "1Gi");
        assert_eq!(c["resources"]["limits"]["cpu"], "2");
        assert_eq!(
            c["envFrom"],
            json!([{ "secretRef": { "name": "codex-fleet-model-acme", "optional": true } }])
        );
        // The tenant's own entry travels in the pod; no credential does.
        let env = c["env"].as_array().expect("env");
        assert_eq!(env.len(), 1, "{env:?}");
        assert_eq!(env[0]["name"], TENANT_ENTRY_ENV);
        let entry: Value =
            serde_json::from_str(env[0]["value"].as_str().expect("a value")).expect("JSON");
        assert_eq!(entry["id"], "acme");
        assert_eq!(entry["max_workers"], 4);
        assert!(
            !pod.to_string().contains(&"ab".repeat(32)),
            "a token digest in the pod"
        );
        assert!(c["volumeMounts"]
            .as_array()
            .expect("mounts")
            .contains(&json!({ "name": "home", "mountPath": HOME_MOUNT })));
        assert!(pod["spec"]["volumes"]
            .as_array()
            .expect("volumes")
            .contains(&json!({ "name": "home", "persistentVolumeClaim": { "claimName": "codex-fleet-home-acme" } })));
        let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
        assert_eq!(requests(&typed).get("memory"), Some(&1_073_741_824.0));
        assert_eq!(requests(&typed).get("cpu"), Some(&0.25));
    }

    #[test]
    fn a_tenants_pod_carries_its_own_settings_and_nothing_of_another_tenant() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pod.json");
        std::fs::write(&path, TEMPLATE).expect("write");
        let beta_digest = "cd".repeat(32);
        let text = edge(
            &path,
            &format!(
                "max_workers = 7\nconfig_overrides = [\"model=\\\"o3\\\"\"]\n\
                 token_files = [\"/etc/codex-fleet/tokens/acme\"]\n\
                 [tenants.policy]\nprocess = \"deny\"\n\n\
                 [[tenants]]\nid = \"beta\"\ntoken_sha256 = [\"{beta_digest}\"]\nmax_workers = 2\n"
            ),
            "",
        );
        let cfg = Config::parse(&text).expect("valid");
        let list = render(cfg.nodes.as_ref(), &cfg.tenants, "acme").expect("render");
        let pod = list["items"][1].to_string();
        for secret in [
            beta_digest.as_str(),
            &"ab".repeat(32),
            "/etc/codex-fleet/tokens",
        ] {
            assert!(!pod.contains(secret), "{secret} in acme's pod: {pod}");
        }
        assert!(!pod.contains("beta"), "another tenant in acme's pod: {pod}");
        let c = &list["items"][1]["spec"]["containers"][0];
        let entry: Value =
            serde_json::from_str(c["env"][0]["value"].as_str().expect("the entry")).expect("JSON");
        assert_eq!(
            entry,
            json!({
                "id": "acme", "max_workers": 7, "min_workers": 0,
                "config_overrides": ["model=\"o3\""], "allowed_origins": [],
                "close_on_expiry": true, "workspace_roots": [],
                "policy": { "process": "deny" },
            })
        );
    }

    #[test]
    fn the_admin_port_is_the_readiness_probes_by_number_or_by_name() {
        let with = |probe: &str, ports: &str| {
            Template::parse(&format!(
                r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"t"}},"spec":{{"containers":[{{"name":"node","image":"i","readinessProbe":{{"httpGet":{{"path":"/readyz","port":{probe}}}}},"ports":{ports}}}]}}}}"#
            ))
            .expect("a template")
            .admin_port()
        };
        assert_eq!(with("9464", "[]"), Some(9464));
        assert_eq!(with("\"9465\"", "[]"), Some(9465));
        assert_eq!(
            with("\"admin\"", r#"[{"name":"admin","containerPort":9466}]"#),
            Some(9466)
        );
        assert_eq!(
            with("\"other\"", r#"[{"name":"admin","containerPort":9466}]"#),
            None
        );
        assert_eq!(with("70000", "[]"), None);
    }

    #[test]
    fn the_template_hash_label_changes_with_the_template_or_the_tenants_entry() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pod.json");
        std::fs::write(&path, TEMPLATE).expect("write");
        let hash = |tenant: &str| {
            let cfg = Config::parse(&edge(&path, tenant, "")).expect("valid");
            let list = render(cfg.nodes.as_ref(), &cfg.tenants, "acme").expect("render");
            list["items"][1]["metadata"]["labels"][TEMPLATE_HASH_LABEL]
                .as_str()
                .expect("a hash label")
                .to_owned()
        };
        let first = hash("");
        assert_eq!(first.len(), 10);
        assert!(first.chars().all(|c| c.is_ascii_hexdigit()), "{first}");
        assert_eq!(hash(""), first, "the same spec, the same hash");
        assert_ne!(hash("max_workers = 7"), first, "the tenant's entry changed");
        std::fs::write(&path, TEMPLATE.replace("codex-fleet:1", "codex-fleet:2")).expect("write");
        assert_ne!(hash(""), first, "the template changed");
    }

    #[test]
    fn a_kubernetes_edge_refuses_what_cannot_become_a_pod() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pod.json");
        let cases = [
            (
                "node = \"n1\"",
                "",
                "tenants[].node is for the static backend",
            ),
            ("", "name_prefix = \"Codex\"", "name_prefix"),
            ("", "storage_size = \"lots\"", "storage_size"),
            ("", "start_timeout_secs = 0", "start_timeout_secs"),
            ("", "max_pod_age_secs = 0", "max_pod_age_secs"),
            ("", "api_url = \"not a url\"", "api_url"),
            (
                "[tenants.kubernetes.resources]\nrequests = { cpu = \"fast\" }",
                "",
                "requests.cpu",
            ),
            (
                "[tenants.kubernetes.resources]\nrequests = { gpu = \"1\" }",
                "",
                "unknown resource",
            ),
        ];
        for (tenant, kube, needle) in cases {
            let e = Config::parse(&edge(&path, tenant, kube))
                .expect_err(needle)
                .to_string();
            assert!(e.contains(needle), "{needle}: {e}");
        }
        let underscore = edge(&path, "", "").replace("id = \"acme\"", "id = \"ac_me\"");
        let e = Config::parse(&underscore)
            .expect_err("underscore")
            .to_string();
        assert!(e.contains("not a DNS label"), "{e}");
        let no_table = edge(&path, "", "")
            .replace("[nodes.kubernetes]\n", "")
            .replace("namespace = \"codex\"\n", "")
            .replace(&format!("pod_template = {:?}\n", path.display()), "");
        let e = Config::parse(&no_table).expect_err("no table").to_string();
        assert!(e.contains("needs a [nodes.kubernetes] table"), "{e}");
    }

    #[test]
    fn a_template_without_its_node_container_is_refused() {
        assert!(Template::parse(TEMPLATE).is_ok());
        let two = TEMPLATE.replace(
            r#""containers":[{"name":"node""#,
            r#""containers":[{"name":"side","image":"x"},{"name":"node""#,
        );
        assert!(Template::parse(&two).is_err());
        let renamed = TEMPLATE.replace(r#"{"name":"node""#, r#"{"name":"app""#);
        assert!(Template::parse(&renamed).is_err());
        assert!(Template::parse(r#"{"apiVersion":"v1","kind":"Service"}"#).is_err());
    }
}
