//! `gangway bench fleet`: thousands of simulated node agents against a real
//! 3-replica cluster on loopback. Each simulated agent speaks the real agent
//! protocol over real gRPC (register, heartbeat with what it runs and what it
//! has seen, task exit reports) and decides with the production
//! `AgentCore`; its tasks are timers, not processes. A steady stream of jobs
//! (1-GPU jobs and 2-node gangs) keeps the scheduler busy.
//!
//! It reports heartbeat round-trip percentiles, the leader's CPU and resident
//! memory, Raft entries per second, submit→start latency, placements per
//! second, nodes wrongly declared down (must be 0), and how long a node that
//! really stops takes to be declared down.
//!
//! The simulated agents share a few connections (`--connections`): a real
//! agent has its own, and the kernel's limits on one host make tens of
//! thousands of them a measurement of the host, not of Gangway. The cluster
//! runs `--insecure` (agents claim their identity): issuing 10,000 agent
//! certificates would measure the PKI.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use gangway_core::agent::{Action, AgentCore, Exit, Fences};
use gangway_proto::client::Client;
use gangway_proto::tls::Security;
use gangway_proto::v1 as pb;
use gangway_proto::v1::job_service_client::JobServiceClient;
use tonic::Request;

use crate::bench::{all_jobs, percentile, submit_spec, LocalCluster};

/// Simulated nodes one run may start (the core's node limit).
const FLEET_NODES_MAX: usize = gangway_core::limits::NODES_MAX;
/// Connections the simulated agents may share.
const FLEET_CONNECTIONS_MAX: usize = 1024;
/// Longest measurement.
const FLEET_SECONDS_MAX: u64 = 3600;
/// Jobs per second the submitter may be asked for.
const FLEET_JOBS_PER_S_MAX: u64 = 10_000;
/// Nodes stopped on purpose to time node-down detection.
const FLEET_STOPPED_NODES: usize = 5;
/// How long the whole fleet may take to register.
const REGISTER_WAIT: Duration = Duration::from_secs(300);
/// Registrations tried per agent, half a second apart, before the run
/// fails: as long as the fleet may take to register.
const REGISTER_ATTEMPTS_MAX: u64 = 601;
const REGISTER: gangway_proto::retry::Retry =
    gangway_proto::retry::Retry::new(REGISTER_ATTEMPTS_MAX, Duration::from_millis(500));
/// Heartbeat round trips kept for percentiles (the rest only counted).
const RTT_SAMPLES_MAX: usize = 2_000_000;
/// Exit reports one agent sends per round at most (the rest wait).
const REPORTS_PER_ROUND_MAX: usize = 64;

/// The exit reports this round sends, oldest first: [`REPORTS_PER_ROUND_MAX`].
fn round_reports(c: &mut AgentCore) -> Vec<Exit> {
    std::iter::from_fn(|| c.take_report()).take(REPORTS_PER_ROUND_MAX).collect()
}

/// Keeps a round trip for the percentiles while fewer than
/// [`RTT_SAMPLES_MAX`] are kept (the rest are only counted).
fn keep_sample(rtts: &mut Vec<u32>, rtt: Duration) {
    if rtts.len() < RTT_SAMPLES_MAX {
        rtts.push(u32::try_from(rtt.as_micros()).unwrap_or(u32::MAX));
    }
}
/// Grace an agent gives a task it stops (the agent's default).
const STOP_GRACE_MS: u64 = 10_000;
/// One call's deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Share of submitted jobs that are 2-node gangs of whole nodes, per thousand.
const GANGS_PER_MILLE: u64 = 100;
/// The name of the preloaded jobs that run until the benchmark ends.
const LONG_JOB_NAME: &str = "fleet-long";
/// Jobs one run may preload (running or pending): the core's active-job
/// limit bounds the rest.
const PRELOAD_JOBS_MAX: u64 = 500_000;
/// The user the preloaded jobs belong to.
const PRELOAD_USER: &str = "preload";
/// Submissions in flight while preloading.
const PRELOAD_CONCURRENCY: usize = 64;
/// How long the preloaded jobs may take to start.
const PRELOAD_WAIT: Duration = Duration::from_secs(600);
/// One in this many of the big gang's nodes checks its task environment.
const GANG_ENV_SAMPLE: u32 = 64;
/// How long the failover phase waits for the fleet to follow a new leader.
const FAILOVER_WAIT: Duration = Duration::from_secs(120);

#[derive(Args, Debug)]
pub struct FleetArgs {
    /// Simulated nodes (agents).
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Seconds measured once every node has registered.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Jobs submitted per second (1-GPU jobs and a tenth 2-node gangs).
    #[arg(long, default_value_t = 50)]
    jobs_per_s: u64,
    /// Longest run time of a job, seconds (each runs 1..this, by its id).
    #[arg(long, default_value_t = 20)]
    run_s: u64,
    /// gRPC connections the simulated agents share.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Keep the cluster's data here instead of a temp dir.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// At the start of the measurement, submit one gang of this many whole
    /// nodes (0: none) and time its placement and its launch on every node;
    /// each node checks the job's hostlist in its task environment.
    #[arg(long, default_value_t = 0)]
    gang_nodes: u32,
    /// Before the measurement, start this many long-running one-CPU jobs
    /// (they run until the benchmark ends) and wait until they all run.
    #[arg(long, default_value_t = 0)]
    preload_running: u64,
    /// Before the measurement, queue this many jobs that wait on a
    /// dependency (on one of the long-running jobs): pending all along.
    #[arg(long, default_value_t = 0)]
    preload_pending: u64,
    /// After the measurement, kill the leader (SIGKILL) and time how long
    /// the fleet takes to follow its successor.
    #[arg(long)]
    failover: bool,
}

/// What the agents measure together.
#[derive(Default)]
struct Shared {
    rtts_us: std::sync::Mutex<Vec<u32>>,
    heartbeats: AtomicU64,
    errors: AtomicU64,
    /// Answers saying the node is unknown or down (it registers again).
    unknown: AtomicU64,
    launches: AtomicU64,
    exits: AtomicU64,
    registered: AtomicU64,
    /// Pokes received on the agents' WatchNode streams.
    pokes: AtomicU64,
    /// The term of the leader that last answered each agent.
    answered_term: Vec<AtomicU64>,
    /// When each agent's watch was last poked (wall ms).
    poked_ms: Vec<AtomicU64>,
    /// Each agent's watch: streams opened, and whether one is open now.
    watch_opened: Vec<AtomicU64>,
    watch_open: Vec<AtomicBool>,
    /// The big gang's launches later than a second, by whether the agent's
    /// watch was poked after the gang was submitted.
    gang_late_poked: AtomicU64,
    gang_late_unpoked: AtomicU64,
    gang_submitted_ms: AtomicU64,
    /// The term of the leader killed in the failover phase (0: none yet).
    killed_term: AtomicU64,
    /// Wall ms of the first launch a later leader ordered (0: none yet).
    first_launch_after_kill_ms: AtomicU64,
    /// Each job's attempts running somewhere now, with their task counts.
    running_attempts: std::sync::Mutex<BTreeMap<u64, BTreeMap<u32, u32>>>,
    /// Launches of a job while another attempt of it still ran: a job
    /// started twice (must be 0).
    overlaps: AtomicU64,
    /// Preloaded long jobs launched.
    long_launched: AtomicU64,
    /// The big gang's job id (0: none) and size.
    gang_job: AtomicU64,
    gang_nodes: AtomicU64,
    /// When each of its tasks launched (wall ms), in order.
    gang_launch_ms: std::sync::Mutex<Vec<u64>>,
    /// Its launches whose task environment named every node of the gang,
    /// and those whose did not.
    gang_env_ok: AtomicU64,
    gang_env_bad: AtomicU64,
    /// Set: the agent stops heartbeating (a node that really died).
    stop: Vec<AtomicBool>,
    /// The whole run ends.
    done: AtomicBool,
}

impl Shared {
    /// A launch of the big gang's task on `node`: on every
    /// GANG_ENV_SAMPLE-th rank the order is completed as a real agent does
    /// and its environment must name the whole gang. (Every agent expanding
    /// the hostlist would make the benchmark's one host do a whole fleet's
    /// work.)
    fn gang_launch(&self, order: Option<&pb::LaunchOrder>, node: &str) {
        let want = self.gang_nodes.load(Ordering::Relaxed) as usize;
        self.gang_launch_ms.lock().expect("gang launches").push(now_ms());
        if order.is_some_and(|o| o.node_rank % GANG_ENV_SAMPLE != 0) {
            return;
        }
        let mut order = order.cloned();
        let env = match order.as_mut().map(gangway_node_agent::launch::complete_order) {
            Some(Ok(())) => order.as_ref().map(|o| gangway_node_agent::launch::task_env(o, node)).unwrap_or_default(),
            _ => Default::default(),
        };
        let named = env.get("SLURM_JOB_NODELIST").and_then(|l| crate::slurm::hostlist::expand(l).ok());
        let ok = named.is_some_and(|n| n.len() == want && n.iter().any(|x| x == node))
            && env.get("SLURM_JOB_NUM_NODES").is_some_and(|n| *n == want.to_string());
        let counter = if ok { &self.gang_env_ok } else { &self.gang_env_bad };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn task_started(&self, (job, attempt): (u64, u32)) {
        let mut running = self.running_attempts.lock().expect("attempts");
        let attempts = running.entry(job).or_default();
        if attempts.iter().any(|(a, n)| *a != attempt && *n > 0) {
            self.overlaps.fetch_add(1, Ordering::Relaxed);
        }
        *attempts.entry(attempt).or_default() += 1;
    }

    fn task_gone(&self, (job, attempt): (u64, u32)) {
        let mut running = self.running_attempts.lock().expect("attempts");
        if let Some(attempts) = running.get_mut(&job) {
            if let Some(n) = attempts.get_mut(&attempt) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    attempts.remove(&attempt);
                }
            }
            if attempts.is_empty() {
                running.remove(&job);
            }
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn node_name(i: usize) -> String {
    format!("fleet{i:05}")
}

/// A request carrying `identity`: the cluster is insecure, agents claim who they are.
fn claimed<T>(msg: T, identity: &tonic::metadata::MetadataValue<tonic::metadata::Ascii>) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert(gangway_proto::IDENTITY_METADATA_KEY, identity.clone());
    r.set_timeout(CALL_TIMEOUT);
    r
}

fn register_request(i: usize, gpus: u32) -> pb::RegisterRequest {
    let name = node_name(i);
    pb::RegisterRequest {
        gpus: (0..gpus)
            .map(|g| pb::GpuInventory {
                uuid: format!("GPU-{name}-{g}"),
                model: "h100-80gb".into(),
                mem_mb: 81_920,
                nvlink_island: 0,
            })
            .collect(),
        name,
        addr: String::new(),
        cpus: 64,
        mem_mb: 512 * 1024,
        topology: vec![format!("rack{}", i / 32)],
        labels: Default::default(),
    }
}

/// How long job `id`'s tasks run: 1..=run_s seconds, fixed by the id so
/// every node of a gang agrees.
fn run_time(id: u64, run_s: u64) -> Duration {
    Duration::from_secs(1 + id.wrapping_mul(0x9E37_79B9_7F4A_7C15) % run_s.max(1))
}

/// Stops a simulated agent's watch when the agent ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The agent's WatchNode stream, as the real agent keeps one: each change
/// that concerns the node wakes its heartbeat early.
async fn watch(i: usize, client: Arc<Client>, shared: Arc<Shared>, poke: Arc<tokio::sync::Notify>) {
    let name = node_name(i);
    let Ok(identity) = format!("agent:{name}").parse::<tonic::metadata::MetadataValue<_>>() else { return };
    while !shared.done.load(Ordering::Relaxed) && !shared.stop[i].load(Ordering::Relaxed) {
        let req = pb::WatchNodeRequest { name: name.clone() };
        let stream = client
            .call(|ch| {
                let mut r = Request::new(req.clone());
                r.metadata_mut().insert(gangway_proto::IDENTITY_METADATA_KEY, identity.clone());
                async move { gangway_proto::limits::agent_client(ch).watch_node(r).await }
            })
            .await;
        if let Ok(stream) = stream {
            shared.watch_opened[i].fetch_add(1, Ordering::Relaxed);
            shared.watch_open[i].store(true, Ordering::Relaxed);
            let _open = OnDrop(|| shared.watch_open[i].store(false, Ordering::Relaxed));
            let mut stream = stream.into_inner();
            while let Ok(Some(_)) = stream.message().await {
                if shared.done.load(Ordering::Relaxed) || shared.stop[i].load(Ordering::Relaxed) {
                    return;
                }
                shared.pokes.fetch_add(1, Ordering::Relaxed);
                shared.poked_ms[i].store(now_ms(), Ordering::Relaxed);
                poke.notify_one();
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// One simulated node: registers, then heartbeats every interval (or at
/// once when its watch is poked) until the run ends (or it is told to stop,
/// as a dead node would).
async fn agent(i: usize, client: Arc<Client>, shared: Arc<Shared>, gpus: u32, run_s: u64) -> anyhow::Result<()> {
    let name = node_name(i);
    let identity: tonic::metadata::MetadataValue<_> = format!("agent:{name}").parse()?;
    let poke = Arc::new(tokio::sync::Notify::new());
    let _watch = AbortOnDrop(tokio::spawn(watch(i, client.clone(), shared.clone(), poke.clone())));
    let register = || {
        let (client, identity) = (client.clone(), identity.clone());
        let req = register_request(i, gpus);
        async move {
            client
                .call(|ch| {
                    let r = claimed(req.clone(), &identity);
                    async move { gangway_proto::limits::agent_client(ch).register(r).await }
                })
                .await
        }
    };
    let mut core: Option<AgentCore> = None;
    let mut tasks: BTreeMap<(u64, u32), Instant> = BTreeMap::new();
    // Spread the fleet's heartbeats over the interval, as real agents started
    // at different times are.
    tokio::time::sleep(Duration::from_millis((i as u64 * 7919) % 1000)).await;
    while !shared.done.load(Ordering::Relaxed) {
        if shared.stop[i].load(Ordering::Relaxed) {
            // The node died, and its tasks with it.
            for t in std::mem::take(&mut tasks).into_keys() {
                shared.task_gone(t);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        if core.is_none() {
            let sent = now_ms();
            let mut tries = REGISTER.tries();
            let mut failed = None;
            let resp = loop {
                if !tries.next().await {
                    bail!("{name}: register: {REGISTER_ATTEMPTS_MAX} attempts: {}", failed.unwrap_or_default());
                }
                match register().await {
                    Ok(r) => break r.into_inner(),
                    Err(e) => {
                        shared.errors.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(node = %name, error = %e, "register failed; retrying");
                        failed = Some(e.to_string());
                    }
                }
            };
            let mut c = AgentCore::new(Fences::default(), STOP_GRACE_MS, sent);
            c.registered_at(sent, resp.node_down_timeout_ms, resp.heartbeat_interval_ms);
            // Tasks it ran are gone with the node's "restart".
            for t in std::mem::take(&mut tasks).into_keys() {
                shared.task_gone(t);
            }
            core = Some(c);
            shared.registered.fetch_add(1, Ordering::Relaxed);
        }
        let c = core.as_mut().expect("registered");
        // Tasks whose time is up end well.
        let now = Instant::now();
        let ended: Vec<(u64, u32)> = tasks.iter().filter(|(_, end)| **end <= now).map(|(k, _)| *k).collect();
        for t in ended {
            tasks.remove(&t);
            shared.task_gone(t);
            c.task_exited(Exit::ended(t, Some(0), None));
        }
        // Exits go before the heartbeat, as the real agent sends them.
        let mut round = round_reports(c).into_iter();
        while let Some(e) = round.next() {
            let req = pb::TaskExitReport {
                node: name.clone(),
                job_id: e.task.0,
                attempt: e.task.1,
                exit_code: e.exit_code,
                signal: e.signal,
                reason: e.reason.clone(),
                lost: e.lost,
                peak_mem_mb: None,
                usage: None,
            };
            let sent = client
                .call(|ch| {
                    let r = claimed(req.clone(), &identity);
                    async move { gangway_proto::limits::agent_client(ch).report_task_exit(r).await }
                })
                .await;
            if sent.is_err() {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                // This one and the rest go first next round, in order.
                let back: Vec<Exit> = std::iter::once(e).chain(round).collect();
                for e in back.into_iter().rev() {
                    c.report_failed(e);
                }
                break;
            }
            shared.exits.fetch_add(1, Ordering::Relaxed);
        }
        let running: Vec<pb::TaskRef> =
            c.running().into_iter().map(|(job_id, attempt)| pb::TaskRef { job_id, attempt }).collect();
        let req = pb::HeartbeatRequest {
            name: name.clone(),
            running,
            gpu_health: (0..gpus)
                .map(|g| pb::GpuHealthReport { index: g, healthy: true, reason: String::new() })
                .collect(),
            seen_index: c.seen_index(),
            reads_nodelist: true,
            history: Some(c.fences().history),
        };
        let sent = now_ms();
        let t0 = Instant::now();
        let resp = client
            .call(|ch| {
                let r = claimed(req.clone(), &identity);
                async move { gangway_proto::limits::agent_client(ch).heartbeat(r).await }
            })
            .await;
        let rtt = t0.elapsed();
        shared.heartbeats.fetch_add(1, Ordering::Relaxed);
        match resp {
            Ok(r) => {
                {
                    keep_sample(&mut shared.rtts_us.lock().expect("rtts"), rtt);
                }
                let r = r.into_inner();
                if !r.known {
                    shared.unknown.fetch_add(1, Ordering::Relaxed);
                    core = None;
                    continue;
                }
                shared.answered_term[i].fetch_max(r.term, Ordering::Relaxed);
                let killed = shared.killed_term.load(Ordering::Relaxed);
                let answer = gangway_node_agent::answer_from(&r);
                for action in c.answered(sent, &answer) {
                    match action {
                        Action::PersistFences => {}
                        Action::Launch(t) => {
                            shared.launches.fetch_add(1, Ordering::Relaxed);
                            shared.task_started(t);
                            if t.0 == shared.gang_job.load(Ordering::Relaxed) {
                                let submitted = shared.gang_submitted_ms.load(Ordering::Relaxed);
                                if now_ms().saturating_sub(submitted) > 1000 {
                                    if shared.poked_ms[i].load(Ordering::Relaxed) > submitted {
                                        shared.gang_late_poked.fetch_add(1, Ordering::Relaxed);
                                    } else {
                                        shared.gang_late_unpoked.fetch_add(1, Ordering::Relaxed);
                                        eprintln!(
                                            "fleet: {name} launched the gang late, unpoked; watch open {} (opened {} times)",
                                            shared.watch_open[i].load(Ordering::Relaxed),
                                            shared.watch_opened[i].load(Ordering::Relaxed)
                                        );
                                    }
                                }
                                shared.gang_launch(r.launch.iter().find(|o| (o.job_id, o.attempt) == t), &name);
                            }
                            if killed != 0 && r.term > killed {
                                let _ = shared.first_launch_after_kill_ms.compare_exchange(
                                    0,
                                    now_ms(),
                                    Ordering::Relaxed,
                                    Ordering::Relaxed,
                                );
                            }
                            let long = r.launch.iter().any(|o| o.job_id == t.0 && o.name == LONG_JOB_NAME);
                            if long {
                                shared.long_launched.fetch_add(1, Ordering::Relaxed);
                            }
                            let runs =
                                if long { Duration::from_secs(FLEET_SECONDS_MAX * 4) } else { run_time(t.0, run_s) };
                            tasks.insert(t, Instant::now() + runs);
                        }
                        // The fleet's jobs are never suspended.
                        Action::Suspend(_) | Action::Resume(_) | Action::Signal { .. } => {}
                        // A stopped timer ends at once, as a task killed by SIGTERM.
                        Action::Stop { task, .. } => {
                            if tasks.remove(&task).is_some() {
                                shared.task_gone(task);
                            }
                            c.task_exited(Exit::ended(task, None, Some(15)));
                        }
                    }
                }
            }
            Err(e) => {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(node = %name, error = %e, "heartbeat failed");
            }
        }
        for action in c.tick(now_ms()) {
            if let Action::Stop { task, .. } = action {
                if tasks.remove(&task).is_some() {
                    shared.task_gone(task);
                }
                c.task_exited(Exit::ended(task, None, Some(15)));
            }
        }
        // As the real agent: an exit to report (a task this answer stopped,
        // whose GPUs a deferred launch waits for) goes out at once, with the
        // heartbeat that brings that launch again.
        let interval = match c.reports_pending() {
            0 => Duration::from_millis(c.heartbeat_interval_ms()),
            _ => Duration::ZERO,
        };
        tokio::select! {
            _ = tokio::time::sleep(interval.saturating_sub(t0.elapsed())) => {}
            _ = poke.notified() => {}
        }
    }
    Ok(())
}

/// Submits `per_s` jobs a second until the run ends.
async fn submitter(client: Arc<Client>, shared: Arc<Shared>, per_s: u64, gpus: u32) -> u64 {
    let mut submitted = 0u64;
    let started = Instant::now();
    while !shared.done.load(Ordering::Relaxed) {
        let due = (started.elapsed().as_secs_f64() * per_s as f64) as u64;
        if submitted >= due {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let gang = submitted.wrapping_mul(0x9E37_79B9) % 1000 < GANGS_PER_MILLE;
        let spec = pb::JobSpec {
            name: "fleet".into(),
            command: vec!["true".into()],
            nodes: Some(if gang { 2 } else { 1 }),
            gpus_per_node: Some(if gang { i64::from(gpus) } else { 1 }),
            time_limit_s: Some(3600),
            ..Default::default()
        };
        if let Err(e) = submit_spec(&client, spec, format!("fleet-{submitted}")).await {
            if shared.errors.fetch_add(1, Ordering::Relaxed) == 0 || submitted == 0 {
                eprintln!("fleet: a submit failed: {}", e.message());
            }
        }
        submitted += 1;
    }
    submitted
}

/// Submits `count` jobs like `spec` (keys `prefix-N`), PRELOAD_CONCURRENCY
/// at a time; returns the first job's id.
async fn preload(clients: &[Arc<Client>], spec: pb::JobSpec, count: u64, prefix: &str) -> anyhow::Result<u64> {
    let next = Arc::new(AtomicU64::new(0));
    let first = Arc::new(AtomicU64::new(u64::MAX));
    let mut workers = Vec::new();
    for k in 0..PRELOAD_CONCURRENCY {
        let (client, spec, next, first) =
            (clients[k % clients.len()].clone(), spec.clone(), next.clone(), first.clone());
        let prefix = prefix.to_string();
        workers.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= count {
                    return Ok::<(), tonic::Status>(());
                }
                let id = submit_spec(&client, spec.clone(), format!("{prefix}-{n}")).await?;
                first.fetch_min(id, Ordering::Relaxed);
            }
        }));
    }
    for w in workers {
        w.await.context("a preloading task")?.context("preloading")?;
    }
    Ok(first.load(Ordering::Relaxed))
}

/// Fills the cluster before the measurement: `running` long one-CPU jobs,
/// waited for until they all run, and `pending` jobs that wait on one of
/// them.
async fn preload_cluster(shared: &Shared, endpoints: &[String], running: u64, pending: u64) -> anyhow::Result<()> {
    // Submitted as a user of their own: one user's unfinished jobs are
    // bounded, and the stream measured next is another user's.
    let clients: Vec<Arc<Client>> = (0..8)
        .map(|_| Client::new(endpoints, PRELOAD_USER, &Security::Insecure).map(Arc::new))
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let long = pb::JobSpec {
        name: LONG_JOB_NAME.into(),
        command: vec!["true".into()],
        time_limit_s: Some(24 * 3600),
        ..Default::default()
    };
    let first = if running > 0 { preload(&clients, long.clone(), running, "fleet-long").await? } else { 0 };
    eprintln!("fleet: {running} long jobs submitted in {:.1} s", started.elapsed().as_secs_f64());
    if pending > 0 {
        let anchor = if running > 0 { first } else { preload(&clients, long, 1, "fleet-anchor").await? };
        let waiting = pb::JobSpec {
            name: "fleet-waiting".into(),
            command: vec!["true".into()],
            dependency: format!("afterok:{anchor}"),
            ..Default::default()
        };
        let t = Instant::now();
        preload(&clients, waiting, pending, "fleet-waiting").await?;
        eprintln!("fleet: {pending} waiting jobs submitted in {:.1} s", t.elapsed().as_secs_f64());
    }
    let t = Instant::now();
    let mut said = Instant::now();
    loop {
        let run_now = shared.long_launched.load(Ordering::Relaxed);
        if run_now >= running {
            eprintln!(
                "fleet: {run_now} long jobs running on their agents, {pending} waiting, {:.1} s after the preload began",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if t.elapsed() > PRELOAD_WAIT {
            bail!("only {run_now} of {running} preloaded jobs started within {} s", PRELOAD_WAIT.as_secs());
        }
        if said.elapsed() > Duration::from_secs(10) {
            eprintln!("fleet: {run_now} of {running} long jobs running");
            said = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A process's CPU time (user + system) and resident memory, from /proc.
fn proc_usage(pid: u32) -> Option<(Duration, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after ") ".
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches(" kB").trim().parse().ok()?;
    Some((Duration::from_millis(ticks * 1000 / hz), rss_kb * 1024))
}

async fn cluster_status(client: &Client) -> anyhow::Result<pb::ClusterStatusResponse> {
    Ok(client.admin_cluster_status(pb::ClusterStatusRequest {}).await?.into_inner())
}

/// The options, within their limits.
fn check(a: &FleetArgs) -> anyhow::Result<()> {
    if a.nodes == 0 || a.nodes > FLEET_NODES_MAX {
        bail!("--nodes: between 1 and {FLEET_NODES_MAX}");
    }
    if a.connections == 0 || a.connections > FLEET_CONNECTIONS_MAX {
        bail!("--connections: between 1 and {FLEET_CONNECTIONS_MAX}");
    }
    if a.seconds == 0 || a.seconds > FLEET_SECONDS_MAX {
        bail!("--seconds: between 1 and {FLEET_SECONDS_MAX}");
    }
    if a.jobs_per_s > FLEET_JOBS_PER_S_MAX {
        bail!("--jobs-per-s: at most {FLEET_JOBS_PER_S_MAX}");
    }
    if a.preload_running + a.preload_pending > PRELOAD_JOBS_MAX {
        bail!("--preload-running and --preload-pending: at most {PRELOAD_JOBS_MAX} jobs in all");
    }
    if a.gang_nodes as usize > a.nodes {
        bail!("--gang-nodes: at most --nodes ({})", a.nodes);
    }
    if a.gpus_per_node == 0 || a.gpus_per_node > gangway_core::limits::GPUS_PER_NODE_MAX {
        bail!("--gpus-per-node: between 1 and {}", gangway_core::limits::GPUS_PER_NODE_MAX);
    }
    Ok(())
}

pub async fn run(a: FleetArgs) -> anyhow::Result<()> {
    check(&a)?;
    let mut cluster = LocalCluster::start(3, a.data_dir.clone())?;
    let endpoints = cluster.endpoints();
    let admin = Client::new(&endpoints, "bench", &Security::Insecure)?;
    let leader = cluster.wait_leader(&admin).await?;
    eprintln!("fleet: 3 replicas up (leader {leader}); starting {} agents", a.nodes);
    let clients: Vec<Arc<Client>> = (0..a.connections)
        .map(|k| {
            Client::new(&endpoints, &format!("agent:pool{k}"), &Security::Insecure).map(|c| Arc::new(c.for_fleet()))
        })
        .collect::<Result<_, _>>()?;
    let shared = Arc::new(Shared {
        stop: (0..a.nodes).map(|_| AtomicBool::new(false)).collect(),
        answered_term: (0..a.nodes).map(|_| AtomicU64::new(0)).collect(),
        poked_ms: (0..a.nodes).map(|_| AtomicU64::new(0)).collect(),
        watch_opened: (0..a.nodes).map(|_| AtomicU64::new(0)).collect(),
        watch_open: (0..a.nodes).map(|_| AtomicBool::new(false)).collect(),
        ..Shared::default()
    });
    let mut agents = Vec::with_capacity(a.nodes);
    for i in 0..a.nodes {
        let (client, shared) = (clients[i % clients.len()].clone(), shared.clone());
        agents.push(tokio::spawn(agent(i, client, shared, a.gpus_per_node, a.run_s)));
    }
    let reg_started = Instant::now();
    let mut said = Instant::now();
    while (shared.registered.load(Ordering::Relaxed) as usize) < a.nodes {
        let (registered, errors) = (shared.registered.load(Ordering::Relaxed), shared.errors.load(Ordering::Relaxed));
        if reg_started.elapsed() > REGISTER_WAIT {
            shared.done.store(true, Ordering::Relaxed);
            bail!(
                "only {registered} of {} agents registered in {} s ({errors} failed calls; logs in {})",
                a.nodes,
                REGISTER_WAIT.as_secs(),
                cluster.root().display()
            );
        }
        if said.elapsed() > Duration::from_secs(10) {
            eprintln!("fleet: {registered} of {} registered, {errors} failed calls", a.nodes);
            said = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let registered_in = reg_started.elapsed();
    if a.preload_running > 0 || a.preload_pending > 0 {
        preload_cluster(&shared, &endpoints, a.preload_running, a.preload_pending).await?;
    }
    eprintln!(
        "fleet: {} agents registered in {:.1} s; measuring {} s",
        a.nodes,
        registered_in.as_secs_f64(),
        a.seconds
    );
    // The measurement window.
    let leader_pid = cluster.children.get(&leader).map(|c| c.id()).context("the leader's process")?;
    let follower_pid = cluster.children.iter().find(|(id, _)| **id != leader).map(|(_, c)| c.id());
    let cpu0 = proc_usage(leader_pid);
    let fcpu0 = follower_pid.and_then(proc_usage);
    let commit0 = cluster_status(&admin).await?.replicas.iter().filter_map(|r| r.commit_index).max().unwrap_or(0);
    {
        shared.rtts_us.lock().expect("rtts").clear();
    }
    let pokes0 = shared.pokes.load(Ordering::Relaxed);
    let (hb0, err0, unknown0) = (
        shared.heartbeats.load(Ordering::Relaxed),
        shared.errors.load(Ordering::Relaxed),
        shared.unknown.load(Ordering::Relaxed),
    );
    let window_started_ms = now_ms();
    let t0 = Instant::now();
    let gang =
        if a.gang_nodes > 0 { Some(submit_gang(&admin, &shared, a.gang_nodes, a.gpus_per_node).await?) } else { None };
    let submit = tokio::spawn(submitter(
        Arc::new(Client::new(&endpoints, "bench", &Security::Insecure)?),
        shared.clone(),
        a.jobs_per_s,
        a.gpus_per_node,
    ));
    // Halfway, a few nodes stop for good: how long until they are Down?
    tokio::time::sleep(Duration::from_secs(a.seconds / 2)).await;
    let stopped: Vec<usize> =
        (0..FLEET_STOPPED_NODES.min(a.nodes)).map(|k| k * a.nodes / FLEET_STOPPED_NODES).collect();
    for &i in &stopped {
        shared.stop[i].store(true, Ordering::Relaxed);
    }
    let stop_at = Instant::now();
    let mut detected: Option<Duration> = None;
    while t0.elapsed() < Duration::from_secs(a.seconds)
        || (detected.is_none() && stop_at.elapsed() < Duration::from_secs(120))
    {
        if detected.is_none() {
            let nodes = admin.list_nodes(false).await.unwrap_or_default();
            let down = nodes.iter().filter(|n| n.state == pb::NodeState::Down as i32).map(|n| n.name.clone());
            let down: std::collections::BTreeSet<String> = down.collect();
            if stopped.iter().all(|i| down.contains(&node_name(*i))) {
                detected = Some(stop_at.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let window = t0.elapsed();
    let (hb1, err1, pokes1, unknown1) = (
        shared.heartbeats.load(Ordering::Relaxed),
        shared.errors.load(Ordering::Relaxed),
        shared.pokes.load(Ordering::Relaxed),
        shared.unknown.load(Ordering::Relaxed),
    );
    let mut rtts: Vec<Duration> =
        shared.rtts_us.lock().expect("rtts").drain(..).map(|us| Duration::from_micros(u64::from(us))).collect();
    rtts.sort_unstable();
    let cpu1 = proc_usage(leader_pid);
    let fcpu1 = follower_pid.and_then(proc_usage);
    let commit1 = cluster_status(&admin).await?.replicas.iter().filter_map(|r| r.commit_index).max().unwrap_or(0);
    let failover =
        if a.failover { Some(failover(&mut cluster, &admin, &shared, leader, &stopped).await?) } else { None };
    shared.done.store(true, Ordering::Relaxed);
    let submitted = submit.await.unwrap_or(0);
    for h in agents {
        if let Ok(Err(e)) = h.await {
            eprintln!("fleet: an agent failed: {e:#}");
        }
    }
    // Nodes that were never stopped but are Down: false node failures.
    let nodes = admin.list_nodes(false).await?;
    let false_down = nodes
        .iter()
        .filter(|n| n.state == pb::NodeState::Down as i32 && !stopped.iter().any(|i| node_name(*i) == n.name))
        .count();
    let jobs = all_jobs(&admin).await?;
    let mut waits: Vec<Duration> = jobs
        .iter()
        .filter(|j| j.submit_time_ms >= window_started_ms)
        .filter_map(|j| j.start_time_ms.map(|s| Duration::from_millis(s.saturating_sub(j.submit_time_ms))))
        .collect();
    waits.sort_unstable();
    let started_in_window = jobs.iter().filter(|j| j.start_time_ms.is_some_and(|s| s >= window_started_ms)).count();
    let secs = window.as_secs_f64();
    let cpu = |a: Option<(Duration, u64)>, b: Option<(Duration, u64)>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2} cores, {} MiB resident", (b.0 - a.0).as_secs_f64() / secs, b.1 >> 20),
        _ => "unknown".into(),
    };
    let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1000.0);
    println!("## gangway bench fleet: {} nodes × {} GPUs, {:.0} s", a.nodes, a.gpus_per_node, secs);
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    println!("| agents registered in | {:.1} s |", registered_in.as_secs_f64());
    println!(
        "| heartbeats | {:.0}/s, round trip p50 {} p99 {} max {} |",
        (hb1 - hb0) as f64 / secs,
        ms(percentile(&rtts, 0.5)),
        ms(percentile(&rtts, 0.99)),
        ms(rtts.last().copied().unwrap_or_default())
    );
    println!("| failed calls | {} |", err1 - err0);
    println!("| pokes on WatchNode streams | {:.0}/s |", (pokes1 - pokes0) as f64 / secs);
    println!("| answers \"unknown node\" (re-registrations) | {} |", unknown1 - unknown0);
    println!("| leader | {} |", cpu(cpu0, cpu1));
    println!("| a follower | {} |", cpu(fcpu0, fcpu1));
    println!("| Raft entries committed | {:.0}/s |", commit1.saturating_sub(commit0) as f64 / secs);
    println!("| jobs submitted | {submitted} ({:.0}/s) |", submitted as f64 / secs);
    println!("| jobs started | {started_in_window} ({:.0}/s) |", started_in_window as f64 / secs);
    println!(
        "| submit → start | p50 {} p99 {} (of {} started) |",
        ms(percentile(&waits, 0.5)),
        ms(percentile(&waits, 0.99)),
        waits.len()
    );
    println!(
        "| task launches / exits reported | {} / {} |",
        shared.launches.load(Ordering::Relaxed),
        shared.exits.load(Ordering::Relaxed)
    );
    println!("| nodes wrongly declared down | {false_down} |");
    println!(
        "| a stopped node declared down after | {} (timeout 30 s) |",
        detected.map_or("not within 120 s".to_string(), |d| format!("{:.1} s", d.as_secs_f64()))
    );
    println!("| a job launched while another attempt of it ran | {} |", shared.overlaps.load(Ordering::Relaxed));
    if let Some((job_id, submitted_ms)) = gang {
        let job = admin
            .call(|ch| {
                let r = admin.request(pb::GetJobRequest { job_id, stale: false });
                async move { JobServiceClient::new(ch).get(r).await }
            })
            .await?
            .into_inner();
        let after = |t: u64| format!("{:.2} s", t.saturating_sub(submitted_ms) as f64 / 1000.0);
        println!(
            "| a {}-node gang placed after | {} |",
            a.gang_nodes,
            job.start_time_ms.map_or("not placed".into(), after)
        );
        let mut launches = shared.gang_launch_ms.lock().expect("gang launches").clone();
        launches.sort_unstable();
        let pick = |p: f64| launches.get(((launches.len() as f64 - 1.0) * p).round() as usize).copied();
        let all = launches.last().copied().filter(|_| launches.len() >= a.gang_nodes as usize);
        println!(
            "| its task launched on every node after | {} ({} of {} launched; p50 {}, p99 {}) |",
            all.map_or("not yet".to_string(), after),
            launches.len(),
            a.gang_nodes,
            pick(0.5).map_or("-".into(), after),
            pick(0.99).map_or("-".into(), after),
        );
        println!(
            "| its launches later than 1 s: poked after the submit / never poked | {} / {} |",
            shared.gang_late_poked.load(Ordering::Relaxed),
            shared.gang_late_unpoked.load(Ordering::Relaxed)
        );
        println!(
            "| its nodes (1 in {GANG_ENV_SAMPLE}) whose SLURM_JOB_NODELIST named the whole gang | {} (wrong: {}) |",
            shared.gang_env_ok.load(Ordering::Relaxed),
            shared.gang_env_bad.load(Ordering::Relaxed)
        );
    }
    if let Some(f) = failover {
        let secs = |d: Option<Duration>| {
            d.map_or(format!("not within {} s", FAILOVER_WAIT.as_secs()), |d| format!("{:.2} s", d.as_secs_f64()))
        };
        println!("| failover: a new leader elected after | {} |", secs(f.elected));
        println!("| failover: every live agent answered by it after | {} |", secs(f.fleet_moved));
        println!("| failover: its first launch after | {} |", secs(f.first_launch));
        println!(
            "| failover: failed calls / re-registrations | {} / {} |",
            shared.errors.load(Ordering::Relaxed) - err1,
            shared.unknown.load(Ordering::Relaxed) - unknown1
        );
        let mut during: Vec<Duration> =
            shared.rtts_us.lock().expect("rtts").iter().map(|us| Duration::from_micros(u64::from(*us))).collect();
        during.sort_unstable();
        println!(
            "| failover: heartbeat round trip from the kill on | p50 {} p99 {} max {} |",
            ms(percentile(&during, 0.5)),
            ms(percentile(&during, 0.99)),
            ms(during.last().copied().unwrap_or_default())
        );
    }
    Ok(())
}

/// Submits one gang of `nodes` whole nodes; returns its job id and when it
/// was submitted (wall ms).
async fn submit_gang(admin: &Client, shared: &Shared, nodes: u32, gpus: u32) -> anyhow::Result<(u64, u64)> {
    let spec = pb::JobSpec {
        name: "fleet-gang".into(),
        command: vec!["true".into()],
        nodes: Some(i64::from(nodes)),
        gpus_per_node: Some(i64::from(gpus)),
        time_limit_s: Some(3600),
        ..Default::default()
    };
    let submitted_ms = now_ms();
    shared.gang_submitted_ms.store(submitted_ms, Ordering::Relaxed);
    shared.gang_nodes.store(u64::from(nodes), Ordering::Relaxed);
    let job_id = submit_spec(admin, spec, "fleet-gang".into()).await.context("submitting the big gang")?;
    shared.gang_job.store(job_id, Ordering::Relaxed);
    eprintln!("fleet: submitted a {nodes}-node gang (job {job_id})");
    Ok((job_id, submitted_ms))
}

/// What the failover phase measured, from the moment the leader was killed.
struct Failover {
    elected: Option<Duration>,
    fleet_moved: Option<Duration>,
    first_launch: Option<Duration>,
}

/// Kills the leader and waits until a new one is elected, every live agent
/// has been answered by it, and it has ordered a launch.
async fn failover(
    cluster: &mut LocalCluster,
    admin: &Client,
    shared: &Shared,
    leader: u64,
    stopped: &[usize],
) -> anyhow::Result<Failover> {
    let status = cluster_status(admin).await?;
    let term = status.replicas.iter().find(|r| r.id == leader).map_or(0, |r| r.term).max(1);
    shared.killed_term.store(term, Ordering::Relaxed);
    eprintln!("fleet: killing the leader (replica {leader}, term {term})");
    let killed_ms = now_ms();
    let kill_at = Instant::now();
    cluster.kill(leader);
    let live: Vec<usize> = (0..shared.stop.len()).filter(|i| !stopped.contains(i)).collect();
    let (mut elected, mut fleet_moved) = (None, None);
    while kill_at.elapsed() < FAILOVER_WAIT {
        if elected.is_none() {
            if let Ok(s) = cluster_status(admin).await {
                let new = s.replicas.iter().any(|r| {
                    r.id != leader && r.term > term && r.replica_role() == Some(gangway_proto::ReplicaRole::Leader)
                });
                if new {
                    elected = Some(kill_at.elapsed());
                }
            }
        }
        if fleet_moved.is_none() && live.iter().all(|i| shared.answered_term[*i].load(Ordering::Relaxed) > term) {
            fleet_moved = Some(kill_at.elapsed());
        }
        if elected.is_some() && fleet_moved.is_some() && shared.first_launch_after_kill_ms.load(Ordering::Relaxed) != 0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = shared.first_launch_after_kill_ms.load(Ordering::Relaxed);
    let first_launch = (first != 0).then(|| Duration::from_millis(first.saturating_sub(killed_ms)));
    Ok(Failover { elected, fleet_moved, first_launch })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A round sends REPORTS_PER_ROUND_MAX exits, oldest first; the one
    /// past waits for the next. RTT_SAMPLES_MAX round trips are kept.
    #[test]
    fn fleet_agents_bound_their_reports_and_samples() {
        let mut c = AgentCore::new(Fences::default(), STOP_GRACE_MS, 0);
        for job in 0..=REPORTS_PER_ROUND_MAX as u64 {
            c.task_exited(Exit::ended((job, 1), Some(0), None));
        }
        let round = round_reports(&mut c);
        assert_eq!(round.len(), REPORTS_PER_ROUND_MAX);
        assert_eq!(round.first().map(|e| e.task), Some((0, 1)));
        assert_eq!(c.reports_pending(), 1, "one past waits");
        assert_eq!(round_reports(&mut c).len(), 1);
        let mut rtts = vec![0; RTT_SAMPLES_MAX - 1];
        keep_sample(&mut rtts, Duration::from_micros(7));
        assert_eq!(rtts.last(), Some(&7));
        keep_sample(&mut rtts, Duration::from_micros(8));
        assert_eq!(rtts.len(), RTT_SAMPLES_MAX, "one past is only counted");
        assert_eq!(REGISTER.attempts, REGISTER_ATTEMPTS_MAX);
        assert!(REGISTER.span() >= REGISTER_WAIT, "an agent retries as long as the fleet may take to register");
    }

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: FleetArgs,
    }

    /// Each option is taken at its limit and refused one past it, the
    /// refusal naming the option and the limit.
    #[test]
    fn fleet_options_stop_at_their_limits() {
        let check_of = |args: &[String]| {
            let argv = std::iter::once("fleet".to_string()).chain(args.iter().cloned());
            check(&Cmd::try_parse_from(argv).expect("options parse").a)
        };
        let cases: [(&str, u64, &[&str]); 5] = [
            ("--nodes", FLEET_NODES_MAX as u64, &[]),
            ("--connections", FLEET_CONNECTIONS_MAX as u64, &[]),
            ("--seconds", FLEET_SECONDS_MAX, &[]),
            ("--jobs-per-s", FLEET_JOBS_PER_S_MAX, &[]),
            ("--preload-running", PRELOAD_JOBS_MAX, &["--preload-pending", "0"]),
        ];
        for (option, limit, more) in cases {
            let with = |v: u64| {
                let mut args = vec![option.to_string(), v.to_string()];
                args.extend(more.iter().map(|s| s.to_string()));
                check_of(&args)
            };
            assert!(with(limit).is_ok(), "{option} {limit}: {:?}", with(limit));
            let e = with(limit + 1).expect_err("one past the limit is taken").to_string();
            assert!(e.starts_with(option) && e.contains(&limit.to_string()), "{e}");
        }
    }
}
