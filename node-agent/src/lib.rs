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

// This crate parses what the network sends: an overflow must never panic the daemon.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects, clippy::cast_possible_truncation))]

pub mod cgroup;
pub mod devices;
pub mod fence;
pub mod health;
pub mod inventory;
pub mod kept;
pub mod launch;
pub mod lease;
pub mod nvml;
pub mod process;
pub mod shim;
pub mod steps;
pub mod supervisor;
pub mod telemetry;
pub mod terminal;
pub mod usage;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use gangway_core::agent::{Action, AgentCore, Answer, Exit};
use gangway_proto::client::Client;
use gangway_proto::v1::{GpuInventory, RegisterRequest, TaskExitReport};

/// Pause after a failed register or heartbeat round (the client already retried
/// every replica); short so that the node is back quickly after an outage.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Pause after the controllers refused to register this node (not admitted
/// by the node inventory, or a name its certificate does not bind): an
/// admin's change is needed, so the agent asks again at a pace that keeps
/// its log readable, and is back within this long once admitted.
const REFUSED_PAUSE: Duration = Duration::from_secs(10);
/// Replica names a heartbeat answer may list as the membership: Raft
/// clusters are 3 to 7 voters and a few learners; a longer list is ignored.
const MEMBERS_MAX: usize = 64;
/// Pause before reopening a broken `WatchNode` stream: a fifth of RETRY_PAUSE.
const WATCH_RETRY_PAUSE: Duration = RETRY_PAUSE.checked_div(5).expect("5 is not zero");

/// About thirty years (tokio's own "far future"): where a deadline past the
/// clock's range lands.
const FAR_FUTURE: Duration = Duration::from_secs(30 * 365 * 24 * 60 * 60);

/// The instant `d` after `now`. A `d` past the clock's range (a time limit or
/// interval the network sent) gives a deadline about thirty years on instead
/// of an overflow panic.
pub fn instant_after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d).or_else(|| now.checked_add(FAR_FUTURE)).unwrap_or(now)
}

/// [`instant_after`] from now.
pub fn deadline_in(d: Duration) -> Instant {
    instant_after(Instant::now(), d)
}

/// [`deadline_in`] on tokio's clock (which tests may pause).
pub fn tokio_deadline_in(d: Duration) -> tokio::time::Instant {
    tokio::time::Instant::from_std(instant_after(tokio::time::Instant::now().into_std(), d))
}

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
    /// Confine each task to its own GPUs (a cgroup v1 devices cgroup).
    pub constrain_devices: bool,
    /// Where the agent keeps its launch fences and batch scripts.
    pub state_dir: std::path::PathBuf,
    /// Time between SIGTERM and SIGKILL when a task is stopped.
    pub stop_grace: Duration,
    /// The simulated GPU provider's fault file (see `health.rs`).
    pub gpu_fault_file: Option<std::path::PathBuf>,
    /// The simulated GPUs' load file (see `usage.rs`), sampled into jobs' usage.
    pub gpu_load_file: Option<std::path::PathBuf>,
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
        tokio::time::sleep(WATCH_RETRY_PAUSE).await;
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
            constrain_devices: false,
            gpu_fault_file: Some(state_dir.join("gpu-faults")),
            gpu_load_file: Some(state_dir.join("gpu-load")),
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

/// How often the self-fence is checked, also while a call to the controllers
/// hangs: its deadlines are honoured to within this.
const SELF_FENCE_TICK: Duration = Duration::from_millis(100);

/// The agent's decisions (`gangway_core::agent::AgentCore`) with the I/O they
/// need: the supervisor that runs tasks, the fence store on disk, the exits
/// the supervisor reports, and the agent's monotonic clock.
struct Shell {
    core: AgentCore,
    tasks: supervisor::Supervisor,
    fences: fence::FenceStore,
    exits: tokio::sync::mpsc::Receiver<TaskExitReport>,
    node: String,
    /// The lease last written (see `lease.rs`).
    lease: Option<(u64, u64)>,
}

impl Shell {
    /// Milliseconds on the system's monotonic clock (the shims read the
    /// lease on the same clock).
    fn now_ms() -> u64 {
        lease::now_ms().unwrap_or(0)
    }

    /// Writes the lease when contact moved it; before any launch, so a new
    /// task's shim never reads a lease that ran out before it started. An
    /// error means launches must not happen (their shims would stop them).
    fn renew_lease(&mut self) -> Result<(), String> {
        let lease = self.core.lease();
        if self.lease == Some(lease) {
            return Ok(());
        }
        let path = self.tasks.lease_path();
        let written = path
            .parent()
            .map_or(Ok(()), |dir| std::fs::create_dir_all(dir).and_then(|()| supervisor::reachable_not_listable(dir)))
            .and_then(|()| lease::write(&path, lease::Lease { stop_at_ms: lease.0, kill_at_ms: lease.1 }));
        match written {
            Ok(()) => {
                self.lease = Some(lease);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, path = %path.display(), "cannot renew the agent's lease: launching nothing");
                Err(format!("cannot renew the agent's lease {}: {e}", path.display()))
            }
        }
    }

    /// Takes one exit from the supervisor.
    fn take(&mut self, report: TaskExitReport) {
        self.tasks.forget((report.job_id, report.attempt));
        self.core.task_exited(exit_from_report(report));
    }

    /// Takes every exit already received, so that a task that has ended is
    /// never taken for a running one.
    fn drain(&mut self) {
        while let Ok(report) = self.exits.try_recv() {
            self.take(report);
        }
    }

    /// The self-fence (see `AgentCore::tick`) and the kill deadlines.
    fn check(&mut self) {
        self.drain();
        let actions = self.core.tick(Self::now_ms());
        for a in &actions {
            if let Action::Stop { task, .. } = a {
                tracing::warn!(job = task.0, attempt = task.1, "cut off from every controller: stopping the task");
            }
        }
        self.perform(actions, &[]);
        self.tasks.enforce_kills();
        self.tasks.keep_suspended();
    }

    /// Carries out the core's actions, in order; `orders` holds the launch
    /// orders the actions name.
    fn perform(&mut self, actions: Vec<Action>, orders: &[gangway_proto::v1::LaunchOrder]) {
        // The node's fault, not the job's: such launches are reported lost.
        let mut unrecorded: Option<String> = self.renew_lease().err();
        for action in actions {
            match action {
                Action::PersistFences => {
                    if let Err(e) = self.fences.save(self.core.fences()) {
                        tracing::error!(error = %e, "cannot record the launch fences: launching nothing");
                        unrecorded = Some(format!("cannot record the launch fence: {e}"));
                    }
                }
                Action::Launch(key) => {
                    let outcome = match (&unrecorded, orders.iter().find(|o| (o.job_id, o.attempt) == key)) {
                        (Some(why), _) => Err((why.clone(), true)),
                        (None, None) => Err(("no launch order for the task".to_string(), false)),
                        (None, Some(order)) => self.tasks.launch(order).map_err(|why| (why, false)),
                    };
                    if let Err((reason, lost)) = outcome {
                        tracing::warn!(job = key.0, attempt = key.1, %reason, "launch failed");
                        self.core.launch_failed(key, reason, lost);
                    }
                }
                Action::Stop { task, grace_ms } => self.tasks.stop(task, Duration::from_millis(grace_ms)),
                Action::Suspend(task) => self.tasks.suspend(task),
                Action::Resume(task) => self.tasks.resume(task),
                Action::Signal { task, signal, target } => self.tasks.signal(task, signal, target),
            }
        }
    }

    /// Awaits a call to the controllers, checking the fence every tick while
    /// it is outstanding (the call bounds itself: `Client::call`'s deadline).
    async fn await_fenced<F: Future>(&mut self, call: F) -> F::Output {
        tokio::pin!(call);
        loop {
            tokio::select! {
                out = &mut call => return out,
                _ = tokio::time::sleep(SELF_FENCE_TICK) => self.check(),
            }
        }
    }

    fn report(&self, exit: &Exit) -> TaskExitReport {
        TaskExitReport {
            node: self.node.clone(),
            job_id: exit.task.0,
            attempt: exit.task.1,
            exit_code: exit.exit_code,
            signal: exit.signal,
            reason: exit.reason.clone(),
            lost: exit.lost,
            peak_mem_mb: exit.peak_mem_mb,
            usage: exit.usage.map(usage::to_proto),
        }
    }
}

fn exit_from_report(r: TaskExitReport) -> Exit {
    Exit {
        task: (r.job_id, r.attempt),
        exit_code: r.exit_code,
        signal: r.signal,
        reason: r.reason,
        lost: r.lost,
        peak_mem_mb: r.peak_mem_mb,
        usage: r.usage.map(|u| usage::from_proto(&u)),
    }
}

/// The membership a heartbeat answer names, when it names one of at most
/// MEMBERS_MAX replicas.
fn members_of(resp: &gangway_proto::v1::HeartbeatResponse) -> Option<std::collections::BTreeSet<String>> {
    (!resp.members.is_empty() && resp.members.len() <= MEMBERS_MAX).then(|| resp.members.iter().cloned().collect())
}

/// A leader's heartbeat answer as the agent's core reads it (the codec the
/// controller writes it with: `gangway_proto::orders`).
pub fn answer_from(resp: &gangway_proto::v1::HeartbeatResponse) -> Answer {
    gangway_proto::orders::answer_from_proto(resp)
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
    let client = std::sync::Arc::new(Client::new(&config.controllers, &config.identity, &config.security)?.for_fleet());
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
    let (fence_store, fences) = fence::FenceStore::open(&config.state_dir)
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
    if config.constrain_devices {
        anyhow::ensure!(
            tasks.constrain_devices(),
            "constrain-devices: this host has no cgroup v1 devices controller (/sys/fs/cgroup/devices): on cgroup v2 \
             alone, devices are not filtered yet"
        );
        tracing::info!("each task may open only its own GPUs (a devices cgroup per task)");
    } else if !config.gpus.is_empty() {
        tracing::info!("tasks are not kept from each other's GPUs (--constrain-devices): CUDA_VISIBLE_DEVICES says which are theirs");
    }
    let gpu_source = match (&config.nvml, &config.gpu_load_file) {
        (Some(nvml), _) => usage::GpuSource::Nvml(nvml.clone()),
        (None, Some(file)) => usage::GpuSource::File(file.clone()),
        (None, None) => usage::GpuSource::None,
    };
    tasks.usage = Some(std::sync::Arc::new(usage::Sampler::new(gpu_source, config.gpus.len())));
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
        tasks.step_cluster = creds.cluster();
    }
    tasks.adopt_all();
    tasks.provide_job_tools(&config.state_dir, &config.controllers);
    // Step tasks outlive a restart of this agent (with its shim).
    let keeping = config.shim.as_ref().map(|_| {
        let dir = config.state_dir.join("steps");
        steps::Keeping {
            steps: kept::KeptSteps::load(&dir, kept::RESUME_WAIT, config.stop_grace),
            dir,
            lease: tasks.lease_path(),
        }
    });
    let members = steps::Members::default();
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
                    steps::StepServer::new(
                        &config.name,
                        tasks.step_hosts(),
                        config.security.clone(),
                        config.shim.clone(),
                        tasks.job_tools_dir(),
                        keeping,
                    )
                    .with_members(members.clone()),
                )?)),
                Some(port),
            )
        }
        None => (None, None),
    };
    let stop_grace_ms = u64::try_from(config.stop_grace.as_millis()).unwrap_or(u64::MAX);
    let mut shell = Shell {
        core: AgentCore::new(fences, stop_grace_ms, Shell::now_ms()),
        tasks,
        fences: fence_store,
        exits: exits_rx,
        node: config.name.clone(),
        lease: None,
    };
    for (key, gpus) in shell.tasks.running() {
        shell.core.adopt(key, gpus);
    }
    let mut gpu_health = health::GpuHealthMonitor::new(
        config.gpus.len(),
        config.gpu_fault_file.clone(),
        config.nvml.clone(),
        config.gpu_hold_down,
    );
    tokio::pin!(shutdown);
    let mut last_health: Vec<gangway_proto::v1::GpuHealthReport> = Vec::new();
    loop {
        let per_try = Duration::from_millis(shell.core.call_timeout_ms());
        let round: Result<(), tonic::Status> = async {
            // The core says what to call (`AgentCore::next_call`, as in the
            // simulation): register, then every exit waiting, then the
            // heartbeat, with the exits that came in until now taken first.
            shell.drain();
            let (running, seen_index) = loop {
                match shell.core.next_call() {
                    gangway_core::agent::Call::Register => {
                        let req = config.register_request(step_port);
                        let sent = Shell::now_ms();
                        let call = client.call(|ch| {
                            let mut r = client.request(req.clone());
                            r.set_timeout(per_try);
                            async move { gangway_proto::limits::agent_client(ch).register(r).await }
                        });
                        let resp = shell.await_fenced(call).await?.into_inner();
                        shell.core.registered_at(sent, resp.node_down_timeout_ms, resp.heartbeat_interval_ms);
                        let _ = shell.renew_lease();
                        tracing::info!(node = %config.name, "registered");
                        return Ok(());
                    }
                    // Ended tasks first, so the leader does not relaunch them.
                    gangway_core::agent::Call::Exit(exit) => {
                        let report = shell.report(&exit);
                        let call = client.call(|ch| {
                            let mut r = client.request(report.clone());
                            r.set_timeout(per_try);
                            async move { gangway_proto::limits::agent_client(ch).report_task_exit(r).await }
                        });
                        if let Err(e) = shell.await_fenced(call).await {
                            shell.core.report_failed(exit);
                            return Err(e);
                        }
                    }
                    gangway_core::agent::Call::Heartbeat { running, seen_index } => break (running, seen_index),
                }
            };
            let history = shell.core.fences().history;
            let req = gangway_proto::orders::heartbeat_to_proto(
                &config.name,
                running,
                seen_index,
                history,
                gpu_health.poll(),
            );
            last_health.clone_from(&req.gpu_health);
            // Contact counts from when the heartbeat left (see AgentCore).
            let sent = Shell::now_ms();
            let per_heartbeat = Duration::from_millis(shell.core.heartbeat_call_timeout_ms());
            let call = client.call(|ch| {
                let mut r = client.request(req.clone());
                r.set_timeout(per_heartbeat);
                async move { gangway_proto::limits::agent_client(ch).heartbeat(r).await }
            });
            let mut resp = shell.await_fenced(call).await?.into_inner();
            // Whose step credentials count from now on (a leader that does
            // not say leaves the last word in place).
            if let Some(m) = members_of(&resp) {
                *members.write().expect("members lock") = Some(m);
            }
            // A big gang's order names its nodes as a hostlist: expanded here,
            // and an order that cannot be is not acted on (nor launched).
            resp.launch.retain_mut(|order| match launch::complete_order(order) {
                Ok(()) => true,
                Err(e) => {
                    tracing::error!(error = %e, "ignoring a launch order");
                    false
                }
            });
            let max_term = shell.core.fences().max_term;
            let actions = shell.core.answered(sent, &answer_from(&resp));
            if !resp.known {
                tracing::warn!(node = %config.name, "controller does not know this node (or marked it down): registering again");
            } else if resp.term < max_term {
                tracing::warn!(term = resp.term, max = max_term, "ignoring orders from a stale leader");
            }
            shell.perform(actions, &resp.launch);
            Ok(())
        }
        .await;
        shell.check();
        {
            let mut v = view.lock().expect("view lock");
            v.registered = shell.core.registered();
            let since_contact = Shell::now_ms().saturating_sub(shell.core.last_contact_ms());
            v.last_contact = Instant::now().checked_sub(Duration::from_millis(since_contact));
            v.tasks_running = shell.core.running().len();
            v.gpu_jobs = shell.core.gpu_jobs();
            v.health = last_health.clone();
        }
        let pause = match round {
            Ok(()) if shell.core.registered() && shell.core.reports_pending() == 0 => {
                Duration::from_millis(shell.core.heartbeat_interval_ms())
            }
            Ok(()) => Duration::ZERO,
            Err(status) if status.code() == tonic::Code::PermissionDenied && !shell.core.registered() => {
                tracing::error!(
                    node = %config.name,
                    error = %status.message(),
                    "the controllers refused to register this node; asking again in {} s",
                    REFUSED_PAUSE.as_secs()
                );
                REFUSED_PAUSE
            }
            Err(status) => {
                tracing::warn!(node = %config.name, error = %status.message(), "controllers unreachable; retrying");
                RETRY_PAUSE
            }
        };
        let wake = tokio_deadline_in(pause);
        // Bounded by `wake`: one pass per self-fence tick until then.
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    if config.kill_tasks_on_exit {
                        shell.tasks.kill_all();
                    }
                    return Ok(());
                }
                _ = tokio::time::sleep_until(wake) => break,
                _ = poke.notified(), if shell.core.registered() => break,
                Some(report) = shell.exits.recv() => {
                    shell.take(report);
                    break;
                }
                _ = tokio::time::sleep(SELF_FENCE_TICK) => shell.check(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A heartbeat answer naming MEMBERS_MAX replicas is the membership;
    /// one naming more, or none, leaves the last one in place.
    #[test]
    fn a_membership_names_at_most_members_max_replicas() {
        let answer = |n: usize| gangway_proto::v1::HeartbeatResponse {
            members: (0..n).map(|i| i.to_string()).collect(),
            ..Default::default()
        };
        assert_eq!(members_of(&answer(MEMBERS_MAX)).map(|m| m.len()), Some(MEMBERS_MAX));
        assert_eq!(members_of(&answer(MEMBERS_MAX + 1)), None);
        assert_eq!(members_of(&answer(0)), None);
    }

    #[test]
    fn deadlines_past_the_clocks_range_do_not_panic() {
        let now = Instant::now();
        assert_eq!(instant_after(now, Duration::from_secs(5)), now + Duration::from_secs(5));
        assert!(instant_after(now, Duration::MAX) >= now + Duration::from_secs(365 * 24 * 3600));
        assert!(tokio_deadline_in(Duration::MAX) > tokio::time::Instant::now());
    }
}
