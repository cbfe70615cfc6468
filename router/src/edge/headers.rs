//! Who a session is, on the link: the headers the edge writes into the link's upgrade request
//! and the node reads back ([`TENANT_HEADER`], [`SUBJECT_HEADER`], [`CLIENT_ADDR_HEADER`]).
//!
//! A subject is whatever the client's credential named (a JWT's `sub` may hold any Unicode, up
//! to [`crate::credentials::MAX_SUBJECT_BYTES`]), but a header value carries visible ASCII only.
//! So the subject travels percent-encoded: control characters, space, `%` and every non-ASCII
//! byte as `%XX`, the rest as it is (a plain subject such as `ada@example.com` or
//! `token:0123456789ab` is unchanged on the wire), and the node decodes it back to exactly the
//! subject the edge authenticated. Building the headers cannot fail for a subject the edge
//! admitted; when it does anyway, that is this session's error ([`HeaderError`]), never the
//! node's.

use std::net::SocketAddr;

use http::{HeaderMap, HeaderValue};
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};

use super::{CLIENT_ADDR_HEADER, SUBJECT_HEADER, TENANT_HEADER};

/// Bytes written percent-encoded in [`SUBJECT_HEADER`] (besides every non-ASCII byte).
const SUBJECT_ENCODED: &AsciiSet = &CONTROLS.add(b' ').add(b'%');

/// Longest [`SUBJECT_HEADER`] value either side accepts: every byte of the longest subject
/// encoded.
const MAX_SUBJECT_HEADER: usize = 3 * crate::credentials::MAX_SUBJECT_BYTES;

/// Why a session's identity cannot travel on the link (the session's fault, not the node's).
#[derive(Debug, thiserror::Error)]
#[error("the session's {header} cannot be carried on the link: {reason}")]
pub struct HeaderError {
    /// The header.
    pub header: &'static str,
    /// Why.
    pub reason: String,
}

/// The identity headers of a session's link request.
pub fn build(
    tenant: &str,
    subject: &str,
    client: SocketAddr,
) -> Result<[(&'static str, HeaderValue); 3], HeaderError> {
    let value = |header: &'static str, text: &str| {
        HeaderValue::from_str(text).map_err(|e| HeaderError {
            header,
            reason: e.to_string(),
        })
    };
    let subject = encode_subject(subject);
    if subject.len() > MAX_SUBJECT_HEADER {
        return Err(HeaderError {
            header: SUBJECT_HEADER,
            reason: format!("longer than {MAX_SUBJECT_HEADER} bytes encoded"),
        });
    }
    Ok([
        (TENANT_HEADER, value(TENANT_HEADER, tenant)?),
        (SUBJECT_HEADER, value(SUBJECT_HEADER, &subject)?),
        (
            CLIENT_ADDR_HEADER,
            value(CLIENT_ADDR_HEADER, &client.to_string())?,
        ),
    ])
}

/// The subject as [`SUBJECT_HEADER`] carries it.
pub fn encode_subject(subject: &str) -> String {
    utf8_percent_encode(subject, SUBJECT_ENCODED).to_string()
}

/// What the node learns from a link request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkIdentity {
    /// The tenant the edge admitted the client as, if named.
    pub tenant: Option<String>,
    /// The subject, decoded; empty when the edge sent none.
    pub subject: String,
    /// The client's address as the edge saw it; the edge's own address when the header is
    /// missing or not a socket address.
    pub client: SocketAddr,
}

/// Reads a link request's identity headers; `edge` is the link's peer address. `Err` for a
/// subject that is not UTF-8 once decoded, or longer than any edge sends.
pub fn read(headers: &HeaderMap, edge: SocketAddr) -> Result<LinkIdentity, HeaderError> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let subject = match headers.get(SUBJECT_HEADER) {
        None => String::new(),
        Some(v) => {
            let bad = |reason: &str| HeaderError {
                header: SUBJECT_HEADER,
                reason: reason.to_owned(),
            };
            if v.len() > MAX_SUBJECT_HEADER {
                return Err(bad("too long"));
            }
            match v.to_str() {
                Ok(encoded) => percent_decode_str(encoded)
                    .decode_utf8()
                    .map_err(|_| bad("not UTF-8 once decoded"))?
                    .into_owned(),
                // An edge from before the encoding sent UTF-8 as it is (during a rolling
                // upgrade): taken as it is.
                Err(_) => String::from_utf8(v.as_bytes().to_vec()).map_err(|_| bad("not UTF-8"))?,
            }
        }
    };
    let client = text(CLIENT_ADDR_HEADER)
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .unwrap_or(edge);
    Ok(LinkIdentity {
        tenant: text(TENANT_HEADER).map(str::to_owned),
        subject,
        client,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_subject_the_edge_admits_reaches_the_node_exactly() {
        let client: SocketAddr = "203.0.113.7:40123".parse().unwrap();
        let edge: SocketAddr = "10.0.0.2:5555".parse().unwrap();
        let long = "é".repeat(crate::credentials::MAX_SUBJECT_BYTES / 2);
        for subject in [
            "ada@example.com",
            "token:0123456789ab",
            "a\nb\u{1}c",
            "José",
            " lead and trail ",
            "100%25 %",
            "\u{7f}\r\n\t",
            long.as_str(),
        ] {
            let mut h = HeaderMap::new();
            for (name, value) in build("acme", subject, client).unwrap() {
                h.insert(name, value);
            }
            let got = read(&h, edge).unwrap();
            assert_eq!(
                got,
                LinkIdentity {
                    tenant: Some("acme".into()),
                    subject: subject.into(),
                    client
                }
            );
        }
        // Plain subjects are unchanged on the wire.
        assert_eq!(encode_subject("ada@example.com"), "ada@example.com");
        // A missing or bad client address is the edge's own.
        let mut h = HeaderMap::new();
        h.insert(CLIENT_ADDR_HEADER, HeaderValue::from_static("nonsense"));
        assert_eq!(read(&h, edge).unwrap().client, edge);
        // A subject that does not decode to UTF-8 is refused.
        h.insert(SUBJECT_HEADER, HeaderValue::from_static("%ff"));
        assert!(read(&h, edge).is_err());
        h.insert(SUBJECT_HEADER, HeaderValue::from_bytes(b"\xff").unwrap());
        assert!(read(&h, edge).is_err());
        // An older edge's raw UTF-8 is read as it is.
        h.insert(
            SUBJECT_HEADER,
            HeaderValue::from_bytes("José".as_bytes()).unwrap(),
        );
        assert_eq!(read(&h, edge).unwrap().subject, "José");
        // An over-long subject is the session's error.
        assert!(build("acme", &"x".repeat(MAX_SUBJECT_HEADER + 1), client).is_err());
    }
}
