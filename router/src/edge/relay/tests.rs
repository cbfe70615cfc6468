//! The edge's relay over in-memory sockets (a client and a node end), on paused time: its byte
//! bounds, its frame rate, what it holds while waiting, and that it frees all it held.

use std::sync::Arc;

use futures_util::{SinkExt, StreamExt};
use tokio::io::DuplexStream;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

use super::{Relay, RelayCtx, Waited, PENDING_CLOSE_REASON};
use crate::admission::{Admission, AdmissionConfig, FLOOD_CLOSE_REASON};
use crate::credentials::Lease;
use crate::metrics::RouterMetrics;

type Ws = WebSocketStream<DuplexStream>;

/// A socket pair: (the relay's end, the peer's end); `buf` bytes fit in each direction.
async fn pair(buf: usize) -> (Ws, Ws) {
    let (a, b) = tokio::io::duplex(buf);
    tokio::join!(
        WebSocketStream::from_raw_socket(a, Role::Server, None),
        WebSocketStream::from_raw_socket(b, Role::Client, None),
    )
}

struct Fixture {
    admission: Arc<Admission>,
    metrics: RouterMetrics,
}

impl Fixture {
    fn new(cfg: AdmissionConfig) -> Fixture {
        Fixture {
            admission: Admission::new(cfg).unwrap(),
            metrics: RouterMetrics::register(&prometheus::Registry::new()).unwrap(),
        }
    }

    fn relay(&self, client: Ws, session_bytes: usize, tenant_bytes: usize) -> Relay<DuplexStream> {
        self.relay_queue(client, session_bytes, tenant_bytes, 8192)
    }

    /// A relay whose client queue holds `frames` frames.
    fn relay_queue(
        &self,
        client: Ws,
        session_bytes: usize,
        tenant_bytes: usize,
        frames: usize,
    ) -> Relay<DuplexStream> {
        let ctx = RelayCtx {
            guard: self.admission.open_connection("acme").unwrap(),
            metrics: self.metrics.clone(),
            admission: self.admission.clone(),
            client_queue: frames,
            client_queue_bytes: session_bytes,
            tenant_queue_bytes: tenant_bytes,
            shutdown: CancellationToken::new(),
            client_read: self.admission.read_meter("acme", tenant_bytes),
        };
        Relay::new(client, ctx)
    }

    fn closed(&self, reason: &str) -> u64 {
        self.metrics
            .sessions_closed
            .with_label_values(&[reason])
            .get()
    }

    /// Nothing of the session is left: no queued bytes, no connection slot.
    fn all_freed(&self) {
        assert_eq!(self.admission.queued_bytes("acme"), 0);
        assert_eq!(self.admission.leg_bytes("acme"), 0);
        assert_eq!(self.admission.connections("acme"), (0, 0));
    }
}

fn notification(method: &str, pad: usize) -> Message {
    Message::text(format!(
        r#"{{"method":"{method}","params":{{"pad":"{}"}}}}"#,
        "x".repeat(pad)
    ))
}

/// The close frame a peer reads next, skipping other frames.
async fn close_of(ws: &mut Ws) -> Option<(u16, String)> {
    while let Some(m) = ws.next().await {
        match m {
            Ok(Message::Close(f)) => return f.map(|f| (u16::from(f.code), f.reason.to_string())),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

#[tokio::test(start_paused = true)]
async fn a_client_that_never_reads_is_closed_at_its_byte_bound_and_everything_is_freed() {
    let f = Fixture::new(AdmissionConfig::default());
    let (client, _never_read) = pair(4096).await;
    let (link, mut node) = pair(1 << 20).await;
    let relay = f.relay(client, 256 << 10, 1 << 20);
    let unbounded = Lease::unbounded();
    let flood = async {
        for _ in 0..64 {
            if node.send(notification("thread/x", 64 << 10)).await.is_err() {
                break;
            }
        }
        close_of(&mut node).await
    };
    let mut lost = None;
    let relayed = |l| lost = Some(l);
    let ((), node_close) = tokio::join!(relay.run(link, Vec::new(), &unbounded, relayed), flood);
    assert_eq!(lost, Some(false));
    assert!(node_close.is_none(), "the node gets a plain close");
    assert_eq!(f.closed("slow_client"), 1);
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn deltas_are_dropped_above_the_soft_mark_and_whole_items_still_go() {
    let f = Fixture::new(AdmissionConfig::default());
    let (client, mut reader) = pair(4096).await;
    let (link, mut node) = pair(1 << 20).await;
    let relay = f.relay(client, 256 << 10, 1 << 20);
    let unbounded = Lease::unbounded();
    let run = relay.run(link, Vec::new(), &unbounded, |_| {});
    let peers = async {
        // 150 KiB the client does not read yet: above half of its 256 KiB.
        node.send(notification("item/completed", 150 << 10))
            .await
            .unwrap();
        for _ in 0..10 {
            node.send(notification("item/agentMessage/delta", 10))
                .await
                .unwrap();
        }
        node.send(notification("item/completed", 10)).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let mut got = Vec::new();
        for _ in 0..2 {
            match reader.next().await {
                Some(Ok(Message::Text(t))) => got.push(t.len()),
                other => panic!("{other:?}"),
            }
        }
        reader.close(None).await.unwrap();
        got
    };
    let ((), got) = tokio::join!(run, peers);
    assert!(got[0] > 150 << 10 && got[1] < 100, "{got:?}");
    assert_eq!(f.metrics.deltas_dropped.get(), 10);
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn pings_count_against_the_frame_rate_and_a_flood_is_closed() {
    let f = Fixture::new(AdmissionConfig {
        conn_fps: 1,
        conn_burst: 5,
        ..AdmissionConfig::default()
    });
    let (client, mut peer) = pair(1 << 20).await;
    let (link, _node) = pair(1 << 20).await;
    let relay = f.relay(client, 256 << 10, 1 << 20);
    let unbounded = Lease::unbounded();
    let flood = async {
        for _ in 0..10 {
            if peer.send(Message::Ping(vec![1].into())).await.is_err() {
                break;
            }
        }
        close_of(&mut peer).await
    };
    let ((), close) = tokio::join!(relay.run(link, Vec::new(), &unbounded, |_| {}), flood);
    assert_eq!(close, Some((1008, FLOOD_CLOSE_REASON.to_owned())));
    assert_eq!(f.closed("flooded"), 1);
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn a_request_over_the_frame_rate_is_answered_and_not_forwarded() {
    let f = Fixture::new(AdmissionConfig {
        conn_fps: 1,
        conn_burst: 2,
        ..AdmissionConfig::default()
    });
    let (client, mut peer) = pair(1 << 20).await;
    let (link, mut node) = pair(1 << 20).await;
    let relay = f.relay(client, 256 << 10, 1 << 20);
    let unbounded = Lease::unbounded();
    let peers = async {
        for id in 1..=3 {
            let r = format!(r#"{{"id":{id},"method":"thread/list","params":{{}}}}"#);
            peer.send(Message::text(r)).await.unwrap();
        }
        let answer = match peer.next().await {
            Some(Ok(Message::Text(t))) => serde_json::from_str::<serde_json::Value>(&t).unwrap(),
            other => panic!("{other:?}"),
        };
        let mut forwarded = Vec::new();
        for _ in 0..2 {
            match node.next().await {
                Some(Ok(Message::Text(t))) => forwarded.push(t.to_string()),
                other => panic!("{other:?}"),
            }
        }
        peer.close(None).await.unwrap();
        // Nothing more reaches the node than the two and the close.
        let rest = close_of(&mut node).await;
        (answer, forwarded, rest)
    };
    let ((), (answer, forwarded, _rest)) =
        tokio::join!(relay.run(link, Vec::new(), &unbounded, |_| {}), peers);
    assert_eq!(answer["id"], 3, "{answer}");
    assert_eq!(answer["error"]["code"], -32001, "{answer}");
    assert_eq!(answer["error"]["data"]["scope"], "connection", "{answer}");
    assert!(forwarded.iter().all(|t| !t.contains(r#""id":3"#)));
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn what_a_waiting_session_holds_is_bounded_in_bytes() {
    let f = Fixture::new(AdmissionConfig::default());
    let (client, mut peer) = pair(1 << 20).await;
    let mut relay = f.relay(client, 64 << 10, 1 << 20);
    let never = std::future::pending::<Result<Ws, super::super::LinkError>>();
    let lease = Lease::unbounded();
    let send = async {
        // Three messages well under the count bound, over the byte bound together.
        for _ in 0..3 {
            peer.send(notification("x/y", 30 << 10)).await.unwrap();
        }
    };
    let (waited, ()) = tokio::join!(relay.wait(never, &lease), send);
    let Waited::Ended(ending) = waited else {
        panic!("the session was not ended while waiting");
    };
    relay.end(ending).await;
    assert_eq!(
        close_of(&mut peer).await,
        Some((1008, PENDING_CLOSE_REASON.to_owned()))
    );
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn a_revoked_credential_ends_a_waiting_session_and_nothing_held_leaves() {
    let f = Fixture::new(AdmissionConfig::default());
    let revoked = Lease::revoked();
    // While waiting: the credential ends the wait.
    let (client, mut peer) = pair(1 << 20).await;
    let mut relay = f.relay(client, 64 << 10, 1 << 20);
    let never = std::future::pending::<Result<Ws, super::super::LinkError>>();
    let Waited::Ended(ending) = relay.wait(never, &revoked).await else {
        panic!("the session was not ended while waiting");
    };
    relay.end(ending).await;
    assert_eq!(
        close_of(&mut peer).await,
        Some((1008, crate::end::REVOKED_REASON.to_owned()))
    );
    // Linked, with held messages: they do not leave.
    let (client, mut peer) = pair(1 << 20).await;
    let (link, mut node) = pair(1 << 20).await;
    let relay = f.relay(client, 64 << 10, 1 << 20);
    let held = vec![Message::text(
        r#"{"id":1,"method":"thread/start","params":{}}"#,
    )];
    let ((), node_saw) = tokio::join!(relay.run(link, held, &revoked, |_| {}), async {
        let mut texts = 0;
        while let Some(Ok(m)) = node.next().await {
            texts += usize::from(matches!(m, Message::Text(_)));
        }
        texts
    });
    assert_eq!(node_saw, 0, "a held request reached the node");
    assert_eq!(
        close_of(&mut peer).await,
        Some((1008, crate::end::REVOKED_REASON.to_owned()))
    );
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn a_credential_revoked_while_the_session_relays_ends_it() {
    let f = Fixture::new(AdmissionConfig::default());
    let lease = Lease::unbounded();
    let (client, mut peer) = pair(1 << 20).await;
    let (link, mut node) = pair(1 << 20).await;
    let relay = f.relay(client, 64 << 10, 1 << 20);
    let session = relay.run(link, Vec::new(), &lease, |_| {});
    let driver = async {
        // The session relays (its rare events have been polled and are waited on)...
        peer.send(Message::text(
            r#"{"id":1,"method":"thread/list","params":{}}"#,
        ))
        .await
        .unwrap();
        match node.next().await {
            Some(Ok(Message::Text(t))) => assert!(t.contains("thread/list"), "{t}"),
            other => panic!("the node got {other:?}"),
        }
        // (under the link's ping interval, so nothing else wakes it)
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        // ...then the credential is revoked: the wake must reach the session.
        lease.revoke();
        let closed = close_of(&mut peer).await;
        while node.next().await.is_some() {}
        closed
    };
    let ((), closed) = tokio::join!(session, driver);
    assert_eq!(closed, Some((1008, crate::end::REVOKED_REASON.to_owned())));
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn a_large_frame_crosses_the_edge_in_fragments_both_ways_and_arrives_whole() {
    use crate::raw_ws::{raw_frame, raw_message};
    use proto::ws::FRAGMENT_SIZE;
    use tokio::io::AsyncWriteExt;

    let f = Fixture::new(AdmissionConfig::default());
    let (relay_end, client) = tokio::io::duplex(64 << 10);
    let (mut client_rx, mut client_tx) = tokio::io::split(client);
    let (link_end, mut node) = tokio::io::duplex(64 << 10);
    let relay = f.relay(
        WebSocketStream::from_raw_socket(relay_end, Role::Server, None).await,
        4 << 20,
        4 << 20,
    );
    let link = WebSocketStream::from_raw_socket(link_end, Role::Client, None).await;
    let unbounded = Lease::unbounded();
    let run = relay.run(link, Vec::new(), &unbounded, |_| {});
    let pad = "é".repeat(FRAGMENT_SIZE * 3);
    let request = format!(r#"{{"id":1,"method":"thread/x","params":{{"pad":"{pad}"}}}}"#);
    let answer = format!(r#"{{"id":1,"result":{{"pad":"{pad}"}}}}"#);
    let peers = async {
        // Each sends its frame whole; each reads what the edge wrote.
        let to_node = async {
            client_tx
                .write_all(&raw_frame(true, 1, request.as_bytes(), true))
                .await
                .unwrap();
            let (frames, joined) = raw_message(&mut node).await;
            node.write_all(&raw_frame(true, 1, answer.as_bytes(), false))
                .await
                .unwrap();
            (frames, joined)
        };
        let ((up, up_joined), (down, down_joined)) =
            tokio::join!(to_node, raw_message(&mut client_rx));
        client_tx
            .write_all(&raw_frame(true, 8, &[0x03, 0xE8], true))
            .await
            .unwrap();
        (up, up_joined, down, down_joined)
    };
    let ((), (up, up_joined, down, down_joined)) = tokio::join!(run, peers);
    for (frames, joined, sent) in [(up, up_joined, &request), (down, down_joined, &answer)] {
        assert_eq!(joined, sent.as_bytes(), "the message arrives whole");
        assert!(frames.len() >= 4, "{} frames", frames.len());
        crate::raw_ws::assert_text_fragments(&frames);
    }
    f.all_freed();
}

#[tokio::test(start_paused = true)]
async fn a_client_s_large_frames_count_against_its_tenant_s_buffers_until_it_goes() {
    let f = Fixture::new(AdmissionConfig::default());
    let request = |pad: usize| {
        Message::text(format!(
            r#"{{"id":1,"method":"thread/x","params":{{"pad":"{}"}}}}"#,
            "x".repeat(pad)
        ))
    };
    // Room for 300 KiB of the tenant's read buffers.
    let (first_client, mut first) = pair(1 << 20).await;
    let (first_link, mut first_node) = pair(1 << 20).await;
    let (second_client, mut second) = pair(1 << 20).await;
    let (second_link, _second_node) = pair(1 << 20).await;
    let (a, b) = (
        f.relay(first_client, 1 << 20, 300 << 10),
        f.relay(second_client, 1 << 20, 300 << 10),
    );
    let unbounded = Lease::unbounded();
    let peers = async {
        // The first sends 200 KiB: forwarded, and its socket's buffer is that large from now on.
        first.send(request(200 << 10)).await.unwrap();
        assert!(matches!(
            first_node.next().await,
            Some(Ok(Message::Text(_)))
        ));
        assert!(f.admission.held_bytes("acme") > 200 << 10);
        // The second's 150 KiB find no room: it is closed, and counts nothing.
        second.send(request(150 << 10)).await.unwrap();
        let close = close_of(&mut second).await;
        let held = f.admission.held_bytes("acme");
        // The first goes on; once it is gone, so is what it held.
        first.send(request(10)).await.unwrap();
        assert!(matches!(
            first_node.next().await,
            Some(Ok(Message::Text(_)))
        ));
        first.close(None).await.unwrap();
        (close, held)
    };
    let ((), (), (close, held)) = tokio::join!(
        a.run(first_link, Vec::new(), &unbounded, |_| {}),
        b.run(second_link, Vec::new(), &unbounded, |_| {}),
        peers
    );
    assert_eq!(
        close,
        Some((1008, crate::end::LARGE_FRAMES_REASON.to_owned()))
    );
    assert!((200 << 10..250 << 10).contains(&held), "{held}");
    assert_eq!(f.closed("large_frames"), 1);
    assert_eq!(f.admission.held_bytes("acme"), 0);
    f.all_freed();
}

/// A node that stops reading a session (its tenant's worker stopped: `serve` then stops reading
/// the client) holds the client at the edge as `serve` holds it: what the link holds is bounded
/// ([`super::LinkOut`]), the client is not read beyond it, the node's frames still reach the
/// client, the held link is not taken for a lost node, and once the node reads again every
/// message arrives, in order.
#[tokio::test(start_paused = true)]
async fn a_node_that_stops_reading_holds_the_client_and_the_relay_goes_on() {
    use std::time::Duration;

    let f = Fixture::new(AdmissionConfig::default());
    let lease = Lease::unbounded();
    let (client, peer) = pair(256 << 10).await;
    let (mut peer_tx, mut peer_rx) = peer.split();
    let (link, node) = pair(64 << 10).await;
    let (mut node_tx, mut node_rx) = node.split();
    let relay = f.relay(client, 256 << 10, 1 << 20);
    let session = relay.run(link, Vec::new(), &lease, |lost| {
        assert!(!lost, "taken for lost")
    });
    let driver = async {
        // The node reads nothing: the client's messages fill the link, then the link's budget,
        // then the client's own socket, and its sends stop.
        let mut sent = 0;
        while sent < 200 {
            let send = peer_tx.send(notification("x/flood", 32 << 10));
            if tokio::time::timeout(Duration::from_secs(1), send)
                .await
                .is_err()
            {
                break;
            }
            sent += 1;
        }
        assert!(sent < 200, "the client was never held");
        let held = f.admission.leg_bytes("acme");
        assert!(
            (256 << 10..(256 + 40) << 10).contains(&held),
            "the link holds {held} bytes"
        );
        // The other direction goes on, long past the link's silence deadline.
        for round in 0..4 {
            tokio::time::sleep(Duration::from_secs(10)).await;
            node_tx.send(notification("x/still", round)).await.unwrap();
            match tokio::time::timeout(Duration::from_secs(5), peer_rx.next()).await {
                Ok(Some(Ok(Message::Text(t)))) => assert!(t.contains("x/still"), "{t}"),
                other => panic!("the client got {other:?} at round {round}"),
            }
        }
        // The node reads again: everything arrives, in order (the one whose send timed out
        // included), then the client's close.
        let mut got = 0;
        let reader = async {
            while let Some(Ok(m)) = node_rx.next().await {
                match m {
                    Message::Text(t) => {
                        assert!(t.contains("x/flood"), "{t}");
                        got += 1;
                    }
                    Message::Close(_) => break,
                    _ => {}
                }
            }
        };
        let closer = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            peer_tx.close().await.unwrap();
            while peer_rx.next().await.is_some() {}
        };
        tokio::join!(reader, closer);
        (sent, got)
    };
    let ((), (sent, got)) = tokio::join!(session, driver);
    assert!(
        got == sent || got == sent + 1,
        "sent {sent}, the node got {got}"
    );
    f.all_freed();
}

/// A session refused while it waited answers every request it held, even more of them than its
/// client queue holds frames (`client_queue` may be set below what a waiting session may hold).
#[tokio::test(start_paused = true)]
async fn a_refused_session_answers_every_request_it_held_whatever_its_queue() {
    let f = Fixture::new(AdmissionConfig::default());
    let (client, mut peer) = pair(1 << 20).await;
    let relay = f.relay_queue(client, 1 << 20, 1 << 20, 4);
    let held: Vec<Message> = (0..40)
        .map(|i| {
            Message::text(format!(
                r#"{{"id":{i},"method":"thread/list","params":{{}}}}"#
            ))
        })
        .collect();
    for m in &held {
        assert!(relay.out.bytes.try_add(proto::ws::Outgoing::counted_len(m)));
    }
    use crate::admission::{Reason, Rejection, Scope};
    let refusal = Rejection::cap(
        Scope::Worker,
        Reason::NodeUnavailable,
        std::time::Duration::from_secs(1),
    );
    let answer = |id: &proto::rpc::RequestId| refusal.to_error_response(id);
    let refuse = relay.refuse(held, &refusal, answer, None, 1013, "no node");
    let read = async {
        let mut ids = Vec::new();
        let close = loop {
            match peer.next().await {
                Some(Ok(Message::Text(t))) => {
                    let v: serde_json::Value = serde_json::from_str(&t).unwrap();
                    assert_eq!(v["error"]["code"], -32001, "{v}");
                    ids.push(v["id"].as_i64().unwrap());
                }
                Some(Ok(Message::Close(f))) => break f.map(|f| u16::from(f.code)),
                other => panic!("the client got {other:?}"),
            }
        };
        (ids, close)
    };
    let ((), (ids, close)) = tokio::join!(refuse, read);
    assert_eq!(
        ids,
        (0..40).collect::<Vec<_>>(),
        "every held request answered, in order"
    );
    assert_eq!(close, Some(1013));
    f.all_freed();
}

/// A link that takes nothing of what it holds for [`super::LINK_BLOCKED`] is a node frozen (its
/// kernel still acknowledging, its window shut) or a machine gone: the session is closed 1012
/// and counted lost, and everything it held is freed.
#[tokio::test(start_paused = true)]
async fn a_link_that_takes_nothing_for_two_minutes_is_lost() {
    use std::time::Duration;

    let f = Fixture::new(AdmissionConfig::default());
    let lease = Lease::unbounded();
    let (client, peer) = pair(256 << 10).await;
    let (mut peer_tx, mut peer_rx) = peer.split();
    let (link, _node) = pair(64 << 10).await;
    let relay = f.relay(client, 256 << 10, 1 << 20);
    let lost = std::sync::atomic::AtomicBool::new(false);
    let session = relay.run(link, Vec::new(), &lease, |l| {
        lost.store(l, std::sync::atomic::Ordering::Relaxed);
    });
    let started = tokio::time::Instant::now();
    let driver = async {
        for _ in 0..40 {
            let send = peer_tx.send(notification("x/flood", 32 << 10));
            if tokio::time::timeout(Duration::from_secs(1), send)
                .await
                .is_err()
            {
                break;
            }
        }
        let close = tokio::time::timeout(Duration::from_secs(300), async {
            while let Some(m) = peer_rx.next().await {
                if let Ok(Message::Close(f)) = m {
                    return f.map(|f| u16::from(f.code));
                }
            }
            None
        })
        .await;
        (close.ok().flatten(), started.elapsed())
    };
    let ((), (close, after)) = tokio::join!(session, driver);
    assert_eq!(close, Some(super::super::NODE_LOST_CODE));
    assert!(lost.load(std::sync::atomic::Ordering::Relaxed));
    assert!(
        (Duration::from_secs(120)..Duration::from_secs(135)).contains(&after),
        "closed after {after:?}"
    );
    f.all_freed();
}

/// A binary frame is answered by the node with an error whatever it holds: the edge passes on
/// an empty one, so a large one costs the link nothing.
#[tokio::test(start_paused = true)]
async fn a_binary_frame_goes_on_empty() {
    let f = Fixture::new(AdmissionConfig::default());
    let lease = Lease::unbounded();
    let (client, mut peer) = pair(1 << 20).await;
    let (link, mut node) = pair(1 << 20).await;
    let relay = f.relay(client, 1 << 20, 1 << 20);
    let session = relay.run(link, Vec::new(), &lease, |_| {});
    let driver = async {
        peer.send(Message::binary(vec![7u8; 200 << 10]))
            .await
            .unwrap();
        let got = node.next().await;
        peer.close(None).await.unwrap();
        while node.next().await.is_some() {}
        got
    };
    let ((), got) = tokio::join!(session, driver);
    match got {
        Some(Ok(Message::Binary(b))) => assert!(b.is_empty(), "{} bytes", b.len()),
        other => panic!("the node got {other:?}"),
    }
    f.all_freed();
}
