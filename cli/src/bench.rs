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
use gangway_proto::v1::job_service_client::JobServiceClient;
use gangway_proto::ReplicaRole;
use tokio::sync::Mutex;

/// Concurrent clients one run may use (each is a task with its own connection).
const BENCH_CLIENTS_MAX: usize = 1024;
/// Longest measurement per client count.
const BENCH_SECONDS_MAX: u64 = 600;
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
    }
}

/// A cluster of real controller processes on loopback.
pub(crate) struct LocalCluster {
    exe: PathBuf,
    root: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    addrs: BTreeMap<u64, String>,
    pub(crate) children: BTreeMap<u64, Child>,
    /// With mutual TLS: the certificates' directory (replicas get --tls-dir).
    tls_dir: Option<PathBuf>,
    /// How the benchmark's clients connect.
    security: Security,
}

/// Certificates for a bench cluster: replicas 1-5 and the client `bench`.
fn bench_pki(root: &Path) -> anyhow::Result<(PathBuf, Security)> {
    use gangway_proto::tls::{Credentials, Principal, Role, TlsFiles};
    let dir = root.join("tls");
    let mut ps: Vec<Principal> = (1..=5)
        .map(|i| Principal::new(Role::Server, &i.to_string()))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    ps.push(Principal::new(Role::Client, "bench").map_err(anyhow::Error::msg)?);
    gangway_proto::pki::throwaway(&dir, &ps).map_err(anyhow::Error::msg)?;
    let creds = Credentials::load(TlsFiles::in_dir(&dir, "client-bench")).map_err(anyhow::Error::msg)?;
    Ok((dir, Security::Tls(creds)))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl LocalCluster {
    pub(crate) fn start(replicas: u64, data_dir: Option<PathBuf>) -> anyhow::Result<LocalCluster> {
        Self::start_with(replicas, data_dir, false)
    }

    fn start_with(replicas: u64, data_dir: Option<PathBuf>, mtls: bool) -> anyhow::Result<LocalCluster> {
        let (tmp, root) = match data_dir {
            Some(d) => (None, d),
            None => {
                let t = tempfile::Builder::new().prefix("gangway-bench-").tempdir()?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        let mut addrs = BTreeMap::new();
        for id in 1..=replicas {
            addrs.insert(id, format!("127.0.0.1:{}", free_port()?));
        }
        let (tls_dir, security) = if mtls {
            let (d, s) = bench_pki(&root)?;
            (Some(d), s)
        } else {
            (None, Security::Insecure)
        };
        let mut c = LocalCluster {
            exe: std::env::current_exe()?,
            root,
            _tmp: tmp,
            addrs,
            children: BTreeMap::new(),
            tls_dir,
            security,
        };
        for id in 1..=replicas {
            c.spawn(id)?;
        }
        Ok(c)
    }

    fn spawn(&mut self, id: u64) -> anyhow::Result<()> {
        let peers: Vec<String> = self.addrs.iter().map(|(i, a)| format!("{i}={a}")).collect();
        let dir = self.root.join(format!("replica-{id}"));
        std::fs::create_dir_all(&dir)?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("controller.log"))?;
        let mut cmd = Command::new(&self.exe);
        cmd.args(["controller", "--id", &id.to_string(), "--listen", &self.addrs[&id], "--peers", &peers.join(",")])
            .args(["--bootstrap-admin", "bench", "--allow-root-jobs"]);
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

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// The leader's id once every live replica agrees there is one.
    pub(crate) async fn wait_leader(&self, client: &Client) -> anyhow::Result<u64> {
        let deadline = Instant::now() + CLUSTER_WAIT;
        while Instant::now() < deadline {
            let s = client
                .call(|ch| {
                    let r = client.request(pb::ClusterStatusRequest {});
                    async move { AdminServiceClient::new(ch).cluster_status(r).await }
                })
                .await;
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
            if let Ok(s) = client
                .call(|ch| {
                    let r = client.request(pb::ClusterStatusRequest {});
                    async move { AdminServiceClient::new(ch).cluster_status(r).await }
                })
                .await
            {
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
    let mut jobs = Vec::new();
    let mut after_id = 0u64;
    for _ in 0..JOB_PAGES_MAX {
        let req = pb::ListJobsRequest { after_id, limit: 10_000, ..Default::default() };
        let page = client
            .call(|ch| {
                let r = client.request(req.clone());
                async move { JobServiceClient::new(ch).list(r).await }
            })
            .await?
            .into_inner();
        jobs.extend(page.jobs);
        if page.next_after_id == 0 {
            return Ok(jobs);
        }
        after_id = page.next_after_id;
    }
    bail!("the job list did not end")
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn bench_spec() -> pb::JobSpec {
    pb::JobSpec { name: "bench".into(), command: vec!["true".into()], workdir: "/tmp".into(), ..Default::default() }
}

async fn submit_once(client: &Client, key: String) -> Result<u64, tonic::Status> {
    submit_spec(client, bench_spec(), key).await
}

/// Submits `spec` with idempotency key `key`; returns the job's id.
pub(crate) async fn submit_spec(client: &Client, spec: pb::JobSpec, key: String) -> Result<u64, tonic::Status> {
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: key };
    client
        .call(|ch| {
            let r = client.request(req.clone());
            async move { JobServiceClient::new(ch).submit(r).await }
        })
        .await
        .map(|r| r.into_inner().job_id)
}

fn machine_facts() -> String {
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

async fn bench_submit(
    clients: &[usize],
    seconds: u64,
    data_dir: Option<PathBuf>,
    replicas: u64,
    transports: &[String],
) -> anyhow::Result<()> {
    if !(1..=5).contains(&replicas) {
        bail!("replicas: must be between 1 and 5");
    }
    if clients.is_empty() || clients.iter().any(|&c| c == 0 || c > BENCH_CLIENTS_MAX) {
        bail!("clients: each count must be between 1 and {BENCH_CLIENTS_MAX}");
    }
    if seconds == 0 || seconds > BENCH_SECONDS_MAX {
        bail!("seconds: must be between 1 and {BENCH_SECONDS_MAX}");
    }
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
        let cluster = LocalCluster::start_with(replicas, dir, mtls)?;
        let security = cluster.security.clone();
        let probe = Client::new(&cluster.endpoints(), "bench", &security)?;
        let leader = cluster.wait_leader(&probe).await?;
        // Clients talk to the leader first (followers would forward: one more hop).
        let mut eps = vec![cluster.addrs[&leader].clone()];
        eps.extend(cluster.addrs.iter().filter(|(id, _)| **id != leader).map(|(_, a)| a.clone()));
        for &n in clients {
            let deadline = Instant::now() + Duration::from_secs(seconds);
            let mut tasks = Vec::new();
            for t in 0..n {
                let eps = eps.clone();
                let security = security.clone();
                tasks.push(tokio::spawn(async move {
                    let client = Client::new(&eps, "bench", &security).expect("endpoints");
                    let mut lat = Vec::new();
                    let mut errors = 0u64;
                    let mut i = 0u64;
                    while Instant::now() < deadline {
                        let started = Instant::now();
                        match submit_once(&client, format!("b{n}-{t}-{i}")).await {
                            Ok(_) => lat.push(started.elapsed()),
                            Err(_) => errors += 1,
                        }
                        i += 1;
                    }
                    (lat, errors)
                }));
            }
            let started = Instant::now();
            let mut all = Vec::new();
            let mut errors = 0;
            for t in tasks {
                let (lat, e) = t.await?;
                all.extend(lat);
                errors += e;
            }
            let elapsed = started.elapsed().as_secs_f64();
            all.sort_unstable();
            println!(
                "{:>9} {:>8} {:>10} {:>12.0} {:>10.2} {:>10.2} {:>10}",
                transport,
                n,
                all.len(),
                all.len() as f64 / elapsed,
                percentile(&all, 0.5).as_secs_f64() * 1000.0,
                percentile(&all, 0.99).as_secs_f64() * 1000.0,
                errors
            );
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
    if runs == 0 || runs > FAILOVER_RUNS_MAX {
        bail!("runs: must be between 1 and {FAILOVER_RUNS_MAX}");
    }
    let mut cluster = LocalCluster::start(3, data_dir)?;
    let client = Arc::new(Client::new(&cluster.endpoints(), "bench", &Security::Insecure)?);
    cluster.wait_leader(&client).await?;
    println!(
        "bench failover: 3 controller processes; one client submitting continuously; leader SIGKILLed {runs} times"
    );
    println!("machine: {}", machine_facts());
    // The submitter records the completion time of every acknowledged submit.
    let acked: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::new(Mutex::new(Vec::new()));
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let submitter = {
        let client = client.clone();
        let acked = acked.clone();
        tokio::spawn(async move {
            let mut i = 0u64;
            loop {
                tokio::select! {
                    _ = &mut stop_rx => return,
                    r = submit_once(&client, format!("failover-{i}")) => {
                        if let Ok(id) = r {
                            acked.lock().await.push((Instant::now(), id));
                        }
                        i += 1;
                    }
                }
            }
        })
    };
    let mut gaps = Vec::new();
    for run in 1..=runs {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let leader = cluster.wait_leader(&client).await?;
        let killed_at = Instant::now();
        cluster.kill(leader);
        let deadline = killed_at + CLUSTER_WAIT;
        let gap = loop {
            if let Some((t, _)) = acked.lock().await.iter().rev().take_while(|(t, _)| *t > killed_at).last() {
                break t.duration_since(killed_at);
            }
            if Instant::now() > deadline {
                bail!("no submit succeeded within {}s of killing the leader", CLUSTER_WAIT.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        println!(
            "run {run:>3}: killed leader {leader}; first acknowledged submit after {:.0} ms",
            gap.as_secs_f64() * 1000.0
        );
        gaps.push(gap);
        cluster.spawn(leader)?;
        cluster.wait_converged(&client).await?;
    }
    let _ = stop_tx.send(());
    let _ = submitter.await;
    gaps.sort_unstable();
    println!(
        "failover gap over {} runs: median {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        gaps.len(),
        percentile(&gaps, 0.5).as_secs_f64() * 1000.0,
        percentile(&gaps, 0.99).as_secs_f64() * 1000.0,
        gaps.last().copied().unwrap_or_default().as_secs_f64() * 1000.0
    );
    // Every acknowledged submit must be in the final state.
    let acked_ids: BTreeSet<u64> = acked.lock().await.iter().map(|(_, id)| *id).collect();
    let present: BTreeSet<u64> = all_jobs(&client).await?.iter().map(|j| j.id).collect();
    let missing = acked_ids.difference(&present).count();
    println!("acknowledged submits: {}; missing after all failovers: {missing}", acked_ids.len());
    if missing > 0 {
        bail!("{missing} acknowledged submits were lost");
    }
    Ok(())
}

/// Jobs in `states` (at most `limit` are counted).
async fn count_jobs(client: &Client, states: &[pb::JobState], limit: u32) -> Result<usize, tonic::Status> {
    let req = pb::ListJobsRequest { states: states.iter().map(|s| *s as i32).collect(), limit, ..Default::default() };
    let resp = client
        .call(|ch| {
            let r = client.request(req.clone());
            async move { JobServiceClient::new(ch).list(r).await }
        })
        .await?;
    Ok(resp.into_inner().jobs.len())
}

async fn bench_jobs(jobs: usize, nodes: usize, data_dir: Option<PathBuf>) -> anyhow::Result<()> {
    if jobs == 0 || jobs > BENCH_JOBS_MAX {
        bail!("jobs: must be between 1 and {BENCH_JOBS_MAX}");
    }
    if nodes == 0 || nodes > BENCH_NODES_MAX {
        bail!("nodes: must be between 1 and {BENCH_NODES_MAX}");
    }
    let cluster = LocalCluster::start(3, data_dir)?;
    let client = Arc::new(Client::new(&cluster.endpoints(), "bench", &Security::Insecure)?);
    cluster.wait_leader(&client).await?;
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut agents = Vec::new();
    for i in 1..=nodes {
        let name = format!("bench-node-{i}");
        let state_dir = cluster.root().join(format!("agent-{name}"));
        let config = gangway_node_agent::AgentConfig {
            identity: "bench".into(),
            gpu_fault_file: None,
            ..gangway_node_agent::AgentConfig::simulated(cluster.endpoints(), &name, state_dir)
        };
        let mut stop = stop_tx.subscribe();
        agents.push(tokio::spawn(gangway_node_agent::run(config, async move {
            let _ = stop.recv().await;
        })));
    }
    // Wait until every node is registered.
    let deadline = Instant::now() + CLUSTER_WAIT;
    loop {
        let n = client.list_nodes(false).await.map(|n| n.len()).unwrap_or(0);
        if n == nodes {
            break;
        }
        if Instant::now() > deadline {
            bail!("only {n} of {nodes} agents registered");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
                client
                    .call(|ch| {
                        let r = client.request(req.clone());
                        async move { JobServiceClient::new(ch).submit(r).await }
                    })
                    .await?;
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
        let active = count_jobs(&client, &[pb::JobState::Pending, pb::JobState::Running], 1).await?;
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
    let _ = stop_tx.send(());
    for a in agents {
        let _ = a.await;
    }
    Ok(())
}
