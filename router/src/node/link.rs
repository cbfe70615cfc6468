//! A node's side of the link: an edge, admitted by mutual TLS, names in the link's upgrade
//! headers the session's tenant, who the client is and its address
//! ([`crate::edge::headers`]). A malformed header is answered 400, a tenant this node does not
//! serve 404; an admitted link is recorded in the audit log with the edge's address.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{HeaderMap, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Bytes;

use crate::door::Door;
use crate::tenants::{Tenant, Tenants};
use crate::untrusted::Untrusted;

/// A session an edge brought over its link.
pub struct Linked {
    /// The tenant, served by this node.
    pub tenant: Arc<Tenant>,
    /// Who the client is, as the edge authenticated it.
    pub subject: String,
    /// The client's address, as the edge saw it.
    pub client: SocketAddr,
}

/// Reads who a link's session is from its upgrade headers; the refusal, answered at the door,
/// when they are malformed or name a tenant this node does not serve.
pub fn admit(
    door: &Door,
    tenants: &Tenants,
    headers: &HeaderMap,
) -> Result<Linked, Box<Response<Full<Bytes>>>> {
    let who = crate::edge::headers::read(headers, door.addr).map_err(|e| {
        tracing::warn!(error = %e, "link refused: a malformed identity header");
        Box::new(door.plain(StatusCode::BAD_REQUEST, "link_header", &e.to_string()))
    })?;
    let Some(tenant) = who.tenant.as_deref().and_then(|id| tenants.get(id)) else {
        let named = who.tenant.as_deref().map(Untrusted::text);
        tracing::warn!(tenant = ?named, "link refused: the tenant is not on this node");
        return Err(Box::new(door.plain(
            StatusCode::NOT_FOUND,
            "tenant_not_here",
            "the tenant is not on this node",
        )));
    };
    door.audit.record(
        "link.admitted",
        serde_json::json!({
            "tenant": tenant.id, "subject": who.subject,
            "remote": who.client.to_string(), "edge": door.addr.to_string(),
        }),
    );
    Ok(Linked {
        tenant: tenant.clone(),
        subject: who.subject,
        client: who.client,
    })
}
