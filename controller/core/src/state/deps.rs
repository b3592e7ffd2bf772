//! Job dependencies after submit: when a job starts or finishes, the pending
//! jobs that wait on it drop the dependencies now met; one that can never be
//! met fails the job (`kill_on_invalid_dep`) or holds it with reason
//! `DependencyNeverSatisfied`. Failing a job can make its own dependents
//! unsatisfiable, so settling runs as a bounded worklist.
//!
//! ```text
//! apply(cmd) ─► finish_job / apply_plan push the job id to dep_triggers
//!            └► settle_dependents: for each trigger, re-check its dependents
//! ```
//!
//! Related code: `submit.rs` resolves dependencies to job ids at submit.

use super::submit::DepStatus;
use super::{JobEvent, State};
use crate::model::{JobId, JobState};
use crate::spec::{Dependency, DependencyKind};

impl State {
    /// Where one resolved dependency stands. A job that no longer exists was
    /// purged long after finishing, so its dependents were settled then: it
    /// counts as met.
    pub fn dependency_status(&self, d: &Dependency) -> DepStatus {
        let Some(target) = self.jobs.get(&d.job_id) else { return DepStatus::Satisfied };
        let whole_array = d.array_index.is_none() && target.array.is_some_and(|a| a.array_job_id == d.job_id);
        if !whole_array {
            return status_of(d.kind, target.state, target.start_time_ms.is_some() || target.attempt > 0);
        }
        let count = target.array.map_or(1, |a| u64::from(a.count));
        let mut all = DepStatus::Satisfied;
        for id in d.job_id..d.job_id + count {
            let Some(el) = self.jobs.get(&id) else { continue };
            match status_of(d.kind, el.state, el.start_time_ms.is_some() || el.attempt > 0) {
                DepStatus::Never => return DepStatus::Never,
                DepStatus::Waiting => all = DepStatus::Waiting,
                DepStatus::Satisfied => {}
            }
        }
        all
    }

    /// Settles the dependents of every job that started or finished in this
    /// apply; returns the events of jobs failed for unmet dependencies.
    pub(super) fn settle_dependents(&mut self, index: u64) -> Vec<JobEvent> {
        let mut events = Vec::new();
        // Each round either finishes a job (at most once per job) or drains the
        // list: bounded by the number of jobs.
        let mut rounds = self.jobs.len() + 1;
        while let Some(trigger) = self.dep_triggers.pop() {
            rounds = rounds.saturating_sub(1);
            assert!(rounds > 0, "dependency settling did not converge");
            let mut keys = vec![trigger];
            if let Some(a) = self.jobs.get(&trigger).and_then(|j| j.array) {
                keys.push(a.array_job_id);
            }
            for key in keys {
                let waiting: Vec<JobId> =
                    self.dependents.get(&key).map(|s| s.iter().copied().collect()).unwrap_or_default();
                for dependent in waiting {
                    if let Some(ev) = self.settle_one(index, dependent) {
                        events.push(ev);
                    }
                }
            }
        }
        events
    }

    /// Drops a pending job's met dependencies; fails or holds it if one can never be met.
    fn settle_one(&mut self, index: u64, job_id: JobId) -> Option<JobEvent> {
        let job = self.jobs.get(&job_id)?;
        if job.state != JobState::Pending {
            return None;
        }
        let mut never = None;
        let mut still = Vec::new();
        for d in &job.deps_pending {
            match self.dependency_status(d) {
                DepStatus::Satisfied => {}
                DepStatus::Waiting => still.push(d.clone()),
                DepStatus::Never => {
                    never.get_or_insert_with(|| d.clone());
                    still.push(d.clone());
                }
            }
        }
        let kill = job.spec.kill_on_invalid_dep;
        let met: Vec<JobId> =
            job.deps_pending.iter().filter(|d| !still.contains(d)).map(|d| d.job_id).collect::<Vec<_>>();
        for m in met {
            if let Some(set) = self.dependents.get_mut(&m) {
                set.remove(&job_id);
                if set.is_empty() {
                    self.dependents.remove(&m);
                }
            }
        }
        let job = self.jobs.get_mut(&job_id).expect("checked above");
        job.deps_pending = still;
        let d = never?;
        let why = format!("DependencyNeverSatisfied: {}:{} ended {}", d.kind.as_str(), d.job_id, {
            self.jobs.get(&d.job_id).map_or("", |t| t.state.as_str())
        });
        if kill {
            Some(self.finish_job(index, job_id, JobState::Cancelled, None, why))
        } else {
            let job = self.jobs.get_mut(&job_id).expect("checked above");
            job.held = Some("DependencyNeverSatisfied".to_string());
            job.reason = why;
            None
        }
    }

    /// Removes a finished job from the dependents index (as a waiter).
    pub(super) fn forget_dependencies(&mut self, job_id: JobId) {
        let deps: Vec<JobId> = self.jobs[&job_id].deps_pending.iter().map(|d| d.job_id).collect();
        for key in deps {
            if let Some(set) = self.dependents.get_mut(&key) {
                set.remove(&job_id);
                if set.is_empty() {
                    self.dependents.remove(&key);
                }
            }
        }
        self.jobs.get_mut(&job_id).expect("exists").deps_pending.clear();
    }
}

fn status_of(kind: DependencyKind, state: JobState, started: bool) -> DepStatus {
    let finished = state.is_finished();
    let ok = state == JobState::Completed;
    match kind {
        DependencyKind::After if started || finished => DepStatus::Satisfied,
        DependencyKind::AfterAny if finished => DepStatus::Satisfied,
        DependencyKind::AfterOk | DependencyKind::AfterCorr if finished => {
            if ok {
                DepStatus::Satisfied
            } else {
                DepStatus::Never
            }
        }
        DependencyKind::AfterNotOk if finished => {
            if ok {
                DepStatus::Never
            } else {
                DepStatus::Satisfied
            }
        }
        _ => DepStatus::Waiting,
    }
}
