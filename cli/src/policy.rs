//! `gangway admin ...`: the cluster policy (partitions, accounts, users, QOS,
//! priority weights, topology levels) — shown, exported to and imported from
//! TOML, and edited one object at a time in the spirit of `sacctmgr` and
//! `scontrol update`.
//!
//! Every edit is a read-modify-write of the whole policy with the version it
//! read (compare-and-set in the replicated state machine); a concurrent edit
//! makes the write fail with ABORTED and the edit is retried on the new policy.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use gangway_core::policy::{Account, ClusterPolicy, NodePool, Partition, PreemptMode, Qos, Quota, User};
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use serde_json::json;

use crate::output::Output;
use crate::parse;

/// Read-modify-write attempts when other admins edit at the same time, a
/// moment apart (an edit commits in milliseconds).
pub(crate) const POLICY_EDIT_ATTEMPTS_MAX: u64 = 5;
pub(crate) const POLICY_EDIT: gangway_proto::retry::Retry =
    gangway_proto::retry::Retry::new(POLICY_EDIT_ATTEMPTS_MAX, std::time::Duration::from_millis(100));

#[derive(Subcommand)]
pub enum AdminCmd {
    /// Print the policy as TOML (the format `import` reads).
    Export {
        /// Write to this file instead of stdout.
        file: Option<PathBuf>,
    },
    /// Replace the whole policy with a TOML file (validated as a whole).
    Import {
        file: PathBuf,
        /// Allow quotas below current use and removing objects jobs still use.
        #[arg(long)]
        force: bool,
        /// Validate and show the differences only.
        #[arg(long)]
        dry_run: bool,
    },
    /// Partitions: groups of nodes with defaults and limits.
    #[command(subcommand)]
    Partition(ObjCmd<PartitionArgs>),
    /// Accounts: a tree with fair-share shares and quotas.
    #[command(subcommand)]
    Account(ObjCmd<AccountArgs>),
    /// Users: the accounts they may charge, and per-user quotas.
    #[command(subcommand)]
    User(ObjCmd<UserArgs>),
    /// QOS levels: priority, limits, preemption.
    #[command(subcommand)]
    Qos(ObjCmd<QosArgs>),
    /// Elastic node pools (Slurm's power saving and cloud nodes): nodes
    /// powered down while idle and powered up when work needs them, by the
    /// controllers' --resume-program and --suspend-program.
    #[command(subcommand)]
    Pool(ObjCmd<PoolArgs>),
    /// Cluster-wide settings: topology levels, priority weights, fair share,
    /// backfill, admins, operators, the user map, root jobs, private jobs.
    Set(SetArgs),
    /// Account coordinators (they manage their account's jobs, and the
    /// sub-accounts and members below it): list them, or set one account's.
    Coordinators {
        /// The account (all accounts' when omitted).
        account: Option<String>,
        /// Identities or user names, comma-separated; empty removes them all.
        #[arg(long, value_delimiter = ',')]
        set: Option<Vec<String>>,
    },
    /// Node admission: which nodes may register and what each may claim
    /// (node classes), and retired nodes.
    #[command(subcommand)]
    Inventory(crate::inventory::InventoryCmd),
    /// Fair share per account: shares, decayed usage, factor (like `sshare`).
    Shares {
        #[arg(long)]
        stale: bool,
    },
    /// Advance reservations: nodes set aside for users, accounts or maintenance.
    #[command(subcommand)]
    Reservation(crate::reservations::ReservationCmd),
    /// Cluster licenses (Slurm's Licenses=): `license wandb 4` sets the
    /// seats, `license wandb 0` removes it, `license` lists them with use.
    /// With --account or --qos: the seats that account (its sub-accounts
    /// included) or QOS may hold at once (Slurm's GrpTRES=license/NAME=N);
    /// 0 removes the limit.
    License {
        name: Option<String>,
        count: Option<u32>,
        #[arg(long, conflicts_with = "qos")]
        account: Option<String>,
        #[arg(long)]
        qos: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum ObjCmd<A: Args> {
    /// Create (fails if it exists).
    Add {
        name: String,
        #[command(flatten)]
        args: A,
        #[arg(long)]
        force: bool,
    },
    /// Change the given fields (fails if it does not exist).
    Set {
        name: String,
        #[command(flatten)]
        args: A,
        #[arg(long)]
        force: bool,
    },
    /// Remove.
    Rm {
        name: String,
        #[arg(long)]
        force: bool,
    },
    /// List all.
    List,
}

#[derive(Args)]
pub struct PartitionArgs {
    /// Node name patterns, comma-separated (gpu[001-128],cpu-*); empty: every node.
    #[arg(long, value_delimiter = ',')]
    nodes: Option<Vec<String>>,
    /// Make this the default partition.
    #[arg(long)]
    default: Option<bool>,
    #[arg(long)]
    default_time: Option<String>,
    #[arg(long)]
    max_time: Option<String>,
    #[arg(long)]
    default_mem_per_cpu: Option<String>,
    #[arg(long)]
    default_mem_per_gpu: Option<String>,
    /// Higher tiers are scheduled first.
    #[arg(long)]
    tier: Option<u32>,
    /// Accounts allowed (with their sub-accounts), comma-separated; empty: all.
    #[arg(long, value_delimiter = ',')]
    accounts: Option<Vec<String>>,
    #[arg(long)]
    default_qos: Option<String>,
    #[arg(long)]
    max_nodes: Option<u32>,
}

#[derive(Args, Default)]
pub struct QuotaArgs {
    /// Running GPUs at most (-1: unlimited).
    #[arg(long, allow_negative_numbers = true)]
    max_gpus: Option<i64>,
    #[arg(long, allow_negative_numbers = true)]
    max_cpus: Option<i64>,
    /// Running jobs at most.
    #[arg(long, allow_negative_numbers = true)]
    max_jobs: Option<i64>,
    /// Pending + running jobs at most.
    #[arg(long, allow_negative_numbers = true)]
    max_submit: Option<i64>,
}

#[derive(Args)]
pub struct AccountArgs {
    /// Parent account (default root).
    #[arg(long)]
    parent: Option<String>,
    /// Fair-share shares relative to siblings.
    #[arg(long)]
    shares: Option<u32>,
    #[arg(long)]
    description: Option<String>,
    /// GPUs it may run beyond --max-gpus on siblings' idle quota (reclaimed by preemption).
    #[arg(long)]
    borrow_gpus: Option<u32>,
    #[command(flatten)]
    quota: QuotaArgs,
}

#[derive(Args)]
pub struct UserArgs {
    /// Accounts the user may charge, comma-separated; the first is the default.
    #[arg(long, value_delimiter = ',')]
    accounts: Option<Vec<String>>,
    #[command(flatten)]
    quota: QuotaArgs,
}

#[derive(Args)]
pub struct PoolArgs {
    /// The pool's nodes, a hostlist (cloud-[001-064]).
    #[arg(long)]
    nodes: Option<String>,
    /// CPUs each node has (until its agent registers what it really has).
    #[arg(long)]
    cpus: Option<u32>,
    /// Memory each node has (MB, or with a K/M/G/T suffix).
    #[arg(long)]
    mem: Option<String>,
    /// GPUs each node has: N or MODEL:N (h100:8).
    #[arg(long)]
    gpus: Option<String>,
    /// Memory of each GPU (MB, or with a suffix).
    #[arg(long)]
    gpu_mem: Option<String>,
    /// Node features (labels), comma-separated: KEY or KEY=VALUE.
    #[arg(long, value_delimiter = ',')]
    features: Option<Vec<String>>,
    /// Idle time before an up node is powered down (Slurm's SuspendTime;
    /// 0: never). Default 10:00.
    #[arg(long)]
    suspend_after: Option<String>,
    /// Time a powered-up node has to register before it is marked down and
    /// its jobs requeued (Slurm's ResumeTimeout). Default 10:00.
    #[arg(long)]
    resume_timeout: Option<String>,
}

impl PoolArgs {
    fn apply(&self, p: &mut NodePool) -> anyhow::Result<()> {
        if let Some(list) = &self.nodes {
            let names = gangway_proto::hostlist::expand(list).map_err(|e| anyhow::anyhow!("--nodes: {e}"))?;
            if names.len() > gangway_core::limits::NODES_MAX {
                bail!(
                    "--nodes: {} nodes, more than a cluster may have ({})",
                    names.len(),
                    gangway_core::limits::NODES_MAX
                );
            }
            p.nodes = names;
        }
        if let Some(c) = self.cpus {
            p.cpus = c;
        }
        if let Some(m) = mem("--mem", &self.mem)? {
            p.mem_mb = m;
        }
        if let Some(g) = &self.gpus {
            (p.gpu_model, p.gpus) = gpus_arg(g)?;
        }
        if let Some(m) = mem("--gpu-mem", &self.gpu_mem)? {
            p.gpu_mem_mb = m;
        }
        if let Some(f) = &self.features {
            p.labels = f
                .iter()
                .filter(|x| !x.is_empty())
                .map(|x| x.split_once('=').map_or((x.clone(), String::new()), |(k, v)| (k.into(), v.into())))
                .collect();
        }
        if let Some(t) = dur("--suspend-after", &self.suspend_after)? {
            p.suspend_after_s = t;
        }
        if let Some(t) = dur("--resume-timeout", &self.resume_timeout)? {
            p.resume_timeout_s = t;
        }
        Ok(())
    }
}

#[derive(Args)]
pub struct QosArgs {
    #[arg(long)]
    priority: Option<u32>,
    #[arg(long)]
    max_time: Option<String>,
    /// QOS levels this one may preempt, comma-separated.
    #[arg(long, value_delimiter = ',')]
    preempt: Option<Vec<String>>,
    /// What happens to this QOS's jobs when preempted: requeue, cancel, or
    /// suspend (stopped, giving their CPUs and GPUs to the preemptor until
    /// they are free again).
    #[arg(long)]
    preempt_mode: Option<String>,
    /// Seconds between the warning signal and the kill of a preempted job.
    #[arg(long)]
    grace: Option<u32>,
    /// Per-user limits under this QOS.
    #[command(flatten)]
    quota: QuotaArgs,
}

#[derive(Args)]
pub struct SetArgs {
    /// Topology level names, top down (e.g. zone,block,rack); nodes' topology paths follow them.
    #[arg(long, value_delimiter = ',')]
    topology_levels: Option<Vec<String>>,
    #[arg(long)]
    weight_age: Option<u32>,
    #[arg(long)]
    weight_fairshare: Option<u32>,
    #[arg(long)]
    weight_job_size: Option<u32>,
    #[arg(long)]
    weight_qos: Option<u32>,
    #[arg(long)]
    weight_partition: Option<u32>,
    /// Age at which the age factor is full (a duration like 7-00:00:00).
    #[arg(long)]
    max_age: Option<String>,
    /// Fair-share usage half-life (a duration like 7-00:00:00).
    #[arg(long)]
    half_life: Option<String>,
    /// Top jobs that get a backfill reservation per pass.
    #[arg(long)]
    reservations: Option<u32>,
    /// Refuse jobs from users without a policy entry.
    #[arg(long)]
    enforce_users: Option<bool>,
    /// Admin identities or user names, comma-separated (an empty list keeps
    /// the current admins: a cluster that has had an admin always has one).
    #[arg(long, value_delimiter = ',')]
    admins: Option<Vec<String>>,
    /// Operator identities or user names, comma-separated (drain and resume
    /// nodes, change anyone's jobs; not the policy). Empty: none.
    #[arg(long, value_delimiter = ',')]
    operators: Option<Vec<String>>,
    /// Identities whose jobs run as another Unix user, NAME=USER,
    /// comma-separated (replaces the map; empty clears it).
    #[arg(long, value_delimiter = ',')]
    user_map: Option<Vec<String>>,
    /// Domains stripped from identities (alice@DOMAIN runs as alice), comma-separated.
    #[arg(long, value_delimiter = ',')]
    user_domains: Option<Vec<String>>,
    /// Allow jobs as root (agents must allow them too).
    #[arg(long)]
    allow_root_jobs: Option<bool>,
    /// Users see only their own jobs (coordinators: their accounts'), like Slurm's PrivateData=jobs.
    #[arg(long)]
    private_jobs: Option<bool>,
    /// Finished jobs the cluster keeps before it drops the oldest (Slurm's
    /// MaxJobCount): 1 to 100000 (the default); the accounting database
    /// keeps the rest. 0 goes back to the default.
    #[arg(long)]
    finished_jobs_kept: Option<u32>,
}

/// The policy as the cluster has it now, and its version.
pub async fn fetch_policy(client: &Client, stale: bool) -> anyhow::Result<(ClusterPolicy, u64)> {
    let resp = client.admin_get_policy(pb::GetPolicyRequest { stale }).await?.into_inner();
    let policy: ClusterPolicy =
        serde_json::from_str(&resp.json).context("policy: the controller sent an unreadable policy")?;
    Ok((policy, resp.version))
}

async fn store(
    client: &Client,
    policy: &ClusterPolicy,
    expected: Option<u64>,
    force: bool,
) -> Result<u64, tonic::Status> {
    let json = serde_json::to_string(policy).expect("policy encodes");
    let req = pb::UpdatePolicyRequest { json, expected_version: expected, force };
    let resp = client.admin_update_policy(req.clone()).await?;
    Ok(resp.into_inner().version)
}

/// Applies `edit` to the current policy and stores it, retrying on concurrent edits.
async fn edit<F>(client: &Client, force: bool, mut edit: F) -> anyhow::Result<u64>
where
    F: FnMut(&mut ClusterPolicy) -> anyhow::Result<()>,
{
    let mut tries = POLICY_EDIT.tries();
    while tries.next().await {
        let (mut policy, version) = fetch_policy(client, false).await?;
        edit(&mut policy)?;
        match store(client, &policy, Some(version), force).await {
            Ok(v) => return Ok(v),
            Err(s) if s.code() == tonic::Code::Aborted => continue,
            Err(s) => return Err(s.into()),
        }
    }
    bail!("policy: it kept changing under this edit ({POLICY_EDIT_ATTEMPTS_MAX} attempts); retry")
}

fn to_toml(policy: &ClusterPolicy) -> anyhow::Result<String> {
    let mut p = policy.clone();
    p.version = 0;
    let body = toml::to_string_pretty(&p).context("policy: cannot write TOML")?;
    Ok(format!(
        "# Gangway cluster policy (version {}). Edit and load with `gangway admin import FILE`.\n{body}",
        policy.version
    ))
}

/// `NAME=USER` pairs (empty items skipped) as a user map.
fn parse_user_map(items: &[String]) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    items
        .iter()
        .filter(|x| !x.is_empty())
        .map(|x| match x.split_once('=') {
            Some((name, user)) if !name.is_empty() && !user.is_empty() => Ok((name.to_string(), user.to_string())),
            _ => bail!("--user-map: '{x}' must be NAME=USER"),
        })
        .collect()
}

fn quota_apply(q: &mut Quota, a: &QuotaArgs) -> anyhow::Result<()> {
    let conv = |field: &str, v: Option<i64>, cur: Option<u32>| -> anyhow::Result<Option<u32>> {
        match v {
            None => Ok(cur),
            Some(-1) => Ok(None),
            Some(n) if n >= 0 && n <= i64::from(u32::MAX) => Ok(Some(n as u32)),
            Some(n) => bail!("{field}: {n} must be -1 (unlimited) or 0..{}", u32::MAX),
        }
    };
    q.max_running_gpus = conv("max-gpus", a.max_gpus, q.max_running_gpus)?;
    q.max_running_cpus = conv("max-cpus", a.max_cpus, q.max_running_cpus)?;
    q.max_running_jobs = conv("max-jobs", a.max_jobs, q.max_running_jobs)?;
    q.max_submitted_jobs = conv("max-submit", a.max_submit, q.max_submitted_jobs)?;
    Ok(())
}

fn dur(field: &str, v: &Option<String>) -> anyhow::Result<Option<u64>> {
    v.as_deref().map(|t| parse::time_limit_s(t).map_err(|e| anyhow::anyhow!(e.replace("--time", field)))).transpose()
}

/// `--gpus N` or `--gpus MODEL:N` as (model, count); no model: any.
pub(crate) fn gpus_arg(g: &str) -> anyhow::Result<(String, u32)> {
    let (model, n) = g.rsplit_once(':').unwrap_or(("", g));
    let n = n.parse().map_err(|_| anyhow::anyhow!("--gpus: '{g}' must be N or MODEL:N"))?;
    Ok((model.to_string(), n))
}

pub(crate) fn mem(field: &str, v: &Option<String>) -> anyhow::Result<Option<u64>> {
    v.as_deref().map(|t| parse::mem_mb(t).map_err(|e| anyhow::anyhow!(e.replace("--mem", field)))).transpose()
}

impl PartitionArgs {
    fn apply(&self, p: &mut Partition) -> anyhow::Result<()> {
        if let Some(n) = &self.nodes {
            p.nodes = n.iter().filter(|x| !x.is_empty()).cloned().collect();
        }
        if let Some(d) = self.default {
            p.default = d;
        }
        if let Some(t) = dur("--default-time", &self.default_time)? {
            p.default_time_s = t;
        }
        if let Some(t) = dur("--max-time", &self.max_time)? {
            p.max_time_s = t;
        }
        if let Some(m) = mem("--default-mem-per-cpu", &self.default_mem_per_cpu)? {
            p.default_mem_per_cpu_mb = m;
        }
        if let Some(m) = mem("--default-mem-per-gpu", &self.default_mem_per_gpu)? {
            p.default_mem_per_gpu_mb = m;
        }
        if let Some(t) = self.tier {
            p.priority_tier = t;
        }
        if let Some(a) = &self.accounts {
            p.allow_accounts = a.iter().filter(|x| !x.is_empty()).cloned().collect();
        }
        if let Some(q) = &self.default_qos {
            p.default_qos = q.clone();
        }
        if let Some(n) = self.max_nodes {
            p.max_nodes = n;
        }
        Ok(())
    }
}

impl AccountArgs {
    fn apply(&self, a: &mut Account) -> anyhow::Result<()> {
        if let Some(p) = &self.parent {
            a.parent = if p == "root" { String::new() } else { p.clone() };
        }
        if let Some(s) = self.shares {
            a.shares = s;
        }
        if let Some(d) = &self.description {
            a.description = d.clone();
        }
        if let Some(b) = self.borrow_gpus {
            a.borrow_gpus = b;
        }
        quota_apply(&mut a.quota, &self.quota)
    }
}

impl UserArgs {
    fn apply(&self, u: &mut User) -> anyhow::Result<()> {
        if let Some(a) = &self.accounts {
            u.accounts = a.iter().filter(|x| !x.is_empty()).cloned().collect();
        }
        quota_apply(&mut u.quota, &self.quota)
    }
}

impl QosArgs {
    fn apply(&self, q: &mut Qos) -> anyhow::Result<()> {
        if let Some(p) = self.priority {
            q.priority = p;
        }
        if let Some(t) = dur("--max-time", &self.max_time)? {
            q.max_time_s = t;
        }
        if let Some(p) = &self.preempt {
            q.preempt = p.iter().filter(|x| !x.is_empty()).cloned().collect();
        }
        if let Some(m) = &self.preempt_mode {
            q.preempt_mode = match m.as_str() {
                "requeue" => PreemptMode::Requeue,
                "cancel" => PreemptMode::Cancel,
                "suspend" => PreemptMode::Suspend,
                other => bail!("preempt-mode: '{other}' must be requeue, cancel or suspend"),
            };
        }
        if let Some(g) = self.grace {
            q.preempt_grace_s = g;
        }
        quota_apply(&mut q.per_user, &self.quota)
    }
}

/// Runs add/set/rm on one kind of object in the policy's map `pick`.
async fn object_cmd<A: Args, T: Default + serde::Serialize>(
    client: &Client,
    out: &Output,
    kind: &str,
    cmd: ObjCmd<A>,
    pick: fn(&mut ClusterPolicy) -> &mut std::collections::BTreeMap<String, T>,
    apply: fn(&A, &mut T) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let (verb, name, version) = match cmd {
        ObjCmd::List => {
            let (mut policy, _) = fetch_policy(client, false).await?;
            let map = pick(&mut policy);
            if out.json {
                println!("{}", serde_json::to_string_pretty(&*map)?);
            } else if map.is_empty() {
                println!("(no {kind}s defined)");
            } else {
                let mut wrapper = toml::Table::new();
                wrapper.insert(format!("{kind}s"), toml::Value::try_from(&*map)?);
                print!("{}", toml::to_string_pretty(&wrapper)?);
            }
            return Ok(());
        }
        ObjCmd::Add { name, args, force } => {
            let v = edit(client, force, |p| {
                let map = pick(p);
                if map.contains_key(&name) {
                    bail!("{kind}: '{name}' already exists; use `set` to change it");
                }
                let mut obj = T::default();
                apply(&args, &mut obj)?;
                map.insert(name.clone(), obj);
                Ok(())
            })
            .await?;
            ("added", name, v)
        }
        ObjCmd::Set { name, args, force } => {
            let v = edit(client, force, |p| {
                let obj = pick(p)
                    .get_mut(&name)
                    .ok_or_else(|| anyhow::anyhow!("{kind}: '{name}' does not exist; use `add` to create it"))?;
                apply(&args, obj)
            })
            .await?;
            ("updated", name, v)
        }
        ObjCmd::Rm { name, force } => {
            let v = edit(client, force, |p| {
                pick(p).remove(&name).map(|_| ()).ok_or_else(|| anyhow::anyhow!("{kind}: '{name}' does not exist"))
            })
            .await?;
            ("removed", name, v)
        }
    };
    if out.json {
        println!("{}", json!({"kind": kind, "name": name, "result": verb, "policy_version": version}));
    } else {
        println!("{kind} {name} {verb} (policy version {version})");
    }
    Ok(())
}

pub async fn run(client: &Client, out: &Output, cmd: AdminCmd) -> anyhow::Result<()> {
    match cmd {
        AdminCmd::Export { file } => {
            let (policy, _) = fetch_policy(client, false).await?;
            let text = to_toml(&policy)?;
            match file {
                Some(f) => std::fs::write(&f, text).with_context(|| format!("cannot write {}", f.display()))?,
                None => print!("{text}"),
            }
            Ok(())
        }
        AdminCmd::Import { file, force, dry_run } => {
            let text = std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
            let policy: ClusterPolicy =
                toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", file.display(), e.message()))?;
            policy.validate().map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let (current, version) = fetch_policy(client, false).await?;
            let (mut a, mut b) = (current.clone(), policy.clone());
            a.version = 0;
            b.version = 0;
            if a == b {
                println!("the policy already matches {} (version {version})", file.display());
                return Ok(());
            }
            if dry_run {
                println!("{} is valid; it would replace policy version {version}", file.display());
                return Ok(());
            }
            let v = store(client, &policy, Some(version), force).await?;
            println!("policy imported from {} (version {v})", file.display());
            Ok(())
        }
        AdminCmd::Partition(c) => {
            object_cmd(client, out, "partition", c, |p| &mut p.partitions, PartitionArgs::apply).await
        }
        AdminCmd::Account(c) => object_cmd(client, out, "account", c, |p| &mut p.accounts, AccountArgs::apply).await,
        AdminCmd::User(c) => object_cmd(client, out, "user", c, |p| &mut p.users, UserArgs::apply).await,
        AdminCmd::Qos(c) => object_cmd(client, out, "qos", c, |p| &mut p.qos, QosArgs::apply).await,
        AdminCmd::Pool(c) => object_cmd(client, out, "pool", c, |p| &mut p.pools, PoolArgs::apply).await,
        AdminCmd::Set(a) => {
            let v = edit(client, false, |p| {
                if let Some(l) = &a.topology_levels {
                    p.topology_levels = l.iter().filter(|x| !x.is_empty()).cloned().collect();
                }
                let w = &mut p.priority;
                for (dst, src) in [
                    (&mut w.age, a.weight_age),
                    (&mut w.fairshare, a.weight_fairshare),
                    (&mut w.job_size, a.weight_job_size),
                    (&mut w.qos, a.weight_qos),
                    (&mut w.partition, a.weight_partition),
                ] {
                    if let Some(x) = src {
                        *dst = x;
                    }
                }
                if let Some(t) = dur("--max-age", &a.max_age)? {
                    p.priority.max_age_s = t;
                }
                if let Some(t) = dur("--half-life", &a.half_life)? {
                    p.fairshare_half_life_s = t;
                }
                if let Some(r) = a.reservations {
                    p.backfill_reservations = r;
                }
                if let Some(e) = a.enforce_users {
                    p.enforce_users = e;
                }
                if let Some(ad) = &a.admins {
                    p.admins = ad.iter().filter(|x| !x.is_empty()).cloned().collect();
                }
                if let Some(o) = &a.operators {
                    p.operators = o.iter().filter(|x| !x.is_empty()).cloned().collect();
                }
                if let Some(m) = &a.user_map {
                    p.user_map = parse_user_map(m)?;
                }
                if let Some(d) = &a.user_domains {
                    p.user_domains = d.iter().filter(|x| !x.is_empty()).cloned().collect();
                }
                if let Some(r) = a.allow_root_jobs {
                    p.allow_root_jobs = r;
                }
                if let Some(pj) = a.private_jobs {
                    p.private_jobs = pj;
                }
                if let Some(n) = a.finished_jobs_kept {
                    p.finished_jobs_kept = (n > 0).then_some(n);
                }
                Ok(())
            })
            .await?;
            println!("policy updated (version {v})");
            Ok(())
        }
        AdminCmd::Reservation(c) => crate::reservations::run(client, out, c).await,
        AdminCmd::Inventory(c) => crate::inventory::run(client, out, c).await,
        AdminCmd::License { name, count: None, .. } => {
            crate::reservations::show_licenses(client, out, name.as_deref()).await
        }
        AdminCmd::License { name: None, count: Some(_), .. } => {
            bail!("license: give the license's name before the count")
        }
        AdminCmd::License { name: Some(name), count: Some(count), account, qos }
            if account.is_some() || qos.is_some() =>
        {
            let (scope, what) = match (account.clone(), qos) {
                (Some(a), _) => (a, "account"),
                (None, q) => (q.unwrap_or_default(), "QOS"),
            };
            let v = edit(client, false, |p| {
                let limits = if account.is_some() { &mut p.account_licenses } else { &mut p.qos_licenses };
                if count == 0 {
                    if let Some(m) = limits.get_mut(&scope) {
                        m.remove(&name);
                        if m.is_empty() {
                            limits.remove(&scope);
                        }
                    }
                } else {
                    limits.entry(scope.clone()).or_default().insert(name.clone(), count);
                }
                Ok(())
            })
            .await?;
            println!("license {name}: {what} {scope} may hold {count} seats (policy version {v})");
            Ok(())
        }
        AdminCmd::License { name: Some(name), count: Some(count), .. } => {
            let v = edit(client, false, |p| {
                if count == 0 {
                    p.licenses.remove(&name);
                } else {
                    p.licenses.insert(name.clone(), count);
                }
                Ok(())
            })
            .await?;
            println!("license {name}: {count} seats (policy version {v})");
            Ok(())
        }
        AdminCmd::Coordinators { account, set } => {
            let Some(names) = set else {
                let (policy, _) = fetch_policy(client, false).await?;
                let rows: Vec<_> =
                    policy.coordinators.iter().filter(|(a, _)| account.as_ref().is_none_or(|x| x == *a)).collect();
                if out.json {
                    println!("{}", serde_json::to_string_pretty(&rows)?);
                } else {
                    println!("{:<24} COORDINATORS", "ACCOUNT");
                    for (a, names) in rows {
                        println!("{a:<24} {}", names.join(","));
                    }
                }
                return Ok(());
            };
            let Some(account) = account else { bail!("coordinators: --set needs the account") };
            let names: Vec<String> = names.iter().filter(|x| !x.is_empty()).cloned().collect();
            let v = edit(client, false, |p| {
                if names.is_empty() {
                    p.coordinators.remove(&account);
                } else {
                    p.coordinators.insert(account.clone(), names.clone());
                }
                Ok(())
            })
            .await?;
            println!("coordinators of {account} set (policy version {v})");
            Ok(())
        }
        AdminCmd::Shares { stale } => {
            let resp = client.admin_fair_share(pb::FairShareRequest { stale }).await?.into_inner();
            if out.json {
                let rows: Vec<_> = resp
                    .accounts
                    .iter()
                    .map(|a| {
                        json!({"account": a.account, "parent": a.parent, "shares": a.shares, "norm_shares": a.norm_shares,
                            "gpu_hours": a.gpu_hours, "cpu_hours": a.cpu_hours, "norm_usage": a.norm_usage,
                            "factor": a.factor, "running_gpus": a.running_gpus, "running_jobs": a.running_jobs,
                            "pending_jobs": a.pending_jobs})
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(());
            }
            println!(
                "{:<20} {:<12} {:>7} {:>10} {:>11} {:>11} {:>10} {:>8} {:>8} {:>8}",
                "ACCOUNT",
                "PARENT",
                "SHARES",
                "NORM_SHR",
                "GPU_HOURS",
                "CPU_HOURS",
                "NORM_USE",
                "FAIRSHR",
                "RUN_GPU",
                "PENDING"
            );
            for a in &resp.accounts {
                println!(
                    "{:<20} {:<12} {:>7} {:>10.4} {:>11.2} {:>11.2} {:>10.4} {:>8.4} {:>8} {:>8}",
                    a.account,
                    a.parent,
                    a.shares,
                    a.norm_shares,
                    a.gpu_hours,
                    a.cpu_hours,
                    a.norm_usage,
                    a.factor,
                    a.running_gpus,
                    a.pending_jobs
                );
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An edit that keeps racing others is read and stored
    /// POLICY_EDIT_ATTEMPTS_MAX times, then refused with a message to retry.
    #[tokio::test]
    async fn a_policy_edit_tries_policy_edit_attempts_max_times() {
        assert_eq!(gangway_proto::retry::count_tries(POLICY_EDIT).await, POLICY_EDIT_ATTEMPTS_MAX);
        assert!(POLICY_EDIT.span() < std::time::Duration::from_secs(2), "an admin waits at most a moment");
    }
}
