//! The administrators' changes to the cluster: policy updates (with the
//! checks that keep jobs and quotas whole), the node inventory, a restored
//! cluster's history, and the accounting store's cursor.
//!
//! Related code: [`crate::policy`] (what the policy holds), [`crate::sched`]
//! (the reader of usage and quotas).

use super::{Applied, Outcome, RefusalKind, State, UseKey};
use crate::model::NodeState;
use crate::policy::{ClusterPolicy, Quota, Use, ROLES_FORMAT};

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

    /// A refusal for a command of format 13 in an older cluster (the
    /// leader never writes one there; a log that holds one anyway is not
    /// applied differently by builds that know it).
    pub(super) fn needs_accounting_format(&self) -> Option<Applied> {
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
}
