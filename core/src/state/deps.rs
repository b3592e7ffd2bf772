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

use std::collections::BTreeMap;

use super::submit::DepStatus;
use super::{JobEvent, State};
use crate::model::{HoldKind, JobId, JobState};
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
        for id in d.job_id..d.job_id.saturating_add(count) {
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
    /// apply; returns the events of jobs cancelled for unmet dependencies.
    pub(super) fn settle_dependents(&mut self, index: u64) -> Vec<JobEvent> {
        let mut events = Vec::new();
        // Terminates: a trigger is only added when a job starts or finishes,
        // and settling can only finish pending jobs (each at most once).
        while let Some(trigger) = self.dep_triggers.pop_first() {
            let mut keys = vec![trigger];
            if let Some(head) = self.jobs.get(&trigger).and_then(|j| j.array).map(|a| a.array_job_id) {
                if head != trigger {
                    keys.push(head);
                }
            }
            for key in keys {
                let waiting: Vec<JobId> =
                    self.dependents.get(&key).map(|s| s.iter().copied().collect()).unwrap_or_default();
                // Every waiter of an array asks about the same array: look once.
                let mut memo: BTreeMap<Dependency, DepStatus> = BTreeMap::new();
                for dependent in waiting {
                    if let Some(ev) = self.settle_one(index, dependent, &mut memo) {
                        events.push(ev);
                        memo.clear();
                    }
                }
            }
        }
        events
    }

    /// Drops a pending job's met dependencies; cancels it, or holds it, if one
    /// can never be met (a held job forgets that dependency: releasing it runs it).
    /// A would-be job's dependencies as `apply` would leave them right after
    /// the submission: those already satisfied dropped (never-met ones were
    /// refused by `prepare_submission`).
    pub fn settle_hypothetical(&self, job: &mut crate::model::Job) {
        job.deps_pending.retain(|d| self.dependency_status(d) != DepStatus::Satisfied);
    }

    fn settle_one(
        &mut self,
        index: u64,
        job_id: JobId,
        memo: &mut BTreeMap<Dependency, DepStatus>,
    ) -> Option<JobEvent> {
        let job = self.jobs.get(&job_id)?;
        if job.state != JobState::Pending {
            return None;
        }
        let mut never = None;
        let mut still = Vec::new();
        let mut dropped = Vec::new();
        for d in &job.deps_pending {
            let status = match memo.get(d) {
                Some(s) => *s,
                None => {
                    let s = self.dependency_status(d);
                    memo.insert(d.clone(), s);
                    s
                }
            };
            match status {
                DepStatus::Satisfied => dropped.push(d.job_id),
                DepStatus::Waiting => still.push(d.clone()),
                DepStatus::Never => {
                    never.get_or_insert_with(|| d.clone());
                    dropped.push(d.job_id);
                }
            }
        }
        if dropped.is_empty() {
            return None;
        }
        let kill = job.spec.kill_on_invalid_dep;
        for m in dropped {
            if still.iter().any(|d| d.job_id == m) {
                continue;
            }
            if let Some(set) = self.dependents.get_mut(&m) {
                set.remove(&job_id);
                if set.is_empty() {
                    self.dependents.remove(&m);
                }
            }
        }
        let job = self.jobs.get_mut(&job_id)?;
        job.deps_pending = still;
        let d = never?;
        let why = format!("DependencyNeverSatisfied: {}:{} ended {}", d.kind.as_str(), d.job_id, {
            self.jobs.get(&d.job_id).map_or("", |t| t.state.as_str())
        });
        if kill {
            self.finish_job(index, job_id, JobState::Cancelled, None, why)
        } else {
            let job = self.jobs.get_mut(&job_id)?;
            job.held = Some(HoldKind::DependencyNeverSatisfied);
            job.reason = why;
            None
        }
    }

    /// Settles freshly submitted jobs (dependencies already met or impossible).
    pub(super) fn settle_new(&mut self, index: u64, ids: &[JobId]) -> Vec<JobEvent> {
        let mut memo = BTreeMap::new();
        ids.iter().filter_map(|id| self.settle_one(index, *id, &mut memo)).collect()
    }

    /// Whether an array (by its first job id) still has unfinished elements:
    /// its first job then stays in the state, as whole-array dependencies are
    /// filed under it.
    pub(super) fn array_unfinished(&self, head: JobId) -> bool {
        let Some(a) = self.jobs.get(&head).and_then(|j| j.array).filter(|a| a.array_job_id == head) else {
            return false;
        };
        (head.saturating_add(1)..head.saturating_add(u64::from(a.count)))
            .any(|id| self.jobs.get(&id).is_some_and(|j| !j.state.is_finished()))
    }

    /// Removes a finished job from the dependents index (as a waiter).
    pub(super) fn forget_dependencies(&mut self, job_id: JobId) {
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        let deps: Vec<JobId> = std::mem::take(&mut job.deps_pending).into_iter().map(|d| d.job_id).collect();
        for key in deps {
            if let Some(set) = self.dependents.get_mut(&key) {
                set.remove(&job_id);
                if set.is_empty() {
                    self.dependents.remove(&key);
                }
            }
        }
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
