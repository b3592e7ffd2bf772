//! Running tasks on this node: launch as a process group, stop with SIGTERM then
//! SIGKILL of the whole group after a grace period, and report each exit.
//!
//! Also here: re-adopting tasks after an agent restart (by their exit files
//! and process groups), step records and output files, and when to send
//! Slurm's warning signal before a time limit. Elsewhere: the processes and
//! the signals themselves (`process.rs`), each task's cgroups (`cgroup.rs`,
//! and `devices.rs` for GPUs).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gangway_proto::v1::{LaunchOrder, TaskExitReport};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::mpsc;

use crate::launch::{output_paths, task_env};
use crate::process::{continue_processes, group_alive, is_shim, send_warning, stop_processes, WarnTarget};

/// Default time between SIGTERM and SIGKILL when a task is stopped (Slurm's
/// KillWait defaults to 30 s; training jobs that checkpoint on SIGTERM need
/// seconds, not minutes).
pub const STOP_GRACE_DEFAULT: Duration = Duration::from_secs(10);
/// Exits waiting to be reported: the channel blocks task watchers beyond this.
const EXIT_QUEUE_MAX: usize = 4096;
/// How often a re-adopted task (not our child) is checked for its end.
const ADOPTED_POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How a task ended: `status` (the wait status of our own child) decides,
/// with the shim's exit file only telling "exit 130" from "killed by signal 2"
/// where both agree; a re-adopted task (not our child) has only its exit file.
/// Neither means the task was lost. The task's record is removed.
fn exit_report(
    node: &str,
    key: Key,
    exit_file: &std::path::Path,
    record: &std::path::Path,
    status: Option<(Option<i32>, Option<i32>)>,
    peak_mem_mb: Option<u64>,
) -> TaskExitReport {
    let found = crate::shim::reconcile_exit(crate::shim::read_exit(exit_file), status);
    let _ = std::fs::remove_file(exit_file);
    let _ = std::fs::remove_file(steps_path(record));
    let _ = std::fs::remove_file(record);
    // A root shim that never started leaves its environment file behind.
    let _ = std::fs::remove_file(record.with_extension("env"));
    // The batch script goes with its task (records and scripts are siblings
    // under the state dir).
    if let Some(state_dir) = record.parent().and_then(std::path::Path::parent) {
        let _ = std::fs::remove_file(state_dir.join("scripts").join(format!("job-{}-{}.sh", key.0, key.1)));
        let _ = std::fs::remove_file(state_dir.join("scripts").join(format!("job-{}-{}.stepaddrs", key.0, key.1)));
    }
    let (exit_code, signal) = found.unwrap_or((None, None));
    TaskExitReport {
        node: node.to_string(),
        job_id: key.0,
        attempt: key.1,
        exit_code,
        signal,
        reason: if found.is_none() {
            "the task ended while its agent was down; its exit status is unknown".into()
        } else {
            String::new()
        },
        lost: found.is_none(),
        peak_mem_mb,
        usage: None,
    }
}

/// Samples a task's use (see `crate::usage`) until its main process `pid`
/// ends, and then, before it is reaped, reads the CPU time of its whole
/// waited-for tree. Without a pidfd (a kernel before 5.3) nothing is
/// measured and the caller just waits.
async fn measure_until_exit(
    pid: i32,
    pgid: Pid,
    steps: &crate::steps::StepGroups,
    sampler: &Arc<crate::usage::Sampler>,
    meter: &mut crate::usage::Meter,
) -> Option<u64> {
    let raw = rustix::process::Pid::from_raw(pid)?;
    let pidfd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()?;
    // Deprecated because a registered fd that its owner closes meanwhile is
    // unsound; this one is an `OwnedFd` the AsyncFd itself owns, closed only
    // when it is dropped (`register`, the replacement, is an unsafe fn).
    #[allow(deprecated)]
    let ended = tokio::io::unix::AsyncFd::with_interest(pidfd, tokio::io::Interest::READABLE).ok()?;
    // Bounded by the task's life: one sample per interval until it ends.
    // A sample under way never holds up the exit: the task's end is
    // watched while it runs.
    let mut sampling: Option<tokio::task::JoinHandle<Option<Arc<crate::usage::Snapshot>>>> = None;
    let mut tick = crate::tokio_deadline_in(crate::usage::FIRST_SAMPLE);
    loop {
        tokio::select! {
            _ = ended.readable() => break,
            snap = async { sampling.as_mut().expect("guarded").await }, if sampling.is_some() => {
                sampling = None;
                if let Ok(Some(snap)) = snap {
                    let groups: Vec<i32> = task_groups(pgid, steps).iter().map(|g| g.as_raw()).collect();
                    meter.observe(&snap, &groups);
                }
            }
            _ = tokio::time::sleep_until(tick), if sampling.is_none() => {
                let s = sampler.clone();
                sampling = Some(tokio::task::spawn_blocking(move || s.snapshot()));
                tick = crate::tokio_deadline_in(crate::usage::SAMPLE_INTERVAL);
            }
        }
    }
    crate::usage::ended_tree_ticks(pid)
}

type Key = (u64, u32);

/// How often a task's process group is checked for leftovers after its main
/// process ended.
const LEFTOVER_POLL: Duration = Duration::from_millis(50);
/// Polls after SIGKILL before giving up on a group that will not empty (a
/// process stuck in uninterruptible sleep): the exit is reported anyway.
const LEFTOVER_KILL_POLLS: u32 = 100;

/// A batch task's step host in its task record (so a restarted agent can
/// start steps in it again): `step-host UID GID GPUS WORKDIR`, `-` for none.
fn step_host_line(h: &crate::steps::StepHost) -> String {
    let (uid, gid) = h.ids.map_or(("-".to_string(), "-".to_string()), |(u, g)| (u.to_string(), g.to_string()));
    let gpus: Vec<String> = h.gpus.iter().map(u32::to_string).collect();
    let gpus = if gpus.is_empty() { "-".to_string() } else { gpus.join(",") };
    format!("step-host {uid} {gid} {gpus} {}", h.workdir)
}

/// A task record as read back: the task, its shim's pid, its step host (a
/// batch job's), and its GPUs (records from before they were written: None).
type TaskRecord = (Key, i32, Option<crate::steps::StepHost>, Option<Vec<u32>>);

/// A task record's `gpus 0,1` line (empty after `gpus `: none).
fn parse_gpus_line(line: &str) -> Option<Vec<u32>> {
    let list = line.strip_prefix("gpus ").or_else(|| (line == "gpus").then_some(""))?;
    list.split(',').filter(|g| !g.is_empty()).map(|g| g.parse().ok()).collect()
}

fn parse_step_host(line: &str, pid: i32) -> Option<crate::steps::StepHost> {
    let rest = line.strip_prefix("step-host ")?;
    let mut f = rest.splitn(4, ' ');
    let (uid, gid, gpus, workdir) = (f.next()?, f.next()?, f.next()?, f.next()?);
    let ids = match (uid, gid) {
        ("-", "-") => None,
        (u, g) => Some((u.parse().ok()?, g.parse().ok()?)),
    };
    let gpus = if gpus == "-" { Vec::new() } else { gpus.split(',').map(|g| g.parse().ok()).collect::<Option<_>>()? };
    Some(crate::steps::StepHost {
        pgid: pid,
        groups: Default::default(),
        steps_file: None,
        ids,
        cgroup: None,
        devices: None,
        gpus,
        workdir: workdir.to_string(),
        suspended: Default::default(),
        shims: Default::default(),
    })
}

/// The shims among a task's processes: its own (under a shim, the group's
/// leader) and its kept step tasks' (see `kept.rs`), as the agent started
/// or found them (never by what a process calls itself).
fn spared(shim: bool, t: &Task) -> Vec<Pid> {
    let kept: Vec<Pid> = t.shims.lock().expect("step groups lock").iter().map(|p| Pid::from_raw(*p)).collect();
    shim.then_some(t.pgid).into_iter().chain(kept).collect()
}

/// How often a suspended task is looked over for processes that run.
const SUSPEND_RECHECK: Duration = Duration::from_secs(1);

/// Slurm's `--signal` warning of one task, armed by a timer that a
/// suspension pauses.
#[derive(Debug, Clone, Copy)]
struct Warning {
    sig: Signal,
    target: WarnTarget,
    /// When it is due, while the task runs.
    due: Instant,
    /// The time it had left when the task was suspended.
    paused: Option<Duration>,
}

/// Sends `w` to the task (`pgid` and its step groups) once it is due.
/// Slurm's `--signal` for a task: the signal, whom it reaches, and when
/// (this long before its time limit); None when the job asked for none (or
/// for the batch shell only, on a step host, which has none).
fn warning_of(order: &LaunchOrder, step_host: bool) -> Option<Warning> {
    let target = match (order.batch, step_host, order.warn_batch_shell) {
        (false, _, _) => WarnTarget::Group,
        (true, true, true) => return None,
        // The step host's waiting shell is its "batch shell": spared.
        (true, true, false) => WarnTarget::AllButBatchShell,
        (true, false, true) => WarnTarget::BatchShell,
        (true, false, false) => WarnTarget::AllButBatchShell,
    };
    let sig = (order.warn_signal > 0).then(|| Signal::try_from(order.warn_signal as i32).ok()).flatten()?;
    let delay = Duration::from_secs(order.time_limit_s.saturating_sub(order.warn_before_s.into()));
    Some(Warning { sig, target, due: crate::deadline_in(delay), paused: None })
}

fn arm_warning(
    key: Key,
    w: Warning,
    pgid: Pid,
    steps: crate::steps::StepGroups,
    shim: bool,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        tokio::time::sleep_until(w.due.into()).await;
        tracing::info!(job = key.0, signal = %w.sig, target = ?w.target, "sending the time-limit warning signal");
        send_warning(&task_groups(pgid, &steps), w.sig, w.target, shim);
    })
}

/// What a task left running in its process group (daemons it started, steps
/// in a step host, children still in their SIGTERM handler) ends before the
/// task's exit is reported, so its GPUs are free when the leader reuses them:
/// SIGTERM (unless the task is already being stopped), `grace` to finish,
/// then SIGKILL. Slurm likewise ends a job's leftover processes.
/// `groups` says which process groups are the task's now (its own, and a step
/// host's step tasks').
pub(crate) async fn end_leftovers(groups: impl Fn() -> Vec<Pid>, stopping: &AtomicBool, grace: Duration) {
    let alive = || groups().into_iter().any(group_alive);
    let signal_all = |sig: Signal| {
        for g in groups() {
            let _ = killpg(g, sig);
        }
    };
    if !alive() {
        return;
    }
    if !stopping.load(Ordering::SeqCst) {
        signal_all(Signal::SIGTERM);
    }
    let deadline = crate::deadline_in(grace);
    // Bounded by the deadline.
    while alive() && Instant::now() < deadline {
        tokio::time::sleep(LEFTOVER_POLL).await;
    }
    signal_all(Signal::SIGKILL);
    for _ in 0..LEFTOVER_KILL_POLLS {
        if !alive() {
            break;
        }
        tokio::time::sleep(LEFTOVER_POLL).await;
    }
}

/// How a script is run, as the kernel would: its `#!` line's interpreter and
/// optional argument, else `/bin/sh`.
fn interpreter(script: &str) -> Vec<String> {
    let Some(line) = script.strip_prefix("#!").and_then(|s| s.lines().next()) else {
        return vec!["/bin/sh".into()];
    };
    let line = line.trim();
    match line.split_once([' ', '\t']) {
        Some((interp, arg)) if !arg.trim().is_empty() => vec![interp.to_string(), arg.trim().to_string()],
        Some((interp, _)) => vec![interp.to_string()],
        None if line.is_empty() => vec!["/bin/sh".into()],
        None => vec![line.to_string()],
    }
}

/// The file noting a step host's step tasks, next to its task record.
fn steps_path(record: &std::path::Path) -> PathBuf {
    record.with_extension("steps")
}

/// The step tasks a previous agent process started in job `key`'s step host
/// and that still run: their srun lost them with that agent, so they are
/// ended (checked against their environment, so a reused process id is never
/// taken for one).
fn orphaned_steps(record: &std::path::Path, key: Key) -> Vec<Pid> {
    let Ok(text) = std::fs::read_to_string(steps_path(record)) else { return Vec::new() };
    let job = format!("SLURM_JOB_ID={}", key.0);
    text.lines()
        .filter_map(|l| l.trim().parse::<i32>().ok())
        .map(Pid::from_raw)
        .filter(|&p| group_alive(p))
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == job.as_bytes()))
        })
        .collect()
}

/// A task's own process group and its step tasks' groups (step hosts).
fn task_groups(pgid: Pid, steps: &crate::steps::StepGroups) -> Vec<Pid> {
    let mut all = vec![pgid];
    all.extend(steps.lock().expect("step groups lock").iter().map(|g| Pid::from_raw(*g)));
    all
}

struct Task {
    pgid: Pid,
    /// Step tasks' process groups (a batch job's task; empty otherwise).
    steps: crate::steps::StepGroups,
    /// The shims among them (kept step tasks'): spared by a suspend.
    shims: crate::steps::StepGroups,
    /// Set once the task is being stopped (its group already has SIGTERM).
    stopping: Arc<AtomicBool>,
    /// When SIGTERM was sent, SIGKILL follows at this instant.
    kill_at: Option<Instant>,
    killed: bool,
    /// Sends the warning signal before the time limit; aborted when the
    /// task ends or is suspended.
    warn_timer: Option<tokio::task::JoinHandle<()>>,
    warning: Option<Warning>,
    /// Its job is suspended: its processes are stopped (shared with its
    /// step host, which then starts no step).
    suspended: Arc<AtomicBool>,
    /// The task's cgroup on cgroup v2 hosts.
    cgroup: Option<PathBuf>,
    /// GPU indexes the task was given (empty for re-adopted tasks).
    gpus: Vec<u32>,
}

pub struct Supervisor {
    node: String,
    /// GPUs on this node: orders naming others are refused.
    gpu_count: usize,
    cgroups: Option<crate::cgroup::Cgroups>,
    /// Each task's devices cgroup (cgroup v1), refusing other tasks' GPUs
    /// (`--constrain-devices`).
    devices: Option<crate::devices::DeviceCgroups>,
    state_dir: PathBuf,
    stop_grace: Duration,
    scripts_dir: PathBuf,
    /// One record per running task (pid, exit file), for re-adoption.
    records_dir: PathBuf,
    /// The `gangway` binary to run tasks under `task-shim`; without it tasks are
    /// the agent's own children and cannot outlive it.
    shim: Option<PathBuf>,
    tasks: BTreeMap<Key, Task>,
    exits_tx: mpsc::Sender<TaskExitReport>,
    /// Batch jobs' allocations here, for the step service.
    step_hosts: crate::steps::StepHosts,
    /// A directory of Slurm command links to the `gangway` binary, on every
    /// task's PATH (after the job's own), and the controllers they talk to.
    job_tools: Option<(PathBuf, String)>,
    /// Whether tasks may run as root (uid 0); refused unless the agent was
    /// started with `--allow-root-jobs`.
    pub allow_root_jobs: bool,
    /// The cluster's CA (PEM), handed to tasks so srun can check the agents
    /// it starts steps on; `None` on an insecure agent.
    pub step_ca_pem: Option<String>,
    /// The cluster this agent's certificate names, for the same tools.
    pub step_cluster: Option<String>,
    /// When suspended tasks were last looked over ([`Supervisor::keep_suspended`]).
    suspend_checked: Instant,
    /// Measures what tasks use (None: not measured).
    pub usage: Option<Arc<crate::usage::Sampler>>,
}

/// The agent's directories on a job's path (the state dir, its scripts and
/// task records): searchable by job users, who reach their own 0700 script and
/// 0600 exit file by name, but neither listable nor writable by them.
const SCRIPTS_DIR_MODE: u32 = 0o711;
/// Longest `GANGWAY_STEP_ADDRS` passed in the environment. Linux refuses to
/// exec with one environment string over 128 KiB (MAX_ARG_STRLEN): a batch
/// gang of a few thousand nodes gets its step addresses in a file
/// (`GANGWAY_STEP_ADDRS_FILE`, srun reads either) instead.
const STEP_ADDRS_ENV_BYTES_MAX: usize = 64 * 1024;

/// Takes `GANGWAY_STEP_ADDRS` out of `env` where it is longer than
/// [`STEP_ADDRS_ENV_BYTES_MAX`] (the task then gets it in a file).
fn take_long_step_addrs(env: &mut Vec<(String, String)>) -> Option<String> {
    let i = env.iter().position(|(k, v)| k == "GANGWAY_STEP_ADDRS" && v.len() > STEP_ADDRS_ENV_BYTES_MAX)?;
    Some(env.remove(i).1)
}

/// Makes `dir` the agent's and [`SCRIPTS_DIR_MODE`].
pub fn reachable_not_listable(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(SCRIPTS_DIR_MODE))
}

/// Runs `f` with this thread's file-system uid and gid set to `ids` (when
/// given), so the kernel checks every path component as that user would; the
/// thread's credentials are restored afterwards. Other threads are unaffected.
fn with_fs_ids<T>(ids: Option<(u32, u32)>, f: impl FnOnce() -> T) -> T {
    use nix::unistd::{setfsgid, setfsuid, Gid, Uid};
    let Some((uid, gid)) = ids else { return f() };
    let prev_gid = setfsgid(Gid::from_raw(gid));
    let prev_uid = setfsuid(Uid::from_raw(uid));
    let out = f();
    setfsuid(prev_uid);
    setfsgid(prev_gid);
    out
}

/// The umask the job's files get: the submitter's (`SLURM_UMASK`, octal),
/// else the usual 022.
pub fn job_umask(order: &LaunchOrder) -> u32 {
    order
        .env
        .get("SLURM_UMASK")
        .and_then(|u| u32::from_str_radix(u.trim(), 8).ok())
        .filter(|u| *u <= 0o777)
        .unwrap_or(0o022)
}

/// An output file: created with mode 0666 less `umask` (whatever the
/// process umask), or an existing one opened for appending (or truncated).
/// Only a regular file or a character device (`/dev/null`) will do: a FIFO
/// would block the agent (opened without blocking, then refused).
fn open_output(path: &std::path::Path, truncate: bool, umask: u32) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
    let f = match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(f) => {
            f.set_permissions(std::fs::Permissions::from_mode(0o666 & !umask))?;
            return Ok(f);
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(path)?
        }
        Err(e) => return Err(e),
    };
    let kind = f.metadata()?.file_type();
    if !(kind.is_file() || kind.is_char_device()) {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    // Blocking again, then append or truncate as asked.
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let flags = nix::fcntl::OFlag::from_bits_truncate(nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)?);
    let mut flags = flags;
    flags.remove(nix::fcntl::OFlag::O_NONBLOCK);
    if !truncate {
        flags |= nix::fcntl::OFlag::O_APPEND;
    }
    nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(flags))?;
    if truncate && kind.is_file() {
        f.set_len(0)?;
    }
    Ok(f)
}

/// What srun in the task needs to start steps on the job's other nodes: the
/// job's step credential and the CA that signed their agents' certificates
/// (after the job's own environment, so a job cannot replace them).
fn step_env(order: &LaunchOrder, ca_pem: Option<&str>, cluster: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if !order.step_credential.is_empty() {
        env.push((gangway_proto::step_cred::STEP_CREDENTIAL_ENV, order.step_credential.clone()));
    }
    if let Some(ca) = ca_pem {
        env.push((gangway_proto::step_cred::STEP_CA_ENV, ca.to_string()));
    }
    if let Some(cluster) = cluster {
        env.push((gangway_proto::step_cred::STEP_CLUSTER_ENV, cluster.to_string()));
    }
    env
}

/// A task's PATH when its job sends none (and the agent has no job tools).
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The Slurm commands a batch script may call, linked in every task's PATH.
pub const JOB_TOOLS: &[&str] = &["srun", "scontrol", "squeue", "sbatch", "scancel", "sinfo", "sacct", "seff"];

/// A task's PATH: the agent's job tools first, then the submitted PATH (or
/// the system default). First, because a node may have Slurm's own commands
/// installed too (a site moving over): a Gangway job's `srun` must be
/// Gangway's, which alone can start its steps.
pub fn job_path(submitted: Option<&str>, tools: &std::path::Path) -> String {
    // An empty entry would mean the job's working directory.
    let first = tools.display().to_string();
    // A PATH that has it already (a step's, from its job) keeps it once.
    let rest =
        submitted.unwrap_or(DEFAULT_PATH).split(':').filter(|p| !p.is_empty() && **p != *first).map(str::to_string);
    std::iter::once(first.clone()).chain(rest).collect::<Vec<_>>().join(":")
}

impl Supervisor {
    /// Confines every task from now on to its own GPUs (a devices cgroup);
    /// false where this host has no cgroup v1 devices controller.
    pub fn constrain_devices(&mut self) -> bool {
        let gpus = u32::try_from(self.gpu_count).unwrap_or(u32::MAX);
        self.devices = crate::devices::DeviceCgroups::detect(&self.node, &self.state_dir, gpus);
        self.devices.is_some()
    }

    pub fn new(
        node: &str,
        state_dir: &std::path::Path,
        stop_grace: Duration,
        gpu_count: usize,
        shim: Option<PathBuf>,
    ) -> (Supervisor, mpsc::Receiver<TaskExitReport>) {
        let (exits_tx, rx) = mpsc::channel(EXIT_QUEUE_MAX);
        let cgroups = crate::cgroup::Cgroups::detect();
        match &cgroups {
            Some(_) => tracing::info!("tasks run in cgroup v2 with CPU and memory limits"),
            None => tracing::info!("no delegable cgroup v2 here: tasks run as plain process groups"),
        }
        let s = Supervisor {
            node: node.to_string(),
            stop_grace,
            gpu_count,
            cgroups,
            devices: None,
            state_dir: state_dir.to_path_buf(),
            scripts_dir: state_dir.join("scripts"),
            records_dir: state_dir.join("tasks"),
            shim,
            tasks: BTreeMap::new(),
            exits_tx,
            step_hosts: Default::default(),
            job_tools: None,
            allow_root_jobs: false,
            step_ca_pem: None,
            step_cluster: None,
            suspend_checked: Instant::now(),
            usage: None,
        };
        (s, rx)
    }

    /// Links the Slurm commands (`srun`, `scontrol`, ...) to the `gangway`
    /// binary in STATE_DIR/bin and puts that directory first in every task's
    /// PATH ([`job_path`]), with GANGWAY_ENDPOINTS naming `controllers`, so
    /// batch scripts find them on a node where they were not installed.
    pub fn provide_job_tools(&mut self, state_dir: &std::path::Path, controllers: &[String]) {
        let Some(exe) = self.shim.clone() else { return };
        let dir = state_dir.join("bin");
        let made = std::fs::create_dir_all(&dir).and_then(|()| {
            // First in every job's PATH: it must be the agent's own, a real
            // directory nobody else may write (a `bin` someone else made, or
            // a link to theirs, would let them shadow every command of every
            // user's jobs).
            use std::os::unix::fs::{MetadataExt, PermissionsExt};
            let meta = std::fs::symlink_metadata(&dir)?;
            if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() {
                return Err(std::io::Error::other("not a directory owned by the agent's user"));
            }
            // Every job's user runs these (the agent's umask is 077).
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
            for name in JOB_TOOLS {
                let link = dir.join(name);
                if std::fs::read_link(&link).ok().as_deref() != Some(exe.as_path()) {
                    let _ = std::fs::remove_file(&link);
                    std::os::unix::fs::symlink(&exe, &link)?;
                }
            }
            Ok(())
        });
        match made {
            Ok(()) => self.job_tools = Some((dir, controllers.join(","))),
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "cannot link the Slurm commands for jobs"),
        }
    }

    /// The directory of Slurm command links, when they were provided.
    pub fn job_tools_dir(&self) -> Option<PathBuf> {
        self.job_tools.as_ref().map(|(dir, _)| dir.clone())
    }

    /// The allocations steps can start in (shared with the step service).
    pub fn step_hosts(&self) -> crate::steps::StepHosts {
        self.step_hosts.clone()
    }

    fn record_path(&self, key: Key) -> PathBuf {
        self.records_dir.join(format!("{}-{}", key.0, key.1))
    }

    /// The task's environment for a root shim (removed by the shim once read).
    fn env_path(&self, key: Key) -> PathBuf {
        self.records_dir.join(format!("{}-{}.env", key.0, key.1))
    }

    fn exit_path(&self, key: Key) -> PathBuf {
        self.records_dir.join(format!("{}-{}.exit", key.0, key.1))
    }

    /// Re-adopts the tasks a previous agent process left running (under the
    /// shim): they keep running and their exits are reported as usual. Tasks
    /// that ended meanwhile are reported from their exit files; tasks that
    /// vanished without one are reported lost (and requeued).
    pub fn adopt_all(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.records_dir) else { return };
        let mut records: Vec<TaskRecord> = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some((j, a)) = name.split_once('-') else { continue };
            let (Ok(j), Ok(a)) = (j.parse::<u64>(), a.parse::<u32>()) else { continue };
            let Ok(text) = std::fs::read_to_string(e.path()) else { continue };
            let mut lines = text.lines();
            if let Some(Ok(pid)) = lines.next().map(|l| l.trim().parse::<i32>()) {
                let rest: Vec<&str> = lines.collect();
                let host = rest.iter().find_map(|l| parse_step_host(l, pid));
                let gpus = rest.iter().find_map(|l| parse_gpus_line(l));
                records.push(((j, a), pid, host, gpus));
            }
        }
        for (key, pid, step_host, record_gpus) in records {
            if is_shim(pid) {
                tracing::info!(job = key.0, attempt = key.1, pid, "re-adopted a running task");
                let gpus = record_gpus.or_else(|| step_host.as_ref().map(|h| h.gpus.clone())).unwrap_or_default();
                let steps = step_host.as_ref().map(|h| h.groups.clone()).unwrap_or_default();
                // Step tasks that lost their srun with the agent. Kept ones
                // (under their shim, whose environment is empty: see
                // `kept.rs`) are not among them: they wait for their srun.
                let orphans = orphaned_steps(&self.record_path(key), key);
                if !orphans.is_empty() {
                    tracing::warn!(
                        job = key.0,
                        steps = orphans.len(),
                        "ending steps whose srun was lost with the agent"
                    );
                    let grace = self.stop_grace;
                    tokio::spawn(async move {
                        end_leftovers(|| orphans.clone(), &AtomicBool::new(false), grace).await;
                    });
                }
                let suspended: Arc<AtomicBool> = step_host.as_ref().map(|h| h.suspended.clone()).unwrap_or_default();
                let shims = step_host.as_ref().map(|h| h.shims.clone()).unwrap_or_default();
                if let Some(mut host) = step_host {
                    // Steps can start in a batch job's allocation again,
                    // confined to its devices as its first ones were.
                    host.steps_file = Some(steps_path(&self.record_path(key)));
                    host.devices = self.devices.as_ref().and_then(|d| d.of_running(key, &host.gpus));
                    self.step_hosts.lock().expect("step hosts lock").insert(key, host);
                }
                let pgid = Pid::from_raw(pid);
                let stopping = Arc::new(AtomicBool::new(false));
                self.tasks.insert(
                    key,
                    Task {
                        pgid,
                        steps: steps.clone(),
                        shims,
                        kill_at: None,
                        stopping: stopping.clone(),
                        killed: false,
                        warn_timer: None,
                        warning: None,
                        suspended,
                        cgroup: None,
                        gpus,
                    },
                );
                self.watch_adopted(key, pgid, stopping, steps);
            } else {
                self.report_from_files(key, None);
            }
        }
    }

    /// Polls an adopted task (not our child, so it cannot be waited for).
    fn watch_adopted(&self, key: Key, pid: Pid, stopping: Arc<AtomicBool>, steps: crate::steps::StepGroups) {
        let (tx, node, exit, record) =
            (self.exits_tx.clone(), self.node.clone(), self.exit_path(key), self.record_path(key));
        let grace = self.stop_grace;
        tokio::spawn(async move {
            while nix::sys::signal::kill(pid, None).is_ok() {
                tokio::time::sleep(ADOPTED_POLL_INTERVAL).await;
            }
            end_leftovers(|| task_groups(pid, &steps), &stopping, grace).await;
            let _ = tx.send(exit_report(&node, key, &exit, &record, None, None)).await;
        });
    }

    fn report_from_files(&self, key: Key, fallback: Option<(Option<i32>, Option<i32>)>) {
        let report = exit_report(&self.node, key, &self.exit_path(key), &self.record_path(key), fallback, None);
        let _ = self.exits_tx.try_send(report);
    }

    /// Running tasks and the GPUs each holds (for the agent's core, after
    /// re-adoption).
    pub fn running(&self) -> Vec<(Key, Vec<u32>)> {
        self.tasks.iter().map(|(k, t)| (*k, t.gpus.clone())).collect()
    }

    /// The task ended (its exit was received): forget it.
    pub fn forget(&mut self, key: Key) {
        self.step_hosts.lock().expect("step hosts lock").remove(&key);
        if let Some(t) = self.tasks.remove(&key) {
            if let Some(timer) = t.warn_timer {
                timer.abort();
            }
        }
    }

    /// Starts `order`'s task. An error is a reason the launch failed.
    /// The script's file: `STATE_DIR/scripts` is searchable but not listable
    /// (0711); the script is 0700 and owned by the job's user, created anew
    /// (never through a link), and removed when the task ends.
    fn write_script(&self, order: &LaunchOrder, ids: Option<(u32, u32)>) -> Result<PathBuf, String> {
        let path = self.script_path((order.job_id, order.attempt));
        self.write_user_file(&path, order.script.as_bytes(), 0o700, ids, "the batch script")?;
        Ok(path)
    }

    /// Writes a file of the task's under `STATE_DIR/scripts` (see
    /// `write_script`): created anew with `mode`, never through a link, owned
    /// by the job's user.
    fn write_user_file(
        &self,
        path: &std::path::Path,
        bytes: &[u8],
        mode: u32,
        ids: Option<(u32, u32)>,
        what: &str,
    ) -> Result<(), String> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(SCRIPTS_DIR_MODE)
            .create(&self.scripts_dir)
            .map_err(|e| format!("cannot create the script dir: {e}"))?;
        std::fs::set_permissions(&self.scripts_dir, std::fs::Permissions::from_mode(SCRIPTS_DIR_MODE))
            .map_err(|e| format!("cannot set the script dir's mode: {e}"))?;
        let _ = std::fs::remove_file(path);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| format!("cannot write {what}: {e}"))?;
        f.write_all(bytes).map_err(|e| format!("cannot write {what}: {e}"))?;
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::fchown(&f, Some(uid), Some(gid))
                .map_err(|e| format!("cannot give {what} to its user: {e}"))?;
        }
        Ok(())
    }

    fn step_addrs_path(&self, key: Key) -> PathBuf {
        // exit_report removes it by the same name.
        self.scripts_dir.join(format!("job-{}-{}.stepaddrs", key.0, key.1))
    }

    /// The agent's lease file, which every task's shim obeys (see `lease.rs`).
    pub fn lease_path(&self) -> PathBuf {
        self.records_dir.join("lease")
    }

    fn script_path(&self, key: Key) -> PathBuf {
        // exit_report removes it by the same name.
        self.scripts_dir.join(format!("job-{}-{}.sh", key.0, key.1))
    }

    pub fn launch(&mut self, order: &LaunchOrder) -> Result<(), String> {
        let key = (order.job_id, order.attempt);
        if self.tasks.contains_key(&key) {
            return Ok(());
        }
        if let Some(g) = order.gpus.iter().find(|g| **g as usize >= self.gpu_count) {
            return Err(format!("GPU {g} does not exist on {} (it has {})", self.node, self.gpu_count));
        }
        let workdir = if order.workdir.is_empty() { "/".to_string() } else { order.workdir.clone() };
        if !std::path::Path::new(&workdir).is_dir() {
            return Err(format!("working directory {workdir} does not exist on {}", self.node));
        }
        // The job's user, through NSS (getpwnam_r, so LDAP and SSSD users
        // resolve as local ones do): once per launch, for its ids and its
        // login's variables.
        let account = nix::unistd::User::from_name(&order.user).ok().flatten();
        let ids = self.task_ids(order, account.as_ref())?;
        // A batch job's nodes other than the first hold the allocation for
        // the steps srun starts there; they run nothing of their own.
        let step_host = order.batch && order.node_rank > 0;
        let argv = self.task_argv(order, ids, step_host)?;
        let mut cmd = self.task_command(order, key, ids, &argv)?;
        let (out, err) = self.open_outputs(order, ids, step_host)?;
        if self.shim.is_some() {
            let exit = self.exit_path(key);
            std::fs::write(&exit, "").map_err(|e| format!("cannot create the task's exit file: {e}"))?;
            if let Some((uid, gid)) = ids {
                let _ = std::os::unix::fs::chown(&exit, Some(uid), Some(gid));
            }
        }
        let env = self.environment(order, key, ids, account.as_ref())?;
        self.set_environment(&mut cmd, env, key, ids, &workdir)?;
        // The task's cgroups: the shim joins them before it runs anything of
        // the job's, so nothing the task runs (an early fork, a setsid) ever
        // ran outside them.
        let cgroup = self.cgroups.as_ref().and_then(|cg| {
            let cpus = order.tasks_per_node.saturating_mul(order.cpus_per_task);
            match cg.create(order.job_id, order.attempt, cpus, order.mem_per_node_mb) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::warn!(job = order.job_id, error = %e, "cgroup setup failed; process group only");
                    None
                }
            }
        });
        // Nothing reports a task that did not start: what was written for
        // it goes now (its environment file holds the job's secrets).
        let forget = |joined: &[PathBuf]| {
            for f in [self.script_path(key), self.step_addrs_path(key), self.env_path(key), self.exit_path(key)] {
                let _ = std::fs::remove_file(f);
            }
            for dir in joined {
                let _ = std::fs::remove_dir(dir);
            }
        };
        let devices = match &self.devices {
            Some(d) => match d.create(&format!("job-{}-{}", order.job_id, order.attempt), &order.gpus) {
                Ok(dir) => Some(dir),
                Err(e) => {
                    forget(cgroup.as_slice());
                    return Err(format!("cannot confine the task's devices: {e}"));
                }
            },
            None => None,
        };
        let joined: Vec<PathBuf> = cgroup.iter().chain(devices.iter()).cloned().collect();
        if self.shim.is_some() {
            // The shim's own options end here; the rest is the command.
            cmd.args(crate::devices::shim_options(&joined)).arg("--").args(&argv);
        }
        cmd.stdin(std::process::Stdio::null()).stdout(out).stderr(err).process_group(0).kill_on_drop(false);
        let child = cmd.spawn().map_err(|e| {
            forget(&joined);
            format!("cannot start the task: {e}")
        })?;
        let stopping = Arc::new(AtomicBool::new(false));
        let pid = child.id().ok_or("the task exited before it could be tracked")?;
        let pgid = Pid::from_raw(pid as i32);
        if self.shim.is_none() {
            // Without the shim (an agent that is not root): after it started.
            if let Err(e) = crate::devices::join(&joined, pid) {
                tracing::warn!(job = order.job_id, error = %e, "cgroup join failed; process group only");
            }
        }
        let shim = self.shim.is_some();
        let steps = crate::steps::StepGroups::default();
        let suspended = Arc::new(AtomicBool::new(false));
        let shims = crate::steps::StepGroups::default();
        let warning = warning_of(order, step_host);
        let warn_timer = warning.map(|w| arm_warning(key, w, pgid, steps.clone(), shim));
        self.tasks.insert(
            key,
            Task {
                pgid,
                steps: steps.clone(),
                shims: shims.clone(),
                kill_at: None,
                stopping: stopping.clone(),
                killed: false,
                warn_timer,
                warning,
                suspended: suspended.clone(),
                cgroup: cgroup.clone(),
                gpus: order.gpus.clone(),
            },
        );
        if order.batch {
            let host = crate::steps::StepHost {
                pgid: pgid.as_raw(),
                groups: steps.clone(),
                steps_file: self.shim.is_some().then(|| steps_path(&self.record_path(key))),
                ids,
                cgroup: cgroup.clone(),
                devices: devices.clone(),
                gpus: order.gpus.clone(),
                workdir: workdir.clone(),
                suspended: suspended.clone(),
                shims,
            };
            self.step_hosts.lock().expect("step hosts lock").insert(key, host);
        }
        tracing::info!(job = order.job_id, attempt = order.attempt, pid, step_host, "task started");
        if self.shim.is_some() {
            self.write_record(key, pid, &order.gpus);
        }
        let uid = ids.map_or_else(|| nix::unistd::geteuid().as_raw(), |(uid, _)| uid);
        let watched = Watched {
            key,
            child,
            pgid,
            steps,
            stopping,
            grace: self.stop_grace,
            cgroup,
            devices,
            node: self.node.clone(),
            exit: self.exit_path(key),
            record: self.record_path(key),
            tx: self.exits_tx.clone(),
            meter: self.usage.clone().map(|sampler| (sampler, crate::usage::Meter::new(&order.gpus, Some(uid)))),
        };
        tokio::spawn(watched.until_exit());
        Ok(())
    }

    /// The task's record, which lets a restarted agent find and re-adopt
    /// it: its pid, its GPUs (what it still holds), and a batch task's step
    /// host.
    fn write_record(&self, key: Key, pid: u32, gpus: &[u32]) {
        let mut record = pid.to_string();
        let gpus: Vec<String> = gpus.iter().map(u32::to_string).collect();
        record.push_str(&format!("\ngpus {}", gpus.join(",")));
        if let Some(host) = self.step_hosts.lock().expect("step hosts lock").get(&key) {
            record.push('\n');
            record.push_str(&step_host_line(host));
        }
        let _ = std::fs::write(self.record_path(key), record);
    }

    /// The ids a task runs as: None to run as the agent itself (an agent
    /// that is not root runs only its own user's jobs; root runs a job as
    /// root only with --allow-root-jobs).
    fn task_ids(&self, order: &LaunchOrder, account: Option<&nix::unistd::User>) -> Result<Option<(u32, u32)>, String> {
        if !nix::unistd::geteuid().is_root() {
            // Not root: the agent can only run tasks as itself, so it runs only
            // its own user's jobs rather than run others' as the wrong user.
            let me = nix::unistd::User::from_uid(nix::unistd::geteuid()).ok().flatten().map(|u| u.name);
            if me.as_deref() != Some(order.user.as_str()) {
                return Err(format!(
                    "the agent on {} does not run as root, so it runs jobs only for its own user ({}), not for {}",
                    self.node,
                    me.as_deref().unwrap_or("unknown"),
                    order.user
                ));
            }
            return Ok(None);
        }
        let ids = account
            .map(|u| (u.uid.as_raw(), u.gid.as_raw()))
            .ok_or_else(|| format!("user {} does not exist on {}", order.user, self.node))?;
        if ids.0 != 0 {
            return Ok(Some(ids));
        }
        if !self.allow_root_jobs {
            return Err(format!(
                "jobs as root (user {}, uid 0) are refused on {} (its agent runs without --allow-root-jobs)",
                order.user, self.node
            ));
        }
        Ok(None)
    }

    /// What the task runs: a step host's holding shell, a script through
    /// its interpreter (written to disk first), or the command.
    fn task_argv(&self, order: &LaunchOrder, ids: Option<(u32, u32)>, step_host: bool) -> Result<Vec<String>, String> {
        if step_host {
            return Ok(vec!["/bin/sh".into(), "-c".into(), crate::steps::HOLD_SCRIPT.into()]);
        }
        if order.script.is_empty() {
            return Ok(order.command.clone());
        }
        let path = self.write_script(order, ids)?;
        let path = path.display().to_string();
        // Run through its interpreter rather than exec'ing the file just
        // written: a task forked meanwhile on another thread may still
        // hold it open for writing, and exec would fail (ETXTBSY).
        let mut argv = interpreter(&order.script);
        argv.push(path);
        // With a script, the command is its arguments.
        argv.extend(order.command.iter().cloned());
        Ok(argv)
    }

    /// The process to start: the task shim (which becomes the user and
    /// then runs `argv`, added once the task's cgroups are known), or
    /// `argv` itself.
    fn task_command(
        &self,
        order: &LaunchOrder,
        key: Key,
        ids: Option<(u32, u32)>,
        argv: &[String],
    ) -> Result<tokio::process::Command, String> {
        let Some(shim) = &self.shim else {
            let (program, args) = argv.split_first().ok_or("the task has no command")?;
            let mut c = tokio::process::Command::new(program);
            c.args(args);
            return Ok(c);
        };
        std::fs::create_dir_all(&self.records_dir)
            .and_then(|()| reachable_not_listable(&self.records_dir))
            .map_err(|e| format!("cannot create the task records dir: {e}"))?;
        let _ = std::fs::remove_file(self.exit_path(key));
        let mut c = tokio::process::Command::new(shim);
        c.arg("task-shim").arg("--exit-file").arg(self.exit_path(key)).arg("--lease").arg(self.lease_path());
        // The shim becomes the user itself, supplementary groups
        // included (std's uid()/gid() would drop them).
        if let Some((uid, gid)) = ids {
            let user = crate::shim::TaskUser::lookup(&order.user)
                .filter(|u| u.uid == uid && u.gid == gid)
                .ok_or_else(|| format!("user {} changed or vanished on {} during launch", order.user, self.node))?;
            c.arg("--user").arg(user.encode());
        }
        Ok(c)
    }

    /// The task's standard output and error, opened with the job user's
    /// file-system credentials, so `-o` can only name a file that user may
    /// write (never /etc/passwd, nor a path through a symlink into a
    /// directory the user cannot write). A new file gets the submitter's
    /// umask (the agent's own is 077). A step host writes nothing: its
    /// steps' output goes back to srun.
    fn open_outputs(
        &self,
        order: &LaunchOrder,
        ids: Option<(u32, u32)>,
        step_host: bool,
    ) -> Result<(std::fs::File, std::fs::File), String> {
        let (out_path, err_path) = if step_host { ("/dev/null".into(), None) } else { output_paths(order, &self.node) };
        let umask = job_umask(order);
        let open = |path: &std::path::Path| {
            with_fs_ids(if step_host { None } else { ids }, || {
                open_output(path, order.truncate_output && !step_host, umask)
            })
            .map_err(|e| format!("cannot open output file {}: {e}", path.display()))
        };
        let out = open(&out_path)?;
        let err = match &err_path {
            Some(p) => open(p)?,
            None => out.try_clone().map_err(|e| format!("cannot open output file: {e}"))?,
        };
        Ok((out, err))
    }

    /// The task's environment, in the order it applies (later wins):
    /// nothing of the agent's own (its options file may hold secrets), a
    /// PATH unless the job sends one, a login's variables, then what the
    /// job asked for, Slurm's variables, the GPUs' and the steps'.
    fn environment(
        &self,
        order: &LaunchOrder,
        key: Key,
        ids: Option<(u32, u32)>,
        account: Option<&nix::unistd::User>,
    ) -> Result<Vec<(String, String)>, String> {
        let mut env: Vec<(String, String)> = vec![("PATH".into(), DEFAULT_PATH.into())];
        // A login's variables, from the password database, unless the job sends its own.
        if let Some(u) = account {
            env.push(("HOME".into(), u.dir.display().to_string()));
            env.push(("USER".into(), u.name.clone()));
            env.push(("LOGNAME".into(), u.name.clone()));
            env.push(("SHELL".into(), u.shell.display().to_string()));
        }
        if let Some((dir, endpoints)) = &self.job_tools {
            env.push(("PATH".into(), job_path(order.env.get("PATH").map(String::as_str), dir)));
            if !order.env.contains_key("GANGWAY_ENDPOINTS") {
                env.push(("GANGWAY_ENDPOINTS".into(), endpoints.clone()));
            }
        }
        env.extend(
            order
                .env
                .iter()
                .filter(|(k, _)| self.job_tools.is_none() || *k != "PATH")
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        env.extend(task_env(order, &self.node));
        if self.devices.is_some() && !order.gpus.is_empty() {
            // CUDA numbers the GPUs a confined task can open from 0.
            env.push(("CUDA_VISIBLE_DEVICES".into(), crate::devices::local_indexes(order.gpus.len())));
            env.push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
        }
        if let Some(addrs) = take_long_step_addrs(&mut env) {
            let path = self.step_addrs_path(key);
            self.write_user_file(&path, addrs.as_bytes(), 0o600, ids, "the step addresses")?;
            env.push(("GANGWAY_STEP_ADDRS_FILE".into(), path.display().to_string()));
        }
        env.extend(
            step_env(order, self.step_ca_pem.as_deref(), self.step_cluster.as_deref())
                .into_iter()
                .map(|(k, v)| (k.to_string(), v)),
        );
        Ok(env)
    }

    /// Gives `cmd` the task's environment, working directory and ids.
    fn set_environment(
        &self,
        cmd: &mut tokio::process::Command,
        env: Vec<(String, String)>,
        key: Key,
        ids: Option<(u32, u32)>,
        workdir: &str,
    ) -> Result<(), String> {
        match (ids, &self.shim) {
            // A root shim gets an empty environment and the root directory:
            // the task's environment and working directory take effect only
            // once it is the user (nothing of the job's reaches a root process).
            (Some(_), Some(_)) => {
                let full: BTreeMap<String, String> = env.into_iter().collect();
                let env_file = self.env_path(key);
                let entries: Vec<(String, String)> = full.into_iter().collect();
                crate::shim::write_env_file(&env_file, &entries)
                    .map_err(|e| format!("cannot write the task's environment: {e}"))?;
                cmd.env_clear().current_dir("/").arg("--env-file").arg(&env_file).arg("--workdir").arg(workdir);
            }
            (Some((uid, gid)), None) => {
                cmd.uid(uid).gid(gid).current_dir(workdir).env_clear().envs(env);
            }
            (None, _) => {
                cmd.current_dir(workdir).env_clear().envs(env);
            }
        }
        Ok(())
    }

    /// Asks a task to stop: SIGTERM to its whole process group now, SIGKILL
    /// after `grace` (see [`Supervisor::enforce_kills`]). A task already
    /// stopping keeps the earlier of its two kill deadlines.
    pub fn stop(&mut self, key: Key, grace: Duration) {
        if let Some(t) = self.tasks.get_mut(&key) {
            let kill_at = crate::deadline_in(grace);
            match t.kill_at {
                None => {
                    tracing::info!(job = key.0, attempt = key.1, "stopping task");
                    t.stopping.store(true, Ordering::SeqCst);
                    let groups = task_groups(t.pgid, &t.steps);
                    for g in &groups {
                        let _ = killpg(*g, Signal::SIGTERM);
                    }
                    // A suspended task is continued, so that it can act on it.
                    t.suspended.store(false, Ordering::SeqCst);
                    continue_processes(&groups, t.cgroup.as_deref());
                    t.kill_at = Some(kill_at);
                }
                Some(at) if kill_at < at => t.kill_at = Some(kill_at),
                Some(_) => {}
            }
        }
    }

    /// Suspends a task (its job was suspended): every process of it stops
    /// where it stands, the shim excepted; its time-limit warning waits.
    pub fn suspend(&mut self, key: Key) {
        let shim = self.shim.is_some();
        let Some(t) = self.tasks.get_mut(&key) else { return };
        if t.stopping.load(Ordering::SeqCst) {
            return;
        }
        if let Some(timer) = t.warn_timer.take() {
            timer.abort();
        }
        let now = Instant::now();
        match t.warning {
            // Already sent (or being sent): it is not sent again.
            Some(w) if w.paused.is_none() && w.due <= now => t.warning = None,
            Some(ref mut w) if w.paused.is_none() => w.paused = Some(w.due.saturating_duration_since(now)),
            _ => {}
        }
        // Before the processes stop: no step starts meanwhile.
        t.suspended.store(true, Ordering::SeqCst);
        // Under the shim the group's leader is the shim: it keeps running.
        stop_processes(&task_groups(t.pgid, &t.steps), t.cgroup.as_deref(), &spared(shim, t));
        tracing::info!(job = key.0, attempt = key.1, "task suspended");
    }

    /// Sends a task `signal` (`scancel --signal`): to its steps and the
    /// script's other commands (not the batch shell or srun), to the batch
    /// shell only, or to every process. A job without batch semantics has
    /// no batch shell apart from its command: `Steps` reaches all of it.
    pub fn signal(&mut self, key: Key, signal: i32, target: gangway_core::command::SignalTarget) {
        use gangway_core::command::SignalTarget;
        let Some(t) = self.tasks.get(&key) else { return };
        let Ok(sig) = Signal::try_from(signal) else {
            tracing::warn!(job = key.0, signal, "not a signal this host knows: not sent");
            return;
        };
        let batch = self.step_hosts.lock().expect("step hosts lock").contains_key(&key);
        let to = match target {
            SignalTarget::Full => WarnTarget::Group,
            SignalTarget::Batch => WarnTarget::BatchShell,
            SignalTarget::Steps if batch => WarnTarget::AllButBatchShell,
            SignalTarget::Steps => WarnTarget::Group,
        };
        tracing::info!(job = key.0, attempt = key.1, signal = %sig, ?to, "sending the job's signal");
        send_warning(&task_groups(t.pgid, &t.steps), sig, to, self.shim.is_some());
    }

    /// Stops again whatever of a suspended task runs (a process forked as
    /// it was being stopped, a command its shim started after the stop):
    /// called on the agent's tick, at most every [`SUSPEND_RECHECK`].
    pub fn keep_suspended(&mut self) {
        let now = Instant::now();
        if now.saturating_duration_since(self.suspend_checked) < SUSPEND_RECHECK {
            return;
        }
        self.suspend_checked = now;
        let shim = self.shim.is_some();
        for t in self.tasks.values().filter(|t| t.suspended.load(Ordering::SeqCst)) {
            if !t.stopping.load(Ordering::SeqCst) {
                stop_processes(&task_groups(t.pgid, &t.steps), t.cgroup.as_deref(), &spared(shim, t));
            }
        }
    }

    /// Continues a suspended task; its time-limit warning is due after the
    /// time it had left. (Continuing a running task changes nothing.)
    pub fn resume(&mut self, key: Key) {
        let shim = self.shim.is_some();
        let Some(t) = self.tasks.get_mut(&key) else { return };
        continue_processes(&task_groups(t.pgid, &t.steps), t.cgroup.as_deref());
        if let Some(w) = t.warning.as_mut() {
            if let Some(left) = w.paused.take() {
                w.due = crate::deadline_in(left);
                t.warn_timer = Some(arm_warning(key, *w, t.pgid, t.steps.clone(), shim));
            }
        }
        if t.suspended.swap(false, Ordering::SeqCst) {
            tracing::info!(job = key.0, attempt = key.1, "task resumed");
        }
    }

    /// The configured grace period between SIGTERM and SIGKILL.
    pub fn stop_grace(&self) -> Duration {
        self.stop_grace
    }

    /// SIGKILLs the process groups of tasks that outlived their grace period.
    pub fn enforce_kills(&mut self) {
        let now = Instant::now();
        for (key, t) in self.tasks.iter_mut() {
            if let Some(at) = t.kill_at {
                if !t.killed && now >= at {
                    tracing::warn!(
                        job = key.0,
                        attempt = key.1,
                        "task outlived its grace period; killing its process group"
                    );
                    for g in task_groups(t.pgid, &t.steps) {
                        let _ = killpg(g, Signal::SIGKILL);
                    }
                    if let Some(dir) = &t.cgroup {
                        crate::cgroup::Cgroups::kill(dir);
                    }
                    t.killed = true;
                }
            }
        }
    }

    /// Kills every task's process group (the agent is shutting down in a test or
    /// dev cluster; a production agent leaves tasks running).
    pub fn kill_all(&mut self) {
        for t in self.tasks.values() {
            for g in task_groups(t.pgid, &t.steps) {
                let _ = killpg(g, Signal::SIGKILL);
            }
        }
    }
}

/// A started task, watched until it ends: its usage measured (when the
/// agent measures), what it left behind ended, its cgroups emptied and
/// removed, and its exit reported.
struct Watched {
    key: Key,
    child: tokio::process::Child,
    pgid: Pid,
    steps: crate::steps::StepGroups,
    stopping: Arc<AtomicBool>,
    grace: Duration,
    cgroup: Option<PathBuf>,
    devices: Option<PathBuf>,
    node: String,
    exit: PathBuf,
    record: PathBuf,
    tx: mpsc::Sender<TaskExitReport>,
    meter: Option<(Arc<crate::usage::Sampler>, crate::usage::Meter)>,
}

impl Watched {
    async fn until_exit(mut self) {
        use std::os::unix::process::ExitStatusExt;
        let (pgid, key) = (self.pgid, self.key);
        let tree_ticks = match &mut self.meter {
            Some((sampler, meter)) => measure_until_exit(pgid.as_raw(), pgid, &self.steps, sampler, meter).await,
            None => None,
        };
        let result = self.child.wait().await;
        end_leftovers(|| task_groups(pgid, &self.steps), &self.stopping, self.grace).await;
        let peak_mem_mb = self.cgroup.as_deref().and_then(crate::cgroup::Cgroups::peak_mb);
        if let Some(dir) = &self.cgroup {
            crate::cgroup::Cgroups::kill(dir); // anything the task left behind
            crate::cgroup::Cgroups::remove(dir);
        }
        if let Some(dir) = self.devices.clone() {
            // Nothing left behind keeps its GPUs for the next job.
            let killed = tokio::task::spawn_blocking(move || crate::devices::DeviceCgroups::empty(&dir)).await;
            if let Ok(n @ 1..) = killed {
                tracing::warn!(job = key.0, processes = n, "killed what the task left in its devices cgroup");
            }
        }
        let usage = self
            .meter
            .as_mut()
            .and_then(|(s, meter)| meter.finish(s, tree_ticks, peak_mem_mb))
            .map(crate::usage::to_proto);
        let mut report = match result {
            Ok(status) => exit_report(
                &self.node,
                key,
                &self.exit,
                &self.record,
                Some((status.code(), status.signal())),
                peak_mem_mb,
            ),
            Err(e) => TaskExitReport {
                node: self.node,
                job_id: key.0,
                attempt: key.1,
                exit_code: None,
                signal: None,
                reason: format!("lost track of the task: {e}"),
                lost: false,
                peak_mem_mb,
                usage: None,
            },
        };
        report.usage = usage;
        let _ = self.tx.send(report).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::group_members;

    /// Whether a root-only test can run. Not root fails it (a check that
    /// was skipped must not pass as done), unless GANGWAY_TESTS_WITHOUT_ROOT
    /// is set: a run that knowingly leaves the root-only tests out, which
    /// then says so. CI runs as root.
    fn as_root() -> bool {
        if nix::unistd::geteuid().is_root() {
            return true;
        }
        if std::env::var_os("GANGWAY_TESTS_WITHOUT_ROOT").is_some() {
            eprintln!("skipped (GANGWAY_TESTS_WITHOUT_ROOT): this test needs root");
            return false;
        }
        panic!("this test needs root (CI runs as root); set GANGWAY_TESTS_WITHOUT_ROOT=1 to leave root-only tests out");
    }

    #[test]
    fn a_jobs_slurm_commands_come_before_any_installed_slurm() {
        let tools = std::path::Path::new("/var/lib/gangway/bin");
        assert_eq!(job_path(Some("/usr/bin:/bin"), tools), "/var/lib/gangway/bin:/usr/bin:/bin");
        assert_eq!(job_path(None, tools), "/var/lib/gangway/bin:/usr/local/bin:/usr/bin:/bin");
        assert_eq!(job_path(Some(":/usr/bin::"), tools), "/var/lib/gangway/bin:/usr/bin", "no current directory");
        assert_eq!(job_path(Some(""), tools), "/var/lib/gangway/bin");
        // A step's PATH, from its job's, keeps the tools once.
        let again = job_path(Some("/var/lib/gangway/bin:/usr/bin"), tools);
        assert_eq!(job_path(Some(&again), tools), "/var/lib/gangway/bin:/usr/bin");
    }

    #[test]
    fn task_records_keep_their_gpus() {
        assert_eq!(parse_gpus_line("gpus 0,3"), Some(vec![0, 3]));
        assert_eq!(parse_gpus_line("gpus "), Some(vec![]));
        assert_eq!(parse_gpus_line("gpus x"), None);
        assert_eq!(parse_gpus_line("step-host - - 1 /tmp"), None);
    }

    fn order(gpus: Vec<u32>, workdir: &str, output: &str) -> LaunchOrder {
        LaunchOrder {
            job_id: 1,
            attempt: 1,
            user: "root".into(),
            command: vec!["true".into()],
            workdir: workdir.into(),
            output: output.into(),
            gpus,
            nodes: vec!["n1".into()],
            ..Default::default()
        }
    }

    #[test]
    fn scripts_run_through_their_interpreter() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(interpreter("#!/bin/bash\necho"), v(&["/bin/bash"]));
        assert_eq!(interpreter("#!/usr/bin/env python3\nprint()"), v(&["/usr/bin/env", "python3"]));
        assert_eq!(interpreter("#! /bin/bash -l  \n"), v(&["/bin/bash", "-l"]));
        assert_eq!(interpreter("echo no shebang"), v(&["/bin/sh"]));
        assert_eq!(interpreter("#!\n"), v(&["/bin/sh"]));
    }

    #[test]
    fn step_hosts_survive_in_task_records() {
        let host = crate::steps::StepHost {
            pgid: 42,
            groups: Default::default(),
            steps_file: None,
            ids: Some((1000, 100)),
            cgroup: None,
            devices: None,
            gpus: vec![2, 3],
            workdir: "/home/alice/my runs".into(),
            suspended: Default::default(),
            shims: Default::default(),
        };
        let back = parse_step_host(&step_host_line(&host), 42).unwrap();
        assert_eq!((back.ids, back.gpus, back.workdir.as_str()), (host.ids, host.gpus, "/home/alice/my runs"));
        let bare = crate::steps::StepHost { ids: None, gpus: vec![], workdir: "/".into(), ..host };
        let back = parse_step_host(&step_host_line(&bare), 7).unwrap();
        assert_eq!((back.pgid, back.ids, back.gpus.len()), (7, None, 0));
        assert!(parse_step_host("something else", 1).is_none());
    }

    /// EXIT_QUEUE_MAX exits wait to be reported; one more waits for room.
    #[test]
    fn at_most_exit_queue_max_exits_wait() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _rx) = Supervisor::new("n1", dir.path(), STOP_GRACE_DEFAULT, 0, None);
        for _ in 0..EXIT_QUEUE_MAX {
            s.exits_tx.try_send(TaskExitReport::default()).expect("room in the queue");
        }
        let full = s.exits_tx.try_send(TaskExitReport::default());
        assert!(matches!(full, Err(mpsc::error::TrySendError::Full(_))), "{full:?}");
    }

    /// GANGWAY_STEP_ADDRS of STEP_ADDRS_ENV_BYTES_MAX bytes stays in the
    /// environment; one byte longer is taken out (to go in a file).
    #[test]
    fn step_addrs_stay_in_the_environment_up_to_step_addrs_env_bytes_max() {
        let env = |bytes: usize| {
            vec![("A".to_string(), "1".to_string()), ("GANGWAY_STEP_ADDRS".to_string(), "x".repeat(bytes))]
        };
        let mut at = env(STEP_ADDRS_ENV_BYTES_MAX);
        assert_eq!(take_long_step_addrs(&mut at), None);
        assert_eq!(at, env(STEP_ADDRS_ENV_BYTES_MAX));
        let mut past = env(STEP_ADDRS_ENV_BYTES_MAX + 1);
        assert_eq!(take_long_step_addrs(&mut past).map(|a| a.len()), Some(STEP_ADDRS_ENV_BYTES_MAX + 1));
        assert_eq!(past, vec![("A".to_string(), "1".to_string())]);
    }

    #[tokio::test]
    async fn leftovers_end_before_the_exit_is_reported() {
        // The main process exits at once, leaving a background process (one
        // that ignores SIGTERM, so only the SIGKILL after the grace ends it).
        let mut child = tokio::process::Command::new("sh")
            .args(["-c", "sh -c 'trap \"\" TERM; while :; do sleep 1; done' & exit 0"])
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = Pid::from_raw(child.id().unwrap() as i32);
        assert!(child.wait().await.unwrap().success());
        assert!(group_alive(pgid), "the background process should still run");
        end_leftovers(|| vec![pgid], &AtomicBool::new(false), Duration::from_millis(300)).await;
        assert!(!group_alive(pgid), "a leftover outlived end_leftovers");
    }

    /// A task's environment is what its job asked for and the variables
    /// the agent sets for it: nothing of the agent's own (an options file's
    /// secrets, its RUST_LOG, the service manager's variables).
    #[tokio::test]
    async fn a_task_gets_nothing_of_the_agents_environment() {
        if !as_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (mut s, mut exits) = Supervisor::new("n1", dir.path(), STOP_GRACE_DEFAULT, 0, None);
        s.allow_root_jobs = true;
        let out = dir.path().join("env.out");
        let mut o = order(vec![], &dir.path().display().to_string(), &out.display().to_string());
        o.command = vec!["env".into()];
        o.env.insert("JOB_ASKED".into(), "yes".into());
        // The test process's variables, but for those the agent sets for tasks.
        let set = task_env(&o, "n1");
        let login = ["PATH", "HOME", "USER", "LOGNAME", "SHELL"];
        let agents: Vec<String> = std::env::vars()
            .map(|(k, _)| k)
            .filter(|k| !login.contains(&k.as_str()) && !set.contains_key(k))
            .filter(|k| !k.starts_with("SLURM") && !k.starts_with("GANGWAY"))
            .collect();
        assert!(!agents.is_empty(), "the test process has variables of its own");
        s.launch(&o).unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(30), exits.recv()).await.unwrap().unwrap();
        assert_eq!(exit.exit_code, Some(0), "{exit:?}");
        let text = std::fs::read_to_string(&out).unwrap();
        let keys: Vec<&str> = text.lines().filter_map(|l| l.split_once('=').map(|(k, _)| k)).collect();
        assert!(text.contains("JOB_ASKED=yes\n") && text.contains("SLURM_JOB_ID=1\n"), "{text}");
        assert!(text.contains(&format!("PATH={DEFAULT_PATH}\n")), "a PATH when the job sends none: {text}");
        let root = nix::unistd::User::from_name("root").unwrap().unwrap();
        assert!(text.contains(&format!("HOME={}\n", root.dir.display())), "a login's HOME: {text}");
        assert!(text.contains("USER=root\n") && text.contains("LOGNAME=root\n"), "{text}");
        let leaked: Vec<&String> = agents.iter().filter(|k| keys.contains(&k.as_str())).collect();
        assert!(leaked.is_empty(), "the agent's own variables reached the task: {leaked:?}");
    }

    /// A task may open only its own GPUs, whatever CUDA_VISIBLE_DEVICES
    /// says: with fake GPUs (device nodes of the NVIDIA major, minors 0 and
    /// 1; no driver here, so opening an allowed one fails with ENXIO, a
    /// refused one with EPERM first), a task holding GPU 0 opens it and is
    /// refused GPU 1; a task holding none is refused both; both open
    /// /dev/zero. (Without the shim, as here, a task joins its cgroup just
    /// after it started, so the script waits to be in it; through the shim,
    /// before it runs: the e2e test's sbatch jobs.)
    #[tokio::test]
    async fn a_task_opens_only_its_own_gpus() {
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        if !as_root() {
            return;
        }
        assert!(
            std::path::Path::new("/sys/fs/cgroup/devices/devices.allow").exists(),
            "this host has no cgroup v1 devices controller (the CI machines do)"
        );
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("dev");
        std::fs::create_dir(&dev).unwrap();
        for (name, major, minor) in [("nvidia0", 195, 0), ("nvidia1", 195, 1), ("zero", 1, 5)] {
            mknod(&dev.join(name), SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(major, minor)).unwrap();
        }
        let (mut s, mut exits) = Supervisor::new("n1", dir.path(), STOP_GRACE_DEFAULT, 2, None);
        s.allow_root_jobs = true;
        assert!(s.constrain_devices());
        let opens = |job: u64, gpus: Vec<u32>, out: &std::path::Path| {
            let mut o = order(gpus, &dir.path().display().to_string(), &out.display().to_string());
            o.job_id = job;
            // The opens run in a forked child, as a job's early fork would.
            let each = format!(
                "until grep -q devices:/gangway/ /proc/$$/cgroup; do sleep 0.01; done; (exec 3<{}/zero) && echo zero \
                 open; for d in nvidia0 nvidia1; do dd if={}/$d of=/dev/null count=1 2>&1 | head -1; done",
                dev.display(),
                dev.display()
            );
            o.command = vec!["sh".into(), "-c".into(), each];
            o
        };
        let (mine, none) = (dir.path().join("gpu0.out"), dir.path().join("none.out"));
        s.launch(&opens(1, vec![0], &mine)).unwrap();
        s.launch(&opens(2, vec![], &none)).unwrap();
        for _ in 0..2 {
            let exit = tokio::time::timeout(Duration::from_secs(30), exits.recv()).await.unwrap().unwrap();
            assert_eq!(exit.exit_code, Some(0), "{exit:?}");
        }
        let mine = std::fs::read_to_string(&mine).unwrap();
        let none = std::fs::read_to_string(&none).unwrap();
        assert!(mine.contains("zero open"), "{mine}");
        // Refused by the cgroup (EPERM) for the GPU not its own; the driver's
        // absence (ENXIO) for its own.
        let lines: Vec<&str> = mine.lines().filter(|l| l.starts_with("dd:")).collect();
        assert!(lines.len() == 2 && lines[0].contains("No such device"), "GPU 0 reached the driver: {mine}");
        assert!(lines[1].contains("Operation not permitted"), "GPU 1 refused by the cgroup: {mine}");
        let lines: Vec<&str> = none.lines().filter(|l| l.starts_with("dd:")).collect();
        assert!(lines.iter().all(|l| l.contains("Operation not permitted")), "no GPU for a CPU job: {none}");
        assert!(none.contains("zero open"), "{none}");
        // The cgroups go with their tasks.
        let root = s.devices.as_ref().unwrap().root().to_path_buf();
        assert!(root.exists());
        assert!(!root.join("job-1-1").exists() && !root.join("job-2-1").exists(), "a task's devices cgroup was left");
        drop(s);
        let _ = std::fs::remove_dir(&root);
    }

    #[test]
    fn bad_orders_fail_with_a_reason_and_start_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, _rx) = Supervisor::new("n1", dir.path(), STOP_GRACE_DEFAULT, 2, None);
        let work = dir.path().display().to_string();
        if nix::unistd::geteuid().is_root() {
            // Root's jobs need --allow-root-jobs.
            let err = s.launch(&order(vec![], &work, "")).unwrap_err();
            assert!(err.contains("jobs as root"), "{err}");
        }
        s.allow_root_jobs = true;
        let err = s.launch(&order(vec![5], &work, "")).unwrap_err();
        assert!(err.contains("GPU 5 does not exist"), "{err}");
        let err = s.launch(&order(vec![0], &work, "/proc/gangway-denied/out.log")).unwrap_err();
        assert!(err.contains("cannot open output file"), "{err}");
        let err = s.launch(&order(vec![], "/nonexistent/dir", "")).unwrap_err();
        assert!(err.contains("does not exist"), "{err}");
        // A task that cannot start leaves nothing written for it (its script).
        let unstartable =
            LaunchOrder { script: "#!/nonexistent/interpreter\ntrue\n".into(), ..order(vec![], &work, "") };
        let err = s.launch(&unstartable).unwrap_err();
        assert!(err.contains("cannot start the task"), "{err}");
        let left: Vec<_> =
            std::fs::read_dir(dir.path().join("scripts")).map(|d| d.flatten().count()).into_iter().collect();
        assert!(left.iter().all(|n| *n == 0), "a script of a task that never started was left: {left:?}");
        assert!(s.running().is_empty(), "a failed launch left a task behind");
    }

    /// Suspending a task stops its shell and the shell's child (no shim
    /// here: the group is the task), pauses its `--signal` warning by the
    /// time it had left, and resuming continues both; a stop of a suspended
    /// task still ends it by SIGTERM.
    #[tokio::test]
    async fn suspend_stops_every_process_pauses_the_warning_and_a_stop_still_ends_it() {
        // Root jobs need a root agent.
        if !as_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (mut s, mut exits) = Supervisor::new("n1", dir.path(), Duration::from_secs(30), 2, None);
        s.allow_root_jobs = true;
        let (ticks, warned) = (dir.path().join("ticks"), dir.path().join("warned"));
        // A shell and its child both tick; USR1 (the warning, due 1 s in) is noted.
        let script = format!(
            "#!/bin/sh\ntrap 'echo warned >> {w}' USR1\n(while :; do echo c >> {t}; sleep 0.05; done) &\n\
             while :; do echo p >> {t}; sleep 0.05; done\n",
            w = warned.display(),
            t = ticks.display()
        );
        let batch = LaunchOrder {
            batch: true,
            command: vec![],
            script,
            time_limit_s: 2,
            warn_signal: 10,
            warn_before_s: 1,
            warn_batch_shell: true,
            ..order(vec![], &dir.path().display().to_string(), "/dev/null")
        };
        s.launch(&batch).expect("the task starts");
        let count = || std::fs::read_to_string(&ticks).map_or(0, |t| t.lines().count());
        let key = (1, 1);
        tokio::time::sleep(Duration::from_millis(400)).await;
        s.suspend(key);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = count();
        assert!(before > 0, "the task ticked before its suspension");
        let pgid = s.tasks[&key].pgid;
        let members = group_members(pgid).unwrap();
        assert!(members.len() >= 2, "{members:?}");
        for (pid, _) in &members {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let state = stat.rsplit_once(')').unwrap().1.split_whitespace().next().unwrap().to_string();
            assert_eq!(state, "T", "process {pid} of the task is stopped");
        }
        let host_suspended = |s: &Supervisor| s.step_hosts.lock().unwrap()[&key].suspended.load(Ordering::SeqCst);
        assert!(host_suspended(&s), "its step host starts no step while suspended");
        // Past the warning's first due time: nothing ticks, nothing is warned.
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        assert_eq!(count(), before, "a suspended task does not run");
        assert!(!warned.exists(), "the warning waits while the task is suspended");
        s.resume(key);
        assert!(!host_suspended(&s));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(count() > before, "the resumed task runs again");
        assert!(!warned.exists(), "the warning had 600 ms left at the suspension");
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(warned.exists(), "the warning comes after the time it had left");
        // A stop of a suspended task continues it, so SIGTERM ends it long
        // before the 30 s grace's SIGKILL.
        s.suspend(key);
        s.stop(key, Duration::from_secs(30));
        let report = tokio::time::timeout(Duration::from_secs(10), exits.recv()).await.unwrap().unwrap();
        assert_eq!(report.signal, Some(15), "{report:?}");
    }

    /// A batch gang of 6,000 nodes: its step addresses are longer than one
    /// environment string may be (the exec would fail with E2BIG), so the
    /// script gets them in a file of its own, which goes with the task.
    #[tokio::test]
    async fn a_big_gangs_step_addresses_reach_its_script_in_a_file() {
        // The job runs as root here, which only a root agent may start.
        if !as_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (mut s, mut exits) = Supervisor::new("node-00000", dir.path(), STOP_GRACE_DEFAULT, 2, None);
        s.allow_root_jobs = true;
        let nodes: Vec<String> = (0..6_000).map(|i| format!("node-{i:05}")).collect();
        let step_addrs: Vec<String> = (0..6_000).map(|i| format!("10.1.{}.{}:7011", i / 250, i % 250)).collect();
        let out = dir.path().join("out.txt");
        let batch = LaunchOrder {
            batch: true,
            command: vec![],
            script: "#!/bin/sh\necho \"env=${#GANGWAY_STEP_ADDRS} file=$GANGWAY_STEP_ADDRS_FILE\"\nhead -c 27 \"$GANGWAY_STEP_ADDRS_FILE\"; echo\nwc -c < \"$GANGWAY_STEP_ADDRS_FILE\"\n".into(),
            nodes: nodes.clone(),
            step_addrs: step_addrs.clone(),
            ..order(vec![], &dir.path().display().to_string(), &out.display().to_string())
        };
        s.launch(&batch).expect("the task starts");
        let report = tokio::time::timeout(Duration::from_secs(20), exits.recv()).await.unwrap().unwrap();
        assert_eq!(report.exit_code, Some(0), "{report:?}");
        let text = std::fs::read_to_string(&out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("env=0 file=/"), "{text}");
        assert_eq!(lines[1], "node-00000=10.1.0.0:7011,no", "{text}");
        let want: usize = nodes.iter().zip(&step_addrs).map(|(n, a)| n.len() + 1 + a.len() + 1).sum::<usize>() - 1;
        assert_eq!(lines[2].trim(), want.to_string(), "{text}");
        let file = lines[0].trim_start_matches("env=0 file=");
        assert!(!std::path::Path::new(file).exists(), "the file outlived its task");
    }

    /// A hostile job's output paths: opened as the job's user, so neither a
    /// root-owned file, nor a symlink into a root-only directory, nor `../` in
    /// the job name reaches anything that user could not write anyway.
    #[tokio::test]
    async fn output_files_are_opened_as_the_jobs_user() {
        use std::os::unix::fs::PermissionsExt;
        // Only a root agent switches users.
        if !as_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (mut s, _rx) = Supervisor::new("n1", dir.path(), STOP_GRACE_DEFAULT, 2, None);
        // A directory the user may write, and a root-only one with a file.
        let open_dir = dir.path().join("work");
        std::fs::create_dir(&open_dir).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let secret_dir = dir.path().join("root-only");
        std::fs::create_dir(&secret_dir).unwrap();
        std::fs::set_permissions(&secret_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let secret = secret_dir.join("passwd");
        std::fs::write(&secret, "root:x:0:0\n").unwrap();
        std::os::unix::fs::symlink(&secret, open_dir.join("link")).unwrap();
        let work = open_dir.display().to_string();
        let as_nobody = |output: &str, name: &str| LaunchOrder {
            user: "nobody".into(),
            name: name.into(),
            ..order(vec![], &work, output)
        };
        for (output, name) in [
            (secret.display().to_string(), "job"),
            (open_dir.join("link").display().to_string(), "job"),
            (format!("{}/%x.out", open_dir.display()), "../root-only/passwd"),
        ] {
            let err = s.launch(&as_nobody(&output, name)).unwrap_err();
            assert!(err.contains("cannot open output file") && err.contains("ermission denied"), "{output}: {err}");
        }
        assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root:x:0:0\n", "the root-only file was touched");
        // A FIFO (which would block the agent forever) is refused at once.
        let fifo = open_dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap();
        let err = s.launch(&as_nobody(&fifo.display().to_string(), "job")).unwrap_err();
        assert!(err.contains("cannot open output file"), "{err}");
        assert!(s.running().is_empty());
        // A file of its own, in a directory it may write, opens as the user's.
        s.launch(&as_nobody(&format!("{}/%j.out", open_dir.display()), "ok")).unwrap();
        let meta = std::fs::metadata(open_dir.join("1.out")).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), 65534, "created as nobody");
    }
}
