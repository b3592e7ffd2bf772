//! Changes to one job after its submit: hold, release, priority, nice,
//! requeue, time limit, suspend, resume, signal (`JobChange`), and its
//! checkpoints.
//!
//! Related code: `yielding.rs` (suspension for a preemptor), `steps.rs`.

use super::{Applied, JobEvent, Outcome, RefusalKind, State};
use crate::command::JobChange;
use crate::limits::*;
use crate::model::{HoldKind, JobId, JobState, StopCause};

impl State {
    pub(super) fn apply_update_job(
        &mut self,
        index: u64,
        job_id: JobId,
        change: &JobChange,
        identity: &str,
    ) -> Applied {
        // Operators hold the admin's powers over jobs.
        let admin = self.is_operator(identity);
        let job = match self.changeable_job(job_id, identity, "change") {
            Ok(job) => job,
            Err(refused) => return refused,
        };
        let pending = job.state == JobState::Pending;
        // Found above; apply refuses rather than panics if that ever changed.
        let gone = || Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist"));
        let not_pending = || {
            Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("job {job_id} is {}, not pending", job.state.as_str()),
            )
        };
        let mut events = Vec::new();
        match change {
            JobChange::Hold { admin: as_admin } => {
                if !pending {
                    return not_pending();
                }
                if *as_admin && !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: admin holds need an operator or admin",
                    );
                }
                if job.held == Some(HoldKind::Admin) && !*as_admin {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is already held by an admin"),
                    );
                }
                let hold = if *as_admin { HoldKind::Admin } else { HoldKind::User };
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.held = Some(hold);
                job.reason = hold.as_str().to_string();
            }
            JobChange::Release => {
                if job.held.is_none() {
                    return Applied::refused(RefusalKind::FailedPrecondition, format!("job {job_id} is not held"));
                }
                if job.held == Some(HoldKind::Admin) && !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: an admin hold can only be released by an operator or admin",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.held = None;
                job.reason.clear();
            }
            JobChange::SetPriority(p) => {
                if !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: only operators and admins set priorities",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.priority_override = *p;
            }
            JobChange::SetNice(n) => {
                if n.unsigned_abs() > NICE_MAX.unsigned_abs() {
                    return Applied::refused(RefusalKind::InvalidArgument, format!("nice: must be within ±{NICE_MAX}"));
                }
                if *n < 0 && !admin {
                    return Applied::refused(
                        RefusalKind::InvalidArgument,
                        "nice: only operators and admins may set a negative value",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.spec.nice = *n;
            }
            JobChange::Requeue { hold } => {
                if job.state != JobState::Running {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is {}, not running", job.state.as_str()),
                    );
                }
                if job.attempt >= ATTEMPTS_MAX {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} made {ATTEMPTS_MAX} attempts, its limit"),
                    );
                }
                self.note_stop(job_id, StopCause::RequeuedBy { identity: identity.to_string() });
                events.extend(self.requeue_job(index, job_id, format!("requeued by {identity}")));
                if *hold {
                    let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                    job.held = Some(HoldKind::User);
                }
            }
            JobChange::SetTimeLimit(t) => {
                if *t == 0 || *t > TIME_LIMIT_S_MAX {
                    return Applied::refused(
                        RefusalKind::InvalidArgument,
                        format!("time_limit_s: must be between 1 and {TIME_LIMIT_S_MAX}"),
                    );
                }
                if *t > job.spec.time_limit_s && !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: only operators and admins may raise a time limit",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.spec.time_limit_s = *t;
                // An explicit limit replaces the one a shortened start kept.
                job.requested_limit_s = 0;
            }
            JobChange::Signal { signal, target } => {
                if self.format < crate::format::SUSPEND_FORMAT {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("signal: needs data format {}", crate::format::SUSPEND_FORMAT),
                    );
                }
                if !(1..=crate::limits::SIGNAL_SEND_MAX).contains(signal) {
                    return Applied::refused(
                        RefusalKind::InvalidArgument,
                        format!("signal: must be 1..={}, got {signal}", crate::limits::SIGNAL_SEND_MAX),
                    );
                }
                if job.state != JobState::Running {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is {}, not running", job.state.as_str()),
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                let seq = job.signal.map_or(1, |s| s.seq.saturating_add(1));
                job.signal = Some(crate::model::JobSignal { seq, signal: *signal, target: *target });
            }
            JobChange::Suspend | JobChange::Resume => {
                let suspend = *change == JobChange::Suspend;
                let verb = if suspend { "suspend" } else { "resume" };
                if self.format < crate::format::SUSPEND_FORMAT {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("{verb}: needs data format {}", crate::format::SUSPEND_FORMAT),
                    );
                }
                if !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: only operators and admins suspend and resume jobs",
                    );
                }
                if job.state != JobState::Running {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is {}, not running", job.state.as_str()),
                    );
                }
                if suspend == job.is_suspended() {
                    let what = if suspend { "already suspended" } else { "not suspended" };
                    return Applied::refused(RefusalKind::FailedPrecondition, format!("job {job_id} is {what}"));
                }
                if !suspend && job.is_yielded() {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!(
                            "job {job_id} was suspended by preemption and gave its CPUs and GPUs to another job; \
                             it resumes by itself once they are free again"
                        ),
                    );
                }
                let now = self.clock_ms;
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                if suspend {
                    job.suspended_at_ms = Some(now);
                } else {
                    job.suspended_ms = job.suspended_total_ms(now);
                    job.suspended_at_ms = None;
                }
                let done = if suspend { "suspended" } else { "resumed" };
                events.push(JobEvent {
                    index,
                    job_id,
                    state: JobState::Running,
                    attempt: job.attempt,
                    reason: format!("{done} by {identity}"),
                    suspended: Some(suspend),
                    step: None,
                    usage: false,
                });
            }
        }
        Applied { outcome: Outcome::JobUpdated { job_id }, events }
    }

    pub(super) fn apply_job_checkpointed(&mut self, job_id: JobId, attempt: u32) -> Applied {
        let now = self.clock_ms;
        match self.jobs.get_mut(&job_id) {
            Some(job) if job.state == JobState::Running && job.attempt == attempt => {
                job.last_checkpoint_ms = Some(now);
                Applied { outcome: Outcome::CheckpointRecorded { job_id }, events: Vec::new() }
            }
            Some(_) => Applied::refused(RefusalKind::Stale, format!("job {job_id} attempt {attempt} is not running")),
            None => Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist")),
        }
    }
}
