//! The leader's memory of its nodes' heartbeats: written by the agent API
//! (`api/agent.rs`) as heartbeats arrive, read by the leader's duties
//! (`leader/duties.rs`) and by status calls. The rules (keep the newest
//! report, registration clears it) are the core's `duties::HeardBook`; this
//! is its thread-safe holder with a monotonic clock.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Instant;

use gangway_core::duties::{HeardBook, TaskReport};
use gangway_core::JobId;

/// The leader's memory of node heartbeats, in monotonic milliseconds since the
/// replica started (never the wall clock: a clock step must not make every
/// node look silent). Only transitions to Down are committed.
pub struct Heartbeats {
    epoch: Instant,
    /// The term in which this replica's leader duties last started, and when
    /// (monotonic ms).
    leading: Mutex<Option<(u64, u64)>>,
    book: Mutex<HeardBook>,
    /// Nodes remembered at most (the core's NODES_MAX).
    max: usize,
}

impl Heartbeats {
    pub fn new(max: usize) -> Heartbeats {
        Heartbeats { epoch: Instant::now(), leading: Mutex::new(None), book: Mutex::new(HeardBook::default()), max }
    }

    /// Monotonic milliseconds since the replica started.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// See `HeardBook::record`.
    pub fn record(&self, node: &str, running: Option<(u64, BTreeSet<JobId>)>) {
        let now = self.now_ms();
        self.book.lock().expect("heartbeats lock").record(node, now, running, self.max);
    }

    pub fn last_ms(&self, node: &str) -> Option<u64> {
        self.book.lock().expect("heartbeats lock").last(node)
    }

    /// See `gangway_core::duties::Heard::runs`.
    pub fn runs(&self, node: &str, job: JobId) -> Option<TaskReport> {
        self.book.lock().expect("heartbeats lock").runs(node, job)
    }

    /// How long `node` has been silent, as the leader of `term` counts it.
    /// 0 until this replica's duties of that term have started: until then no
    /// tick can be declaring the node down.
    pub fn silence_ms(&self, node: &str, term: u64) -> u64 {
        match *self.leading.lock().expect("leading lock") {
            Some((t, since)) if t == term => gangway_core::duties::silence_ms(self.now_ms(), since, self.last_ms(node)),
            _ => 0,
        }
    }

    /// This replica's leader duties of `term` started at `since_ms`.
    pub fn started_leading(&self, term: u64, since_ms: u64) {
        *self.leading.lock().expect("leading lock") = Some((term, since_ms));
    }

    pub fn age_ms(&self, node: &str) -> Option<u64> {
        self.last_ms(node).map(|t| self.now_ms().saturating_sub(t))
    }
}
