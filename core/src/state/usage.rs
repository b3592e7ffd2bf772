//! The use and usage counters quotas and fair share read: what running
//! jobs hold per account, user and QOS (`running_use`), the decayed usage
//! buckets fair share charges finished runs to, and the quota checks.
//!
//! Related code: [`crate::sched`] (the reader of usage and quotas),
//! [`crate::policy`] (the quotas).

use std::collections::BTreeMap;

use super::{Applied, Outcome, RefusalKind, State, UseKey};
use crate::limits::*;
use crate::model::{Allocation, Job, JobId, JobState};
use crate::policy::Use;

pub use crate::model::UsageBucket;

/// Usage buckets are a quarter half-life wide: fine enough that decay is smooth.
pub fn usage_bucket_width_ms(half_life_s: u64) -> u64 {
    (half_life_s.saturating_mul(1000) / 4).max(1)
}

/// Adds a charge at `charge.start_ms` to the newest bucket while it is
/// younger than `width_ms`, else to a new one; the oldest beyond
/// `USAGE_BUCKETS_MAX` go.
fn charge_bucket(buckets: &mut std::collections::VecDeque<UsageBucket>, width_ms: u64, charge: UsageBucket) {
    match buckets.back_mut() {
        Some(b) if charge.start_ms < b.start_ms.saturating_add(width_ms) => {
            b.gpu_ms = b.gpu_ms.saturating_add(charge.gpu_ms);
            b.cpu_ms = b.cpu_ms.saturating_add(charge.cpu_ms);
        }
        _ => buckets.push_back(charge),
    }
    while buckets.len() > USAGE_BUCKETS_MAX {
        buckets.pop_front();
    }
}

/// One finished run for [`usage_from_runs`]: its account, when it ended, and
/// the GPU- and CPU-milliseconds it was charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargedRun {
    pub account: String,
    pub end_ms: u64,
    pub gpu_ms: u64,
    pub cpu_ms: u64,
}

/// Fair share's usage rebuilt from finished runs (the accounting store's
/// jobs): the buckets the state would hold had it charged each run at its
/// end, as `charge_usage` does, under a policy with `half_life_s`.
pub fn usage_from_runs(mut runs: Vec<ChargedRun>, half_life_s: u64) -> BTreeMap<String, Vec<UsageBucket>> {
    runs.sort_by(|a, b| (a.end_ms, &a.account).cmp(&(b.end_ms, &b.account)));
    let width_ms = usage_bucket_width_ms(half_life_s);
    let mut usage: BTreeMap<String, std::collections::VecDeque<UsageBucket>> = BTreeMap::new();
    for r in runs.into_iter().filter(|r| r.gpu_ms > 0 || r.cpu_ms > 0) {
        let charge = UsageBucket { start_ms: r.end_ms, gpu_ms: r.gpu_ms, cpu_ms: r.cpu_ms };
        charge_bucket(usage.entry(r.account).or_default(), width_ms, charge);
    }
    usage.into_iter().map(|(a, b)| (a, b.into())).collect()
}

/// Why restored usage (see `Command::RestoreUsage`) cannot be taken, if it
/// cannot: the field and the rule.
pub fn check_restored_usage(usage: &BTreeMap<String, Vec<UsageBucket>>, clock_ms: u64) -> Result<(), String> {
    if usage.len() > crate::policy::ACCOUNTS_MAX {
        return Err(format!("usage: at most {} accounts", crate::policy::ACCOUNTS_MAX));
    }
    for (account, buckets) in usage {
        crate::policy::check_ident("usage", account).map_err(|e| e.to_string())?;
        if buckets.len() > USAGE_BUCKETS_MAX {
            return Err(format!("usage.{account}: at most {USAGE_BUCKETS_MAX} buckets"));
        }
        if !buckets.iter().zip(buckets.iter().skip(1)).all(|(a, b)| a.start_ms < b.start_ms) {
            return Err(format!("usage.{account}: buckets must be oldest first, each starting later"));
        }
        if buckets.last().is_some_and(|b| b.start_ms > clock_ms) {
            return Err(format!("usage.{account}: a bucket starts after the cluster's clock"));
        }
    }
    Ok(())
}

/// Adds `n` seats under `key` (or takes them away, dropping a key that
/// reaches 0, so the derived maps compare equal to a recount).
pub(super) fn count_seats<K: Ord>(seats: &mut BTreeMap<K, u64>, key: K, n: u64, add: bool) {
    if add {
        let e = seats.entry(key).or_default();
        *e = e.saturating_add(n);
    } else if let Some(e) = seats.get_mut(&key) {
        *e = e.saturating_sub(n);
        if *e == 0 {
            seats.remove(&key);
        }
    }
}

/// What an allocation holds.
pub fn alloc_use(alloc: &Allocation) -> Use {
    Use {
        gpus: alloc.nodes.iter().map(|n| n.gpus.len() as u64).sum(),
        cpus: alloc.nodes.iter().map(|n| u64::from(n.cpus)).sum(),
        jobs: 1,
    }
}

impl State {
    /// Recomputes the quota counters from the jobs (after the account tree changed).
    pub(super) fn rebuild_use(&mut self) {
        self.running_use.clear();
        self.licenses_used.clear();
        self.licenses_held.clear();
        self.deadline_jobs.clear();
        self.active_by_user.clear();
        self.active_jobs.clear();
        self.unfinished_bytes.clear();
        let active: Vec<JobId> = self.pending.iter().chain(self.running.iter()).copied().collect();
        for id in active {
            self.count_active(id, true);
            if let Some(alloc) = self.jobs.get(&id).and_then(|j| j.allocation.clone()) {
                self.count_running(id, &alloc, true);
            }
        }
    }

    /// Counts an allocation in (or out of) the running-use counters.
    pub(super) fn count_running(&mut self, job_id: JobId, alloc: &Allocation, add: bool) {
        let u = alloc_use(alloc);
        let licenses = self.jobs.get(&job_id).map(|j| j.spec.licenses.clone()).unwrap_or_default();
        for (name, n) in licenses {
            count_seats(&mut self.licenses_used, name, u64::from(n), add);
        }
        self.count_held_licenses(job_id, add);
        for k in self.use_keys(job_id) {
            let e = self.running_use.entry(k.clone()).or_default();
            if add {
                e.add(u);
            } else {
                e.sub(u);
                if *e == Use::default() {
                    self.running_use.remove(&k);
                }
            }
        }
    }

    /// The first running quota (account tree, user, QOS per user) that starting
    /// `job` with `extra` would exceed, as a reason.
    pub fn quota_exceeded(&self, job: &Job, extra: Use) -> Option<String> {
        self.quota_exceeded_with(job, extra, &BTreeMap::new())
    }

    /// As [`State::quota_exceeded`], with `planned` use (a plan being built) on
    /// top of the committed use.
    pub fn quota_exceeded_with(&self, job: &Job, extra: Use, planned: &BTreeMap<UseKey, Use>) -> Option<String> {
        let current = |k: &UseKey| {
            let mut u = self.running_use.get(k).copied().unwrap_or_default();
            if let Some(x) = planned.get(k) {
                u.add(*x);
            }
            u
        };
        self.quota_exceeded_at(job, extra, &current)
    }

    /// As [`State::quota_exceeded`], as if the running `victims` had stopped
    /// (a preemptor's check: their use no longer counts).
    pub fn quota_exceeded_releasing(&self, job: &Job, extra: Use, victims: &[&Job]) -> Option<String> {
        let mut released: BTreeMap<UseKey, Use> = BTreeMap::new();
        for v in victims {
            let Some(alloc) = v.allocation.as_ref().filter(|_| v.state == JobState::Running) else { continue };
            for k in self.use_keys_of(v) {
                released.entry(k).or_default().add(alloc_use(alloc));
            }
        }
        let current = |k: &UseKey| {
            let u = self.running_use.get(k).copied().unwrap_or_default();
            // Saturating: a check never panics, whatever the bookkeeping says.
            let x = released.get(k).copied().unwrap_or_default();
            Use {
                gpus: u.gpus.saturating_sub(x.gpus),
                cpus: u.cpus.saturating_sub(x.cpus),
                jobs: u.jobs.saturating_sub(x.jobs),
            }
        };
        self.quota_exceeded_at(job, extra, &current)
    }

    /// The quota check over `current` use per key.
    fn quota_exceeded_at(&self, job: &Job, extra: Use, current: &dyn Fn(&UseKey) -> Use) -> Option<String> {
        let p = &self.policy;
        let spec = &job.spec;
        for a in p.lineage(&spec.account) {
            let Some(acc) = p.accounts.get(a) else { continue };
            let used = current(&UseKey::Account(a.to_string()));
            if let Some((what, max)) = acc.quota.exceeded_by(used, extra) {
                let only_gpus = acc.quota.exceeded_by(used, Use { gpus: 0, ..extra }).is_none();
                if !(only_gpus && self.may_borrow(a, used, extra.gpus, current)) {
                    return Some(format!("AssocGrpLimit: account {a} {what} limit {max}"));
                }
            }
        }
        if let Some(u) = p.users.get(&spec.user) {
            if let Some((what, max)) = u.quota.exceeded_by(current(&UseKey::User(spec.user.clone())), extra) {
                return Some(format!("AssocMaxLimit: user {} {what} limit {max}", spec.user));
            }
        }
        if let Some(q) = p.qos.get(&spec.qos) {
            let key = UseKey::QosUser(spec.qos.clone(), spec.user.clone());
            if let Some((what, max)) = q.per_user.exceeded_by(current(&key), extra) {
                return Some(format!("QOSMaxPerUser: QOS {} {what} per user limit {max}", spec.qos));
            }
        }
        None
    }

    /// Whether `account` may run `extra` more GPUs beyond its GPU quota on
    /// idle quota of its siblings: within its `borrow_gpus`, and the cohort
    /// (it and its siblings, all with GPU quotas) stays within the sum of their quotas.
    fn may_borrow(&self, account: &str, used: Use, extra: u64, current: &dyn Fn(&UseKey) -> Use) -> bool {
        let p = &self.policy;
        let Some(acc) = p.accounts.get(account) else { return false };
        let Some(own) = acc.quota.max_running_gpus else { return false };
        let wanted = used.gpus.saturating_add(extra);
        if acc.borrow_gpus == 0 || wanted > u64::from(own).saturating_add(u64::from(acc.borrow_gpus)) {
            return false;
        }
        let (mut cohort_quota, mut cohort_used) = (u64::from(own), used.gpus);
        for s in p.siblings(account) {
            let Some(q) = p.accounts.get(s).and_then(|a| a.quota.max_running_gpus) else { return false };
            cohort_quota = cohort_quota.saturating_add(u64::from(q));
            cohort_used = cohort_used.saturating_add(current(&UseKey::Account(s.to_string())).gpus);
        }
        cohort_used.saturating_add(extra) <= cohort_quota
    }

    /// Adds an ending allocation's GPU- and CPU-time to its account's usage.
    pub(super) fn charge_usage(&mut self, job_id: JobId, alloc: &Allocation) {
        let Some(job) = self.jobs.get(&job_id) else { return };
        let now = self.clock_ms;
        let ran_ms = now.saturating_sub(job.start_time_ms.unwrap_or(now));
        // From format 11 the time it was suspended is not charged (its
        // processes were stopped); before, it was, and old logs replay so.
        let ran_ms = if self.format >= crate::format::UNCHARGED_SUSPENSION_FORMAT {
            ran_ms.saturating_sub(job.suspended_total_ms(now))
        } else {
            ran_ms
        };
        let u = alloc_use(alloc);
        let (gpu_ms, cpu_ms) = (u.gpus.saturating_mul(ran_ms), u.cpus.saturating_mul(ran_ms));
        if gpu_ms == 0 && cpu_ms == 0 {
            return;
        }
        let width_ms = usage_bucket_width_ms(self.policy.fairshare_half_life_s);
        let buckets = self.usage.entry(job.spec.account.clone()).or_default();
        charge_bucket(buckets, width_ms, UsageBucket { start_ms: now, gpu_ms, cpu_ms });
    }

    /// Replaces fair share's usage with buckets rebuilt from the accounting
    /// store: admins only; refused whole unless every account name is one,
    /// each account's buckets are at most `USAGE_BUCKETS_MAX`, oldest first,
    /// and none starts after the replicated clock.
    pub(super) fn apply_restore_usage(
        &mut self,
        usage: &BTreeMap<String, Vec<UsageBucket>>,
        identity: &str,
    ) -> Applied {
        if let Some(refused) = self.needs_accounting_format() {
            return refused;
        }
        if !self.is_admin(identity) {
            return Applied::refused(
                RefusalKind::PermissionDenied,
                format!("permission: {identity} is not an admin of this cluster"),
            );
        }
        if let Err(e) = check_restored_usage(usage, self.clock_ms) {
            return Applied::refused(RefusalKind::InvalidArgument, e);
        }
        self.usage = usage
            .iter()
            .filter(|(_, b)| !b.is_empty())
            .map(|(account, b)| (account.clone(), b.iter().copied().collect()))
            .collect();
        let accounts = u32::try_from(self.usage.len()).unwrap_or(u32::MAX);
        Applied { outcome: Outcome::UsageRestored { accounts }, events: Vec::new() }
    }
}
