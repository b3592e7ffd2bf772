//! The state's derived counters rebuilt from its jobs and nodes
//! (`rebuild_derived`, after a snapshot is decoded), and the invariants that
//! recount them and check every rule `apply` keeps (`check_invariants`,
//! which the property tests, the simulation and the scenarios run after
//! every command).
//!
//! Related code: `mod.rs` (what apply keeps), `usage.rs` (the use counters).

use std::collections::{BTreeMap, BTreeSet};

use super::State;
use crate::limits::*;
use crate::model::*;
use crate::reservation::Reservation;

impl State {
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_stop_causes()?;
        if (self.history != 0 || self.history_since != 0) && self.format < crate::format::HISTORY_FORMAT {
            return Err(format!("history {} in format {}, which cannot hold it", self.history, self.format));
        }
        if self.history_pending && (self.format < crate::format::FRESH_HISTORY_FORMAT || self.history == 0) {
            return Err(format!("a history to draw in format {}, history {}", self.format, self.history));
        }
        if self.node_inventory != crate::inventory::NodeInventory::default()
            && self.format < crate::format::NODE_ADMISSION_FORMAT
        {
            return Err(format!("a node inventory in format {}, which cannot hold it", self.format));
        }
        if self.unfinished_bytes != self.unfinished_bytes_of_jobs() {
            return Err("the unfinished-bytes budget index differs from the jobs".into());
        }
        if self.finished_bytes != self.finished_bytes_of_jobs() {
            return Err("the finished-bytes index differs from the jobs".into());
        }
        let mut cpus: BTreeMap<&str, u32> = BTreeMap::new();
        let mut mem: BTreeMap<&str, u64> = BTreeMap::new();
        let mut gpus: BTreeMap<(&str, u32), JobId> = BTreeMap::new();
        let mut node_jobs: BTreeMap<&str, BTreeSet<JobId>> = BTreeMap::new();
        for (&id, job) in &self.jobs {
            if id != job.id || id >= self.next_job_id {
                return Err(format!("job key {id} vs id {} (next {})", job.id, self.next_job_id));
            }
            let in_pending = self.pending.contains(&id);
            let in_running = self.running.contains(&id);
            match job.state {
                JobState::Pending if !in_pending || in_running || job.allocation.is_some() => {
                    return Err(format!("pending job {id} misfiled or allocated"))
                }
                JobState::Running if !in_running || in_pending || job.allocation.is_none() => {
                    return Err(format!("running job {id} misfiled or unallocated"))
                }
                s if s.is_finished() && (in_pending || in_running || job.allocation.is_some()) => {
                    return Err(format!("finished job {id} still queued or allocated"))
                }
                _ => {}
            }
            if job.is_suspended() && job.state != JobState::Running {
                return Err(format!("job {id} is suspended but {}", job.state.as_str()));
            }
            if job.is_yielded() != self.yielded.contains(&id) || (job.is_yielded() && !job.is_suspended()) {
                return Err(format!("job {id}: yielded for a preemptor but not suspended, or misfiled"));
            }
            if job.state == JobState::Pending && (job.suspended_ms != 0 || !job.steps.is_empty()) {
                return Err(format!("pending job {id} kept suspended time or steps from an earlier attempt"));
            }
            if job.steps.len() > STEPS_PER_JOB_MAX || job.steps.iter().any(|s| s.id >= job.next_step_id) {
                return Err(format!("job {id} keeps too many steps, or one numbered past its count"));
            }
            if job.state != JobState::Running && job.steps.iter().any(|s| s.end_ms.is_none()) {
                return Err(format!("job {id} is {} with a step still running", job.state.as_str()));
            }
            if job.state == JobState::Running {
                let alloc_nodes: BTreeSet<&str> =
                    job.allocation.iter().flat_map(|a| a.nodes.iter().map(|n| n.node.as_str())).collect();
                let exits_ok = job.task_exits.iter().all(|(n, e)| alloc_nodes.contains(n.as_str()) && e.succeeded());
                if !exits_ok || job.task_exits.len() >= alloc_nodes.len().max(1) {
                    return Err(format!("running job {id} has task exits that should have finished it"));
                }
            }
            if let Some(alloc) = &job.allocation {
                let (least, most) = if job.spec.components.is_empty() {
                    (job.spec.nodes, job.spec.nodes_max())
                } else {
                    (job.spec.total_nodes(), job.spec.total_nodes())
                };
                if alloc.attempt != job.attempt
                    || alloc.nodes.len() < least as usize
                    || alloc.nodes.len() > most as usize
                {
                    return Err(format!("job {id} allocation does not match its attempt or gang size"));
                }
                for na in &alloc.nodes {
                    let m = mem.entry(&na.node).or_default();
                    *m = m.saturating_add(na.mem_mb);
                    node_jobs.entry(&na.node).or_default().insert(id);
                    // A yielded job holds its memory only.
                    if job.is_yielded() {
                        continue;
                    }
                    let c = cpus.entry(&na.node).or_default();
                    *c = c.saturating_add(na.cpus);
                    for &g in &na.gpus {
                        if gpus.insert((&na.node, g), id).is_some() {
                            return Err(format!("GPU {g} on {} held twice", na.node));
                        }
                    }
                }
            }
        }
        if self.pending.len().saturating_add(self.running.len()).saturating_add(self.finished.len()) != self.jobs.len()
        {
            return Err("job sets do not partition the jobs".into());
        }
        for id in self.pending.iter().chain(&self.running).chain(&self.finished) {
            if !self.jobs.contains_key(id) {
                return Err(format!("queued job {id} does not exist"));
            }
        }
        for (name, node) in &self.nodes {
            let n = name.as_str();
            if node.cpus_alloc != cpus.get(n).copied().unwrap_or(0)
                || node.mem_alloc_mb != mem.get(n).copied().unwrap_or(0)
            {
                return Err(format!("node {name}: allocated resources differ from the sum of allocations"));
            }
            if node.cpus_alloc > node.cpus || node.mem_alloc_mb > node.mem_mb {
                return Err(format!("node {name}: more allocated than it has"));
            }
            let listed: BTreeSet<JobId> = node.jobs.iter().copied().collect();
            if listed.len() != node.jobs.len() || listed != node_jobs.remove(n).unwrap_or_default() {
                return Err(format!("node {name}: job list differs from allocations"));
            }
            // GPUs are looked up by index as position, and held in 32-bit masks.
            if node.gpus.len() > crate::limits::GPUS_PER_NODE_MAX as usize
                || node.gpus.iter().enumerate().any(|(i, g)| g.index as usize != i)
            {
                return Err(format!("node {name}: more GPUs than the limit, or a GPU's index is not its position"));
            }
            for gpu in &node.gpus {
                if gpu.allocated_to != gpus.remove(&(n, gpu.index)) {
                    return Err(format!("node {name} GPU {}: holder differs from allocations", gpu.index));
                }
            }
        }
        if !gpus.is_empty() || !node_jobs.is_empty() {
            return Err("allocation names a node or GPU that does not exist".into());
        }
        let pooled = self.policy.pool_nodes();
        for (name, node) in &self.nodes {
            let powered = matches!(node.state, NodeState::PoweredDown | NodeState::PoweringUp);
            if powered && !pooled.contains(name.as_str()) {
                return Err(format!("node {name} is {} but in no pool", node.state.as_str()));
            }
            if node.state == NodeState::PoweredDown && !node.jobs.is_empty() {
                return Err(format!("node {name} is powered down with jobs on it"));
            }
        }
        let mut recount = self.clone();
        recount.rebuild_use();
        if recount.running_use != self.running_use
            || recount.active_jobs != self.active_jobs
            || recount.licenses_used != self.licenses_used
            || recount.licenses_held != self.licenses_held
            || recount.deadline_jobs != self.deadline_jobs
            || recount.active_by_user != self.active_by_user
        {
            return Err("quota use counters differ from the jobs".into());
        }
        for id in &self.pending {
            let Some(job) = self.jobs.get(id) else { return Err(format!("pending job {id} does not exist")) };
            for d in &job.deps_pending {
                if !self.dependents.get(&d.job_id).is_some_and(|s| s.contains(id)) {
                    return Err(format!("pending job {id} waits on {} but is not filed as its dependent", d.job_id));
                }
            }
        }
        if self.reserved_nodes != self.reserved_nodes_of_reservations() {
            return Err("the reserved-node index differs from the reservations".into());
        }
        if self.reservations.len() > RESERVATIONS_MAX {
            return Err("more reservations than the limit".into());
        }
        let resv: Vec<&Reservation> = self.reservations.values().collect();
        for (k, (name, r)) in self.reservations.iter().enumerate() {
            if *name != r.name {
                return Err(format!("reservation {name} is filed under another name"));
            }
            for other in resv.iter().skip(k.saturating_add(1)) {
                if other.conflicts(r) && other.nodes.iter().any(|n| r.contains(n)) {
                    return Err(format!("reservations {name} and {} hold a node at the same time", other.name));
                }
            }
        }
        if self.idempotency.len() != self.idempotency_expiry.len() {
            return Err("idempotency index and expiry index differ in size".into());
        }
        for (_, identity, key) in &self.idempotency_expiry {
            if !self.idempotency.contains_key(&(identity.clone(), key.clone())) {
                return Err("idempotency expiry names an unknown key".into());
            }
        }
        let by_identity: usize = self.idempotency_by_identity.values().map(BTreeSet::len).sum();
        if by_identity != self.idempotency_expiry.len() {
            return Err("idempotency keys per identity and the expiry index differ in size".into());
        }
        for (identity, mine) in &self.idempotency_by_identity {
            if mine.is_empty() {
                return Err(format!("idempotency keys of {identity}: an empty set is kept"));
            }
            for (expires, key) in mine {
                if !self.idempotency_expiry.contains(&(*expires, identity.clone(), key.clone())) {
                    return Err(format!("idempotency keys of {identity}: one the expiry index lacks"));
                }
            }
        }
        Ok(())
    }

    /// Stop causes only from format 18; a job suspended for a preemptor
    /// says so, naming it; a running job that is not has none.
    fn check_stop_causes(&self) -> Result<(), String> {
        for job in self.jobs.values() {
            let Some(cause) = &job.stop_cause else { continue };
            if self.format < crate::format::STOP_CAUSE_FORMAT {
                return Err(format!("job {} has a stop cause in format {}", job.id, self.format));
            }
            if job.state == JobState::Running && !self.yielded.contains(&job.id) {
                return Err(format!("running job {} has a stop cause: {cause:?}", job.id));
            }
        }
        if self.format >= crate::format::STOP_CAUSE_FORMAT {
            for id in &self.yielded {
                let job = self.jobs.get(id).ok_or_else(|| format!("yielded job {id} does not exist"))?;
                let by = job.stop_cause.as_ref().and_then(StopCause::preempted_by);
                if by.is_none() || by != job.preempted_by {
                    return Err(format!(
                        "yielded job {id} was preempted by {:?}, its cause says {by:?}",
                        job.preempted_by
                    ));
                }
            }
        }
        Ok(())
    }

    /// Rebuilds what a snapshot does not carry (after decoding one).
    pub fn rebuild_derived(&mut self) {
        self.idempotency_by_identity.clear();
        for (expires, identity, key) in &self.idempotency_expiry {
            self.idempotency_by_identity.entry(identity.clone()).or_default().insert((*expires, key.clone()));
        }
        self.unfinished_bytes = self.unfinished_bytes_of_jobs();
        self.finished_bytes = self.finished_bytes_of_jobs();
        self.licenses_used = self.licenses_of_running_jobs();
        self.licenses_held.clear();
        let running: Vec<JobId> = self.running.iter().copied().collect();
        for id in running {
            self.count_held_licenses(id, true);
        }
        self.deadline_jobs = self
            .pending
            .iter()
            .chain(&self.running)
            .filter(|id| self.jobs.get(id).is_some_and(|j| j.spec.deadline_ms > 0))
            .copied()
            .collect();
        self.active_by_user.clear();
        for id in self.pending.iter().chain(&self.running) {
            if let Some(j) = self.jobs.get(id) {
                self.active_by_user.entry(j.spec.user.clone()).or_default().insert(*id);
            }
        }
        self.reserved_nodes = self.reserved_nodes_of_reservations();
        self.yielded =
            self.running.iter().copied().filter(|id| self.jobs.get(id).is_some_and(Job::is_yielded)).collect();
    }

    /// Verifies every invariant of the state. Returns the first violation found.
    /// The derived indexes a snapshot does not carry, computed from the jobs.
    fn unfinished_bytes_of_jobs(&self) -> BTreeMap<String, u64> {
        let mut out: BTreeMap<String, u64> = BTreeMap::new();
        for id in self.pending.iter().chain(&self.running) {
            let Some(job) = self.jobs.get(id) else { continue };
            let bytes = job.spec.size_bytes() as u64;
            for who in [job.spec.user.clone(), String::new()] {
                let e = out.entry(who).or_default();
                *e = e.saturating_add(bytes);
            }
        }
        out
    }

    fn finished_bytes_of_jobs(&self) -> u64 {
        self.finished
            .iter()
            .filter_map(|id| self.jobs.get(id))
            .fold(0u64, |n, j| n.saturating_add(j.retained_bytes() as u64))
    }

    fn licenses_of_running_jobs(&self) -> BTreeMap<String, u64> {
        let mut used: BTreeMap<String, u64> = BTreeMap::new();
        for j in self.running.iter().filter_map(|id| self.jobs.get(id)) {
            for (name, &n) in &j.spec.licenses {
                let u = used.entry(name.clone()).or_default();
                *u = u.saturating_add(u64::from(n));
            }
        }
        used
    }
}
