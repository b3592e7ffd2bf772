//! srun's steps in the replicated history (data format 10): a step of a
//! running attempt starts and ends, and accounting shows it as `ID.N`. A job
//! that ends closes the steps still running (CANCELLED, as Slurm does); a
//! requeue starts the next attempt with none.

use super::{Applied, JobEvent, Outcome, RefusalKind, State};
use crate::limits::{STEPS_PER_JOB_MAX, STEP_NAME_BYTES_MAX, STEP_NODES_LISTED_MAX, STEP_TASKS_PER_NODE_MAX};
use crate::model::{Job, JobId, JobState, Step};

impl State {
    /// The job whose running `attempt` a step command names, or the refusal
    /// (before format 10, a job that does not exist or runs no such attempt).
    fn step_job(&mut self, job_id: JobId, attempt: u32) -> Result<&mut Job, Applied> {
        if self.format < crate::format::SUSPEND_FORMAT {
            return Err(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("steps: recording them needs data format {}", crate::format::SUSPEND_FORMAT),
            ));
        }
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Err(Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist")));
        };
        if job.state != JobState::Running || job.attempt != attempt {
            return Err(Applied::refused(RefusalKind::Stale, format!("job {job_id} attempt {attempt} is not running")));
        }
        Ok(job)
    }

    pub(super) fn apply_step_started(
        &mut self,
        index: u64,
        job_id: JobId,
        attempt: u32,
        name: &str,
        nodes: &[String],
        tasks: u32,
    ) -> Applied {
        let now = self.clock_ms;
        let job = match self.step_job(job_id, attempt) {
            Ok(job) => job,
            Err(refused) => return refused,
        };
        if job.is_suspended() {
            return Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("job {job_id} is suspended: its steps wait for its resume"),
            );
        }
        if name.len() > STEP_NAME_BYTES_MAX || name.chars().any(char::is_control) {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                format!("name: at most {STEP_NAME_BYTES_MAX} bytes, without control characters"),
            );
        }
        let held: Vec<&str> = job.allocation.iter().flat_map(|a| a.nodes.iter().map(|n| n.node.as_str())).collect();
        if nodes.len() > STEP_NODES_LISTED_MAX {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                format!("nodes: at most {STEP_NODES_LISTED_MAX} listed (none: every node of the job)"),
            );
        }
        if let Some(n) = nodes.iter().find(|n| !held.contains(&n.as_str())) {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                format!("nodes: {n} is not one of job {job_id}'s nodes"),
            );
        }
        if nodes.iter().enumerate().any(|(i, n)| nodes.iter().take(i).any(|m| m == n)) {
            return Applied::refused(RefusalKind::InvalidArgument, "nodes: a node is listed twice");
        }
        let node_count = if nodes.is_empty() { held.len() } else { nodes.len() };
        let tasks_max = u32::try_from(node_count).unwrap_or(u32::MAX).saturating_mul(STEP_TASKS_PER_NODE_MAX);
        if tasks == 0 || tasks > tasks_max {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                format!("tasks: between 1 and {STEP_TASKS_PER_NODE_MAX} per node ({tasks_max} here)"),
            );
        }
        let id = job.next_step_id;
        let Some(next) = id.checked_add(1) else {
            return Applied::refused(RefusalKind::ResourceExhausted, format!("job {job_id} ran {id} steps"));
        };
        // The oldest step that ended makes way for the new one; if none has
        // (sruns that died without saying so), the oldest of all does.
        if job.steps.len() >= STEPS_PER_JOB_MAX {
            let oldest = job.steps.iter().position(|s| s.end_ms.is_some()).unwrap_or(0);
            job.steps.remove(oldest);
        }
        job.next_step_id = next;
        job.steps.push(Step {
            id,
            name: name.to_string(),
            // Every node of the job: listed as none.
            nodes: if node_count == held.len() { Vec::new() } else { nodes.to_vec() },
            tasks,
            start_ms: now,
            end_ms: None,
            state: JobState::Running,
            exit_code: None,
            signal: None,
        });
        let event = JobEvent {
            index,
            job_id,
            state: JobState::Running,
            attempt,
            reason: format!("step {id} ({name}) started"),
            suspended: None,
            step: Some((id, JobState::Running)),
            usage: false,
        };
        Applied { outcome: Outcome::StepStarted { job_id, step_id: id }, events: vec![event] }
    }

    pub(super) fn apply_step_ended(
        &mut self,
        index: u64,
        job_id: JobId,
        attempt: u32,
        step_id: u32,
        exit_code: Option<i32>,
        signal: Option<i32>,
    ) -> Applied {
        let now = self.clock_ms;
        let job = match self.step_job(job_id, attempt) {
            Ok(job) => job,
            Err(refused) => return refused,
        };
        let Some(step) = job.steps.iter_mut().find(|s| s.id == step_id) else {
            return Applied::refused(RefusalKind::NotFound, format!("job {job_id} has no step {step_id}"));
        };
        if step.end_ms.is_some() {
            return Applied::refused(RefusalKind::Stale, format!("step {job_id}.{step_id} has ended"));
        }
        let state = if exit_code == Some(0) && signal.is_none() { JobState::Completed } else { JobState::Failed };
        step.end_ms = Some(now);
        step.state = state;
        step.exit_code = exit_code;
        step.signal = signal;
        let event = JobEvent {
            index,
            job_id,
            state: JobState::Running,
            attempt,
            reason: format!("step {step_id} ({}) ended", step.name),
            suspended: None,
            step: Some((step_id, state)),
            usage: false,
        };
        Applied { outcome: Outcome::StepEnded { job_id, step_id }, events: vec![event] }
    }
}
