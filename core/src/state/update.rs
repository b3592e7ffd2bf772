//! Changes to one job after its submit: hold, release, priority, nice,
//! requeue, time limit, suspend, resume, signal (`JobChange`), and its
//! checkpoints.
//!
//! Related code: `yielding.rs` (suspension for a preemptor), `steps.rs`.

use super::{Applied, JobEvent, Outcome, RefusalKind, State};
use crate::command::JobChange;
use crate::limits::*;
use crate::model::{HoldKind, Job, JobId, JobSignal, JobState, SignalTarget, StopCause};

/// The refusal of a change to a job that apply found and then lost (it
/// refuses rather than panics if that ever changed).
fn gone(job_id: JobId) -> Applied {
    Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist"))
}

/// The refusal of a change that needs the job in `want` state.
fn not_in(job: &Job, want: &str) -> Applied {
    Applied::refused(RefusalKind::FailedPrecondition, format!("job {} is {}, not {want}", job.id, job.state.as_str()))
}

/// What a change did (its events) or why it was refused.
type Changed = Result<Vec<JobEvent>, Applied>;

impl State {
    /// One change to a job its owner (or an operator: `admin`) may make,
    /// each checked by its own method before it changes anything.
    pub(super) fn apply_update_job(
        &mut self,
        index: u64,
        job_id: JobId,
        change: &JobChange,
        identity: &str,
    ) -> Applied {
        // Operators hold the admin's powers over jobs.
        let admin = self.is_operator(identity);
        if let Err(refused) = self.changeable_job(job_id, identity, "change") {
            return refused;
        }
        let changed = match change {
            JobChange::Hold { admin: as_admin } => self.change_hold(job_id, *as_admin, admin),
            JobChange::Release => self.change_release(job_id, admin),
            JobChange::SetPriority(p) => self.change_priority(job_id, *p, admin),
            JobChange::SetNice(n) => self.change_nice(job_id, *n, admin),
            JobChange::Requeue { hold } => self.change_requeue(index, job_id, *hold, identity),
            JobChange::SetTimeLimit(t) => self.change_time_limit(job_id, *t, admin),
            JobChange::Signal { signal, target } => self.change_signal(job_id, *signal, *target),
            JobChange::Suspend | JobChange::Resume => {
                self.change_suspension(index, job_id, *change == JobChange::Suspend, admin, identity)
            }
        };
        match changed {
            Ok(events) => Applied { outcome: Outcome::JobUpdated { job_id }, events },
            Err(refused) => refused,
        }
    }

    fn change_hold(&mut self, job_id: JobId, as_admin: bool, admin: bool) -> Changed {
        let job = self.jobs.get(&job_id).ok_or_else(|| gone(job_id))?;
        if job.state != JobState::Pending {
            return Err(not_in(job, "pending"));
        }
        if as_admin && !admin {
            return Err(Applied::refused(
                RefusalKind::PermissionDenied,
                "permission: admin holds need an operator or admin",
            ));
        }
        if job.held == Some(HoldKind::Admin) && !as_admin {
            return Err(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("job {job_id} is already held by an admin"),
            ));
        }
        let hold = if as_admin { HoldKind::Admin } else { HoldKind::User };
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
        job.held = Some(hold);
        job.reason = hold.as_str().to_string();
        Ok(Vec::new())
    }

    fn change_release(&mut self, job_id: JobId, admin: bool) -> Changed {
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
        if job.held.is_none() {
            return Err(Applied::refused(RefusalKind::FailedPrecondition, format!("job {job_id} is not held")));
        }
        if job.held == Some(HoldKind::Admin) && !admin {
            return Err(Applied::refused(
                RefusalKind::PermissionDenied,
                "permission: an admin hold can only be released by an operator or admin",
            ));
        }
        job.held = None;
        job.reason.clear();
        Ok(Vec::new())
    }

    fn change_priority(&mut self, job_id: JobId, priority: Option<u32>, admin: bool) -> Changed {
        if !admin {
            return Err(Applied::refused(
                RefusalKind::PermissionDenied,
                "permission: only operators and admins set priorities",
            ));
        }
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
        job.priority_override = priority;
        Ok(Vec::new())
    }

    fn change_nice(&mut self, job_id: JobId, nice: i32, admin: bool) -> Changed {
        if nice.unsigned_abs() > NICE_MAX.unsigned_abs() {
            return Err(Applied::refused(RefusalKind::InvalidArgument, format!("nice: must be within ±{NICE_MAX}")));
        }
        if nice < 0 && !admin {
            return Err(Applied::refused(
                RefusalKind::InvalidArgument,
                "nice: only operators and admins may set a negative value",
            ));
        }
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
        job.spec.nice = nice;
        Ok(Vec::new())
    }

    fn change_requeue(&mut self, index: u64, job_id: JobId, hold: bool, identity: &str) -> Changed {
        let job = self.jobs.get(&job_id).ok_or_else(|| gone(job_id))?;
        if job.state != JobState::Running {
            return Err(not_in(job, "running"));
        }
        if job.attempt >= ATTEMPTS_MAX {
            return Err(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("job {job_id} made {ATTEMPTS_MAX} attempts, its limit"),
            ));
        }
        self.note_stop(job_id, StopCause::RequeuedBy { identity: identity.to_string() });
        let events = self.requeue_job(index, job_id, format!("requeued by {identity}")).into_iter().collect();
        if hold {
            let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
            job.held = Some(HoldKind::User);
        }
        Ok(events)
    }

    fn change_time_limit(&mut self, job_id: JobId, limit_s: u64, admin: bool) -> Changed {
        if limit_s == 0 || limit_s > TIME_LIMIT_S_MAX {
            return Err(Applied::refused(
                RefusalKind::InvalidArgument,
                format!("time_limit_s: must be between 1 and {TIME_LIMIT_S_MAX}"),
            ));
        }
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
        if limit_s > job.spec.time_limit_s && !admin {
            return Err(Applied::refused(
                RefusalKind::PermissionDenied,
                "permission: only operators and admins may raise a time limit",
            ));
        }
        job.spec.time_limit_s = limit_s;
        // An explicit limit replaces the one a shortened start kept.
        job.requested_limit_s = 0;
        Ok(Vec::new())
    }

    fn change_signal(&mut self, job_id: JobId, signal: i32, target: SignalTarget) -> Changed {
        if self.format < crate::format::SUSPEND_FORMAT {
            return Err(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("signal: needs data format {}", crate::format::SUSPEND_FORMAT),
            ));
        }
        if !(1..=SIGNAL_SEND_MAX).contains(&signal) {
            return Err(Applied::refused(
                RefusalKind::InvalidArgument,
                format!("signal: must be 1..={SIGNAL_SEND_MAX}, got {signal}"),
            ));
        }
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
        if job.state != JobState::Running {
            return Err(not_in(job, "running"));
        }
        let seq = job.signal.map_or(1, |s| s.seq.saturating_add(1));
        job.signal = Some(JobSignal { seq, signal, target });
        Ok(Vec::new())
    }

    fn change_suspension(&mut self, index: u64, job_id: JobId, suspend: bool, admin: bool, identity: &str) -> Changed {
        let verb = if suspend { "suspend" } else { "resume" };
        if self.format < crate::format::SUSPEND_FORMAT {
            return Err(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("{verb}: needs data format {}", crate::format::SUSPEND_FORMAT),
            ));
        }
        if !admin {
            return Err(Applied::refused(
                RefusalKind::PermissionDenied,
                "permission: only operators and admins suspend and resume jobs",
            ));
        }
        let now = self.clock_ms;
        let job = self.jobs.get_mut(&job_id).ok_or_else(|| gone(job_id))?;
        if job.state != JobState::Running {
            return Err(not_in(job, "running"));
        }
        if suspend == job.is_suspended() {
            let what = if suspend { "already suspended" } else { "not suspended" };
            return Err(Applied::refused(RefusalKind::FailedPrecondition, format!("job {job_id} is {what}")));
        }
        if !suspend && job.is_yielded() {
            return Err(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!(
                    "job {job_id} was suspended by preemption and gave its CPUs and GPUs to another job; \
                     it resumes by itself once they are free again"
                ),
            ));
        }
        if suspend {
            job.suspended_at_ms = Some(now);
        } else {
            job.suspended_ms = job.suspended_total_ms(now);
            job.suspended_at_ms = None;
        }
        let done = if suspend { "suspended" } else { "resumed" };
        Ok(vec![JobEvent {
            index,
            job_id,
            state: JobState::Running,
            attempt: job.attempt,
            reason: format!("{done} by {identity}"),
            suspended: Some(suspend),
            step: None,
            usage: false,
        }])
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
