//! `gangway bench`: numbers, not pass/fail. Each benchmark starts its own cluster
//! of real `gangway controller` child processes on loopback with durable storage
//! in a temp dir, and removes it afterwards.
//!
//! - `bench submit`: submissions/s and latency percentiles at several client counts.
//! - `bench failover`: leader SIGKILL → first successful submit, over repeated runs,
//!   and a check that every acknowledged submit survived.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Subcommand;
use gangway_proto::client::Client;
use gangway_proto::tls::Security;
use gangway_proto::v1 as pb;
use gangway_proto::v1::admin_service_client::AdminServiceClient;
use gangway_proto::ReplicaRole;
use tokio::sync::Mutex;

/// Concurrent clients one run may use (each is a task with its own connection).
pub(crate) const BENCH_CLIENTS_MAX: usize = 1024;
/// Longest measurement per client count.
pub(crate) const BENCH_SECONDS_MAX: u64 = 600;
/// Jobs one `bench jobs` run may submit, and agents it may start.
const BENCH_JOBS_MAX: usize = 100_000;
const BENCH_NODES_MAX: usize = 64;
/// Submitting clients in `bench jobs`.
const BENCH_JOBS_CLIENTS: usize = 16;
/// Failover runs at most.
const FAILOVER_RUNS_MAX: usize = 100;
/// Waiting for a cluster to elect a leader or for a restarted replica to catch up.
pub(crate) const CLUSTER_WAIT: Duration = Duration::from_secs(30);

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Submission throughput and latency against a local 3-replica cluster.
    Submit {
        /// Client counts to measure, in order.
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        clients: Vec<usize>,
        /// Seconds to measure each client count.
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Keep the cluster's data here instead of a temp dir.
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Controller replicas (1 measures the node without replication).
        #[arg(long, default_value_t = 3)]
        replicas: u64,
        /// Transports to measure, each on a fresh cluster: mtls (what clusters
        /// run), insecure (plaintext, the cost of TLS by difference).
        #[arg(long, value_delimiter = ',', default_value = "insecure,mtls", value_parser = ["insecure", "mtls"])]
        transport: Vec<String>,
    },
    /// End to end: trivial jobs submitted, scheduled, run as real processes on
    /// agents, and completed; jobs per second from first submit to last completion.
    Jobs {
        #[arg(long, default_value_t = 500)]
        jobs: usize,
        /// Agents (simulated nodes running real processes), 64 CPUs each.
        #[arg(long, default_value_t = 4)]
        nodes: usize,
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// The scheduler alone: one pass over 100k / 1M pending jobs on 10,000 × 8 GPUs.
    Sched(crate::bench_sched::SchedArgs),
    /// A fleet of simulated agents (real gRPC, tasks as timers) against a
    /// 3-replica cluster: heartbeat latency, leader CPU and memory, Raft
    /// rate, submit→start latency, false node failures, node-down detection.
    Fleet(crate::bench_fleet::FleetArgs),
    /// Hostile load against a 3-replica mTLS cluster with a fleet of agents
    /// and one well-behaved user: squeue pollers, crafted requests, idle and
    /// anonymous connections, a write flood; one table against the goals.
    Storm(crate::bench_storm::StormArgs),
    /// Slurm, etcd and Gangway measured in one run on this machine; one
    /// Markdown table with the ratios (`make bench-peers` installs the peers).
    Peers(crate::bench_peers::PeersArgs),
    /// The accounting store in PostgreSQL: ingest events/s through the
    /// service's write path, and sacct/sreport query latency over a history
    /// of --jobs (default 1,000,000) jobs. Needs an empty database.
    Accounting(crate::bench_accounting::AccountingBenchArgs),
    /// Leader SIGKILL → first successful submit, repeated.
    Failover {
        #[arg(long, default_value_t = 10)]
        runs: usize,
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
}

pub async fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Submit { clients, seconds, data_dir, replicas, transport } => {
            bench_submit(&clients, seconds, data_dir, replicas, &transport).await
        }
        BenchCmd::Failover { runs, data_dir } => bench_failover(runs, data_dir).await,
        BenchCmd::Jobs { jobs, nodes, data_dir } => bench_jobs(jobs, nodes, data_dir).await,
        BenchCmd::Sched(a) => crate::bench_sched::run(a),
        BenchCmd::Fleet(a) => crate::bench_fleet::run(a).await,
        BenchCmd::Storm(a) => crate::bench_storm::run(a).await,
        BenchCmd::Peers(a) => crate::bench_peers::run(a).await,
        BenchCmd::Accounting(a) => crate::bench_accounting::run(a).await,
    }
}

/// A cluster of real controller processes on loopback.
pub(crate) struct LocalCluster {
    exe: PathBuf,
    root: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    addrs: BTreeMap<u64, String>,
    /// Each replica's Prometheus endpoint (plain HTTP on loopback).
    metrics: BTreeMap<u64, String>,
    pub(crate) children: BTreeMap<u64, Child>,
    /// With mutual TLS: the certificates' directory (replicas get --tls-dir).
    tls_dir: Option<PathBuf>,
    /// How the benchmark's clients connect.
    security: Security,
    /// Each replica's peer port (Raft's own, `--peer-listen`), when the
    /// controllers serve Raft apart.
    peer_ports: BTreeMap<u64, String>,
}

/// Certificates for a bench cluster: replicas 1-5, the client `bench` and
/// `extra`.
fn bench_pki(root: &Path, extra: &[gangway_proto::tls::Principal]) -> anyhow::Result<(PathBuf, Security)> {
    use gangway_proto::tls::{Credentials, Principal, Role, TlsFiles};
    let dir = root.join("tls");
    let mut ps: Vec<Principal> = (1..=5)
        .map(|i| Principal::new(Role::Server, &i.to_string()))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    ps.push(Principal::new(Role::Client, "bench").map_err(anyhow::Error::msg)?);
    ps.extend_from_slice(extra);
    gangway_proto::pki::throwaway(&dir, &ps).map_err(anyhow::Error::msg)?;
    let creds = Credentials::load(TlsFiles::in_dir(&dir, "client-bench")).map_err(anyhow::Error::msg)?;
    Ok((dir, Security::Tls(creds)))
}

/// Whether `exe`'s controller serves Raft on a peer port of its own (an
/// older build, run for a before-and-after comparison, may not).
fn serves_peer_ports(exe: &Path) -> bool {
    Command::new(exe)
        .args(["controller", "--help"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--peer-listen"))
}

/// `n` distinct loopback ports free right now (all held until all are chosen).
pub(crate) fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let held: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    held.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

impl LocalCluster {
    pub(crate) fn start(replicas: u64, data_dir: Option<PathBuf>) -> anyhow::Result<LocalCluster> {
        Self::start_with(replicas, data_dir, None)
    }

    /// With mutual TLS; certificates for `extra` principals (agents, users)
    /// are made beside the replicas' and the `bench` client's.
    pub(crate) fn start_mtls(
        replicas: u64,
        data_dir: Option<PathBuf>,
        extra: &[gangway_proto::tls::Principal],
    ) -> anyhow::Result<LocalCluster> {
        Self::start_with(replicas, data_dir, Some(extra))
    }

    /// [`LocalCluster::start_mtls`] running `exe`'s controllers (another
    /// build's, for a before-and-after comparison), or this binary's.
    pub(crate) fn start_mtls_with(
        replicas: u64,
        data_dir: Option<PathBuf>,
        extra: &[gangway_proto::tls::Principal],
        exe: Option<PathBuf>,
    ) -> anyhow::Result<LocalCluster> {
        let peer_ports = match &exe {
            None => true,
            Some(e) => serves_peer_ports(e),
        };
        Self::start_from(replicas, data_dir, Some(extra), exe, peer_ports)
    }

    fn start_with(
        replicas: u64,
        data_dir: Option<PathBuf>,
        mtls: Option<&[gangway_proto::tls::Principal]>,
    ) -> anyhow::Result<LocalCluster> {
        Self::start_from(replicas, data_dir, mtls, None, false)
    }

    fn start_from(
        replicas: u64,
        data_dir: Option<PathBuf>,
        mtls: Option<&[gangway_proto::tls::Principal]>,
        exe: Option<PathBuf>,
        peer_ports: bool,
    ) -> anyhow::Result<LocalCluster> {
        let (tmp, root) = match data_dir {
            Some(d) => (None, d),
            None => {
                let t = tempfile::Builder::new().prefix("gangway-bench-").tempdir()?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        std::fs::create_dir_all(&root)?;
        let ports = free_ports(3 * replicas as usize)?;
        let at = |p: &u16| format!("127.0.0.1:{p}");
        let addrs: BTreeMap<u64, String> = (1..=replicas).zip(ports.iter().step_by(3).map(at)).collect();
        let metrics: BTreeMap<u64, String> = (1..=replicas).zip(ports.iter().skip(1).step_by(3).map(at)).collect();
        let peer_ports: BTreeMap<u64, String> = match peer_ports {
            true => (1..=replicas).zip(ports.iter().skip(2).step_by(3).map(at)).collect(),
            false => BTreeMap::new(),
        };
        let (tls_dir, security) = match mtls {
            Some(extra) => {
                let (d, s) = bench_pki(&root, extra)?;
                (Some(d), s)
            }
            None => (None, Security::Insecure),
        };
        let mut c = LocalCluster {
            exe: match exe {
                Some(e) => e,
                None => std::env::current_exe()?,
            },
            root,
            _tmp: tmp,
            addrs,
            metrics,
            children: BTreeMap::new(),
            tls_dir,
            security,
            peer_ports,
        };
        for id in 1..=replicas {
            c.respawn(id)?;
        }
        Ok(c)
    }

    /// Starts replica `id` (again, after a kill: same address and data).
    pub(crate) fn respawn(&mut self, id: u64) -> anyhow::Result<()> {
        let member = |i: &u64, a: &String| match self.peer_ports.get(i).and_then(|p| p.rsplit_once(':')) {
            Some((_, port)) => format!("{a}/{port}"),
            None => a.clone(),
        };
        let peers: Vec<String> = self.addrs.iter().map(|(i, a)| format!("{i}={}", member(i, a))).collect();
        let dir = self.root.join(format!("replica-{id}"));
        std::fs::create_dir_all(&dir)?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("controller.log"))?;
        let mut cmd = Command::new(&self.exe);
        cmd.args(["controller", "--id", &id.to_string(), "--listen", &self.addrs[&id], "--peers", &peers.join(",")])
            .args(["--bootstrap-admin", "bench", "--allow-root-jobs", "--metrics-listen", &self.metrics[&id]]);
        if let Some(p) = self.peer_ports.get(&id) {
            cmd.args(["--peer-listen", p, "--advertise", &member(&id, &self.addrs[&id])]);
        }
        match &self.tls_dir {
            Some(d) => cmd.arg("--tls-dir").arg(d),
            None => cmd.arg("--insecure"),
        };
        let child = cmd
            .arg("--data-dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting a controller process")?;
        self.children.insert(id, child);
        Ok(())
    }

    /// SIGKILL: no chance to flush or say goodbye.
    pub(crate) fn kill(&mut self, id: u64) {
        if let Some(mut c) = self.children.remove(&id) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub(crate) fn endpoints(&self) -> Vec<String> {
        self.addrs.values().cloned().collect()
    }

    /// The replicas' peer ports (empty when Raft shares the API port).
    pub(crate) fn peer_endpoints(&self) -> Vec<String> {
        self.peer_ports.values().cloned().collect()
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    pub(crate) fn security(&self) -> &Security {
        &self.security
    }

    pub(crate) fn tls_dir(&self) -> Option<&Path> {
        self.tls_dir.as_deref()
    }

    /// Every replica's address, `leader`'s first (followers would forward:
    /// one more hop).
    pub(crate) fn endpoints_leader_first(&self, leader: u64) -> Vec<String> {
        let mut eps = vec![self.addrs[&leader].clone()];
        eps.extend(self.addrs.iter().filter(|(id, _)| **id != leader).map(|(_, a)| a.clone()));
        eps
    }

    /// The leader's id once every live replica agrees there is one.
    pub(crate) async fn wait_leader(&self, client: &Client) -> anyhow::Result<u64> {
        let deadline = Instant::now() + CLUSTER_WAIT;
        while Instant::now() < deadline {
            let s = client.admin_cluster_status(pb::ClusterStatusRequest {}).await;
            if let Ok(s) = s {
                let s = s.into_inner();
                if let Some(l) = s.leader_id {
                    if s.replicas.iter().any(|r| r.id == l && r.replica_role() == Some(ReplicaRole::Leader)) {
                        return Ok(l);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("no leader within {}s (logs in {})", CLUSTER_WAIT.as_secs(), self.root.display())
    }

    /// Waits until every replica answers and has applied the leader's commit index.
    pub(crate) async fn wait_converged(&self, client: &Client) -> anyhow::Result<()> {
        let deadline = Instant::now() + CLUSTER_WAIT;
        while Instant::now() < deadline {
            if let Ok(s) = client.admin_cluster_status(pb::ClusterStatusRequest {}).await {
                let s = s.into_inner();
                let commit = s
                    .replicas
                    .iter()
                    .filter(|r| r.replica_role() == Some(ReplicaRole::Leader))
                    .filter_map(|r| r.commit_index)
                    .max();
                if let Some(c) = commit {
                    if s.replicas.iter().all(|r| {
                        r.replica_role() != Some(ReplicaRole::Unreachable) && r.applied_index.unwrap_or(0) >= c
                    }) {
                        return Ok(());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("replicas did not converge within {}s", CLUSTER_WAIT.as_secs())
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let ids: Vec<u64> = self.children.keys().copied().collect();
        for id in ids {
            self.kill(id);
        }
    }
}

/// Pages of a job list read at most: 10,000 jobs each, past any job count
/// the core keeps.
const JOB_PAGES_MAX: usize = 100_000;

/// Every job, paged.
pub(crate) async fn all_jobs(client: &Client) -> anyhow::Result<Vec<pb::Job>> {
    job_pages(|after_id| async move {
        let req = pb::ListJobsRequest { after_id, limit: 10_000, ..Default::default() };
        let page = client.job_list(req.clone()).await?.into_inner();
        anyhow::Ok((page.jobs, Some(page.next_after_id).filter(|n| *n != 0)))
    })
    .await
}

/// A whole job list (`fetch(after_id)`), within [`JOB_PAGES_MAX`] pages,
/// or an error.
async fn job_pages<F, Fut>(fetch: F) -> anyhow::Result<Vec<pb::Job>>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(Vec<pb::Job>, Option<u64>)>>,
{
    let (all, whole) = gangway_proto::client::paged(JOB_PAGES_MAX, 0, fetch).await?;
    anyhow::ensure!(whole, "the job list did not end within {JOB_PAGES_MAX} pages");
    Ok(all)
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// What a closed loop of clients measured: acknowledged operations, their
/// rate over the run, latency percentiles, failed calls.
pub(crate) struct Load {
    pub ops: usize,
    pub per_s: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub errors: u64,
}

/// One client's operation: called with a sequence number, true when the
/// system acknowledged it.
pub(crate) type Op = Box<dyn FnMut(u64) -> futures::future::BoxFuture<'static, bool> + Send>;

/// `clients` tasks, each calling its own `make_op(t)` back to back for
/// `seconds`.
pub(crate) async fn closed_loop(clients: usize, seconds: u64, make_op: impl Fn(usize) -> Op) -> anyhow::Result<Load> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|t| {
            let mut op = make_op(t);
            tokio::spawn(async move {
                let (mut lat, mut errors, mut i) = (Vec::new(), 0u64, 0u64);
                while Instant::now() < deadline {
                    let began = Instant::now();
                    if op(i).await {
                        lat.push(began.elapsed());
                    } else {
                        errors += 1;
                    }
                    i += 1;
                }
                (lat, errors)
            })
        })
        .collect();
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (lat, e) = t.await?;
        all.extend(lat);
        errors += e;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    Ok(Load {
        ops: all.len(),
        per_s: all.len() as f64 / elapsed,
        p50: percentile(&all, 0.5),
        p99: percentile(&all, 0.99),
        errors,
    })
}

/// A submit loop for one client with its own connection; idempotency keys
/// start with `prefix`.
pub(crate) fn submit_op(endpoints: &[String], security: &Security, prefix: String) -> Op {
    let client = Arc::new(Client::new(endpoints, "bench", security).expect("loopback endpoints parse"));
    Box::new(move |i| {
        let (client, key) = (client.clone(), format!("{prefix}-{i}"));
        Box::pin(async move { submit_once(&client, key).await.is_ok() })
    })
}

/// Leader kills against a replicated system while one client writes.
pub(crate) trait Replicated {
    /// The current leader's id, once the members agree on one.
    fn leader(&mut self) -> futures::future::BoxFuture<'_, anyhow::Result<u64>>;
    /// SIGKILLs member `id`: no chance to flush or say goodbye.
    fn kill(&mut self, id: u64);
    /// Restarts that member and waits until the system is whole again.
    fn restore(&mut self, id: u64) -> futures::future::BoxFuture<'_, anyhow::Result<()>>;
}

/// When a write was issued and when it was acknowledged.
pub(crate) type Acks = Mutex<Vec<(Instant, Instant)>>;

/// For each kill: the time until the first write issued after the kill was
/// acknowledged (a write in flight at the kill may still be acknowledged by
/// the old leader; it says nothing about the failover), sorted.
pub(crate) async fn failover_gaps(
    sys: &mut dyn Replicated,
    acks: &Acks,
    runs: usize,
    label: &str,
) -> anyhow::Result<Vec<Duration>> {
    let mut gaps = Vec::with_capacity(runs);
    for run in 1..=runs {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let leader = sys.leader().await?;
        let killed_at = Instant::now();
        sys.kill(leader);
        let deadline = killed_at + CLUSTER_WAIT;
        let gap = loop {
            let first = acks.lock().await.iter().rev().take_while(|(issued, _)| *issued > killed_at).last().copied();
            if let Some((_, acked)) = first {
                break acked.duration_since(killed_at);
            }
            if Instant::now() > deadline {
                bail!("{label}: no write succeeded within {} s of killing the leader", CLUSTER_WAIT.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        println!(
            "{label} run {run:>3}: killed leader {leader}; next acknowledged write after {:.0} ms",
            gap.as_secs_f64() * 1000.0
        );
        gaps.push(gap);
        sys.restore(leader).await?;
    }
    gaps.sort_unstable();
    Ok(gaps)
}

/// A task that loops `op` and records when each acknowledged write was
/// issued and acknowledged.
pub(crate) fn spawn_writer(mut op: Op, acks: Arc<Acks>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut i = 0u64;
        loop {
            let issued = Instant::now();
            if op(i).await {
                acks.lock().await.push((issued, Instant::now()));
            }
            i += 1;
        }
    })
}

/// A Gangway cluster under leader kills.
pub(crate) struct GangwayFailover<'a> {
    pub cluster: &'a mut LocalCluster,
    pub client: &'a Client,
}

impl Replicated for GangwayFailover<'_> {
    fn leader(&mut self) -> futures::future::BoxFuture<'_, anyhow::Result<u64>> {
        Box::pin(self.cluster.wait_leader(self.client))
    }

    fn kill(&mut self, id: u64) {
        self.cluster.kill(id);
    }

    fn restore(&mut self, id: u64) -> futures::future::BoxFuture<'_, anyhow::Result<()>> {
        Box::pin(async move {
            self.cluster.respawn(id)?;
            self.cluster.wait_converged(self.client).await
        })
    }
}

/// Submits back to back through `client`, recording each acknowledged job's
/// id in `ids` and when it was acknowledged in `acks`.
pub(crate) fn spawn_submitter(
    client: Arc<Client>,
    ids: Arc<Mutex<BTreeSet<u64>>>,
    acks: Arc<Acks>,
) -> tokio::task::JoinHandle<()> {
    let op: Op = Box::new(move |i| {
        let (client, ids) = (client.clone(), ids.clone());
        Box::pin(async move {
            match submit_once(&client, format!("failover-{i}")).await {
                Ok(id) => {
                    ids.lock().await.insert(id);
                    true
                }
                Err(_) => false,
            }
        })
    });
    spawn_writer(op, acks)
}

/// Of the acknowledged job ids, how many the cluster no longer has.
pub(crate) async fn lost_jobs(client: &Client, acked: &BTreeSet<u64>) -> anyhow::Result<usize> {
    let present: BTreeSet<u64> = all_jobs(client).await?.iter().map(|j| j.id).collect();
    Ok(acked.difference(&present).count())
}

pub(crate) fn bench_spec() -> pb::JobSpec {
    pb::JobSpec { name: "bench".into(), command: vec!["true".into()], workdir: "/tmp".into(), ..Default::default() }
}

async fn submit_once(client: &Client, key: String) -> Result<u64, tonic::Status> {
    submit_spec(client, bench_spec(), key).await
}

/// Submits `spec` with idempotency key `key`; returns the job's id.
pub(crate) async fn submit_spec(client: &Client, spec: pb::JobSpec, key: String) -> Result<u64, tonic::Status> {
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: key };
    client.job_submit(req.clone()).await.map(|r| r.into_inner().job_id)
}

/// A histogram's running totals as a replica exposes them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct SumCount {
    pub sum: f64,
    pub count: f64,
}

/// `name`'s `_sum` and `_count` in Prometheus text, added up over the series
/// whose labels contain `labels` (empty: every series).
pub(crate) fn sum_count(text: &str, name: &str, labels: &str) -> SumCount {
    let (sum_name, count_name) = (format!("{name}_sum"), format!("{name}_count"));
    let mut out = SumCount::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(v) = value.parse::<f64>() else { continue };
        let (metric, series_labels) = series.split_once('{').unwrap_or((series, ""));
        if !series_labels.contains(labels) {
            continue;
        }
        if metric == sum_name {
            out.sum += v;
        } else if metric == count_name {
            out.count += v;
        }
    }
    out
}

/// Bytes of one scrape read at most (a replica's page is tens of KB).
const SCRAPE_BYTES_MAX: u64 = 16 << 20;

/// One replica's metrics page ("" when it does not answer).
async fn scrape(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n").await?;
        let mut buf = Vec::new();
        s.take(SCRAPE_BYTES_MAX).read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&buf).into_owned())
    };
    match tokio::time::timeout(Duration::from_secs(5), fetch).await {
        Ok(Ok(text)) => text.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default(),
        _ => String::new(),
    }
}

/// Where a replicated write's time goes, as the replicas themselves record
/// it: (what, histogram, labels, on the leader or summed over followers).
const WRITE_BREAKDOWN: &[(&str, &str, &str, bool)] = &[
    ("leader: proposed → committed and applied", "gangway_proposal_seconds", "", true),
    (
        "leader: append RPC to a follower, round trip (heartbeats too)",
        "gangway_raft_rpc_seconds",
        "rpc=\"append\"",
        true,
    ),
    ("leader: its own log fsync", "gangway_raft_wal_fsync_seconds", "", true),
    ("follower: append handled (write, fsync, answer)", "gangway_raft_append_handled_seconds", "", false),
    ("follower: its log fsync", "gangway_raft_wal_fsync_seconds", "", false),
];

impl LocalCluster {
    /// Every live replica's metrics page.
    pub(crate) async fn scrape_all(&self) -> BTreeMap<u64, String> {
        let mut out = BTreeMap::new();
        for (id, addr) in &self.metrics {
            out.insert(*id, scrape(addr).await);
        }
        out
    }
}

/// The breakdown between two scrapes: (what, mean ms, events) per row.
pub(crate) fn write_breakdown(
    before: &BTreeMap<u64, String>,
    after: &BTreeMap<u64, String>,
    leader: u64,
) -> Vec<(&'static str, f64, f64)> {
    WRITE_BREAKDOWN
        .iter()
        .map(|(what, name, labels, on_leader)| {
            let mut d = SumCount::default();
            for (id, text) in after {
                if (*id == leader) != *on_leader {
                    continue;
                }
                let (a, b) = (sum_count(text, name, labels), sum_count(&before[id], name, labels));
                d.sum += a.sum - b.sum;
                d.count += a.count - b.count;
            }
            let mean_ms = if d.count > 0.0 { d.sum / d.count * 1000.0 } else { 0.0 };
            (*what, mean_ms, d.count)
        })
        .collect()
}

pub(crate) fn machine_facts() -> String {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mem_gb = gangway_node_agent::inventory::host_mem_mb() / 1024;
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    format!("{cpus} CPUs ({model}), {mem_gb} GiB RAM")
}

/// `bench submit`'s options, within their limits.
fn check_submit(replicas: u64, clients: &[usize], seconds: u64) -> anyhow::Result<()> {
    if !(1..=5).contains(&replicas) {
        bail!("replicas: must be between 1 and 5");
    }
    if clients.is_empty() || clients.iter().any(|&c| c == 0 || c > BENCH_CLIENTS_MAX) {
        bail!("clients: each count must be between 1 and {BENCH_CLIENTS_MAX}");
    }
    if seconds == 0 || seconds > BENCH_SECONDS_MAX {
        bail!("seconds: must be between 1 and {BENCH_SECONDS_MAX}");
    }
    Ok(())
}

/// `bench failover`'s runs, within their limit.
fn check_runs(runs: usize) -> anyhow::Result<()> {
    if runs == 0 || runs > FAILOVER_RUNS_MAX {
        bail!("runs: must be between 1 and {FAILOVER_RUNS_MAX}");
    }
    Ok(())
}

/// `bench jobs`'s options, within their limits.
fn check_jobs(jobs: usize, nodes: usize) -> anyhow::Result<()> {
    if jobs == 0 || jobs > BENCH_JOBS_MAX {
        bail!("jobs: must be between 1 and {BENCH_JOBS_MAX}");
    }
    if nodes == 0 || nodes > BENCH_NODES_MAX {
        bail!("nodes: must be between 1 and {BENCH_NODES_MAX}");
    }
    Ok(())
}

async fn bench_submit(
    clients: &[usize],
    seconds: u64,
    data_dir: Option<PathBuf>,
    replicas: u64,
    transports: &[String],
) -> anyhow::Result<()> {
    check_submit(replicas, clients, seconds)?;
    println!("bench submit: {replicas} controller processes, durable RocksDB (fsync before ack), loopback gRPC");
    println!("machine: {}", machine_facts());
    println!(
        "{:>9} {:>8} {:>10} {:>12} {:>10} {:>10} {:>10}",
        "transport", "clients", "submits", "submits/s", "p50 ms", "p99 ms", "errors"
    );
    let mut connects = Vec::new();
    for transport in transports {
        let mtls = transport == "mtls";
        let dir = data_dir.as_ref().map(|d| d.join(transport));
        let cluster =
            if mtls { LocalCluster::start_mtls(replicas, dir, &[])? } else { LocalCluster::start(replicas, dir)? };
        let security = cluster.security.clone();
        let probe = Client::new(&cluster.endpoints(), "bench", &security)?;
        let leader = cluster.wait_leader(&probe).await?;
        let eps = cluster.endpoints_leader_first(leader);
        let mut breakdowns = Vec::new();
        for &n in clients {
            let before = cluster.scrape_all().await;
            let l = closed_loop(n, seconds, |t| submit_op(&eps, &security, format!("b{n}-{t}"))).await?;
            breakdowns.push((n, write_breakdown(&before, &cluster.scrape_all().await, leader)));
            println!(
                "{:>9} {:>8} {:>10} {:>12.0} {:>10.2} {:>10.2} {:>10}",
                transport,
                n,
                l.ops,
                l.per_s,
                l.p50.as_secs_f64() * 1000.0,
                l.p99.as_secs_f64() * 1000.0,
                l.errors
            );
        }
        for (n, rows) in breakdowns {
            println!("  where the time went at {n} client(s), {transport} (means the replicas recorded):");
            for (what, mean_ms, count) in rows {
                println!("    {what:<50} {mean_ms:>8.3} ms  ({count:.0} times)");
            }
        }
        connects.push((transport.clone(), new_connection_cost(&cluster.addrs[&leader], &security).await?));
    }
    for (transport, (p50, p99)) in connects {
        println!(
            "new connection + first call ({CONNECT_SAMPLES} samples), {transport}: p50 {:.2} ms, p99 {:.2} ms",
            p50.as_secs_f64() * 1000.0,
            p99.as_secs_f64() * 1000.0
        );
    }
    Ok(())
}

/// New connections measured for the handshake cost.
const CONNECT_SAMPLES: usize = 200;

/// Connecting anew (TCP, plus the TLS handshake when secured) and one small
/// call on the fresh connection, repeated: p50 and p99.
async fn new_connection_cost(addr: &str, security: &Security) -> anyhow::Result<(Duration, Duration)> {
    let mut lat = Vec::with_capacity(CONNECT_SAMPLES);
    for _ in 0..CONNECT_SAMPLES {
        let started = Instant::now();
        let ch = security
            .connect(addr, gangway_proto::tls::Expect::Server, Duration::from_secs(2))
            .await
            .map_err(anyhow::Error::msg)?;
        AdminServiceClient::new(ch).get_replica_status(pb::ReplicaStatusRequest {}).await?;
        lat.push(started.elapsed());
    }
    lat.sort_unstable();
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
}

async fn bench_failover(runs: usize, data_dir: Option<PathBuf>) -> anyhow::Result<()> {
    check_runs(runs)?;
    let mut cluster = LocalCluster::start(3, data_dir)?;
    let client = Arc::new(Client::new(&cluster.endpoints(), "bench", &Security::Insecure)?);
    cluster.wait_leader(&client).await?;
    println!(
        "bench failover: 3 controller processes; one client submitting continuously; leader SIGKILLed {runs} times"
    );
    println!("machine: {}", machine_facts());
    let (ids, acks) = (Arc::new(Mutex::new(BTreeSet::new())), Arc::new(Mutex::new(Vec::new())));
    let submitter = spawn_submitter(client.clone(), ids.clone(), acks.clone());
    let gaps =
        failover_gaps(&mut GangwayFailover { cluster: &mut cluster, client: &client }, &acks, runs, "failover").await;
    submitter.abort();
    let _ = submitter.await;
    let gaps = gaps?;
    println!(
        "failover gap over {} runs: median {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        gaps.len(),
        percentile(&gaps, 0.5).as_secs_f64() * 1000.0,
        percentile(&gaps, 0.99).as_secs_f64() * 1000.0,
        gaps.last().copied().unwrap_or_default().as_secs_f64() * 1000.0
    );
    // Every acknowledged submit must be in the final state.
    let acked = ids.lock().await.clone();
    let missing = lost_jobs(&client, &acked).await?;
    println!("acknowledged submits: {}; missing after all failovers: {missing}", acked.len());
    if missing > 0 {
        bail!("{missing} acknowledged submits were lost");
    }
    Ok(())
}

/// Agents run in this process against a bench cluster, stopped together.
pub(crate) struct BenchAgents {
    stop: tokio::sync::broadcast::Sender<()>,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl BenchAgents {
    /// Starts an agent for each of `configs` and waits until `client` sees
    /// them all registered.
    pub(crate) async fn start(
        configs: Vec<gangway_node_agent::AgentConfig>,
        client: &Client,
    ) -> anyhow::Result<BenchAgents> {
        let (stop, _) = tokio::sync::broadcast::channel::<()>(1);
        let want = configs.len();
        let tasks = configs
            .into_iter()
            .map(|config| {
                let mut stop_rx = stop.subscribe();
                tokio::spawn(gangway_node_agent::run(config, async move {
                    let _ = stop_rx.recv().await;
                }))
            })
            .collect();
        let agents = BenchAgents { stop, tasks };
        let deadline = Instant::now() + CLUSTER_WAIT;
        loop {
            let n = client.list_nodes(false).await.map(|n| n.len()).unwrap_or(0);
            if n >= want {
                return Ok(agents);
            }
            if Instant::now() > deadline {
                agents.stop().await;
                bail!("only {n} of {want} agents registered within {} s", CLUSTER_WAIT.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(crate) async fn stop(self) {
        let _ = self.stop.send(());
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Jobs in `states` (at most `limit` are counted).
async fn count_jobs(client: &Client, states: &[pb::JobState], limit: u32) -> Result<usize, tonic::Status> {
    let req = pb::ListJobsRequest { states: states.iter().map(|s| *s as i32).collect(), limit, ..Default::default() };
    let resp = client.job_list(req.clone()).await?;
    Ok(resp.into_inner().jobs.len())
}

async fn bench_jobs(jobs: usize, nodes: usize, data_dir: Option<PathBuf>) -> anyhow::Result<()> {
    check_jobs(jobs, nodes)?;
    let cluster = LocalCluster::start(3, data_dir)?;
    let client = Arc::new(Client::new(&cluster.endpoints(), "bench", &Security::Insecure)?);
    cluster.wait_leader(&client).await?;
    let configs = (1..=nodes).map(|i| {
        let name = format!("bench-node-{i}");
        let state_dir = cluster.root().join(format!("agent-{name}"));
        gangway_node_agent::AgentConfig {
            identity: "bench".into(),
            gpu_fault_file: None,
            gpu_load_file: None,
            ..gangway_node_agent::AgentConfig::simulated(cluster.endpoints(), &name, state_dir)
        }
    });
    let agents = BenchAgents::start(configs.collect(), &client).await?;
    let workdir = cluster.root().join("jobs");
    std::fs::create_dir_all(&workdir)?;
    let user = nix::unistd::User::from_uid(nix::unistd::geteuid()).ok().flatten().map(|u| u.name).unwrap_or_default();
    println!("bench jobs: {jobs} trivial jobs (`true`) on {nodes} agents of 64 CPUs, 3 controller processes");
    println!("machine: {}", machine_facts());
    let started = Instant::now();
    let mut submitters = Vec::new();
    for c in 0..BENCH_JOBS_CLIENTS {
        let client = client.clone();
        let (workdir, user) = (workdir.display().to_string(), user.clone());
        submitters.push(tokio::spawn(async move {
            for j in (c..jobs).step_by(BENCH_JOBS_CLIENTS) {
                let spec = pb::JobSpec {
                    command: vec!["true".into()],
                    workdir: workdir.clone(),
                    user: user.clone(),
                    ..Default::default()
                };
                let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: format!("job-{j}") };
                client.job_submit(req.clone()).await?;
            }
            Ok::<_, tonic::Status>(())
        }));
    }
    for s in submitters {
        s.await??;
    }
    let submitted = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(600);
    let (done, failed) = loop {
        let active =
            count_jobs(&client, &[pb::JobState::Pending, pb::JobState::Running, pb::JobState::Suspended], 1).await?;
        if active == 0 {
            let completed = count_jobs(&client, &[pb::JobState::Completed], 10_000).await?;
            break (started.elapsed(), jobs.saturating_sub(completed));
        }
        if Instant::now() > deadline {
            bail!("jobs still active after 600 s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    println!(
        "all {jobs} submitted in {:.2} s; all finished after {:.2} s: {:.0} jobs/s end to end ({failed} not COMPLETED)",
        submitted.as_secs_f64(),
        done.as_secs_f64(),
        jobs as f64 / done.as_secs_f64()
    );
    agents.stop().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job list of JOB_PAGES_MAX pages is read; one page more is an
    /// error (a benchmark never counts a list cut short).
    #[tokio::test]
    async fn a_benchmark_reads_job_pages_max_pages_and_not_one_more() {
        use crate::slurm::tests::pages_of;
        let n = JOB_PAGES_MAX as u64;
        assert_eq!(job_pages(pages_of(n)).await.unwrap().len(), JOB_PAGES_MAX);
        let e = job_pages(pages_of(n + 1)).await.unwrap_err();
        assert!(e.to_string().contains(&JOB_PAGES_MAX.to_string()), "{e}");
    }

    /// A scrape reads SCRAPE_BYTES_MAX bytes of a page at most, however
    /// much a replica sends.
    #[tokio::test]
    async fn a_scrape_reads_at_most_scrape_bytes_max() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let head = b"HTTP/1.1 200 OK\r\n\r\n";
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 256];
            let _ = s.read(&mut req).await;
            let _ = s.write_all(head).await;
            let body = vec![b'a'; SCRAPE_BYTES_MAX as usize];
            let _ = s.write_all(&body).await;
        });
        let page = scrape(&addr).await;
        assert_eq!(page.len(), SCRAPE_BYTES_MAX as usize - head.len(), "one byte past SCRAPE_BYTES_MAX was read");
        server.await.unwrap();
    }

    /// Each bench option is taken at its limit and refused one past it, the
    /// refusal naming the option and the limit.
    #[test]
    fn bench_options_stop_at_their_limits() {
        let refused = |r: anyhow::Result<()>, option: &str, limit: usize| {
            let e = r.expect_err("one past the limit is taken").to_string();
            assert!(e.starts_with(option) && e.contains(&limit.to_string()), "{e}");
        };
        assert!(check_submit(3, &[1, BENCH_CLIENTS_MAX], BENCH_SECONDS_MAX).is_ok());
        refused(check_submit(3, &[BENCH_CLIENTS_MAX + 1], 1), "clients:", BENCH_CLIENTS_MAX);
        refused(check_submit(3, &[1], BENCH_SECONDS_MAX + 1), "seconds:", BENCH_SECONDS_MAX as usize);
        refused(check_submit(6, &[1], 1), "replicas:", 5);
        assert!(check_runs(FAILOVER_RUNS_MAX).is_ok());
        refused(check_runs(FAILOVER_RUNS_MAX + 1), "runs:", FAILOVER_RUNS_MAX);
        assert!(check_jobs(BENCH_JOBS_MAX, BENCH_NODES_MAX).is_ok());
        refused(check_jobs(BENCH_JOBS_MAX + 1, 1), "jobs:", BENCH_JOBS_MAX);
        refused(check_jobs(1, BENCH_NODES_MAX + 1), "nodes:", BENCH_NODES_MAX);
    }

    #[test]
    fn a_histograms_totals_are_read_from_the_exposition_text_by_name_and_label() {
        let text = "# HELP x\n# TYPE gangway_raft_rpc_seconds histogram\n\
            gangway_raft_rpc_seconds_bucket{rpc=\"append\",le=\"0.001\"} 3\n\
            gangway_raft_rpc_seconds_sum{rpc=\"append\"} 0.5\n\
            gangway_raft_rpc_seconds_count{rpc=\"append\"} 10\n\
            gangway_raft_rpc_seconds_sum{rpc=\"vote\"} 7\n\
            gangway_raft_rpc_seconds_count{rpc=\"vote\"} 1\n\
            gangway_raft_wal_fsync_seconds_sum 0.25\n\
            gangway_raft_wal_fsync_seconds_count 4\n";
        assert_eq!(sum_count(text, "gangway_raft_rpc_seconds", "rpc=\"append\""), SumCount { sum: 0.5, count: 10.0 });
        assert_eq!(sum_count(text, "gangway_raft_rpc_seconds", ""), SumCount { sum: 7.5, count: 11.0 });
        assert_eq!(sum_count(text, "gangway_raft_wal_fsync_seconds", ""), SumCount { sum: 0.25, count: 4.0 });
        assert_eq!(sum_count(text, "gangway_raft_wal_fsync", ""), SumCount::default(), "names match whole");
        let before = BTreeMap::from([(1, String::new()), (2, String::new())]);
        let after = BTreeMap::from([(1, text.to_string()), (2, text.to_string())]);
        let rows = write_breakdown(&before, &after, 1);
        let fsync: Vec<_> = rows.iter().filter(|r| r.0.ends_with("log fsync")).collect();
        assert_eq!(fsync.len(), 2);
        assert!(fsync.iter().all(|r| (r.1 - 62.5).abs() < 1e-9 && r.2 == 4.0), "{rows:?}");
    }
}
