//! The leader's periodic work as a thin shell around the core's pure
//! `duties::leader_tick`: each tick reads the state (on a blocking thread,
//! under the read lock), and proposes what the tick decided: the scheduling
//! plan as one `ApplySchedule`, jobs past their time limit, and nodes silent
//! for longer than the node-down timeout. Agents learn of started and ended
//! jobs from their next heartbeat (see `api/agent.rs`).
//!
//! A pass takes tens of milliseconds with a long queue (about 1 s for a
//! million pending jobs), so passes are spaced to keep applies flowing, and
//! the pass's pending reasons are kept for `List` to show without another pass.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gangway_core::duties::{leader_tick, Heard, HeardBook, LeaderMemory, TaskReport};
use gangway_core::{Command, JobId, Outcome};

use crate::replica::Replica;

/// The leader ticks when a job is submitted or ends, and at least this often
/// (time limits, silent nodes, nodes coming back).
const TICK: Duration = Duration::from_millis(200);
/// Shortest gap between ticks: under a stream of submissions, one pass covers
/// everything that arrived meanwhile instead of one pass per submission.
const TICK_MIN_INTERVAL: Duration = Duration::from_millis(5);
/// Idle time between ticks, as a multiple of the last tick's duration: the
/// scheduler holds the state's read lock at most a third of the time, so
/// applies (which need the write lock) keep flowing under a huge queue.
const PASS_SPACING_FACTOR: u32 = 2;

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

    pub fn age_ms(&self, node: &str) -> Option<u64> {
        self.last_ms(node).map(|t| self.now_ms().saturating_sub(t))
    }
}

pub async fn run(replica: Arc<Replica>) {
    let leader_since = replica.heartbeats.now_ms();
    *replica.heartbeats.leading.lock().expect("leading lock") = Some((replica.node.status().term, leader_since));
    let mut events = replica.node.state().subscribe();
    let mut last_pass = Duration::ZERO;
    let memory = Arc::new(Mutex::new(LeaderMemory::default()));
    loop {
        tokio::time::sleep(TICK_MIN_INTERVAL.max(last_pass * PASS_SPACING_FACTOR)).await;
        // Wait for a change (or the tick); a lagged receiver just means "tick now".
        tokio::select! {
            _ = tokio::time::sleep(TICK) => {}
            _ = events.recv() => {}
        }
        while events.try_recv().is_ok() {}
        let now = crate::now_ms();
        let r = replica.clone();
        let memory = memory.clone();
        let started = Instant::now();
        let tick = tokio::task::spawn_blocking(move || {
            let last = |node: &str| r.heartbeats.last_ms(node);
            let runs = |node: &str, job: JobId| r.heartbeats.runs(node, job);
            let (index, state) = r.node.state().read_with_index();
            let heard = Heard {
                index,
                now: r.heartbeats.now_ms(),
                leader_since,
                down_timeout_ms: r.timing.node_down_timeout_ms,
                last: &last,
                runs: &runs,
            };
            let mut memory = memory.lock().expect("leader memory lock");
            leader_tick(&state, now, Some(&heard), &mut memory, gangway_core::sched::Policy::Easy)
        })
        .await;
        last_pass = started.elapsed();
        metrics::histogram!("gangway_schedule_pass_seconds").record(last_pass.as_secs_f64());
        let Ok(mut tick) = tick else {
            tracing::error!("a leader tick panicked");
            continue;
        };
        replica.set_pending_reasons(std::mem::take(&mut tick.reasons));
        for cmd in tick.commands {
            if !propose(&replica, cmd, now).await {
                break;
            }
        }
    }
}

/// Proposes one of the tick's commands; false when it could not be committed
/// (the rest wait for the next tick).
async fn propose(replica: &Replica, cmd: Command, now: u64) -> bool {
    match &cmd {
        Command::SetNodeState { name, reason, .. } => tracing::warn!(node = %name, %reason, "marking node down"),
        Command::ApplySchedule { placements, .. } if !placements.is_empty() => {
            tracing::debug!(planned = placements.len(), "committing a plan")
        }
        _ => {}
    }
    let what = cmd.name();
    let applied = match replica.proposer.propose(cmd).await {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(command = what, error = %e, "could not commit the leader's decision");
            return false;
        }
    };
    match applied.outcome {
        Outcome::ScheduleApplied { started, rejected, preempted } => {
            metrics::counter!("gangway_jobs_started_total").increment(started.len() as u64);
            let state = replica.node.state().read();
            for id in &started {
                if let Some(j) = state.jobs.get(id) {
                    let wait_ms = now.saturating_sub(j.submit_time_ms);
                    metrics::histogram!("gangway_job_queue_wait_seconds").record(wait_ms as f64 / 1000.0);
                }
            }
            metrics::counter!("gangway_jobs_preempted_total").increment(preempted.len() as u64);
            if !rejected.is_empty() {
                tracing::debug!(rejected = rejected.len(), "part of a plan was stale");
            }
        }
        Outcome::NodeStateSet { .. } => metrics::counter!("gangway_nodes_marked_down_total").increment(1),
        _ => {}
    }
    true
}
