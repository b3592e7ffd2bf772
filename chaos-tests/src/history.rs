//! The record of what clients did and saw: every submit as invoke → ok / fail /
//! unknown (the call timed out or the connection broke: it may or may not have
//! taken effect), with times. Checkers read it after the run.

use std::sync::Mutex;
use std::time::Instant;

/// Operations one run records: far above what a smoke run issues.
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

#[derive(Default)]
pub struct History {
    submits: Mutex<Vec<Submit>>,
}

impl History {
    pub fn record(&self, s: Submit) {
        let mut v = self.submits.lock().expect("history lock");
        assert!(v.len() < OPS_MAX, "history is full ({OPS_MAX} operations)");
        v.push(s);
    }

    pub fn submits(&self) -> Vec<Submit> {
        self.submits.lock().expect("history lock").clone()
    }
}
