//! The `initialize` request's params, typed.

use serde::{Deserialize, Serialize};

/// `initialize` params: who the client is and what it can do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitializeParams<'a> {
    /// The client.
    #[serde(borrow)]
    pub client_info: ClientInfo<'a>,
    /// What it supports.
    #[serde(default)]
    pub capabilities: Capabilities,
}

/// `clientInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientInfo<'a> {
    /// `name`: app-server adopts it as the originator unless it is a daemon name
    /// (docs/app-server-facts.md §3).
    #[serde(borrow)]
    pub name: std::borrow::Cow<'a, str>,
    /// `title`, sent as `null` when absent.
    #[serde(default, borrow)]
    pub title: Option<std::borrow::Cow<'a, str>>,
    /// `version`.
    #[serde(borrow)]
    pub version: std::borrow::Cow<'a, str>,
}

/// `capabilities`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// `experimentalApi`: the experimental methods and fields.
    #[serde(default)]
    pub experimental_api: bool,
}

// === impl InitializeParams ===

impl<'a> InitializeParams<'a> {
    /// A client called `name` at `version`, without a title, experimental API on.
    pub fn experimental(name: &'a str, version: &'a str) -> Self {
        InitializeParams {
            client_info: ClientInfo {
                name: name.into(),
                title: None,
                version: version.into(),
            },
            capabilities: Capabilities {
                experimental_api: true,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_shape() {
        let init = serde_json::to_value(InitializeParams::experimental(
            "codex_app_server_daemon",
            "1",
        ))
        .unwrap();
        assert_eq!(
            init,
            serde_json::json!({
                "clientInfo": {"name": "codex_app_server_daemon", "title": null, "version": "1"},
                "capabilities": {"experimentalApi": true}
            })
        );
        let read: InitializeParams<'_> =
            serde_json::from_str(r#"{"clientInfo":{"name":"codex-tui","version":"0.1"}}"#).unwrap();
        assert_eq!(read.client_info.name, "codex-tui");
        assert!(!read.capabilities.experimental_api);
    }
}
