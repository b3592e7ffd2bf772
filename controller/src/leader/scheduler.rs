//! The leader's scheduling loop: plans with the core's pure `sched::plan`
//! (priority order, EASY backfilling, preemption), commits each plan as one
//! `ApplySchedule`, and ends jobs that ran past their time limit. Agents learn
//! of started and ended jobs from their next heartbeat (see `api/agent.rs`).
//!
//! A pass reads the state under its read lock on a blocking thread; with a
//! long queue it takes tens of milliseconds (about 1 s for a million pending
//! jobs), so passes are spaced to keep applies flowing, and the pass's pending
//! reasons are kept for `List` to show without another pass.

use std::sync::Arc;
use std::time::Duration;

use gangway_core::{Command, JobState, Outcome};

use crate::replica::Replica;

/// The leader plans when a job is submitted or ends, and at least this often
/// (time limits, nodes coming back); each pass is bounded by the core's limits.
const SCHEDULE_TICK: Duration = Duration::from_millis(200);
/// Shortest gap between passes: under a stream of submissions, one pass covers
/// everything that arrived meanwhile instead of one pass per submission.
const SCHEDULE_MIN_INTERVAL: Duration = Duration::from_millis(5);
/// Jobs ended for their time limit per pass (bounds one pass's log entries).
const TIMEOUTS_PER_PASS_MAX: usize = 256;
/// Idle time between passes, as a multiple of the last pass's duration: the
/// scheduler holds the state's read lock at most a third of the time, so
/// applies (which need the write lock) keep flowing under a huge queue.
const PASS_SPACING_FACTOR: u32 = 2;

pub async fn run(replica: Arc<Replica>) {
    let mut events = replica.node.state().subscribe();
    let mut last_pass = Duration::ZERO;
    loop {
        tokio::time::sleep(SCHEDULE_MIN_INTERVAL.max(last_pass * PASS_SPACING_FACTOR)).await;
        // Wait for a change (or the tick); a lagged receiver just means "plan now".
        tokio::select! {
            _ = tokio::time::sleep(SCHEDULE_TICK) => {}
            _ = events.recv() => {}
        }
        while events.try_recv().is_ok() {}
        let now = crate::now_ms();
        let shared = replica.node.state().clone();
        let started = std::time::Instant::now();
        let pass = tokio::task::spawn_blocking(move || {
            let state = shared.read();
            let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, now);
            let plan = gangway_core::sched::plan(&state, &opts);
            let expired: Vec<(u64, u32, u64)> = state
                .running
                .iter()
                .filter_map(|id| state.jobs.get(id))
                .filter(|j| j.start_time_ms.is_some_and(|s| s + j.spec.time_limit_s * 1000 <= now))
                .take(TIMEOUTS_PER_PASS_MAX)
                .map(|j| (j.id, j.attempt, j.spec.time_limit_s))
                .collect();
            (plan, expired)
        })
        .await;
        last_pass = started.elapsed();
        metrics::histogram!("gangway_schedule_pass_seconds").record(last_pass.as_secs_f64());
        let Ok((mut plan, expired)) = pass else {
            tracing::error!("a scheduling pass panicked");
            continue;
        };
        replica.set_pending_reasons(std::mem::take(&mut plan.reasons));
        if !plan.placements.is_empty() || !plan.preemptions.is_empty() {
            let n = plan.placements.len();
            let cmd =
                Command::ApplySchedule { preemptions: plan.preemptions, placements: plan.placements, now_ms: now };
            match replica.proposer.propose(cmd).await {
                Ok(applied) => {
                    if let Outcome::ScheduleApplied { started, rejected, preempted } = applied.outcome {
                        metrics::counter!("gangway_jobs_started_total").increment(started.len() as u64);
                        let state = replica.node.state().read();
                        for id in &started {
                            if let Some(j) = state.jobs.get(id) {
                                let wait_ms = now.saturating_sub(j.submit_time_ms);
                                metrics::histogram!("gangway_job_queue_wait_seconds").record(wait_ms as f64 / 1000.0);
                            }
                        }
                        drop(state);
                        metrics::counter!("gangway_jobs_preempted_total").increment(preempted.len() as u64);
                        if !rejected.is_empty() {
                            tracing::debug!(planned = n, rejected = rejected.len(), "part of a plan was stale");
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not commit a plan"),
            }
        }
        for (job_id, attempt, limit_s) in expired {
            let cmd = Command::JobFinished {
                job_id,
                attempt,
                state: JobState::TimedOut,
                exit_code: None,
                reason: format!("time limit of {} reached", crate::format_duration_s(limit_s)),
                now_ms: now,
            };
            if let Err(e) = replica.proposer.propose(cmd).await {
                tracing::warn!(job_id, error = %e, "could not end a job at its time limit");
                break;
            }
        }
    }
}
