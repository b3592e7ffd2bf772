//! `gangway bench storm`: hostile load against a real cluster (issue 32).
//!
//! A 3-replica cluster of real controller processes with mutual TLS, a
//! fleet of simulated agents heartbeating (each with its own agent
//! certificate and connection), and one well-behaved user who submits and
//! lists, while each attack runs in turn:
//!
//! - `quiet`: nothing else (the baseline);
//! - `poll`: a thousand clients of one user polling squeue's listing over
//!   the held jobs, as array tasks running `squeue` in a loop do;
//! - `crafted`: the requests that stopped or stalled replicas before (a List
//!   past the last id, a List naming a state eight million times),
//!   maximum-size specs, explains on every follower, a thousand event
//!   streams from the oldest index;
//! - `idle`: thousands of TLS connections without a certificate that say
//!   nothing, and large anonymous Raft messages;
//! - `flood`: a user writing at the write limit with fresh idempotency keys.
//!
//! One table: per attack, the heartbeats' p99, the good user's submit and
//! list p99, nodes wrongly declared down (every agent stays alive), agents
//! that went longer than their self-fence window without an answer, replica
//! restarts (a replica that exits is restarted and counted), each replica's
//! peak RSS, and the attack's requests refused of those sent.
//! `--controller-exe` runs another build's controllers (the before column).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::tls::{Credentials, Principal, Role, Security, TlsFiles};
use gangway_proto::v1 as pb;
use gangway_proto::v1::job_service_client::JobServiceClient;
use tonic::Code;

use crate::bench::{percentile, LocalCluster};

/// Agents the storm runs at most (each its own certificate and connection).
const STORM_AGENTS_MAX: usize = 5_000;
/// Polling clients at most.
const STORM_CLIENTS_MAX: usize = 10_000;
/// Idle connections at most (file descriptors: the machine's limit is 20,000).
const STORM_IDLE_MAX: usize = 15_000;
/// Held jobs preloaded at most.
const STORM_JOBS_MAX: u64 = 200_000;
/// Seconds per attack at most.
const STORM_SECONDS_MAX: u64 = 600;
/// Connections the polling clients share: many calls multiplexed on each,
/// as a login node's or a job's processes would open.
const POLL_CONNECTIONS: usize = 64;
/// Submits in flight while preloading.
const PRELOAD_CONCURRENCY: usize = 64;
/// Idle connections being opened at once.
const IDLE_OPENING_AT_ONCE: usize = 256;
/// The size of each anonymous Raft message in the `idle` attack.
const ANONYMOUS_MESSAGE_BYTES: usize = 64 << 20;
/// Tasks sending anonymous Raft messages.
const ANONYMOUS_SENDERS: usize = 4;
/// Worker threads of the attackers' own runtime: their tasks never queue on
/// a worker the fleet or the good user needs, as clients on other hosts
/// would not (they still share the machine's two cores with everything).
const ATTACKER_THREADS: usize = 2;
/// Idle connections from one attacking host in the `idle` attack: they
/// come from many hosts (loopback addresses 127.0.2.1 and on, in ten /24
/// networks), as a botnet's would, not from the fleet's own address.
const IDLE_PER_HOST: usize = 250;
/// Writers in the `flood` attack.
const FLOOD_WRITERS: usize = 16;
/// A state named this many times in one crafted List (the 8 MB request).
const CRAFTED_STATES: usize = 8_000_000;
/// The largest script a spec may carry (the 2 MiB spec limit holds it and
/// the rest of the spec).
const CRAFTED_SCRIPT_BYTES: usize = gangway_core::limits::SCRIPT_BYTES_MAX;
/// Event streams from the oldest index in the `crafted` attack.
const CRAFTED_STREAMS: usize = 1_000;
/// How long the cluster runs with only the fleet and the good user before
/// the attack: the memory baseline.
const IDLE_BASELINE: Duration = Duration::from_secs(5);
/// The good user's pause between rounds (a submit and a listing).
const GOOD_PAUSE: Duration = Duration::from_millis(100);
/// How often replicas' processes are checked (exits) and sampled (RSS).
const SAMPLE_EVERY: Duration = Duration::from_millis(250);
/// The longest wait a refused caller honours before asking again.
const HINT_MAX: Duration = Duration::from_secs(5);
/// One call's deadline in the benchmark.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Args, Debug)]
pub struct StormArgs {
    /// Simulated agents heartbeating throughout.
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    /// Held jobs in the queue the listings read.
    #[arg(long, default_value_t = 20_000)]
    jobs: u64,
    /// Polling clients in the `poll` attack.
    #[arg(long, default_value_t = 1000)]
    clients: usize,
    /// Idle TLS connections without a certificate in the `idle` attack.
    #[arg(long, default_value_t = 10_000)]
    idle: usize,
    /// Seconds each attack (and the quiet baseline) runs.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// The attacks, in order.
    #[arg(long, value_delimiter = ',', default_value = "quiet,poll,crafted,idle,flood",
          value_parser = ["quiet", "poll", "crafted", "idle", "flood"])]
    attacks: Vec<String>,
    /// Run this build's controllers instead of this binary (the agents, the
    /// users and the attacks are always this binary's).
    #[arg(long)]
    controller_exe: Option<PathBuf>,
    /// Keep the cluster's data and logs here instead of a temp dir.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The parts of the `crafted` attack to run (to tell what each costs).
    #[arg(long, value_delimiter = ',', default_value = "lists,specs,explains,streams",
          value_parser = ["lists", "specs", "explains", "streams"])]
    crafted: Vec<String>,
    /// The CPU the attackers' threads get on this machine: `spare` (the
    /// lowest priority, nice 19: what the cluster, the fleet and the good
    /// user leave, as attackers on hosts of their own would take none of
    /// theirs) or
    /// `equal` (the same share as every other thread: on a small machine the
    /// attackers' own work then slows the cluster as much as what they send).
    #[arg(long, default_value = "spare", value_parser = ["spare", "equal"])]
    attacker_cpu: String,
}

/// What happened when, for the table (each phase is a time window).
#[derive(Default)]
struct Meter {
    started: Option<Instant>,
    /// (ms since start, heartbeat round trip µs)
    heartbeats: Mutex<Vec<(u64, u32)>>,
    /// (ms, submit µs) and (ms, list µs) of the good user; failures as u32::MAX.
    submits: Mutex<Vec<(u64, u32)>>,
    lists: Mutex<Vec<(u64, u32)>>,
    /// (ms, agent) of answers saying the node is unknown or down.
    downs: Mutex<Vec<(u64, usize)>>,
    /// (ms, agent) of answers that came later than the agent's self-fence
    /// window after the one before.
    fenced: Mutex<Vec<(u64, usize)>>,
    /// Each agent's last answered heartbeat (ms), and its self-fence window.
    last_ok: Mutex<BTreeMap<usize, u64>>,
    fence_ms: AtomicU64,
    /// (ms, replica) of replica processes that exited.
    exits: Mutex<Vec<(u64, u64)>>,
    /// (ms, replica, RSS bytes)
    rss: Mutex<Vec<(u64, u64, u64)>>,
    /// Why the fleet's and the good user's calls failed (the first words of
    /// each message), with counts.
    failures: Mutex<BTreeMap<String, u64>>,
    /// The running attack's requests sent and refused.
    sent: AtomicU64,
    refused: AtomicU64,
    /// The attack's tasks stop.
    attack_over: AtomicBool,
    /// Everything stops.
    done: AtomicBool,
}

impl Meter {
    fn failed(&self, who: &str, s: &tonic::Status) {
        let words: String = s.message().split_whitespace().take(8).collect::<Vec<_>>().join(" ");
        let mut f = self.failures.lock().expect("failures");
        if f.len() < 64 || f.contains_key(&format!("{who}: {:?} {words}", s.code())) {
            *f.entry(format!("{who}: {:?} {words}", s.code())).or_default() += 1;
        }
    }

    fn ms(&self) -> u64 {
        self.started.map_or(0, |s| u64::try_from(s.elapsed().as_millis()).unwrap_or(u64::MAX))
    }
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX - 1)
}

/// One row of the table.
struct Row {
    attack: String,
    heartbeat_p99: Duration,
    heartbeats: usize,
    submit_p99: Duration,
    /// The good user's answered submits the p99 is of (a p99 over ~180 is
    /// the second-slowest: one slow moment moves it).
    submits: usize,
    submit_failed: usize,
    list_p99: Duration,
    list_failed: usize,
    downs: usize,
    fenced: usize,
    restarts: usize,
    peak_rss_mb: BTreeMap<u64, u64>,
    idle_rss_mb: BTreeMap<u64, u64>,
    /// CPU seconds during the attack: each replica's, and the attackers'.
    replica_cpu_s: BTreeMap<u64, f64>,
    attacker_cpu_s: f64,
    sent: u64,
    refused: u64,
}

fn p99_of(samples: &[(u64, u32)], from: u64, to: u64) -> (Duration, usize, usize) {
    let mut ok: Vec<Duration> = Vec::new();
    let mut failed = 0;
    for (t, us) in samples {
        if *t >= from && *t < to {
            if *us == u32::MAX {
                failed += 1;
            } else {
                ok.push(Duration::from_micros(u64::from(*us)));
            }
        }
    }
    ok.sort_unstable();
    (percentile(&ok, 0.99), ok.len(), failed)
}

/// The options, within their limits.
fn check(a: &StormArgs) -> anyhow::Result<()> {
    anyhow::ensure!((1..=STORM_AGENTS_MAX).contains(&a.agents), "agents: 1 to {STORM_AGENTS_MAX}");
    anyhow::ensure!((1..=STORM_CLIENTS_MAX).contains(&a.clients), "clients: 1 to {STORM_CLIENTS_MAX}");
    anyhow::ensure!(a.idle <= STORM_IDLE_MAX, "idle: at most {STORM_IDLE_MAX}");
    anyhow::ensure!(a.jobs <= STORM_JOBS_MAX, "jobs: at most {STORM_JOBS_MAX}");
    anyhow::ensure!((1..=STORM_SECONDS_MAX).contains(&a.seconds), "seconds: 1 to {STORM_SECONDS_MAX}");
    Ok(())
}

pub async fn run(a: StormArgs) -> anyhow::Result<()> {
    check(&a)?;
    // Each attack on a cluster of its own: memory a replica took in one
    // attack is not charged to the next.
    let mut rows = Vec::new();
    for attack in &a.attacks {
        rows.push(run_attack(&a, attack).await?);
    }
    print_table(&rows, &a);
    Ok(())
}

/// One attack on a fresh cluster: the cluster, the queue, the fleet and the
/// good user, an idle moment for the memory baseline, then the attack.
async fn run_attack(a: &StormArgs, attack: &str) -> anyhow::Result<Row> {
    let mut principals: Vec<Principal> = ["good", "poller", "crafted", "flood"]
        .iter()
        .map(|n| Principal::new(Role::Client, n))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    for i in 0..a.agents {
        principals.push(Principal::new(Role::Agent, &node_name(i)).map_err(anyhow::Error::msg)?);
    }
    eprintln!("storm: {attack}: a cluster, certificates for {} agents and 4 users", a.agents);
    let data_dir = a.data_dir.as_ref().map(|d| d.join(attack));
    let cluster = LocalCluster::start_mtls_with(3, data_dir, &principals, a.controller_exe.clone())?;
    let tls = cluster.tls_dir().context("an mTLS cluster has a certificates directory")?.to_path_buf();
    let admin = Client::new(&cluster.endpoints(), "bench", cluster.security())?;
    let leader = cluster.wait_leader(&admin).await?;
    let endpoints = cluster.endpoints_leader_first(leader);
    let peer_endpoints = cluster.peer_endpoints();
    let admin = Client::new(&endpoints, "bench", cluster.security())?;
    let user = |name: &str| -> anyhow::Result<Client> {
        let creds = Credentials::load(TlsFiles::in_dir(&tls, &format!("client-{name}"))).map_err(anyhow::Error::msg)?;
        Ok(Client::new(&endpoints, name, &Security::Tls(creds))?.from_address(user_host(name))?)
    };
    let pids: BTreeMap<u64, u32> = cluster.children.iter().map(|(id, c)| (*id, c.id())).collect();
    let cluster = Arc::new(Mutex::new(cluster));

    eprintln!("storm: {attack}: preloading {} held jobs", a.jobs);
    preload(&admin, a.jobs).await?;

    let meter = Arc::new(Meter { started: Some(Instant::now()), ..Default::default() });
    let watcher = tokio::spawn(watch_replicas(cluster.clone(), meter.clone(), pids));
    eprintln!("storm: {attack}: starting {} agents", a.agents);
    let mut agents = Vec::new();
    for i in 0..a.agents {
        let creds = Credentials::load(TlsFiles::in_dir(&tls, &format!("agent-{}", node_name(i))))
            .map_err(anyhow::Error::msg)?;
        let client = Client::new(&endpoints, "agent", &Security::Tls(creds))?.from_address(agent_host(i))?.for_fleet();
        agents.push(tokio::spawn(agent(i, client, meter.clone())));
    }
    wait_registered(&admin, a.agents).await?;
    let good = tokio::spawn(good_user(user("good")?, meter.clone()));
    // An idle moment (the fleet heartbeating, the good user working): the
    // memory baseline.
    let idle_from = meter.ms();
    tokio::time::sleep(IDLE_BASELINE).await;
    let idle_rss = peak_rss(&meter, idle_from, meter.ms());

    eprintln!("storm: {attack}: attacking for {} s", a.seconds);
    let from = meter.ms();
    let cpu_from = cpu_seconds_of(&pids_now(&cluster));
    let attacker_tids: Arc<Mutex<Vec<i32>>> = Arc::default();
    let (tids, spare) = (attacker_tids.clone(), a.attacker_cpu == "spare");
    let attackers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(ATTACKER_THREADS)
        .thread_name("storm-attacker")
        .on_thread_start(move || {
            let Some(tid) = this_thread_id() else { return };
            tids.lock().expect("attacker tids").push(tid);
            if spare {
                lowest_priority(tid);
            }
        })
        .enable_all()
        .build()?;
    let tasks: Vec<tokio::task::JoinHandle<()>> = match attack {
        "quiet" => Vec::new(),
        "poll" => {
            let _on = attackers.enter();
            poll(user("poller")?, a.clients, &meter)
        }
        "crafted" => {
            let (client, endpoints, m) = (user("crafted")?, endpoints.clone(), meter.clone());
            let parts = a.crafted.clone();
            attackers.spawn(async move { crafted(client, &endpoints, &parts, &m).await }).await?
        }
        "idle" => {
            // The peer ports (where the build has them) get their share.
            let targets: Vec<String> = endpoints.iter().cloned().chain(peer_endpoints.iter().cloned()).collect();
            let _on = attackers.enter();
            idle(&targets, &tls, a.idle, &meter)?
        }
        "flood" => {
            let _on = attackers.enter();
            (0..FLOOD_WRITERS).map(|w| tokio::spawn(flood(user("flood").ok(), w, meter.clone()))).collect()
        }
        other => anyhow::bail!("attack: {other} is not one of quiet, poll, crafted, idle, flood"),
    };
    tokio::time::sleep(Duration::from_secs(a.seconds)).await;
    meter.attack_over.store(true, Ordering::SeqCst);
    let cpu_to = cpu_seconds_of(&pids_now(&cluster));
    let attacker_cpu_s: f64 = attacker_tids
        .lock()
        .expect("attacker tids")
        .iter()
        .filter_map(|tid| cpu_seconds(&format!("/proc/self/task/{tid}/stat")))
        .sum();
    for t in tasks {
        t.abort();
    }
    attackers.shutdown_background();
    let to = meter.ms();
    meter.done.store(true, Ordering::SeqCst);
    good.abort();
    for t in agents {
        t.abort();
    }
    watcher.abort();
    let mut row = row(attack, &meter, from, to);
    row.idle_rss_mb = idle_rss;
    row.attacker_cpu_s = attacker_cpu_s;
    row.replica_cpu_s = cpu_to
        .iter()
        .map(|(id, to)| (*id, to - cpu_from.get(id).copied().filter(|f| f <= to).unwrap_or(0.0)))
        .collect();
    for (why, n) in meter.failures.lock().expect("failures").iter() {
        eprintln!("storm: {attack}: {n} × {why}");
    }
    Ok(row)
}

/// Each replica's peak RSS (MB) between `from` and `to`.
fn peak_rss(meter: &Meter, from: u64, to: u64) -> BTreeMap<u64, u64> {
    let mut peak: BTreeMap<u64, u64> = BTreeMap::new();
    for (t, id, b) in meter.rss.lock().expect("rss").iter() {
        if *t >= from && *t < to {
            let e = peak.entry(*id).or_default();
            *e = (*e).max(b >> 20);
        }
    }
    peak
}

fn node_name(i: usize) -> String {
    format!("storm-{i:05}")
}

/// Submits `count` held jobs as the admin (not write-limited).
async fn preload(admin: &Client, count: u64) -> anyhow::Result<()> {
    use futures::StreamExt;
    let spec = pb::JobSpec { command: vec!["true".into()], hold: true, workdir: "/tmp".into(), ..Default::default() };
    let results: Vec<anyhow::Result<u64>> = futures::stream::iter(0..count)
        .map(|i| {
            let spec = spec.clone();
            async move {
                crate::bench::submit_spec(admin, spec, format!("storm-preload-{i}"))
                    .await
                    .map_err(|s| anyhow::anyhow!("preload: {}", s.message()))
            }
        })
        .buffer_unordered(PRELOAD_CONCURRENCY)
        .collect()
        .await;
    for r in results {
        r?;
    }
    Ok(())
}

/// Every `SAMPLE_EVERY`: replicas that exited are counted and started again;
/// each live replica's RSS is recorded.
async fn watch_replicas(cluster: Arc<Mutex<LocalCluster>>, meter: Arc<Meter>, mut pids: BTreeMap<u64, u32>) {
    while !meter.done.load(Ordering::Relaxed) {
        let exited: Vec<u64> = {
            let mut c = cluster.lock().expect("cluster");
            let ids: Vec<u64> = c.children.keys().copied().collect();
            ids.into_iter()
                .filter(|id| c.children.get_mut(id).is_some_and(|ch| matches!(ch.try_wait(), Ok(Some(_)))))
                .collect()
        };
        for id in exited {
            meter.exits.lock().expect("exits").push((meter.ms(), id));
            eprintln!("storm: replica {id} exited; restarting it");
            let mut c = cluster.lock().expect("cluster");
            c.children.remove(&id);
            if c.respawn(id).is_ok() {
                if let Some(ch) = c.children.get(&id) {
                    pids.insert(id, ch.id());
                }
            }
        }
        for (id, pid) in &pids {
            if let Some(rss) = rss_bytes(*pid) {
                meter.rss.lock().expect("rss").push((meter.ms(), *id, rss));
            }
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

/// The replicas' processes now (a restarted one has a new pid).
fn pids_now(cluster: &Mutex<LocalCluster>) -> BTreeMap<u64, u32> {
    cluster.lock().expect("cluster").children.iter().map(|(id, c)| (*id, c.id())).collect()
}

/// Each process's CPU seconds so far (user and system).
fn cpu_seconds_of(pids: &BTreeMap<u64, u32>) -> BTreeMap<u64, f64> {
    pids.iter().filter_map(|(id, pid)| Some((*id, cpu_seconds(&format!("/proc/{pid}/stat"))?))).collect()
}

/// User plus system CPU seconds from a /proc `stat` file (a process's or a
/// thread's): fields 14 and 15, counted after the command name's `)`.
fn cpu_seconds(path: &str) -> Option<f64> {
    let ticks = cpu_ticks(&std::fs::read_to_string(path).ok()?)?;
    let per_s = rustix::param::clock_ticks_per_second().max(1);
    Some(ticks as f64 / per_s as f64)
}

/// utime + stime of a /proc `stat` line. The command name (field 2) may
/// hold spaces and parentheses, so fields are counted after its last `)`:
/// state is field 3, so utime (14) and stime (15) sit at 11 and 12 there.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let rest = stat.get(stat.rfind(')')?.checked_add(1)?..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()?.saturating_add(fields.get(12)?.parse::<u64>().ok()?))
}

/// The calling thread's id, from /proc/thread-self (a link to PID/task/TID).
fn this_thread_id() -> Option<i32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// Gives thread `tid` the lowest priority (nice 19): on Linux a thread's nice
/// value is its own, and at 19 it weighs 15 against an ordinary thread's 1,024,
/// so it runs on what the others leave.
fn lowest_priority(tid: i32) {
    let set = rustix::process::Pid::from_raw(tid).map(|pid| rustix::process::setpriority_process(Some(pid), 19));
    if !matches!(set, Some(Ok(()))) {
        eprintln!("storm: could not lower an attacker thread's priority: {set:?}");
    }
}

/// A process's resident set, from /proc.
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb.saturating_mul(1024))
}

/// Waits until `n` nodes are registered.
async fn wait_registered(admin: &Client, n: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let nodes = admin.list_nodes(true).await.map(|v| v.len()).unwrap_or(0);
        if nodes >= n {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "only {nodes} of {n} agents registered");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A simulated agent: registers, then heartbeats at the interval the leader
/// asks, recording each answer's round trip, answers that say the node is
/// down, and gaps between answers longer than its self-fence window.
async fn agent(i: usize, client: Client, meter: Arc<Meter>) {
    let name = node_name(i);
    let register = pb::RegisterRequest { name: name.clone(), cpus: 64, mem_mb: 512 * 1024, ..Default::default() };
    let (mut interval, mut fence_ms) = (Duration::from_secs(1), 15_000u64);
    let mut registered = false;
    let mut last_ok: Option<u64> = None;
    while !meter.done.load(Ordering::Relaxed) {
        if !registered {
            let r = client
                .call(|ch| {
                    let r = client.request(register.clone());
                    async move { gangway_proto::limits::agent_client(ch).register(r).await }
                })
                .await;
            match r {
                Ok(r) => {
                    let r = r.into_inner();
                    interval = Duration::from_millis(r.heartbeat_interval_ms.max(100));
                    fence_ms = r.node_down_timeout_ms / 2;
                    meter.fence_ms.store(fence_ms, Ordering::Relaxed);
                    registered = true;
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            }
        }
        let hb = pb::HeartbeatRequest { name: name.clone(), ..Default::default() };
        let t0 = Instant::now();
        let mut req = client.request(hb);
        req.set_timeout(CALL_TIMEOUT);
        let ch = client.channels()[0].clone();
        // One attempt to the leader, as the clock of the self-fence sees it.
        let r = gangway_proto::limits::agent_client(ch).heartbeat(req).await;
        let rtt = t0.elapsed();
        let now = meter.ms();
        match r {
            Ok(resp) => {
                let resp = resp.into_inner();
                if !resp.known {
                    meter.downs.lock().expect("downs").push((now, i));
                    registered = false;
                }
                meter.heartbeats.lock().expect("heartbeats").push((now, micros(rtt)));
                if let Some(prev) = last_ok {
                    if now.saturating_sub(prev) > fence_ms {
                        meter.fenced.lock().expect("fenced").push((now, i));
                    }
                }
                last_ok = Some(now);
                meter.last_ok.lock().expect("last ok").insert(i, now);
                if resp.heartbeat_interval_ms > 0 {
                    interval = Duration::from_millis(resp.heartbeat_interval_ms);
                }
            }
            Err(s) => {
                meter.failed("heartbeat", &s);
                meter.heartbeats.lock().expect("heartbeats").push((now, u32::MAX));
            }
        }
        tokio::time::sleep(interval.saturating_sub(rtt)).await;
    }
}

/// The well-behaved user: a held job submitted and its own queue listed,
/// over and over, each timed (through the client library, as `sbatch` and
/// `squeue` would).
async fn good_user(client: Client, meter: Arc<Meter>) {
    let spec = pb::JobSpec { command: vec!["true".into()], hold: true, workdir: "/tmp".into(), ..Default::default() };
    let mut n = 0u64;
    while !meter.done.load(Ordering::Relaxed) {
        n = n.saturating_add(1);
        let t0 = Instant::now();
        let r = crate::bench::submit_spec(&client, spec.clone(), format!("good-{n}")).await;
        if let Err(s) = &r {
            meter.failed("good submit", s);
        }
        let ok = r.is_ok();
        let took = if ok { micros(t0.elapsed()) } else { u32::MAX };
        meter.submits.lock().expect("submits").push((meter.ms(), took));
        let t0 = Instant::now();
        let listing = crate::slurm::Listing {
            states: vec![pb::JobState::Pending as i32, pb::JobState::Running as i32],
            user: "good".into(),
            ..Default::default()
        };
        let ok = crate::slurm::list_jobs(&client, &listing).await.is_ok();
        let took = if ok { micros(t0.elapsed()) } else { u32::MAX };
        meter.lists.lock().expect("lists").push((meter.ms(), took));
        tokio::time::sleep(GOOD_PAUSE).await;
    }
}

/// Counts an attack request's outcome; on a refusal with a hint, waits it
/// out as a well-written client would.
async fn outcome<T>(meter: &Meter, r: Result<T, tonic::Status>) {
    meter.sent.fetch_add(1, Ordering::Relaxed);
    if let Err(s) = r {
        if s.code() != Code::NotFound {
            meter.refused.fetch_add(1, Ordering::Relaxed);
            meter.failed("attack", &s);
        }
        tokio::time::sleep(wait_after(&s)).await;
    }
}

/// How long an attacker waits after a refusal: the server's hint, at most
/// [`HINT_MAX`] (a hint past what the client library waits out, or none on
/// a refusal for load: the longest it waits).
fn wait_after(s: &tonic::Status) -> Duration {
    let hint = match gangway_proto::client::retry_after(s) {
        Some(h) => h,
        None if s.code() == Code::ResourceExhausted => HINT_MAX,
        None => Duration::from_millis(20),
    };
    hint.min(HINT_MAX)
}

/// `clients` pollers of one user, over POLL_CONNECTIONS connections: each
/// reads squeue's listing of the whole queue, page by page, in a loop.
fn poll(poller: Client, clients: usize, meter: &Arc<Meter>) -> Vec<tokio::task::JoinHandle<()>> {
    let poller = Arc::new(poller);
    let channels: Vec<tonic::transport::Channel> = (0..POLL_CONNECTIONS)
        .filter_map(|_| {
            let (to, from) = (poller.preferred_endpoint(), Some(user_host("poller")));
            poller.security().channel_from(to, gangway_proto::tls::Expect::Server, Duration::from_secs(2), from).ok()
        })
        .collect();
    (0..clients)
        .map(|i| {
            let (meter, poller) = (meter.clone(), poller.clone());
            let ch = channels[i % channels.len().max(1)].clone();
            tokio::spawn(async move {
                while !meter.attack_over.load(Ordering::Relaxed) {
                    let mut after_id = 0;
                    loop {
                        let mut req = poller.request(pb::ListJobsRequest {
                            states: vec![pb::JobState::Pending as i32, pb::JobState::Running as i32],
                            limit: 1000,
                            after_id,
                            ..Default::default()
                        });
                        req.set_timeout(CALL_TIMEOUT);
                        let r = JobServiceClient::new(ch.clone()).list(req).await.map(|r| r.into_inner().next_after_id);
                        let next = r.as_ref().ok().copied();
                        outcome(&meter, r).await;
                        match next {
                            Some(n) if n != 0 && !meter.attack_over.load(Ordering::Relaxed) => after_id = n,
                            _ => break,
                        }
                    }
                }
            })
        })
        .collect()
}

/// The crafted requests, each in a loop of its own, and the event streams.
async fn crafted(
    client: Client,
    endpoints: &[String],
    parts: &[String],
    meter: &Arc<Meter>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let part = |p: &str| parts.iter().any(|x| x == p);
    let client = Arc::new(client);
    let mut tasks = Vec::new();
    let channels: Vec<tonic::transport::Channel> = endpoints
        .iter()
        .filter_map(|e| {
            let from = Some(user_host("crafted"));
            client.security().channel_from(e, gangway_proto::tls::Expect::Server, Duration::from_secs(2), from).ok()
        })
        .collect();
    for ch in &channels {
        // The List past the last id (an overflow of after_id + 1 before).
        let (m, c, ch1) = (meter.clone(), client.clone(), ch.clone());
        let lists = part("lists");
        tasks.push(tokio::spawn(async move {
            while lists && !m.attack_over.load(Ordering::Relaxed) {
                let req = c.request(pb::ListJobsRequest { after_id: u64::MAX, stale: true, ..Default::default() });
                outcome(&m, JobServiceClient::new(ch1.clone()).list(req).await).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
        // The 8 MB List: one state, eight million times.
        let (m, c, ch2) = (meter.clone(), client.clone(), ch.clone());
        tasks.push(tokio::spawn(async move {
            let states = vec![pb::JobState::Running as i32; CRAFTED_STATES * usize::from(lists)];
            while lists && !m.attack_over.load(Ordering::Relaxed) {
                let req = c.request(pb::ListJobsRequest {
                    states: states.clone(),
                    user: "x".into(),
                    stale: true,
                    ..Default::default()
                });
                let mut js = JobServiceClient::new(ch2.clone()).max_encoding_message_size(usize::MAX);
                outcome(&m, js.list(req).await).await;
            }
        }));
        // Explain on every replica (followers serve stale ones themselves).
        let (m, c, ch3) = (meter.clone(), client.clone(), ch.clone());
        let explains = part("explains");
        tasks.push(tokio::spawn(async move {
            while explains && !m.attack_over.load(Ordering::Relaxed) {
                let req = c.request(pb::ExplainRequest { job_id: 1, stale: true });
                outcome(&m, JobServiceClient::new(ch3.clone()).explain(req).await).await;
            }
        }));
    }
    // Maximum-size specs, held.
    let (m, c) = (meter.clone(), client.clone());
    let specs = part("specs");
    tasks.push(tokio::spawn(async move {
        let largest = largest_spec();
        let mut n = 0u64;
        while specs && !m.attack_over.load(Ordering::Relaxed) {
            n = n.saturating_add(1);
            let spec = largest.clone();
            let req = c.request(pb::SubmitRequest { spec: Some(spec), idempotency_key: format!("big-{n}") });
            let ch = c.channels()[0].clone();
            outcome(&m, JobServiceClient::new(ch).submit(req).await).await;
        }
    }));
    // Event streams from the oldest index, read as fast as they come.
    for i in 0..CRAFTED_STREAMS * usize::from(part("streams")) {
        let (m, c) = (meter.clone(), client.clone());
        let ch = channels[i % channels.len().max(1)].clone();
        tasks.push(tokio::spawn(async move {
            while !m.attack_over.load(Ordering::Relaxed) {
                let req = c.stream_request(pb::EventsRequest { from_index: 1, job_id: 0, history: None });
                match JobServiceClient::new(ch.clone()).events(req).await {
                    Ok(s) => {
                        m.sent.fetch_add(1, Ordering::Relaxed);
                        let mut s = s.into_inner();
                        while let Ok(Some(_)) = s.message().await {}
                    }
                    Err(e) => outcome(&m, Err::<(), _>(e)).await,
                }
            }
        }));
    }
    tasks
}

/// A held spec at the spec limit (`JOB_SPEC_BYTES_MAX`, less a kilobyte for
/// what the controller adds): the largest script, and environment values of
/// the largest size for the rest.
fn largest_spec() -> pb::JobSpec {
    use gangway_core::limits::{ENV_VALUE_BYTES_MAX, ENV_VARS_MAX, JOB_SPEC_BYTES_MAX};
    let script = format!("#!/bin/sh\n# {}\ntrue\n", "x".repeat(CRAFTED_SCRIPT_BYTES - 64));
    let size = |env: &BTreeMap<String, String>| {
        let spec = gangway_core::spec::JobSpec {
            script: script.clone().into(),
            env: env.clone().into(),
            workdir: "/tmp".into(),
            ..Default::default()
        };
        spec.size_bytes()
    };
    let target = JOB_SPEC_BYTES_MAX - 1024;
    let mut env = BTreeMap::new();
    for i in 0..ENV_VARS_MAX {
        // A variable's name and bookkeeping take well under 128 bytes.
        let room = target.saturating_sub(size(&env)).saturating_sub(128).min(ENV_VALUE_BYTES_MAX);
        if room == 0 {
            break;
        }
        env.insert(format!("PAD{i}"), "y".repeat(room));
    }
    let env = env.into_iter().collect();
    pb::JobSpec { script, env, hold: true, workdir: "/tmp".into(), ..Default::default() }
}

/// Thousands of TLS connections without a certificate that say nothing,
/// and anonymous Raft messages of ANONYMOUS_MESSAGE_BYTES.
fn idle(
    endpoints: &[String],
    tls: &std::path::Path,
    count: usize,
    meter: &Arc<Meter>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let ca = std::fs::read(tls.join("ca.pem")).context("the CA certificate")?;
    let anonymous = Credentials::from_ca_pem(&ca, None).map_err(anyhow::Error::msg)?;
    let config = anonymous.client_config(gangway_proto::tls::Expect::Server).map_err(anyhow::Error::msg)?;
    let mut tasks = Vec::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(IDLE_OPENING_AT_ONCE));
    for i in 0..count {
        let (m, config, slots) = (meter.clone(), config.clone(), slots.clone());
        let addr = endpoints[i % endpoints.len()].clone();
        tasks.push(tokio::spawn(async move {
            let Ok(permit) = slots.acquire_owned().await else { return };
            m.sent.fetch_add(1, Ordering::Relaxed);
            let opened = async {
                let target: std::net::SocketAddr = addr.parse().ok()?;
                let socket = tokio::net::TcpSocket::new_v4().ok()?;
                socket.bind(attacker_host(i)).ok()?;
                let tcp = socket.connect(target).await.ok()?;
                let name = rustls::pki_types::ServerName::try_from(gangway_proto::tls::SNI_NAME).ok()?;
                tokio_rustls::TlsConnector::from(config).connect(name, tcp).await.ok()
            };
            let conn = tokio::time::timeout(Duration::from_secs(10), opened).await.ok().flatten();
            drop(permit);
            let Some(mut conn) = conn else {
                m.refused.fetch_add(1, Ordering::Relaxed);
                return;
            };
            // Say nothing; notice when the replica closes it.
            let mut buf = [0u8; 64];
            let closed = tokio::io::AsyncReadExt::read(&mut conn, &mut buf).await;
            if matches!(closed, Ok(0) | Err(_)) {
                m.refused.fetch_add(1, Ordering::Relaxed);
            }
            std::future::pending::<()>().await;
        }));
    }
    let anonymous = Security::Tls(anonymous);
    for i in 0..ANONYMOUS_SENDERS {
        let m = meter.clone();
        let ch = anonymous
            .channel(&endpoints[i % endpoints.len()], gangway_proto::tls::Expect::Server, Duration::from_secs(2))
            .map_err(anyhow::Error::msg)?;
        tasks.push(tokio::spawn(async move {
            let payload = pb::RaftPayload { data: vec![7u8; ANONYMOUS_MESSAGE_BYTES] };
            while !m.attack_over.load(Ordering::Relaxed) {
                let mut raft = gangway_proto::v1::raft_service_client::RaftServiceClient::new(ch.clone())
                    .max_encoding_message_size(usize::MAX);
                outcome(&m, raft.append_entries(payload.clone()).await).await;
            }
        }));
    }
    Ok(tasks)
}

/// The host (a loopback address) each user works from: each its own, as
/// on a real cluster, so the per-host connection limits meet each where a
/// real one would (everything from 127.0.0.1 would share one host's share).
fn user_host(name: &str) -> std::net::IpAddr {
    let n = match name {
        "poller" => 3,
        "crafted" => 4,
        "flood" => 5,
        _ => 6,
    };
    std::net::IpAddr::from([127, 0, n, 1])
}

/// The host agent `i` runs on: 127.1.x.y, 250 to a /24, as a fleet's nodes
/// are spread over racks' networks.
fn agent_host(i: usize) -> std::net::IpAddr {
    let net = u8::try_from(i / 250 % 250).unwrap_or(0);
    let last = u8::try_from(1 + i % 250).unwrap_or(1);
    std::net::IpAddr::from([127, 1, net, last])
}

/// The loopback address idle connection `i` comes from (see IDLE_PER_HOST).
fn attacker_host(i: usize) -> std::net::SocketAddr {
    let host = i / IDLE_PER_HOST;
    let net = u8::try_from(2 + host % 10).unwrap_or(2);
    let last = u8::try_from(1 + (host / 10) % 250).unwrap_or(1);
    std::net::SocketAddr::from(([127, 0, net, last], 0))
}

/// A writer at the write limit: held submits with fresh idempotency keys.
async fn flood(client: Option<Client>, writer: usize, meter: Arc<Meter>) {
    let Some(client) = client else { return };
    let spec = pb::JobSpec { command: vec!["true".into()], hold: true, workdir: "/tmp".into(), ..Default::default() };
    let mut n = 0u64;
    let ch = client.channels()[0].clone();
    while !meter.attack_over.load(Ordering::Relaxed) {
        n = n.saturating_add(1);
        let req = client.request(pb::SubmitRequest {
            spec: Some(spec.clone()),
            idempotency_key: format!("flood-{writer}-{n}-{}", meter.ms()),
        });
        outcome(&meter, JobServiceClient::new(ch.clone()).submit(req).await).await;
    }
}

fn row(attack: &str, meter: &Meter, from: u64, to: u64) -> Row {
    let (heartbeat_p99, heartbeats, _) = p99_of(&meter.heartbeats.lock().expect("heartbeats"), from, to);
    let (submit_p99, submits, submit_failed) = p99_of(&meter.submits.lock().expect("submits"), from, to);
    let (list_p99, _, list_failed) = p99_of(&meter.lists.lock().expect("lists"), from, to);
    let within = |t: u64| t >= from && t < to;
    let count = |v: &Mutex<Vec<(u64, usize)>>| v.lock().expect("events").iter().filter(|(t, _)| within(*t)).count();
    let restarts = meter.exits.lock().expect("exits").iter().filter(|(t, _)| within(*t)).count();
    // Agents that went longer than their self-fence window without an
    // answer: a gap that ended in the window, or one still open at its end.
    let fence = meter.fence_ms.load(Ordering::Relaxed);
    let mut fenced: std::collections::BTreeSet<usize> =
        meter.fenced.lock().expect("fenced").iter().filter(|(t, _)| within(*t)).map(|(_, i)| *i).collect();
    fenced.extend(
        meter
            .last_ok
            .lock()
            .expect("last ok")
            .iter()
            .filter(|(_, t)| fence > 0 && to.saturating_sub(**t) > fence)
            .map(|(i, _)| *i),
    );
    Row {
        attack: attack.to_string(),
        heartbeat_p99,
        heartbeats,
        submit_p99,
        submits,
        submit_failed,
        list_p99,
        list_failed,
        downs: count(&meter.downs),
        fenced: fenced.len(),
        restarts,
        peak_rss_mb: peak_rss(meter, from, to),
        idle_rss_mb: BTreeMap::new(),
        replica_cpu_s: BTreeMap::new(),
        attacker_cpu_s: 0.0,
        sent: meter.sent.load(Ordering::Relaxed),
        refused: meter.refused.load(Ordering::Relaxed),
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

fn print_table(rows: &[Row], a: &StormArgs) {
    let (agents, jobs, exe) = (a.agents, a.jobs, a.controller_exe.as_deref());
    let machine = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "gangway bench storm: 3 replicas (mTLS), {agents} agents, {jobs} held jobs, controllers: {}; {cores} cores, {machine}",
        exe.map_or_else(|| "this build".to_string(), |p| p.display().to_string())
    );
    println!(
        "(each attack on a fresh cluster; idle RSS: the same cluster before the attack; CPU s: during the attack)"
    );
    println!(
        "(attackers' CPU: {})",
        if a.attacker_cpu == "spare" {
            "what the rest leaves (nice 19), as on hosts of their own"
        } else {
            "an equal share of this machine's cores"
        }
    );
    println!();
    println!(
        "| attack | heartbeat p99 ms | submit p99 ms | list p99 ms | false downs | self-fenced | restarts | peak RSS MB (r1/r2/r3) | idle RSS MB | CPU s (r1/r2/r3, attackers) | refused / sent |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let mb = |m: &BTreeMap<u64, u64>| -> String {
            (1..=3).map(|id| m.get(&id).map_or("-".into(), |v| v.to_string())).collect::<Vec<String>>().join("/")
        };
        let failed = |n: usize| if n > 0 { format!(" ({n} failed)") } else { String::new() };
        let cpu = (1..=3)
            .map(|id| r.replica_cpu_s.get(&id).map_or("-".into(), |v| format!("{v:.1}")))
            .collect::<Vec<String>>()
            .join("/");
        println!(
            "| {} | {} ({} beats) | {} ({} submits){} | {}{} | {} | {} | {} | {} | {} | {cpu}, {:.1} | {} / {} |",
            r.attack,
            ms(r.heartbeat_p99),
            r.heartbeats,
            ms(r.submit_p99),
            r.submits,
            failed(r.submit_failed),
            ms(r.list_p99),
            failed(r.list_failed),
            r.downs,
            r.fenced,
            r.restarts,
            mb(&r.peak_rss_mb),
            mb(&r.idle_rss_mb),
            r.attacker_cpu_s,
            r.refused,
            r.sent
        );
    }
    // The goals of issue 32.
    let quiet = rows.iter().find(|r| r.attack == "quiet");
    let mut misses = Vec::new();
    for r in rows {
        if r.restarts > 0 || r.downs > 0 || r.fenced > 0 {
            misses.push(format!(
                "{}: {} restarts, {} false downs, {} self-fenced",
                r.attack, r.restarts, r.downs, r.fenced
            ));
        }
        for (id, peak) in &r.peak_rss_mb {
            if let Some(idle) = r.idle_rss_mb.get(id).copied() {
                if *peak > idle.saturating_mul(2) {
                    misses
                        .push(format!("{}: replica {id} peaked at {peak} MB, over twice its idle {idle} MB", r.attack));
                }
            }
        }
        if let Some(q) = quiet {
            if r.submit_p99 > q.submit_p99 * 2 || r.list_p99 > q.list_p99 * 2 {
                misses.push(format!(
                    "{}: the good user's p99 (submit {} ms, list {} ms) is over twice the quiet run's ({} / {} ms)",
                    r.attack,
                    ms(r.submit_p99),
                    ms(r.list_p99),
                    ms(q.submit_p99),
                    ms(q.list_p99)
                ));
            }
        }
    }
    println!();
    if misses.is_empty() {
        println!(
            "goals: all met (0 restarts, 0 false downs, 0 self-fences, RSS under 2x idle, good p99 within 2x quiet)"
        );
    } else {
        println!("goals missed:");
        for m in misses {
            println!("- {m}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A refused attacker honours a hint up to HINT_MAX; one a millisecond
    /// longer is cut to it, as is a refusal for load without a hint.
    #[test]
    fn an_attacker_waits_out_hints_up_to_hint_max() {
        let refused = |ms: Option<u128>| {
            let mut s = tonic::Status::resource_exhausted("busy");
            if let Some(ms) = ms {
                let v = ms.to_string().parse().expect("metadata");
                s.metadata_mut().insert(gangway_proto::client::RETRY_AFTER_METADATA_KEY, v);
            }
            wait_after(&s)
        };
        assert_eq!(refused(Some(HINT_MAX.as_millis())), HINT_MAX);
        assert_eq!(refused(Some(HINT_MAX.as_millis() + 1)), HINT_MAX);
        assert_eq!(refused(Some(7)), Duration::from_millis(7));
        assert_eq!(refused(None), HINT_MAX);
        assert_eq!(wait_after(&tonic::Status::unavailable("down")), Duration::from_millis(20));
    }

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        a: StormArgs,
    }

    /// Each option is taken at its limit and refused one past it, the
    /// refusal naming the option and the limit.
    #[test]
    fn storm_options_stop_at_their_limits() {
        let cases: [(&str, u64); 5] = [
            ("agents", STORM_AGENTS_MAX as u64),
            ("clients", STORM_CLIENTS_MAX as u64),
            ("idle", STORM_IDLE_MAX as u64),
            ("jobs", STORM_JOBS_MAX),
            ("seconds", STORM_SECONDS_MAX),
        ];
        for (option, limit) in cases {
            let with = |v: u64| {
                let argv = ["storm".to_string(), format!("--{option}"), v.to_string()];
                check(&Cmd::try_parse_from(argv).expect("options parse").a)
            };
            assert!(with(limit).is_ok(), "{option} {limit}: {:?}", with(limit));
            let e = with(limit + 1).expect_err("one past the limit is taken").to_string();
            assert!(e.starts_with(&format!("{option}:")) && e.contains(&limit.to_string()), "{e}");
        }
    }

    #[test]
    fn cpu_ticks_are_counted_after_the_command_name() {
        let stat = "4242 (tokio (rt) 1) S 1 4242 4242 0 -1 4194560 100 0 0 0 17 5 0 0 20 0 9 0 123 456 789";
        assert_eq!(cpu_ticks(stat), Some(22));
        assert_eq!(cpu_ticks("4242 (cut short) S 1 2"), None);
        assert_eq!(cpu_ticks("no name at all"), None);
    }

    #[test]
    fn this_thread_has_an_id_and_its_own_stat() {
        let tid = this_thread_id().expect("/proc/thread-self names the thread");
        assert!(cpu_seconds(&format!("/proc/self/task/{tid}/stat")).is_some());
    }
}
