//! The step service: starts the tasks of a job step on this node for `srun`
//! running in the job's batch script on the job's first node (Slurm's srun
//! calling each slurmd), and streams their output and exits back.
//!
//! A step runs inside an allocation this node holds: the task of a batch job
//! on a node other than its first is a *step host* (a process that only waits,
//! see [`HOLD_SCRIPT`]). Each step task leads a process group of its own
//! (joining the host's group is not possible across sessions, e.g. once a
//! restarted agent re-adopted the host), recorded in the host's
//! [`StepGroups`] and its cgroup: everything that stops the job here (its
//! end, a cancel, the self-fence, the warning before the time limit) signals
//! those groups with the host's. A call that is dropped (srun ended or was
//! killed) stops its tasks.
//!
//! Trust: like the controllers' API, the service believes the job id and
//! attempt it is given; it only starts tasks as the job's own user, in a job
//! that runs here. Serve it on the cluster's private network.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use gangway_proto::v1::step_event::Kind;
use gangway_proto::v1::step_service_server::StepService;
use gangway_proto::v1::{StepEvent, StepInput, StepOutput, StepRequest, StepResumeRequest, StepTaskEnd};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

/// What a step host runs: nothing, until it is stopped with the job. It
/// ignores the signals meant for the step's tasks (the `--signal` warning
/// reaches the whole process group), so that only a stop ends it.
pub const HOLD_SCRIPT: &str = "trap '' USR1 USR2 HUP INT ALRM QUIT; while :; do sleep 3600; done";

/// What the first node of an interactive allocation (salloc, srun outside a
/// job) runs: it holds the allocation as [`HOLD_SCRIPT`] does until the
/// client, its command done, puts the command's exit code in the release
/// directory through a step, then exits with it, so the job ends COMPLETED
/// (or FAILED) with that code, as Slurm's salloc jobs do. The directory's
/// name carries `token`, a secret the client chose (the script is readable
/// by its owner only); the script creates it 0700, so no other user can
/// place, link or read anything there. If it exists already, the script
/// only holds (the client then cancels the job).
pub fn release_hold_script(token: &str) -> String {
    let dir = release_dir(token);
    format!(
        "trap '' USR1 USR2 HUP INT ALRM QUIT; d={dir}; \
         if ! mkdir -m 700 \"$d\" 2>/dev/null; then while :; do sleep 3600; done; fi; \
         while [ ! -f \"$d/code\" ] || [ -L \"$d/code\" ]; do sleep 0.5; done; \
         c=$(head -c 8 \"$d/code\"); rm -rf \"$d\"; \
         case $c in ''|*[!0-9]*) exit 1;; esac; exit $((c % 256))"
    )
}

/// The release directory of [`release_hold_script`] for `token` (hex
/// digits and dashes only: anything else is dropped).
pub fn release_dir(token: &str) -> String {
    let safe: String = token.chars().filter(|c| c.is_ascii_hexdigit() || *c == '-').take(64).collect();
    format!("/tmp/gangway-release-{safe}")
}

/// Tasks one step may start on a node (srun's own limit per node).
pub const STEP_TASKS_MAX: usize = 1024;
/// Bytes of environment (names and values) one step request may carry: far
/// above any real environment, and bounded so a request cannot exhaust memory.
pub const STEP_ENV_BYTES_MAX: usize = 4 << 20;
/// Bytes of one message the step service reads: the environment at its
/// limit and a megabyte for the command, the tasks and the rest. (gRPC's
/// default, 4 MiB, would refuse a request at the environment's limit with a
/// transport error before the limit's own, clearer one.)
pub const STEP_MESSAGE_BYTES_MAX: usize = STEP_ENV_BYTES_MAX + (1 << 20);
/// Arguments of a step's command.
pub const STEP_ARGV_MAX: usize = 65_536;
/// Bytes of output per streamed chunk.
const OUTPUT_CHUNK_BYTES: usize = 64 * 1024;
/// Events buffered per step before its tasks' output waits for srun to read
/// (a slow reader slows the tasks down instead of growing memory).
const STEP_EVENTS_QUEUE_MAX: usize = 256;

/// The process groups of a step host's running step tasks.
pub type StepGroups = Arc<Mutex<std::collections::BTreeSet<i32>>>;

/// A job allocation on this node that can host steps.
#[derive(Clone, Debug)]
pub struct StepHost {
    /// The job's task's process group.
    pub pgid: i32,
    /// Its step tasks' process groups (shared with the supervisor's task).
    pub groups: StepGroups,
    /// Where each step task's process group is also noted, so that a
    /// restarted agent finds (and ends) the steps of the agent before it.
    pub steps_file: Option<PathBuf>,
    /// The job's user (uid, gid) when tasks switch user.
    pub ids: Option<(u32, u32)>,
    /// The job's cgroup on cgroup v2 hosts.
    pub cgroup: Option<PathBuf>,
    /// The job's devices cgroup (cgroup v1): its step tasks may open only
    /// the job's GPUs.
    pub devices: Option<PathBuf>,
    /// GPU indexes the job holds on this node.
    pub gpus: Vec<u32>,
    pub workdir: String,
    /// The job is suspended here (set by the supervisor): no step starts
    /// until it is resumed.
    pub suspended: Arc<std::sync::atomic::AtomicBool>,
    /// The shims of its kept step tasks (see `kept.rs`), which a suspend
    /// spares as it spares the task's own (shared with the supervisor's task).
    pub shims: StepGroups,
}

/// The allocations that can host steps, by (job, attempt); kept by the supervisor.
pub type StepHosts = Arc<Mutex<BTreeMap<(u64, u32), StepHost>>>;

/// The replicas of the cluster's membership as the leader last said
/// (`HeartbeatResponse.members`; `None` until it has): a step credential
/// signed by any other replica, a removed one's included, is refused.
pub type Members = Arc<std::sync::RwLock<Option<std::collections::BTreeSet<String>>>>;

pub struct StepServer {
    node: String,
    hosts: StepHosts,
    /// With TLS, a step needs the job's step credential (signed by a
    /// controller replica); an insecure agent takes any step of a running job.
    security: gangway_proto::tls::Security,
    /// The `gangway` binary: a root agent starts step tasks through its
    /// shim, which becomes the user with the user's groups and umask.
    shim: Option<std::path::PathBuf>,
    /// The Slurm command links (see `Supervisor::provide_job_tools`), first
    /// on every step task's PATH as on the job's.
    tools: Option<std::path::PathBuf>,
    /// Where step tasks that outlive a restart of this agent live.
    keeping: Option<Keeping>,
    /// Whose step credentials count.
    members: Members,
}

/// Where kept step tasks live (see `kept.rs`): an agent with a task shim and
/// a state directory keeps the tasks of every step srun names (`step_key`).
#[derive(Clone)]
pub struct Keeping {
    pub dir: PathBuf,
    /// The agent's lease, which kept tasks' shims obey as the job's do.
    pub lease: PathBuf,
    /// What a previous agent process left for srun to resume.
    pub steps: crate::kept::KeptSteps,
}

impl StepServer {
    pub fn new(
        node: &str,
        hosts: StepHosts,
        security: gangway_proto::tls::Security,
        shim: Option<std::path::PathBuf>,
        tools: Option<std::path::PathBuf>,
        keeping: Option<Keeping>,
    ) -> StepServer {
        StepServer { node: node.to_string(), hosts, security, shim, tools, keeping, members: Members::default() }
    }

    /// Refuses credentials of replicas outside `members`.
    pub fn with_members(mut self, members: Members) -> StepServer {
        self.members = members;
        self
    }

    /// The caller must hold this job attempt's step credential naming this node.
    fn check_credential(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        job_id: u64,
        attempt: u32,
    ) -> Result<(), Status> {
        use gangway_proto::step_cred::{verify_by, STEP_CREDENTIAL_METADATA_KEY};
        let Some(creds) = self.security.credentials() else { return Ok(()) };
        let token = metadata
            .get(STEP_CREDENTIAL_METADATA_KEY)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| Status::unauthenticated("a step needs its job's step credential (srun sends it)"))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let refused = |why: String| {
            tracing::warn!(target: "gangway::audit", job_id, attempt, reason = %why, "step refused: bad credential");
            Status::permission_denied(format!("permission: the step credential is not valid here: {why}"))
        };
        let (_, signer) = verify_by(creds, token, job_id, attempt, &self.node, now).map_err(refused)?;
        let member = self.members.read().expect("members lock").as_ref().is_none_or(|m| m.contains(&signer.name));
        if !member {
            return Err(refused(format!("its signer {signer} is not a member of the cluster")));
        }
        Ok(())
    }
}

impl StepServer {
    /// Checks a step request's bounds and finds its allocation here: the
    /// job runs here (this attempt), is not suspended, and holds the GPUs
    /// its tasks ask for.
    async fn admit(&self, r: &StepRequest) -> Result<StepHost, Status> {
        validate(r)?;
        let Some(host) = self.wait_for_host(r.job_id, r.attempt).await else {
            return Err(Status::failed_precondition(format!(
                "job {} attempt {} does not run on {}: no step can start there",
                r.job_id, r.attempt, self.node
            )));
        };
        if host.suspended.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::failed_precondition(format!(
                "job {} is suspended: its steps wait for `scontrol resume {}`",
                r.job_id, r.job_id
            )));
        }
        let per_task = r.gpus_per_task as usize;
        if per_task.saturating_mul(r.tasks.len()) > host.gpus.len() {
            return Err(Status::invalid_argument(format!(
                "gpus_per_task: {} tasks x {per_task} GPUs, but job {} holds {} on {}",
                r.tasks.len(),
                r.job_id,
                host.gpus.len(),
                self.node
            )));
        }
        Ok(host)
    }

    /// The environment of the task `local` of this node's share, in the
    /// order it applies (later wins): srun's, the task's, then the node's.
    fn task_env(&self, r: &StepRequest, host: &StepHost, local: usize) -> Vec<(String, String)> {
        let task = &r.tasks[local];
        let per_task = r.gpus_per_task as usize;
        // `admit` made sure every task's share lies within the job's GPUs.
        let gpus =
            if per_task > 0 { host.gpus.chunks_exact(per_task).nth(local).unwrap_or(&[]) } else { &host.gpus[..] };
        // A confined job's tasks see its GPUs numbered from 0, in the order
        // of their minors (CUDA's, with CUDA_DEVICE_ORDER=PCI_BUS_ID).
        let visible: Vec<String> = match host.devices {
            Some(_) => {
                let mut sorted = host.gpus.clone();
                sorted.sort_unstable();
                gpus.iter().filter_map(|g| sorted.iter().position(|s| s == g)).map(|i| i.to_string()).collect()
            }
            None => gpus.iter().map(u32::to_string).collect(),
        };
        let mut env: Vec<(String, String)> =
            r.env.iter().chain(&task.env).map(|(k, v)| (k.clone(), v.clone())).collect();
        env.push(("CUDA_VISIBLE_DEVICES".into(), visible.join(",")));
        if host.devices.is_some() {
            env.push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
        }
        env.push(("SLURM_GPUS_ON_NODE".into(), host.gpus.len().to_string()));
        env.push(("SLURM_JOB_GPUS".into(), host.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",")));
        env.push(("SLURMD_NODENAME".into(), self.node.clone()));
        if let Some(tools) = &self.tools {
            let path = env.iter().rev().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str());
            let path = crate::supervisor::job_path(path, tools);
            env.push(("PATH".into(), path));
        }
        env
    }

    /// The job's user as the shim switches to it (a root agent), None when
    /// tasks run as the agent's own user; Err names a user unknown here.
    fn task_user(&self, host: &StepHost) -> Result<Option<(std::path::PathBuf, crate::shim::TaskUser)>, String> {
        match (&self.shim, host.ids) {
            (Some(shim), Some((uid, gid))) => match crate::shim::TaskUser::lookup_ids(uid, gid) {
                Some(user) => Ok(Some((shim.clone(), user))),
                None => Err(format!("the job's user (uid {uid}) is unknown on {}", self.node)),
            },
            _ => Ok(None),
        }
    }

    /// The allocation of `job`'s `attempt` here. The first node's script can
    /// call srun before this node's agent has its own launch order (it comes
    /// with the next heartbeat answer), so a step waits for it, within
    /// [`STEP_HOST_WAIT`]; a request for another attempt of a job that runs
    /// here is answered at once.
    async fn wait_for_host(&self, job: u64, attempt: u32) -> Option<StepHost> {
        for _ in 0..STEP_HOST_POLLS {
            {
                let hosts = self.hosts.lock().expect("step hosts lock");
                if let Some(h) = hosts.get(&(job, attempt)) {
                    return Some(h.clone());
                }
                if hosts.range((job, 0)..=(job, u32::MAX)).next().is_some() {
                    return None;
                }
            }
            tokio::time::sleep(STEP_HOST_POLL).await;
        }
        None
    }
}

/// How long a step waits for its job's allocation to start on this node: a
/// few heartbeats, and a leader change, beyond the moment the first node began.
const STEP_HOST_WAIT: std::time::Duration = std::time::Duration::from_secs(30);
const STEP_HOST_POLL: std::time::Duration = std::time::Duration::from_millis(50);
const STEP_HOST_POLLS: u128 = STEP_HOST_WAIT.as_millis() / STEP_HOST_POLL.as_millis();

/// Checks a request's bounds; the error names the field and the rule.
fn validate(r: &StepRequest) -> Result<(), Status> {
    if r.argv.is_empty() || r.argv[0].is_empty() {
        return Err(Status::invalid_argument("argv: give the command to run"));
    }
    if r.argv.len() > STEP_ARGV_MAX {
        return Err(Status::invalid_argument(format!("argv: at most {STEP_ARGV_MAX} arguments")));
    }
    if r.tasks.is_empty() || r.tasks.len() > STEP_TASKS_MAX {
        return Err(Status::invalid_argument(format!("tasks: between 1 and {STEP_TASKS_MAX} per node")));
    }
    let env_bytes: usize = r
        .env
        .iter()
        .chain(r.tasks.iter().flat_map(|t| t.env.iter()))
        .map(|(k, v)| k.len().saturating_add(v.len()))
        .fold(0, usize::saturating_add);
    let bad_var = r
        .env
        .iter()
        .chain(r.tasks.iter().flat_map(|t| t.env.iter()))
        .find(|(k, v)| k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0'));
    if let Some((k, _)) = bad_var {
        return Err(Status::invalid_argument(format!(
            "env: '{}' is not a variable name with a value (no '=' or NUL in names, no NUL in values)",
            k.escape_debug()
        )));
    }
    if !r.workdir.is_empty() && !r.workdir.starts_with('/') {
        return Err(Status::invalid_argument("workdir: must be an absolute path"));
    }
    if env_bytes > STEP_ENV_BYTES_MAX {
        return Err(Status::invalid_argument(format!("env: at most {STEP_ENV_BYTES_MAX} bytes of environment")));
    }
    crate::kept::check_key(&r.step_key).map_err(Status::invalid_argument)?;
    Ok(())
}

#[tonic::async_trait]
impl StepService for StepServer {
    type RunStream = tokio_stream::wrappers::ReceiverStream<Result<StepEvent, Status>>;

    async fn run(&self, request: Request<StepRequest>) -> Result<Response<Self::RunStream>, Status> {
        self.check_credential(request.metadata(), request.get_ref().job_id, request.get_ref().attempt)?;
        let r = request.into_inner();
        let host = self.admit(&r).await?;
        let (tx, rx) = step_events();
        let workdir = if r.workdir.is_empty() { host.workdir.clone() } else { r.workdir.clone() };
        for (local, task) in r.tasks.iter().enumerate() {
            let env = self.task_env(&r, &host, local);
            // As root, through the shim: it reads the environment from its
            // stdin, becomes the user (groups too), enters the directory and
            // becomes the command; nothing of the job's reaches a root process.
            let via_shim = match self.task_user(&host) {
                Ok(via) => via,
                Err(error) => {
                    let end = StepTaskEnd { rank: task.rank, exit_code: None, signal: None, error };
                    let _ = tx.send(Ok(StepEvent { kind: Some(Kind::End(end)) })).await;
                    continue;
                }
            };
            // A named step's tasks outlive a restart of this agent.
            if let (Some(keeping), Some(shim), false) = (&self.keeping, &self.shim, r.step_key.is_empty()) {
                let user = via_shim.as_ref().map(|(_, u)| u);
                if let Err(error) = self.start_kept(keeping, shim, &r, &host, local, &env, &workdir, user, &tx) {
                    let end = StepTaskEnd { rank: task.rank, exit_code: None, signal: None, error };
                    let _ = tx.send(Ok(StepEvent { kind: Some(Kind::End(end)) })).await;
                }
                continue;
            }
            let mut cmd = match &via_shim {
                Some((shim, user)) => {
                    shim_command(shim, &["--exec"], Some(user), &workdir, &cgroups_of(&host), &r.argv)
                }
                None => {
                    let mut c = tokio::process::Command::new(&r.argv[0]);
                    c.args(&r.argv[1..])
                        .env_clear()
                        .envs(env.clone())
                        .current_dir(&workdir)
                        .stdin(std::process::Stdio::null());
                    if let Some((uid, gid)) = host.ids {
                        c.uid(uid).gid(gid);
                    }
                    c
                }
            };
            cmd.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .process_group(0)
                .kill_on_drop(true);
            let rank = task.rank;
            match cmd.spawn() {
                Ok(mut child) => {
                    let stdin = child.stdin.take();
                    if let Some(pid) = child.id() {
                        register(&host, r.job_id, pid, via_shim.is_some());
                    }
                    // Only now the environment: the shim waits for it before
                    // anything else, so the task runs nothing before it is in
                    // its cgroup and recorded with the step host.
                    if let Some(stdin) = stdin {
                        send_env(stdin, &env);
                    }
                    tokio::spawn(supervise(child, rank, tx.clone(), host.groups.clone()));
                }
                Err(e) => {
                    let end = StepTaskEnd {
                        rank,
                        exit_code: None,
                        signal: None,
                        error: format!("cannot start {} on {}: {e}", r.argv[0], self.node),
                    };
                    let _ = tx.send(Ok(StepEvent { kind: Some(Kind::End(end)) })).await;
                }
            }
        }
        tracing::info!(job = r.job_id, attempt = r.attempt, tasks = r.tasks.len(), "step started");
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    type ResumeStream = tokio_stream::wrappers::ReceiverStream<Result<StepEvent, Status>>;

    async fn resume(&self, request: Request<StepResumeRequest>) -> Result<Response<Self::ResumeStream>, Status> {
        let r = request.get_ref();
        self.check_credential(request.metadata(), r.job_id, r.attempt)?;
        crate::kept::check_key(&r.step_key).map_err(Status::invalid_argument)?;
        let Some(keeping) = self.keeping.as_ref().filter(|_| !r.step_key.is_empty()) else {
            return Err(Status::failed_precondition(format!("{} keeps no step tasks across restarts", self.node)));
        };
        let tasks = keeping.steps.claim(r.job_id, r.attempt, &r.step_key);
        if tasks.is_empty() {
            return Err(Status::failed_precondition(format!(
                "step {} of job {} has nothing left on {} (it ended, or was stopped)",
                r.step_key, r.job_id, self.node
            )));
        }
        // Only inside the job's allocation here, with whose end they stop:
        // a job that ended while the agent was away takes its steps along.
        let host = self.hosts.lock().expect("step hosts lock").get(&(r.job_id, r.attempt)).cloned();
        let Some(host) = host else {
            tokio::spawn(async move {
                let stopping = std::sync::atomic::AtomicBool::new(false);
                let running: Vec<_> =
                    tasks.iter().filter(|k| k.running()).map(|k| nix::unistd::Pid::from_raw(k.pid)).collect();
                crate::supervisor::end_leftovers(|| running.clone(), &stopping, STEP_STOP_GRACE).await;
                tasks.iter().for_each(crate::kept::Kept::remove_files);
            });
            return Err(Status::failed_precondition(format!(
                "job {} attempt {} no longer runs on {}: its step was stopped",
                r.job_id, r.attempt, self.node
            )));
        };
        let (tx, rx) = step_events();
        tracing::info!(job = r.job_id, attempt = r.attempt, tasks = tasks.len(), "step resumed");
        for k in tasks {
            follow_kept(k, None, &host, &tx);
        }
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    type AttachStream = tokio_stream::wrappers::ReceiverStream<Result<StepEvent, Status>>;

    async fn attach(
        &self,
        request: Request<tonic::Streaming<StepInput>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        use gangway_proto::v1::step_input::Kind as Input;
        let (metadata, _, mut input) = request.into_parts();
        let first = tokio::time::timeout(ATTACH_START_WAIT, input.message())
            .await
            .map_err(|_| Status::deadline_exceeded("start: the step's request did not come in time"))??;
        let Some(StepInput { kind: Some(Input::Start(r)) }) = first else {
            return Err(Status::invalid_argument("start: a terminal step's first input must be its request"));
        };
        self.check_credential(&metadata, r.job_id, r.attempt)?;
        if r.tasks.len() != 1 {
            return Err(Status::invalid_argument("tasks: a terminal step runs exactly one task"));
        }
        let host = self.admit(&r).await?;
        let Some(shim) = self.shim.clone() else {
            return Err(Status::failed_precondition(format!(
                "{} cannot start terminal steps: its agent has no task shim",
                self.node
            )));
        };
        let user = self.task_user(&host).map_err(Status::failed_precondition)?.map(|(_, u)| u);
        let size = crate::terminal::winsize(r.window.as_ref());
        let (master, slave) = crate::terminal::open(size, host.ids)
            .map_err(|e| Status::internal(format!("cannot open a terminal on {}: {e}", self.node)))?;
        let workdir = if r.workdir.is_empty() { host.workdir.clone() } else { r.workdir.clone() };
        let env = self.task_env(&r, &host, 0);
        let output = slave.try_clone().map_err(|e| Status::internal(format!("the terminal: {e}")))?;
        // Through the shim, as user or not: it starts the session whose
        // controlling terminal this is (so no process group is set here).
        let mut cmd = shim_command(&shim, &["--exec", "--pty"], user.as_ref(), &workdir, &cgroups_of(&host), &r.argv);
        cmd.stdout(std::process::Stdio::from(output)).stderr(std::process::Stdio::from(slave)).kill_on_drop(true);
        let spawned = cmd.spawn();
        // Only the task holds the terminal's other side now: its end reads as
        // the end of the output.
        drop(cmd);
        let mut child =
            spawned.map_err(|e| Status::internal(format!("cannot start {} on {}: {e}", r.argv[0], self.node)))?;
        let pid = child.id().unwrap_or(0) as i32;
        // The shim starts the session (its process group) before it reads
        // its environment: only then is the group registered to stop with
        // the job, and only then does the task run.
        if !crate::terminal::session_started(pid).await {
            let _ = child.start_kill();
            let _ = child.wait().await;
            return Err(Status::internal(format!("the terminal step did not start on {}", self.node)));
        }
        register(&host, r.job_id, pid as u32, true);
        if let Some(stdin) = child.stdin.take() {
            send_env(stdin, &env);
        }
        let (tx, rx) = step_events();
        let rank = r.tasks[0].rank;
        tokio::spawn(async move {
            // On return the terminal is closed: the session is hung up.
            let ended = crate::terminal::relay(&mut child, master, input, &tx, rank).await;
            if let Some(status) = ended {
                let _ = tx.send(Ok(StepEvent { kind: Some(Kind::End(task_end(rank, status))) })).await;
            }
            // What is left of the session (the shell when its client went
            // away, background jobs) ends with it: SIGTERM, grace, SIGKILL.
            let stopping = std::sync::atomic::AtomicBool::new(false);
            let groups = || crate::terminal::session_groups(pid);
            crate::supervisor::end_leftovers(groups, &stopping, STEP_STOP_GRACE).await;
            let _ = child.wait().await;
            host.groups.lock().expect("step groups lock").remove(&pid);
        });
        tracing::info!(job = r.job_id, attempt = r.attempt, "terminal step started");
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

impl StepServer {
    /// Starts task `local` of `r` as a kept task (see `kept.rs`): under the
    /// shim in its waiting mode, output through FIFOs, recorded for a
    /// restarted agent; its events go to `tx`.
    #[allow(clippy::too_many_arguments)]
    fn start_kept(
        &self,
        keeping: &Keeping,
        shim: &std::path::Path,
        r: &StepRequest,
        host: &StepHost,
        local: usize,
        env: &[(String, String)],
        workdir: &str,
        user: Option<&crate::shim::TaskUser>,
        tx: &EventSender,
    ) -> Result<(), String> {
        let rank = r.tasks[local].rank;
        let mut kept = crate::kept::Kept::new(&keeping.dir, r.job_id, r.attempt, &r.step_key, rank);
        let (out, err) =
            kept.prepare(host.ids).map_err(|e| format!("cannot make the task's output pipes on {}: {e}", self.node))?;
        let exit = kept.exit_file();
        let lease = keeping.lease.as_os_str();
        let mode =
            [OsStr::new("--exit-file"), exit.as_os_str(), OsStr::new("--drain-output"), OsStr::new("--lease"), lease];
        let mut cmd = shim_command(shim, &mode, user, workdir, &cgroups_of(host), &r.argv);
        cmd.stdout(out).stderr(err).process_group(0);
        let spawned = cmd.spawn();
        drop(cmd);
        let mut child = spawned.map_err(|e| {
            kept.remove_files();
            format!("cannot start {} on {}: {e}", r.argv[0], self.node)
        })?;
        let pid = child.id().unwrap_or(0);
        if let Err(e) = kept.record(pid) {
            tracing::warn!(job = r.job_id, error = %e, "cannot record a kept step task: it ends with this agent");
        }
        register(host, r.job_id, pid, true);
        if let Some(stdin) = child.stdin.take() {
            send_env(stdin, env);
        }
        follow_kept(kept, Some(child), host, tx);
        Ok(())
    }
}

/// Follows a kept task (its shim `child` when this agent started it) to
/// its end in `host`'s allocation: its shim is among the allocation's step
/// groups and spared shims meanwhile, and its events go to `tx`.
fn follow_kept(kept: crate::kept::Kept, child: Option<tokio::process::Child>, host: &StepHost, tx: &EventSender) {
    let (tx, groups, shims) = (tx.clone(), host.groups.clone(), host.shims.clone());
    groups.lock().expect("step groups lock").insert(kept.pid);
    shims.lock().expect("step groups lock").insert(kept.pid);
    tokio::spawn(async move {
        if let Some(end) = kept.follow(child, &tx, STEP_STOP_GRACE).await {
            let _ = tx.send(Ok(StepEvent { kind: Some(Kind::End(end)) })).await;
        }
        groups.lock().expect("step groups lock").remove(&kept.pid);
        shims.lock().expect("step groups lock").remove(&kept.pid);
    });
}

/// The task shim started for a step task: its `mode` options, then (when
/// tasks switch users) the user to become, the working directory and the
/// command. Nothing of the agent's environment passes: the task's comes on
/// its stdin.
fn shim_command<S: AsRef<OsStr>>(
    shim: &std::path::Path,
    mode: &[S],
    user: Option<&crate::shim::TaskUser>,
    workdir: &str,
    cgroups: &[PathBuf],
    argv: &[String],
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(shim);
    cmd.arg("task-shim").args(mode).arg("--env-stdin");
    if let Some(u) = user {
        cmd.arg("--user").arg(u.encode());
    }
    // One word, so no directory name can pass for an option.
    cmd.arg(format!("--workdir={workdir}"))
        .args(crate::devices::shim_options(cgroups))
        .arg("--")
        .args(argv)
        .env_clear()
        .current_dir("/")
        .stdin(std::process::Stdio::piped());
    cmd
}

/// How long a terminal step's request may take to follow its call.
const ATTACH_START_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Hands the shim the task's environment on its stdin (it reads to the end
/// before anything else runs).
fn send_env(mut stdin: tokio::process::ChildStdin, env: &[(String, String)]) {
    use tokio::io::AsyncWriteExt;
    let bytes = crate::shim::encode_env(env);
    tokio::spawn(async move {
        let _ = stdin.write_all(&bytes).await;
    });
}

/// How a task ended, as its step's event says it.
fn task_end(rank: u32, status: std::io::Result<std::process::ExitStatus>) -> StepTaskEnd {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => StepTaskEnd { rank, exit_code: s.code(), signal: s.signal(), error: String::new() },
        Err(e) => StepTaskEnd { rank, exit_code: None, signal: None, error: format!("lost track of the task: {e}") },
    }
}

/// The job's cgroups a step task joins: CPU and memory (v2), devices (v1).
/// Through the shim, it joins them before it runs anything of the job's.
fn cgroups_of(host: &StepHost) -> Vec<PathBuf> {
    host.cgroup.iter().chain(host.devices.iter()).cloned().collect()
}

/// Notes a step task just started (`pid`, its process group's leader) with
/// its step groups, and the file a restarted agent finds them in; one
/// started without the shim joins its job's cgroups now.
fn register(host: &StepHost, job: u64, pid: u32, shimmed: bool) {
    if !shimmed {
        if let Err(e) = crate::devices::join(&cgroups_of(host), pid) {
            tracing::warn!(job, error = %e, "step task: cgroup join failed");
        }
    }
    host.groups.lock().expect("step groups lock").insert(pid as i32);
    if let Some(f) = &host.steps_file {
        use std::io::Write;
        let noted =
            std::fs::OpenOptions::new().create(true).append(true).open(f).and_then(|mut file| writeln!(file, "{pid}"));
        if let Err(e) = noted {
            tracing::warn!(file = %f.display(), error = %e, "cannot note a step task");
        }
    }
}

/// Streams one task's output, then its end; the task's group leaves `groups`
/// once nothing of it runs.
async fn supervise(
    child: tokio::process::Child,
    rank: u32,
    tx: mpsc::Sender<Result<StepEvent, Status>>,
    groups: StepGroups,
) {
    let pgid = child.id().map(|p| nix::unistd::Pid::from_raw(p as i32));
    let stopped = run_task(child, rank, tx.clone()).await;
    if let Some(pgid) = pgid {
        // What the task left in its group ends with it.
        let stopping = std::sync::atomic::AtomicBool::new(stopped);
        crate::supervisor::end_leftovers(|| vec![pgid], &stopping, STEP_STOP_GRACE).await;
        groups.lock().expect("step groups lock").remove(&pgid.as_raw());
    }
    drop(tx); // the step's stream ends once every task's group is gone
}

/// Where a step's events go (srun's call).
pub(crate) type EventSender = mpsc::Sender<Result<StepEvent, Status>>;

/// The queue of one step's events to srun: [`STEP_EVENTS_QUEUE_MAX`].
fn step_events() -> (EventSender, mpsc::Receiver<Result<StepEvent, Status>>) {
    mpsc::channel(STEP_EVENTS_QUEUE_MAX)
}

/// Streams one task's output, then its end. When srun goes away (the stream
/// is dropped) the task is stopped, and true returned.
async fn run_task(mut child: tokio::process::Child, rank: u32, tx: EventSender) -> bool {
    if pump(child.stdout.take(), child.stderr.take(), rank, &tx).await {
        return stop(child).await;
    }
    let status = tokio::select! {
        s = child.wait() => s,
        _ = tx.closed() => return stop(child).await,
    };
    let _ = tx.send(Ok(StepEvent { kind: Some(Kind::End(task_end(rank, status))) })).await;
    false
}

/// Streams a task's output from its two pipes until both are closed; true
/// when srun went away first.
pub(crate) async fn pump<O, E>(mut out: Option<O>, mut err: Option<E>, rank: u32, tx: &EventSender) -> bool
where
    O: tokio::io::AsyncRead + Unpin,
    E: tokio::io::AsyncRead + Unpin,
{
    let (mut obuf, mut ebuf) = (vec![0u8; OUTPUT_CHUNK_BYTES], vec![0u8; OUTPUT_CHUNK_BYTES]);
    let output = |stderr: bool, data: &[u8]| StepEvent {
        kind: Some(Kind::Output(StepOutput { rank, stderr, data: data.to_vec() })),
    };
    // Bounded by the pipes: each turn reads from one until both are closed.
    while out.is_some() || err.is_some() {
        let event = tokio::select! {
            n = read_some(&mut out, &mut obuf), if out.is_some() => match n {
                Some(n) => output(false, &obuf[..n]),
                None => { out = None; continue; }
            },
            n = read_some(&mut err, &mut ebuf), if err.is_some() => match n {
                Some(n) => output(true, &ebuf[..n]),
                None => { err = None; continue; }
            },
            _ = tx.closed() => return true,
        };
        if tx.send(Ok(event)).await.is_err() {
            return true;
        }
    }
    false
}

/// Time a step task has between SIGTERM and SIGKILL when its srun went away
/// (the agent's default stop grace: training checkpoints on SIGTERM).
const STEP_STOP_GRACE: std::time::Duration = crate::supervisor::STOP_GRACE_DEFAULT;

/// Stops a task whose srun went away: SIGTERM to its group, then SIGKILL
/// after the grace. True: it was stopped.
async fn stop(mut child: tokio::process::Child) -> bool {
    use nix::sys::signal::{killpg, Signal};
    let pgid = child.id().map(|p| nix::unistd::Pid::from_raw(p as i32));
    if let Some(g) = pgid {
        let _ = killpg(g, Signal::SIGTERM);
    }
    if tokio::time::timeout(STEP_STOP_GRACE, child.wait()).await.is_err() {
        if let Some(g) = pgid {
            let _ = killpg(g, Signal::SIGKILL);
        }
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
    true
}

/// Reads what is there from `pipe`; None at its end (or on an error).
async fn read_some<R: tokio::io::AsyncRead + Unpin>(pipe: &mut Option<R>, buf: &mut [u8]) -> Option<usize> {
    let p = pipe.as_mut()?;
    match p.read(buf).await {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(n),
    }
}

/// How often the step service pings an srun whose call is quiet, and how
/// long it waits for the answer: an srun whose host died or was cut off
/// without closing its connection is noticed within a minute (its call
/// then ends, and its tasks are stopped, as when srun goes away).
const CLIENT_PING_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
const CLIENT_PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Serves `server` on `listener` until the returned task is aborted.
pub fn serve(listener: tokio::net::TcpListener, server: StepServer) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    use gangway_proto::v1::step_service_server::StepServiceServer;
    let incoming = gangway_proto::tls::incoming(listener, &server.security)
        .map_err(|e| anyhow::anyhow!("step service TLS: {e}"))?;
    Ok(tokio::spawn(async move {
        if let Err(e) = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(CLIENT_PING_INTERVAL))
            .http2_keepalive_timeout(Some(CLIENT_PING_TIMEOUT))
            .add_service(StepServiceServer::new(server).max_decoding_message_size(STEP_MESSAGE_BYTES_MAX))
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!(error = %e, "the step service stopped");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_proto::v1::StepTask;
    use tokio_stream::StreamExt;

    /// STEP_EVENTS_QUEUE_MAX events wait for srun to read them; the task
    /// output past them waits for room (its pipe fills, the task slows).
    #[test]
    fn a_steps_events_wait_past_step_events_queue_max() {
        let (tx, mut rx) = step_events();
        for _ in 0..STEP_EVENTS_QUEUE_MAX {
            assert!(tx.try_send(Ok(StepEvent::default())).is_ok());
        }
        assert!(matches!(tx.try_send(Ok(StepEvent::default())), Err(mpsc::error::TrySendError::Full(_))));
        assert!(rx.try_recv().is_ok());
        assert!(tx.try_send(Ok(StepEvent::default())).is_ok());
    }

    fn request(job_id: u64, argv: &[&str], ranks: &[u32]) -> StepRequest {
        StepRequest {
            job_id,
            attempt: 1,
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: [("FROM_SRUN".to_string(), "yes".to_string())].into(),
            tasks: ranks
                .iter()
                .map(|&rank| StepTask { rank, env: [("SLURM_PROCID".to_string(), rank.to_string())].into() })
                .collect(),
            workdir: String::new(),
            gpus_per_task: 1,
            window: None,
            step_key: String::new(),
        }
    }

    #[tokio::test]
    async fn steps_run_in_a_held_allocation_and_stream_back() {
        // A step host to join: a process group of our own.
        let mut hold = tokio::process::Command::new("sleep").arg("30").process_group(0).spawn().unwrap();
        let pgid = hold.id().unwrap() as i32;
        let hosts: StepHosts = Default::default();
        let dir = tempfile::tempdir().unwrap();
        let host = StepHost {
            pgid,
            groups: Default::default(),
            steps_file: None,
            ids: None,
            cgroup: None,
            devices: None,
            gpus: vec![2, 3],
            workdir: dir.path().display().to_string(),
            suspended: Default::default(),
            shims: Default::default(),
        };
        hosts.lock().unwrap().insert((7, 1), host);
        let server = StepServer::new("n2", hosts.clone(), gangway_proto::tls::Security::Insecure, None, None, None);

        // Another attempt of a job that runs here, or a bad request: refused
        // at once, with the field named.
        let stale = StepRequest { attempt: 2, ..request(7, &["true"], &[0]) };
        let err = server.run(Request::new(stale)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains("job 7 attempt 2 does not run on n2"), "{}", err.message());
        let err = server.run(Request::new(request(7, &[], &[0]))).await.unwrap_err();
        assert!(err.message().starts_with("argv:"), "{}", err.message());
        let err = server.run(Request::new(request(7, &["true"], &[0, 1, 2]))).await.unwrap_err();
        assert!(err.message().starts_with("gpus_per_task:"), "{}", err.message());
        // A suspended job starts no step until it is resumed.
        let flag = hosts.lock().unwrap()[&(7, 1)].suspended.clone();
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        let err = server.run(Request::new(request(7, &["true"], &[0]))).await.unwrap_err();
        assert!(err.message().contains("job 7 is suspended"), "{}", err.message());
        flag.store(false, std::sync::atomic::Ordering::SeqCst);

        // Two tasks, each with one of the node's GPUs, srun's environment and
        // its own; output and exit codes come back per rank.
        let script = "echo $SLURM_PROCID $FROM_SRUN $CUDA_VISIBLE_DEVICES $SLURMD_NODENAME; \
                      echo $$ $(ps -o pgid= $$) >> groups.txt; sleep 0.3; \
                      echo oops >&2; exit $((SLURM_PROCID + 3))";
        let stream = server.run(Request::new(request(7, &["sh", "-c", script], &[4, 5]))).await.unwrap();
        let events: Vec<StepEvent> = stream.into_inner().map(|e| e.unwrap()).collect().await;
        let mut out = BTreeMap::<(u32, bool), String>::new();
        let mut ends = BTreeMap::new();
        for e in events {
            match e.kind.unwrap() {
                Kind::Output(o) => {
                    out.entry((o.rank, o.stderr)).or_default().push_str(&String::from_utf8_lossy(&o.data))
                }
                Kind::End(end) => {
                    assert!(!out.is_empty(), "an end came before its output");
                    ends.insert(end.rank, (end.exit_code, end.error));
                }
            }
        }
        assert_eq!(out[&(4, false)].trim(), "4 yes 2 n2");
        assert_eq!(out[&(5, false)].trim(), "5 yes 3 n2");
        // Each task led a group of its own, recorded with the host while it ran.
        let groups = std::fs::read_to_string(dir.path().join("groups.txt")).unwrap();
        for line in groups.lines() {
            let (pid, pgrp) = line.split_once(' ').unwrap();
            assert_eq!(pid.trim(), pgrp.trim(), "a step task is not its group's leader: {groups}");
        }
        assert_eq!(groups.lines().count(), 2, "{groups}");
        assert!(hosts.lock().unwrap()[&(7, 1)].groups.lock().unwrap().is_empty(), "ended steps' groups remain");
        assert_eq!(out[&(5, true)].trim(), "oops");
        assert_eq!(ends[&4], (Some(7), String::new()));
        assert_eq!(ends[&5], (Some(8), String::new()));

        // A command that cannot start is an end with the reason.
        let stream = server.run(Request::new(request(7, &["/nonexistent/cmd"], &[0]))).await.unwrap();
        let events: Vec<StepEvent> = stream.into_inner().map(|e| e.unwrap()).collect().await;
        let Some(Kind::End(end)) = events.last().and_then(|e| e.kind.clone()) else { panic!("{events:?}") };
        assert!(end.error.contains("cannot start /nonexistent/cmd on n2"), "{}", end.error);

        // A step that arrives before its allocation here waits for it.
        let early = {
            let server = StepServer::new("n2", hosts.clone(), gangway_proto::tls::Security::Insecure, None, None, None);
            tokio::spawn(async move { server.run(Request::new(request(9, &["true"], &[0]))).await.map(|_| ()) })
        };
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let host = hosts.lock().unwrap()[&(7, 1)].clone();
        hosts.lock().unwrap().insert((9, 1), host);
        early.await.unwrap().expect("the early step was refused");

        // Dropping the stream (srun went away) kills the step's tasks.
        let marker = dir.path().join("survived");
        let cmd = format!("sleep 2; touch {}", marker.display());
        let stream = server.run(Request::new(request(7, &["sh", "-c", &cmd], &[0]))).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        drop(stream);
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        assert!(!marker.exists(), "a step task outlived its srun");
        hold.kill().await.unwrap();
    }

    /// A terminal step over real gRPC: its first input must be its request,
    /// of one task, in a job that runs here; an agent without a task shim
    /// (which makes the terminal the task's own) says it cannot. A request
    /// is read up to the service's own limits, STEP_ENV_BYTES_MAX and
    /// STEP_MESSAGE_BYTES_MAX, and refused one byte past each.
    #[tokio::test]
    async fn terminal_steps_are_checked_before_anything_starts() {
        use gangway_proto::v1::step_input::Kind as Input;
        use gangway_proto::v1::step_service_client::StepServiceClient;
        let hosts: StepHosts = Default::default();
        let dir = tempfile::tempdir().unwrap();
        let host = StepHost {
            pgid: std::process::id() as i32,
            groups: Default::default(),
            steps_file: None,
            ids: None,
            cgroup: None,
            devices: None,
            gpus: vec![0],
            workdir: dir.path().display().to_string(),
            suspended: Default::default(),
            shims: Default::default(),
        };
        hosts.lock().unwrap().insert((7, 1), host);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = StepServer::new("n2", hosts, gangway_proto::tls::Security::Insecure, None, None, None);
        let _server = serve(listener, server).unwrap();
        let attach = |inputs: Vec<StepInput>| async move {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await;
            let mut client = StepServiceClient::new(channel.unwrap());
            client.attach(tokio_stream::iter(inputs)).await.map(drop).unwrap_err()
        };
        let start = |r: StepRequest| StepInput { kind: Some(Input::Start(r)) };
        let err = attach(vec![StepInput { kind: Some(Input::Stdin(b"ls\n".to_vec())) }]).await;
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().starts_with("start:"), "{}", err.message());
        let err = attach(vec![start(request(7, &["bash"], &[0, 1]))]).await;
        assert!(err.message().starts_with("tasks: a terminal step runs exactly one task"), "{}", err.message());
        let err = attach(vec![start(StepRequest { attempt: 2, ..request(7, &["bash"], &[0]) })]).await;
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        let err = attach(vec![start(request(7, &["bash"], &[0]))]).await;
        assert!(err.message().contains("n2 cannot start terminal steps"), "{}", err.message());
        // The environment's limit is the step service's own, not the
        // transport's: at it the request is read (and refused later, for the
        // missing shim); one byte past it, refused by name.
        let with_env = |bytes: usize| {
            // BIG=... and the task's SLURM_PROCID=0 (13 bytes): `bytes` in all.
            let mut r = request(7, &["bash"], &[0]);
            r.env = [("BIG".to_string(), "x".repeat(bytes - 3 - 13))].into_iter().collect();
            start(r)
        };
        let err = attach(vec![with_env(STEP_ENV_BYTES_MAX)]).await;
        assert!(err.message().contains("n2 cannot start terminal steps"), "{}", err.message());
        let err = attach(vec![with_env(STEP_ENV_BYTES_MAX + 1)]).await;
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().starts_with("env: at most"), "{}", err.message());
        // A message of STEP_MESSAGE_BYTES_MAX bytes is read (here too, refused
        // later for the missing shim); one byte more, refused by the transport.
        // Its size is the filler argument's and what the transport reports
        // past it (a message over the limit names its size).
        let with_arg = |bytes: usize| start(request(7, &["bash", &"x".repeat(bytes)], &[0]));
        let found = |err: &Status| -> usize {
            assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
            let size = err.message().split("found ").nth(1).and_then(|m| m.split(' ').next());
            size.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{}", err.message()))
        };
        let overhead = found(&attach(vec![with_arg(STEP_MESSAGE_BYTES_MAX)]).await) - STEP_MESSAGE_BYTES_MAX;
        let err = attach(vec![with_arg(STEP_MESSAGE_BYTES_MAX - overhead)]).await;
        assert!(err.message().contains("n2 cannot start terminal steps"), "{}", err.message());
        let err = attach(vec![with_arg(STEP_MESSAGE_BYTES_MAX - overhead + 1)]).await;
        assert_eq!(found(&err), STEP_MESSAGE_BYTES_MAX + 1);
    }

    /// A request may carry STEP_ARGV_MAX arguments and STEP_TASKS_MAX tasks;
    /// one more of either is refused with the field and the limit named.
    #[test]
    fn step_requests_hold_at_most_step_argv_max_and_step_tasks_max() {
        let with_args = |n: usize| StepRequest { argv: vec!["true".to_string(); n], ..request(7, &[], &[0]) };
        validate(&with_args(STEP_ARGV_MAX)).unwrap();
        let err = validate(&with_args(STEP_ARGV_MAX + 1)).unwrap_err();
        assert!(err.message().starts_with(&format!("argv: at most {STEP_ARGV_MAX}")), "{}", err.message());
        let ranks = |n: usize| (0..n as u32).collect::<Vec<_>>();
        validate(&request(7, &["true"], &ranks(STEP_TASKS_MAX))).unwrap();
        let err = validate(&request(7, &["true"], &ranks(STEP_TASKS_MAX + 1))).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains(&format!("between 1 and {STEP_TASKS_MAX}")), "{}", err.message());
    }

    /// A secured agent starts a step only for the holder of its job's
    /// credential naming this node; nothing else gets that far.
    #[tokio::test]
    async fn a_secured_step_service_needs_the_jobs_credential() {
        use gangway_proto::step_cred::{sign, StepClaims, STEP_CREDENTIAL_METADATA_KEY};
        use gangway_proto::tls::{Credentials, Principal, Role, Security, TlsFiles};
        use gangway_proto::v1::step_service_server::StepService;
        let dir = tempfile::tempdir().unwrap();
        let ps = [Principal::new(Role::Server, "1").unwrap(), Principal::new(Role::Agent, "n2").unwrap()];
        gangway_proto::pki::throwaway(dir.path(), &ps).unwrap();
        let server = Credentials::load(TlsFiles::in_dir(dir.path(), "server-1")).unwrap();
        let agent = Credentials::load(TlsFiles::in_dir(dir.path(), "agent-n2")).unwrap();
        let step = StepServer::new("n2", StepHosts::default(), Security::Tls(agent.clone()), None, None, None);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let call = |credential: Option<String>| {
            let mut r = Request::new(request(7, &["true"], &[0]));
            if let Some(c) = credential {
                r.metadata_mut().insert(STEP_CREDENTIAL_METADATA_KEY, c.parse().unwrap());
            }
            step.run(r)
        };
        let code = |r: Result<Response<_>, Status>| r.err().map(|s| s.code());
        assert_eq!(code(call(None).await), Some(tonic::Code::Unauthenticated));
        let claims = |job_id, nodes: &[&str]| StepClaims {
            job_id,
            attempt: 1,
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            expires_unix: now + 600,
        };
        // Another job's, or one for other nodes: refused.
        let other_job = sign(&server, &claims(8, &["n2"])).unwrap();
        assert_eq!(code(call(Some(other_job)).await), Some(tonic::Code::PermissionDenied));
        let other_node = sign(&server, &claims(7, &["n1"])).unwrap();
        assert_eq!(code(call(Some(other_node)).await), Some(tonic::Code::PermissionDenied));
        // Minted by the agent itself (not a server): refused.
        let forged = sign(&agent, &claims(7, &["n2"])).unwrap();
        assert_eq!(code(call(Some(forged)).await), Some(tonic::Code::PermissionDenied));
        // The right one passes the check: what refuses this step (no command)
        // comes after it.
        let good = sign(&server, &claims(7, &["n1", "n2"])).unwrap();
        let good_request = || {
            let mut r = Request::new(request(7, &[], &[0]));
            r.metadata_mut().insert(STEP_CREDENTIAL_METADATA_KEY, good.parse().unwrap());
            r
        };
        assert_eq!(code(step.run(good_request()).await), Some(tonic::Code::InvalidArgument));
        // Once the leader says replica 1 is no longer a member, what it
        // signed opens nothing here; while it is one, it does.
        let members = Members::default();
        let step = StepServer::new("n2", StepHosts::default(), Security::Tls(agent.clone()), None, None, None)
            .with_members(members.clone());
        *members.write().unwrap() = Some(["1".to_string(), "2".to_string()].into());
        assert_eq!(code(step.run(good_request()).await), Some(tonic::Code::InvalidArgument));
        *members.write().unwrap() = Some(["2".to_string(), "3".to_string()].into());
        let Err(refused) = step.run(good_request()).await else {
            panic!("a removed replica's credential opened a step")
        };
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("server:1 is not a member"), "{}", refused.message());
    }
}
