//! A scheduling plan applied: its placements checked against the state
//! (`check_placement`, which the API edge asks too) and started as whole
//! gangs, its preemption victims evicted only for placements that start
//! (from data format 7).
//!
//! Related code: [`crate::sched`] (which makes the plans), `yielding.rs`
//! (victims suspended rather than stopped), `pools.rs` (booting nodes).

use std::collections::{BTreeMap, BTreeSet};

use super::{Applied, Gangs, JobEvent, Outcome, State};
use crate::command::{Placement, Preemption};
use crate::format::PLAN_APPLY_FORMAT;
use crate::limits::*;
use crate::model::*;
use crate::policy::{PreemptMode, Use};
use crate::spec::JobSpec;

impl State {
    /// Applies a plan with its preemptions. From [`PLAN_APPLY_FORMAT`] on, as
    /// Nomad applies a plan: each placement is checked as if its own victims
    /// (the preemptions `for_job` it) had stopped, and only when it is
    /// accepted are they evicted and it started; a refused placement evicts
    /// nobody, a placement that fits without its victims evicts nobody, a
    /// preemption for no placement evicts nobody, and a victim named twice
    /// is evicted once. Placements
    /// apply in the plan's order, each against the state the ones before it
    /// left, as the scheduler planned them. Before that format, every victim
    /// was evicted first and the placements checked after.
    pub(super) fn apply_schedule(
        &mut self,
        index: u64,
        preemptions: &[Preemption],
        placements: &[Placement],
    ) -> Applied {
        if self.format < PLAN_APPLY_FORMAT {
            return self.apply_schedule_evicting_first(index, preemptions, placements);
        }
        let mut preempted = Vec::new();
        let mut started = Vec::new();
        let mut rejected = Vec::new();
        let mut events = Vec::new();
        for p in placements {
            // Each victim once, by the first entry that names its running
            // attempt; victims already gone (finished, requeued) freed their
            // space anyway.
            let mut victims: BTreeMap<JobId, &Preemption> = BTreeMap::new();
            for v in preemptions.iter().filter(|v| v.for_job == p.job_id) {
                // A job suspended already has nothing more to give by
                // suspending (a yielded one gave its CPUs and GPUs already).
                let live = self.jobs.get(&v.job_id).is_some_and(|j| {
                    j.state == JobState::Running
                        && j.attempt == v.attempt
                        && !j.is_yielded()
                        && !(v.mode == PreemptMode::Suspend
                            && (j.is_suspended() || self.format < crate::format::PREEMPT_SUSPEND_FORMAT))
                });
                if live {
                    victims.entry(v.job_id).or_insert(v);
                }
            }
            // A placement that fits without its victims (space freed since
            // the plan) evicts nobody.
            let freed: BTreeMap<JobId, PreemptMode> = if self.check_placement(p).is_ok() {
                BTreeMap::new()
            } else {
                victims.iter().map(|(id, v)| (*id, v.mode)).collect()
            };
            if let Err(why) = self.check_placement_freeing(p, &freed) {
                rejected.push((p.job_id, why));
                continue;
            }
            for (id, v) in victims.iter().filter(|(id, _)| freed.contains_key(id)) {
                if let Some(e) = self.evict(index, v) {
                    events.push(e);
                    preempted.push(*id);
                }
            }
            let plan = self.place_gangs(index, std::slice::from_ref(p));
            events.extend(plan.events);
            // Checked above against the same state less its victims, so
            // `rejected` is empty (the core tests assert it); kept in case it is not.
            started.extend(plan.started);
            rejected.extend(plan.rejected);
        }
        Applied { outcome: Outcome::ScheduleApplied { preempted, started, rejected }, events }
    }

    /// [`State::apply_schedule`] before [`PLAN_APPLY_FORMAT`]: kept so a
    /// replica replaying an older log applies it as it was applied then.
    fn apply_schedule_evicting_first(
        &mut self,
        index: u64,
        preemptions: &[Preemption],
        placements: &[Placement],
    ) -> Applied {
        let mut preempted = Vec::new();
        let mut events = Vec::new();
        for p in preemptions {
            let Some(job) = self.jobs.get(&p.job_id) else { continue };
            if job.state != JobState::Running || job.attempt != p.attempt {
                // Already gone (finished, requeued): its space is free anyway.
                continue;
            }
            if let Some(e) = self.evict(index, p) {
                events.push(e);
                preempted.push(p.job_id);
            }
        }
        let plan = self.place_gangs(index, placements);
        events.extend(plan.events);
        Applied {
            outcome: Outcome::ScheduleApplied { preempted, started: plan.started, rejected: plan.rejected },
            events,
        }
    }

    /// Stops one running preemption victim: requeued (its QOS's mode, while
    /// it has attempts left), suspended yielding its CPUs and GPUs (mode
    /// SUSPEND, from format 12, when it is not suspended already), or
    /// cancelled. None when the attempt the entry names is not running
    /// (total: an entry may name anything).
    fn evict(&mut self, index: u64, p: &Preemption) -> Option<JobEvent> {
        let victim = self
            .jobs
            .get_mut(&p.job_id)
            .filter(|j| j.state == JobState::Running && j.attempt == p.attempt && j.allocation.is_some())?;
        if p.mode == PreemptMode::Suspend {
            if victim.is_suspended() || self.format < crate::format::PREEMPT_SUSPEND_FORMAT {
                return None;
            }
            return self.suspend_for(index, p.job_id, p.for_job);
        }
        let why = StopCause::Preempted { by: p.for_job }.describe(true);
        self.note_stop(p.job_id, StopCause::Preempted { by: p.for_job });
        let victim = self.jobs.get_mut(&p.job_id)?;
        if p.mode == PreemptMode::Requeue && victim.attempt < ATTEMPTS_MAX {
            victim.preempted = victim.preempted.saturating_add(1);
            self.requeue_job(index, p.job_id, format!("requeued: {why}"))
        } else {
            self.finish_job(index, p.job_id, JobState::Cancelled, None, why)
        }
    }

    /// Checks one gang placement against the current state without changing it.
    pub fn check_placement(&self, p: &Placement) -> Result<(), String> {
        self.check_placement_freeing(p, &BTreeMap::new())
    }

    /// As [`State::check_placement`], as if the running jobs in `freed` (the
    /// placement's preemption victims, with their modes) had already
    /// stopped: their CPUs, memory, GPUs, licenses and quota use count as
    /// free; a victim suspended instead (mode SUSPEND) frees only its CPUs
    /// and GPUs. Apply evicts victims only once this accepts the placement
    /// they make room for (Nomad's plan apply), so a stale plan never evicts
    /// for nothing.
    pub fn check_placement_freeing(
        &self,
        p: &Placement,
        freed: &BTreeMap<JobId, crate::policy::PreemptMode>,
    ) -> Result<(), String> {
        let job = self.jobs.get(&p.job_id).ok_or_else(|| format!("job {} does not exist", p.job_id))?;
        if job.state != JobState::Pending {
            return Err(format!("job {} is {}, not pending", p.job_id, job.state.as_str()));
        }
        if p.attempt != job.attempt.saturating_add(1) {
            return Err(format!(
                "stale plan: attempt {} but job {} is at attempt {}",
                p.attempt, p.job_id, job.attempt
            ));
        }
        if let Some(hold) = job.held {
            return Err(format!("job {} is held ({})", p.job_id, hold.as_str()));
        }
        if !job.deps_pending.is_empty() {
            return Err(format!("job {} waits for its dependencies", p.job_id));
        }
        let spec = &job.spec;
        // What the victims hold on each node.
        let mut released: BTreeMap<&str, (u32, u64)> = BTreeMap::new();
        let mut victims: Vec<&Job> = Vec::new();
        for (id, mode) in freed {
            let Some(v) = self.jobs.get(id) else { continue };
            let stops = *mode != crate::policy::PreemptMode::Suspend;
            if stops {
                victims.push(v);
            }
            for na in v.allocation.iter().flat_map(|a| &a.nodes) {
                let r = released.entry(na.node.as_str()).or_default();
                let mem = if stops { na.mem_mb } else { 0 };
                *r = (r.0.saturating_add(na.cpus), r.1.saturating_add(mem));
            }
        }
        let mut seen = BTreeSet::new();
        if spec.components.is_empty() {
            if p.nodes.len() < spec.nodes as usize || p.nodes.len() > spec.nodes_max() as usize {
                return Err(format!("gang of {}-{} nodes placed on {}", spec.nodes, spec.nodes_max(), p.nodes.len()));
            }
            self.check_component(spec, &p.nodes, freed, &released, &mut seen)?;
        } else {
            // A heterogeneous job: component 0's nodes, then component 1's, ...
            if p.nodes.len() != spec.total_nodes() as usize {
                return Err(format!(
                    "heterogeneous job of {} nodes in all placed on {}",
                    spec.total_nodes(),
                    p.nodes.len()
                ));
            }
            let mut rest = p.nodes.as_slice();
            for (k, count) in spec.component_nodes().into_iter().enumerate() {
                let Some((mine, after)) = rest.split_at_checked(count as usize) else {
                    return Err(format!("component {k}: fewer nodes placed than its {count}"));
                };
                self.check_component(&spec.component_shape(k), mine, freed, &released, &mut seen)
                    .map_err(|e| format!("component {k}: {e}"))?;
                rest = after;
            }
        }
        let extra = Use {
            gpus: p.nodes.iter().map(|n| n.gpus.len() as u64).sum(),
            cpus: p.nodes.iter().map(|n| u64::from(n.cpus)).sum(),
            jobs: 1,
        };
        if let Some(why) = self.quota_exceeded_releasing(job, extra, &victims) {
            return Err(why);
        }
        if self.format >= crate::format::SLURM_FEATURES_FORMAT {
            for (name, &want) in &spec.licenses {
                let total = u64::from(self.policy.licenses.get(name).copied().unwrap_or(0));
                let released: u64 =
                    victims.iter().filter_map(|v| v.spec.licenses.get(name)).map(|&n| u64::from(n)).sum();
                let used = self.licenses_used.get(name).copied().unwrap_or(0).saturating_sub(released);
                if used.saturating_add(u64::from(want)) > total {
                    return Err(format!(
                        "license {name}: {want} wanted, {} of {total} free",
                        total.saturating_sub(used)
                    ));
                }
            }
            if let Some(why) = self.license_limit_exceeded(job, &victims, |_, _| 0) {
                return Err(why);
            }
            if let Some(wait) = self.reservation_gate(job, self.clock_ms) {
                return Err(format!("reservation {}: {}", spec.reservation, wait.as_str()));
            }
            self.start_limit_s(job, p.nodes.iter().map(|n| n.node.as_str()), self.clock_ms)?;
        }
        Ok(())
    }

    /// One component's nodes of a placement (all of an ordinary job's), as
    /// [`State::check_placement_freeing`] checks them: `seen` collects the
    /// nodes of the components before, none of which it may use again.
    fn check_component<'n>(
        &self,
        spec: &JobSpec,
        nodes: &'n [NodeAllocation],
        freed: &BTreeMap<JobId, crate::policy::PreemptMode>,
        released: &BTreeMap<&str, (u32, u64)>,
        seen: &mut BTreeSet<&'n str>,
    ) -> Result<(), String> {
        let partitions = &self.policy.partitions;
        let partition = partitions.get(&spec.partition);
        let in_partition = |node: &str| {
            if self.format >= PLAN_APPLY_FORMAT {
                // As the scheduler's view decides it: with partitions defined, a
                // job whose partition is gone fits nowhere.
                partitions.is_empty() || partition.is_some_and(|part| part.contains(node))
            } else {
                partition.is_none_or(|part| part.contains(node))
            }
        };
        // Every listed node is in the gang (a list shorter than the gang is
        // completed with others).
        if !spec.nodelist.is_empty() {
            let placed: BTreeSet<&str> = nodes.iter().map(|na| na.node.as_str()).collect();
            if let Some(n) = spec.nodelist.iter().find(|n| !placed.contains(n.as_str())) {
                return Err(format!("node {n} is in the job's node list but not in the placement"));
            }
        }
        let mut domain: Option<&[String]> = None;
        let level = self.topology_depth(&spec.topology.level);
        for na in nodes {
            if !seen.insert(na.node.as_str()) {
                return Err(format!("node {} appears twice", na.node));
            }
            let node = self.nodes.get(&na.node).ok_or_else(|| format!("node {} does not exist", na.node))?;
            // A pool's powered-down or booting node takes work (format 12).
            let pooled = self.format >= crate::format::ELASTIC_POOLS_FORMAT && node.state.takes_work();
            if node.state != NodeState::Up && !pooled {
                return Err(format!("node {} is {}", na.node, node.state.as_str()));
            }
            if let Some(m) = crate::fit::mismatch(spec, node, in_partition(&na.node)) {
                return Err(format!("node {}: {}", na.node, m.as_str()));
            }
            if let (Some(depth), true) = (level, spec.topology.required) {
                let path = node.topology.get(..depth).unwrap_or(&node.topology);
                match domain {
                    None => domain = Some(path),
                    Some(d) if d != path => {
                        return Err(format!("nodes span more than one {} (required)", spec.topology.level))
                    }
                    _ => {}
                }
            }
            let others = node.jobs.iter().filter(|j| !freed.contains_key(j)).count();
            if spec.exclusive && (others > 0 || na.cpus != node.cpus) {
                return Err(format!("node {} is not whole for an exclusive job", na.node));
            }
            if na.cpus < spec.cpus_per_node() || na.mem_mb < spec.mem_per_node_mb {
                return Err(format!("allocation on {} is smaller than the request", na.node));
            }
            let (cpus_released, mem_released) = released.get(na.node.as_str()).copied().unwrap_or_default();
            if node.cpus_alloc.saturating_sub(cpus_released).saturating_add(na.cpus) > node.cpus
                || node.mem_alloc_mb.saturating_sub(mem_released).saturating_add(na.mem_mb) > node.mem_mb
            {
                return Err(format!("node {} lacks free CPUs or memory", na.node));
            }
            if na.gpus.len() != spec.gpus_per_node as usize {
                return Err(format!("{} GPUs on {} but {} requested", na.gpus.len(), na.node, spec.gpus_per_node));
            }
            let mut gpus_seen = BTreeSet::new();
            for &g in &na.gpus {
                let gpu = node.gpus.get(g as usize).ok_or_else(|| format!("GPU {g} on {} does not exist", na.node))?;
                if !gpus_seen.insert(g) {
                    return Err(format!("GPU {g} on {} appears twice", na.node));
                }
                let taken = gpu.allocated_to.is_some_and(|holder| !freed.contains_key(&holder));
                if taken || gpu.health != GpuHealth::Healthy {
                    return Err(format!("GPU {g} on {} is not free", na.node));
                }
                if !crate::fit::gpu_is_type(gpu, &spec.gpu_type) {
                    return Err(format!("GPU {g} on {} is {}, not {}", na.node, gpu.model, spec.gpu_type));
                }
            }
        }
        Ok(())
    }

    pub(super) fn apply_plan(&mut self, index: u64, placements: &[Placement]) -> Applied {
        let Gangs { started, rejected, events } = self.place_gangs(index, placements);
        Applied { outcome: Outcome::PlanApplied { started, rejected }, events }
    }

    /// Starts each gang of a plan that still fits, in order.
    fn place_gangs(&mut self, index: u64, placements: &[Placement]) -> Gangs {
        let mut started = Vec::new();
        let mut rejected = Vec::new();
        let mut events = Vec::new();
        for p in placements {
            // Each gang is re-checked against the state as changed by the gangs
            // before it in this plan: all of a gang or none of it.
            if let Err(why) = self.check_placement(p) {
                rejected.push((p.job_id, why));
                continue;
            }
            // check_placement found the job: apply changes nothing if that ever broke.
            if !self.jobs.contains_key(&p.job_id) {
                continue;
            }
            let now = self.clock_ms;
            let mut booting = false;
            for na in &p.nodes {
                // check_placement found every node.
                let Some(node) = self.nodes.get_mut(&na.node) else { continue };
                booting |= matches!(node.state, NodeState::PoweredDown | NodeState::PoweringUp);
                // A pool's powered-down node is powered up for it.
                if node.state == NodeState::PoweredDown {
                    node.state = NodeState::PoweringUp;
                    node.state_reason = format!("powering up for job {}", p.job_id);
                    node.state_changed_ms = now;
                }
                node.cpus_alloc = node.cpus_alloc.saturating_add(na.cpus);
                node.mem_alloc_mb = node.mem_alloc_mb.saturating_add(na.mem_mb);
                for &g in &na.gpus {
                    let Some(gpu) = node.gpus.get_mut(g as usize) else { continue };
                    gpu.allocated_to = Some(p.job_id);
                }
                node.jobs.push(p.job_id);
            }
            // Shortened (down to --time-min) to end before a reservation or the deadline.
            let limit_s = if self.format >= crate::format::SLURM_FEATURES_FORMAT {
                let job = self.jobs.get(&p.job_id);
                job.and_then(|job| self.start_limit_s(job, p.nodes.iter().map(|n| n.node.as_str()), self.clock_ms).ok())
            } else {
                None
            };
            let alloc = Allocation { attempt: p.attempt, nodes: p.nodes.clone() };
            self.count_running(p.job_id, &alloc, true);
            self.dep_triggers.insert(p.job_id);
            let now = self.clock_ms;
            // check_placement found the job.
            let Some(job) = self.jobs.get_mut(&p.job_id) else { continue };
            job.state = JobState::Running;
            job.attempt = p.attempt;
            job.expedite_nodes = None;
            if let Some(limit_s) = limit_s.filter(|l| *l != job.spec.time_limit_s) {
                job.requested_limit_s = job.spec.time_limit_s;
                job.spec.time_limit_s = limit_s;
            }
            // A job with a node still booting starts its clock when that
            // node registers (`pools.rs`), and is launched only then.
            job.start_time_ms = (!booting).then_some(now);
            job.reason = String::new();
            job.stop_cause = None;
            job.task_exits.clear();
            job.task_usage.clear();
            job.ran_on = p.nodes.iter().map(|n| n.node.clone()).collect();
            job.last_checkpoint_ms = None;
            job.suspended_at_ms = None;
            job.suspended_ms = 0;
            job.steps.clear();
            job.next_step_id = 0;
            job.signal = None;
            job.allocation = Some(alloc);
            self.pending.remove(&p.job_id);
            self.running.insert(p.job_id);
            started.push(p.job_id);
            events.push(JobEvent {
                index,
                job_id: p.job_id,
                state: JobState::Running,
                attempt: p.attempt,
                reason: String::new(),
                suspended: None,
                step: None,
                usage: false,
            });
        }
        Gangs { started, rejected, events }
    }
}
