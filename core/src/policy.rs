//! Cluster policy: partitions, the account tree, users' memberships, QOS levels,
//! quotas, priority weights and topology level names — replicated state that
//! admins change at run time (`gangway admin ...`) or import from a TOML file.
//!
//! The whole policy is one value ([`ClusterPolicy`]) replaced atomically by
//! `Command::UpdatePolicy`, validated as a whole (no cycles in the account tree,
//! names that resolve, limits in range) and compare-and-set on `version`, so two
//! admins editing at once cannot silently undo each other.
//!
//! An empty policy is a working cluster: one implicit partition holding every
//! node, every job in the `root` account, the `normal` QOS, no quotas.
//!
//! Related code: [`crate::state`] applies updates and resolves submissions
//! against the policy; [`crate::sched`] reads priorities, quotas and partitions.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::spec::SpecError;

/// The account every job belongs to when the policy names none (and the root of
/// the account tree).
pub const ROOT_ACCOUNT: &str = "root";
/// The QOS a job gets when neither it, its partition nor the policy names one.
pub const DEFAULT_QOS: &str = "normal";
/// The implicit partition when the policy defines none.
pub const DEFAULT_PARTITION: &str = "default";

/// Partitions in one cluster: they are a scheduler index per pass (bitmask of 64).
pub const PARTITIONS_MAX: usize = 64;
pub use crate::limits::ACCOUNTS_MAX;
/// Users with a policy entry.
pub const USERS_MAX: usize = 100_000;
/// QOS levels: a handful in practice (Slurm sites use 3-20).
pub const QOS_MAX: usize = 64;
/// Depth of the account tree: bounds every walk up to the root.
pub const ACCOUNT_DEPTH_MAX: usize = 16;
/// Node-name patterns per partition (hostlist patterns like `gpu[001-512]`).
pub const PARTITION_NODE_PATTERNS_MAX: usize = 256;
/// Accounts one user may belong to.
pub const USER_ACCOUNTS_MAX: usize = 256;
/// Reservation depth of EASY backfill: how many top jobs get a reservation per
/// pass. Each costs a sweep over running jobs' end times.
pub const BACKFILL_RESERVATIONS_MAX: u32 = 64;
/// Longest fair-share half-life: a year (usage older than a few half-lives no
/// longer counts).
pub const HALF_LIFE_S_MAX: u64 = 365 * 24 * 3600;
/// Admin identities: a short list of operators and automation accounts.
pub const ADMINS_MAX: usize = 256;
/// A priority weight: keeps weighted sums far from u64 overflow.
pub const PRIORITY_WEIGHT_MAX: u32 = 1_000_000;
/// Operator identities: like admins, a short list of people and automation.
pub const OPERATORS_MAX: usize = 256;
/// Coordinators of one account (Slurm sites name a few per project).
pub const ACCOUNT_COORDINATORS_MAX: usize = 64;
/// Entries in the identity-to-user map: one per person or service whose
/// certificate or token names them otherwise than their Unix account.
pub const USER_MAP_MAX: usize = 100_000;
/// Domains stripped from identities (`alice@corp.example` runs as `alice`).
pub const USER_DOMAINS_MAX: usize = 16;
/// The first data format that carries the roles, the user map and the
/// cluster-wide job switches below (see [`ClusterPolicy::needs_format`]).
pub const ROLES_FORMAT: u32 = 6;

/// Running/submitted limits on one account, user or QOS. `None` is unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Quota {
    pub max_running_gpus: Option<u32>,
    pub max_running_cpus: Option<u32>,
    pub max_running_jobs: Option<u32>,
    /// Pending + running jobs (checked at submit).
    pub max_submitted_jobs: Option<u32>,
}

impl Quota {
    pub fn is_empty(&self) -> bool {
        *self == Quota::default()
    }
}

/// What a running job holds, for quota checks and use counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Use {
    pub gpus: u64,
    pub cpus: u64,
    pub jobs: u64,
}

impl Use {
    pub fn add(&mut self, other: Use) {
        self.gpus = self.gpus.saturating_add(other.gpus);
        self.cpus = self.cpus.saturating_add(other.cpus);
        self.jobs = self.jobs.saturating_add(other.jobs);
    }

    /// Saturating: the use counters are derived (`State::check_invariants`
    /// recounts them), and a drift must never stop every replica.
    pub fn sub(&mut self, other: Use) {
        self.gpus = self.gpus.saturating_sub(other.gpus);
        self.cpus = self.cpus.saturating_sub(other.cpus);
        self.jobs = self.jobs.saturating_sub(other.jobs);
    }
}

impl Quota {
    /// The first running limit that `current + extra` would exceed, as
    /// `(what, limit)`, or None.
    pub fn exceeded_by(&self, current: Use, extra: Use) -> Option<(&'static str, u32)> {
        let checks = [
            ("running GPUs", self.max_running_gpus, current.gpus.saturating_add(extra.gpus)),
            ("running CPUs", self.max_running_cpus, current.cpus.saturating_add(extra.cpus)),
            ("running jobs", self.max_running_jobs, current.jobs.saturating_add(extra.jobs)),
        ];
        checks.into_iter().find_map(|(what, max, v)| max.filter(|&m| v > u64::from(m)).map(|m| (what, m)))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Partition {
    /// Node-name patterns (`gpu[001-128]`, `node-*`, exact names); empty: every node.
    pub nodes: Vec<String>,
    /// Jobs that name no partition go to the default one.
    pub default: bool,
    /// Time limit for jobs that give none (seconds; 0 = the cluster default).
    pub default_time_s: u64,
    /// Longest time limit a job may ask for here (0 = no partition limit).
    pub max_time_s: u64,
    /// Memory per allocated CPU / GPU for jobs that give no memory (MiB, 0 = none).
    pub default_mem_per_cpu_mb: u64,
    pub default_mem_per_gpu_mb: u64,
    /// Higher tiers are scheduled first (Slurm's PriorityTier) and weigh in priority.
    pub priority_tier: u32,
    /// Accounts allowed here (and their sub-accounts); empty: all.
    pub allow_accounts: Vec<String>,
    /// QOS for jobs here that name none (empty: the cluster default).
    pub default_qos: String,
    /// Largest gang allowed here, in nodes (0 = no partition limit).
    pub max_nodes: u32,
}

impl Default for Partition {
    fn default() -> Self {
        Partition {
            nodes: Vec::new(),
            default: false,
            default_time_s: 0,
            max_time_s: 0,
            default_mem_per_cpu_mb: 0,
            default_mem_per_gpu_mb: 0,
            priority_tier: 1,
            allow_accounts: Vec::new(),
            default_qos: String::new(),
            max_nodes: 0,
        }
    }
}

impl Partition {
    /// Whether `node` belongs to this partition.
    pub fn contains(&self, node: &str) -> bool {
        self.nodes.is_empty() || self.nodes.iter().any(|p| pattern_matches(p, node))
    }
}

/// Matches a node name against `*` globs and `prefix[001-010,015]suffix` ranges.
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    if let Some((prefix, rest)) = pattern.split_once('[') {
        let Some((ranges, suffix)) = rest.split_once(']') else { return pattern == name };
        let Some(mid) = name.strip_prefix(prefix).and_then(|r| r.strip_suffix(suffix)) else { return false };
        if mid.is_empty() || !mid.chars().all(|c| c.is_ascii_digit()) {
            return false;
        }
        let Ok(n) = mid.parse::<u64>() else { return false };
        return ranges.split(',').any(|r| match r.split_once('-') {
            Some((a, b)) => {
                let width_ok = a.len() == mid.len() || !a.starts_with('0');
                width_ok && a.parse::<u64>().is_ok_and(|a| a <= n) && b.parse::<u64>().is_ok_and(|b| n <= b)
            }
            None => r == mid,
        });
    }
    match pattern.split_once('*') {
        Some((pre, post)) => {
            name.len() >= pre.len().saturating_add(post.len()) && name.starts_with(pre) && name.ends_with(post)
        }
        None => pattern == name,
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Account {
    /// The parent account; empty means directly under `root`.
    pub parent: String,
    /// Fair-share shares relative to sibling accounts.
    pub shares: u32,
    pub quota: Quota,
    /// GPUs this account may run beyond its `max_running_gpus` while sibling
    /// accounts (same parent, all with GPU quotas) leave theirs idle. Jobs
    /// started on borrowed GPUs are preempted when a sibling needs its quota
    /// back. 0: no borrowing.
    pub borrow_gpus: u32,
    pub description: String,
}

impl Default for Account {
    fn default() -> Self {
        Account {
            parent: String::new(),
            shares: 1,
            quota: Quota::default(),
            borrow_gpus: 0,
            description: String::new(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct User {
    /// Accounts the user may charge; the first is the default.
    pub accounts: Vec<String>,
    /// Limits on this user's own jobs (across accounts).
    pub quota: Quota,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreemptMode {
    /// Victims go back to the queue (keeping their priority age).
    Requeue,
    /// Victims end CANCELLED.
    Cancel,
    /// Victims are suspended (their tasks stopped, as `scontrol suspend`
    /// stops them) and give their CPUs and GPUs to the preemptor; they keep
    /// their memory, licenses and quota use, and resume by themselves once
    /// their CPUs and GPUs are free again. Since format 12.
    Suspend,
}

impl PreemptMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PreemptMode::Requeue => "requeue",
            PreemptMode::Cancel => "cancel",
            PreemptMode::Suspend => "suspend",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Qos {
    /// Weighs into priority (normalized by the highest QOS priority).
    pub priority: u32,
    /// Longest time limit under this QOS (0 = none).
    pub max_time_s: u64,
    /// Limits per user running under this QOS.
    pub per_user: Quota,
    /// QOS levels whose jobs this QOS may preempt.
    pub preempt: Vec<String>,
    pub preempt_mode: PreemptMode,
    /// Seconds between the warning signal (SIGTERM) and the kill of a victim.
    pub preempt_grace_s: u32,
}

impl Default for Qos {
    fn default() -> Self {
        Qos {
            priority: 0,
            max_time_s: 0,
            per_user: Quota::default(),
            preempt: Vec::new(),
            preempt_mode: PreemptMode::Requeue,
            preempt_grace_s: 30,
        }
    }
}

/// Multifactor priority weights (Slurm's PriorityWeight*). Each factor is
/// normalized to 0..=1 and multiplied by its weight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PriorityWeights {
    pub age: u32,
    pub fairshare: u32,
    pub job_size: u32,
    pub qos: u32,
    pub partition: u32,
    /// Age at which the age factor reaches 1 (Slurm's PriorityMaxAge).
    pub max_age_s: u64,
}

impl Default for PriorityWeights {
    fn default() -> Self {
        PriorityWeights {
            age: 1000,
            fairshare: 10_000,
            job_size: 100,
            qos: 10_000,
            partition: 1000,
            max_age_s: 7 * 24 * 3600,
        }
    }
}

/// Where a license limit applies: an account's jobs (its sub-accounts'
/// included), or a QOS's.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum LicenseScope {
    Account(String),
    Qos(String),
}

impl LicenseScope {
    /// As a refusal or a reason says it.
    pub fn describe(&self) -> String {
        match self {
            LicenseScope::Account(a) => format!("account {a}"),
            LicenseScope::Qos(q) => format!("QOS {q}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterPolicy {
    /// Bumped by every accepted update (read-only for writers: updates say which
    /// version they were based on).
    pub version: u64,
    /// Names of the positions in nodes' topology paths, top down, e.g.
    /// `["zone", "block", "rack"]`: jobs name a level for co-location.
    pub topology_levels: Vec<String>,
    pub partitions: BTreeMap<String, Partition>,
    pub accounts: BTreeMap<String, Account>,
    pub users: BTreeMap<String, User>,
    pub qos: BTreeMap<String, Qos>,
    pub priority: PriorityWeights,
    /// Half-life of historical usage in fair share.
    pub fairshare_half_life_s: u64,
    /// Top jobs that get an EASY backfill reservation per pass.
    pub backfill_reservations: u32,
    /// Refuse jobs from users without a policy entry (otherwise they charge `root`).
    pub enforce_users: bool,
    /// Identities allowed to change the policy and other users' jobs. Empty
    /// means nobody (default deny): a new cluster gets its first admin from
    /// the replicas' `--bootstrap-admin`, committed by the leader.
    pub admins: Vec<String>,
    // ---- From data format 6 (ROLES_FORMAT); empty in older clusters. ----
    /// Identities that run the machines and the queue, not the policy: drain
    /// and resume nodes, and change any job (cancel, hold and release,
    /// requeue, priority, time limits), as admins do. They see every job, but
    /// not other users' scripts and environments.
    pub operators: Vec<String>,
    /// Account coordinators (Slurm's), by account: they manage the jobs of
    /// their account and the accounts below it, the limits of those below,
    /// and which users belong to them.
    pub coordinators: BTreeMap<String, Vec<String>>,
    /// Identity (a certificate's or token's name) to the Unix user its jobs
    /// run as, where the two differ. Unlisted names run as themselves.
    pub user_map: BTreeMap<String, String>,
    /// Domains stripped from unmapped identities: with `corp.example` listed,
    /// `alice@corp.example` runs as `alice`.
    pub user_domains: Vec<String>,
    /// Jobs may run as root (uid 0). Agents must allow it too.
    pub allow_root_jobs: bool,
    /// Users see only their own jobs (coordinators: their accounts'), as
    /// Slurm's `PrivateData=jobs`; others' read as not found.
    pub private_jobs: bool,
    // ---- From data format 9 (`format::SLURM_FEATURES_FORMAT`). ----
    /// Cluster-wide counted resources (Slurm's `Licenses=wandb:4,matlab:2`):
    /// name → seats. A job holds the seats it asks for (`--licenses`) while
    /// it runs and starts only when they are free.
    pub licenses: BTreeMap<String, u32>,
    // ---- From data format 11 (`format::HET_JOBS_FORMAT`); empty before. ----
    /// Seats of a license an account's jobs, its sub-accounts' included, may
    /// hold at once (Slurm's `GrpTRES=license/NAME=N` on an account):
    /// account → license → seats.
    pub account_licenses: BTreeMap<String, BTreeMap<String, u32>>,
    /// Seats of a license the jobs of a QOS may hold at once (Slurm's QOS
    /// `GrpTRES=license/NAME=N`): QOS → license → seats.
    pub qos_licenses: BTreeMap<String, BTreeMap<String, u32>>,
    /// Elastic node pools by name: nodes powered down while idle and
    /// powered up when the scheduler plans on them. Since format 12.
    pub pools: BTreeMap<String, NodePool>,
    /// Finished jobs the state keeps before it drops the oldest (Slurm's
    /// MaxJobCount/MinJobAge purge): 1 to `FINISHED_JOBS_RETAINED_MAX`, which
    /// is also the default. Fewer keep replicas small where the accounting
    /// store holds the history. Since format 13.
    pub finished_jobs_kept: Option<u32>,
}

/// Pools one cluster may have (a site has one per instance type or rack
/// kind, not hundreds).
pub const POOLS_MAX: usize = 64;
/// Longest idle time before a power-down, and longest boot: a day.
pub const POOL_SECONDS_MAX: u64 = 24 * 3600;
/// The boot time a pool allows when it names none (Slurm's ResumeTimeout).
pub const POOL_RESUME_TIMEOUT_DEFAULT_S: u64 = 600;

/// An elastic node pool (Slurm's power saving and cloud nodes): its nodes
/// exist in the state before their agents ever registered, powered down,
/// with the pool's hardware; the scheduler plans on them when the rest of
/// the cluster cannot hold a job, which powers them up (the leader runs the
/// controller's resume program); an idle one is powered down again after
/// `suspend_after_s` (the suspend program). A node that does not register
/// within `resume_timeout_s` of its power-up goes down and its jobs are
/// requeued. The programs are the controllers' own configuration
/// (`--resume-program`, `--suspend-program`), never the replicated policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodePool {
    /// The pool's node names, each listed (`gangway admin pool` expands a
    /// hostlist); no node is in two pools.
    pub nodes: Vec<String>,
    /// What each node has until its agent registers what it really has.
    pub cpus: u32,
    pub mem_mb: u64,
    pub gpus: u32,
    pub gpu_model: String,
    pub gpu_mem_mb: u64,
    pub topology: Vec<String>,
    pub labels: BTreeMap<String, String>,
    /// Seconds an up node of the pool may stay idle before it is powered
    /// down (Slurm's SuspendTime); 0: never.
    pub suspend_after_s: u64,
    /// Seconds a powered-up node has to register (Slurm's ResumeTimeout).
    pub resume_timeout_s: u64,
}

impl Default for NodePool {
    fn default() -> Self {
        NodePool {
            nodes: Vec::new(),
            cpus: 1,
            mem_mb: 1024,
            gpus: 0,
            gpu_model: String::new(),
            gpu_mem_mb: 0,
            topology: Vec::new(),
            labels: BTreeMap::new(),
            suspend_after_s: 600,
            resume_timeout_s: POOL_RESUME_TIMEOUT_DEFAULT_S,
        }
    }
}

impl NodePool {
    /// Node `name` of the pool as the state holds it before its agent
    /// registered: the pool's hardware, with placeholder GPU ids.
    pub fn node_spec(&self, name: &str) -> crate::spec::NodeSpec {
        crate::spec::NodeSpec {
            name: name.to_string(),
            addr: String::new(),
            cpus: self.cpus,
            mem_mb: self.mem_mb,
            gpus: (0..self.gpus)
                .map(|g| crate::spec::GpuSpec {
                    uuid: format!("{name}-pool-gpu{g}"),
                    model: if self.gpu_model.is_empty() { "gpu".into() } else { self.gpu_model.clone() },
                    mem_mb: self.gpu_mem_mb,
                    nvlink_island: 0,
                })
                .collect(),
            topology: self.topology.clone(),
            labels: self.labels.clone(),
        }
    }
}

impl Default for ClusterPolicy {
    fn default() -> Self {
        ClusterPolicy {
            version: 0,
            topology_levels: Vec::new(),
            partitions: BTreeMap::new(),
            accounts: BTreeMap::new(),
            users: BTreeMap::new(),
            qos: BTreeMap::new(),
            priority: PriorityWeights::default(),
            fairshare_half_life_s: 7 * 24 * 3600,
            backfill_reservations: 1,
            enforce_users: false,
            admins: Vec::new(),
            operators: Vec::new(),
            coordinators: BTreeMap::new(),
            user_map: BTreeMap::new(),
            user_domains: Vec::new(),
            allow_root_jobs: false,
            private_jobs: false,
            licenses: BTreeMap::new(),
            account_licenses: BTreeMap::new(),
            qos_licenses: BTreeMap::new(),
            pools: BTreeMap::new(),
            finished_jobs_kept: None,
        }
    }
}

pub(crate) fn check_ident(field: &str, value: &str) -> Result<(), SpecError> {
    let ok = !value.is_empty()
        && value.len() <= crate::limits::NAME_BYTES_MAX
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        return Err(SpecError::new(field, format!("'{value}' must be 1-256 of letters, digits, '-', '_' or '.'")));
    }
    Ok(())
}

/// An identity or name in a role list: 1-256 bytes, no spaces or controls.
fn check_role_name(field: &str, name: &str) -> Result<(), SpecError> {
    if name.is_empty() || name.len() > crate::limits::NAME_BYTES_MAX || name.chars().any(|c| c.is_control() || c == ' ')
    {
        return Err(SpecError::new(
            field,
            format!("'{name}' must be an identity or user name (1-256 bytes, no spaces)"),
        ));
    }
    Ok(())
}

/// A name certificates and tokens can carry (as `gangway_proto::tls` checks
/// them): 1 to 128 bytes of letters, digits, `.`, `_`, `-` and `@`, starting
/// with a letter or digit. Other keys could never match a caller.
fn check_identity_name(field: &str, name: &str) -> Result<(), SpecError> {
    use crate::limits::IDENTITY_NAME_BYTES_MAX;
    let ok = !name.is_empty()
        && name.len() <= IDENTITY_NAME_BYTES_MAX
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@'));
    if !ok {
        return Err(SpecError::new(
            field,
            format!(
                "'{name}' must be a certificate or token name: 1-{IDENTITY_NAME_BYTES_MAX} letters, digits, '.', \
                 '_', '-' or '@', starting with a letter or digit"
            ),
        ));
    }
    Ok(())
}

/// A caller's identity as commands carry it, parsed once: `KIND:NAME`
/// (`client:alice`, `agent:node7`, `server:1`, `dev:alice` from an insecure
/// cluster) or a bare name. The API edge sets it from what it verified (a
/// certificate, a token, a step credential); the core only reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity<'a> {
    pub kind: IdentityKind,
    /// The name after the kind (`alice`); names hold no `:`.
    pub name: &'a str,
}

/// What kind of caller an identity names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityKind {
    /// A controller replica (`server:ID`): only a server certificate yields it.
    Server,
    /// A node agent (`agent:NODE`): never a person.
    Agent,
    /// A person or tool with a client certificate or token (`client:NAME`).
    Client,
    /// Anything else: `dev:NAME` on an insecure cluster, or a bare name.
    Other,
}

impl<'a> Identity<'a> {
    pub fn parse(text: &'a str) -> Identity<'a> {
        let kind = match text.split_once(':').map(|(k, _)| k) {
            Some("server") => IdentityKind::Server,
            Some("agent") => IdentityKind::Agent,
            Some("client") => IdentityKind::Client,
            _ => IdentityKind::Other,
        };
        Identity { kind, name: text.rsplit(':').next().unwrap_or(text) }
    }
}

/// The name in an identity: `client:alice` → `alice`.
pub fn identity_name(identity: &str) -> &str {
    Identity::parse(identity).name
}

/// Whether a coordinator of the accounts `mine` may turn `old` into `new`.
/// In reach: accounts strictly below one of theirs (added, removed, edited,
/// their coordinators too, as long as they stay below), and users'
/// memberships in their accounts and those below, for users already a member
/// of one of them (never a user from outside or a new one: an admin adds
/// those): a user they touch keeps at least one account, and the first (the
/// default) moves only from an account in reach to one in reach; users'
/// entries are never removed. Everything else must
/// be as it was; the first difference out of reach is named. (Admins apply
/// `new` whole; the state machine fills in the version and empty admins
/// before calling this, and checks what needs the jobs: see
/// `State::apply_update_policy`.)
///
/// `in_tree_only` is format 17's rule (`format::NODE_ADMISSION_FORMAT`);
/// before it, a coordinator could also add users from outside the tree and
/// make an account in reach their default.
pub fn coordinator_change(
    old: &ClusterPolicy,
    new: &ClusterPolicy,
    mine: &[&str],
    in_tree_only: bool,
) -> Result<(), SpecError> {
    // The accounts in reach, walked once per policy: (members, strictly below).
    let reach = |p: &ClusterPolicy| -> (BTreeSet<String>, BTreeSet<String>) {
        let mut members = BTreeSet::new();
        let mut below = BTreeSet::new();
        for a in p.accounts.keys() {
            let lineage = p.lineage(a);
            if mine.iter().any(|m| lineage.contains(m)) {
                members.insert(a.clone());
                if !mine.contains(&a.as_str()) {
                    below.insert(a.clone());
                }
            }
        }
        (members, below)
    };
    let ((old_members, old_below), (new_members, new_below)) = (reach(old), reach(new));
    let out = |field: String| {
        Err(SpecError::new(
            &field,
            "out of a coordinator's reach (their accounts' sub-accounts and members); ask an admin",
        ))
    };
    let names: BTreeSet<&String> = old.accounts.keys().chain(new.accounts.keys()).collect();
    for name in names {
        let (o, n) = (old.accounts.get(name), new.accounts.get(name));
        if o == n {
            continue;
        }
        let was_ok = o.is_none() || old_below.contains(name);
        let is_ok = n.is_none() || new_below.contains(name);
        if !(was_ok && is_ok) {
            return out(format!("accounts.{name}"));
        }
    }
    for name in old.coordinators.keys().chain(new.coordinators.keys()) {
        if old.coordinators.get(name) != new.coordinators.get(name)
            && !(old_below.contains(name) || new_below.contains(name))
        {
            return out(format!("coordinators.{name}"));
        }
    }
    let users: BTreeSet<&String> = old.users.keys().chain(new.users.keys()).collect();
    for name in users {
        let (o, n) = (old.users.get(name), new.users.get(name));
        if o == n {
            continue;
        }
        let field = format!("users.{name}");
        // Removing a user (or all their accounts) would let their jobs
        // charge `root` or any account: an admin's call.
        let Some(n) = n.filter(|n| !n.accounts.is_empty()) else {
            return Err(SpecError::new(
                &format!("{field}.accounts"),
                "a coordinator may remove a user from their accounts, but the user keeps at least one account \
                 (an admin removes users)",
            ));
        };
        // Only users already in their tree: adding someone from outside (or
        // someone with no entry yet) would let the coordinator see and cancel
        // that user's next jobs, charged to the coordinator's account.
        let in_tree = |u: &User| u.accounts.iter().any(|a| old_members.contains(a));
        if in_tree_only && !o.is_some_and(in_tree) {
            return Err(SpecError::new(
                &field,
                "not a member of a coordinator's accounts; an admin adds users to an account tree \
                 (`gangway admin user add`)",
            ));
        }
        if o.map(|u| &u.quota) != Some(&n.quota) && !(o.is_none() && n.quota.is_empty()) {
            return out(format!("{field}.quota"));
        }
        // Memberships outside their accounts stay, in order; the default
        // (first) account changes only to an account in reach.
        let outside = |u: &User, members: &BTreeSet<String>| -> Vec<String> {
            u.accounts.iter().filter(|a| !members.contains(*a)).cloned().collect()
        };
        if o.map(|o| outside(o, &old_members)).unwrap_or_default() != outside(n, &new_members) {
            return out(format!("{field}.accounts"));
        }
        // The default account moves only to one in reach, and (format 17)
        // only from one in reach: a user whose jobs go elsewhere by default
        // keeps them there.
        let (f_old, f_new) = (o.and_then(|u| u.accounts.first()), n.accounts.first());
        let from_reach = !in_tree_only || f_old.is_some_and(|a| old_members.contains(a));
        if f_old != f_new && !(from_reach && f_new.is_some_and(|a| new_members.contains(a))) {
            return out(format!("{field}.accounts"));
        }
    }
    // Everything else whole: compare with the in-reach parts taken from `old`.
    let mut rest = new.clone();
    rest.accounts = old.accounts.clone();
    rest.coordinators = old.coordinators.clone();
    rest.users = old.users.clone();
    rest.version = old.version;
    if rest != *old {
        let field = first_difference(old, &rest);
        return out(field.to_string());
    }
    Ok(())
}

/// The name of the first top-level field in which `a` and `b` differ.
fn first_difference(a: &ClusterPolicy, b: &ClusterPolicy) -> &'static str {
    let checks: [(&str, bool); 19] = [
        ("pools", a.pools == b.pools),
        ("licenses", a.licenses == b.licenses),
        ("account_licenses", a.account_licenses == b.account_licenses),
        ("qos_licenses", a.qos_licenses == b.qos_licenses),
        ("topology_levels", a.topology_levels == b.topology_levels),
        ("partitions", a.partitions == b.partitions),
        ("qos", a.qos == b.qos),
        ("priority", a.priority == b.priority),
        ("fairshare_half_life_s", a.fairshare_half_life_s == b.fairshare_half_life_s),
        ("backfill_reservations", a.backfill_reservations == b.backfill_reservations),
        ("enforce_users", a.enforce_users == b.enforce_users),
        ("admins", a.admins == b.admins),
        ("operators", a.operators == b.operators),
        ("user_map", a.user_map == b.user_map),
        ("user_domains", a.user_domains == b.user_domains),
        ("allow_root_jobs", a.allow_root_jobs == b.allow_root_jobs),
        ("private_jobs", a.private_jobs == b.private_jobs),
        ("accounts", a.accounts == b.accounts),
        ("users", a.users == b.users),
    ];
    checks.iter().find(|(_, same)| !same).map_or("policy", |(f, _)| f)
}

fn check_quota(field: &str, q: &Quota) -> Result<(), SpecError> {
    if q.max_running_jobs == Some(0) && q.max_submitted_jobs != Some(0) {
        // Allowed (a paused account), nothing to check; kept explicit for clarity.
    }
    if let (Some(run), Some(sub)) = (q.max_running_jobs, q.max_submitted_jobs) {
        if run > sub {
            return Err(SpecError::new(
                field,
                format!("max_running_jobs ({run}) must not exceed max_submitted_jobs ({sub})"),
            ));
        }
    }
    Ok(())
}

impl ClusterPolicy {
    /// Per-account and per-QOS license limits name accounts, QOS and
    /// licenses that exist, with 0 to the license's seats each.
    fn validate_license_limits(&self) -> Result<(), SpecError> {
        for (field, limits) in [("account_licenses", &self.account_licenses), ("qos_licenses", &self.qos_licenses)] {
            if limits.len() > crate::limits::LICENSE_LIMIT_SCOPES_MAX {
                return Err(SpecError::new(
                    field,
                    format!("at most {} entries", crate::limits::LICENSE_LIMIT_SCOPES_MAX),
                ));
            }
            for (scope, seats) in limits {
                let known = if field == "account_licenses" {
                    self.accounts.contains_key(scope)
                } else {
                    self.qos_exists(scope)
                };
                if !known {
                    let what = if field == "account_licenses" { "account" } else { "QOS" };
                    return Err(SpecError::new(field, format!("{scope}: no such {what}")));
                }
                for (name, &n) in seats {
                    let Some(&total) = self.licenses.get(name) else {
                        return Err(SpecError::new(
                            field,
                            format!("{scope}: '{name}' is not a license of this cluster"),
                        ));
                    };
                    if n > total {
                        return Err(SpecError::new(
                            field,
                            format!("{scope}: {n} seats of {name}, but the cluster has {total}"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The license limits that apply to a job of `account` in `qos`: the
    /// account's and every account above it, then the QOS's, as
    /// (scope, license, seats).
    pub fn license_limits<'a>(&'a self, account: &'a str, qos: &'a str) -> Vec<(LicenseScope, &'a str, u32)> {
        if self.account_licenses.is_empty() && self.qos_licenses.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for a in self.lineage(account) {
            for (name, &n) in self.account_licenses.get(a).into_iter().flatten() {
                out.push((LicenseScope::Account(a.to_string()), name.as_str(), n));
            }
        }
        for (name, &n) in self.qos_licenses.get(qos).into_iter().flatten() {
            out.push((LicenseScope::Qos(qos.to_string()), name.as_str(), n));
        }
        out
    }

    /// Pools: at most [`POOLS_MAX`], each node named once in all of them
    /// and valid with its pool's hardware (as a registration would be).
    fn validate_pools(&self) -> Result<(), SpecError> {
        if self.pools.len() > POOLS_MAX {
            return Err(SpecError::new("pools", format!("at most {POOLS_MAX}")));
        }
        let mut seen: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
        for (name, pool) in &self.pools {
            check_ident("pools", name)?;
            if pool.nodes.is_empty() {
                return Err(SpecError::new("pools", format!("{name}: names no nodes")));
            }
            for (field, secs) in
                [("suspend_after_s", pool.suspend_after_s), ("resume_timeout_s", pool.resume_timeout_s)]
            {
                if secs > POOL_SECONDS_MAX {
                    return Err(SpecError::new("pools", format!("{name}: {field} is at most {POOL_SECONDS_MAX}")));
                }
            }
            if pool.resume_timeout_s == 0 {
                return Err(SpecError::new("pools", format!("{name}: resume_timeout_s must be at least 1")));
            }
            // The sizes first: the template below holds one entry per GPU.
            if pool.gpus > crate::limits::GPUS_PER_NODE_MAX {
                let max = crate::limits::GPUS_PER_NODE_MAX;
                return Err(SpecError::new("pools", format!("{name}: gpus is at most {max}")));
            }
            if pool.nodes.len() > crate::limits::NODES_MAX {
                return Err(SpecError::new("pools", format!("more than {} nodes", crate::limits::NODES_MAX)));
            }
            // Checked with the longest name (the GPUs' placeholder ids hold it).
            let Some(longest) = pool.nodes.iter().max_by_key(|n| n.len()) else {
                return Err(SpecError::new("pools", format!("{name}: names no nodes")));
            };
            let template = pool.node_spec(longest);
            template.validate().map_err(|e| SpecError::new("pools", format!("{name}: {e}")))?;
            for node in &pool.nodes {
                if !seen.insert(node) {
                    return Err(SpecError::new("pools", format!("{name}: node {node} is in another pool too")));
                }
                if seen.len() > crate::limits::NODES_MAX {
                    return Err(SpecError::new("pools", format!("more than {} nodes", crate::limits::NODES_MAX)));
                }
                // A name the programs get as their argument: never an option.
                if node.starts_with('-') {
                    return Err(SpecError::new("pools", format!("{name}: node name '{node}' must not start with '-'")));
                }
                let named = crate::spec::NodeSpec { name: node.clone(), gpus: Vec::new(), ..template.clone() };
                named.validate().map_err(|e| SpecError::new("pools", format!("{name}: {node}: {e}")))?;
            }
        }
        Ok(())
    }

    /// Every pool's nodes.
    pub fn pool_nodes(&self) -> std::collections::BTreeSet<&str> {
        self.pools.values().flat_map(|p| p.nodes.iter().map(String::as_str)).collect()
    }

    /// The pool node `name` is in, if any.
    pub fn pool_of(&self, name: &str) -> Option<(&str, &NodePool)> {
        self.pools.iter().find(|(_, p)| p.nodes.iter().any(|n| n == name)).map(|(k, p)| (k.as_str(), p))
    }

    /// Checks the whole policy: names, references, the tree, limits.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.validate_pools()?;
        if let Some(n) = self.finished_jobs_kept {
            let max = crate::limits::FINISHED_JOBS_RETAINED_MAX;
            if n == 0 || n as usize > max {
                return Err(SpecError::new("finished_jobs_kept", format!("must be 1 to {max}")));
            }
        }
        if self.licenses.len() > crate::limits::LICENSES_MAX {
            return Err(SpecError::new("licenses", format!("at most {}", crate::limits::LICENSES_MAX)));
        }
        for (name, &count) in &self.licenses {
            check_ident("licenses", name)?;
            if count == 0 || count > crate::limits::LICENSE_COUNT_MAX {
                return Err(SpecError::new(
                    "licenses",
                    format!("{name}: the count must be 1 to {}", crate::limits::LICENSE_COUNT_MAX),
                ));
            }
        }
        self.validate_license_limits()?;
        if self.partitions.len() > PARTITIONS_MAX {
            return Err(SpecError::new("partitions", format!("at most {PARTITIONS_MAX}")));
        }
        if self.accounts.len() > ACCOUNTS_MAX {
            return Err(SpecError::new("accounts", format!("at most {ACCOUNTS_MAX}")));
        }
        if self.users.len() > USERS_MAX {
            return Err(SpecError::new("users", format!("at most {USERS_MAX}")));
        }
        if self.qos.len() > QOS_MAX {
            return Err(SpecError::new("qos", format!("at most {QOS_MAX}")));
        }
        if self.topology_levels.len() > crate::limits::TOPOLOGY_LEVELS_MAX {
            return Err(SpecError::new(
                "topology_levels",
                format!("at most {} levels", crate::limits::TOPOLOGY_LEVELS_MAX),
            ));
        }
        let mut seen = BTreeSet::new();
        for l in &self.topology_levels {
            check_ident("topology_levels", l)?;
            if l == "node" || l == "island" {
                return Err(SpecError::new("topology_levels", format!("'{l}' is built in; do not list it")));
            }
            if !seen.insert(l) {
                return Err(SpecError::new("topology_levels", format!("'{l}' is listed twice")));
            }
        }
        if self.partitions.values().filter(|p| p.default).count() > 1 {
            return Err(SpecError::new("partitions", "at most one partition may be the default"));
        }
        for (name, p) in &self.partitions {
            let f = |x: &str| format!("partitions.{name}.{x}");
            check_ident("partitions", name)?;
            if p.nodes.len() > PARTITION_NODE_PATTERNS_MAX {
                return Err(SpecError::new(&f("nodes"), format!("at most {PARTITION_NODE_PATTERNS_MAX} patterns")));
            }
            for pat in &p.nodes {
                if pat.is_empty() || pat.len() > crate::limits::NAME_BYTES_MAX {
                    return Err(SpecError::new(&f("nodes"), "patterns must be 1-256 bytes"));
                }
            }
            if p.max_time_s > crate::limits::TIME_LIMIT_S_MAX || p.default_time_s > crate::limits::TIME_LIMIT_S_MAX {
                return Err(SpecError::new(
                    &f("max_time_s"),
                    format!("time limits must be at most {} s", crate::limits::TIME_LIMIT_S_MAX),
                ));
            }
            if p.default_mem_per_cpu_mb > crate::limits::MEM_PER_NODE_MB_MAX
                || p.default_mem_per_gpu_mb > crate::limits::MEM_PER_NODE_MB_MAX
            {
                return Err(SpecError::new(
                    &f("default_mem_per_cpu_mb"),
                    format!("memory defaults must be at most {} MiB", crate::limits::MEM_PER_NODE_MB_MAX),
                ));
            }
            if p.max_time_s > 0 && p.default_time_s > p.max_time_s {
                return Err(SpecError::new(&f("default_time_s"), "must not exceed max_time_s"));
            }
            for a in &p.allow_accounts {
                if a != ROOT_ACCOUNT && !self.accounts.contains_key(a) {
                    return Err(SpecError::new(&f("allow_accounts"), format!("account '{a}' does not exist")));
                }
            }
            if !p.default_qos.is_empty() && !self.qos_exists(&p.default_qos) {
                return Err(SpecError::new(&f("default_qos"), format!("QOS '{}' does not exist", p.default_qos)));
            }
        }
        for (name, a) in &self.accounts {
            check_ident("accounts", name)?;
            if name == ROOT_ACCOUNT {
                return Err(SpecError::new("accounts", "'root' is built in; add accounts under it"));
            }
            if !a.parent.is_empty() && a.parent != ROOT_ACCOUNT && !self.accounts.contains_key(&a.parent) {
                return Err(SpecError::new(
                    &format!("accounts.{name}.parent"),
                    format!("account '{}' does not exist", a.parent),
                ));
            }
            if a.shares == 0 {
                return Err(SpecError::new(&format!("accounts.{name}.shares"), "must be at least 1"));
            }
            check_quota(&format!("accounts.{name}.quota"), &a.quota)?;
            if a.borrow_gpus > 0 && a.quota.max_running_gpus.is_none() {
                return Err(SpecError::new(
                    &format!("accounts.{name}.borrow_gpus"),
                    "borrowing needs a max_running_gpus quota to borrow beyond",
                ));
            }
        }
        for name in self.accounts.keys() {
            // Walk to the root: a cycle or an over-deep tree never reaches it.
            let mut cur = name.as_str();
            let mut depth = 0usize;
            while cur != ROOT_ACCOUNT {
                depth = depth.saturating_add(1);
                if depth > ACCOUNT_DEPTH_MAX {
                    return Err(SpecError::new(
                        &format!("accounts.{name}.parent"),
                        format!("the account tree has a cycle or is deeper than {ACCOUNT_DEPTH_MAX} levels"),
                    ));
                }
                cur = self.parent_of(cur);
            }
        }
        for (name, u) in &self.users {
            check_ident("users", name)?;
            if u.accounts.len() > USER_ACCOUNTS_MAX {
                return Err(SpecError::new(&format!("users.{name}.accounts"), format!("at most {USER_ACCOUNTS_MAX}")));
            }
            for a in &u.accounts {
                if !self.account_exists(a) {
                    return Err(SpecError::new(
                        &format!("users.{name}.accounts"),
                        format!("account '{a}' does not exist"),
                    ));
                }
            }
            check_quota(&format!("users.{name}.quota"), &u.quota)?;
        }
        for (name, q) in &self.qos {
            check_ident("qos", name)?;
            for p in &q.preempt {
                if !self.qos_exists(p) {
                    return Err(SpecError::new(&format!("qos.{name}.preempt"), format!("QOS '{p}' does not exist")));
                }
                if p == name {
                    return Err(SpecError::new(&format!("qos.{name}.preempt"), "a QOS cannot preempt itself"));
                }
            }
            if q.max_time_s > crate::limits::TIME_LIMIT_S_MAX {
                return Err(SpecError::new(&format!("qos.{name}.max_time_s"), "must be at most a year"));
            }
            check_quota(&format!("qos.{name}.per_user"), &q.per_user)?;
        }
        let w = &self.priority;
        for (field, v) in [
            ("age", w.age),
            ("fairshare", w.fairshare),
            ("job_size", w.job_size),
            ("qos", w.qos),
            ("partition", w.partition),
        ] {
            if v > PRIORITY_WEIGHT_MAX {
                return Err(SpecError::new(
                    &format!("priority.{field}"),
                    format!("must be at most {PRIORITY_WEIGHT_MAX}"),
                ));
            }
        }
        if w.max_age_s == 0 {
            return Err(SpecError::new("priority.max_age_s", "must be at least 1"));
        }
        if self.fairshare_half_life_s == 0 || self.fairshare_half_life_s > HALF_LIFE_S_MAX {
            return Err(SpecError::new("fairshare_half_life_s", format!("must be between 1 and {HALF_LIFE_S_MAX}")));
        }
        if self.admins.len() > ADMINS_MAX {
            return Err(SpecError::new("admins", format!("at most {ADMINS_MAX}")));
        }
        for a in &self.admins {
            if a.is_empty() || a.len() > crate::limits::NAME_BYTES_MAX || a.chars().any(|c| c.is_control() || c == ' ')
            {
                return Err(SpecError::new(
                    "admins",
                    format!("'{a}' must be an identity or user name (1-256 bytes, no spaces)"),
                ));
            }
        }
        self.validate_roles()?;
        if self.backfill_reservations > BACKFILL_RESERVATIONS_MAX {
            return Err(SpecError::new(
                "backfill_reservations",
                format!("must be at most {BACKFILL_RESERVATIONS_MAX}"),
            ));
        }
        Ok(())
    }

    /// The roles, the user map and the job switches (data format 6).
    fn validate_roles(&self) -> Result<(), SpecError> {
        if self.operators.len() > OPERATORS_MAX {
            return Err(SpecError::new("operators", format!("at most {OPERATORS_MAX}")));
        }
        for o in &self.operators {
            check_role_name("operators", o)?;
        }
        for (account, names) in &self.coordinators {
            let field = format!("coordinators.{account}");
            if names.is_empty() {
                return Err(SpecError::new(&field, "name at least one coordinator (or leave the account out)"));
            }
            if !self.accounts.contains_key(account) {
                return Err(SpecError::new(
                    &field,
                    format!("account '{account}' does not exist (root has admins, not coordinators)"),
                ));
            }
            if names.len() > ACCOUNT_COORDINATORS_MAX {
                return Err(SpecError::new(&field, format!("at most {ACCOUNT_COORDINATORS_MAX} coordinators")));
            }
            for n in names {
                check_role_name(&field, n)?;
            }
        }
        if self.user_map.len() > USER_MAP_MAX {
            return Err(SpecError::new("user_map", format!("at most {USER_MAP_MAX} entries")));
        }
        for (name, user) in &self.user_map {
            check_identity_name("user_map", name)?;
            check_ident(&format!("user_map.{name}"), user)?;
            if user.starts_with('-') {
                return Err(SpecError::new(&format!("user_map.{name}"), "a user name cannot start with '-'"));
            }
        }
        if self.user_domains.len() > USER_DOMAINS_MAX {
            return Err(SpecError::new("user_domains", format!("at most {USER_DOMAINS_MAX}")));
        }
        for d in &self.user_domains {
            check_ident("user_domains", d)?;
        }
        Ok(())
    }

    /// The oldest data format that can hold this policy: the roles, the user
    /// map and the job switches need [`ROLES_FORMAT`], licenses format 9.
    pub fn needs_format(&self) -> u32 {
        let roles = !self.operators.is_empty()
            || !self.coordinators.is_empty()
            || !self.user_map.is_empty()
            || !self.user_domains.is_empty()
            || self.allow_root_jobs
            || self.private_jobs;
        if self.finished_jobs_kept.is_some() {
            crate::format::ACCOUNTING_FORMAT
        } else if self.qos.values().any(|q| q.preempt_mode == PreemptMode::Suspend) || !self.pools.is_empty() {
            crate::format::PREEMPT_SUSPEND_FORMAT
        } else if !self.account_licenses.is_empty() || !self.qos_licenses.is_empty() {
            crate::format::HET_JOBS_FORMAT
        } else if !self.licenses.is_empty() {
            crate::format::SLURM_FEATURES_FORMAT
        } else if roles {
            ROLES_FORMAT
        } else {
            crate::format::FORMAT_BASE
        }
    }

    /// Finished jobs the state keeps (see `finished_jobs_kept`).
    pub fn finished_jobs_limit(&self) -> usize {
        self.finished_jobs_kept
            .map_or(crate::limits::FINISHED_JOBS_RETAINED_MAX, |n| n as usize)
            .min(crate::limits::FINISHED_JOBS_RETAINED_MAX)
    }

    /// The Unix user the jobs of `name` (a certificate's or token's name) run
    /// as: its entry in `user_map`, else the name without a listed domain,
    /// else the name itself.
    pub fn unix_user<'a>(&'a self, name: &'a str) -> &'a str {
        if let Some(user) = self.user_map.get(name) {
            return user;
        }
        match name.rsplit_once('@') {
            Some((user, domain)) if check_ident("", user).is_ok() && self.user_domains.iter().any(|d| d == domain) => {
                user
            }
            _ => name,
        }
    }

    /// Whether `list` names the person behind `identity`: by identity, by
    /// name, or by the Unix user it runs as. Agents are never people.
    pub fn lists(&self, list: &[String], identity: &str) -> bool {
        let who = Identity::parse(identity);
        if who.kind == IdentityKind::Agent {
            return false;
        }
        let name = who.name;
        let user = self.unix_user(name);
        list.iter().any(|a| a == identity || a == name || a == user)
    }

    /// Whether `identity` is an operator (admins are checked on their own).
    pub fn is_operator(&self, identity: &str) -> bool {
        self.lists(&self.operators, identity)
    }

    /// The accounts `identity` coordinates (each with everything below it).
    pub fn coordinated(&self, identity: &str) -> Vec<&str> {
        self.coordinators.iter().filter(|(_, names)| self.lists(names, identity)).map(|(a, _)| a.as_str()).collect()
    }

    /// Whether `identity` coordinates `account` or an account above it.
    pub fn coordinates(&self, identity: &str, account: &str) -> bool {
        self.coordinators.iter().any(|(a, names)| self.is_under(account, a) && self.lists(names, identity))
    }

    pub fn account_exists(&self, name: &str) -> bool {
        name == ROOT_ACCOUNT || self.accounts.contains_key(name)
    }

    pub fn qos_exists(&self, name: &str) -> bool {
        name == DEFAULT_QOS || self.qos.contains_key(name)
    }

    /// The QOS settings for `name` (the built-in `normal` has defaults).
    pub fn qos_of(&self, name: &str) -> Qos {
        self.qos.get(name).cloned().unwrap_or_default()
    }

    /// The parent of an account (`root` for top-level ones and for root itself).
    pub fn parent_of(&self, account: &str) -> &str {
        match self.accounts.get(account) {
            Some(a) if !a.parent.is_empty() => a.parent.as_str(),
            _ => ROOT_ACCOUNT,
        }
    }

    /// The account and its ancestors up to (not including) root, nearest first.
    pub fn lineage<'a>(&'a self, account: &'a str) -> Vec<&'a str> {
        let mut out = Vec::new();
        let mut cur = account;
        while cur != ROOT_ACCOUNT && out.len() < ACCOUNT_DEPTH_MAX {
            out.push(cur);
            cur = self.parent_of(cur);
        }
        out
    }

    /// Accounts with the same parent as `account` (excluding it).
    pub fn siblings<'a>(&'a self, account: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let parent = self.parent_of(account);
        self.accounts.keys().map(String::as_str).filter(move |a| *a != account && self.parent_of(a) == parent)
    }

    /// Whether `account` is `ancestor` or below it.
    pub fn is_under(&self, account: &str, ancestor: &str) -> bool {
        ancestor == ROOT_ACCOUNT || self.lineage(account).contains(&ancestor)
    }

    /// The partition a job naming `requested` (maybe empty) runs in.
    pub fn resolve_partition<'a>(&'a self, requested: &'a str) -> Result<(&'a str, Partition), SpecError> {
        if self.partitions.is_empty() {
            if requested.is_empty() || requested == DEFAULT_PARTITION {
                return Ok((DEFAULT_PARTITION, Partition { default: true, ..Partition::default() }));
            }
            return Err(SpecError::new(
                "partition",
                format!(
                    "'{requested}' does not exist (this cluster has only the implicit '{DEFAULT_PARTITION}' partition)"
                ),
            ));
        }
        if requested.is_empty() {
            return match self.partitions.iter().find(|(_, p)| p.default) {
                Some((n, p)) => Ok((n.as_str(), p.clone())),
                None => Err(SpecError::new("partition", "no partition given and the cluster has no default partition")),
            };
        }
        match self.partitions.get(requested) {
            Some(p) => Ok((requested, p.clone())),
            None => Err(SpecError::new(
                "partition",
                format!(
                    "'{requested}' does not exist (partitions: {})",
                    self.partitions.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )),
        }
    }

    /// The account a job of `user` naming `requested` (maybe empty) charges.
    pub fn resolve_account<'a>(&'a self, user: &str, requested: &'a str) -> Result<&'a str, SpecError> {
        match self.users.get(user) {
            Some(u) => {
                if requested.is_empty() {
                    return Ok(u.accounts.first().map(String::as_str).unwrap_or(ROOT_ACCOUNT));
                }
                if !self.account_exists(requested) {
                    return Err(SpecError::new("account", format!("'{requested}' does not exist")));
                }
                if !u.accounts.iter().any(|a| a == requested) {
                    return Err(SpecError::new(
                        "account",
                        format!("user {user} is not a member of account '{requested}' (member of: {})", u.accounts.join(", ")),
                    ));
                }
                Ok(requested)
            }
            None if self.enforce_users => Err(SpecError::new(
                "user",
                format!("user {user} has no account on this cluster; ask an admin to run `gangway admin user add {user} --account ACCOUNT`"),
            )),
            None => {
                if requested.is_empty() {
                    return Ok(ROOT_ACCOUNT);
                }
                if !self.account_exists(requested) {
                    return Err(SpecError::new("account", format!("'{requested}' does not exist")));
                }
                Ok(requested)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_patterns() {
        assert!(pattern_matches("gpu[001-010]", "gpu007"));
        assert!(!pattern_matches("gpu[001-010]", "gpu011"));
        assert!(!pattern_matches("gpu[001-010]", "gpu7"));
        assert!(pattern_matches("gpu[1-3,7]", "gpu7"));
        assert!(pattern_matches("rack1-[1-4].dc", "rack1-2.dc"));
        assert!(pattern_matches("node-*", "node-17"));
        assert!(pattern_matches("*", "anything"));
        assert!(!pattern_matches("node-*", "gpu-1"));
        assert!(pattern_matches("exact", "exact"));
    }

    #[test]
    fn account_cycles_are_refused() {
        let mut p = ClusterPolicy::default();
        p.accounts.insert("a".into(), Account { parent: "b".into(), ..Account::default() });
        p.accounts.insert("b".into(), Account { parent: "a".into(), ..Account::default() });
        let e = p.validate().unwrap_err();
        assert!(e.rule.contains("cycle"), "{e}");
        p.accounts.get_mut("b").unwrap().parent = String::new();
        p.validate().unwrap();
        assert_eq!(p.lineage("a"), vec!["a", "b"]);
        assert!(p.is_under("a", "b"));
        assert!(!p.is_under("b", "a"));
    }

    #[test]
    fn references_must_resolve() {
        let mut p = ClusterPolicy::default();
        p.users.insert("alice".into(), User { accounts: vec!["ml".into()], ..User::default() });
        assert_eq!(p.validate().unwrap_err().field, "users.alice.accounts");
        p.accounts.insert("ml".into(), Account::default());
        p.validate().unwrap();
        assert_eq!(p.resolve_account("alice", "").unwrap(), "ml");
        assert_eq!(p.resolve_account("alice", "root").unwrap_err().field, "account");
        assert_eq!(p.resolve_account("bob", "").unwrap(), ROOT_ACCOUNT);
        p.enforce_users = true;
        assert_eq!(p.resolve_account("bob", "").unwrap_err().field, "user");
        p.qos.insert("high".into(), Qos { preempt: vec!["low".into()], ..Qos::default() });
        assert_eq!(p.validate().unwrap_err().field, "qos.high.preempt");
    }
}

#[cfg(test)]
mod identity_tests {
    use super::*;

    #[test]
    fn identities_parse_into_a_kind_and_a_name() {
        let cases = [
            ("client:alice", IdentityKind::Client, "alice"),
            ("agent:gpu-07", IdentityKind::Agent, "gpu-07"),
            ("server:2", IdentityKind::Server, "2"),
            ("dev:bob", IdentityKind::Other, "bob"),
            ("carol", IdentityKind::Other, "carol"),
            // Not a kind, only a prefix of one: a person.
            ("agents:x", IdentityKind::Other, "x"),
            ("", IdentityKind::Other, ""),
        ];
        for (text, kind, name) in cases {
            assert_eq!(Identity::parse(text), Identity { kind, name }, "{text}");
        }
    }
}
