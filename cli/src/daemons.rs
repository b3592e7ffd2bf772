//! The two daemons: `gangway controller` (a replica) and `gangway agent` (a
//! node agent), their options and start-up.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};

// ---------------------------------------------------------------- controller

#[derive(Args)]
pub struct ControllerArgs {
    /// This replica's id (a positive integer, unique in the cluster), or
    /// `ordinal`: one more than the number that ends the host name, as a
    /// Kubernetes StatefulSet names its pods (gangway-controller-0 is 1).
    #[arg(long, value_parser = parse_replica_id)]
    id: u64,
    /// Address to listen on, e.g. 0.0.0.0:50051.
    #[arg(long)]
    listen: String,
    /// Address others reach this replica at (default: the listen address,
    /// and /PEERPORT when --peer-listen is given).
    #[arg(long)]
    advertise: Option<String>,
    /// Serve Raft on a port of its own, e.g. 0.0.0.0:50052: its TLS handshake
    /// fails without a certificate, and only replicas' connections stay open
    /// (as etcd's peer port). The API port then refuses Raft. Each replica's
    /// address in --peers names it: 1=HOST:PORT/PEERPORT.
    #[arg(long)]
    peer_listen: Option<String>,
    /// Initial members: 1=HOST:PORT,2=HOST:PORT,3=HOST:PORT (include this
    /// replica), each HOST:PORT/PEERPORT when the replicas have peer ports.
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
    /// The accounting database `gangway accounting` fills: sacct and
    /// `gangway show` read the history the state no longer holds from it
    /// (postgres://USER@HOST/DB; a read-only role is enough).
    #[arg(long, env = "GANGWAY_ACCOUNTING_DATABASE")]
    accounting_database: Option<String>,
    /// Serve the web console at HOST:PORT, path /ui/ (e.g. 0.0.0.0:8443):
    /// HTTPS with this replica's certificate (browsers log in with a bearer
    /// token or a client certificate of the cluster's CA), plain HTTP with --insecure.
    #[arg(long)]
    ui_listen: Option<String>,
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
    /// The accounting service's identity (`client:accounting`, repeatable;
    /// give every replica the same list): it reads every job as operators do
    /// (without scripts and environments) and reports what it stored, and
    /// may do nothing else, unlike an operator.
    #[arg(long = "accounting-identity")]
    accounting_identities: Vec<String>,
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
    /// The `aud` tokens must carry (default: the cluster its certificate
    /// names, `gangway` unless made with `gangway tls cert create --cluster`):
    /// a token for another cluster that shares the signing key is refused.
    #[arg(long)]
    token_audience: Option<String>,
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
    /// The program the leader runs to power elastic pools' nodes up (Slurm's
    /// ResumeProgram): called with the nodes as a hostlist; it starts them
    /// (boot a machine, start a cloud instance) and returns. Give every
    /// replica the same.
    #[arg(long, value_name = "PROGRAM")]
    resume_program: Option<std::path::PathBuf>,
    /// The program the leader runs to power idle pool nodes down (Slurm's
    /// SuspendProgram), called the same way.
    #[arg(long, value_name = "PROGRAM")]
    suspend_program: Option<std::path::PathBuf>,
    /// Writes per second one user may sustain (submits, cancels, updates),
    /// counted on the leader (admins have their own, --admin-writes-per-s).
    #[arg(long, default_value_t = gangway_controller::ratelimit::WRITES_PER_S)]
    user_writes_per_s: f64,
    /// Writes one user may make in a burst above that rate.
    #[arg(long, default_value_t = gangway_controller::ratelimit::WRITES_BURST)]
    user_write_burst: f64,
    /// Bytes of writes (job specs, mostly) per second one user may sustain.
    #[arg(long, default_value_t = gangway_controller::ratelimit::WRITE_BYTES_PER_S)]
    user_write_bytes_per_s: f64,
    /// Bytes of writes one user may make in a burst above that rate.
    #[arg(long, default_value_t = gangway_controller::ratelimit::WRITE_BYTES_BURST)]
    user_write_bytes_burst: f64,
    /// Writes per second one admin may sustain, counted on the leader.
    #[arg(long, default_value_t = gangway_controller::ratelimit::ADMIN_WRITES_PER_S)]
    admin_writes_per_s: f64,
    /// Writes one admin may make in a burst above that rate.
    #[arg(long, default_value_t = gangway_controller::ratelimit::ADMIN_WRITES_BURST)]
    admin_write_burst: f64,
    /// Bytes of writes per second one admin may sustain.
    #[arg(long, default_value_t = gangway_controller::ratelimit::ADMIN_WRITE_BYTES_PER_S)]
    admin_write_bytes_per_s: f64,
    /// Bytes of writes one admin may make in a burst above that rate.
    #[arg(long, default_value_t = gangway_controller::ratelimit::ADMIN_WRITE_BYTES_BURST)]
    admin_write_bytes_burst: f64,
    /// Read units per second one caller may spend on this replica: one per
    /// job or node a read looks at, one per 128 bytes it answers, 10 per call.
    #[arg(long, default_value_t = gangway_controller::ratelimit::READ_UNITS_PER_S)]
    user_read_units_per_s: f64,
    /// Read units in a caller's full bucket (what it may spend at once).
    #[arg(long, default_value_t = gangway_controller::ratelimit::READ_UNITS_BURST)]
    user_read_burst: f64,
}

/// `--id`: a number, or `ordinal` (from the host name's trailing `-N`).
fn parse_replica_id(s: &str) -> Result<u64, String> {
    if s != "ordinal" {
        return s.parse().map_err(|_| format!("'{s}' is not a replica id (a positive integer, or `ordinal`)"));
    }
    let host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(|e| format!("ordinal: the host name: {e}"))?;
    ordinal_id(host.trim())
}

/// The replica id of a StatefulSet pod named `host` (`NAME-N` is N + 1).
fn ordinal_id(host: &str) -> Result<u64, String> {
    let n = host
        .rsplit_once('-')
        .and_then(|(_, n)| n.parse::<u64>().ok())
        .ok_or_else(|| format!("ordinal: host name '{host}' does not end in -N, as a StatefulSet pod's does"))?;
    n.checked_add(1).ok_or_else(|| format!("ordinal: '{host}' is out of range"))
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
    for who in &a.accounting_identities {
        let name = who.strip_prefix("client:").unwrap_or(who);
        gangway_proto::tls::check_principal_name(name).map_err(|e| anyhow::anyhow!("accounting-identity: {e}"))?;
    }
    let peer_listener = match &a.peer_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("peer-listen: cannot bind {addr}"))?,
        ),
        None => None,
    };
    let advertise = match (&a.advertise, &peer_listener) {
        (Some(adv), _) => adv.clone(),
        (None, None) => a.listen.clone(),
        (None, Some(l)) => format!("{}/{}", a.listen, l.local_addr()?.port()),
    };
    let peers = match &a.peers {
        Some(p) => gangway_controller::config::parse_peers(p).map_err(anyhow::Error::msg)?,
        None if a.join => BTreeMap::from([(a.id, advertise.clone())]),
        None => {
            bail!("peers: required (e.g. --peers 1=10.0.0.1:50051,2=10.0.0.2:50051,3=10.0.0.3:50051), or use --join")
        }
    };
    let listener =
        tokio::net::TcpListener::bind(&a.listen).await.with_context(|| format!("listen: cannot bind {}", a.listen))?;
    for (flag, v) in [
        ("user-writes-per-s", a.user_writes_per_s),
        ("user-write-burst", a.user_write_burst),
        ("user-write-bytes-per-s", a.user_write_bytes_per_s),
        ("user-write-bytes-burst", a.user_write_bytes_burst),
        ("admin-writes-per-s", a.admin_writes_per_s),
        ("admin-write-burst", a.admin_write_burst),
        ("admin-write-bytes-per-s", a.admin_write_bytes_per_s),
        ("admin-write-bytes-burst", a.admin_write_bytes_burst),
        ("user-read-units-per-s", a.user_read_units_per_s),
        ("user-read-burst", a.user_read_burst),
    ] {
        if !(v.is_finite() && v >= 1.0) {
            bail!("{flag}: must be a number of at least 1, got {v}");
        }
    }
    let timing = gangway_controller::Timing {
        node_down_timeout_ms: a.node_down_timeout_ms,
        user_writes_per_s: a.user_writes_per_s,
        user_write_burst: a.user_write_burst,
        user_write_bytes_per_s: a.user_write_bytes_per_s,
        user_write_bytes_burst: a.user_write_bytes_burst,
        admin_writes_per_s: a.admin_writes_per_s,
        admin_write_burst: a.admin_write_burst,
        admin_write_bytes_per_s: a.admin_write_bytes_per_s,
        admin_write_bytes_burst: a.admin_write_bytes_burst,
        user_read_units_per_s: a.user_read_units_per_s,
        user_read_burst: a.user_read_burst,
        ..Default::default()
    };
    let token_audience = a.token_audience.unwrap_or_else(|| {
        security
            .credentials()
            .and_then(|c| c.cluster())
            .unwrap_or_else(|| gangway_proto::token::DEFAULT_AUDIENCE.into())
    });
    let config = gangway_controller::ReplicaConfig {
        id: a.id,
        advertise_addr: advertise,
        peers,
        data_dir: a.data_dir,
        join: a.join,
        timing,
        security,
        bootstrap_admins: a.bootstrap_admins,
        accounting_identities: a.accounting_identities,
        allow_root_jobs: a.allow_root_jobs,
        tokens: gangway_proto::token::TokenVerifier::load(&gangway_proto::token::TokenConfig {
            public_keys: a.token_public_keys,
            jwks: a.token_jwks,
            issuer: Some(a.token_issuer),
            audience: Some(token_audience),
            revoked: a.token_revoked,
        })
        .map_err(|e| anyhow::anyhow!("tokens: {e}"))?,
        private_jobs: a.private_jobs,
        restore: a.restore.clone(),
        power: gangway_controller::config::PowerPrograms {
            resume: a.resume_program.clone(),
            suspend: a.suspend_program.clone(),
        },
        accounting: a.accounting_database.clone(),
    };
    let metrics = match &a.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr).await.with_context(|| format!("metrics-listen: cannot bind {addr}"))?,
        ),
        None => None,
    };
    let ui = match &a.ui_listen {
        Some(addr) => {
            Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("ui-listen: cannot bind {addr}"))?)
        }
        None => None,
    };
    let mut handle = gangway_controller::replica::start_with_peer_port(config, listener, peer_listener).await?;
    let _ui = match ui {
        Some(l) => {
            let transport = match handle.replica.security.credentials() {
                Some(_) => gangway_controller::ui::Transport::Tls(handle.replica.security.clone()),
                None => gangway_controller::ui::Transport::Plain,
            };
            tracing::info!(addr = ?l.local_addr().ok(), "serving the web console at /ui/");
            Some(
                gangway_controller::ui::serve(handle.replica.clone(), l, transport)
                    .map_err(|e| anyhow::anyhow!("ui: {e}"))?,
            )
        }
        None => None,
    };
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
            // A leader hands over first (bounded: a transfer that does not
            // finish in time leaves the others to elect, as after a crash).
            let handed = tokio::time::timeout(
                HANDOVER_TIMEOUT,
                gangway_controller::api::admin::hand_over_leadership(&handle.replica),
            )
            .await;
            match handed {
                Ok(Some(Ok(to))) => tracing::info!(to, "handed leadership over before stopping"),
                Ok(Some(Err(why))) => tracing::warn!(%why, "could not hand leadership over; the others will elect"),
                Ok(None) => {}
                Err(_) => tracing::warn!("handing leadership over took too long; the others will elect"),
            }
            handle.shutdown().await;
            Ok(())
        }
    }
}

/// How long a stopping leader may spend handing leadership over: well
/// within systemd's and Kubernetes' stop timeouts (90 s and 30 s), and a
/// transfer takes well under a second when the cluster is healthy.
const HANDOVER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

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
pub(crate) fn cert_expiry(not_after_unix: Option<i64>) -> String {
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
    /// Let each task open only its own GPUs (Slurm's ConstrainDevices): a
    /// devices cgroup per task refuses the node's other GPUs; its
    /// CUDA_VISIBLE_DEVICES then counts from 0. Needs root and the cgroup v1
    /// devices controller.
    #[arg(long)]
    constrain_devices: bool,
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
    /// Simulated GPUs' load is read from this file, one `INDEX UTIL_PCT
    /// [MEM_MB]` line per busy GPU, and sampled into each job's usage like
    /// NVML's readings (default with --fake-gpus: STATE_DIR/gpu-load).
    #[arg(long)]
    gpu_load_file: Option<PathBuf>,
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
    let gpu_load_file = a.gpu_load_file.or_else(|| simulated.then(|| state_dir.join("gpu-load")));
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
        labels: crate::parse::parse_labels(&a.labels).map_err(|e| anyhow::anyhow!("labels: {e}"))?,
        identity: identity.to_string(),
        security,
        allow_root_jobs: a.allow_root_jobs,
        constrain_devices: a.constrain_devices,
        stop_grace: gangway_node_agent::supervisor::STOP_GRACE_DEFAULT,
        gpu_fault_file,
        gpu_load_file,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statefulset_pod_name_gives_the_replica_id() {
        assert_eq!(ordinal_id("gangway-controller-0"), Ok(1));
        assert_eq!(ordinal_id("gangway-controller-4"), Ok(5));
        assert!(ordinal_id("gangway").unwrap_err().contains("does not end in -N"));
        assert!(ordinal_id("ctl-x").is_err());
        assert_eq!(parse_replica_id("3"), Ok(3));
        assert!(parse_replica_id("three").unwrap_err().contains("not a replica id"));
    }
}
