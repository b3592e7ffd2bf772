//! Policy updates, job updates (hold/release/priority/nice/requeue/time limit),
//! preemption plans, checkpoints, and the use/usage counters that quotas and
//! fair share read.
//!
//! Related code: [`crate::policy`] (what the policy holds), [`crate::sched`]
//! (the reader of usage and quotas).

use std::collections::BTreeMap;

use super::{Applied, JobEvent, Outcome, RefusalKind, State, UseKey};
use crate::command::{JobChange, Placement, Preemption};
use crate::format::PLAN_APPLY_FORMAT;
use crate::limits::*;
use crate::model::{Allocation, HoldKind, Job, JobId, JobState, NodeState, StopCause};
use crate::policy::{ClusterPolicy, PreemptMode, Quota, Use, ROLES_FORMAT};

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

impl State {
    pub(super) fn apply_update_policy(
        &mut self,
        index: u64,
        policy: &ClusterPolicy,
        expected_version: Option<u64>,
        force: bool,
        identity: &str,
    ) -> Applied {
        let admin = self.is_admin(identity);
        let coordinated: Vec<String> = if admin || self.format < ROLES_FORMAT {
            Vec::new()
        } else {
            self.policy.coordinated(identity).into_iter().map(str::to_string).collect()
        };
        if !admin && coordinated.is_empty() {
            return Applied::refused(
                RefusalKind::PermissionDenied,
                format!("permission: {identity} is not an admin of this cluster"),
            );
        }
        let needs = policy.needs_format();
        if needs > self.format {
            return Applied::refused(
                RefusalKind::FailedPrecondition,
                format!(
                    "this policy needs data format {needs} (operators, coordinators, user_map, user_domains, \
                     allow_root_jobs and private_jobs need 6, licenses 9, license limits per account or QOS 11, a \
                     QOS preempt mode suspend and node pools 12); this cluster is on format {} until every replica \
                     runs a build that reads {needs}",
                    self.format
                ),
            );
        }
        if let Some(v) = expected_version {
            if v != self.policy.version {
                return Applied::refused(
                    RefusalKind::Stale,
                    format!("the policy changed (version {} now, edit was based on {v}); retry", self.policy.version),
                );
            }
        }
        if let Err(e) = policy.validate() {
            return Applied::refused(RefusalKind::InvalidArgument, e.to_string());
        }
        let mut next = policy.clone();
        // A policy that names no admins keeps the current ones: an import of a
        // file without them must not lock every admin out (nothing is allowed
        // to anyone when no admin is named).
        if next.admins.is_empty() {
            next.admins = self.policy.admins.clone();
        }
        if !admin {
            if force {
                return Applied::refused(
                    RefusalKind::PermissionDenied,
                    "permission: force: only admins may force a policy change",
                );
            }
            let mine: Vec<&str> = coordinated.iter().map(String::as_str).collect();
            if let Err(e) = crate::policy::coordinator_change(
                &self.policy,
                &next,
                &mine,
                self.format >= crate::format::NODE_ADMISSION_FORMAT,
            ) {
                return Applied::refused(RefusalKind::PermissionDenied, format!("permission: {e}"));
            }
            if let Some(why) = self.account_names_in_use(&self.policy, &next) {
                return Applied::refused(RefusalKind::PermissionDenied, format!("permission: {why}"));
            }
        }
        if let Some(why) = self.pool_nodes_over_limit(&next) {
            return Applied::refused(RefusalKind::ResourceExhausted, why);
        }
        next.version = self.policy.version.saturating_add(1);
        let previous = std::mem::replace(&mut self.policy, next);
        self.rebuild_use();
        if !force {
            if let Some(why) = self.quota_below_use().or_else(|| self.orphaned_jobs()) {
                self.policy = previous;
                self.rebuild_use();
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("{why}; pass --force to set it anyway"),
                );
            }
        }
        let events = self.sync_pool_nodes(index);
        Applied { outcome: Outcome::PolicyUpdated { version: self.policy.version }, events }
    }

    /// For a coordinator's edit: an account it adds or removes that a kept
    /// job names. Removing one would take its running jobs out of the quotas
    /// above it; adding one of a retired name would hand its jobs to the
    /// coordinator. (Admins may: they see the whole cluster.)
    fn account_names_in_use(&self, old: &ClusterPolicy, new: &ClusterPolicy) -> Option<String> {
        let changed: std::collections::BTreeSet<&String> =
            old.accounts.keys().filter(|a| !new.accounts.contains_key(*a)).collect::<std::collections::BTreeSet<_>>();
        let added: std::collections::BTreeSet<&String> =
            new.accounts.keys().filter(|a| !old.accounts.contains_key(*a)).collect();
        if changed.is_empty() && added.is_empty() {
            return None;
        }
        self.jobs.values().find(|j| changed.contains(&j.spec.account) || added.contains(&j.spec.account)).map(|j| {
            format!(
                "accounts.{}: job {} still names this account; only an admin may add or remove it",
                j.spec.account, j.id
            )
        })
    }

    /// An object the new policy removed although pending jobs still need it
    /// (running jobs just finish where they are).
    fn orphaned_jobs(&self) -> Option<String> {
        let p = &self.policy;
        for (id, s) in self.pending.iter().filter_map(|id| Some((id, &self.jobs.get(id)?.spec))) {
            if !p.account_exists(&s.account) {
                return Some(format!("accounts.{}: pending jobs (e.g. {id}) still charge it", s.account));
            }
            if !p.qos_exists(&s.qos) {
                return Some(format!("qos.{}: pending jobs (e.g. {id}) still use it", s.qos));
            }
            // A heterogeneous job waits in each of its components' partitions.
            let partitions = std::iter::once(&s.partition).chain(s.components.iter().map(|c| &c.partition));
            for partition in partitions {
                let part_ok = if p.partitions.is_empty() {
                    *partition == crate::policy::DEFAULT_PARTITION
                } else {
                    p.partitions.contains_key(partition)
                };
                if !part_ok {
                    return Some(format!("partitions.{partition}: pending jobs (e.g. {id}) wait in it"));
                }
            }
        }
        None
    }

    /// The first quota that current use already exceeds.
    fn quota_below_use(&self) -> Option<String> {
        let p = &self.policy;
        let mut quotas: Vec<(UseKey, &Quota, String)> = Vec::new();
        for (name, a) in &p.accounts {
            quotas.push((UseKey::Account(name.clone()), &a.quota, format!("accounts.{name}.quota")));
        }
        for (name, u) in &p.users {
            quotas.push((UseKey::User(name.clone()), &u.quota, format!("users.{name}.quota")));
        }
        for (key, quota, field) in quotas {
            let running = self.running_use.get(&key).copied().unwrap_or_default();
            if let Some((what, max)) = quota.exceeded_by(running, Use::default()) {
                return Some(format!("{field}: {what} limit {max} is below current use"));
            }
            let active = self.active_jobs.get(&key).copied().unwrap_or(0);
            if let Some(max) = quota.max_submitted_jobs.filter(|&m| active > u64::from(m)) {
                return Some(format!("{field}: max_submitted_jobs {max} is below the {active} unfinished jobs"));
            }
        }
        None
    }

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

    /// A refusal for a command of format 13 in an older cluster (the
    /// leader never writes one there; a log that holds one anyway is not
    /// applied differently by builds that know it).
    fn needs_accounting_format(&self) -> Option<Applied> {
        (self.format < crate::format::ACCOUNTING_FORMAT).then(|| {
            Applied::refused(
                RefusalKind::FailedPrecondition,
                format!(
                    "this needs data format {}; the cluster is on {}",
                    crate::format::ACCOUNTING_FORMAT,
                    self.format
                ),
            )
        })
    }

    /// [`Command::DrawHistory`]: once, after a restore, a history that is
    /// neither the first (0) nor the one derived from the backup.
    pub(super) fn apply_draw_history(&mut self, history: u64) -> Applied {
        let needs = crate::format::FRESH_HISTORY_FORMAT;
        if self.format < needs {
            return Applied::refused(RefusalKind::FailedPrecondition, format!("history: needs data format {needs}"));
        }
        if !self.history_pending {
            return Applied::refused(RefusalKind::Stale, "history: drawn already (only a restore leaves one to draw)");
        }
        if history == 0 || history == self.history {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                "history: must differ from the first history (0) and from the one the backup gave",
            );
        }
        self.history = history;
        self.history_pending = false;
        Applied { outcome: Outcome::HistoryDrawn { history }, events: Vec::new() }
    }

    /// [`Command::SetNodeInventory`]: admins only, at the version the edit
    /// read. Nodes with an agent that the new inventory does not admit (left
    /// out, retired, or claiming more than their class now allows) go down
    /// with the reason, and their jobs are requeued or end as on a node
    /// failure; they come back only by registering what they may claim.
    pub(super) fn apply_set_node_inventory(
        &mut self,
        index: u64,
        inventory: &crate::inventory::NodeInventory,
        expected_version: Option<u64>,
        identity: &str,
    ) -> Applied {
        let needs = crate::format::NODE_ADMISSION_FORMAT;
        if self.format < needs {
            return Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("node inventory: needs data format {needs}; this cluster is on format {}", self.format),
            );
        }
        if !self.is_admin(identity) {
            return Applied::refused(
                RefusalKind::PermissionDenied,
                format!("permission: {identity} is not an admin of this cluster (only admins admit nodes)"),
            );
        }
        if let Some(v) = expected_version.filter(|v| *v != self.node_inventory.version) {
            return Applied::refused(
                RefusalKind::Stale,
                format!(
                    "the node inventory changed (version {} now, edit was based on {v}); retry",
                    self.node_inventory.version
                ),
            );
        }
        if let Err(e) = inventory.validate() {
            return Applied::refused(RefusalKind::InvalidArgument, e.to_string());
        }
        let mut next = inventory.clone();
        next.version = self.node_inventory.version.saturating_add(1);
        self.node_inventory = next;
        let mut revoked = Vec::new();
        for node in self.nodes.values() {
            if matches!(node.state, NodeState::Down | NodeState::PoweredDown) {
                continue;
            }
            if let Err(e) = self.node_inventory.admit(&crate::inventory::Claim::of_node(node)) {
                revoked.push((node.name.clone(), format!("not admitted by the node inventory: {e}")));
            }
        }
        let mut events = Vec::new();
        for (name, why) in &revoked {
            let now = self.clock_ms;
            if let Some(node) = self.nodes.get_mut(name) {
                node.state = NodeState::Down;
                node.state_reason.clone_from(why);
                node.state_changed_ms = now;
            }
            events.extend(self.end_jobs_on(index, name, why));
        }
        let revoked = revoked.into_iter().map(|(name, _)| name).collect();
        Applied { outcome: Outcome::NodeInventorySet { version: self.node_inventory.version, revoked }, events }
    }

    /// The accounting store has every job through `stored` (an entry
    /// before this one, `index`): operators and admins only; it never goes
    /// back. Finished jobs it now holds may go past `finished_jobs_kept`.
    pub(super) fn apply_accounting_stored(&mut self, index: u64, stored: u64, identity: &str) -> Applied {
        if let Some(refused) = self.needs_accounting_format() {
            return refused;
        }
        if !self.is_operator(identity) {
            return Applied::refused(
                RefusalKind::PermissionDenied,
                format!("permission: {identity} is not an operator or admin of this cluster"),
            );
        }
        if stored >= index {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                format!("index: {stored} is not an entry before this one ({index})"),
            );
        }
        self.accounted_index = self.accounted_index.max(stored);
        self.purge_finished();
        Applied { outcome: Outcome::AccountingStored { index: self.accounted_index }, events: Vec::new() }
    }

    pub(super) fn apply_update_job(
        &mut self,
        index: u64,
        job_id: JobId,
        change: &JobChange,
        identity: &str,
    ) -> Applied {
        // Operators hold the admin's powers over jobs.
        let admin = self.is_operator(identity);
        let job = match self.changeable_job(job_id, identity, "change") {
            Ok(job) => job,
            Err(refused) => return refused,
        };
        let pending = job.state == JobState::Pending;
        // Found above; apply refuses rather than panics if that ever changed.
        let gone = || Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist"));
        let not_pending = || {
            Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("job {job_id} is {}, not pending", job.state.as_str()),
            )
        };
        let mut events = Vec::new();
        match change {
            JobChange::Hold { admin: as_admin } => {
                if !pending {
                    return not_pending();
                }
                if *as_admin && !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: admin holds need an operator or admin",
                    );
                }
                if job.held == Some(HoldKind::Admin) && !*as_admin {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is already held by an admin"),
                    );
                }
                let hold = if *as_admin { HoldKind::Admin } else { HoldKind::User };
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.held = Some(hold);
                job.reason = hold.as_str().to_string();
            }
            JobChange::Release => {
                if job.held.is_none() {
                    return Applied::refused(RefusalKind::FailedPrecondition, format!("job {job_id} is not held"));
                }
                if job.held == Some(HoldKind::Admin) && !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: an admin hold can only be released by an operator or admin",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.held = None;
                job.reason.clear();
            }
            JobChange::SetPriority(p) => {
                if !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: only operators and admins set priorities",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.priority_override = *p;
            }
            JobChange::SetNice(n) => {
                if n.unsigned_abs() > NICE_MAX.unsigned_abs() {
                    return Applied::refused(RefusalKind::InvalidArgument, format!("nice: must be within ±{NICE_MAX}"));
                }
                if *n < 0 && !admin {
                    return Applied::refused(
                        RefusalKind::InvalidArgument,
                        "nice: only operators and admins may set a negative value",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.spec.nice = *n;
            }
            JobChange::Requeue { hold } => {
                if job.state != JobState::Running {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is {}, not running", job.state.as_str()),
                    );
                }
                if job.attempt >= ATTEMPTS_MAX {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} made {ATTEMPTS_MAX} attempts, its limit"),
                    );
                }
                self.note_stop(job_id, StopCause::RequeuedBy { identity: identity.to_string() });
                events.extend(self.requeue_job(index, job_id, format!("requeued by {identity}")));
                if *hold {
                    let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                    job.held = Some(HoldKind::User);
                }
            }
            JobChange::SetTimeLimit(t) => {
                if *t == 0 || *t > TIME_LIMIT_S_MAX {
                    return Applied::refused(
                        RefusalKind::InvalidArgument,
                        format!("time_limit_s: must be between 1 and {TIME_LIMIT_S_MAX}"),
                    );
                }
                if *t > job.spec.time_limit_s && !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: only operators and admins may raise a time limit",
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                job.spec.time_limit_s = *t;
                // An explicit limit replaces the one a shortened start kept.
                job.requested_limit_s = 0;
            }
            JobChange::Signal { signal, target } => {
                if self.format < crate::format::SUSPEND_FORMAT {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("signal: needs data format {}", crate::format::SUSPEND_FORMAT),
                    );
                }
                if !(1..=crate::limits::SIGNAL_SEND_MAX).contains(signal) {
                    return Applied::refused(
                        RefusalKind::InvalidArgument,
                        format!("signal: must be 1..={}, got {signal}", crate::limits::SIGNAL_SEND_MAX),
                    );
                }
                if job.state != JobState::Running {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is {}, not running", job.state.as_str()),
                    );
                }
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                let seq = job.signal.map_or(1, |s| s.seq.saturating_add(1));
                job.signal = Some(crate::model::JobSignal { seq, signal: *signal, target: *target });
            }
            JobChange::Suspend | JobChange::Resume => {
                let suspend = *change == JobChange::Suspend;
                let verb = if suspend { "suspend" } else { "resume" };
                if self.format < crate::format::SUSPEND_FORMAT {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("{verb}: needs data format {}", crate::format::SUSPEND_FORMAT),
                    );
                }
                if !admin {
                    return Applied::refused(
                        RefusalKind::PermissionDenied,
                        "permission: only operators and admins suspend and resume jobs",
                    );
                }
                if job.state != JobState::Running {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!("job {job_id} is {}, not running", job.state.as_str()),
                    );
                }
                if suspend == job.is_suspended() {
                    let what = if suspend { "already suspended" } else { "not suspended" };
                    return Applied::refused(RefusalKind::FailedPrecondition, format!("job {job_id} is {what}"));
                }
                if !suspend && job.is_yielded() {
                    return Applied::refused(
                        RefusalKind::FailedPrecondition,
                        format!(
                            "job {job_id} was suspended by preemption and gave its CPUs and GPUs to another job; \
                             it resumes by itself once they are free again"
                        ),
                    );
                }
                let now = self.clock_ms;
                let Some(job) = self.jobs.get_mut(&job_id) else { return gone() };
                if suspend {
                    job.suspended_at_ms = Some(now);
                } else {
                    job.suspended_ms = job.suspended_total_ms(now);
                    job.suspended_at_ms = None;
                }
                let done = if suspend { "suspended" } else { "resumed" };
                events.push(JobEvent {
                    index,
                    job_id,
                    state: JobState::Running,
                    attempt: job.attempt,
                    reason: format!("{done} by {identity}"),
                    suspended: Some(suspend),
                    step: None,
                    usage: false,
                });
            }
        }
        Applied { outcome: Outcome::JobUpdated { job_id }, events }
    }

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

    pub(super) fn apply_job_checkpointed(&mut self, job_id: JobId, attempt: u32) -> Applied {
        let now = self.clock_ms;
        match self.jobs.get_mut(&job_id) {
            Some(job) if job.state == JobState::Running && job.attempt == attempt => {
                job.last_checkpoint_ms = Some(now);
                Applied { outcome: Outcome::CheckpointRecorded { job_id }, events: Vec::new() }
            }
            Some(_) => Applied::refused(RefusalKind::Stale, format!("job {job_id} attempt {attempt} is not running")),
            None => Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist")),
        }
    }
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
