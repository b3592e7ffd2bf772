//! The client commands (`submit`, `queue`, `show`, …) and the two daemons
//! (`controller`, `agent`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use gangway_proto::v1::admin_service_client::AdminServiceClient;
use gangway_proto::v1::job_service_client::JobServiceClient;
use gangway_proto::v1::node_service_client::NodeServiceClient;
use serde_json::{json, Value};

use crate::{jobctl, parse, policy};

pub struct Output {
    pub json: bool,
}

impl Output {
    fn print_json(&self, v: &Value) {
        println!("{}", serde_json::to_string_pretty(v).expect("json"));
    }
}

/// Renders an error chain as one line; gRPC statuses as `code: message`.
pub fn one_line(e: &anyhow::Error) -> String {
    if let Some(s) = e.downcast_ref::<tonic::Status>() {
        let code = match s.code() {
            tonic::Code::InvalidArgument => "invalid argument",
            tonic::Code::NotFound => "not found",
            tonic::Code::FailedPrecondition => "refused",
            tonic::Code::Unavailable => "unavailable",
            tonic::Code::ResourceExhausted => "limit reached",
            tonic::Code::DeadlineExceeded => "timed out",
            tonic::Code::Aborted => "aborted",
            tonic::Code::PermissionDenied => "permission denied",
            _ => "error",
        };
        return format!("{code}: {}", s.message()).replace('\n', " ");
    }
    format!("{e:#}").replace('\n', " ")
}

// ---------------------------------------------------------------- controller

#[derive(Args)]
pub struct ControllerArgs {
    /// This replica's id (a positive integer, unique in the cluster).
    #[arg(long)]
    id: u64,
    /// Address to listen on, e.g. 0.0.0.0:50051.
    #[arg(long)]
    listen: String,
    /// Address others reach this replica at (default: the listen address).
    #[arg(long)]
    advertise: Option<String>,
    /// Initial members: 1=HOST:PORT,2=HOST:PORT,3=HOST:PORT (include this replica).
    #[arg(long)]
    peers: Option<String>,
    /// Where the Raft log, metadata and snapshots live.
    #[arg(long)]
    data_dir: PathBuf,
    /// Start empty and wait to be added with `gangway cluster add`.
    #[arg(long)]
    join: bool,
    /// Mark a node down after this many ms without a heartbeat (its jobs are
    /// then requeued). Agents stop their tasks after half of it without a
    /// leader, so it is also the longest control-plane outage running jobs ride
    /// out (half of it).
    #[arg(long, default_value_t = gangway_controller::Timing::default().node_down_timeout_ms)]
    node_down_timeout_ms: u64,
    /// Serve Prometheus metrics at HOST:PORT, path /metrics (e.g. 0.0.0.0:9464).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Serve the metrics over TLS with this replica's certificate, only to
    /// the scrapers --metrics-client names.
    #[arg(long)]
    metrics_tls: bool,
    /// A client certificate name allowed to scrape with --metrics-tls (repeatable).
    #[arg(long = "metrics-client", default_value = "prometheus")]
    metrics_clients: Vec<String>,
    /// A user who is an admin while the policy names none: the first admin of
    /// a new cluster (repeatable; give every replica the same list).
    #[arg(long = "bootstrap-admin")]
    bootstrap_admins: Vec<String>,
    /// Accept jobs that run as root: seeds the policy's allow_root_jobs when
    /// this replica moves the cluster to data format 6 (a new cluster, or an
    /// upgrade); after that the policy decides (`gangway admin set
    /// --allow-root-jobs`). Give every replica the same.
    #[arg(long)]
    allow_root_jobs: bool,
    /// Accept bearer tokens signed by this public key (PEM: EC P-256 for
    /// ES256, Ed25519, or RSA for RS256; repeatable, e.g. during rotation).
    #[arg(long = "token-public-key")]
    token_public_keys: Vec<PathBuf>,
    /// Accept bearer tokens signed by the keys of this JWKS file (a site's OIDC issuer).
    #[arg(long)]
    token_jwks: Option<PathBuf>,
    /// The `iss` tokens must carry.
    #[arg(long, default_value = gangway_proto::token::DEFAULT_ISSUER)]
    token_issuer: String,
    /// The `aud` tokens must carry.
    #[arg(long, default_value = gangway_proto::token::DEFAULT_AUDIENCE)]
    token_audience: String,
    /// Revoked token ids (`jti`), one per line; read again when it changes.
    #[arg(long)]
    token_revoked: Option<PathBuf>,
    /// Users see only their own jobs (Slurm's PrivateData=jobs): others' read
    /// as not found. Always on at this replica, and seeds the policy's
    /// private_jobs when this replica moves the cluster to data format 6
    /// (then `gangway admin set --private-jobs` rules the whole cluster).
    #[arg(long)]
    private_jobs: bool,
    /// Seed this replica's empty data directory from a backup file (`gangway
    /// cluster backup`), as a member of a new cluster of --peers: the way back
    /// when a majority is lost for good. Restore every member from the same
    /// file; once seeded, start the replica without this flag.
    #[arg(long, value_name = "FILE")]
    restore: Option<std::path::PathBuf>,
}

pub async fn controller(a: ControllerArgs, tls: &crate::tls::TlsArgs) -> anyhow::Result<()> {
    crash_on_panic();
    let me = gangway_proto::tls::Principal::new(gangway_proto::tls::Role::Server, &a.id.to_string())
        .map_err(anyhow::Error::msg)?;
    let security = tls.for_daemon(&me)?;
    if let Some(p) = security.credentials().and_then(|c| c.principal()) {
        if p != me {
            bail!("tls: the certificate names {p}, but this is replica {} (server:{})", a.id, a.id);
        }
    }
    for admin in &a.bootstrap_admins {
        gangway_proto::tls::check_principal_name(admin).map_err(|e| anyhow::anyhow!("bootstrap-admin: {e}"))?;
    }
    let advertise = a.advertise.clone().unwrap_or_else(|| a.listen.clone());
    let peers = match &a.peers {
        Some(p) => gangway_controller::config::parse_peers(p).map_err(anyhow::Error::msg)?,
        None if a.join => BTreeMap::from([(a.id, advertise.clone())]),
        None => {
            bail!("peers: required (e.g. --peers 1=10.0.0.1:50051,2=10.0.0.2:50051,3=10.0.0.3:50051), or use --join")
        }
    };
    let listener =
        tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("listen: cannot bind {}", a.listen))?;
    let timing = gangway_controller::Timing { node_down_timeout_ms: a.node_down_timeout_ms, ..Default::default() };
    let config = gangway_controller::ReplicaConfig {
        id: a.id,
        advertise_addr: advertise,
        peers,
        data_dir: a.data_dir,
        join: a.join,
        timing,
        security,
        bootstrap_admins: a.bootstrap_admins,
        allow_root_jobs: a.allow_root_jobs,
        tokens: gangway_proto::token::TokenVerifier::load(&gangway_proto::token::TokenConfig {
            public_keys: a.token_public_keys,
            jwks: a.token_jwks,
            issuer: Some(a.token_issuer),
            audience: Some(a.token_audience),
            revoked: a.token_revoked,
        })
        .map_err(|e| anyhow::anyhow!("tokens: {e}"))?,
        private_jobs: a.private_jobs,
        restore: a.restore.clone(),
    };
    let metrics = match &a.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("metrics-listen: cannot bind {addr}"))?,
        ),
        None => None,
    };
    let mut handle = gangway_controller::replica::start(config, listener).await?;
    tracing::info!(id = a.id, addr = %handle.local_addr, "controller serving");
    let metrics_tls = match (handle.replica.security.credentials(), a.metrics_tls) {
        (Some(c), true) => Some(gangway_proto::telemetry::MetricsTls {
            config: c.server_config_for(b"http/1.1").map_err(|e| anyhow::anyhow!("metrics TLS: {e}"))?,
            scrapers: a.metrics_clients.clone(),
        }),
        (None, true) => bail!("metrics-tls: needs the replica's certificate (not --insecure)"),
        (_, false) => None,
    };
    let _metrics = metrics.map(|l| {
        tracing::info!(addr = ?l.local_addr().ok(), tls = metrics_tls.is_some(), "serving metrics");
        gangway_controller::telemetry::serve(handle.replica.clone(), l, metrics_tls)
    });
    tokio::select! {
        r = handle.wait() => r,
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            handle.shutdown().await;
            Ok(())
        }
    }
}

/// Exit status of a replica that panicked (EX_SOFTWARE): distinct from a
/// refused start (1), so logs and supervisors tell them apart.
const PANIC_EXIT_CODE: i32 = 70;

/// Crash-only replicas: a panic anywhere (a broken invariant) ends the process,
/// after the panic is logged, so its supervisor restarts it from its durable
/// store instead of leaving a half-working replica that still answers.
fn crash_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        tracing::error!(panic = %info, "FATAL: the replica panicked; exiting so it is restarted");
        std::process::exit(PANIC_EXIT_CODE);
    }));
}

/// A certificate's expiry as days from now (`-` when the replica has none).
fn cert_expiry(not_after_unix: Option<i64>) -> String {
    let Some(t) = not_after_unix else { return "-".into() };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    let days = (t - now).div_euclid(86_400);
    if t <= now {
        "EXPIRED".into()
    } else {
        format!("{days}d")
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

// ---------------------------------------------------------------- agent

#[derive(Args)]
pub struct AgentArgs {
    /// Controller replicas, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    controllers: Vec<String>,
    /// Run tasks as root when a job's user is root (refused by default).
    #[arg(long)]
    allow_root_jobs: bool,
    /// Node name (default: the host name).
    #[arg(long)]
    name: Option<String>,
    /// Simulated GPUs: COUNTxMODEL[/ISLAND_SIZE], e.g. 8xh100-80gb or 8xa100-40gb/4.
    #[arg(long, conflicts_with = "gpu_inventory")]
    fake_gpus: Option<String>,
    /// Simulated GPUs from a file: one `MODEL ISLAND [MEM_MB]` line per GPU.
    #[arg(long)]
    gpu_inventory: Option<PathBuf>,
    /// CPUs to offer (default: all of the host's).
    #[arg(long)]
    cpus: Option<u32>,
    /// Memory to offer in MiB (default: all of the host's).
    #[arg(long)]
    mem_mb: Option<u64>,
    /// Labels, k=v,k=v.
    #[arg(long, value_delimiter = ',')]
    labels: Vec<String>,
    /// Topology path, e.g. zone-a/block-1/rack-3.
    #[arg(long)]
    topology: Option<String>,
    /// Simulated GPU faults are read from this file, one `INDEX REASON` line per
    /// failing GPU (default with --fake-gpus: STATE_DIR/gpu-faults).
    #[arg(long)]
    gpu_fault_file: Option<PathBuf>,
    /// Seconds a failed GPU must stay healthy before it returns to service.
    #[arg(long, default_value_t = 60)]
    gpu_hold_down_s: u64,
    /// A health-check program run every --health-check-interval-s; a non-zero
    /// exit drains the node with its first line of output as the reason.
    #[arg(long)]
    health_check_program: Option<PathBuf>,
    #[arg(long, default_value_t = 300)]
    health_check_interval_s: u64,
    /// Print the discovered inventory and GPU health as JSON, then exit.
    #[arg(long)]
    probe: bool,
    /// Where the agent keeps launch fences and scripts
    /// (default: /var/lib/gangway-agent as root, ~/.local/state/gangway-agent otherwise).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Serve Prometheus metrics (node and per-GPU) at HOST:PORT, path /metrics.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Serve the metrics over TLS with this node's certificate, only to the
    /// scrapers --metrics-client names.
    #[arg(long)]
    metrics_tls: bool,
    /// A client certificate name allowed to scrape with --metrics-tls (repeatable).
    #[arg(long = "metrics-client", default_value = "prometheus")]
    metrics_clients: Vec<String>,
    /// The address other nodes reach this one at (default: its node name):
    /// srun's steps and training rendezvous (MASTER_ADDR) use it.
    #[arg(long, default_value = "")]
    addr: String,
    /// Serve the step service (the tasks srun starts from a batch script on
    /// the job's first node) at HOST:PORT (Slurm's slurmd uses 6818); `none`: off.
    #[arg(long, default_value = "0.0.0.0:6818")]
    step_listen: String,
}

fn parse_labels(items: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    items
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| anyhow::anyhow!("labels: '{s}' must be KEY=VALUE"))
        })
        .collect()
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "node".into())
}

pub async fn agent(a: AgentArgs, identity: &str, tls: &crate::tls::TlsArgs) -> anyhow::Result<()> {
    let name = a.name.unwrap_or_else(hostname);
    let simulated = a.fake_gpus.is_some() || a.gpu_inventory.is_some();
    let (gpus, nvml) = match (&a.fake_gpus, &a.gpu_inventory) {
        (Some(spec), _) => {
            (gangway_node_agent::inventory::parse_fake_gpus(spec, &name).map_err(anyhow::Error::msg)?, None)
        }
        (None, Some(file)) => {
            (gangway_node_agent::inventory::read_inventory_file(file, &name).map_err(anyhow::Error::msg)?, None)
        }
        (None, None) => match gangway_node_agent::nvml::NvmlProvider::probe() {
            Ok((provider, gpus)) => {
                let provider = std::sync::Arc::new(provider);
                if !a.probe {
                    provider.start_xid_watch();
                }
                (gpus, Some(provider))
            }
            Err(why) => {
                tracing::warn!("{why}");
                (Vec::new(), None)
            }
        },
    };
    if a.probe {
        let health: Vec<Value> = gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let fault = nvml.as_ref().and_then(|n| n.fault(i as u32));
                json!({"index": i, "uuid": g.uuid, "model": g.model, "mem_mb": g.mem_mb,
                       "nvlink_island": g.nvlink_island, "healthy": fault.is_none(), "fault": fault})
            })
            .collect();
        let doc = json!({"node": name, "cpus": gangway_node_agent::inventory::host_cpus(),
                         "mem_mb": gangway_node_agent::inventory::host_mem_mb(),
                         "gpu_source": if simulated { "fake" } else if nvml.is_some() { "nvml" } else { "none" },
                         "gpus": health});
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    let state_dir = a.state_dir.unwrap_or_else(|| {
        if nix::unistd::geteuid().is_root() {
            PathBuf::from("/var/lib/gangway-agent")
        } else {
            let home = std::env::var("HOME").unwrap_or_else(|_| "/tmp".into());
            PathBuf::from(home).join(".local/state/gangway-agent")
        }
    });
    let gpu_fault_file = a.gpu_fault_file.or_else(|| simulated.then(|| state_dir.join("gpu-faults")));
    let me = gangway_proto::tls::Principal::new(gangway_proto::tls::Role::Agent, &name)
        .map_err(|e| anyhow::anyhow!("name: {e}"))?;
    let security = tls.for_daemon(&me)?;
    if nix::unistd::geteuid().is_root() {
        // Whatever groups the agent was started with (sudo, a root shell)
        // must not lend their access to the files it opens for jobs.
        nix::unistd::setgroups(&[]).context("dropping the agent's supplementary groups")?;
    }
    // The agent's own files (state, fences, task records) are private; job
    // files get their submitter's umask explicitly.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let config = gangway_node_agent::AgentConfig {
        controllers: a.controllers,
        name,
        addr: a.addr,
        cpus: a.cpus.unwrap_or_else(gangway_node_agent::inventory::host_cpus),
        mem_mb: a.mem_mb.unwrap_or_else(gangway_node_agent::inventory::host_mem_mb),
        gpus,
        topology: a.topology.map(|t| t.split('/').map(str::to_string).collect()).unwrap_or_default(),
        labels: parse_labels(&a.labels)?,
        identity: identity.to_string(),
        security,
        allow_root_jobs: a.allow_root_jobs,
        stop_grace: gangway_node_agent::supervisor::STOP_GRACE_DEFAULT,
        gpu_fault_file,
        gpu_hold_down: std::time::Duration::from_secs(a.gpu_hold_down_s),
        nvml,
        shim: Some(std::env::current_exe().context("finding the gangway binary for task-shim")?),
        kill_tasks_on_exit: false,
        metrics_listen: a.metrics_listen,
        metrics_tls: a.metrics_tls.then_some(a.metrics_clients),
        step_listen: (a.step_listen != "none").then_some(a.step_listen),
        health_check: a
            .health_check_program
            .map(|p| (p, std::time::Duration::from_secs(a.health_check_interval_s.max(1)))),
        state_dir,
    };
    gangway_node_agent::run(config, shutdown_signal()).await
}

// ---------------------------------------------------------------- submit

#[derive(Args, Default)]
pub struct SubmitArgs {
    /// Job name.
    #[arg(short = 'J', long = "job-name", alias = "name")]
    pub(crate) name: Option<String>,
    /// Nodes: N, or a range MIN-MAX (the whole gang starts together).
    #[arg(short = 'N', long, allow_hyphen_values = true)]
    pub(crate) nodes: Option<String>,
    /// Tasks in all: spread evenly over the nodes (with no -N, all on one node).
    #[arg(short = 'n', long = "ntasks", allow_negative_numbers = true, conflicts_with = "tasks_per_node")]
    pub(crate) ntasks: Option<i64>,
    #[arg(long = "ntasks-per-node", allow_negative_numbers = true)]
    pub(crate) tasks_per_node: Option<i64>,
    #[arg(short = 'c', long = "cpus-per-task", allow_negative_numbers = true)]
    pub(crate) cpus_per_task: Option<i64>,
    /// Memory per node: MiB, or with a unit (512M, 64G).
    #[arg(long)]
    pub(crate) mem: Option<String>,
    /// GPUs per node: COUNT or TYPE:COUNT (h100:8).
    #[arg(long = "gpus-per-node", allow_hyphen_values = true)]
    pub(crate) gpus_per_node: Option<String>,
    /// GPUs for the whole job: [TYPE:]COUNT, spread evenly over its nodes.
    #[arg(short = 'G', long = "gpus", allow_hyphen_values = true)]
    pub(crate) gpus: Option<String>,
    /// GPUs per task: [TYPE:]COUNT (times --ntasks-per-node per node).
    #[arg(long = "gpus-per-task", allow_hyphen_values = true)]
    pub(crate) gpus_per_task: Option<String>,
    /// Generic resources, Slurm style: gpu[:TYPE]:COUNT per node.
    #[arg(long)]
    pub(crate) gres: Option<String>,
    /// Memory per allocated CPU: MiB or with a unit (4G).
    #[arg(long = "mem-per-cpu")]
    pub(crate) mem_per_cpu: Option<String>,
    /// Memory per allocated GPU: MiB or with a unit (80G); per node it is this
    /// times the node's GPUs.
    #[arg(long = "mem-per-gpu")]
    pub(crate) mem_per_gpu: Option<String>,
    /// Not before this time (UTC): now+1hour, 16:00, 2026-12-24T08:00, midnight.
    #[arg(long, short = 'b')]
    pub(crate) begin: Option<String>,
    /// Free text kept with the job (shown by show/squeue %k/sacct).
    #[arg(long)]
    pub(crate) comment: Option<String>,
    /// Admins: the job's priority, replacing the computed one.
    #[arg(long)]
    pub(crate) priority: Option<u32>,
    /// Run on exactly these nodes (a hostlist: n[1-4],gpu7); with no --nodes,
    /// the job takes as many nodes as listed.
    #[arg(short = 'w', long)]
    pub(crate) nodelist: Option<String>,
    /// Never run on these nodes (a hostlist).
    #[arg(short = 'x', long)]
    pub(crate) exclude: Option<String>,
    /// CPUs per allocated GPU: each node gets this times its GPUs, split
    /// among its tasks (instead of --cpus-per-task).
    #[arg(long = "cpus-per-gpu")]
    pub(crate) cpus_per_gpu: Option<i64>,
    /// Slurm's batch semantics (what sbatch does): the command runs on the
    /// first node only and `srun` inside it starts steps on the others.
    /// Without it the command runs once on every node.
    #[arg(long)]
    pub(crate) batch: bool,
    /// append (default: a requeued job's earlier output is kept) or truncate
    /// the output files when the job starts.
    #[arg(long = "open-mode")]
    pub(crate) open_mode: Option<String>,
    /// Account to charge (default: your default account).
    #[arg(short = 'A', long)]
    pub(crate) account: Option<String>,
    /// Quality of service.
    #[arg(short = 'q', long)]
    pub(crate) qos: Option<String>,
    /// Node features, joined with & (e.g. "ib&arch=zen4").
    #[arg(short = 'C', long)]
    pub(crate) constraint: Option<String>,
    /// Whole nodes, shared with no other job.
    #[arg(long)]
    pub(crate) exclusive: bool,
    /// Keep the gang within one domain of a topology level: LEVEL[:required] or
    /// LEVEL:preferred[@WAIT] (e.g. rack:required, block:preferred@10:00).
    #[arg(long)]
    pub(crate) topology: Option<String>,
    /// Slurm's --switches=1[@WAIT]: within one leaf domain (the lowest topology level),
    /// preferred for WAIT (default: required).
    #[arg(long)]
    pub(crate) switches: Option<String>,
    /// Dependencies: afterok:ID[:ID..],afterany:ID,...,singleton.
    #[arg(short = 'd', long)]
    pub(crate) dependency: Option<String>,
    /// A job array: indexes like 0-99, 1,3,5-7 or 0-99:2, with an optional %LIMIT.
    #[arg(short = 'a', long)]
    pub(crate) array: Option<String>,
    /// Lower the priority by N (admins may raise it with a negative N).
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) nice: Option<i32>,
    /// Submit held; start it with `gangway release`.
    #[arg(short = 'H', long)]
    pub(crate) hold: bool,
    /// What to do when a dependency can never be met: yes = cancel (default), no = keep it held.
    #[arg(long = "kill-on-invalid-dep")]
    pub(crate) kill_on_invalid_dep: Option<String>,
    /// Time limit: MINUTES, H:MM:SS, D-HH:MM:SS.
    #[arg(short = 't', long)]
    pub(crate) time: Option<String>,
    #[arg(short = 'p', long)]
    pub(crate) partition: Option<String>,
    /// Working directory (default: the current one).
    #[arg(short = 'D', long)]
    pub(crate) chdir: Option<String>,
    /// Run this shell command line as the job.
    #[arg(long)]
    pub(crate) wrap: Option<String>,
    /// Environment for the job, KEY=VALUE (repeatable).
    #[arg(long = "env")]
    pub(crate) env: Vec<String>,
    /// Deduplication key (default: a fresh one per invocation, so the client's own
    /// retries never create a second job).
    #[arg(long)]
    pub(crate) idempotency_key: Option<String>,
    /// Print only the job id.
    #[arg(long)]
    pub(crate) parsable: bool,
    /// stdout file pattern (%j job id, %x name, %N node, %u user, %t rank, %A %a).
    #[arg(short = 'o', long)]
    pub(crate) output: Option<String>,
    /// stderr file pattern (default: with stdout).
    #[arg(short = 'e', long)]
    pub(crate) error: Option<String>,
    /// Warning signal before the time limit: [B:]SIG[@SECONDS], e.g. USR1@120.
    #[arg(long)]
    pub(crate) signal: Option<String>,
    /// Requeue the job if a node it runs on fails (the default).
    #[arg(long, overrides_with = "no_requeue")]
    pub(crate) requeue: bool,
    /// End the job NODE_FAIL instead of requeueing it when a node fails.
    #[arg(long)]
    pub(crate) no_requeue: bool,
    /// A batch script to run.
    pub(crate) script: Option<PathBuf>,
    /// The script's text when the caller has read it already (sbatch).
    #[arg(skip)]
    pub(crate) script_text: Option<String>,
    /// A command to run, after `--`.
    #[arg(last = true)]
    pub(crate) command: Vec<String>,
}

/// Submits; the job id and how many jobs (an array's elements) it made.
pub async fn submit(client: &Client, out: &Output, a: SubmitArgs) -> anyhow::Result<(u64, u32)> {
    // --switches names the lowest topology level, which the policy defines.
    let leaf_level = match (&a.topology, &a.switches) {
        (None, Some(_)) => {
            let policy = policy::fetch_policy(client, true).await?.0;
            let Some(level) = policy.topology_levels.last() else {
                bail!("switches: this cluster defines no topology levels (gangway admin set --topology-levels ...)")
            };
            Some(level.clone())
        }
        _ => None,
    };
    let (key, parsable, priority, held) = (a.idempotency_key.clone(), a.parsable, a.priority, a.hold);
    let mut spec = job_spec(a, leaf_level.as_deref())?;
    let Some(priority) = priority else {
        return send_submit(client, out, spec, key, parsable).await;
    };
    // --priority: admins only, checked before anything is submitted; the job is
    // submitted held, given its priority, then released (unless -H).
    let policy = policy::fetch_policy(client, false).await?.0;
    let me = client.identity();
    if !(policy.lists(&policy.admins, me) || policy.is_operator(me)) {
        let user = gangway_core::policy::identity_name(me);
        bail!("--priority: only operators and admins may set a job's priority ({user} is neither)");
    }
    spec.hold = true;
    let id = send_submit_quiet(client, spec, key).await?;
    use pb::update_job_request::Change;
    let set = jobctl::change_jobs_quiet(client, id, Change::SetPriority, i64::from(priority)).await;
    if let Err(e) = set {
        let _ = jobctl::cancel_quiet(client, id).await;
        return Err(e.context("--priority"));
    }
    if !held {
        jobctl::change_jobs_quiet(client, id, Change::Release, 0).await?;
    }
    if out.json {
        out.print_json(&json!({"job_id": id, "priority": priority}));
    } else if parsable {
        println!("{id}");
    } else {
        println!("Submitted batch job {id}");
    }
    Ok((id, 1))
}

/// This process's umask, as Slurm hands it to jobs (`SLURM_UMASK`, octal):
/// files the job creates get the modes they would get here.
pub(crate) fn umask_env(spec: &mut pb::JobSpec) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let umask = status.lines().find_map(|l| l.strip_prefix("Umask:")).map(str::trim);
    if let Some(u) = umask.filter(|u| u.len() <= 4 && u.chars().all(|c| c.is_digit(8))) {
        spec.env.entry("SLURM_UMASK".to_string()).or_insert_with(|| u.to_string());
    }
}

/// Submits `spec` and returns the job id, printing nothing.
async fn send_submit_quiet(client: &Client, mut spec: pb::JobSpec, key: Option<String>) -> anyhow::Result<u64> {
    umask_env(&mut spec);
    let key = key.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: key };
    Ok(client
        .call(|ch| {
            let r = client.request(req.clone());
            async move { JobServiceClient::new(ch).submit(r).await }
        })
        .await?
        .into_inner()
        .job_id)
}

/// `sbatch --test-only`: where and when the job would start, submitting nothing.
pub(crate) async fn test_submit(client: &Client, out: &Output, a: SubmitArgs) -> anyhow::Result<()> {
    let leaf_level = match (&a.topology, &a.switches) {
        (None, Some(_)) => policy::fetch_policy(client, true).await?.0.topology_levels.last().cloned(),
        _ => None,
    };
    let spec = job_spec(a, leaf_level.as_deref())?;
    let req = pb::SubmitRequest { spec: Some(spec.clone()), idempotency_key: String::new() };
    let e = client
        .call(|ch| {
            let r = client.request(req.clone());
            async move { JobServiceClient::new(ch).test_submit(r).await }
        })
        .await?
        .into_inner();
    let cpus = spec.nodes.unwrap_or(1).max(1)
        * spec.tasks_per_node.unwrap_or(1).max(1)
        * spec.cpus_per_task.unwrap_or(1).max(1);
    if out.json {
        out.print_json(&json!({
            "job_id": e.job_id, "reason": e.reason, "detail": e.detail,
            "estimated_start_ms": e.estimated_start_ms, "nodes": e.start_nodes, "cpus": cpus,
        }));
        return Ok(());
    }
    match e.estimated_start_ms {
        Some(t) => {
            let nodes = if e.start_nodes.is_empty() {
                String::new()
            } else {
                format!(" on nodes {}", crate::slurm::hostlist::compress(&e.start_nodes))
            };
            let partition =
                if spec.partition.is_empty() { String::new() } else { format!(" in partition {}", spec.partition) };
            eprintln!(
                "sbatch: Job {} to start at {} using {cpus} processors{nodes}{partition}",
                e.job_id,
                crate::slurm::timestamp(t)
            );
            Ok(())
        }
        None if e.reason == "BadConstraints" => bail!("test-only: the job could never run: {}", e.detail),
        None => {
            eprintln!("sbatch: Job {} would wait ({}): {}; no start time is known yet", e.job_id, e.reason, e.detail);
            Ok(())
        }
    }
}

/// Builds the job spec from submit options (no network: `leaf_level` is the
/// policy's lowest topology level, needed only for `--switches`).
pub(crate) fn job_spec(a: SubmitArgs, leaf_level: Option<&str>) -> anyhow::Result<pb::JobSpec> {
    let (command, script) = match (&a.wrap, &a.script) {
        (None, None) if !a.command.is_empty() => (a.command.clone(), String::new()),
        (Some(w), None) if a.command.is_empty() => (Vec::new(), format!("#!/bin/sh\n{w}\n")),
        (None, Some(path)) => {
            let text = match &a.script_text {
                Some(t) => t.clone(),
                None => {
                    std::fs::read_to_string(path).with_context(|| format!("script: cannot read {}", path.display()))?
                }
            };
            // After a script, the command is the script's arguments.
            (a.command.clone(), text)
        }
        (None, None) => {
            bail!("command: nothing to run; give a command after `--`, --wrap \"...\", or a script file")
        }
        _ => bail!("command: give only one of a command after `--`, --wrap, or a script file"),
    };
    let (nodes, nodes_max) = match a.nodes.as_deref() {
        Some(n) => {
            let (lo, hi) = parse::node_range(n).map_err(anyhow::Error::msg)?;
            (Some(i64::from(lo)), hi)
        }
        None => (None, 0),
    };
    let names = |opt: &str, list: &Option<String>| -> anyhow::Result<Vec<String>> {
        let Some(list) = list else { return Ok(Vec::new()) };
        crate::slurm::hostlist::expand(list).map_err(|e| anyhow::anyhow!("--{opt}: {e}"))
    };
    let nodelist = names("nodelist", &a.nodelist)?;
    let exclude = names("exclude", &a.exclude)?;
    // A node list without --nodes: as many nodes as it names.
    let nodes = match nodes {
        None if !nodelist.is_empty() => Some(nodelist.len() as i64),
        n => n,
    };
    let node_count = nodes.unwrap_or(1).max(1);
    let tasks_per_node = match a.ntasks {
        Some(n) if n < 1 => bail!("--ntasks: must be at least 1, got {n}"),
        Some(n) if n % node_count != 0 => {
            bail!("--ntasks: {n} tasks do not spread evenly over {node_count} nodes; use --ntasks-per-node")
        }
        Some(n) => Some(n / node_count),
        None => a.tasks_per_node,
    };
    let tasks = tasks_per_node.unwrap_or(1).max(1);
    let (gpu_type, gpus) = parse::gpu_request(
        a.gpus_per_node.as_deref(),
        a.gpus.as_deref(),
        a.gpus_per_task.as_deref(),
        a.gres.as_deref(),
        node_count,
        tasks,
    )
    .map_err(anyhow::Error::msg)?;
    let warn = a.signal.as_deref().map(parse::warn_signal).transpose().map_err(anyhow::Error::msg)?.unwrap_or((0, 0));
    let workdir = match a.chdir {
        Some(d) => d,
        None => std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default(),
    };
    let topology = match (&a.topology, &a.switches) {
        (Some(_), Some(_)) => bail!("topology: give --topology or --switches, not both"),
        (Some(t), None) => Some(parse::topology(t).map_err(anyhow::Error::msg)?),
        (None, Some(sw)) => {
            let (required, wait_s) = parse::switches(sw).map_err(anyhow::Error::msg)?;
            let level = leaf_level.context("switches: the cluster's topology levels are unknown")?;
            Some(pb::TopologyConstraint { level: level.to_string(), required, wait_s })
        }
        (None, None) => None,
    };
    let kill_on_invalid_dep = match a.kill_on_invalid_dep.as_deref() {
        None => None,
        Some("yes" | "true" | "1") => Some(true),
        Some("no" | "false" | "0") => Some(false),
        Some(other) => bail!("kill-on-invalid-dep: '{other}' must be yes or no"),
    };
    let spec = pb::JobSpec {
        name: a.name.unwrap_or_else(|| default_job_name(&command, a.script.as_ref(), a.wrap.is_some())),
        user: String::new(),
        command,
        script,
        workdir,
        partition: a.partition.unwrap_or_default(),
        nodes,
        tasks_per_node,
        cpus_per_task: match (a.cpus_per_task, a.cpus_per_gpu) {
            (Some(_), Some(_)) => bail!("--cpus-per-gpu: give --cpus-per-task or --cpus-per-gpu, not both"),
            (None, Some(c)) if c < 1 => bail!("--cpus-per-gpu: must be at least 1, got {c}"),
            (None, Some(c)) => match gpus.unwrap_or(0) {
                0 => bail!("--cpus-per-gpu: the job asks for no GPUs (add --gpus-per-node, --gpus or --gres)"),
                // Each node's CPUs, split among its tasks (rounded up).
                g => Some((c * g + tasks - 1) / tasks),
            },
            (c, None) => c,
        },
        mem_per_node_mb: match (&a.mem, &a.mem_per_gpu) {
            (Some(_), Some(_)) => bail!("--mem-per-gpu: give --mem (per node) or --mem-per-gpu, not both"),
            (None, Some(_)) if a.mem_per_cpu.is_some() => {
                bail!("--mem-per-gpu: give --mem-per-cpu or --mem-per-gpu, not both")
            }
            (None, Some(per_gpu)) => {
                let per_gpu =
                    parse::mem_mb(per_gpu).map_err(|e| anyhow::anyhow!(e.replace("--mem", "--mem-per-gpu")))?;
                match gpus.unwrap_or(0) {
                    0 => bail!("--mem-per-gpu: the job asks for no GPUs (add --gpus-per-node, --gpus or --gres)"),
                    g => Some(per_gpu as i64 * g),
                }
            }
            (m, None) => m.as_deref().map(parse::mem_mb).transpose().map_err(anyhow::Error::msg)?.map(|m| m as i64),
        },
        gpus_per_node: gpus,
        gpu_type,
        time_limit_s: a
            .time
            .as_deref()
            .map(parse::time_limit_s)
            .transpose()
            .map_err(anyhow::Error::msg)?
            .map(|t| t as i64),
        env: parse_labels(&a.env).context("env")?.into_iter().collect(),
        requeue: (a.requeue || a.no_requeue).then_some(!a.no_requeue),
        output: a.output.unwrap_or_default(),
        error: a.error.unwrap_or_default(),
        warn_signal: warn.0,
        warn_before_s: warn.1,
        warn_batch_shell: a.signal.as_deref().is_some_and(|s| s.starts_with("B:")),
        account: a.account.unwrap_or_default(),
        qos: a.qos.unwrap_or_default(),
        nodes_max,
        mem_per_cpu_mb: a
            .mem_per_cpu
            .as_deref()
            .map(parse::mem_mb)
            .transpose()
            .map_err(anyhow::Error::msg)?
            .unwrap_or(0),
        constraints: a
            .constraint
            .as_deref()
            .map(|c| c.split('&').map(|f| f.trim().to_string()).filter(|f| !f.is_empty()).collect())
            .unwrap_or_default(),
        exclusive: a.exclusive,
        topology,
        dependency: a.dependency.unwrap_or_default(),
        array: a.array.unwrap_or_default(),
        nice: a.nice.unwrap_or(0),
        hold: a.hold,
        kill_on_invalid_dep,
        begin_time_ms: match &a.begin {
            Some(b) => parse::begin_ms(b, crate::slurm::now_ms()).map_err(anyhow::Error::msg)?,
            None => 0,
        },
        comment: a.comment.clone().unwrap_or_default(),
        batch: a.batch,
        nodelist,
        exclude,
        truncate_output: match a.open_mode.as_deref() {
            None | Some("append") => false,
            Some("truncate") => true,
            Some(other) => bail!("--open-mode: '{other}' must be append or truncate"),
        },
    };
    Ok(spec)
}

/// Submits `spec` and prints what sbatch would: `Submitted batch job N`, or the
/// id alone with `parsable`.
pub(crate) async fn send_submit(
    client: &Client,
    out: &Output,
    mut spec: pb::JobSpec,
    key: Option<String>,
    parsable: bool,
) -> anyhow::Result<(u64, u32)> {
    umask_env(&mut spec);
    let key = key.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: key };
    let resp = client
        .call(|ch| {
            let r = client.request(req.clone());
            async move { JobServiceClient::new(ch).submit(r).await }
        })
        .await?
        .into_inner();
    if out.json {
        out.print_json(&json!({"job_id": resp.job_id, "duplicate": resp.duplicate, "count": resp.count}));
    } else if parsable {
        println!("{}", resp.job_id);
    } else if resp.count > 1 {
        println!(
            "Submitted batch job {} (array of {} jobs: {}..{})",
            resp.job_id,
            resp.count,
            resp.job_id,
            resp.job_id + u64::from(resp.count) - 1
        );
    } else {
        println!("Submitted batch job {}", resp.job_id);
    }
    Ok((resp.job_id, resp.count.max(1)))
}

fn default_job_name(command: &[String], script: Option<&PathBuf>, wrap: bool) -> String {
    if wrap {
        return "wrap".into();
    }
    if let Some(p) = script {
        return p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| "script".into());
    }
    command.first().map(|c| c.rsplit('/').next().unwrap_or(c).to_string()).unwrap_or_else(|| "job".into())
}

// ---------------------------------------------------------------- queue / show / cancel

#[derive(Args)]
pub struct QueueArgs {
    /// Include finished jobs.
    #[arg(short, long)]
    all: bool,
    /// Only jobs in these states (PENDING, RUNNING, COMPLETED, ...).
    #[arg(short = 't', long = "state", value_delimiter = ',')]
    states: Vec<String>,
    #[arg(short, long)]
    user: Option<String>,
    #[arg(short = 'n', long)]
    name: Option<String>,
    /// Read from the answering replica without confirming with the leader.
    #[arg(long)]
    stale: bool,
    /// Jobs to show at most.
    #[arg(long, default_value_t = 1000)]
    limit: u32,
    #[arg(short = 'A', long)]
    account: Option<String>,
    #[arg(short = 'p', long)]
    partition: Option<String>,
}

pub(crate) fn job_json(j: &pb::Job) -> Value {
    let spec = j.spec.clone().unwrap_or_default();
    let mut v = json!({
        "id": j.id,
        "name": spec.name,
        "user": spec.user,
        "state": crate::slurm::state_name(j.state),
        "attempt": j.attempt,
        "submitted_by": j.submitted_by,
        "submit_time_ms": j.submit_time_ms,
        "start_time_ms": j.start_time_ms,
        "end_time_ms": j.end_time_ms,
        "exit_code": j.exit_code,
        "reason": j.reason,
        "ran_on": j.ran_on,
        "command": spec.command,
        "script": spec.script,
        "workdir": spec.workdir,
        "partition": spec.partition,
        "nodes": spec.nodes,
        "tasks_per_node": spec.tasks_per_node,
        "cpus_per_task": spec.cpus_per_task,
        "mem_per_node_mb": spec.mem_per_node_mb,
        "gpus_per_node": spec.gpus_per_node,
        "gpu_type": spec.gpu_type,
        "time_limit_s": spec.time_limit_s,
        "allocation": j.allocation.iter().map(|a| json!({"node": a.node, "cpus": a.cpus, "mem_mb": a.mem_mb, "gpus": a.gpus})).collect::<Vec<_>>(),
    });
    let extra = json!({
        "display_id": j.display_id,
        "array_job_id": j.array_job_id,
        "array_index": j.array_index,
        "account": spec.account,
        "qos": spec.qos,
        "held": j.held,
        "pending_dependencies": j.pending_dependencies,
        "priority_override": j.priority_override,
        "preempted": j.preempted,
        "constraints": spec.constraints,
        "exclusive": spec.exclusive,
        "nodes_max": spec.nodes_max,
        "dependency": spec.dependency,
        "array": spec.array,
        "nice": spec.nice,
    });
    if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
        m.extend(x);
    }
    v
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{:<w$}  ", c, w = widths[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}

pub async fn queue(client: &Client, out: &Output, a: QueueArgs) -> anyhow::Result<()> {
    let mut states = Vec::new();
    for s in &a.states {
        let st = gangway_core::JobState::parse(s).ok_or_else(|| {
            anyhow::anyhow!(
                "state: '{s}' is not a job state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL)"
            )
        })?;
        states.push(st);
    }
    let states: Vec<i32> = if states.is_empty() && !a.all {
        vec![pb::JobState::Pending as i32, pb::JobState::Running as i32]
    } else {
        states
            .iter()
            .map(|s| {
                pb::JobState::from_str_name(&format!("JOB_STATE_{}", s.as_str())).unwrap_or(pb::JobState::Unspecified)
                    as i32
            })
            .collect()
    };
    let req = pb::ListJobsRequest {
        states,
        user: a.user.unwrap_or_default(),
        name: a.name.unwrap_or_default(),
        stale: a.stale,
        limit: a.limit,
        after_id: 0,
        account: a.account.unwrap_or_default(),
        partition: a.partition.unwrap_or_default(),
        explain: true,
    };
    let resp = client
        .call(|ch| {
            let r = client.request(req.clone());
            async move { JobServiceClient::new(ch).list(r).await }
        })
        .await?
        .into_inner();
    if out.json {
        out.print_json(&Value::Array(resp.jobs.iter().map(job_json).collect()));
        return Ok(());
    }
    let now = now_ms();
    let rows: Vec<Vec<String>> = resp
        .jobs
        .iter()
        .map(|j| {
            let spec = j.spec.clone().unwrap_or_default();
            let elapsed = match (j.start_time_ms, j.end_time_ms) {
                (Some(s), Some(e)) => e.saturating_sub(s) / 1000,
                (Some(s), None) => now.saturating_sub(s) / 1000,
                _ => 0,
            };
            let where_ = if !j.allocation.is_empty() {
                j.allocation.iter().map(|a| a.node.as_str()).collect::<Vec<_>>().join(",")
            } else if !j.reason.is_empty() {
                format!("({})", j.reason)
            } else {
                j.ran_on.join(",")
            };
            vec![
                if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() },
                spec.partition,
                spec.name,
                spec.user,
                crate::slurm::state_name(j.state).to_string(),
                parse::duration(elapsed),
                spec.nodes.unwrap_or(1).to_string(),
                spec.gpus_per_node.unwrap_or(0).to_string(),
                where_,
            ]
        })
        .collect();
    print_table(
        &["JOBID", "PARTITION", "NAME", "USER", "STATE", "TIME", "NODES", "GPUS/NODE", "NODELIST(REASON)"],
        &rows,
    );
    if resp.next_after_id != 0 {
        eprintln!("(more jobs not shown; raise --limit)");
    }
    Ok(())
}

pub async fn show(client: &Client, out: &Output, job_id: u64, stale: bool) -> anyhow::Result<()> {
    let req = pb::GetJobRequest { job_id, stale };
    let job = client
        .call(|ch| {
            let r = client.request(req);
            async move { JobServiceClient::new(ch).get(r).await }
        })
        .await?
        .into_inner();
    let mut v = job_json(&job);
    // A pending job: why, in Slurm's words and Gangway's detail.
    let why = if job.state == pb::JobState::Pending as i32 {
        let r = client
            .call(|ch| {
                let r = client.request(pb::ExplainRequest { job_id, stale });
                async move { JobServiceClient::new(ch).explain(r).await }
            })
            .await;
        r.ok().map(|r| r.into_inner())
    } else {
        None
    };
    if let (Some(e), Value::Object(map)) = (&why, &mut v) {
        let mut rej: Vec<(&String, &u32)> = e.rejections.iter().collect();
        rej.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        map.insert(
            "pending".into(),
            json!({
                "reason": e.reason, "detail": e.detail, "queue_position": e.queue_position,
                "eligible_nodes": e.eligible_nodes,
                "rejected_nodes": rej.iter().map(|(k, n)| json!({"why": k, "nodes": n})).collect::<Vec<_>>(),
                "estimated_start": e.estimated_start_ms.map(crate::slurm::timestamp),
            }),
        );
    }
    if out.json {
        out.print_json(&v);
        return Ok(());
    }
    if let Value::Object(map) = v {
        for (k, val) in map {
            if k == "pending" {
                continue;
            }
            let s = match val {
                Value::String(s) => s,
                Value::Null => "-".into(),
                other => other.to_string(),
            };
            println!("{k:>16}: {s}");
        }
    }
    if let Some(e) = why {
        println!("{:>16}: {} ({})", "pending", e.reason, e.detail);
        if let Some(t) = e.estimated_start_ms {
            println!("{:>16}: {}", "expected start", crate::slurm::timestamp(t));
        }
        let mut rej: Vec<(String, u32)> = e.rejections.into_iter().collect();
        rej.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        for (why, n) in rej {
            println!("{:>16}: {n} node(s): {why}", "rejected");
        }
    }
    Ok(())
}

pub async fn cancel(client: &Client, out: &Output, job_ids: &[u64]) -> anyhow::Result<()> {
    let mut results = Vec::new();
    let mut failed = None;
    for &job_id in job_ids {
        let req = pb::CancelRequest { job_id };
        let r = client
            .call(|ch| {
                let r = client.request(req);
                async move { JobServiceClient::new(ch).cancel(r).await }
            })
            .await;
        match r {
            Ok(_) => {
                results.push(json!({"job_id": job_id, "cancelled": true}));
                if !out.json {
                    println!("Cancelled job {job_id}");
                }
            }
            Err(s) => {
                results.push(json!({"job_id": job_id, "cancelled": false, "error": s.message()}));
                failed = Some(anyhow::Error::new(s));
            }
        }
    }
    if out.json {
        out.print_json(&Value::Array(results));
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

// ---------------------------------------------------------------- nodes

#[derive(Subcommand)]
pub enum NodeCmd {
    /// Stop placing new work on a node; running work finishes.
    Drain {
        name: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Make a drained node available again.
    Resume { name: String },
}

fn node_state_name(s: i32) -> &'static str {
    match pb::NodeState::try_from(s).unwrap_or(pb::NodeState::Unspecified) {
        pb::NodeState::Up => "UP",
        pb::NodeState::Drain => "DRAIN",
        pb::NodeState::Down => "DOWN",
        pb::NodeState::Unspecified => "UNKNOWN",
    }
}

pub(crate) fn node_json(n: &pb::Node) -> Value {
    json!({
        "name": n.name, "state": node_state_name(n.state), "reason": n.state_reason,
        "cpus": n.cpus, "cpus_alloc": n.cpus_alloc, "mem_mb": n.mem_mb, "mem_alloc_mb": n.mem_alloc_mb,
        "gpus": n.gpus.iter().map(|g| json!({"index": g.index, "uuid": g.uuid, "model": g.model, "mem_mb": g.mem_mb,
            "nvlink_island": g.nvlink_island, "healthy": g.healthy, "health_reason": g.health_reason, "allocated_to": g.allocated_to})).collect::<Vec<_>>(),
        "topology": n.topology, "labels": n.labels, "jobs": n.jobs, "last_heartbeat_age_ms": n.last_heartbeat_age_ms,
    })
}

pub async fn nodes(client: &Client, out: &Output, stale: bool) -> anyhow::Result<()> {
    let nodes = client.list_nodes(stale).await?;
    if out.json {
        out.print_json(&Value::Array(nodes.iter().map(node_json).collect()));
        return Ok(());
    }
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let free = n.gpus.iter().filter(|g| g.healthy && g.allocated_to.is_none()).count();
            let model = n.gpus.first().map(|g| g.model.clone()).unwrap_or_else(|| "-".into());
            let sick: Vec<String> = n
                .gpus
                .iter()
                .filter(|g| !g.healthy)
                .map(|g| format!("GPU {} quarantined: {}", g.index, g.health_reason))
                .collect();
            let reason = [n.state_reason.clone()]
                .into_iter()
                .chain(sick)
                .filter(|r| !r.is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            vec![
                n.name.clone(),
                node_state_name(n.state).to_string(),
                format!("{}/{}", n.cpus - n.cpus_alloc, n.cpus),
                format!("{}/{}", (n.mem_mb - n.mem_alloc_mb) / 1024, n.mem_mb / 1024),
                format!("{free}/{} {model}", n.gpus.len()),
                n.topology.join("/"),
                n.last_heartbeat_age_ms.map(|a| format!("{:.1}s ago", a as f64 / 1000.0)).unwrap_or_else(|| "-".into()),
                reason,
            ]
        })
        .collect();
    print_table(
        &["NODE", "STATE", "CPUS(free/all)", "MEM_GB(free/all)", "GPUS(free/all)", "TOPOLOGY", "HEARTBEAT", "REASON"],
        &rows,
    );
    Ok(())
}

pub async fn node(client: &Client, out: &Output, cmd: NodeCmd) -> anyhow::Result<()> {
    let node = match cmd {
        NodeCmd::Drain { name, reason } => {
            let req = pb::DrainRequest { name, reason };
            client
                .call(|ch| {
                    let r = client.request(req.clone());
                    async move { NodeServiceClient::new(ch).drain(r).await }
                })
                .await?
        }
        NodeCmd::Resume { name } => {
            let req = pb::ResumeRequest { name };
            client
                .call(|ch| {
                    let r = client.request(req.clone());
                    async move { NodeServiceClient::new(ch).resume(r).await }
                })
                .await?
        }
    }
    .into_inner();
    if out.json {
        out.print_json(&node_json(&node));
    } else {
        println!("node {} is {}", node.name, node_state_name(node.state));
    }
    Ok(())
}

// ---------------------------------------------------------------- cluster

#[derive(Subcommand)]
pub enum ClusterCmd {
    /// Every replica's role, term and log positions.
    Status,
    /// Add a replica (started with `gangway controller --join`) as a learner.
    Add { id: u64, addr: String },
    /// Make a learner a voting member.
    Promote { id: u64 },
    /// Remove a replica from the cluster.
    Remove { id: u64 },
    /// Move leadership to another voter.
    TransferLeader { id: u64 },
    /// Build a snapshot on the answering replica now.
    Snapshot,
    /// Write a consistent backup of the cluster's state to FILE (admins; the
    /// file is created 0600 and never overwritten). Restore with
    /// `gangway controller --restore FILE`.
    Backup { file: std::path::PathBuf },
}

/// The most a backup may be: far above any state a replica holds in memory
/// (a million jobs take ~1-2 GiB), so a confused server cannot fill the disk.
const BACKUP_BYTES_MAX: u64 = 64 * 1024 * 1024 * 1024;

/// Streams a backup from a replica into a new file, then checks it whole.
async fn backup(client: &Client, file: &std::path::Path) -> anyhow::Result<(u64, u64)> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut stream = client
        .call(|ch| {
            let r = client.request(pb::BackupRequest {});
            async move { AdminServiceClient::new(ch).backup(r).await }
        })
        .await?
        .into_inner();
    if file.exists() {
        bail!("backup: {} exists; an existing file is never overwritten", file.display());
    }
    // Written beside the file, checked, synced, then linked into place: an
    // interrupted backup never leaves a partial file under the real name.
    let partial = file.with_file_name(format!(
        "{}.partial",
        file.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "backup".into())
    ));
    let _ = std::fs::remove_file(&partial);
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .with_context(|| format!("backup: creating {}", partial.display()))?;
    let (mut index, mut total, mut written) = (0u64, 0u64, 0u64);
    let result: anyhow::Result<()> = async {
        while let Some(chunk) = stream.message().await? {
            if written == 0 {
                (index, total) = (chunk.index, chunk.total_bytes);
                anyhow::ensure!(total <= BACKUP_BYTES_MAX, "backup: the replica announced {total} bytes");
            }
            written = written.saturating_add(chunk.data.len() as u64);
            anyhow::ensure!(written <= total, "backup: the replica sent more than the {total} bytes it announced");
            out.write_all(&chunk.data)?;
        }
        anyhow::ensure!(written == total && total > 0, "backup: got {written} of {total} bytes");
        out.sync_all()?;
        let bytes = std::fs::read(&partial)?;
        gangway_raft_store::backup::Backup::from_bytes(&bytes).map_err(|e| anyhow::anyhow!("backup: {e}"))?;
        // A hard link never replaces an existing file.
        std::fs::hard_link(&partial, file)
            .with_context(|| format!("backup: {} (an existing file is never overwritten)", file.display()))?;
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
    .await;
    let _ = std::fs::remove_file(&partial);
    result?;
    Ok((index, total))
}

fn opt(v: Option<u64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

pub async fn cluster(client: &Client, out: &Output, cmd: ClusterCmd) -> anyhow::Result<()> {
    macro_rules! admin {
        ($method:ident, $req:expr) => {{
            let req = $req;
            client
                .call(|ch| {
                    let r = client.request(req.clone());
                    async move { AdminServiceClient::new(ch).$method(r).await }
                })
                .await?
                .into_inner()
        }};
    }
    let membership = |m: pb::MembershipResponse| {
        if out.json {
            out.print_json(&json!({"voters": m.voters, "learners": m.learners, "log_index": m.log_index}));
        } else {
            println!("voters: {:?}  learners: {:?}  (committed at log index {})", m.voters, m.learners, m.log_index);
        }
    };
    match cmd {
        ClusterCmd::Status => {
            let s = admin!(cluster_status, pb::ClusterStatusRequest {});
            if out.json {
                let replicas: Vec<Value> = s
                    .replicas
                    .iter()
                    .map(|r| {
                        json!({"id": r.id, "addr": r.addr, "role": r.role, "term": r.term, "leader_id": r.leader_id,
                        "voter": r.voter, "last_log_index": r.last_log_index, "commit_index": r.commit_index,
                        "applied_index": r.applied_index, "snapshot_index": r.snapshot_index,
                        "cert_not_after_unix": r.cert_not_after_unix, "error": r.error,
                        "newest_data_format": r.newest_data_format, "data_format": r.data_format})
                    })
                    .collect();
                out.print_json(
                    &json!({"leader_id": s.leader_id, "term": s.term, "data_format": s.data_format, "replicas": replicas}),
                );
                return Ok(());
            }
            println!("leader: {}   term: {}   format: {}", opt(s.leader_id), s.term, s.data_format);
            let rows: Vec<Vec<String>> = s
                .replicas
                .iter()
                .map(|r| {
                    vec![
                        r.id.to_string(),
                        r.addr.clone(),
                        r.role.clone(),
                        if r.voter { "voter" } else { "learner" }.to_string(),
                        r.term.to_string(),
                        opt(r.last_log_index),
                        opt(r.commit_index),
                        opt(r.applied_index),
                        opt(r.snapshot_index),
                        cert_expiry(r.cert_not_after_unix),
                        // The newest format the replica's build reads (4: a
                        // build from before formats were reported).
                        match (r.role.as_str(), r.newest_data_format) {
                            ("unreachable", _) => "-".to_string(),
                            (_, 0) => "4".to_string(),
                            (_, n) => n.to_string(),
                        },
                        r.error.clone(),
                    ]
                })
                .collect();
            print_table(
                &[
                    "ID", "ADDR", "ROLE", "MEMBER", "TERM", "LAST_LOG", "COMMIT", "APPLIED", "SNAPSHOT", "CERT",
                    "READS", "ERROR",
                ],
                &rows,
            );
        }
        ClusterCmd::Add { id, addr } => membership(admin!(add_learner, pb::AddLearnerRequest { id, addr })),
        ClusterCmd::Promote { id } => membership(admin!(promote, pb::PromoteRequest { id })),
        ClusterCmd::Remove { id } => membership(admin!(remove_member, pb::RemoveMemberRequest { id })),
        ClusterCmd::TransferLeader { id } => {
            let r = admin!(transfer_leader, pb::TransferLeaderRequest { to: id });
            if out.json {
                out.print_json(&json!({"leader_id": r.leader_id, "term": r.term}));
            } else {
                println!("leader is now replica {} (term {})", r.leader_id, r.term);
            }
        }
        ClusterCmd::Backup { file } => {
            let (index, bytes) = backup(client, &file).await?;
            if out.json {
                out.print_json(&json!({"index": index, "bytes": bytes, "file": file}));
            } else {
                println!("backup of log index {index} ({bytes} bytes) written to {}", file.display());
            }
        }
        ClusterCmd::Snapshot => {
            let r = admin!(snapshot, pb::SnapshotRequest {});
            if out.json {
                out.print_json(&json!({"index": r.index}));
            } else {
                println!("snapshot at log index {}", r.index);
            }
        }
    }
    Ok(())
}
