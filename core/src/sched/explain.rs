//! Why a pending job is not running: the reason the scheduler gives it (from a
//! full pass, exactly as the leader would plan now), its priority factors and
//! position, and per node why it cannot host the job (counted by reason, as
//! Nomad's AllocMetric counts filtered nodes).
//!
//! Related code: `mod.rs` (the pass whose reason this reports).

use std::collections::BTreeMap;

use super::view::View;
use super::{Options, Order, Pending, Policy, Prioritizer};
use crate::model::{HoldKind, Job, JobId, JobState};
use crate::state::State;

#[derive(Debug, Clone, PartialEq)]
pub struct Explanation {
    pub job_id: JobId,
    pub state: JobState,
    /// Slurm-style reason code (empty when the job is not pending).
    pub reason: String,
    /// One sentence a user can act on.
    pub detail: String,
    pub factors: super::Factors,
    /// Nodes that could take one gang member now.
    pub eligible_nodes: u32,
    /// Why the other nodes cannot (reason → nodes).
    pub rejections: BTreeMap<String, u32>,
    /// 1 = next in line among pending jobs.
    pub queue_position: u32,
    /// When it is expected to start: now (the next pass starts it), its
    /// backfill reservation, or its begin time; None when nothing says.
    pub estimated_start_ms: Option<u64>,
    /// Where it would start now.
    pub start_nodes: Vec<String>,
}

/// Explains `job_id` at `now_ms`; None if the job does not exist.
pub fn explain(state: &State, job_id: JobId, now_ms: u64) -> Option<Explanation> {
    let job = state.jobs.get(&job_id)?;
    Some(explain_job(state, job, false, now_ms))
}

/// Explains `job` as it would be if submitted now: a job not in the state
/// (see [`State::prepare_submission`]), planned as if pending, without a
/// copy of the state.
pub fn explain_submission(state: &State, job: &Job, now_ms: u64) -> Explanation {
    explain_job(state, job, true, now_ms)
}

fn explain_job(state: &State, job: &Job, hypothetical: bool, now_ms: u64) -> Explanation {
    let job_id = job.id;
    let prio = Prioritizer::new(state, now_ms);
    let factors = prio.factors(job);
    let mut out = Explanation {
        job_id,
        state: job.state,
        reason: String::new(),
        detail: String::new(),
        factors,
        eligible_nodes: 0,
        rejections: BTreeMap::new(),
        queue_position: 0,
        estimated_start_ms: None,
        start_nodes: Vec::new(),
    };
    if job.state != JobState::Pending {
        out.detail = match job.state {
            JobState::Running => format!("running on {}", job.ran_on.join(",")),
            s if job.reason.is_empty() => format!("{} (ran on {})", s.as_str(), job.ran_on.join(",")),
            s => format!("{}: {}", s.as_str(), job.reason),
        };
        return out;
    }
    let key = (prio.tier(job), factors.total);
    out.queue_position = state
        .pending
        .iter()
        .filter(|id| **id != job_id)
        .filter(|id| {
            let Some(j) = state.jobs.get(*id) else { return false };
            let k = (prio.tier(j), prio.factors(j).total);
            k.0 > key.0 || (k.0 == key.0 && (k.1 > key.1 || (k.1 == key.1 && **id < job_id)))
        })
        .count()
        .try_into()
        .unwrap_or(u32::MAX)
        .saturating_add(1);
    let view = View::of(state, now_ms);
    let mut statically_ok = 0u32;
    for (i, f) in view.free.iter().enumerate() {
        if view.hardware_reject(i, job).is_none() {
            crate::incr(&mut statically_ok);
        }
        match view.static_reject(i, job) {
            Some(why) => crate::incr(out.rejections.entry(why.to_string()).or_default()),
            None => {
                if view.fits_now(i, job) {
                    crate::incr(&mut out.eligible_nodes);
                } else {
                    crate::incr(out.rejections.entry(view.busy_reason(job, f).to_string()).or_default());
                }
            }
        }
    }
    let opts = Options { policy: Policy::Easy, order: Order::Priority, now_ms, estimate_s: None, stopping: None };
    let p = super::plan_with(state, &opts, hypothetical.then_some(job));
    let reason = p.reasons.iter().find(|(id, _)| *id == job_id).map(|(_, r)| *r);
    let starting = p.placements.iter().any(|pl| pl.job_id == job_id);
    let need = job.spec.nodes;
    if let Some(pl) = p.placements.iter().find(|pl| pl.job_id == job_id) {
        out.estimated_start_ms = Some(now_ms);
        out.start_nodes = pl.nodes.iter().map(|n| n.node.clone()).collect();
    } else if let Some((_, t)) = p.reservations.iter().find(|(id, _)| *id == job_id) {
        out.estimated_start_ms = Some(*t);
    } else if job.spec.begin_ms > now_ms && reason == Some(Pending::BeginTime) {
        out.estimated_start_ms = Some(job.spec.begin_ms);
    }
    let (reason, detail) = if starting {
        ("None", "the next scheduling pass starts it".to_string())
    } else if statically_ok < need && job.held.is_none() && job.deps_pending.is_empty() {
        let top = out.rejections.iter().max_by_key(|(_, c)| **c).map(|(r, _)| r.clone()).unwrap_or_default();
        (
            "BadConstraints",
            format!(
                "only {statically_ok} node(s) could ever run it and it needs {need} (most common: {top}); change the request or partition"
            ),
        )
    } else {
        match reason {
            Some(Pending::Dependency) => (
                "Dependency",
                if job.deps_pending.is_empty() {
                    "singleton: another job with the same name and user is running".to_string()
                } else {
                    let deps: Vec<String> =
                        job.deps_pending.iter().map(|d| format!("{}:{}", d.kind.as_str(), d.job_id)).collect();
                    format!("waiting for {}", deps.join(","))
                },
            ),
            Some(r @ Pending::Held(hold)) => {
                let by = match hold {
                    HoldKind::User => "held by its user".to_string(),
                    HoldKind::Admin => "held by an admin".to_string(),
                    HoldKind::DependencyNeverSatisfied => format!("held: {}", job.reason),
                };
                (r.as_str(), format!("{by}; `gangway release {}` lets it run", job.id))
            }
            Some(Pending::BeginTime) => (
                "BeginTime",
                format!(
                    "asked not to start before {} ms since the epoch (--begin); it is eligible then",
                    job.spec.begin_ms
                ),
            ),
            Some(Pending::ArrayTaskLimit) => {
                ("JobArrayTaskLimit", "the array's throttle (%N) is reached; elements start as others end".into())
            }
            Some(r @ (Pending::AssocGrpLimit | Pending::AssocMaxLimit | Pending::QosMaxPerUser)) => {
                let extra = crate::policy::Use { gpus: job.gpus(), cpus: job.cpus(), jobs: 1 };
                (r.as_str(), state.quota_exceeded(job, extra).unwrap_or_else(|| "a quota is reached".into()))
            }
            Some(Pending::Topology) => (
                "Topology",
                format!(
                    "enough nodes are free, but not within one {} (required{})",
                    job.spec.topology.level,
                    if job.spec.topology.required { "" } else { " until its wait ends" }
                ),
            ),
            Some(Pending::Resources) => {
                let start = p.reservations.iter().find(|(id, _)| *id == job_id).map(|(_, t)| *t);
                (
                    "Resources",
                    match start {
                        Some(t) => format!(
                            "waiting for resources; expected to start within {} s (reserved)",
                            t.saturating_sub(now_ms) / 1000
                        ),
                        None => format!(
                            "waiting for resources: {} node(s) can take it now, it needs {need}",
                            out.eligible_nodes
                        ),
                    },
                )
            }
            _ => ("Priority", format!("{} job(s) ahead of it by priority", out.queue_position.saturating_sub(1))),
        }
    };
    out.reason = reason.to_string();
    out.detail = detail;
    out
}
