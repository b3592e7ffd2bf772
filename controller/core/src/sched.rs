//! Placement: which pending jobs start where. A pure function of the state, run
//! by the leader and re-checked by `apply` (plans are optimistic).
//!
//! This is the first, simple policy: jobs in submit order, each gang placed whole
//! on the first nodes that fit (first fit, skipping jobs that do not fit rather
//! than blocking the queue behind them), GPUs preferring one NVLink island.
//! Priorities, fair share, topology-aware placement and backfill replace it in
//! the scheduler issue; the interface (`schedule(&State) -> Vec<Placement>`)
//! stays.

use std::collections::BTreeMap;

use crate::command::Placement;
use crate::model::{GpuHealth, JobId, Node, NodeAllocation, NodeState};
use crate::state::State;

/// Pending jobs examined per pass: bounds one pass's work when the queue is
/// long; the rest are examined on the next passes.
pub const PENDING_EXAMINED_PER_PASS_MAX: usize = 10_000;
/// Jobs examined for backfill behind a reservation per pass (Slurm's
/// bf_max_job_test defaults to 500): each costs a trial placement.
pub const BACKFILL_CANDIDATES_MAX: usize = 1000;
/// Gangs placed per plan: keeps one ApplyPlan entry small.
pub const PLACEMENTS_PER_PLAN_MAX: usize = 512;

/// What a node has left, as the plan being built uses it up.
#[derive(Clone)]
struct Free {
    cpus: u32,
    mem_mb: u64,
    /// Free, healthy GPU indexes grouped by NVLink island.
    gpus_by_island: BTreeMap<u32, Vec<u32>>,
    model: Vec<String>,
}

impl Free {
    fn of(node: &Node) -> Free {
        let mut gpus_by_island: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for g in &node.gpus {
            if g.allocated_to.is_none() && g.health == GpuHealth::Healthy {
                gpus_by_island.entry(g.nvlink_island).or_default().push(g.index);
            }
        }
        Free {
            cpus: node.cpus - node.cpus_alloc,
            mem_mb: node.mem_mb - node.mem_alloc_mb,
            gpus_by_island,
            model: node.gpus.iter().map(|g| g.model.clone()).collect(),
        }
    }

    /// Picks `n` free GPUs of `gpu_type` (prefix; empty = any), from a single
    /// island when one has enough, else the fullest islands first.
    fn pick_gpus(&self, n: usize, gpu_type: &str) -> Option<Vec<u32>> {
        if n == 0 {
            return Some(Vec::new());
        }
        let fits = |g: &u32| gpu_type.is_empty() || self.model[*g as usize].starts_with(gpu_type);
        let islands: Vec<Vec<u32>> =
            self.gpus_by_island.values().map(|gs| gs.iter().copied().filter(fits).collect()).collect();
        // Tightest single island that holds the whole request.
        if let Some(best) = islands.iter().filter(|i| i.len() >= n).min_by_key(|i| i.len()) {
            return Some(best[..n].to_vec());
        }
        let mut sorted = islands;
        sorted.sort_by_key(|i| std::cmp::Reverse(i.len()));
        let all: Vec<u32> = sorted.into_iter().flatten().collect();
        (all.len() >= n).then(|| all[..n].to_vec())
    }

    /// Gives back what an allocation held (when it is expected to end).
    fn give(&mut self, cpus: u32, mem_mb: u64, gpus: &[u32], node: &Node) {
        self.cpus += cpus;
        self.mem_mb += mem_mb;
        for &g in gpus {
            if let Some(gpu) = node.gpus.get(g as usize) {
                if gpu.health == GpuHealth::Healthy {
                    self.gpus_by_island.entry(gpu.nvlink_island).or_default().push(g);
                }
            }
        }
    }

    fn take(&mut self, cpus: u32, mem_mb: u64, gpus: &[u32]) {
        self.cpus -= cpus;
        self.mem_mb -= mem_mb;
        for list in self.gpus_by_island.values_mut() {
            list.retain(|g| !gpus.contains(g));
        }
    }
}

/// How the queue is walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Submit order; a job that does not fit is skipped and later jobs may start
    /// (no reservation: large jobs can wait long behind small ones).
    FirstFit,
    /// Strict submit order: nothing starts ahead of a job that does not fit.
    Fifo,
    /// EASY backfilling: the first job that does not fit gets a reservation at
    /// the earliest time enough resources free up (from running jobs' time
    /// limits); later jobs start now only if they cannot delay it (they end
    /// before it, or use none of its nodes).
    Easy,
}

/// Computes a plan: gangs to start now, each placed whole (first fit).
pub fn schedule(state: &State) -> Vec<Placement> {
    schedule_with(state, Policy::FirstFit, state.clock_ms)
}

/// Computes a plan under `policy`; `now_ms` dates the plan (EASY reasons about
/// when running jobs end).
pub fn schedule_with(state: &State, policy: Policy, now_ms: u64) -> Vec<Placement> {
    if policy == Policy::Easy {
        return schedule_easy(state, now_ms);
    }
    let mut free: BTreeMap<&str, Free> =
        state.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| (n.name.as_str(), Free::of(n))).collect();
    let mut plan = Vec::new();
    for &job_id in state.pending.iter().take(PENDING_EXAMINED_PER_PASS_MAX) {
        if plan.len() >= PLACEMENTS_PER_PLAN_MAX || free.is_empty() {
            break;
        }
        match place(state, job_id, &mut free) {
            Some(p) => plan.push(p),
            None if policy == Policy::Fifo => break,
            None => {}
        }
    }
    plan
}

fn free_map(state: &State) -> BTreeMap<&str, Free> {
    state.nodes.values().filter(|n| n.state == NodeState::Up).map(|n| (n.name.as_str(), Free::of(n))).collect()
}

/// When a job's attempt is expected to end: its start plus its time limit.
fn expected_end_ms(start_ms: u64, limit_s: u64) -> u64 {
    start_ms.saturating_add(limit_s.saturating_mul(1000))
}

fn schedule_easy(state: &State, now_ms: u64) -> Vec<Placement> {
    let mut free = free_map(state);
    let mut plan: Vec<Placement> = Vec::new();
    // (shadow time, nodes the head job will use then)
    let mut reservation: Option<(u64, Vec<String>)> = None;
    let mut backfill_examined = 0;
    for &job_id in state.pending.iter().take(PENDING_EXAMINED_PER_PASS_MAX) {
        if plan.len() >= PLACEMENTS_PER_PLAN_MAX || backfill_examined >= BACKFILL_CANDIDATES_MAX || free.is_empty() {
            break;
        }
        if reservation.is_some() {
            backfill_examined += 1;
        }
        let limit_s = state.jobs[&job_id].spec.time_limit_s;
        match &reservation {
            None => match place(state, job_id, &mut free) {
                Some(p) => plan.push(p),
                None => reservation = reserve(state, job_id, &free, &plan, now_ms),
            },
            Some((shadow_ms, reserved)) => {
                let mut trial = free.clone();
                if let Some(p) = place(state, job_id, &mut trial) {
                    let ends_first = expected_end_ms(now_ms, limit_s) <= *shadow_ms;
                    let disjoint = p.nodes.iter().all(|n| !reserved.contains(&n.node));
                    if ends_first || disjoint {
                        free = trial;
                        plan.push(p);
                    }
                }
            }
        }
    }
    plan
}

/// The earliest time `job_id` fits, releasing running (and just planned) jobs
/// in the order their time limits end, and the nodes it would use then.
fn reserve(
    state: &State,
    job_id: JobId,
    free: &BTreeMap<&str, Free>,
    plan: &[Placement],
    now_ms: u64,
) -> Option<(u64, Vec<String>)> {
    let mut ending: Vec<(u64, &[NodeAllocation])> = state
        .running
        .iter()
        .filter_map(|id| state.jobs.get(id))
        .filter_map(|j| {
            let a = j.allocation.as_ref()?;
            Some((expected_end_ms(j.start_time_ms.unwrap_or(now_ms), j.spec.time_limit_s), a.nodes.as_slice()))
        })
        .chain(
            plan.iter().map(|p| (expected_end_ms(now_ms, state.jobs[&p.job_id].spec.time_limit_s), p.nodes.as_slice())),
        )
        .collect();
    ending.sort_by_key(|(end, _)| *end);
    let mut future = free.clone();
    for (end, allocs) in ending {
        for na in allocs {
            if let (Some(f), Some(node)) = (future.get_mut(na.node.as_str()), state.nodes.get(&na.node)) {
                f.give(na.cpus, na.mem_mb, &na.gpus, node);
            }
        }
        if let Some(p) = place(state, job_id, &mut future.clone()) {
            return Some((end.max(now_ms), p.nodes.into_iter().map(|n| n.node).collect()));
        }
    }
    None
}

fn place(state: &State, job_id: JobId, free: &mut BTreeMap<&str, Free>) -> Option<Placement> {
    let job = &state.jobs[&job_id];
    let spec = &job.spec;
    let cpus = spec.cpus_per_node();
    let gpus = spec.gpus_per_node as usize;
    // Cheap bound first: too few nodes with enough CPUs means no placement.
    if free.values().filter(|f| f.cpus >= cpus).take(spec.nodes as usize).count() < spec.nodes as usize {
        return None;
    }
    let mut chosen: Vec<(&str, Vec<u32>)> = Vec::new();
    for (name, f) in free.iter() {
        if chosen.len() == spec.nodes as usize {
            break;
        }
        if f.cpus < cpus || f.mem_mb < spec.mem_per_node_mb {
            continue;
        }
        if let Some(g) = f.pick_gpus(gpus, &spec.gpu_type) {
            chosen.push((name, g));
        }
    }
    if chosen.len() < spec.nodes as usize {
        return None;
    }
    let mut nodes = Vec::with_capacity(chosen.len());
    for (name, g) in chosen {
        free.get_mut(name).expect("chosen from free").take(cpus, spec.mem_per_node_mb, &g);
        nodes.push(NodeAllocation { node: name.to_string(), cpus, mem_mb: spec.mem_per_node_mb, gpus: g });
    }
    Some(Placement { job_id, attempt: job.attempt + 1, nodes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Command;
    use crate::spec::{GpuSpec, JobSpec, NodeSpec};
    use crate::Outcome;

    fn node(name: &str, gpus: u32) -> NodeSpec {
        NodeSpec {
            name: name.into(),
            addr: String::new(),
            cpus: 8,
            mem_mb: 1024,
            gpus: (0..gpus)
                .map(|i| GpuSpec {
                    uuid: format!("{name}-{i}"),
                    model: "h100-80gb".into(),
                    mem_mb: 1,
                    nvlink_island: i / 4,
                })
                .collect(),
            topology: vec![],
            labels: Default::default(),
        }
    }

    fn submit(s: &mut State, nodes: u32, gpus: u32) {
        let spec = JobSpec {
            user: "u".into(),
            command: vec!["true".into()],
            nodes,
            gpus_per_node: gpus,
            ..JobSpec::default()
        };
        s.apply(1, &Command::SubmitJob { spec, identity: "u".into(), idempotency_key: String::new(), now_ms: 1 });
    }

    #[test]
    fn gangs_fit_whole_and_skip_what_does_not_fit() {
        let mut s = State::default();
        s.apply(1, &Command::RegisterNode { spec: node("a", 8), now_ms: 1 });
        s.apply(1, &Command::RegisterNode { spec: node("b", 8), now_ms: 1 });
        submit(&mut s, 2, 8); // job 1: both nodes whole
        submit(&mut s, 3, 1); // job 2: 3 nodes, never fits
        submit(&mut s, 1, 2); // job 3: waits for job 1
        let plan = schedule(&s);
        assert_eq!(plan.iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![1]);
        let out = s.apply(2, &Command::ApplyPlan { placements: plan, now_ms: 2 }).outcome;
        assert!(matches!(out, Outcome::PlanApplied { ref started, .. } if started == &vec![1]));
        assert!(schedule(&s).is_empty(), "nothing else fits while job 1 holds every GPU");
        s.check_invariants().unwrap();
    }

    #[test]
    fn easy_backfills_only_what_cannot_delay_the_reserved_job() {
        let mut s = State::default();
        for n in ["a", "b"] {
            s.apply(1, &Command::RegisterNode { spec: node(n, 0), now_ms: 0 });
        }
        let submit_t = |s: &mut State, nodes: u32, limit_s: u64| {
            let spec = JobSpec {
                user: "u".into(),
                command: vec!["true".into()],
                nodes,
                cpus_per_task: 8,
                time_limit_s: limit_s,
                ..JobSpec::default()
            };
            s.apply(1, &Command::SubmitJob { spec, identity: "u".into(), idempotency_key: String::new(), now_ms: 0 });
        };
        submit_t(&mut s, 1, 100); // job 1: runs on one node until t=100
        let plan = schedule_with(&s, Policy::Easy, 0);
        s.apply(2, &Command::ApplyPlan { placements: plan, now_ms: 0 });
        submit_t(&mut s, 2, 100); // job 2: needs both nodes: reserved at t=100
        submit_t(&mut s, 1, 500); // job 3: would hold the free node past t=100
        submit_t(&mut s, 1, 50); // job 4: ends by t=50, before the reservation
        let easy: Vec<u64> = schedule_with(&s, Policy::Easy, 0).iter().map(|p| p.job_id).collect();
        assert_eq!(easy, vec![4], "only the job that ends before the reservation may backfill");
        let ff: Vec<u64> = schedule_with(&s, Policy::FirstFit, 0).iter().map(|p| p.job_id).collect();
        assert_eq!(ff, vec![3], "first fit takes the free node and delays job 2");
    }

    #[test]
    fn gpus_come_from_one_nvlink_island_when_possible() {
        let mut s = State::default();
        s.apply(1, &Command::RegisterNode { spec: node("a", 8), now_ms: 1 });
        submit(&mut s, 1, 3);
        submit(&mut s, 1, 4);
        let plan = schedule(&s);
        assert_eq!(plan[0].nodes[0].gpus, vec![0, 1, 2]);
        assert_eq!(plan[1].nodes[0].gpus, vec![4, 5, 6, 7], "the second job gets the untouched island");
    }
}
