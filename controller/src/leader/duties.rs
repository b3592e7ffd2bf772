//! The leader's periodic work as a thin shell around the core's pure
//! `duties::leader_tick`: each tick brings the leader's own copy of the state
//! up to date (`SharedState::refresh`: the commands applied since) and passes
//! over it on a blocking thread, holding no lock, then proposes what the tick
//! decided: the scheduling
//! plan as one `ApplySchedule`, jobs past their time limit, and nodes silent
//! for longer than the node-down timeout. Agents learn of started and ended
//! jobs from their next heartbeat (see `api/agent.rs`).
//!
//! A pass takes tens of milliseconds with a long queue (about 1 s for a
//! million pending jobs), so passes are spaced to keep applies flowing, and
//! the pass's pending reasons are kept for `List` to show without another pass.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gangway_core::duties::{leader_tick, Heard, LeaderMemory};
use gangway_core::{Command, JobId, Outcome};

use gangway_raft_store::StateCopy;

use crate::shared::Replica;

/// The leader ticks when a job is submitted or ends, and at least this often
/// (time limits, silent nodes, nodes coming back).
const TICK: Duration = Duration::from_millis(200);
/// Shortest gap between ticks: under a stream of submissions, one pass covers
/// everything that arrived meanwhile instead of one pass per submission.
const TICK_MIN_INTERVAL: Duration = Duration::from_millis(5);
/// Idle time between ticks, as a multiple of the last tick's duration: the
/// scheduler takes at most a third of a core under a huge queue, and the rest
/// of the replica (heartbeats, apply, the API) keeps the others.
const PASS_SPACING_FACTOR: u32 = 2;

/// Ends the copy's record of applied commands when the duties end (this
/// replica stopped leading): a follower keeps no copy. (A newer leadership's
/// copy keeps its own record.)
struct CopyRelease(Arc<Replica>, Arc<Mutex<Option<StateCopy>>>);

impl Drop for CopyRelease {
    fn drop(&mut self) {
        let copy = self.1.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(c) = copy.as_ref() {
            self.0.node.state().end_copy(c);
        }
    }
}

/// The guard of what a tick keeps between ticks. A tick that panicked may
/// have left it half-changed: then it starts over from `fresh` (a copy taken
/// anew, a memory that knows nothing), never from what the panic left.
fn kept<T>(m: &Mutex<T>, fresh: impl FnOnce() -> T) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => {
            tracing::error!("a leader tick panicked earlier: starting its state over");
            m.clear_poison();
            let mut g = poisoned.into_inner();
            *g = fresh();
            g
        }
    }
}

pub async fn run(replica: Arc<Replica>) {
    let leader_since = replica.heartbeats.now_ms();
    replica.heartbeats.started_leading(replica.node.status().term, leader_since);
    let mut events = replica.node.state().subscribe();
    let mut last_pass = Duration::ZERO;
    let memory = Arc::new(Mutex::new(LeaderMemory::default()));
    let power = super::power::PowerRunner::start(replica.clone());
    // Taken on the first tick's blocking thread (a clone of the whole state).
    let copy: Arc<Mutex<Option<StateCopy>>> = Arc::new(Mutex::new(None));
    let _release = CopyRelease(replica.clone(), copy.clone());
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
        let copy = copy.clone();
        let started = Instant::now();
        let tick = tokio::task::spawn_blocking(move || {
            let last = |node: &str| r.heartbeats.last_ms(node);
            let runs = |node: &str, job: JobId| r.heartbeats.runs(node, job);
            let mut copy = kept(&copy, || None);
            let copy = match copy.as_mut() {
                Some(c) => {
                    r.node.state().refresh(c);
                    c
                }
                None => copy.insert(r.node.state().copy()),
            };
            metrics::gauge!("gangway_scheduler_state_clones").set(copy.clones() as f64);
            let (index, state) = (copy.index(), copy.state());
            let heard = Heard {
                index,
                now: r.heartbeats.now_ms(),
                leader_since,
                down_timeout_ms: r.timing.node_down_timeout_ms,
                last: &last,
                runs: &runs,
            };
            let mut memory = kept(&memory, LeaderMemory::default);
            leader_tick(state, now, Some(&heard), &mut memory, gangway_core::sched::Policy::Easy)
        })
        .await;
        last_pass = started.elapsed();
        metrics::histogram!("gangway_schedule_pass_seconds").record(last_pass.as_secs_f64());
        let Ok(mut tick) = tick else {
            tracing::error!("a leader tick panicked");
            continue;
        };
        replica.set_pending_reasons(std::mem::take(&mut tick.reasons));
        power.request(true, std::mem::take(&mut tick.power_up));
        power.request(false, std::mem::take(&mut tick.power_down));
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
