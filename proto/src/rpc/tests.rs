//! Unit tests of the frame classifier and id rewriting, and property tests of both over
//! pseudo-random input.

use super::*;
use crate::arbitrary::{arbitrary_frame, Rng};
use crate::Message as Rpc;

#[test]
fn classifies_the_three_kinds() {
    match parse(r#"{"id":"initialize","method":"initialize","params":{"a":1}}"#).unwrap() {
        Message::Request { id, method, params } => {
            assert_eq!(id, RequestId::Str("initialize".into()));
            assert_eq!(method, "initialize");
            assert_eq!(params.unwrap().get(), r#"{"a":1}"#);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        parse(r#"{"method":"initialized"}"#).unwrap(),
        Message::Notification { .. }
    ));
    assert!(matches!(
        parse(r#"{"id":7,"result":{"decision":"accept"}}"#).unwrap(),
        Message::Response {
            id: RequestId::Int(7)
        }
    ));
    assert!(matches!(
        parse(r#"{"id":7,"error":{"code":1,"message":"x"}}"#).unwrap(),
        Message::Response { .. }
    ));
}

#[test]
fn bad_input_gets_a_defined_error() {
    assert!(matches!(parse("{not json"), Err(ParseError::NotJson(_))));
    assert!(matches!(parse(""), Err(ParseError::NotJson(_))));
    assert_eq!(
        parse(r#"[{"id":1,"method":"a"}]"#).unwrap_err(),
        ParseError::Batch
    );
    assert_eq!(parse("42").unwrap_err(), ParseError::NotObject);
    assert_eq!(
        parse(r#"{"id":null,"method":"a"}"#).unwrap_err(),
        ParseError::BadId { request: true }
    );
    assert_eq!(
        parse(r#"{"id":3.5,"method":"a"}"#).unwrap_err(),
        ParseError::BadId { request: true }
    );
    assert_eq!(parse(r#"{"id":3}"#).unwrap_err(), ParseError::NotJsonRpc);
    // An id is kept until answered: one longer than the bound is refused, request or response.
    let longest = "i".repeat(MAX_ID_BYTES - 2);
    let request = |id: &str| format!(r#"{{"id":"{id}","method":"a"}}"#);
    assert!(parse(&request(&longest)).is_ok());
    let long = format!("{longest}i");
    assert_eq!(parse(&request(&long)).unwrap_err(), ParseError::LongId);
    assert_eq!(
        parse(&format!(r#"{{"id":"{long}","result":{{}}}}"#)).unwrap_err(),
        ParseError::LongId
    );
    assert_eq!(
        ParseError::LongId.to_string(),
        format!("Invalid request: id longer than {MAX_ID_BYTES} bytes")
    );
    assert_eq!(ParseError::LongId.code(), codes::INVALID_REQUEST);
    assert_eq!(parse("[1,").unwrap_err().code(), codes::PARSE_ERROR);
    assert_eq!(
        parse(r#"{"id":1,"method":7}"#).unwrap_err(),
        ParseError::NotJsonRpc
    );
}

/// A request's `trace` as app-server 0.171 reads it (measured on the pinned binary over stdio:
/// `null`, `{}`, `[]`, string fields and unknown keys answered; a string, a number or a
/// non-string field got no answer at all, the frame read as a notification).
#[test]
fn a_request_whose_trace_app_server_cannot_read_is_refused_with_its_id() {
    for trace in [
        "null",
        "{}",
        "[]",
        r#"{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#,
        r#"{"traceparent":null,"tracestate":"k=v","other":1}"#,
    ] {
        let text = format!(r#"{{"id":2,"method":"model/list","params":{{}},"trace":{trace}}}"#);
        assert!(
            matches!(parse(&text), Ok(Message::Request { .. })),
            "{trace}"
        );
    }
    for trace in [
        "5",
        r#""x""#,
        r#"{"tracestate":1}"#,
        r#"{"traceparent":[]}"#,
    ] {
        let text = format!(r#"{{"id":2,"method":"model/list","params":{{}},"trace":{trace}}}"#);
        let e = parse(&text).unwrap_err();
        assert_eq!(
            e,
            ParseError::BadTrace {
                id: RequestId::Int(2)
            },
            "{trace}"
        );
        assert_eq!(e.id(), Some(&RequestId::Int(2)));
        assert_eq!(e.code(), codes::INVALID_REQUEST);
    }
    // Only a request has a trace to app-server: a notification's or a response's is ignored.
    assert!(parse(r#"{"method":"initialized","trace":5}"#).is_ok());
    assert!(parse(r#"{"id":2,"result":{},"trace":5}"#).is_ok());
    assert_eq!(ParseError::NotObject.id(), None);
}

#[test]
fn a_method_is_read_in_place() {
    let m = parse(r#"{"method":"x/made-up","params":{}}"#).unwrap();
    let Message::Notification { method, .. } = m else {
        panic!()
    };
    assert!(
        matches!(
            method,
            crate::Method::Other(std::borrow::Cow::Borrowed("x/made-up"))
        ),
        "{method:?}"
    );
}

#[test]
fn thread_ids_come_from_params() {
    let m =
        parse(r#"{"id":1,"method":"turn/start","params":{"threadId":"t-1","input":[]}}"#).unwrap();
    let Message::Request { params, .. } = m else {
        panic!()
    };
    assert_eq!(thread_id(params).as_deref(), Some("t-1"));
    assert!(
        matches!(thread_id(params), Some(std::borrow::Cow::Borrowed(_))),
        "read in place"
    );
    assert_eq!(thread_id(None), None);
    // An escaped id is read as what it means.
    let m = parse(r#"{"id":1,"method":"thread/read","params":{"threadId":"t\u002d1"}}"#).unwrap();
    let Message::Request { params, .. } = m else {
        panic!()
    };
    assert_eq!(thread_id(params).as_deref(), Some("t-1"));
}

#[test]
fn ids_are_rewritten_without_touching_the_rest() {
    let text =
        r#"{"method":"item/commandExecution/requestApproval","id":0,"params":{"threadId":"t"}}"#;
    let out = with_id(text, &RequestId::Int(17)).unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["id"], 17);
    assert_eq!(v["params"]["threadId"], "t");
    let resolved = r#"{"method":"serverRequest/resolved","params":{"threadId":"t","requestId":0}}"#;
    let out = with_params_request_id(resolved, &RequestId::Int(17)).unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["requestId"], 17);
    assert_eq!(
        result_thread_id(r#"{"id":1,"result":{"thread":{"id":"t-9","x":1}}}"#).as_deref(),
        Some("t-9")
    );
    assert_eq!(result_thread_id(r#"{"id":1,"result":{}}"#), None);
    assert_eq!(
        error_message(r#"{"id":1,"error":{"code":-32600,"message":"m"}}"#).as_deref(),
        Some("m")
    );
    let err = error_response(None, -32700, "Parse error", None);
    assert_eq!(
        err,
        r#"{"error":{"code":-32700,"message":"Parse error"},"id":null}"#
    );
}

#[test]
fn arbitrary_frames_never_panic_and_parsed_ids_map_back_exactly() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (mut parsed, mut refused) = (0, 0);
    for _ in 0..50_000 {
        let text = arbitrary_frame(&mut rng);
        // The classifier and the rewriting never panic.
        let _ = with_params_request_id(&text, &RequestId::Int(1));
        if let Ok(f) = Frame::parse(&text) {
            let _ = f.error_code();
        }
        match parse(&text) {
            Err(e) => {
                refused += 1;
                assert!(e.code() == codes::PARSE_ERROR || e.code() == codes::INVALID_REQUEST);
            }
            Ok(msg) => {
                parsed += 1;
                let id = match msg {
                    Rpc::Request { id, .. } | Rpc::Response { id } => id,
                    Rpc::Notification { .. } => continue,
                };
                // Rewriting the id to a session id and back restores it exactly.
                let sid = RequestId::Int(rng.next_u64() as i64);
                let there = with_id(&text, &sid).unwrap_or_else(|| panic!("{text}"));
                let back = with_id(&there, &id).expect("an object");
                match (parse(&there), parse(&back)) {
                    (
                        Ok(Rpc::Request { id: a, .. } | Rpc::Response { id: a }),
                        Ok(Rpc::Request { id: b, .. } | Rpc::Response { id: b }),
                    ) => {
                        assert_eq!(a, sid, "{text}");
                        assert_eq!(b, id, "{text}");
                    }
                    other => panic!("{text}: {other:?}"),
                }
            }
        }
    }
    assert!(
        parsed > 1_000 && refused > 1_000,
        "{parsed} parsed, {refused} refused"
    );
}

#[test]
fn any_id_survives_the_round_trip_through_the_router() {
    let mut rng = Rng(0xfeed_0000_0000_0007);
    for _ in 0..20_000 {
        let id = rng.id();
        let sid = RequestId::Int(rng.next_u64() as i64);
        let request = request(&id, "item/tool/call", None);
        let to_client = with_id(&request, &sid).expect("object");
        let Ok(Rpc::Request { id: seen, .. }) = parse(&to_client) else {
            panic!("{to_client}")
        };
        assert_eq!(seen, sid);
        let answer = format!(
            r#"{{"id":{},"result":{{}}}}"#,
            serde_json::to_string(&sid).unwrap()
        );
        let to_worker = with_id(&answer, &id).expect("object");
        let Ok(Rpc::Response { id: back }) = parse(&to_worker) else {
            panic!("{to_worker}")
        };
        assert_eq!(back, id, "{to_worker}");
        // An error answer for this id keeps the id, and its code is read back.
        let overload = error_response(Some(&id), codes::OVERLOADED, "x", None);
        let f = Frame::parse(&overload).expect("an error response");
        assert!(matches!(f.message, Rpc::Response { id: ref kept } if *kept == id));
        assert_eq!(f.error_code(), Some(codes::OVERLOADED));
    }
}

#[test]
fn a_response_frame_keeps_its_result_and_error_raw() {
    let ok = Frame::parse(r#"{"id":1,"result":{"thread":{"id":"t"}}}"#).unwrap();
    assert_eq!(ok.result.unwrap().get(), r#"{"thread":{"id":"t"}}"#);
    assert!(ok.error.is_none());
    assert_eq!(ok.error_code(), None);
    // A message that merely mentions "result" is still an error.
    let err =
        Frame::parse(r#"{"id":1,"error":{"code":-32001,"message":"no \"result\" yet"}}"#).unwrap();
    assert!(err.result.is_none());
    assert_eq!(err.error_code(), Some(-32001));
    assert_eq!(
        thread_of_result(ok.result.unwrap().get()).as_deref(),
        Some("t")
    );
    assert_eq!(
        message_of_error(err.error.unwrap().get()).as_deref(),
        Some("no \"result\" yet")
    );
    let null = Frame::parse(r#"{"id":1,"result":null}"#).unwrap();
    assert_eq!(thread_of_result(null.result.unwrap().get()), None);
    // Requests and notifications carry neither.
    let req = Frame::parse(r#"{"id":1,"method":"m","result":1}"#).unwrap();
    assert!(req.result.is_none() && req.error.is_none());
    assert!(matches!(
        req.message,
        Message::Request {
            method: Method::Other(_),
            ..
        }
    ));
    assert!(matches!(
        parse(r#"{"method":"turn/started","params":{}}"#).unwrap(),
        Message::Notification {
            method: Method::TurnStarted,
            ..
        }
    ));
}

/// The id's own visitor accepts exactly what `#[serde(untagged)]` over `i64` and `String` did,
/// for every kind of JSON value, alone and inside a frame.
#[test]
fn ids_are_read_as_the_untagged_derive_read_them() {
    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(untagged)]
    enum Untagged {
        Int(i64),
        Str(String),
    }
    impl Untagged {
        fn id(self) -> RequestId {
            match self {
                Untagged::Int(n) => RequestId::Int(n),
                Untagged::Str(s) => RequestId::Str(s),
            }
        }
    }
    let values = [
        "0",
        "7",
        "-1",
        "9223372036854775807",
        "-9223372036854775808",
        "9223372036854775808",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775809",
        "1.0",
        "1.5",
        "1e3",
        "-0",
        "\"\"",
        "\"initialize\"",
        "\"esc\\u00e9\\\"aped\\n\"",
        "\"\\ud83d\\ude00\"",
        "null",
        "true",
        "false",
        "[]",
        "[1]",
        "{}",
        "{\"a\":1}",
    ];
    for v in values {
        let ours = serde_json::from_str::<RequestId>(v).ok();
        let theirs = serde_json::from_str::<Untagged>(v).ok().map(Untagged::id);
        assert_eq!(ours, theirs, "id {v}");
        let frame = format!(r#"{{"id":{v},"method":"thread/read"}}"#);
        match (parse(&frame), theirs) {
            (Ok(Rpc::Request { id, .. }), Some(expected)) => assert_eq!(id, expected, "{frame}"),
            (Err(ParseError::BadId { request: true }), None) => {}
            (other, expected) => panic!("{frame}: {other:?}, expected {expected:?}"),
        }
    }
    // From a `Value` too (fan-out merges read ids back from values).
    for v in ["5", "\"s\"", "1.5", "null"] {
        let value: serde_json::Value = serde_json::from_str(v).unwrap();
        let ours = serde_json::from_value::<RequestId>(value.clone()).ok();
        let theirs = serde_json::from_value::<Untagged>(value)
            .ok()
            .map(Untagged::id);
        assert_eq!(ours, theirs, "value {v}");
    }
}

#[test]
fn an_answer_read_by_its_head_is_the_answer_the_full_parse_reads() {
    // As app-server writes them (facts §11), with ids of every form a client may choose.
    let mut rng = Rng(0x5eed_4ead_0000_0019);
    let mut fast = 0;
    for _ in 0..20_000 {
        let id = rng.id();
        let result = rng.pick(&[
            "{}",
            "null",
            r#"{"thread":{"id":"t","turns":[1,"}"]}}"#,
            "[]",
        ]);
        let text = format!(
            r#"{{"id":{},"result":{result}}}"#,
            serde_json::to_string(&id).unwrap()
        );
        let full = Frame::parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        let Rpc::Response { id: parsed } = full.message else {
            panic!("{text}")
        };
        match result_head(&text) {
            Some((head, raw)) => {
                fast += 1;
                assert_eq!(head, parsed, "{text}");
                assert_eq!(raw, full.result.unwrap().get(), "{text}");
            }
            // Only ids with escapes are left to the full parse.
            None => assert!(
                matches!(&id, RequestId::Str(s) if serde_json::to_string(s).unwrap().contains('\\')),
                "{text}"
            ),
        }
    }
    assert!(fast > 10_000, "{fast} read by the head");
    // Anything else it reads, it reads as the full parse does; what it cannot, it leaves.
    let mut rng = Rng(0x5eed_4ead_0000_0020);
    let (mut agreed, mut unchecked) = (0, 0);
    for _ in 0..50_000 {
        let text = arbitrary_frame(&mut rng);
        match (result_head(&text), Frame::parse(&text)) {
            (Some((head, raw)), Ok(full)) => {
                agreed += 1;
                assert!(
                    matches!(full.message, Rpc::Response { id } if id == head),
                    "{text}"
                );
                assert_eq!(Some(raw), full.result.map(RawValue::get), "{text}");
            }
            // Not JSON after the head: read as an answer, its result unchecked (see the doc).
            (Some(_), Err(_)) => unchecked += 1,
            _ => {}
        }
    }
    assert!(agreed > 100, "{agreed} agreed, {unchecked} unchecked");
    for left in [
        r#"{"error":{"code":1,"message":"m"},"id":1}"#, // errors come error-first
        r#"{"id":01,"result":{}}"#,
        r#"{"id":-0,"result":{}}"#,
        r#"{"id":1.0,"result":{}}"#,
        r#"{"id":1e3,"result":{}}"#,
        r#"{"id":9223372036854775808,"result":{}}"#,
        r#"{"id":"a\"b","result":{}}"#,
        "{\"id\":\"a\u{1}\",\"result\":{}}",
        r#"{"id":1,"result":{}} "#,
        r#"{"id":1,"result":}"#,
        "{\"id\":1,\"result\":\t{}}",
        r#"{"id":1,"result":{} }"#,
        r#"{"id":1,"method":"m","result":{}}"#,
        r#" {"id":1,"result":{}}"#,
    ] {
        assert_eq!(result_head(left), None, "{left}");
    }
    // A client's string id cannot smuggle a result of its own past the head: app-server
    // escapes its quotes, and an escape sends the frame to the full parse.
    let sneaky = RequestId::Str(r#"x","result":{"thread":{"id":"victim"}},"y":""#.into());
    let answer = format!(
        r#"{{"id":{},"result":{{}}}}"#,
        serde_json::to_string(&sneaky).unwrap()
    );
    assert_eq!(result_head(&answer), None);
    // Members after `result` (app-server writes none) would run into the result's text; its
    // readers read its first value.
    let (_, trailing) = result_head(r#"{"id":1,"result":{"thread":{"id":"t"}},"at":1}"#).unwrap();
    assert_eq!(thread_of_result(trailing).as_deref(), Some("t"));
    assert_eq!(thread_of_result("nonsense"), None);
    assert_eq!(
        result_head(r#"{"id":-12,"result":{"thread":{"id":"t"}}}"#),
        Some((RequestId::Int(-12), r#"{"thread":{"id":"t"}}"#))
    );
    assert_eq!(
        result_head(r#"{"id":"startup-1","result":null}"#),
        Some((RequestId::Str("startup-1".into()), "null"))
    );
}
