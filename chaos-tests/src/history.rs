//! The record of what clients did and saw: every operation as invoke → ok /
//! fail / unknown (the call timed out or the connection broke: it may or may
//! not have taken effect), with times. Checkers read it after the run.

use std::sync::Mutex;
use std::time::Instant;

/// Operations one run records: far above what a long run issues (three
/// clients, one operation per ~150 ms each, for minutes).
pub const OPS_MAX: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged: the job id the cluster returned.
    Ok(u64),
    /// Refused with a definite error: the submit did not happen.
    Fail(String),
    /// No answer: it may have happened.
    Unknown(String),
}

#[derive(Debug, Clone)]
pub struct Submit {
    /// The idempotency key, also the job's name (`chaos-<key>`).
    pub key: String,
    pub invoked: Instant,
    pub completed: Instant,
    pub outcome: Outcome,
}

/// What a cancel returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// Acknowledged: the job was cancelled at this attempt.
    Ok { attempt: u32 },
    /// Refused: the job had already finished (or a retry found it cancelled).
    AlreadyFinished,
    /// No answer: it may have happened.
    Unknown(String),
}

#[derive(Debug, Clone)]
pub struct Cancel {
    pub job: u64,
    pub invoked: Instant,
    pub completed: Instant,
    pub outcome: CancelOutcome,
}

/// What a query (a linearizable read of one job) returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryOutcome {
    /// The job's state (`pb::JobState` as i32) and attempt.
    Found {
        state: i32,
        attempt: u32,
    },
    NotFound(String),
    Unknown(String),
}

#[derive(Debug, Clone)]
pub struct Query {
    pub job: u64,
    pub invoked: Instant,
    pub completed: Instant,
    pub outcome: QueryOutcome,
}

#[derive(Default)]
struct Ops {
    submits: Vec<Submit>,
    cancels: Vec<Cancel>,
    queries: Vec<Query>,
}

impl Ops {
    fn len(&self) -> usize {
        self.submits.len() + self.cancels.len() + self.queries.len()
    }
}

#[derive(Default)]
pub struct History {
    ops: Mutex<Ops>,
}

impl History {
    fn with<T>(&self, f: impl FnOnce(&mut Ops) -> T) -> T {
        let mut ops = self.ops.lock().expect("history lock");
        assert!(ops.len() < OPS_MAX, "history is full ({OPS_MAX} operations)");
        f(&mut ops)
    }

    pub fn record(&self, s: Submit) {
        self.with(|o| o.submits.push(s));
    }

    pub fn record_cancel(&self, c: Cancel) {
        self.with(|o| o.cancels.push(c));
    }

    pub fn record_query(&self, q: Query) {
        self.with(|o| o.queries.push(q));
    }

    pub fn submits(&self) -> Vec<Submit> {
        self.ops.lock().expect("history lock").submits.clone()
    }

    pub fn cancels(&self) -> Vec<Cancel> {
        self.ops.lock().expect("history lock").cancels.clone()
    }

    pub fn queries(&self) -> Vec<Query> {
        self.ops.lock().expect("history lock").queries.clone()
    }

    /// Every operation's (invoked, completed, succeeded), for availability gaps.
    pub fn spans(&self) -> Vec<(Instant, Instant, bool)> {
        let o = self.ops.lock().expect("history lock");
        let s = o.submits.iter().map(|s| (s.invoked, s.completed, matches!(s.outcome, Outcome::Ok(_))));
        let c = o.cancels.iter().map(|c| (c.invoked, c.completed, !matches!(c.outcome, CancelOutcome::Unknown(_))));
        let q = o.queries.iter().map(|q| (q.invoked, q.completed, !matches!(q.outcome, QueryOutcome::Unknown(_))));
        s.chain(c).chain(q).collect()
    }
}

/// The longest time no operation succeeded while clients kept trying: the
/// worst unavailability a fault caused, as clients saw it. Measured from the
/// end of one success (or the start of the first call) to the end of the next.
pub fn worst_gap(spans: &[(Instant, Instant, bool)]) -> std::time::Duration {
    let Some(first) = spans.iter().map(|s| s.0).min() else { return Default::default() };
    let mut ok: Vec<Instant> = spans.iter().filter(|s| s.2).map(|s| s.1).collect();
    ok.sort();
    let mut worst = std::time::Duration::ZERO;
    let mut last = first;
    for t in ok {
        worst = worst.max(t.saturating_duration_since(last));
        last = t;
    }
    // A tail of failures up to the last attempt counts too.
    if let Some(end) = spans.iter().map(|s| s.1).max() {
        worst = worst.max(end.saturating_duration_since(last));
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A history holds OPS_MAX operations; recording one more stops the
    /// run loudly rather than growing without end.
    #[test]
    fn a_history_holds_at_most_ops_max_operations() {
        let h = History::default();
        let now = Instant::now();
        let cancel = || Cancel { job: 1, invoked: now, completed: now, outcome: CancelOutcome::AlreadyFinished };
        for _ in 0..OPS_MAX {
            h.record_cancel(cancel());
        }
        let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.record_cancel(cancel())));
        let msg = past.expect_err("one past OPS_MAX was recorded");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert_eq!(msg, format!("history is full ({OPS_MAX} operations)"));
    }

    #[test]
    fn the_worst_gap_is_the_longest_stretch_without_a_success() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let spans =
            [(at(0), at(10), true), (at(20), at(2000), false), (at(30), at(2500), true), (at(2600), at(2610), true)];
        assert_eq!(worst_gap(&spans), Duration::from_millis(2490));
        // Failures at the end count up to the last answer.
        let tail = [(at(0), at(10), true), (at(20), at(4010), false)];
        assert_eq!(worst_gap(&tail), Duration::from_millis(4000));
        assert_eq!(worst_gap(&[]), Duration::ZERO);
    }
}
