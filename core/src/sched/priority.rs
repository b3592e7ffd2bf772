//! Multifactor priority and fair share.
//!
//! priority = w_age·age + w_fairshare·fairshare + w_size·size + w_qos·qos
//!          + w_partition·tier − nice            (each factor in 0..=1)
//!
//! Fair share is Slurm's classic factor 2^(−U/S): S is the account's share of
//! the tree (its shares over its siblings', times its parent's), U its share of
//! the cluster's decayed usage (its sub-accounts' included). Usage decays with
//! the policy's half-life; running jobs count for the time they have run.
//!
//! Floating point here never reaches the replicated state: priorities only
//! order the queue the leader plans from, and `apply` re-checks every plan.
//!
//! Related code: `state/admin.rs` records usage buckets when allocations end.

use std::collections::BTreeMap;

use crate::model::Job;
use crate::policy::{ClusterPolicy, ROOT_ACCOUNT};
use crate::state::State;

/// Per account: normalized shares, normalized usage, raw decayed usage and factor.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Share {
    pub norm_shares: f64,
    pub norm_usage: f64,
    pub gpu_hours: f64,
    pub cpu_hours: f64,
    pub factor: f64,
}

/// GPU time counts this many times CPU time in fair-share usage (an 8-GPU
/// server has on the order of 100-200 cores; a GPU is the scarce resource).
pub const GPU_USAGE_WEIGHT: f64 = 32.0;

fn decay(age_ms: u64, half_life_s: u64) -> f64 {
    (-(age_ms as f64) / (half_life_s as f64 * 1000.0) * std::f64::consts::LN_2).exp()
}

/// Fair share for every account in the policy (and root), at `now_ms`.
pub fn fair_share(state: &State, now_ms: u64) -> BTreeMap<String, Share> {
    let policy = &state.policy;
    let hl = policy.fairshare_half_life_s;
    // Own usage (gpu_ms, cpu_ms), decayed, per account.
    let mut own: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for (acct, buckets) in &state.usage {
        let e = own.entry(acct.as_str()).or_default();
        for b in buckets {
            let w = decay(now_ms.saturating_sub(b.start_ms), hl);
            e.0 += b.gpu_ms as f64 * w;
            e.1 += b.cpu_ms as f64 * w;
        }
    }
    for j in state.running.iter().filter_map(|id| state.jobs.get(id)) {
        // Not the time it spent suspended, as apply charges it.
        let ran = now_ms.saturating_sub(j.start_time_ms.unwrap_or(now_ms)).saturating_sub(j.suspended_total_ms(now_ms))
            as f64;
        let e = own.entry(j.spec.account.as_str()).or_default();
        e.0 += j.gpus() as f64 * ran;
        e.1 += j.cpus() as f64 * ran;
    }
    // Roll usage up the tree.
    let mut total_usage: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for (acct, u) in &own {
        let mut chain = policy.lineage(acct);
        chain.push(ROOT_ACCOUNT);
        for a in chain {
            let e = total_usage.entry(a).or_default();
            e.0 += u.0;
            e.1 += u.1;
        }
    }
    let billing = |u: (f64, f64)| u.0 * GPU_USAGE_WEIGHT + u.1;
    let cluster = billing(total_usage.get(ROOT_ACCOUNT).copied().unwrap_or_default());
    let mut sibling_shares: BTreeMap<&str, u64> = BTreeMap::new();
    for a in policy.accounts.values() {
        let s = sibling_shares.entry(parent_name(policy, &a.parent)).or_default();
        *s = s.saturating_add(u64::from(a.shares));
    }
    let mut out = BTreeMap::new();
    let names = std::iter::once(ROOT_ACCOUNT).chain(policy.accounts.keys().map(String::as_str));
    for name in names {
        let mut norm_shares = 1.0;
        // Every account in a lineage is in the policy (an unknown one is skipped).
        for acc in policy.lineage(name).into_iter().filter_map(|a| policy.accounts.get(a)) {
            let siblings = sibling_shares.get(parent_name(policy, &acc.parent)).copied().unwrap_or(1).max(1);
            norm_shares *= f64::from(acc.shares) / siblings as f64;
        }
        let u = total_usage.get(name).copied().unwrap_or_default();
        let norm_usage = if cluster > 0.0 { billing(u) / cluster } else { 0.0 };
        let factor = if norm_shares > 0.0 { 2f64.powf(-norm_usage / norm_shares) } else { 0.0 };
        out.insert(
            name.to_string(),
            Share { norm_shares, norm_usage, gpu_hours: u.0 / 3_600_000.0, cpu_hours: u.1 / 3_600_000.0, factor },
        );
    }
    out
}

fn parent_name<'a>(_policy: &'a ClusterPolicy, parent: &'a str) -> &'a str {
    if parent.is_empty() {
        ROOT_ACCOUNT
    } else {
        parent
    }
}

/// What a job's priority is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Factors {
    pub age: f64,
    pub fairshare: f64,
    pub job_size: f64,
    pub qos: f64,
    pub partition: f64,
    pub nice: f64,
    pub total: f64,
    /// The partition's priority tier (the first sort key).
    pub tier: u32,
}

/// Precomputed inputs of [`Prioritizer::factors`] for one pass.
pub struct Prioritizer<'a> {
    policy: &'a ClusterPolicy,
    shares: BTreeMap<String, Share>,
    max_qos: f64,
    max_tier: f64,
    total_gpus: f64,
    total_nodes: f64,
    now_ms: u64,
}

impl<'a> Prioritizer<'a> {
    pub fn new(state: &'a State, now_ms: u64) -> Prioritizer<'a> {
        let policy = &state.policy;
        let max_qos = policy.qos.values().map(|q| q.priority).max().unwrap_or(0).max(1) as f64;
        let max_tier = policy.partitions.values().map(|p| p.priority_tier).max().unwrap_or(1).max(1) as f64;
        let total_gpus = state.nodes.values().map(|n| n.gpus.len()).sum::<usize>() as f64;
        Prioritizer {
            policy,
            shares: fair_share(state, now_ms),
            max_qos,
            max_tier,
            total_gpus,
            total_nodes: state.nodes.len().max(1) as f64,
            now_ms,
        }
    }

    pub fn shares(&self) -> &BTreeMap<String, Share> {
        &self.shares
    }

    /// The partition tier (scheduled first, higher first).
    pub fn tier(&self, job: &Job) -> u32 {
        self.policy.partitions.get(&job.spec.partition).map_or(1, |p| p.priority_tier)
    }

    /// The queue order key: (partition tier, priority). A job requeued with
    /// `--requeue=expedite` after a node failure sorts above every tier (its
    /// priority factors stay what they are).
    pub fn key(&self, job: &Job) -> (u32, f64) {
        let f = self.factors(job);
        (if job.expedite_nodes.is_some() { u32::MAX } else { f.tier }, f.total)
    }

    pub fn factors(&self, job: &Job) -> Factors {
        let w = &self.policy.priority;
        let age_ms = self.now_ms.saturating_sub(job.submit_time_ms);
        let age = (age_ms as f64 / (w.max_age_s as f64 * 1000.0)).min(1.0);
        let fairshare = self.shares.get(&job.spec.account).map_or(0.5, |s| s.factor);
        let job_size = if self.total_gpus > 0.0 && job.spec.total_gpus() > 0 {
            (job.spec.total_gpus() as f64 / self.total_gpus).min(1.0)
        } else {
            (f64::from(job.spec.total_nodes()) / self.total_nodes).min(1.0)
        };
        let qos = self.policy.qos.get(&job.spec.qos).map_or(0.0, |q| f64::from(q.priority) / self.max_qos);
        let tier = self.tier(job);
        let partition = f64::from(tier) / self.max_tier;
        let nice = f64::from(job.spec.nice);
        let total = match job.priority_override {
            Some(p) => f64::from(p),
            None => {
                f64::from(w.age) * age
                    + f64::from(w.fairshare) * fairshare
                    + f64::from(w.job_size) * job_size
                    + f64::from(w.qos) * qos
                    + f64::from(w.partition) * partition
                    - nice
            }
        };
        Factors { age, fairshare, job_size, qos, partition, nice, total, tier }
    }
}
