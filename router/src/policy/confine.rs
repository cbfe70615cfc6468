//! What a host method's params are checked against: its rule's checks ([`super::rules`]) run
//! over the parsed params, refusing what leaves the tenant's roots or the allowed profiles and
//! config keys, dropping or rewriting what the policy confines, and answering a malformed
//! request in app-server's own words.

use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::rules::{self, Check, Rule};
use super::{strict, HostAccessPolicy, TenantRoots};

/// Why a rule's checks stopped a request.
#[derive(Debug)]
pub(super) enum Fault {
    /// A well-formed request the policy refuses (`-32003`).
    Deny(String),
    /// A malformed request (`-32600`): the detail as serde words it for app-server.
    Invalid(String),
}

impl From<String> for Fault {
    fn from(detail: String) -> Fault {
        Fault::Deny(detail)
    }
}

impl From<&str> for Fault {
    fn from(detail: &str) -> Fault {
        Fault::Deny(detail.to_owned())
    }
}

/// `invalid type: <what v is>, expected <expected>`, word for word what serde_json says when
/// app-server deserializes params of the wrong type.
pub(super) fn invalid_type(v: &Value, expected: &str) -> Fault {
    use serde::de::{Error as _, Unexpected};
    let unexpected = match v {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Unexpected::Unsigned(u),
            (None, Some(i)) => Unexpected::Signed(i),
            _ => Unexpected::Float(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    };
    Fault::Invalid(serde_json::Error::invalid_type(unexpected, &expected).to_string())
}

/// The name app-server's params type has for `method`: `turn/start` → `TurnStartParams`.
pub(super) fn params_type(method: &str) -> String {
    let mut name: String = method
        .split('/')
        .map(|seg| {
            let mut c = seg.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect();
    name.push_str("Params");
    name
}

/// An array, or nothing when absent or null; anything else is malformed.
pub(super) fn array(v: Option<&Value>) -> Result<&[Value], Fault> {
    match v {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(v) => Err(invalid_type(v, "a sequence")),
    }
}

/// A path string (or absent, or null) inside the roots.
pub(super) fn check_opt_path(
    v: Option<&Value>,
    key: &str,
    roots: &TenantRoots,
) -> Result<(), Fault> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(p)) => roots
            .check(p)
            .map(|_| ())
            .map_err(|e| format!("`{key}` {e}").into()),
        Some(v) => Err(invalid_type(v, "a string")),
    }
}

/// The host files named by a turn's input items.
pub(super) fn check_inputs(input: Option<&Value>, roots: &TenantRoots) -> Result<(), Fault> {
    for item in array(input)? {
        let kind = item.get("type").and_then(Value::as_str).unwrap_or_default();
        let path = match item.get("path") {
            None | Some(Value::Null) => continue,
            Some(Value::String(p)) => p.as_str(),
            Some(v) => return Err(invalid_type(v, "a string")),
        };
        let checked = match kind {
            "mention" if path.contains("://") => continue,
            "skill" | "mention" => roots.check_skill(path),
            _ => roots.check(path),
        };
        checked.map_err(|e| format!("`input` {kind} path {e}"))?;
    }
    Ok(())
}

/// Every path of an array (or absent, or null) inside the roots.
pub(super) fn check_paths(v: Option<&Value>, key: &str, roots: &TenantRoots) -> Result<(), Fault> {
    for p in array(v)? {
        check_opt_path(Some(p), key, roots)?;
    }
    Ok(())
}

/// Removes a discovery cwd outside the roots; `true` when it did.
pub(super) fn filter_path(obj: &mut Map<String, Value>, key: &str, roots: &TenantRoots) -> bool {
    let outside = match obj.get(key) {
        None | Some(Value::Null) => false,
        Some(Value::String(p)) => roots.check(p).is_err(),
        Some(_) => true,
    };
    if outside {
        obj.remove(key);
    }
    outside
}

/// Drops the discovery cwds outside the roots; `true` when any were.
pub(super) fn filter_paths(obj: &mut Map<String, Value>, key: &str, roots: &TenantRoots) -> bool {
    let Some(v) = obj.get_mut(key) else {
        return false;
    };
    let Value::Array(items) = v else {
        let bad = !v.is_null();
        if bad {
            obj.remove(key);
        }
        return bad;
    };
    let before = items.len();
    items.retain(|p| p.as_str().is_some_and(|p| roots.check(p).is_ok()));
    items.len() != before
}

// === impl HostAccessPolicy ===

impl HostAccessPolicy {
    /// Runs a rule's checks; `Ok(Some(params))` when they had to be changed.
    pub(super) fn confine(
        &self,
        rule: Rule,
        method: &str,
        params: Option<&RawValue>,
        roots: &TenantRoots,
    ) -> Result<Option<Value>, Fault> {
        let Some(raw) = params else {
            return Ok(None);
        };
        let mut value =
            strict::parse(raw.get()).map_err(|e| format!("has unusable params: {e}"))?;
        if value.is_null() {
            return Ok(None);
        }
        // A struct also deserializes from an array, positionally: the policy cannot check that
        // safely, so it refuses it; any other non-object is malformed, as app-server would say.
        if !value.is_object() && !value.is_array() {
            return Err(invalid_type(
                &value,
                &format!("struct {}", params_type(method)),
            ));
        }
        let obj = value.as_object_mut().ok_or("params must be an object")?;
        if let Some(key) = obj.keys().find(|k| {
            rules::looks_like_path(k) && !rules::checked_keys(rule.checks).any(|c| c == k.as_str())
        }) {
            tracing::debug!(method, key = %crate::untrusted::Untrusted::text(key), "unknown path-like params field");
            return Err(format!("has a field the policy does not know: `{key}`").into());
        }
        let mut changed = false;
        for check in rule.checks {
            changed |= self.apply(*check, obj, roots)?;
        }
        Ok(changed.then_some(value))
    }

    /// One check; `Ok(true)` when it changed the params.
    pub(super) fn apply(
        &self,
        check: Check,
        obj: &mut Map<String, Value>,
        roots: &TenantRoots,
    ) -> Result<bool, Fault> {
        match check {
            Check::Path(key) => check_opt_path(obj.get(key), key, roots).map(|()| false),
            Check::Paths(key) => check_paths(obj.get(key), key, roots).map(|()| false),
            Check::PathObjects(key) => {
                for item in array(obj.get(key))? {
                    check_opt_path(item.get("path"), key, roots)?;
                }
                Ok(false)
            }
            Check::CapabilityRoots => {
                for item in array(obj.get("selectedCapabilityRoots"))? {
                    let path = item.get("location").and_then(|l| l.get("path"));
                    check_opt_path(path, "selectedCapabilityRoots", roots)?;
                }
                Ok(false)
            }
            Check::Environments => {
                for env in array(obj.get("environments"))? {
                    check_opt_path(env.get("cwd"), "environments.cwd", roots)?;
                    check_paths(
                        env.get("runtimeWorkspaceRoots"),
                        "environments.runtimeWorkspaceRoots",
                        roots,
                    )?;
                }
                Ok(false)
            }
            Check::FilterPath(key) => Ok(filter_path(obj, key, roots)),
            Check::FilterPaths(key) => Ok(filter_paths(obj, key, roots)),
            Check::Rollout(key) => match obj.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::String(p)) => roots
                    .check_rollout(p)
                    .map(|_| false)
                    .map_err(|e| format!("`{key}` {e}").into()),
                Some(v) => Err(invalid_type(v, "a string")),
            },
            Check::SandboxMode => match obj.get("sandbox") {
                Some(Value::String(m)) if m == "danger-full-access" => {
                    Err("`sandbox` danger-full-access is not allowed".into())
                }
                _ => Ok(false),
            },
            Check::SandboxPolicy => self
                .check_sandbox_policy(obj.get("sandboxPolicy"), roots)
                .map(|()| false),
            Check::SandboxPolicyOrDefault => self.sandbox_policy_or_default(obj, roots),
            Check::Profile(key) => match obj.get(key) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::String(p)) if self.permission_profiles.contains(p) => Ok(false),
                Some(_) => {
                    Err(format!("`{key}` names a permissions profile that is not allowed").into())
                }
            },
            Check::ConfigOverrides => self
                .check_config_overrides(obj.get("config"))
                .map(|()| false),
            Check::Inputs => check_inputs(obj.get("input"), roots).map(|()| false),
        }
    }

    /// A sandbox policy no wider than workspace-write over the roots.
    pub(super) fn check_sandbox_policy(
        &self,
        policy: Option<&Value>,
        roots: &TenantRoots,
    ) -> Result<(), Fault> {
        let policy = match policy {
            None | Some(Value::Null) => return Ok(()),
            Some(Value::Object(p)) => p,
            Some(v) => {
                return Err(invalid_type(
                    v,
                    "internally tagged enum SandboxPolicyDeserialize",
                ))
            }
        };
        let network = policy.get("networkAccess");
        let wants_network = match network {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::String(s)) if s == "restricted" => false,
            Some(_) => true,
        };
        if wants_network && !self.sandbox_network {
            return Err("`sandboxPolicy` asks for network access, which is not allowed".into());
        }
        match policy.get("type").and_then(Value::as_str) {
            Some("readOnly") => Ok(()),
            Some("workspaceWrite") => check_paths(
                policy.get("writableRoots"),
                "sandboxPolicy.writableRoots",
                roots,
            ),
            _ => Err("`sandboxPolicy` is wider than workspace-write".into()),
        }
    }

    /// `command/exec`: checks a given sandbox policy, or fills in workspace-write over the
    /// roots when the request names neither a policy nor a profile (app-server would otherwise
    /// apply the worker's configured default, which the router cannot see).
    pub(super) fn sandbox_policy_or_default(
        &self,
        obj: &mut Map<String, Value>,
        roots: &TenantRoots,
    ) -> Result<bool, Fault> {
        let given = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
        if given("sandboxPolicy") || given("permissionProfile") {
            return self
                .check_sandbox_policy(obj.get("sandboxPolicy"), roots)
                .map(|()| false);
        }
        let writable: Vec<Value> = roots
            .allowed()
            .iter()
            .map(|p| Value::String(p.to_string_lossy().into_owned()))
            .collect();
        obj.insert(
            "sandboxPolicy".into(),
            json!({
                "type": "workspaceWrite",
                "writableRoots": writable,
                "networkAccess": false,
            }),
        );
        Ok(true)
    }

    /// A thread's `config` overrides may only use allowed top-level keys (dotted keys count by
    /// their first segment).
    pub(super) fn check_config_overrides(&self, config: Option<&Value>) -> Result<(), Fault> {
        let config = match config {
            None | Some(Value::Null) => return Ok(()),
            Some(Value::Object(c)) => c,
            Some(v) => return Err(invalid_type(v, "a map")),
        };
        // An entry allows its key and everything below it (`features` allows `features.x`).
        let allowed = |k: &str| {
            self.thread_config_keys.iter().any(|a| {
                k == a || (k.starts_with(a.as_str()) && k.as_bytes().get(a.len()) == Some(&b'.'))
            })
        };
        // `mcp_servers = {}` only switches MCP servers off (the TUI's title thread sends it);
        // any server definition would start a command, so it is not allowed.
        let harmless =
            |k: &str, v: &Value| k == "mcp_servers" && v.as_object().is_some_and(|o| o.is_empty());
        match config
            .iter()
            .find(|(k, v)| !allowed(k) && !harmless(k, v))
            .map(|(k, _)| k)
        {
            Some(k) => Err(format!("`config` override `{k}` is not allowed").into()),
            None => Ok(()),
        }
    }
}
