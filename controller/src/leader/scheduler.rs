//! The leader's scheduling loop: plans placements with the core's pure
//! `sched::schedule` and commits them as one `ApplyPlan`, and ends jobs that ran
//! past their time limit. Agents learn of started and ended jobs from their next
//! heartbeat (see `api/agent.rs`).

use std::sync::Arc;
use std::time::Duration;

use gangway_core::{Command, JobState, Outcome};

use crate::replica::Replica;

/// How often the leader plans. Short enough that a submitted job starts within a
/// fraction of a second on an idle cluster; each pass is bounded by the core's
/// per-pass limits.
const SCHEDULE_TICK: Duration = Duration::from_millis(200);
/// Jobs ended for their time limit per pass (bounds one pass's log entries).
const TIMEOUTS_PER_PASS_MAX: usize = 256;

pub async fn run(replica: Arc<Replica>) {
    loop {
        tokio::time::sleep(SCHEDULE_TICK).await;
        let now = crate::now_ms();
        let (plan, expired) = {
            let state = replica.node.state().read();
            let plan = gangway_core::sched::schedule(&state);
            let expired: Vec<(u64, u32, u64)> = state
                .running
                .iter()
                .filter_map(|id| state.jobs.get(id))
                .filter(|j| j.start_time_ms.is_some_and(|s| s + j.spec.time_limit_s * 1000 <= now))
                .take(TIMEOUTS_PER_PASS_MAX)
                .map(|j| (j.id, j.attempt, j.spec.time_limit_s))
                .collect();
            (plan, expired)
        };
        if !plan.is_empty() {
            let n = plan.len();
            match replica.proposer.propose(Command::ApplyPlan { placements: plan, now_ms: now }).await {
                Ok(applied) => {
                    if let Outcome::PlanApplied { started, rejected } = applied.outcome {
                        metrics::counter!("gangway_jobs_started_total").increment(started.len() as u64);
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
