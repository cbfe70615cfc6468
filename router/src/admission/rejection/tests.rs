use super::*;

#[test]
fn jitter_stays_within_a_quarter() {
    let mut rng = rand::rng();
    for ms in [0_u64, 1, 3, 40, 999, 1000, 12_345] {
        let d = Duration::from_millis(ms);
        let base = ms.max(1);
        let seen: Vec<u64> = (0..500).map(|_| jittered_ms(d, &mut rng)).collect();
        assert!(
            seen.iter().all(|&v| v >= base && v <= base + base / 4),
            "{ms}: {seen:?}"
        );
        if base >= 40 {
            assert!(seen.iter().any(|&v| v != seen[0]), "{ms}: no jitter at all");
        }
    }
    // Sub-millisecond waits round up, never to zero.
    assert_eq!(jittered_ms(Duration::from_micros(10), &mut rng), 1);
}

#[test]
fn error_data_has_the_exact_shape() {
    let r = Rejection::rate(
        Scope::Tenant,
        Reason::TenantRateLimited,
        Duration::from_millis(80),
    );
    let data = r.to_error_data();
    let keys: Vec<&String> = data.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["reason", "retryAfterMs", "scope"]);
    assert_eq!(data["scope"], "tenant");
    assert_eq!(data["reason"], "tenantRateLimited");
    let ms = data["retryAfterMs"].as_u64().unwrap();
    assert!((80..=100).contains(&ms), "{ms}");
    assert_eq!(ms, r.retry_after_ms_jittered());

    let resp: Value =
        serde_json::from_str(&r.to_error_response(&RequestId::Str("a".into()))).unwrap();
    assert_eq!(
        resp,
        json!({"id": "a", "error": {"code": -32001, "message": "Server overloaded; retry later.", "data": data}})
    );
    for (scope, s) in [
        (Scope::Connection, "connection"),
        (Scope::Worker, "worker"),
        (Scope::Fleet, "fleet"),
    ] {
        let r = Rejection::cap(scope, Reason::WorkerBusy, Duration::ZERO);
        assert_eq!(r.to_error_data()["scope"], s);
        assert_eq!(r.to_error_data()["reason"], "workerBusy");
    }
    for reason in [
        Reason::HandshakeRateLimited,
        Reason::ConnectionRateLimited,
        Reason::TurnRateLimited,
        Reason::ActiveTurnLimit,
        Reason::WorkerOverloaded,
        Reason::TooManyConnections,
    ] {
        assert_eq!(serde_json::to_value(reason).unwrap(), reason.as_str());
    }
}

#[test]
fn http_status_and_retry_after() {
    let rate = Rejection::rate(
        Scope::Connection,
        Reason::HandshakeRateLimited,
        Duration::from_millis(1500),
    );
    assert_eq!(rate.http_status(), 429);
    // 1500..=1875 ms rounds up to 2 s.
    assert_eq!(rate.retry_after_secs(), 2);
    let cap = Rejection::cap(
        Scope::Fleet,
        Reason::TooManyConnections,
        Duration::from_millis(10),
    );
    assert_eq!(cap.http_status(), 503);
    assert_eq!(cap.retry_after_secs(), 1);
}

#[test]
fn worker_overload_gets_the_same_shape() {
    let text = r#"{"id":7,"error":{"code":-32001,"message":"Server overloaded; retry later.","data":null}}"#;
    let out = rewrite_worker_overload(text, Duration::from_millis(200)).unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["id"], 7);
    assert_eq!(v["error"]["code"], -32001);
    assert_eq!(v["error"]["message"], OVERLOADED_MESSAGE);
    assert_eq!(v["error"]["data"]["scope"], "worker");
    assert_eq!(v["error"]["data"]["reason"], "workerOverloaded");
    let ms = v["error"]["data"]["retryAfterMs"].as_u64().unwrap();
    assert!((200..=250).contains(&ms), "{ms}");
    // Without a data field at all, too.
    let bare = r#"{"id":"x","error":{"code":-32001,"message":"m"}}"#;
    assert!(rewrite_worker_overload(bare, Duration::from_millis(1)).is_some());
    // Everything else passes unchanged.
    for other in [
        r#"{"id":7,"result":{"n":-32001}}"#,
        r#"{"id":7,"error":{"code":-32600,"message":"-32001"}}"#,
        r#"{"id":7,"error":{"code":-32001,"message":"m","data":{"retryAfterMs":5}}}"#,
        r#"{"method":"x","params":{"n":-32001}}"#,
        "not json -32001",
    ] {
        assert_eq!(
            rewrite_worker_overload(other, Duration::ZERO),
            None,
            "{other}"
        );
    }
}

#[test]
fn an_upstream_refusal_reads_back_as_the_same_rejection() {
    for scope in Scope::ALL {
        for reason in Reason::ALL {
            for r in [
                Rejection::rate(scope, reason, Duration::from_millis(1500)),
                Rejection::cap(scope, reason, Duration::from_secs(5)),
            ] {
                let header = r.http_header();
                // By its header (the body need not have arrived), and by the body alone (a node
                // from before the header).
                for (header, body) in [
                    (Some(header.as_str()), String::new()),
                    (None, r.http_body()),
                ] {
                    let back = Rejection::from_http(r.http_status(), header, &body).unwrap();
                    // What a client is told is the same (the unjittered wait is not sent).
                    assert_eq!((back.scope, back.reason), (r.scope, r.reason));
                    assert_eq!(back.http_status(), r.http_status());
                    assert_eq!(back.to_error_data(), r.to_error_data());
                    assert_eq!(back.retry_after_secs(), r.retry_after_secs());
                }
            }
        }
    }
    // A wait past an hour is passed on as an hour, by header or by body, however many digits
    // it has.
    for ms in [
        "99999999999",
        "99999999999999999999999999",
        "+99999999999999999999999999",
    ] {
        let long = format!(
            "{OVERLOADED_MESSAGE} (scope tenant, reason tooManyConnections); retry after {ms} ms"
        );
        let back = Rejection::from_http(503, None, &long).unwrap();
        assert_eq!(back.retry_after_ms_jittered(), 3_600_000);
        let long =
            format!("overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms={ms}");
        let back = Rejection::from_http(503, Some(&long), "").unwrap();
        assert_eq!(back.retry_after_ms_jittered(), 3_600_000);
    }
    // Anything else is not one: another status, another body, a reason we do not know (a body
    // comes alone only from a node older than the header, which names none).
    let r = Rejection::cap(
        Scope::Tenant,
        Reason::TooManyConnections,
        Duration::from_secs(1),
    );
    for (status, body) in [
        (502, r.http_body()),
        (503, DRAINING_BODY.to_owned()),
        (503, r.http_body().replace("tooManyConnections", "tooMany")),
        (503, r.http_body().replace(" ms", " s")),
        (503, String::new()),
    ] {
        assert_eq!(
            Rejection::from_http(status, None, &body),
            None,
            "{status} {body}"
        );
    }
    // A newer node's header: its fields in another order, and one this edge does not know.
    let newer = "overloaded; reason=tooManyConnections; since=12; scope=tenant; retry-after-ms=900";
    let back = Rejection::from_http(503, Some(newer), "").unwrap();
    assert_eq!(
        (back.scope, back.reason),
        (Scope::Tenant, Reason::TooManyConnections)
    );
    assert_eq!(back.retry_after_ms_jittered(), 900);
    // A newer node's scope or reason this edge does not know: still the node's refusal, its
    // status and wait kept, the unknown value stood in for (a body is not read so: above).
    for (status, header, scope, reason) in [
        (
            503,
            "overloaded; scope=tenant; reason=tenantMemoryLimit; retry-after-ms=700",
            Scope::Tenant,
            Reason::NodeOverloaded,
        ),
        (
            429,
            "overloaded; scope=region; reason=tenantRateLimited; retry-after-ms=700",
            Scope::Worker,
            Reason::NodeOverloaded,
        ),
        (
            503,
            "overloaded; scope=region; reason=regionFull; retry-after-ms=700",
            Scope::Worker,
            Reason::NodeOverloaded,
        ),
    ] {
        let back = Rejection::from_http(status, Some(header), "").expect(header);
        assert_eq!((back.scope, back.reason), (scope, reason), "{header}");
        assert_eq!(back.http_status(), status, "{header}");
        assert_eq!(back.retry_after_ms_jittered(), 700, "{header}");
        assert_eq!(
            back.to_error_data()["reason"],
            serde_json::json!(reason.as_str()),
            "{header}"
        );
    }
    // A header decides alone: one that is not an overload is not one, whatever the body says.
    let header = r.http_header();
    for (status, header) in [
        (502, header.clone()),
        (503, DRAINING_REFUSAL.to_owned()),
        (503, header.replace("scope=", "scopes=")),
        (503, header.replace("reason=", "why=")),
        (503, header.replace("overloaded", "refused")),
        (503, header.replace("retry-after-ms=", "retry-after-ms=-")),
        (503, header.replace("; retry-after-ms=", "; wait=")),
        (503, String::new()),
    ] {
        assert_eq!(
            Rejection::from_http(status, Some(&header), &r.http_body()),
            None,
            "{status} {header}"
        );
    }
}

#[test]
fn an_upstream_answer_is_a_refusal_or_draining_never_both() {
    let r = Rejection::cap(
        Scope::Tenant,
        Reason::TooManyConnections,
        Duration::from_secs(2),
    );
    let header = r.http_header();
    let headers = [
        None,
        Some(header.as_str()),
        Some(DRAINING_REFUSAL),
        Some("draining; until=later"),
        Some(" draining "),
        Some("drainingsoon"),
        Some("overloaded; scope=tenant; reason=newReason; retry-after-ms=5"),
        Some(""),
    ];
    let body = r.http_body();
    let bodies = [body.as_str(), DRAINING_BODY, ""];
    let mut seen = (0, 0);
    for status in [200, 404, 429, 502, 503] {
        for h in headers {
            for b in bodies {
                let refusal = Rejection::from_http(status, h, b).is_some();
                let draining = is_draining_answer(status, h, b);
                assert!(!(refusal && draining), "{status} {h:?} {b:?}");
                seen.0 += usize::from(refusal);
                seen.1 += usize::from(draining);
            }
        }
    }
    // Refusals: 429 and 503, each with the body alone (1) and the two overload headers over
    // every body (6). Draining: 503 only, the three draining headers over every body (9) and
    // the body alone (1). So neither check above is vacuous.
    assert_eq!(seen, (14, 10));
}

#[test]
fn the_draining_words_are_what_older_edges_and_nodes_read() {
    // Wire text: the tests above read these through the constants, so they are pinned here.
    assert_eq!(DRAINING_REFUSAL, "draining");
    assert_eq!(DRAINING_BODY, "codex-fleet is shutting down");
}

#[test]
fn an_upstreams_waits_are_passed_on_bounded_at_an_hour_and_the_rest_as_it_came() {
    // Within the bound, or no wait: passed on as it came.
    let within = Rejection::cap(
        Scope::Tenant,
        Reason::TooManyConnections,
        Duration::from_secs(5),
    );
    for h in [
        within.http_header().as_str(),
        "overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=3600000",
        "overloaded; scope=tenant; reason=x; Retry-After-Ms = +5 ",
        "overloaded; scope=tenant; reason=x; retry-after-ms= ",
        DRAINING_REFUSAL,
        "draining; until=99999999999",
    ] {
        assert_eq!(bounded_refusal_header(h), None, "{h}");
    }
    // Over it, however many digits and however written (any case, spaces about the `=`, a
    // `+`, the first word too): an hour; not a number: emptied. Every other field where and as
    // it was, known or not, spaces included.
    for (h, bounded) in [
        (
            "overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=3600001",
            "overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=3600000",
        ),
        (
            concat!(
                "overloaded;since=12;retry-after-ms=99999999999999999999999999 ;",
                "  scope=region ;reason=new"
            ),
            "overloaded;since=12;retry-after-ms=3600000 ;  scope=region ;reason=new",
        ),
        (
            concat!(
                "overloaded; retry-after-ms=99999999999; scope=tenant; reason=x; ",
                "retry-after-ms=4000000"
            ),
            concat!(
                "overloaded; retry-after-ms=3600000; scope=tenant; reason=x; ",
                "retry-after-ms=3600000"
            ),
        ),
        (
            "overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=+99999999999",
            "overloaded; scope=tenant; reason=tooManyConnections; retry-after-ms=3600000",
        ),
        (
            "overloaded; scope=worker; reason=x; retry-after-ms=+99999999999999999999999999",
            "overloaded; scope=worker; reason=x; retry-after-ms=3600000",
        ),
        (
            "overloaded; scope=tenant; reason=x; retry-after-ms=5; Retry-After-MS=99999999999",
            "overloaded; scope=tenant; reason=x; retry-after-ms=5; Retry-After-MS=3600000",
        ),
        (
            "overloaded; scope=tenant; reason=x; retry-after-ms =\t99999999999",
            "overloaded; scope=tenant; reason=x; retry-after-ms =3600000",
        ),
        (
            "retry-after-ms=99999999999; scope=tenant; reason=x",
            "retry-after-ms=3600000; scope=tenant; reason=x",
        ),
        (
            "overloaded; retry-after-ms=soon ; scope=t",
            "overloaded; retry-after-ms= ; scope=t",
        ),
        (
            "overloaded; retry-after-ms=-99999999999",
            "overloaded; retry-after-ms=",
        ),
        (
            "overloaded; retry-after-ms=++9; scope=t",
            "overloaded; retry-after-ms=; scope=t",
        ),
        (
            "overloaded; retry-after-ms=\"99999999999\"",
            "overloaded; retry-after-ms=",
        ),
        (
            "overloaded; retry-after-ms=99999999999ms",
            "overloaded; retry-after-ms=",
        ),
        (
            "overloaded; retry-after-ms=99999999999.0",
            "overloaded; retry-after-ms=",
        ),
        (
            "overloaded; retry-after-ms=99_999_999_999",
            "overloaded; retry-after-ms=",
        ),
        // Emptied, not left out: the header reads as it came (not as draining, not as a
        // refusal with the next wait), and is never empty.
        ("retry-after-ms=x; draining", "retry-after-ms=; draining"),
        (
            "overloaded; scope=tenant; reason=x; retry-after-ms=soon; retry-after-ms=5",
            "overloaded; scope=tenant; reason=x; retry-after-ms=; retry-after-ms=5",
        ),
        ("retry-after-ms=x", "retry-after-ms="),
    ] {
        assert_eq!(bounded_refusal_header(h).as_deref(), Some(bounded), "{h}");
        // No wait in it over the hour, however written.
        for field in bounded.split(';') {
            if let Some((key, value)) = field.split_once('=') {
                if key.trim().eq_ignore_ascii_case("retry-after-ms") && !value.trim().is_empty() {
                    let ms = value.trim().trim_start_matches('+');
                    assert!(ms.parse::<u64>().is_ok_and(|ms| ms <= 3_600_000), "{h}");
                }
            }
        }
        // An edge reads it as it reads the header as it came: the same refusal (its wait at
        // most the hour an edge reads anyway), or none; draining, or not.
        let data = |h: &str| Rejection::from_http(503, Some(h), "").map(|r| r.to_error_data());
        assert_eq!(data(bounded), data(h), "{h}");
        assert_eq!(
            is_draining_answer(503, Some(bounded), ""),
            is_draining_answer(503, Some(h), ""),
            "{h}"
        );
    }
    // The body (which a node older than the header sends alone): its wait bounded too; any
    // other body as it came.
    let long = format!(
        "{OVERLOADED_MESSAGE} (scope tenant, reason tooManyConnections); retry after 99999999999 ms"
    );
    assert_eq!(
        bounded_refusal_body(&long),
        Some(format!(
            "{OVERLOADED_MESSAGE} (scope tenant, reason tooManyConnections); retry after 3600000 ms"
        ))
    );
    for body in [within.http_body().as_str(), "node is full", ""] {
        assert_eq!(bounded_refusal_body(body), None, "{body}");
    }
    // Seconds: as they came up to an hour, an hour beyond; anything but seconds is left out.
    for (v, secs) in [
        (&b"0"[..], Some(0)),
        (b"3", Some(3)),
        (b"007", Some(7)),
        (b"3600", Some(3600)),
        (b"3601", Some(3600)),
        (b"99999999999999999999999999", Some(3600)),
        (b"", None),
        (b"+5", None),
        (b"-1", None),
        (b"1.5", None),
        (b" 5", None),
        (b"Wed, 21 Oct 2065 07:28:00 GMT", None),
        (b"5\xff", None),
    ] {
        assert_eq!(
            bounded_retry_after(v),
            secs,
            "{:?}",
            String::from_utf8_lossy(v)
        );
    }
}
