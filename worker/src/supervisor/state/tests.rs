use super::*;
use crate::fleet::FleetCap;
use crate::load::Lifecycle;
use tokio::time::Duration;

/// A new thread's placement, from a caller connected to no worker yet.
const NEW: Purpose<'static> = Purpose::Thread { prefer: &[] };

fn cfg(max_workers: usize, fleet: &FleetCap) -> PoolConfig {
    PoolConfig {
        tenant: "st".into(),
        socket_dir: "/s".into(),
        max_workers,
        load_mark: 2,
        worker_idle: Duration::from_secs(10),
        fleet: fleet.clone(),
        ..PoolConfig::default()
    }
}

fn state() -> PoolState {
    let metrics = WorkerMetrics::register(&prometheus::Registry::new()).unwrap();
    PoolState::new(crate::id::intern_tenant("st"), metrics)
}

/// Adds a ready slot with a fake live worker.
fn ready(state: &mut PoolState) -> usize {
    let index = state.push_slot(None);
    state.slots[index].generation = 1;
    state.slots[index].requested = false;
    let (control, _) = mpsc::channel(1);
    let (_, exit) = watch::channel(None);
    state.slots[index].live = Some(Live {
        id: state.id(index),
        pid: 1,
        peer: crate::id::Peer { pid: 1, uid: 0 },
        fault: Arc::default(),
        group: ProcessGroup::inert(),
        exit,
        load: Arc::new(Load),
        control,
        threads: ThreadView::default(),
        rss: None,
        usage: crate::usage::Usage::default(),
        idle_since: None,
        retire: None,
        placed: Default::default(),
    });
    state.enter(index, WorkerState::Ready);
    index
}

fn status(state: &mut PoolState, index: usize, thread: &str, active: bool) {
    let id = state.id(index);
    let event = if active {
        Lifecycle::Status {
            thread: thread.into(),
            active,
        }
    } else {
        Lifecycle::Started {
            thread: thread.into(),
            active,
        }
    };
    state.on_lifecycle(index, id, event);
}

fn picked(pick: Pick) -> (u32, bool) {
    match pick {
        Pick::Ready { handle, start } => (handle.id.slot(), start.is_some()),
        _ => panic!("expected a ready worker"),
    }
}

#[tokio::test(start_paused = true)]
async fn placement_orders_by_active_then_loaded_then_handles() {
    let fleet = FleetCap::new(8);
    let cfg = cfg(4, &fleet);
    let mut s = state();
    let (a, b) = (ready(&mut s), ready(&mut s));
    let now = Instant::now();
    status(&mut s, a, "t1", true);
    status(&mut s, b, "t2", false);
    status(&mut s, b, "t3", false);
    // b has more loaded threads but no active turn.
    let (slot, _) = picked(s.pick(&cfg, NEW, now, now));
    assert_eq!(slot, 1);
    status(&mut s, b, "t2", true);
    // Both have one active turn: a has fewer loaded threads.
    assert_eq!(picked(s.pick(&cfg, NEW, now, now)).0, 0);
    status(&mut s, a, "t4", false);
    status(&mut s, a, "t5", false);
    // Equal on active and loaded (once the placements above have settled): handles decide.
    let later = now + Duration::from_secs(3);
    let held = s.handle(a, &cfg).unwrap();
    assert_eq!(picked(s.pick(&cfg, NEW, later, later)).0, 1);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn placements_close_together_spread_before_the_counts_arrive() {
    let fleet = FleetCap::new(8);
    let cfg = cfg(4, &fleet);
    let mut s = state();
    ready(&mut s);
    ready(&mut s);
    let now = Instant::now();
    // Nothing reported yet: each placement counts until the control leg's counts arrive.
    let slots: Vec<u32> = (0..4)
        .map(|_| picked(s.pick(&cfg, NEW, now, now)).0)
        .collect();
    assert_eq!(slots.iter().filter(|s| **s == 0).count(), 2, "{slots:?}");
    assert_eq!(slots.iter().filter(|s| **s == 1).count(), 2, "{slots:?}");
    // Settled placements no longer count.
    let later = now + Duration::from_secs(3);
    assert_eq!(picked(s.pick(&cfg, NEW, later, later)).0, 0);
}

#[tokio::test(start_paused = true)]
async fn a_thread_goes_to_a_worker_its_session_holds_unless_that_one_is_loaded_more() {
    let fleet = FleetCap::new(8);
    let cfg = cfg(4, &fleet);
    let mut s = state();
    let (a, b) = (ready(&mut s), ready(&mut s));
    let (ida, idb) = (s.id(a), s.id(b));
    let now = Instant::now();
    // b has a handle more (the session's own leg), so without a preference a would win.
    let held = s.handle(b, &cfg).unwrap();
    assert_eq!(picked(s.pick(&cfg, Purpose::Connection, now, now)).0, 0);
    let mine = Purpose::Thread { prefer: &[idb] };
    assert_eq!(
        picked(s.pick(&cfg, mine, now, now)).0,
        1,
        "b, the session's"
    );
    // That placement counts on b until its thread shows: now a is loaded less, and wins.
    assert_eq!(picked(s.pick(&cfg, mine, now, now)).0, 0, "a, loaded less");
    // Loaded alike again: a preference for either decides, whatever the handles say.
    let settled = now + Duration::from_secs(3);
    status(&mut s, a, "t1", true);
    status(&mut s, b, "t2", true);
    let either = Purpose::Thread {
        prefer: &[ida, idb],
    };
    assert_eq!(picked(s.pick(&cfg, either, settled, settled)).0, 0);
    let b_only = Purpose::Thread { prefer: &[idb] };
    let later = settled + Duration::from_secs(3);
    assert_eq!(picked(s.pick(&cfg, b_only, later, later)).0, 1);
    // An active turn more on b: load wins over the preference.
    status(&mut s, b, "t3", true);
    let latest = later + Duration::from_secs(3);
    assert_eq!(picked(s.pick(&cfg, b_only, latest, latest)).0, 0);
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn a_connection_is_not_counted_as_a_placement() {
    let fleet = FleetCap::new(8);
    let cfg = cfg(4, &fleet);
    let mut s = state();
    ready(&mut s);
    ready(&mut s);
    let now = Instant::now();
    // Connections place no thread: they leave no mark, so they all find slot 0 (least handles,
    // then the first), and so does the first thread after them.
    for _ in 0..3 {
        assert_eq!(picked(s.pick(&cfg, Purpose::Connection, now, now)).0, 0);
    }
    assert_eq!(picked(s.pick(&cfg, NEW, now, now)).0, 0);
    // A thread does leave one: the next thread goes to slot 1.
    assert_eq!(picked(s.pick(&cfg, NEW, now, now)).0, 1);
}

#[tokio::test(start_paused = true)]
async fn at_the_mark_placement_starts_one_more_within_the_caps() {
    let fleet = FleetCap::new(2);
    let cfg = cfg(3, &fleet);
    let _running = fleet.try_take().unwrap();
    let mut s = state();
    let a = ready(&mut s);
    let now = Instant::now();
    status(&mut s, a, "t1", true);
    assert_eq!(
        picked(s.pick(&cfg, NEW, now, now)),
        (0, false),
        "below the mark"
    );
    status(&mut s, a, "t2", true);
    let Pick::Ready {
        start: Some(Start::Add(permit)),
        ..
    } = s.pick(&cfg, NEW, now, now)
    else {
        panic!("expected a background start");
    };
    assert_eq!(fleet.in_use(), 2);
    let b = s.push_slot(Some(permit));
    assert_eq!(
        picked(s.pick(&cfg, NEW, now, now)),
        (0, false),
        "one start at a time"
    );
    // That start fell through (the slot is stopped again) and now the fleet is full: placement
    // still hands out the busy worker, and starts nothing.
    s.slots[b].permit = None;
    let _b_running = fleet.try_take().unwrap();
    drop(s.slots[b].live.take());
    s.enter(b, WorkerState::Stopped);
    s.slots[b].requested = false;
    assert_eq!(picked(s.pick(&cfg, NEW, now, now)), (0, false));
}

#[tokio::test(start_paused = true)]
async fn no_ready_worker_and_a_full_fleet_fails_fast() {
    let fleet = FleetCap::new(1);
    let cfg = cfg(2, &fleet);
    let _other_pool = fleet.try_take().unwrap();
    let mut s = state();
    let now = Instant::now();
    assert!(matches!(
        s.pick(&cfg, NEW, now, now),
        Pick::Fail(PoolError::FleetFull { max: 1, .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn idle_stop_after_worker_idle_never_with_load_or_below_min() {
    let fleet = FleetCap::unlimited();
    let mut cfg = cfg(3, &fleet);
    cfg.min_workers = 1;
    let mut s = state();
    let (min, a) = (ready(&mut s), ready(&mut s));
    let (min_id, a_id) = (s.id(min), s.id(a));
    let tick = |s: &mut PoolState, index, id| {
        let verdict = s.on_loaded(index, id, &[], None, &cfg, Instant::now());
        matches!(verdict, Verdict::Terminate(_))
    };
    assert!(!tick(&mut s, a, a_id));
    tokio::time::advance(Duration::from_secs(9)).await;
    assert!(!tick(&mut s, a, a_id));
    // A handle resets the clock.
    let held = s.handle(a, &cfg).unwrap();
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(!tick(&mut s, a, a_id));
    drop(held);
    assert!(!tick(&mut s, a, a_id));
    // A loaded thread (from the list) resets it too.
    tokio::time::advance(Duration::from_secs(9)).await;
    s.on_loaded(a, a_id, &["t".into()], None, &cfg, Instant::now());
    tokio::time::advance(Duration::from_secs(20)).await;
    assert!(!tick(&mut s, a, a_id));
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(tick(&mut s, a, a_id));
    assert_eq!(s.slots[a].state, WorkerState::Draining);
    assert_eq!(s.retiring(a), Some(ExitReason::Idle));
    // Only once.
    assert!(!tick(&mut s, a, a_id));
    // The min_workers slot stays.
    assert!(!tick(&mut s, min, min_id));
    assert_eq!(s.slots[min].state, WorkerState::Ready);
}

#[tokio::test(start_paused = true)]
async fn memory_guard_waits_for_the_active_turn() {
    let fleet = FleetCap::unlimited();
    let mut cfg = cfg(2, &fleet);
    cfg.max_worker_rss = Some(100);
    let mut s = state();
    let a = ready(&mut s);
    let id = s.id(a);
    status(&mut s, a, "t", true);
    let now = Instant::now();
    let v = s.on_loaded(a, id, &["t".into()], Some(101), &cfg, now);
    assert!(matches!(v, Verdict::Keep));
    assert_eq!(s.slots[a].state, WorkerState::Draining);
    assert!(s.get(id, &cfg).is_some(), "still routes to its threads");
    assert!(matches!(
        s.pick(&cfg, NEW, now, now),
        Pick::Start(Start::Add(_))
    ));
    let v = s.on_lifecycle(
        a,
        id,
        Lifecycle::Status {
            thread: "t".into(),
            active: false,
        },
    );
    assert!(matches!(v, Verdict::Terminate(_)));
    assert_eq!(s.retiring(a), Some(ExitReason::Memory));
    assert!(s.get(id, &cfg).is_none(), "told to stop: no new routes");
}

#[tokio::test]
async fn a_made_up_thread_id_is_looked_for_in_the_views_once_per_generation_of_them() {
    let mut s = state();
    let a = ready(&mut s);
    let w = s.id(a);
    status(&mut s, a, "real", false);
    assert_eq!(s.owner("made-up"), None);
    assert_eq!(s.misses.len(), 1, "the miss is remembered");
    assert_eq!(s.owner("made-up"), None);
    // A known thread changing status adds nothing to a view: the miss stays remembered.
    status(&mut s, a, "real", true);
    assert_eq!(s.misses.len(), 1);
    // A thread started after the miss is found.
    status(&mut s, a, "made-up", false);
    assert_eq!(s.owner("made-up"), Some(w));
    assert_eq!(s.misses.len(), 0, "a view that grew forgot every miss");
}

#[tokio::test]
async fn a_made_up_thread_id_is_remembered_only_up_to_a_bounded_length() {
    let mut s = state();
    let _a = ready(&mut s);
    // A tenant's client makes up ids as long as its frames may be: the pool, shared by all of
    // the tenant's sessions, must not keep megabytes of them.
    let long = "x".repeat(64 * 1024);
    assert_eq!(s.owner(&long), None);
    assert_eq!(s.misses.len(), 0, "a long made-up id is not remembered");
    assert_eq!(s.owner(&"y".repeat(36)), None);
    assert_eq!(s.misses.len(), 1, "an id of a real id's length is");
}

#[tokio::test]
async fn a_remembered_miss_is_looked_for_again_once_a_view_gains_the_thread() {
    let mut s = state();
    let a = ready(&mut s);
    let w = s.id(a);
    assert_eq!(s.owner("t"), None);
    // An answer teaches the view (and the record) the thread; the record then loses it, so only
    // the view still knows: the remembered miss must not hide it.
    s.learn("t", w);
    assert_eq!(s.owners.remove("t"), Some(w));
    assert_eq!(
        s.owner("t"),
        Some(w),
        "found in the view, not the stale miss"
    );
    assert_eq!(s.owners.get("t"), Some(w), "and the record repaired");
    // The same through a loaded list.
    assert_eq!(s.owner("u"), None);
    let cfg = cfg(1, &FleetCap::unlimited());
    s.on_loaded(a, w, &["t".into(), "u".into()], None, &cfg, Instant::now());
    assert_eq!(s.owners.remove("u"), Some(w));
    assert_eq!(s.owner("u"), Some(w));
}
