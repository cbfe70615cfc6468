use super::*;
use crate::admission::{DRAINING_BODY, DRAINING_REFUSAL};
use http::HeaderValue;

fn refused(status: u16, refusal: Option<&str>, body: &str) -> LinkError {
    let mut headers = http::HeaderMap::new();
    if let Some(v) = refusal {
        let v = HeaderValue::from_str(v).expect("a header's text");
        headers.insert(crate::admission::REFUSAL_HEADER, v);
    }
    LinkError::refused("n1".into(), status, &headers, body.into())
}

/// A node's refusal at its tenant's connection cap.
fn tenant_cap() -> Rejection {
    Rejection::cap(
        Scope::Tenant,
        Reason::TooManyConnections,
        Duration::from_secs(3),
    )
}

#[test]
fn a_refusal_header_that_is_not_text_is_not_passed_over_for_the_body_nor_passed_on() {
    let r = tenant_cap();
    for bytes in [&b"overloaded\xff"[..], b"draining\x80", b"\xfe"] {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            crate::admission::REFUSAL_HEADER,
            HeaderValue::from_bytes(bytes).unwrap(),
        );
        // A header the edge does not pass on is not kept.
        headers.insert(http::header::SERVER, HeaderValue::from_static("node"));
        for body in [r.http_body(), DRAINING_BODY.to_owned()] {
            let e = LinkError::refused("n1".into(), 503, &headers, body.clone());
            assert!(
                e.node_refusal().is_none() && !e.draining(),
                "{bytes:?} {body}"
            );
            // Logged as text, lossily; kept byte for byte as the node said it; not passed on by
            // a static edge (readers differ on what such bytes say).
            assert!(e.refusal_header().is_some_and(|t| t.contains('\u{fffd}')));
            let LinkError::Refused { headers: kept, .. } = &e else {
                panic!("{e:?}");
            };
            assert!(passed_on(kept).is_empty(), "{kept:?}");
            let kept: Vec<_> = kept
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_bytes()))
                .collect();
            assert_eq!(kept, [(crate::admission::REFUSAL_HEADER, bytes)]);
        }
    }
}

#[test]
fn a_nodes_refusal_is_read_by_its_header_and_from_an_older_node_by_its_body() {
    let r = tenant_cap();
    let header = r.http_header();
    // The header alone: a body that came in a later TLS record than the head is not needed.
    for e in [
        refused(503, Some(&header), ""),
        refused(503, Some(&header), &r.http_body()),
        refused(503, None, &r.http_body()),
    ] {
        let back = e.node_refusal().expect("a node's refusal");
        assert_eq!(back.to_error_data(), r.to_error_data(), "{e:?}");
        assert!(!e.draining(), "{e:?}");
    }
    // A newer node's reason this edge has no name for is still the node's refusal: its
    // client waits as told, not reconnecting at once to the node that refuses it.
    let newer = "overloaded; scope=tenant; reason=tenantMemoryLimit; retry-after-ms=700";
    let e = refused(503, Some(newer), "");
    let back = e.node_refusal().expect("a newer node's refusal");
    assert_eq!(
        (back.scope, back.reason, back.retry_after_ms_jittered()),
        (Scope::Tenant, Reason::NodeOverloaded, 700)
    );
    assert!(!e.draining(), "{e:?}");
    // Draining, by header, or by body from an older node; never read as an overload.
    for e in [
        refused(503, Some(DRAINING_REFUSAL), ""),
        refused(503, Some(DRAINING_REFUSAL), "anything"),
        // A newer node's fields after the word are not ours to judge.
        refused(503, Some("draining; until=later"), ""),
        refused(503, None, DRAINING_BODY),
    ] {
        assert!(e.draining(), "{e:?}");
        assert!(e.node_refusal().is_none(), "{e:?}");
    }
    // Neither: a header that says otherwise wins over a body, other statuses, other errors.
    for e in [
        refused(503, Some("overloaded"), &r.http_body()),
        refused(503, Some("something-else"), DRAINING_BODY),
        refused(503, Some("drainingsoon"), DRAINING_BODY),
        refused(429, Some(DRAINING_REFUSAL), ""),
        refused(502, Some(&header), &r.http_body()),
        refused(503, None, ""),
        refused(404, None, "not found"),
        LinkError::Unreachable {
            node: "n1".into(),
            reason: "refused".into(),
        },
    ] {
        assert!(!e.draining(), "{e:?}");
        assert!(e.node_refusal().is_none(), "{e:?}");
    }
}

#[test]
fn a_static_edge_passes_on_a_nodes_waits_once_and_bounded_at_an_hour() {
    let mut headers = http::HeaderMap::new();
    let first = concat!(
        "overloaded; scope=tenant; reason=tooManyConnections; ",
        "retry-after-ms=99999999999; since=1"
    );
    for (name, value) in [
        ("retry-after", "99999999999999999999"),
        ("retry-after", "1"),
        (crate::admission::REFUSAL_HEADER, first),
        (
            crate::admission::REFUSAL_HEADER,
            "overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=1",
        ),
        ("server", "node"),
    ] {
        headers.append(name, HeaderValue::from_static(value));
    }
    let e = LinkError::refused("n1".into(), 503, &headers, String::new());
    let LinkError::Refused { headers: kept, .. } = &e else {
        panic!("{e:?}");
    };
    let text = |h: &http::HeaderMap| -> Vec<(String, String)> {
        h.iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap().to_owned()))
            .collect()
    };
    // The link keeps the first of each as the node said it, and reads an hour's wait from it.
    assert_eq!(
        text(kept),
        [
            ("retry-after".into(), "99999999999999999999".into()),
            (crate::admission::REFUSAL_HEADER.into(), first.into()),
        ]
    );
    let r = e.node_refusal().expect("the node's refusal");
    assert_eq!(r.retry_after_ms_jittered(), 3_600_000);
    // A static edge passes them on bounded, nothing else.
    assert_eq!(
        text(&passed_on(kept)),
        [
            ("retry-after".into(), "3600".into()),
            (
                crate::admission::REFUSAL_HEADER.into(),
                first.replace("99999999999", "3600000")
            ),
        ]
    );
    // A header that is not text, with a wait the edge reads lossily: the edge's wait is an
    // hour, and the client gets no header to read another from.
    let not_text = [
        &b"overloaded; scope=tenant; reason=x; "[..],
        b"retry-after-ms=99999999999; by=\xc3\xa9\xff",
    ]
    .concat();
    let mut headers = http::HeaderMap::new();
    headers.insert(
        crate::admission::REFUSAL_HEADER,
        HeaderValue::from_bytes(&not_text).unwrap(),
    );
    let e = LinkError::refused("n1".into(), 503, &headers, String::new());
    let r = e.node_refusal().expect("the node's refusal");
    assert_eq!(r.retry_after_ms_jittered(), 3_600_000);
    let LinkError::Refused { headers: kept, .. } = &e else {
        panic!("{e:?}");
    };
    assert!(passed_on(kept).is_empty());
    // A date (a codex-fleet node sends none) is left out; the refusal still says its wait.
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::RETRY_AFTER,
        HeaderValue::from_static("Wed, 21 Oct 2065 07:28:00 GMT"),
    );
    let e = LinkError::refused("n1".into(), 503, &headers, tenant_cap().http_body());
    let LinkError::Refused { headers: kept, .. } = &e else {
        panic!("{e:?}");
    };
    assert!(passed_on(kept).is_empty(), "{kept:?}");
    assert!(e.node_refusal().is_some());
}
