//! The node agent (`gangway agent`): finds the host's resources, registers the
//! node with the controllers and keeps heartbeating, following the leader
//! through failovers (replicas forward to the leader; the client library fails
//! over between replicas).
//!
//! Each heartbeat says which tasks run here; the leader answers which should,
//! with launch orders for the missing ones. The agent starts those (after
//! recording their fence on disk), stops tasks that should no longer run, and
//! reports every task's exit. Orders follow committed state only, so a gang's
//! members start only after its whole allocation is committed.
//!
//! Related code: `proto/src/client.rs` (failover), `controller/src/api/agent.rs`.

pub mod cgroup;
pub mod fence;
pub mod health;
pub mod inventory;
pub mod launch;
pub mod nvml;
pub mod shim;
pub mod steps;
pub mod supervisor;
pub mod telemetry;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use gangway_proto::client::Client;
use gangway_proto::v1::{GpuInventory, HeartbeatRequest, RegisterRequest, TaskExitReport, TaskRef};

/// Pause after a failed register or heartbeat round (the client already retried
/// every replica); short so that the node is back quickly after an outage.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Bounds the heartbeat interval a controller can ask for.
const HEARTBEAT_INTERVAL_MIN_MS: u64 = 100;
const HEARTBEAT_INTERVAL_MAX_MS: u64 = 60_000;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub controllers: Vec<String>,
    pub name: String,
    pub addr: String,
    pub cpus: u32,
    pub mem_mb: u64,
    pub gpus: Vec<GpuInventory>,
    pub topology: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub identity: String,
    /// Mutual TLS with this node's agent certificate (`agent/NAME`), or `Insecure`.
    pub security: gangway_proto::tls::Security,
    /// Whether tasks may run as root (refused by default).
    pub allow_root_jobs: bool,
    /// Where the agent keeps its launch fences and batch scripts.
    pub state_dir: std::path::PathBuf,
    /// Time between SIGTERM and SIGKILL when a task is stopped.
    pub stop_grace: Duration,
    /// The simulated GPU provider's fault file (see `health.rs`).
    pub gpu_fault_file: Option<std::path::PathBuf>,
    /// How long a failed GPU must stay healthy before it is reported recovered.
    pub gpu_hold_down: Duration,
    /// NVML, when the GPUs are real (their health is then checked every heartbeat).
    pub nvml: Option<std::sync::Arc<nvml::NvmlProvider>>,
    /// A site health check (like Slurm's HealthCheckProgram) and how often to
    /// run it: a non-zero exit drains the node with the program's first line of
    /// output as the reason (an admin resumes it).
    pub health_check: Option<(std::path::PathBuf, Duration)>,
    /// The `gangway` binary, to run each task under `gangway task-shim` so
    /// tasks outlive the agent and are re-adopted when it restarts.
    pub shim: Option<std::path::PathBuf>,
    /// Kill every task when the agent stops (dev clusters and tests); a real
    /// agent leaves them running for its next start to re-adopt.
    pub kill_tasks_on_exit: bool,
    /// Serve Prometheus metrics at this address (`GET /metrics`); None: off.
    pub metrics_listen: Option<String>,
    /// Serve the metrics over TLS, only to these scrapers' client
    /// certificates (`None`: plain HTTP).
    pub metrics_tls: Option<Vec<String>>,
    /// Serve the step service (srun's steps on this node) at this address;
    /// None: off (batch jobs then cannot start steps here). Other nodes reach
    /// it at `addr` (or the node's name when `addr` is empty) and its port.
    pub step_listen: Option<String>,
}

/// Longest a health-check program may run before it counts as failed.
const HEALTH_CHECK_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the site health check on its interval; drains the node when it fails.
async fn health_check_loop(client: std::sync::Arc<Client>, node: String, program: std::path::PathBuf, every: Duration) {
    use gangway_proto::v1::node_service_client::NodeServiceClient;
    let mut drained = false;
    loop {
        tokio::time::sleep(every).await;
        let run = tokio::process::Command::new(&program).kill_on_drop(true).output();
        let failure = match tokio::time::timeout(HEALTH_CHECK_TIMEOUT, run).await {
            Err(_) => Some(format!("timed out after {}s", HEALTH_CHECK_TIMEOUT.as_secs())),
            Ok(Err(e)) => Some(format!("cannot run {}: {e}", program.display())),
            Ok(Ok(out)) if !out.status.success() => {
                let text =
                    String::from_utf8_lossy(if out.stdout.is_empty() { &out.stderr } else { &out.stdout }).into_owned();
                Some(text.lines().next().unwrap_or("failed").chars().take(200).collect())
            }
            Ok(Ok(_)) => None,
        };
        match failure {
            Some(why) if !drained => {
                tracing::warn!(node = %node, %why, "health check failed: draining the node");
                let req =
                    gangway_proto::v1::DrainRequest { name: node.clone(), reason: format!("health check: {why}") };
                let done = client
                    .call(|ch| {
                        let r = client.request(req.clone());
                        async move { NodeServiceClient::new(ch).drain(r).await }
                    })
                    .await;
                drained = done.is_ok();
            }
            Some(_) => {}
            None => drained = false,
        }
    }
}

/// Keeps a `WatchNode` stream open to any replica and wakes the main loop on
/// each notice, so launches and stops happen at once rather than at the next
/// heartbeat. Reconnects after a short pause when the stream breaks; bounded by
/// the agent's life.
async fn watch_node_loop(client: std::sync::Arc<Client>, node: String, poke: std::sync::Arc<tokio::sync::Notify>) {
    use gangway_proto::v1::WatchNodeRequest;
    loop {
        let req = WatchNodeRequest { name: node.clone() };
        let stream = client
            .call(|ch| {
                let r = client.stream_request(req.clone());
                async move { gangway_proto::limits::agent_client(ch).watch_node(r).await }
            })
            .await;
        if let Ok(stream) = stream {
            let mut stream = stream.into_inner();
            // After (re)connecting, reconcile once: notices may have been missed.
            poke.notify_one();
            while let Ok(Some(_)) = stream.message().await {
                poke.notify_one();
            }
        }
        tokio::time::sleep(RETRY_PAUSE / 5).await;
    }
}

/// Stops a background task when the agent stops.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Default hold-down before a recovered GPU returns to service.
pub const GPU_HOLD_DOWN_DEFAULT: Duration = Duration::from_secs(60);

impl AgentConfig {
    /// A simulated node run inside another process (dev cluster, benchmarks,
    /// tests): loopback rendezvous, no GPUs, default timings, tasks run directly
    /// (no shim) and are killed when the agent stops. Callers override the rest.
    pub fn simulated(controllers: Vec<String>, name: &str, state_dir: std::path::PathBuf) -> AgentConfig {
        AgentConfig {
            controllers,
            name: name.to_string(),
            addr: "127.0.0.1".into(),
            cpus: 64,
            mem_mb: 64 * 1024,
            gpus: Vec::new(),
            topology: Vec::new(),
            labels: BTreeMap::new(),
            identity: "agent".into(),
            security: gangway_proto::tls::Security::Insecure,
            allow_root_jobs: true,
            gpu_fault_file: Some(state_dir.join("gpu-faults")),
            state_dir,
            stop_grace: supervisor::STOP_GRACE_DEFAULT,
            gpu_hold_down: GPU_HOLD_DOWN_DEFAULT,
            nvml: None,
            health_check: None,
            shim: None,
            kill_tasks_on_exit: true,
            metrics_listen: None,
            metrics_tls: None,
            step_listen: Some("127.0.0.1:0".into()),
        }
    }

    /// `step_port`: where the step service listens, when it does.
    fn register_request(&self, step_port: Option<u16>) -> RegisterRequest {
        RegisterRequest {
            name: self.name.clone(),
            addr: match step_port {
                Some(port) => format!("{}:{port}", self.addr),
                None => self.addr.clone(),
            },
            cpus: self.cpus,
            mem_mb: self.mem_mb,
            gpus: self.gpus.clone(),
            topology: self.topology.clone(),
            labels: self.labels.clone().into_iter().collect(),
        }
    }
}

/// Exit reports kept for delivery while the controllers are unreachable; beyond
/// this the oldest are dropped (the leader then learns of them as lost tasks).
const PENDING_EXITS_MAX: usize = 10_000;

/// Task exits waiting to be reported to the leader, oldest first.
struct Exits {
    rx: tokio::sync::mpsc::Receiver<TaskExitReport>,
    pending: std::collections::VecDeque<TaskExitReport>,
}

impl Exits {
    /// Takes one exit from the supervisor. A task the node stopped on its own
    /// (cut off) is reported lost, to be requeued, unless it had ended cleanly.
    fn take(&mut self, mut report: TaskExitReport, tasks: &mut supervisor::Supervisor) {
        let stopped_here = tasks.forget((report.job_id, report.attempt));
        let clean = report.exit_code == Some(0) && report.signal.is_none();
        if stopped_here && !clean {
            report.lost = true;
            report.reason = "stopped by its node: cut off from every controller".into();
        }
        if self.pending.len() >= PENDING_EXITS_MAX {
            self.pending.pop_front();
        }
        self.pending.push_back(report);
    }

    /// Takes every exit already received, so that a task that has ended is
    /// never taken for a running one.
    fn drain(&mut self, tasks: &mut supervisor::Supervisor) {
        while let Ok(report) = self.rx.try_recv() {
            self.take(report, tasks);
        }
    }
}

/// How often the self-fence is checked, also while a call to the controllers
/// hangs: its deadlines are honoured to within this.
const SELF_FENCE_TICK: Duration = Duration::from_millis(100);

/// One call attempt's deadline is this share of the node-down timeout (within
/// the bounds below), so an agent whose controller went silent tries the next
/// one long before the leader could declare its node down.
const CALL_TIMEOUT_SHARE: u32 = 4;
const CALL_TIMEOUT_MIN: Duration = Duration::from_millis(500);
const CALL_TIMEOUT_MAX: Duration = Duration::from_secs(10);

/// The agent's half of fencing. The leader declares a node down (and starts its
/// jobs elsewhere) after `down_timeout` without a heartbeat; an agent that has
/// not reached a leader for half of it stops its tasks, and kills them by three
/// quarters of it. Contact is timed from when a heartbeat was sent, and the
/// deadlines are checked on a clock of their own, also while a call hangs in a
/// lossy network, so the node's tasks are gone before the leader can act.
struct SelfFence {
    /// The leader's node-down timeout (from registration).
    down_timeout: Duration,
    /// When the last heartbeat a leader answered was sent.
    last_contact: Instant,
}

impl SelfFence {
    fn call_timeout(&self) -> Duration {
        (self.down_timeout / CALL_TIMEOUT_SHARE).clamp(CALL_TIMEOUT_MIN, CALL_TIMEOUT_MAX)
    }

    fn check(&self, tasks: &mut supervisor::Supervisor, exits: &mut Exits) {
        exits.drain(tasks);
        if self.last_contact.elapsed() >= self.down_timeout / 2 {
            let grace = tasks.stop_grace().min(self.down_timeout / 4);
            for key in tasks.running() {
                if tasks.stop_lost(key, grace) {
                    tracing::warn!(job = key.0, attempt = key.1, "cut off from every controller: stopping the task");
                }
            }
        }
        tasks.enforce_kills();
    }

    /// Awaits a call to the controllers, checking the fence every tick while
    /// it is outstanding (the call bounds itself: `Client::call`'s deadline).
    async fn await_fenced<F: Future>(
        &self,
        call: F,
        tasks: &mut supervisor::Supervisor,
        exits: &mut Exits,
    ) -> F::Output {
        tokio::pin!(call);
        loop {
            tokio::select! {
                out = &mut call => return out,
                _ = tokio::time::sleep(SELF_FENCE_TICK) => self.check(tasks, exits),
            }
        }
    }
}

/// Runs the agent until `shutdown` completes. Its loop is bounded by the agent's
/// life: one register/heartbeat round per interval, woken early by task exits.
pub async fn run(config: AgentConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if let Some(creds) = config.security.credentials() {
        let want = gangway_proto::tls::Principal::new(gangway_proto::tls::Role::Agent, &config.name)
            .map_err(|e| anyhow::anyhow!("node name: {e}"))?;
        let have = creds.principal();
        if have.as_ref() != Some(&want) {
            anyhow::bail!(
                "the agent certificate names {}, but this node is '{}': create one with `gangway tls cert create --agent {}`",
                have.map_or_else(|| "no principal".to_string(), |p| p.to_string()),
                config.name,
                config.name
            );
        }
    }
    let client = std::sync::Arc::new(Client::new(&config.controllers, &config.identity, &config.security)?);
    let _health_check = config.health_check.clone().map(|(program, every)| {
        AbortOnDrop(tokio::spawn(health_check_loop(client.clone(), config.name.clone(), program, every)))
    });
    gangway_proto::telemetry::recorder();
    let view = std::sync::Arc::new(std::sync::Mutex::new(telemetry::View::default()));
    let _metrics = match &config.metrics_listen {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("metrics-listen: cannot bind {addr}: {e}"))?;
            tracing::info!(addr = %l.local_addr()?, "serving metrics");
            let tls = config.security.credentials().cloned();
            let metrics_tls = match (&tls, &config.metrics_tls) {
                (Some(c), Some(scrapers)) => Some(gangway_proto::telemetry::MetricsTls {
                    config: c.server_config_for(b"http/1.1").map_err(|e| anyhow::anyhow!("metrics TLS: {e}"))?,
                    scrapers: scrapers.clone(),
                }),
                (None, Some(_)) => anyhow::bail!("metrics-tls: needs the agent's certificate (not --insecure)"),
                (_, None) => None,
            };
            let (name, gpus, nvml) = (config.name.clone(), config.gpus.clone(), config.nvml.clone());
            let task = telemetry::serve(l, name, gpus, view.clone(), nvml, tls, metrics_tls);
            Some(AbortOnDrop(task))
        }
        None => None,
    };
    let poke = std::sync::Arc::new(tokio::sync::Notify::new());
    let _watch = AbortOnDrop(tokio::spawn(watch_node_loop(client.clone(), config.name.clone(), poke.clone())));
    let mut fences = fence::FenceStore::open(&config.state_dir)
        .map_err(|e| anyhow::anyhow!("state-dir: cannot use {}: {e}", config.state_dir.display()))?;
    supervisor::reachable_not_listable(&config.state_dir)
        .map_err(|e| anyhow::anyhow!("state-dir: {}: {e}", config.state_dir.display()))?;
    let (mut tasks, exits_rx) = supervisor::Supervisor::new(
        &config.name,
        &config.state_dir,
        config.stop_grace,
        config.gpus.len(),
        config.shim.clone(),
    );
    tasks.allow_root_jobs = config.allow_root_jobs;
    if !nix::unistd::geteuid().is_root() {
        let me = nix::unistd::User::from_uid(nix::unistd::geteuid()).ok().flatten().map(|u| u.name);
        tracing::warn!(
            user = me.as_deref().unwrap_or("unknown"),
            "this agent does not run as root: it runs only its own user's jobs and refuses the others'"
        );
    }
    if let Some(creds) = config.security.credentials() {
        // srun in a job checks the other nodes' agents against the cluster's CA.
        let ca = std::fs::read_to_string(&creds.files().ca)
            .map_err(|e| anyhow::anyhow!("tls-ca: {}: {e}", creds.files().ca.display()))?;
        tasks.step_ca_pem = Some(ca);
    }
    tasks.adopt_all();
    tasks.provide_job_tools(&config.state_dir, &config.controllers);
    let (_steps, step_port) = match &config.step_listen {
        Some(addr) => {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("step-listen: cannot bind {addr}: {e}"))?;
            let port = l.local_addr()?.port();
            tracing::info!(addr = %l.local_addr()?, "serving steps");
            (
                Some(AbortOnDrop(steps::serve(
                    l,
                    &config.name,
                    tasks.step_hosts(),
                    config.security.clone(),
                    config.shim.clone(),
                )?)),
                Some(port),
            )
        }
        None => (None, None),
    };
    let mut exits = Exits { rx: exits_rx, pending: std::collections::VecDeque::new() };
    let mut gpu_health = health::GpuHealthMonitor::new(
        config.gpus.len(),
        config.gpu_fault_file.clone(),
        config.nvml.clone(),
        config.gpu_hold_down,
    );
    tokio::pin!(shutdown);
    let mut registered = false;
    let mut interval = Duration::from_secs(1);
    let mut last_health: Vec<gangway_proto::v1::GpuHealthReport> = Vec::new();
    let mut fence_clock = SelfFence { down_timeout: Duration::from_secs(10), last_contact: Instant::now() };
    loop {
        let per_try = fence_clock.call_timeout();
        let round: Result<(), tonic::Status> = async {
            if !registered {
                let req = config.register_request(step_port);
                let sent = Instant::now();
                let call = client.call(|ch| {
                    let mut r = client.request(req.clone());
                    r.set_timeout(per_try);
                    async move { gangway_proto::limits::agent_client(ch).register(r).await }
                });
                let resp = fence_clock.await_fenced(call, &mut tasks, &mut exits).await?.into_inner();
                let ms = resp.heartbeat_interval_ms.clamp(HEARTBEAT_INTERVAL_MIN_MS, HEARTBEAT_INTERVAL_MAX_MS);
                interval = Duration::from_millis(ms);
                if resp.node_down_timeout_ms > 0 {
                    fence_clock.down_timeout = Duration::from_millis(resp.node_down_timeout_ms);
                }
                fence_clock.last_contact = sent;
                tracing::info!(node = %config.name, "registered");
                registered = true;
                return Ok(());
            }
            // Report ended tasks first, so the leader does not relaunch them.
            while let Some(report) = exits.pending.pop_front() {
                let call = client.call(|ch| {
                    let mut r = client.request(report.clone());
                    r.set_timeout(per_try);
                    async move { gangway_proto::limits::agent_client(ch).report_task_exit(r).await }
                });
                if let Err(e) = fence_clock.await_fenced(call, &mut tasks, &mut exits).await {
                    exits.pending.push_front(report);
                    return Err(e);
                }
            }
            let running: Vec<TaskRef> =
                tasks.running().into_iter().map(|(job_id, attempt)| TaskRef { job_id, attempt }).collect();
            let req = HeartbeatRequest { name: config.name.clone(), running, gpu_health: gpu_health.poll() };
            last_health.clone_from(&req.gpu_health);
            // Contact counts from when the heartbeat left, never from when the
            // answer came back: the leader heard it no earlier than that.
            let sent = Instant::now();
            let call = client.call(|ch| {
                let mut r = client.request(req.clone());
                r.set_timeout(per_try);
                async move { gangway_proto::limits::agent_client(ch).heartbeat(r).await }
            });
            let resp = fence_clock.await_fenced(call, &mut tasks, &mut exits).await?.into_inner();
            if !resp.known {
                tracing::warn!(node = %config.name, "controller does not know this node (or marked it down): registering again");
                registered = false;
                return Ok(());
            }
            // An answer from a leader older than one already obeyed is stale.
            if !fences.accept_term(resp.term).unwrap_or(false) {
                tracing::warn!(term = resp.term, max = fences.max_term, "ignoring orders from a stale leader");
                return Ok(());
            }
            let desired: std::collections::BTreeSet<(u64, u32)> =
                resp.desired.iter().map(|t| (t.job_id, t.attempt)).collect();
            fence_clock.last_contact = sent;
            for key in tasks.running() {
                if !desired.contains(&key) {
                    let grace = resp
                        .stops
                        .iter()
                        .find(|s| (s.job_id, s.attempt) == key)
                        .map_or(tasks.stop_grace(), |s| Duration::from_secs(u64::from(s.grace_s)));
                    tasks.stop(key, grace);
                }
            }
            for order in &resp.launch {
                // A preempted task may still hold these GPUs during its grace:
                // the new task starts once it is gone (the order comes again).
                if tasks.gpus_in_use(&order.gpus) {
                    tracing::debug!(job = order.job_id, "GPUs still held by a stopping task; launching later");
                    continue;
                }
                // A refused fence means this attempt already ran here and its task
                // is gone (it died with a previous agent process): lost, not failed.
                let (outcome, lost) = match fences.admit(order.job_id, order.attempt) {
                    Err(reason) => (Err(format!("task lost: {reason}")), true),
                    Ok(()) => (tasks.launch(order), false),
                };
                if let Err(reason) = outcome {
                    tracing::warn!(job = order.job_id, attempt = order.attempt, %reason, "launch failed");
                    exits.pending.push_back(TaskExitReport {
                        node: config.name.clone(),
                        job_id: order.job_id,
                        attempt: order.attempt,
                        exit_code: None,
                        signal: None,
                        reason,
                        lost,
                        peak_mem_mb: None,
                    });
                }
            }
            Ok(())
        }
        .await;
        fence_clock.check(&mut tasks, &mut exits);
        {
            let mut v = view.lock().expect("view lock");
            v.registered = registered;
            v.last_contact = Some(fence_clock.last_contact);
            v.tasks_running = tasks.running().len();
            v.gpu_jobs = tasks.gpu_jobs();
            v.health = last_health.clone();
        }
        let pause = match round {
            Ok(()) if registered && exits.pending.is_empty() => interval,
            Ok(()) => Duration::ZERO,
            Err(status) => {
                tracing::warn!(node = %config.name, error = %status.message(), "controllers unreachable; retrying");
                RETRY_PAUSE
            }
        };
        let wake = tokio::time::Instant::now() + pause;
        // Bounded by `wake`: one pass per self-fence tick until then.
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    if config.kill_tasks_on_exit {
                        tasks.kill_all();
                    }
                    return Ok(());
                }
                _ = tokio::time::sleep_until(wake) => break,
                _ = poke.notified(), if registered => break,
                Some(report) = exits.rx.recv() => {
                    exits.take(report, &mut tasks);
                    break;
                }
                _ = tokio::time::sleep(SELF_FENCE_TICK) => fence_clock.check(&mut tasks, &mut exits),
            }
        }
    }
}
