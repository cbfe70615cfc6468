//! One worker's load as seen from its control leg: loaded threads and which of them are active.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use proto::event::Event;
use serde::Deserialize;

use crate::id::WorkerId;
#[cfg(test)]
use serde_json::Value;
use tokio::time::Instant;
use tracing::warn;

/// Most threads tracked per worker; beyond it new ids are ignored (the next list resets the view).
pub const MAX_TRACKED_THREADS: usize = 10_000;

/// A thread lifecycle broadcast, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lifecycle {
    /// `thread/started`: loaded (new threads start idle unless the summary says otherwise).
    Started { thread: String, active: bool },
    /// `thread/status/changed` to a loaded status.
    Status { thread: String, active: bool },
    /// `thread/status/changed` to `notLoaded`, or `thread/closed`.
    Unloaded { thread: String },
}

/// The answer to `thread/loaded/list`: `{"data":[ids…],"nextCursor":null}` (checked on 0.171.0;
/// without a `limit` it is a single page).
#[derive(Debug, Deserialize)]
pub(crate) struct LoadedList {
    pub data: Vec<String>,
}

// === impl Lifecycle ===

impl Lifecycle {
    /// What a notification's event means for the worker's loaded threads; `None` for turn
    /// events.
    pub(crate) fn of(event: &Event<'_>) -> Option<Self> {
        let thread = event.thread().to_owned();
        Some(match (event, event.lifecycle()?) {
            (_, proto::event::Lifecycle::Unloaded) => Lifecycle::Unloaded { thread },
            (Event::ThreadStarted { .. }, proto::event::Lifecycle::Loaded { active }) => {
                Lifecycle::Started { thread, active }
            }
            (_, proto::event::Lifecycle::Loaded { active }) => Lifecycle::Status { thread, active },
        })
    }

    /// Parses a whole notification (tests).
    #[cfg(test)]
    pub(crate) fn parse(message: &Value) -> Option<Self> {
        Self::of(&Event::from_value(message)?)
    }
}

/// Loaded threads of one worker, each with whether it is active (running a turn or waiting on an
/// approval or user input).
#[derive(Debug, Default, Clone)]
pub(crate) struct ThreadView {
    /// Thread id → (active, when its last lifecycle event arrived).
    threads: HashMap<String, (bool, Instant)>,
    active: usize,
    /// Threads added to the view so far (never decreases): a thread id no view held may be
    /// held once this moves ([`Misses`]).
    additions: u64,
}

// === impl ThreadView ===

impl ThreadView {
    pub(crate) fn loaded(&self) -> usize {
        self.threads.len()
    }

    pub(crate) fn active(&self) -> usize {
        self.active
    }

    /// How many threads were ever added to the view; see [`Misses`].
    pub(crate) fn additions(&self) -> u64 {
        self.additions
    }

    /// Loaded thread ids, sorted.
    pub(crate) fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.threads.keys().cloned().collect();
        ids.sort_unstable();
        ids
    }

    /// Active thread ids, sorted.
    pub(crate) fn active_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .threads
            .iter()
            .filter(|(_, (active, _))| *active)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Whether `thread` is loaded here.
    pub(crate) fn contains(&self, thread: &str) -> bool {
        self.threads.contains_key(thread)
    }

    /// Every loaded thread with whether it is active.
    pub(crate) fn entries(&self) -> Vec<(String, bool)> {
        self.threads
            .iter()
            .map(|(id, (active, _))| (id.clone(), *active))
            .collect()
    }

    /// Records that `thread` is loaded here (a request's answer said so before the control leg
    /// did); what is known about it already stays.
    pub(crate) fn learn(&mut self, thread: &str) {
        if !self.threads.contains_key(thread) && self.threads.len() < MAX_TRACKED_THREADS {
            self.threads
                .insert(thread.to_owned(), (false, Instant::now()));
            self.additions += 1;
        }
    }

    pub(crate) fn apply(&mut self, event: Lifecycle) {
        match event {
            Lifecycle::Started { thread, active } | Lifecycle::Status { thread, active } => {
                self.set(thread, active);
            }
            Lifecycle::Unloaded { thread } => {
                if self
                    .threads
                    .remove(&thread)
                    .is_some_and(|(active, _)| active)
                {
                    self.active -= 1;
                }
            }
        }
    }

    /// The level-triggered truth from `thread/loaded/list`: keeps what is known about listed threads
    /// (a listed thread not seen before counts as not active), drops the rest — except threads
    /// whose lifecycle event arrived within `fresh`: app-server may have built the list before
    /// such a thread started (the answer and the broadcast race on the control leg), and dropping
    /// it would hide a running turn until its next status change.
    pub(crate) fn reset(&mut self, loaded: &[String], fresh: Duration) {
        let now = Instant::now();
        let mut next = HashMap::with_capacity(loaded.len().min(MAX_TRACKED_THREADS));
        for id in loaded.iter().take(MAX_TRACKED_THREADS) {
            let entry = self.threads.get(id).copied().unwrap_or_else(|| {
                self.additions += 1;
                (false, now)
            });
            next.insert(id.clone(), entry);
        }
        for (id, entry) in &self.threads {
            if next.len() < MAX_TRACKED_THREADS
                && now.saturating_duration_since(entry.1) < fresh
                && !next.contains_key(id)
            {
                next.insert(id.clone(), *entry);
            }
        }
        self.active = next.values().filter(|(active, _)| *active).count();
        self.threads = next;
    }

    fn set(&mut self, thread: String, active: bool) {
        let now = Instant::now();
        let len = self.threads.len();
        match self.threads.get_mut(&thread) {
            Some((was, at)) => {
                *at = now;
                if *was != active {
                    *was = active;
                    if active {
                        self.active += 1;
                    } else {
                        self.active -= 1;
                    }
                }
            }
            None if len >= MAX_TRACKED_THREADS => {
                warn!(
                    limit = MAX_TRACKED_THREADS,
                    "too many loaded threads to track"
                );
            }
            None => {
                self.threads.insert(thread, (active, now));
                self.active += usize::from(active);
                self.additions += 1;
            }
        }
    }
}

/// Thread ids that no worker's view held when last looked for, valid for one generation of the
/// views: the tenant's routing looks a thread id up in [`Owners`] first and, on a miss, in every
/// worker's view (which may hold a thread the record lost); a made-up id asked again and again
/// costs one lookup here instead of a look into every view each time. Any thread added to any
/// view starts a new generation, which forgets every miss (views only grow through
/// [`ThreadView::learn`], [`ThreadView::apply`] and [`ThreadView::reset`]; a worker that ends
/// or a thread that unloads only turns more ids into misses).
#[derive(Debug, Default)]
pub(crate) struct Misses {
    /// The generation of the views now.
    generation: u64,
    /// The generation `ids` were looked for in.
    of: u64,
    ids: HashSet<Box<str>>,
}

// === impl Misses ===

impl Misses {
    /// Ids remembered per generation at most: past it, further misses are looked for each time
    /// (a flood of distinct made-up ids costs what it cost before, and no memory).
    const MAX: usize = 4096;
    /// The longest id remembered: app-server's thread ids are UUIDs (36 bytes). A longer made-up
    /// id is looked for each time, as before, so the pool's memory stays bounded in bytes
    /// (at most `MAX × MAX_ID_BYTES`, 1 MiB) however long the ids a client makes up.
    const MAX_ID_BYTES: usize = 256;

    /// A view gained a thread: every remembered miss may now be held somewhere.
    pub(crate) fn views_grew(&mut self) {
        self.generation += 1;
    }

    /// Whether `thread` was looked for in vain in this generation of the views.
    pub(crate) fn contains(&self, thread: &str) -> bool {
        self.of == self.generation && self.ids.contains(thread)
    }

    /// `thread` is in no view now.
    pub(crate) fn insert(&mut self, thread: &str) {
        if self.of != self.generation {
            self.ids.clear();
            self.of = self.generation;
        }
        if self.ids.len() < Self::MAX && thread.len() <= Self::MAX_ID_BYTES {
            self.ids.insert(thread.into());
        }
    }

    /// Misses remembered for the current generation.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        if self.of == self.generation {
            self.ids.len()
        } else {
            0
        }
    }
}

/// Where each of a tenant's loaded threads lives: the pool's one record, kept with the workers'
/// views under the pool's lock and read by the router to route by thread id.
///
/// Looked up on every request that names a thread, so hashed with foldhash, randomly seeded per
/// map, rather than SipHash: the lookup, lock included, takes about 190 instructions instead of
/// 360 and touches about 9 code lines instead of 25 per cold round trip (BENCHMARKS.md, bench 1).
/// Ids a tenant can choose (a rollout it resumes carries its own) reach only its own pool's map,
/// capped at [`Owners::MAX`].
#[derive(Debug, Default)]
pub(crate) struct Owners {
    map: HashMap<String, WorkerId, foldhash::fast::RandomState>,
}

// === impl Owners ===

impl Owners {
    /// Entries kept per tenant at most; app-server's own limits are far below this.
    const MAX: usize = 100_000;

    pub(crate) fn get(&self, thread: &str) -> Option<WorkerId> {
        self.map.get(thread).copied()
    }

    /// `worker` has `thread` loaded (the latest word wins).
    pub(crate) fn set(&mut self, thread: &str, worker: WorkerId) {
        if let Some(w) = self.map.get_mut(thread) {
            *w = worker;
        } else if self.map.len() < Self::MAX {
            self.map.insert(thread.to_owned(), worker);
        }
    }

    /// `worker` no longer has `thread` loaded.
    pub(crate) fn release(&mut self, thread: &str, worker: WorkerId) {
        if self.map.get(thread) == Some(&worker) {
            self.map.remove(thread);
        }
    }

    /// `worker`'s view was reset (a loaded list) or it ended: exactly `view`'s threads are its.
    pub(crate) fn sync(&mut self, worker: WorkerId, view: Option<&ThreadView>) {
        self.map
            .retain(|t, w| *w != worker || view.is_some_and(|v| v.contains(t)));
        if let Some(view) = view {
            for t in view.threads.keys() {
                self.set(t, worker);
            }
        }
    }

    /// Removes `thread` whatever it points at (tests prove the record heals).
    pub(crate) fn remove(&mut self, thread: &str) -> Option<WorkerId> {
        self.map.remove(thread)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status(thread: &str, kind: &str) -> Value {
        json!({"method": "thread/status/changed",
               "params": {"threadId": thread, "status": {"type": kind, "activeFlags": []}}})
    }

    #[test]
    fn parses_lifecycle_broadcasts() {
        let started = json!({"method": "thread/started", "params": {"thread": {
            "id": "a", "status": {"type": "idle"}, "preview": ""}}, "emittedAtMs": 1});
        assert_eq!(
            Lifecycle::parse(&started),
            Some(Lifecycle::Started {
                thread: "a".into(),
                active: false
            })
        );
        assert_eq!(
            Lifecycle::parse(&status("a", "active")),
            Some(Lifecycle::Status {
                thread: "a".into(),
                active: true
            })
        );
        assert_eq!(
            Lifecycle::parse(&status("a", "systemError")),
            Some(Lifecycle::Status {
                thread: "a".into(),
                active: false
            })
        );
        assert_eq!(
            Lifecycle::parse(&status("a", "notLoaded")),
            Some(Lifecycle::Unloaded { thread: "a".into() })
        );
        let closed = json!({"method": "thread/closed", "params": {"threadId": "a"}});
        assert_eq!(
            Lifecycle::parse(&closed),
            Some(Lifecycle::Unloaded { thread: "a".into() })
        );
        assert_eq!(
            Lifecycle::parse(&json!({"method": "thread/name/updated", "params": {}})),
            None
        );
        assert_eq!(
            Lifecycle::parse(&json!({"method": "thread/closed", "params": {}})),
            None
        );
    }

    #[test]
    fn view_counts_loaded_and_active() {
        let mut v = ThreadView::default();
        for e in [
            &status("a", "idle"),
            &status("b", "active"),
            &status("c", "active"),
        ] {
            v.apply(Lifecycle::parse(e).unwrap());
        }
        assert_eq!((v.loaded(), v.active()), (3, 2));
        v.apply(Lifecycle::parse(&status("b", "idle")).unwrap());
        v.apply(Lifecycle::parse(&status("b", "idle")).unwrap());
        assert_eq!((v.loaded(), v.active()), (3, 1));
        v.apply(Lifecycle::parse(&status("c", "notLoaded")).unwrap());
        assert_eq!((v.loaded(), v.active()), (2, 0));
        // A missed close is repaired by the list; a missed start too.
        v.reset(&["b".into(), "d".into()], Duration::ZERO);
        assert_eq!(v.ids(), ["b", "d"]);
        assert_eq!((v.loaded(), v.active()), (2, 0));
        v.apply(Lifecycle::parse(&status("d", "active")).unwrap());
        v.reset(&["d".into()], Duration::ZERO);
        assert_eq!((v.loaded(), v.active()), (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_list_older_than_a_new_thread_does_not_hide_it() {
        let mut v = ThreadView::default();
        v.apply(Lifecycle::parse(&status("old", "idle")).unwrap());
        tokio::time::advance(Duration::from_secs(10)).await;
        // The list was built before "new" started, and is read after its broadcast.
        v.apply(Lifecycle::parse(&status("new", "active")).unwrap());
        v.reset(&[], Duration::from_secs(2));
        assert_eq!(
            v.ids(),
            ["new"],
            "the stale entry goes, the fresh one stays"
        );
        assert_eq!(v.active(), 1);
        tokio::time::advance(Duration::from_secs(3)).await;
        v.reset(&[], Duration::from_secs(2));
        assert_eq!(v.loaded(), 0, "a later list is believed");
    }

    #[test]
    fn owners_follow_the_views_level_triggered() {
        let (w1, w2) = (WorkerId::new("t", 0, 1), WorkerId::new("t", 1, 1));
        let mut owners = Owners::default();
        let mut v1 = ThreadView::default();
        for t in ["a", "b"] {
            v1.learn(t);
            owners.set(t, w1);
        }
        owners.set("c", w2);
        v1.reset(&["b".into(), "d".into()], Duration::ZERO);
        owners.sync(w1, Some(&v1));
        assert_eq!(owners.get("a"), None, "unloaded on w1");
        assert_eq!(owners.get("b"), Some(w1));
        assert_eq!(owners.get("d"), Some(w1), "learned from the list");
        assert_eq!(owners.get("c"), Some(w2), "other workers untouched");
        owners.release("c", w1);
        assert_eq!(
            owners.get("c"),
            Some(w2),
            "release only drops a matching owner"
        );
        v1.apply(Lifecycle::parse(&status("b", "active")).unwrap());
        let mut gone = v1.entries();
        gone.sort();
        assert_eq!(gone, [("b".to_owned(), true), ("d".to_owned(), false)]);
        owners.sync(w1, None);
        assert_eq!(
            (owners.get("b"), owners.get("d"), owners.len()),
            (None, None, 1)
        );
        // What an answer taught is kept by the next list only if the worker still lists it.
        assert_eq!(owners.remove("c"), Some(w2));
        let mut v2 = ThreadView::default();
        v2.learn("c");
        v2.learn("c");
        assert_eq!((v2.loaded(), v2.active()), (1, 0));
    }

    #[test]
    fn loaded_list_shape() {
        let list: LoadedList =
            serde_json::from_value(json!({"data": ["x", "y"], "nextCursor": null})).unwrap();
        assert_eq!(list.data, ["x", "y"]);
    }
}
