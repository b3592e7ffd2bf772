//! `gangway bench peers`: Slurm, etcd and Gangway measured in one run on this
//! machine, each the way its users run it, and one Markdown table with the
//! ratios. The peers come from the distribution's packages (`make bench-peers`
//! installs them); this module starts and stops every process itself, on
//! loopback, with its data in one temporary directory.
//!
//! The same harness measures both sides of each row:
//! - durable replicated writes: etcd puts (3 members, 256-byte values) and
//!   Gangway submits (3 replicas), closed loops of 1, 16 and 64 clients;
//! - the batch command line: `sbatch --wrap=true` against slurmctld with 8
//!   emulated slurmd nodes, and Gangway's `sbatch` against 8 agents of the
//!   same shape, one submitter and four, each call a new process;
//! - trivial jobs from the first submit until the queue is empty;
//! - `squeue` with 1,000 held jobs;
//! - leader SIGKILL to the next acknowledged write (etcd and Gangway; Slurm's
//!   backup controller needs a second host name, so it is not run here).
//!
//! Slurm authenticates with munge and Gangway with mutual TLS, as each does
//! in production; etcd runs as it installs, in plaintext, so the write rows
//! also give Gangway in plaintext, and the ratio uses that one.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::future::BoxFuture;
use gangway_proto::client::Client;
use gangway_proto::tls::{Principal, Role};
use tokio::sync::Mutex;

use crate::bench::{
    closed_loop, failover_gaps, free_ports, machine_facts, percentile, spawn_writer, BenchAgents, GangwayFailover,
    Load, LocalCluster, Op, Replicated, CLUSTER_WAIT,
};

/// Members of each replicated system.
const MEMBERS: u64 = 3;
/// Emulated Slurm nodes and Gangway agents, and the CPUs of each.
const BATCH_NODES: usize = 8;
const BATCH_NODE_CPUS: u32 = 16;
/// etcd's value size in the write rows (a small job record).
const PUT_BYTES: usize = 256;
/// Parallel submitters in the command-line rows (Slurm's own guidance for
/// high-throughput sites keeps submitters few).
const CLI_SUBMITTERS: usize = 4;
/// Times `squeue` is run against the held queue.
const SQUEUE_SAMPLES: usize = 50;
/// How often the end-to-end row polls for an empty queue.
const DRAIN_POLL: Duration = Duration::from_millis(50);
/// The longest any phase may wait for a peer to settle or a queue to drain.
const PHASE_WAIT: Duration = Duration::from_secs(600);
/// Bounds on the knobs (a run is minutes, not hours).
const CALLS_MAX: usize = 10_000;
const FAILOVERS_MAX: usize = 50;
/// A put to etcd that takes longer is an error (etcd's client waits 5 s by
/// default).
const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// The failover writer's shorter one: a put parked on a member with no
/// leader is retried elsewhere this often, so the measured gap overstates
/// etcd's by at most this much (Gangway's clients are told the leader).
const ETCD_FAILOVER_CALL_TIMEOUT: Duration = Duration::from_millis(100);
/// How long SIGTERM has before SIGKILL when a peer is stopped.
const STOP_GRACE: Duration = Duration::from_secs(5);

#[derive(clap::Args)]
pub struct PeersArgs {
    /// Client counts for the durable-write rows.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    clients: Vec<usize>,
    /// Seconds each client count is measured.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// `sbatch` calls in the command-line rows.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Trivial jobs in the end-to-end row.
    #[arg(long, default_value_t = 500)]
    jobs: usize,
    /// Held jobs in the queue `squeue` lists.
    #[arg(long, default_value_t = 1000)]
    pending: usize,
    /// Leader kills per replicated system.
    #[arg(long, default_value_t = 5)]
    failovers: usize,
    /// Also write the table to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep every process's data and logs here instead of a temp dir.
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

impl PeersArgs {
    fn check(&self) -> anyhow::Result<()> {
        if self.clients.is_empty() || self.clients.iter().any(|&c| c == 0 || c > crate::bench::BENCH_CLIENTS_MAX) {
            bail!("clients: each count must be between 1 and {}", crate::bench::BENCH_CLIENTS_MAX);
        }
        if self.seconds == 0 || self.seconds > crate::bench::BENCH_SECONDS_MAX {
            bail!("seconds: must be between 1 and {}", crate::bench::BENCH_SECONDS_MAX);
        }
        for (name, v) in [("calls", self.calls), ("jobs", self.jobs), ("pending", self.pending)] {
            if !(CLI_SUBMITTERS..=CALLS_MAX).contains(&v) {
                bail!("{name}: must be between {CLI_SUBMITTERS} and {CALLS_MAX}");
            }
        }
        if self.failovers == 0 || self.failovers > FAILOVERS_MAX {
            bail!("failovers: must be between 1 and {FAILOVERS_MAX}");
        }
        Ok(())
    }
}

// ------------------------------------------------------------------ the table

/// Which way a row's figure is better.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Better {
    Higher,
    Lower,
}

/// One measured figure: the number compared, and how it reads in the table.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Cell {
    pub value: f64,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row {
    pub what: String,
    pub better: Better,
    pub slurm: Option<Cell>,
    pub etcd: Option<Cell>,
    pub gangway: Option<Cell>,
}

/// How many times better Gangway's figure is than the best peer's (below 1:
/// worse), when both were measured and are positive.
pub(crate) fn ratio(row: &Row) -> Option<f64> {
    let g = row.gangway.as_ref()?.value;
    let peers = [&row.slurm, &row.etcd].into_iter().flatten().map(|c| c.value).filter(|v| *v > 0.0);
    let best = match row.better {
        Better::Higher => peers.fold(None, |b: Option<f64>, v| Some(b.map_or(v, |b| b.max(v)))),
        Better::Lower => peers.fold(None, |b: Option<f64>, v| Some(b.map_or(v, |b| b.min(v)))),
    }?;
    if g <= 0.0 {
        return None;
    }
    Some(match row.better {
        Better::Higher => g / best,
        Better::Lower => best / g,
    })
}

/// The rows as one Markdown table, with the ratio column.
pub(crate) fn render_table(rows: &[Row]) -> String {
    let mut s = String::from("| what | Slurm | etcd | Gangway | Gangway vs best peer |\n|---|---|---|---|---|\n");
    let cell = |c: &Option<Cell>| c.as_ref().map_or("—".to_string(), |c| c.text.replace('|', "/"));
    for r in rows {
        let vs = match ratio(r) {
            Some(x) if x >= 1.0 => format!("{x:.1}× better"),
            Some(x) => format!("{:.1}× worse", 1.0 / x),
            None => "—".into(),
        };
        s.push_str(&format!("| {} | {} | {} | {} | {vs} |\n", r.what, cell(&r.slurm), cell(&r.etcd), cell(&r.gangway)));
    }
    s
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A rate cell: "N/s (p50 X ms, p99 Y ms)".
fn rate_cell(l: &Load) -> Cell {
    Cell {
        value: l.per_s,
        text: format!("{:.0}/s (p50 {:.2} ms, p99 {:.1} ms){}", l.per_s, ms(l.p50), ms(l.p99), errors_note(l.errors)),
    }
}

fn errors_note(errors: u64) -> String {
    if errors == 0 {
        String::new()
    } else {
        format!(", {errors} errors")
    }
}

// ----------------------------------------------------------- the measurements

/// Runs `calls` commands, `parallel` at a time (each submitter runs its share
/// one after another), each a new process as a user's would be; the latency of
/// each call and the rate over the whole run.
fn time_commands(parallel: usize, calls: usize, make: &(dyn Fn(usize) -> Command + Sync)) -> anyhow::Result<Load> {
    let started = Instant::now();
    let results: Vec<(Vec<Duration>, u64, Option<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..parallel)
            .map(|t| {
                s.spawn(move || {
                    let (mut lat, mut errors, mut first_error) = (Vec::new(), 0u64, None);
                    for i in (t..calls).step_by(parallel) {
                        let began = Instant::now();
                        match make(i).stdin(Stdio::null()).output() {
                            Ok(o) if o.status.success() => lat.push(began.elapsed()),
                            Ok(o) => {
                                errors += 1;
                                first_error.get_or_insert_with(|| String::from_utf8_lossy(&o.stderr).into_owned());
                            }
                            Err(e) => {
                                errors += 1;
                                first_error.get_or_insert_with(|| e.to_string());
                            }
                        }
                    }
                    (lat, errors, first_error)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a submitter thread panicked")).collect()
    });
    let elapsed = started.elapsed();
    let mut lat = Vec::new();
    let (mut errors, mut first_error) = (0, None);
    for (l, e, f) in results {
        lat.extend(l);
        errors += e;
        first_error = first_error.or(f);
    }
    if let Some(e) = &first_error {
        eprintln!("  {errors} of {calls} calls failed; the first said: {}", e.trim());
    }
    if lat.is_empty() {
        bail!("every call failed: {}", first_error.unwrap_or_default().trim());
    }
    lat.sort_unstable();
    Ok(Load {
        ops: lat.len(),
        per_s: lat.len() as f64 / elapsed.as_secs_f64(),
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        errors,
    })
}

/// Polls `count` until it says 0; the time from `since`.
fn wait_empty(since: Instant, count: &dyn Fn() -> anyhow::Result<usize>) -> anyhow::Result<Duration> {
    let deadline = Instant::now() + PHASE_WAIT;
    loop {
        if count()? == 0 {
            return Ok(since.elapsed());
        }
        if Instant::now() > deadline {
            bail!("the queue did not empty within {} s", PHASE_WAIT.as_secs());
        }
        std::thread::sleep(DRAIN_POLL);
    }
}

/// Lines a command printed (it must succeed).
fn output_lines(mut cmd: Command) -> anyhow::Result<usize> {
    let o = cmd.stdin(Stdio::null()).output().context("running a status command")?;
    if !o.status.success() {
        bail!("{:?} failed: {}", cmd.get_program(), String::from_utf8_lossy(&o.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&o.stdout).lines().filter(|l| !l.trim().is_empty()).count())
}

/// What the batch rows measured for one system.
struct BatchFigures {
    one: Load,
    many: Load,
    end_to_end: Duration,
    squeue: Load,
}

/// The batch rows against one system, through its own commands: `cmd(name)`
/// builds its `sbatch`, `squeue`, ... with the environment that reaches it.
/// `active`: the states a job is in until it is done, in that system's
/// `squeue -t` spelling (Slurm's jobs pass through COMPLETING).
fn batch_rows(
    a: &PeersArgs,
    cmd: &(dyn Fn(&str) -> Command + Sync),
    active: &str,
    label: &str,
) -> anyhow::Result<BatchFigures> {
    let sbatch = |args: &'static [&'static str]| {
        move |_: usize| {
            let mut c = cmd("sbatch");
            c.args(args).stdout(Stdio::null());
            c
        }
    };
    let active = || {
        let mut c = cmd("squeue");
        c.args(["-h", "-t", active, "-o", "%i"]);
        output_lines(c)
    };
    println!("{label}: sbatch --wrap=true, 1 submitter, {} calls", a.calls);
    let one = time_commands(1, a.calls, &sbatch(&["--wrap=true"]))?;
    println!("{label}: sbatch --wrap=true, {CLI_SUBMITTERS} submitters, {} calls", a.calls);
    let many = time_commands(CLI_SUBMITTERS, a.calls, &sbatch(&["--wrap=true"]))?;
    wait_empty(Instant::now(), &active)?;
    println!("{label}: {} trivial jobs, {CLI_SUBMITTERS} submitters, first submit until the queue is empty", a.jobs);
    let started = Instant::now();
    time_commands(CLI_SUBMITTERS, a.jobs, &sbatch(&["--wrap=true"]))?;
    let end_to_end = wait_empty(started, &active)?;
    println!("{label}: {} held jobs, then squeue {SQUEUE_SAMPLES} times", a.pending);
    time_commands(CLI_SUBMITTERS, a.pending, &sbatch(&["-H", "--wrap=true"]))?;
    let held = {
        let mut c = cmd("squeue");
        c.args(["-h", "-t", "PD", "-o", "%i"]);
        output_lines(c)?
    };
    if held < a.pending {
        bail!("{label}: squeue lists {held} pending jobs, {} were submitted", a.pending);
    }
    let squeue = time_commands(1, SQUEUE_SAMPLES, &|_| {
        let mut c = cmd("squeue");
        c.stdout(Stdio::null());
        c
    })?;
    Ok(BatchFigures { one, many, end_to_end, squeue })
}

fn failover_cell(gaps: &[Duration], extra: &str) -> Cell {
    Cell {
        value: ms(percentile(gaps, 0.5)),
        text: format!(
            "median {:.0} ms, max {:.0} ms{extra}",
            ms(percentile(gaps, 0.5)),
            ms(gaps.last().copied().unwrap_or_default())
        ),
    }
}

// ------------------------------------------------------------------- children

/// Stops a child we started: SIGTERM, then SIGKILL after the grace.
fn stop_child(c: &mut Child) {
    let pid = nix::unistd::Pid::from_raw(c.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
}

fn spawn_logged(mut cmd: Command, log: &Path) -> anyhow::Result<Child> {
    let out = std::fs::File::create(log)?;
    cmd.stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("starting {:?} (is it installed? `make bench-peers` installs it)", cmd.get_program()))
}

fn version_of(program: &str, flag: &str) -> String {
    Command::new(program)
        .arg(flag)
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().next().map(|l| l.trim().to_string()))
        .unwrap_or_else(|| "unknown version".into())
}

// ---------------------------------------------------------------------- Slurm

fn require_root() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("bench peers: Slurm's daemons run jobs as their users and must start as root");
    }
    Ok(())
}

/// munged, slurmctld and one slurmd per emulated node, as children.
struct Slurm {
    conf: PathBuf,
    jobs: PathBuf,
    children: Vec<Child>,
}

impl Slurm {
    fn start(root: &Path) -> anyhow::Result<Slurm> {
        require_root()?;
        let dir = root.join("slurm");
        let munge = dir.join("munge");
        let jobs = dir.join("jobs");
        for d in [&munge, &dir.join("state"), &jobs] {
            std::fs::create_dir_all(d)?;
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&munge, std::fs::Permissions::from_mode(0o700))?;
        let mut key = vec![0u8; 1024];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
        let key_file = munge.join("munge.key");
        std::fs::write(&key_file, &key)?;
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600))?;
        let socket = munge.join("socket");
        let conf = dir.join("slurm.conf");
        // Every child goes into `s` as it starts: an error anywhere after
        // stops what was started.
        let mut s = Slurm { conf, jobs, children: Vec::new() };
        let mut munged = Command::new("munged");
        munged
            .args(["--foreground", "--force"])
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key_file.display()))
            .arg(format!("--log-file={}", munge.join("munged.log").display()))
            .arg(format!("--pid-file={}", munge.join("munged.pid").display()))
            .arg(format!("--seed-file={}", munge.join("seed").display()));
        s.children.push(spawn_logged(munged, &munge.join("munged.out"))?);
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_string();
        std::fs::write(&s.conf, slurm_conf(&dir, &host, &socket)?)?;
        wait_until(|| Ok(socket.exists()), "munged's socket")?;
        let mut ctld = Command::new("slurmctld");
        ctld.args(["-D", "-i", "-f"]).arg(&s.conf);
        s.children.push(spawn_logged(ctld, &dir.join("slurmctld.out"))?);
        for n in 1..=BATCH_NODES {
            std::fs::create_dir_all(dir.join(format!("spool-n{n}")))?;
            let mut d = Command::new("slurmd");
            d.args(["-D", "-f"]).arg(&s.conf).args(["-N", &format!("n{n}")]);
            s.children.push(spawn_logged(d, &dir.join(format!("slurmd-n{n}.out")))?);
        }
        wait_until(
            || {
                let mut c = s.cmd("sinfo");
                c.args(["-h", "-N", "-t", "idle", "-o", "%N"]);
                Ok(output_lines(c).unwrap_or(0) >= BATCH_NODES)
            },
            "every slurmd idle",
        )
        .with_context(|| format!("Slurm did not come up (logs in {})", dir.display()))?;
        Ok(s)
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf).current_dir(&self.jobs);
        c
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        // Daemons first, munged (which they authenticate through) last.
        for c in self.children.iter_mut().rev() {
            stop_child(c);
        }
    }
}

fn slurm_conf(dir: &Path, host: &str, munge_socket: &Path) -> anyhow::Result<String> {
    let d = dir.display();
    let ports = free_ports(1 + BATCH_NODES)?;
    let mut s = format!(
        "ClusterName=bench\nSlurmctldHost={host}(127.0.0.1)\nSlurmctldPort={}\n\
         AuthType=auth/munge\nAuthInfo=socket={}\nCredType=cred/munge\nSlurmUser=root\nSlurmdUser=root\n\
         StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool-%n\nSlurmctldPidFile={d}/slurmctld.pid\n\
         SlurmdPidFile={d}/slurmd-%n.pid\nSlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd-%n.log\n\
         ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSchedulerType=sched/backfill\n\
         SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nSlurmdParameters=config_overrides\n\
         ReturnToService=2\nMpiDefault=none\nJobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n\
         SwitchType=switch/none\n",
        ports[0],
        munge_socket.display()
    );
    for (n, port) in (1..=BATCH_NODES).zip(&ports[1..]) {
        s.push_str(&format!(
            "NodeName=n{n} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={BATCH_NODE_CPUS} RealMemory=16000 State=UNKNOWN\n"
        ));
    }
    s.push_str("PartitionName=bench Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n");
    Ok(s)
}

/// Polls `ready` every 100 ms for up to the cluster wait.
fn wait_until(mut ready: impl FnMut() -> anyhow::Result<bool>, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + CLUSTER_WAIT;
    while Instant::now() < deadline {
        if ready()? {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("waited {} s for {what}", CLUSTER_WAIT.as_secs())
}

// ----------------------------------------------------------------------- etcd

/// The few etcd v3 messages the bench speaks (etcdserverpb, by field number).
mod etcd_pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PutRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResponseHeader {
        #[prost(uint64, tag = "2")]
        pub member_id: u64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PutResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StatusRequest {}
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StatusResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(uint64, tag = "4")]
        pub leader: u64,
    }
}

async fn etcd_call<Req, Resp>(
    ch: tonic::transport::Channel,
    path: &'static str,
    req: Req,
) -> Result<Resp, tonic::Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let mut g = tonic::client::Grpc::new(ch);
    g.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    g.unary(tonic::Request::new(req), path, tonic::codec::ProstCodec::default()).await.map(|r| r.into_inner())
}

const ETCD_PUT: &str = "/etcdserverpb.KV/Put";
const ETCD_STATUS: &str = "/etcdserverpb.Maintenance/Status";

/// Three etcd members on loopback, as children.
struct Etcd {
    exe: String,
    timing: gangway_controller::config::Timing,
    dir: PathBuf,
    clients: Vec<String>,
    peers: Vec<String>,
    children: Vec<Option<Child>>,
}

impl Etcd {
    fn start(root: &Path) -> anyhow::Result<Etcd> {
        let dir = root.join("etcd");
        std::fs::create_dir_all(&dir)?;
        let mut e = Etcd {
            exe: "etcd".into(),
            timing: Default::default(),
            dir,
            clients: Vec::new(),
            peers: Vec::new(),
            children: Vec::new(),
        };
        let ports = free_ports(2 * MEMBERS as usize)?;
        for p in ports.chunks(2) {
            e.clients.push(format!("127.0.0.1:{}", p[0]));
            e.peers.push(format!("http://127.0.0.1:{}", p[1]));
            e.children.push(None);
        }
        for i in 0..MEMBERS as usize {
            e.spawn(i)?;
        }
        Ok(e)
    }

    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let cluster: Vec<String> = self.peers.iter().enumerate().map(|(j, p)| format!("e{j}={p}")).collect();
        let mut c = Command::new(&self.exe);
        c.arg("--name")
            .arg(format!("e{i}"))
            .arg("--data-dir")
            .arg(self.dir.join(format!("e{i}")))
            .args(["--listen-peer-urls", &self.peers[i], "--initial-advertise-peer-urls", &self.peers[i]])
            .args(["--listen-client-urls", &format!("http://{}", self.clients[i])])
            .args(["--advertise-client-urls", &format!("http://{}", self.clients[i])])
            .args(["--initial-cluster", &cluster.join(","), "--initial-cluster-token", "bench"])
            // Gangway's Raft timing, so the failover row compares failovers,
            // not defaults (etcd's are 100 ms and 1 s; it draws its election
            // timeout from [t, 2t)).
            .arg(format!("--heartbeat-interval={}", self.timing.heartbeat_interval_ms))
            .arg(format!("--election-timeout={}", self.timing.election_timeout_min_ms));
        let log = self.dir.join(format!("e{i}.log"));
        self.children[i] = Some(spawn_logged(c, &log)?);
        Ok(())
    }

    fn channel(&self, i: usize, timeout: Duration) -> anyhow::Result<tonic::transport::Channel> {
        Ok(tonic::transport::Endpoint::from_shared(format!("http://{}", self.clients[i]))?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect_lazy())
    }

    /// The index of the member every live member names as leader.
    async fn leader(&self) -> anyhow::Result<usize> {
        let deadline = Instant::now() + CLUSTER_WAIT;
        while Instant::now() < deadline {
            let mut named = Vec::new();
            let mut ids = Vec::new();
            for i in 0..self.clients.len() {
                if self.children[i].is_none() {
                    continue;
                }
                match etcd_call::<_, etcd_pb::StatusResponse>(
                    self.channel(i, ETCD_CALL_TIMEOUT)?,
                    ETCD_STATUS,
                    etcd_pb::StatusRequest {},
                )
                .await
                {
                    Ok(s) => {
                        named.push(s.leader);
                        ids.push((i, s.header.map(|h| h.member_id).unwrap_or(0)));
                    }
                    Err(_) => named.push(0),
                }
            }
            let all_agree = named.windows(2).all(|w| w[0] == w[1]) && named.first().is_some_and(|l| *l != 0);
            if all_agree {
                if let Some((i, _)) = ids.iter().find(|(_, id)| *id == named[0]) {
                    return Ok(*i);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("etcd elected no leader within {} s (logs in {})", CLUSTER_WAIT.as_secs(), self.dir.display())
    }

    /// A put loop for one client: starts at member `first` and moves on to the
    /// next member when a call fails.
    fn put_op(&self, first: usize, client: usize, timeout: Duration) -> anyhow::Result<Op> {
        let channels: Vec<_> =
            (0..self.clients.len()).map(|i| self.channel(i, timeout)).collect::<anyhow::Result<_>>()?;
        let at = Arc::new(std::sync::atomic::AtomicUsize::new(first));
        let value = vec![b'x'; PUT_BYTES];
        Ok(Box::new(move |i| {
            let n = at.load(std::sync::atomic::Ordering::Relaxed);
            let ch = channels[n % channels.len()].clone();
            let req = etcd_pb::PutRequest { key: format!("bench/{client}/{i}").into_bytes(), value: value.clone() };
            let at = at.clone();
            Box::pin(async move {
                let ok = etcd_call::<_, etcd_pb::PutResponse>(ch, ETCD_PUT, req).await.is_ok();
                if !ok {
                    at.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                ok
            })
        }))
    }
}

impl Replicated for Etcd {
    fn leader(&mut self) -> BoxFuture<'_, anyhow::Result<u64>> {
        Box::pin(async move { Etcd::leader(self).await.map(|l| l as u64) })
    }

    fn kill(&mut self, id: u64) {
        if let Some(mut c) = self.children[id as usize].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn restore(&mut self, id: u64) -> BoxFuture<'_, anyhow::Result<()>> {
        Box::pin(async move {
            self.spawn(id as usize)?;
            Etcd::leader(self).await.map(|_| ())
        })
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            stop_child(c);
        }
    }
}

// -------------------------------------------------------------------- Gangway

/// Submit loops against `cluster`, each client with its own connection, the
/// leader first.
async fn submit_ops(cluster: &LocalCluster) -> anyhow::Result<impl Fn(usize) -> Op> {
    let security = cluster.security().clone();
    let probe = Client::new(&cluster.endpoints(), "bench", &security)?;
    let leader = cluster.wait_leader(&probe).await?;
    let eps = cluster.endpoints_leader_first(leader);
    Ok(move |t: usize| crate::bench::submit_op(&eps, &security, format!("peers-{t}")))
}

/// The batch rows' Gangway: mutual TLS, agents of Slurm's node shape.
struct GangwayBatch {
    cluster: LocalCluster,
    agents: BenchAgents,
    jobs: PathBuf,
}

impl GangwayBatch {
    async fn start(root: &Path) -> anyhow::Result<GangwayBatch> {
        let user = crate::tls::login_name();
        let mut extra = vec![Principal::new(Role::Client, &user).map_err(anyhow::Error::msg)?];
        let names: Vec<String> = (1..=BATCH_NODES).map(|n| format!("n{n}")).collect();
        for n in &names {
            extra.push(Principal::new(Role::Agent, n).map_err(anyhow::Error::msg)?);
        }
        let cluster = LocalCluster::start_mtls(MEMBERS, Some(root.join("gangway-batch")), &extra)?;
        let tls = cluster.tls_dir().context("an mTLS cluster has a TLS directory")?.to_path_buf();
        let client = Client::new(&cluster.endpoints(), "bench", cluster.security())?;
        cluster.wait_leader(&client).await?;
        let mut configs = Vec::new();
        for (p, name) in extra[1..].iter().zip(&names) {
            let files = gangway_proto::tls::TlsFiles::in_dir(&tls, &gangway_proto::pki::stem(p));
            let creds = gangway_proto::tls::Credentials::load(files).map_err(anyhow::Error::msg)?;
            let state_dir = cluster.root().join(format!("agent-{name}"));
            configs.push(gangway_node_agent::AgentConfig {
                cpus: BATCH_NODE_CPUS,
                mem_mb: 16_000,
                security: gangway_proto::tls::Security::Tls(creds),
                gpu_fault_file: None,
                gpu_load_file: None,
                ..gangway_node_agent::AgentConfig::simulated(cluster.endpoints(), name, state_dir)
            });
        }
        let agents = BenchAgents::start(configs, &client).await?;
        let jobs = cluster.root().join("jobs");
        std::fs::create_dir_all(&jobs)?;
        Ok(GangwayBatch { cluster, agents, jobs })
    }

    /// Gangway's own command `program` (`sbatch`, `squeue`): this binary, with
    /// the user's certificate.
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(std::env::current_exe().unwrap_or_else(|_| "gangway".into()));
        c.arg(program)
            .env("GANGWAY_ENDPOINTS", self.cluster.endpoints().join(","))
            .env("GANGWAY_TLS_DIR", self.cluster.tls_dir().unwrap_or(Path::new("/nonexistent")))
            .env_remove("GANGWAY_INSECURE")
            .current_dir(&self.jobs);
        c
    }

    async fn stop(self) {
        self.agents.stop().await;
        drop(self.cluster);
    }
}

// ------------------------------------------------------------------------ run

pub async fn run(a: PeersArgs) -> anyhow::Result<()> {
    a.check()?;
    require_root()?;
    let (_tmp, root) = match &a.data_dir {
        Some(d) => (None, d.clone()),
        None => {
            let t = tempfile::Builder::new().prefix("gangway-peers-").tempdir()?;
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    };
    std::fs::create_dir_all(&root)?;
    let slurm_version = version_of("slurmctld", "-V");
    let etcd_version = version_of("etcd", "--version");
    println!(
        "bench peers: Slurm ({slurm_version}), etcd ({etcd_version}) and Gangway, one after another on this machine"
    );
    println!("machine: {}", machine_facts());
    let mut rows: Vec<Row> = Vec::new();

    // Durable writes.
    let etcd_loads = {
        let mut etcd = Etcd::start(&root)?;
        let leader = Etcd::leader(&etcd).await?;
        let mut loads = Vec::new();
        for &n in &a.clients {
            println!("etcd: {n} clients putting {PUT_BYTES}-byte values for {} s", a.seconds);
            let etcd_ref = &etcd;
            loads.push(
                closed_loop(n, a.seconds, |t| etcd_ref.put_op(leader, t, ETCD_CALL_TIMEOUT).expect("a lazy channel"))
                    .await?,
            );
        }
        let acks = Arc::new(Mutex::new(Vec::new()));
        let leader = Etcd::leader(&etcd).await?;
        let writer = spawn_writer(etcd.put_op(leader, usize::MAX, ETCD_FAILOVER_CALL_TIMEOUT)?, acks.clone());
        let gaps = failover_gaps(&mut etcd, &acks, a.failovers, "etcd").await;
        writer.abort();
        (loads, gaps?)
    };
    let mut gangway_loads = Vec::new();
    for mtls in [false, true] {
        let cluster = if mtls {
            LocalCluster::start_mtls(MEMBERS, Some(root.join("gangway-mtls")), &[])?
        } else {
            LocalCluster::start(MEMBERS, Some(root.join("gangway-plain")))?
        };
        let ops = submit_ops(&cluster).await?;
        let mut loads = Vec::new();
        for &n in &a.clients {
            let t = if mtls { "mutual TLS" } else { "plaintext" };
            println!("gangway: {n} clients submitting for {} s ({t})", a.seconds);
            loads.push(closed_loop(n, a.seconds, &ops).await?);
        }
        gangway_loads.push(loads);
    }
    for (i, &n) in a.clients.iter().enumerate() {
        let (plain, tls) = (&gangway_loads[0][i], &gangway_loads[1][i]);
        let mut g = rate_cell(plain);
        g.text = format!("{}; mutual TLS {:.0}/s (p50 {:.2} ms)", g.text, tls.per_s, ms(tls.p50));
        rows.push(Row {
            what: format!("durable writes, {n} client{}", if n == 1 { "" } else { "s" }),
            better: Better::Higher,
            slurm: None,
            etcd: Some(rate_cell(&etcd_loads.0[i])),
            gangway: Some(g),
        });
    }

    // Failover (Gangway), plaintext like etcd.
    let gangway_gaps = {
        let mut cluster = LocalCluster::start(MEMBERS, Some(root.join("gangway-failover")))?;
        let client = Arc::new(Client::new(&cluster.endpoints(), "bench", cluster.security())?);
        cluster.wait_leader(&client).await?;
        let (ids, acks) = (Arc::new(Mutex::new(Default::default())), Arc::new(Mutex::new(Vec::new())));
        let submitter = crate::bench::spawn_submitter(client.clone(), ids.clone(), acks.clone());
        let gaps = failover_gaps(
            &mut GangwayFailover { cluster: &mut cluster, client: &client },
            &acks,
            a.failovers,
            "gangway",
        )
        .await;
        submitter.abort();
        let _ = submitter.await;
        let gaps = gaps?;
        let acked = ids.lock().await.clone();
        let lost = crate::bench::lost_jobs(&client, &acked).await?;
        (gaps, lost, acked.len())
    };
    rows.push(Row {
        what: "leader SIGKILL → next acknowledged write".into(),
        better: Better::Lower,
        slurm: None,
        etcd: Some(failover_cell(&etcd_loads.1, "")),
        gangway: Some(failover_cell(
            &gangway_gaps.0,
            &format!("; {} of {} acknowledged lost", gangway_gaps.1, gangway_gaps.2),
        )),
    });

    // The batch rows.
    let slurm = {
        let s = Slurm::start(&root)?;
        tokio::task::block_in_place(|| batch_rows(&a, &|p| s.cmd(p), "PD,R,CG", "slurm"))?
    };
    let gangway = {
        let g = GangwayBatch::start(&root).await?;
        let figures = tokio::task::block_in_place(|| batch_rows(&a, &|p| g.cmd(p), "PD,R", "gangway"));
        g.stop().await;
        figures?
    };
    let e2e = |d: Duration| Cell {
        value: a.jobs as f64 / d.as_secs_f64(),
        text: format!("{:.1} jobs/s ({:.1} s)", a.jobs as f64 / d.as_secs_f64(), d.as_secs_f64()),
    };
    let squeue =
        |l: &Load| Cell { value: ms(l.p50), text: format!("p50 {:.1} ms, p99 {:.1} ms", ms(l.p50), ms(l.p99)) };
    rows.push(Row {
        what: "`sbatch --wrap=true`, 1 submitter".into(),
        better: Better::Higher,
        slurm: Some(rate_cell(&slurm.one)),
        etcd: None,
        gangway: Some(rate_cell(&gangway.one)),
    });
    rows.push(Row {
        what: format!("`sbatch --wrap=true`, {CLI_SUBMITTERS} submitters"),
        better: Better::Higher,
        slurm: Some(rate_cell(&slurm.many)),
        etcd: None,
        gangway: Some(rate_cell(&gangway.many)),
    });
    rows.push(Row {
        what: format!("{} trivial jobs, first submit → queue empty", a.jobs),
        better: Better::Higher,
        slurm: Some(e2e(slurm.end_to_end)),
        etcd: None,
        gangway: Some(e2e(gangway.end_to_end)),
    });
    rows.push(Row {
        what: format!("`squeue` with {} held jobs", a.pending),
        better: Better::Lower,
        slurm: Some(squeue(&slurm.squeue)),
        etcd: None,
        gangway: Some(squeue(&gangway.squeue)),
    });

    let table = format!(
        "{}\n{BATCH_NODES} emulated Slurm nodes and {BATCH_NODES} Gangway agents of {BATCH_NODE_CPUS} CPUs; \
         3 etcd members and 3 Gangway replicas; everything on loopback, one system at a time. \
         Slurm authenticates with munge, Gangway's command line with mutual TLS, etcd and the \
         first Gangway write figure in plaintext. etcd runs with Gangway's Raft timing (heartbeat \
         50 ms, election timeout 250 ms). Gangway's agents run inside the benchmark's process \
         and start tasks directly (no task shim); Slurm runs its defaults (no high-throughput \
         tuning). Slurm's backup controller needs a second host name and is not run here.\nmachine: {}; Slurm {slurm_version}; {etcd_version}\n",
        render_table(&rows),
        machine_facts()
    );
    println!("\n{table}");
    if let Some(out) = &a.out {
        std::fs::write(out, &table).with_context(|| format!("out: cannot write {}", out.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each knob is taken at its limit (CALLS_MAX, FAILOVERS_MAX) and
    /// refused one past it, naming the knob.
    #[test]
    fn peers_knobs_stop_at_their_limits() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cmd {
            #[command(flatten)]
            a: PeersArgs,
        }
        let check = |args: &[&str]| {
            let argv = std::iter::once("bench-peers").chain(args.iter().copied());
            Cmd::try_parse_from(argv).expect("options parse").a.check().map_err(|e| e.to_string())
        };
        let (calls, failovers) = (CALLS_MAX.to_string(), FAILOVERS_MAX.to_string());
        let (calls_past, failovers_past) = ((CALLS_MAX + 1).to_string(), (FAILOVERS_MAX + 1).to_string());
        for knob in ["--calls", "--jobs", "--pending"] {
            assert_eq!(check(&[knob, &calls]), Ok(()));
            let e = check(&[knob, &calls_past]).unwrap_err();
            assert!(e.starts_with(knob.trim_start_matches("--")) && e.contains(&calls), "{e}");
        }
        assert_eq!(check(&["--failovers", &failovers]), Ok(()));
        let e = check(&["--failovers", &failovers_past]).unwrap_err();
        assert!(e.starts_with("failovers:") && e.contains(&failovers), "{e}");
    }

    fn cell(v: f64) -> Option<Cell> {
        Some(Cell { value: v, text: format!("{v}") })
    }

    #[test]
    fn the_ratio_compares_gangway_with_the_best_peer_in_the_rows_direction() {
        let rate = Row {
            what: "w".into(),
            better: Better::Higher,
            slurm: cell(40.0),
            etcd: cell(600.0),
            gangway: cell(1200.0),
        };
        assert_eq!(ratio(&rate), Some(2.0));
        let latency = Row { better: Better::Lower, slurm: cell(20.0), etcd: None, gangway: cell(40.0), ..rate.clone() };
        assert_eq!(ratio(&latency), Some(0.5));
        let alone = Row { slurm: None, etcd: None, ..rate.clone() };
        assert_eq!(ratio(&alone), None);
        let t = render_table(&[rate, latency, alone]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert!(lines[2].ends_with("| 2.0× better |"), "{t}");
        assert!(lines[3].ends_with("| 2.0× worse |"), "{t}");
        assert!(lines[4].contains("| — | — | 1200 | — |"), "{t}");
    }

    #[test]
    fn a_cell_cannot_break_the_table() {
        let r = Row {
            what: "w".into(),
            better: Better::Higher,
            slurm: None,
            etcd: None,
            gangway: Some(Cell { value: 1.0, text: "a|b".into() }),
        };
        assert!(render_table(&[r]).contains("| a/b |"));
    }

    #[test]
    fn slurm_gets_one_line_per_emulated_node_with_its_own_port() {
        let conf = slurm_conf(Path::new("/x"), "host", Path::new("/x/munge/socket")).unwrap();
        let nodes: Vec<&str> = conf.lines().filter(|l| l.starts_with("NodeName=")).collect();
        assert_eq!(nodes.len(), BATCH_NODES);
        let ports: std::collections::BTreeSet<&str> =
            nodes.iter().filter_map(|l| l.split_whitespace().find(|w| w.starts_with("Port="))).collect();
        assert_eq!(ports.len(), BATCH_NODES, "{conf}");
        assert!(conf.contains("AuthInfo=socket=/x/munge/socket"));
    }
}
