//! QOS preempt mode SUSPEND (data format 12): a victim is suspended for its
//! preemptor and *yields* its CPUs and GPUs, keeping its memory (its stopped
//! processes still hold it, as Slurm keeps a suspended job's memory),
//! licenses and quota use, its allocation record and its place in its
//! nodes' job lists. `apply` resumes it, taking its CPUs and GPUs back, as
//! soon as they are all free again: after whichever command freed them.
//!
//! Invariants (checked by `State::check_invariants`): a yielded job is
//! running and suspended; its CPUs are not in its nodes' `cpus_alloc` and
//! no GPU names it as holder; `State::yielded` lists exactly these jobs.
//!
//! Related code: `admin.rs` evicts victims; `sched::view` keeps a yielded
//! job's CPUs and GPUs out of what the scheduler sees free, so nothing else
//! is planned onto them.

use super::{JobEvent, State};
use crate::model::{GpuHealth, JobId, JobState, NodeState, StopCause};

impl State {
    /// Suspends running `job_id` for `for_job`, giving up its CPUs and GPUs.
    /// None, changing nothing, unless it is running, allocated and not
    /// suspended.
    pub(super) fn suspend_for(&mut self, index: u64, job_id: JobId, for_job: JobId) -> Option<JobEvent> {
        let now = self.clock_ms;
        let job = self.jobs.get_mut(&job_id).filter(|j| j.state == JobState::Running && !j.is_suspended())?;
        let alloc = job.allocation.clone()?;
        job.suspended_at_ms = Some(now);
        job.preempted_by = Some(for_job);
        job.preempted = job.preempted.saturating_add(1);
        job.reason = StopCause::Preempted { by: for_job }.describe(true);
        if self.format >= crate::format::STOP_CAUSE_FORMAT {
            job.stop_cause = Some(StopCause::Preempted { by: for_job });
        }
        let attempt = job.attempt;
        let reason = job.reason.clone();
        // As in `release`: saturating on a state `check_invariants` keeps consistent.
        for na in &alloc.nodes {
            let Some(node) = self.nodes.get_mut(&na.node) else { continue };
            node.cpus_alloc = node.cpus_alloc.saturating_sub(na.cpus);
            for &g in &na.gpus {
                let Some(gpu) = node.gpus.get_mut(g as usize) else { continue };
                if gpu.allocated_to == Some(job_id) {
                    gpu.allocated_to = None;
                }
            }
        }
        self.yielded.insert(job_id);
        Some(JobEvent {
            index,
            job_id,
            state: JobState::Running,
            attempt,
            reason,
            suspended: Some(true),
            step: None,
            usage: false,
        })
    }

    /// Resumes every yielded job whose CPUs and GPUs are all free again, in
    /// job id order (the oldest victims first).
    pub(super) fn resume_yielded(&mut self, index: u64) -> Vec<JobEvent> {
        let ready: Vec<JobId> = self.yielded.iter().copied().filter(|id| self.can_take_back(*id)).collect();
        let mut events = Vec::new();
        for job_id in ready {
            // An earlier resume of this apply may have taken shared space.
            if !self.can_take_back(job_id) {
                continue;
            }
            let now = self.clock_ms;
            // can_take_back found it, allocated.
            let Some(job) = self.jobs.get_mut(&job_id) else { continue };
            let Some(alloc) = job.allocation.clone() else { continue };
            job.suspended_ms = job.suspended_total_ms(now);
            job.suspended_at_ms = None;
            job.preempted_by = None;
            job.reason = String::new();
            job.stop_cause = None;
            let attempt = job.attempt;
            for na in &alloc.nodes {
                let Some(node) = self.nodes.get_mut(&na.node) else { continue };
                node.cpus_alloc = node.cpus_alloc.saturating_add(na.cpus);
                for &g in &na.gpus {
                    let Some(gpu) = node.gpus.get_mut(g as usize) else { continue };
                    gpu.allocated_to = Some(job_id);
                }
            }
            self.yielded.remove(&job_id);
            events.push(JobEvent {
                index,
                job_id,
                state: JobState::Running,
                attempt,
                reason: "resumed: its CPUs and GPUs are free again".to_string(),
                suspended: Some(false),
                step: None,
                usage: false,
            });
        }
        events
    }

    /// Whether every node of yielded `job_id` is not down and has its CPUs
    /// free and its GPUs free and healthy.
    fn can_take_back(&self, job_id: JobId) -> bool {
        let Some(alloc) = self.jobs.get(&job_id).and_then(|j| j.allocation.as_ref()) else { return false };
        alloc.nodes.iter().all(|na| {
            self.nodes.get(&na.node).is_some_and(|node| {
                node.state != NodeState::Down
                    && node.cpus.saturating_sub(node.cpus_alloc) >= na.cpus
                    && na.gpus.iter().all(|&g| {
                        node.gpus
                            .get(g as usize)
                            .is_some_and(|gpu| gpu.allocated_to.is_none() && gpu.health == GpuHealth::Healthy)
                    })
            })
        })
    }

    /// The yielded jobs whose allocation names GPU `gpu` of `node` (a GPU
    /// that fails while they wait fails them as it would had they held it).
    pub(super) fn yielded_on_gpu(&self, node: &str, gpu: u32) -> Vec<JobId> {
        self.yielded
            .iter()
            .copied()
            .filter(|id| {
                self.jobs
                    .get(id)
                    .iter()
                    .flat_map(|j| &j.allocation)
                    .flat_map(|a| &a.nodes)
                    .any(|na| na.node == node && na.gpus.contains(&gpu))
            })
            .collect()
    }
}
