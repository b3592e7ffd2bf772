//! Elastic node pools (data format 12): a pool's nodes are in the state
//! before their agents ever registered, `PoweredDown`, with the pool's
//! hardware. A placement on one powers it up (`PoweringUp`, in
//! `apply_plan`); its agent's registration brings it `Up`, and the jobs
//! placed on it start their clock then. `PowerDown` (the leader's, for an
//! idle node; or an operator's) and `PowerUp` (an operator's) are node
//! changes. The programs that really power machines are run by the
//! leader's shell, never by `apply`.
//!
//! Related code: `policy::NodePool`; `duties::power_decisions` (idle
//! power-downs, boot timeouts); `sched` plans on powered-down nodes only
//! when up ones cannot hold a job.

use super::{Applied, Outcome, RefusalKind, State};
use crate::command::NodeStateChange;
use crate::limits::NODES_MAX;
use crate::model::{Node, NodeState};
use crate::policy::ClusterPolicy;
use crate::spec::NodeSpec;

/// How long after a power-down a node's agent may not register again: the
/// suspend program is stopping it meanwhile, and a heartbeat it still sends
/// must not bring the node back up.
pub const POWER_DOWN_REGISTER_GRACE_MS: u64 = 60_000;

impl State {
    /// Why `next` would need more nodes than the cluster may have, if it would.
    pub(super) fn pool_nodes_over_limit(&self, next: &ClusterPolicy) -> Option<String> {
        if self.format < crate::format::ELASTIC_POOLS_FORMAT {
            return None;
        }
        let new = next.pools.values().flat_map(|p| &p.nodes).filter(|n| !self.nodes.contains_key(*n)).count();
        (self.nodes.len().saturating_add(new) > NODES_MAX)
            .then(|| format!("pools: {new} new nodes would take the cluster past its limit of {NODES_MAX} nodes"))
    }

    /// After a policy change: every node a pool names exists (powered down
    /// with the pool's hardware until its agent registers); a powered-down
    /// or booting node that no pool names any more is gone (never
    /// registered) or down (its jobs requeued): only a pool's nodes are
    /// powered, so none is left waiting for a power-up that never comes.
    pub(super) fn sync_pool_nodes(&mut self, index: u64) -> Vec<super::JobEvent> {
        if self.format < crate::format::ELASTIC_POOLS_FORMAT {
            return Vec::new();
        }
        let now = self.clock_ms;
        let pooled: std::collections::BTreeSet<String> =
            self.policy.pool_nodes().into_iter().map(str::to_string).collect();
        let out_of_pool =
            |n: &Node| matches!(n.state, NodeState::PoweredDown | NodeState::PoweringUp) && !pooled.contains(&n.name);
        self.nodes.retain(|_, n| !(out_of_pool(n) && !n.ever_registered() && n.jobs.is_empty()));
        let orphans: Vec<String> = self.nodes.values().filter(|n| out_of_pool(n)).map(|n| n.name.clone()).collect();
        let mut events = Vec::new();
        for name in orphans {
            let Some(node) = self.nodes.get_mut(&name) else { continue };
            node.state = NodeState::Down;
            node.state_reason = "its pool no longer names it".into();
            node.state_changed_ms = now;
            events.extend(self.end_jobs_on(index, &name, &format!("node {name} left its pool while powered down")));
        }
        let policy = &self.policy;
        for pool in policy.pools.values() {
            for name in &pool.nodes {
                if self.nodes.len() >= NODES_MAX {
                    return events;
                }
                if !self.nodes.contains_key(name) {
                    // Never registered: `registered_ms` 0 until its agent does.
                    let mut node = Node::from_spec(&pool.node_spec(name), 0);
                    node.state = NodeState::PoweredDown;
                    node.state_changed_ms = now;
                    node.state_reason = "never powered up".into();
                    self.nodes.insert(name.clone(), node);
                }
            }
        }
        events
    }

    /// The node changes of pools: `PowerDown` (an idle node, or a booting
    /// one nothing waits for, or a down one to retry later) and `PowerUp`
    /// (a powered-down one); the other changes are `apply_set_node_state`'s.
    pub(super) fn power_change(&mut self, name: &str, change: NodeStateChange, reason: &str) -> Applied {
        if self.format < crate::format::ELASTIC_POOLS_FORMAT {
            let needs = crate::format::ELASTIC_POOLS_FORMAT;
            return Applied::refused(RefusalKind::FailedPrecondition, format!("power: needs data format {needs}"));
        }
        if self.policy.pool_of(name).is_none() {
            return Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("node {name} is in no pool: only a pool's nodes are powered down and up"),
            );
        }
        let now = self.clock_ms;
        let Some(node) = self.nodes.get_mut(name) else {
            return Applied::refused(RefusalKind::NotFound, format!("node {name} does not exist"));
        };
        let state = match (change, node.state) {
            (NodeStateChange::PowerDown, NodeState::PoweredDown)
            | (NodeStateChange::PowerUp, NodeState::PoweringUp) => {
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("node {name} is {} already", node.state.as_str()),
                )
            }
            (NodeStateChange::PowerDown, _) if !node.jobs.is_empty() => {
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("node {name} holds {} jobs: drain it and let them end first", node.jobs.len()),
                )
            }
            // Powered down, it would take work again: a drain is kept.
            (NodeStateChange::PowerDown, NodeState::Drain) => {
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("node {name} is drained: resume it first (a drained node stays powered)"),
                )
            }
            (NodeStateChange::PowerDown, _) => NodeState::PoweredDown,
            (NodeStateChange::PowerUp, NodeState::PoweredDown) => NodeState::PoweringUp,
            (_, state) => {
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("node {name} is {}: only a powered-down node is powered up", state.as_str()),
                )
            }
        };
        node.state = state;
        node.state_reason = reason.to_string();
        node.state_changed_ms = now;
        Applied { outcome: Outcome::NodeStateSet { name: name.to_string(), state }, events: Vec::new() }
    }

    /// A pool node that was powered down or booting registered: it is up,
    /// with the hardware it really has where that still holds what was
    /// placed on it (else its jobs are requeued or failed, as for a node
    /// lost); jobs none of whose nodes still boots start their clock now.
    /// None when `spec` is not such a node's. Refused for a node powered
    /// down less than [`POWER_DOWN_REGISTER_GRACE_MS`] ago: its agent may
    /// still be answering while the suspend program stops it.
    pub(super) fn pool_node_registered(&mut self, index: u64, spec: &NodeSpec) -> Option<Applied> {
        let node = self.nodes.get(&spec.name)?;
        if !matches!(node.state, NodeState::PoweredDown | NodeState::PoweringUp) {
            return None;
        }
        let since = self.clock_ms.saturating_sub(node.state_changed_ms);
        if node.state == NodeState::PoweredDown && node.ever_registered() && since < POWER_DOWN_REGISTER_GRACE_MS {
            return Some(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!(
                    "node {} is being powered down; it registers again {} s after that at the earliest",
                    spec.name,
                    POWER_DOWN_REGISTER_GRACE_MS / 1000
                ),
            ));
        }
        let first = if node.registered_ms == 0 { self.clock_ms } else { node.registered_ms };
        let fresh = Node::from_spec(spec, first);
        let mut events = Vec::new();
        if let Some(why) = self.cannot_hold_its_jobs(&fresh) {
            events = self.end_jobs_on(index, &spec.name, &why);
        }
        let now = self.clock_ms;
        let node = self.nodes.get_mut(&spec.name)?;
        let mut fresh = fresh;
        fresh.cpus_alloc = node.cpus_alloc;
        fresh.mem_alloc_mb = node.mem_alloc_mb;
        fresh.jobs = std::mem::take(&mut node.jobs);
        for g in &mut fresh.gpus {
            g.allocated_to = node.gpus.get(g.index as usize).and_then(|old| old.allocated_to);
            // Quarantines of GPUs that are still present are kept.
            if let Some(old) = node.gpus.iter().find(|o| o.uuid == g.uuid) {
                g.health = old.health;
                g.health_reason = old.health_reason.clone();
            }
        }
        fresh.state_changed_ms = now;
        *node = fresh;
        // The jobs' clocks start once every node of theirs is up.
        let booted: Vec<u64> = node.jobs.clone();
        for job_id in booted {
            let Some(job) = self.jobs.get(&job_id) else { continue };
            let all_up = job
                .allocation
                .iter()
                .flat_map(|a| &a.nodes)
                .all(|na| self.nodes.get(&na.node).is_some_and(|n| n.state != NodeState::PoweringUp));
            let Some(job) = self.jobs.get_mut(&job_id) else { continue };
            if all_up && job.start_time_ms.is_none() {
                job.start_time_ms = Some(now);
                // Suspended while its nodes booted: suspended from now on.
                if job.is_suspended() {
                    job.suspended_at_ms = Some(now);
                    job.suspended_ms = 0;
                }
            }
        }
        Some(Applied { outcome: Outcome::NodeRegistered { name: spec.name.clone() }, events })
    }

    /// Why the hardware a pool node registered with cannot hold what was
    /// placed on it (by its pool's template), if it cannot: what the node's
    /// running jobs hold, and each job's own allocation (a yielded one's too,
    /// for its resume), held GPU indexes and their type, and fit (features).
    fn cannot_hold_its_jobs(&self, fresh: &Node) -> Option<String> {
        let node = self.nodes.get(&fresh.name)?;
        let name = &fresh.name;
        if node.cpus_alloc > fresh.cpus || node.mem_alloc_mb > fresh.mem_mb {
            return Some(format!(
                "node {name} registered with {} CPUs and {} MiB, less than its jobs hold ({} CPUs, {} MiB)",
                fresh.cpus, fresh.mem_mb, node.cpus_alloc, node.mem_alloc_mb
            ));
        }
        for job_id in &node.jobs {
            let job = self.jobs.get(job_id)?;
            let Some(alloc) = &job.allocation else { continue };
            let Some((k, na)) = alloc.nodes.iter().enumerate().find(|(_, na)| na.node == *name) else { continue };
            let shape = job.spec.component_shape(job.spec.component_of(k));
            if na.cpus > fresh.cpus || na.mem_mb > fresh.mem_mb {
                return Some(format!("node {name} registered with less than job {job_id} holds there"));
            }
            for &g in &na.gpus {
                match fresh.gpus.get(g as usize) {
                    None => return Some(format!("node {name} registered without GPU {g}, which job {job_id} holds")),
                    Some(gpu) if !crate::fit::gpu_is_type(gpu, &shape.gpu_type) => {
                        return Some(format!(
                            "node {name}: GPU {g} registered as {}, not {}",
                            gpu.model, shape.gpu_type
                        ))
                    }
                    Some(_) => {}
                }
            }
            if let Some(m) = crate::fit::mismatch(&shape, fresh, true) {
                return Some(format!("node {name} registered unfit for job {job_id}: {}", m.as_str()));
            }
        }
        None
    }
}
