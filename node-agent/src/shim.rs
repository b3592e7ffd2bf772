//! The task shim (`gangway task-shim`), like slurmstepd or a container shim: it
//! is the task's process-group leader, runs the real command, waits for it and
//! writes its exit status to a file. Because the shim, not the agent, is the
//! command's parent, an agent can exit or crash and a restarted agent re-adopts
//! the task and still learns how it ended.
//!
//! The shim survives SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2/SIGALRM
//! (they are meant for the command, and reach it through the process group), so it outlives the command's graceful
//! shutdown; SIGKILL of the group ends both.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

// The exit codes and signals a wait status can hold, as the controllers check them.
use gangway_core::limits::{EXIT_CODE_MAX, SIGNAL_MAX};

/// The Unix identity a task runs as: `UID:GID:G1,G2,...` (the user's groups,
/// as `initgroups` would set them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskUser {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// Supplementary groups a task may get (Linux's NGROUPS_MAX is 65536; real
/// users have a few dozen).
const GROUPS_MAX: usize = 65_536;

impl TaskUser {
    pub fn encode(&self) -> String {
        let groups: Vec<String> = self.groups.iter().map(u32::to_string).collect();
        format!("{}:{}:{}", self.uid, self.gid, groups.join(","))
    }

    pub fn parse(s: &str) -> Result<TaskUser, String> {
        let mut f = s.splitn(3, ':');
        let num = |v: Option<&str>, what: &str| -> Result<u32, String> {
            v.and_then(|v| v.parse().ok()).ok_or_else(|| format!("user: bad {what} in '{s}'"))
        };
        let uid = num(f.next(), "uid")?;
        let gid = num(f.next(), "gid")?;
        let groups: Vec<u32> = match f.next().filter(|g| !g.is_empty()) {
            None => Vec::new(),
            Some(g) => g
                .split(',')
                .map(|x| x.parse().map_err(|_| format!("user: bad group in '{s}'")))
                .collect::<Result<_, _>>()?,
        };
        if groups.len() > GROUPS_MAX {
            return Err(format!("user: more than {GROUPS_MAX} groups"));
        }
        Ok(TaskUser { uid, gid, groups })
    }

    /// The identity of the user with `uid` (and primary group `gid`).
    pub fn lookup_ids(uid: u32, gid: u32) -> Option<TaskUser> {
        let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)).ok()??;
        TaskUser::lookup(&user.name).filter(|u| u.uid == uid && u.gid == gid)
    }

    /// `name`'s identity through NSS, with its supplementary groups.
    pub fn lookup(name: &str) -> Option<TaskUser> {
        let user = nix::unistd::User::from_name(name).ok()??;
        let cname = std::ffi::CString::new(name).ok()?;
        let groups = nix::unistd::getgrouplist(&cname, user.gid).unwrap_or_else(|_| vec![user.gid]);
        Some(TaskUser {
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
            groups: groups.into_iter().map(|g| g.as_raw()).take(GROUPS_MAX).collect(),
        })
    }

    /// Becomes this user for good: groups, then gid, then uid (after which
    /// none of them can be changed back).
    fn become_it(&self) -> Result<(), String> {
        use nix::unistd::{setgid, setgroups, setuid, Gid, Uid};
        let groups: Vec<Gid> = self.groups.iter().map(|g| Gid::from_raw(*g)).collect();
        setgroups(&groups).map_err(|e| format!("setgroups: {e}"))?;
        setgid(Gid::from_raw(self.gid)).map_err(|e| format!("setgid {}: {e}", self.gid))?;
        setuid(Uid::from_raw(self.uid)).map_err(|e| format!("setuid {}: {e}", self.uid))?;
        if nix::unistd::geteuid().as_raw() != self.uid {
            return Err("setuid did not take".into());
        }
        Ok(())
    }
}

/// Runs `argv`, waits, records `exit N` or `signal S` in `exit_file`, and
/// returns the exit code the shim itself should exit with.
///
/// A root agent starts the shim as root with an empty environment (so
/// nothing of the job's, such as `LD_PRELOAD`, reaches a root process) and
/// hands it `setup`: the shim reads the task's environment from the agent's
/// file, becomes the job's user (supplementary groups included), and only then
/// enters the working directory and runs the command.
pub fn run(exit_file: Option<&Path>, setup: &TaskSetup, argv: &[String]) -> i32 {
    let refuse = |why: String| {
        eprintln!("task-shim: {why}");
        if let Some(f) = exit_file {
            let _ = write_atomic(f, "exit 126\n");
        }
        126
    };
    for dir in &setup.cgroups {
        if let Err(e) = std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string()) {
            return refuse(format!("cannot join the task's cgroup {}: {e}", dir.display()));
        }
    }
    // A terminal step: a session of its own, with the terminal on stdout as
    // its controlling terminal (so job control, Ctrl-C and hangups work).
    if setup.pty {
        if let Err(e) = rustix::process::setsid()
            .map_err(std::io::Error::from)
            .and_then(|_| rustix::process::ioctl_tiocsctty(std::io::stdout()).map_err(std::io::Error::from))
        {
            return refuse(format!("cannot take the step's terminal: {e}"));
        }
    }
    let env = match (&setup.env_file, setup.env_stdin) {
        (Some(f), _) => match read_env_file(f) {
            Ok(env) => Some(env),
            Err(e) => return refuse(e),
        },
        (None, true) => match read_env(std::io::stdin().lock()) {
            Ok(env) => Some(env),
            Err(e) => return refuse(e),
        },
        (None, false) => None,
    };
    if let Some(u) = &setup.user {
        if let Err(e) = TaskUser::parse(u).and_then(|u| u.become_it()) {
            return refuse(format!("cannot become the job's user: {e}"));
        }
    }
    // Entered as the user: a directory the user cannot reach is refused.
    if let Some(dir) = &setup.workdir {
        if let Err(e) = std::env::set_current_dir(dir) {
            return refuse(format!("cannot enter the working directory {}: {e}", dir.display()));
        }
    }
    if setup.exec {
        return exec(env, argv, setup.pty);
    }
    if setup.pty {
        return refuse("--pty needs --exec".into());
    }
    let Some(exit_file) = exit_file else {
        return refuse("an --exit-file is needed unless --exec".into());
    };
    let ignored = Arc::new(AtomicBool::new(false));
    use signal_hook::consts::*;
    // Every signal meant for the command (stops, Slurm's --signal warnings)
    // reaches it through the process group; the shim must outlive them.
    for sig in [SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM] {
        let _ = signal_hook::flag::register(sig, ignored.clone());
    }
    set_umask(env.as_deref());
    let Some((program, args)) = argv.split_first() else {
        eprintln!("task-shim: nothing to run");
        return 127;
    };
    let mut command = std::process::Command::new(program);
    command.args(args);
    if let Some(env) = env {
        command.env_clear().envs(env);
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("task-shim: cannot start {program}: {e}");
            let _ = write_atomic(exit_file, "exit 127\n");
            return 127;
        }
    };
    let status = match wait_under_lease(&mut child, setup.lease.as_deref(), exit_file) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("task-shim: lost the command: {e}");
            let _ = write_atomic(exit_file, "exit 1\n");
            return 1;
        }
    };
    use std::os::unix::process::ExitStatusExt;
    let (record, code) = match (status.code(), status.signal()) {
        (Some(c), _) => (format!("exit {c}\n"), c),
        (None, Some(s)) => (format!("signal {s}\n"), s.saturating_add(128)),
        _ => ("exit 1\n".to_string(), 1),
    };
    let _ = write_atomic(exit_file, &record);
    if setup.drain {
        wait_drained();
    }
    code
}

/// How long a shim whose output goes through FIFOs waits for the agent to
/// read what is left in them: past the time a restarted agent keeps a step
/// for its srun (`kept::RESUME_WAIT`), after which nothing reads them.
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(90);
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_millis(100);
const DRAIN_POLLS: u128 = DRAIN_WAIT.as_millis() / DRAIN_POLL.as_millis();

/// Holds the shim's stdout and stderr (FIFOs) open until nothing is left in
/// them, within DRAIN_WAIT: a FIFO's data is lost once nobody has it open,
/// and an agent restarting while the command ends must still read it.
fn wait_drained() {
    use std::os::fd::AsFd;
    let left = || {
        let out = rustix::io::ioctl_fionread(std::io::stdout().as_fd()).unwrap_or(0);
        let err = rustix::io::ioctl_fionread(std::io::stderr().as_fd()).unwrap_or(0);
        out.saturating_add(err)
    };
    for _ in 0..DRAIN_POLLS {
        if left() == 0 {
            return;
        }
        std::thread::sleep(DRAIN_POLL);
    }
}

/// How often the shim checks its command and the agent's lease, once the
/// command has run a while; it starts at LEASE_POLL_FIRST and doubles, so
/// that a short command (an srun step of a few milliseconds) is not held up.
const LEASE_POLL: std::time::Duration = std::time::Duration::from_millis(200);
const LEASE_POLL_FIRST: std::time::Duration = std::time::Duration::from_millis(2);

/// Waits for the command; with a lease, stops the process group (SIGTERM)
/// once the lease's stop time passes and kills it (SIGKILL, the shim
/// included, after recording the kill) once its kill time passes.
fn wait_under_lease(
    child: &mut std::process::Child,
    lease: Option<&Path>,
    exit_file: &Path,
) -> std::io::Result<std::process::ExitStatus> {
    let Some(lease) = lease else { return child.wait() };
    let group = nix::unistd::getpgrp();
    let mut stopped = false;
    // The last lease read: a file that cannot be read (being replaced, or
    // gone) does not lift deadlines already known.
    let mut known: Option<crate::lease::Lease> = None;
    let mut poll = LEASE_POLL_FIRST;
    // Bounded by the command's life (or the lease's kill, which ends the shim too).
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if let Some(l) = crate::lease::read(lease) {
            known = Some(l);
        }
        if let (Some(l), Some(now)) = (known, crate::lease::now_ms()) {
            if now >= l.kill_at_ms {
                eprintln!("task-shim: the agent's lease ran out: killing the task");
                let _ = write_atomic(exit_file, "signal 9\n");
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            } else if now >= l.stop_at_ms && !stopped {
                eprintln!("task-shim: the agent has been away too long: stopping the task");
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
                // A suspended task is continued, so that it can act on it.
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGCONT);
                stopped = true;
            }
        }
        std::thread::sleep(poll);
        poll = poll.saturating_mul(2).min(LEASE_POLL);
    }
}

/// Exec mode: the command replaces the shim (same pid, pipes, process
/// group), now as the user, with the user's umask, and stdin from /dev/null
/// or, for a terminal step, from the terminal its output goes to.
fn exec(env: Option<Vec<(String, String)>>, argv: &[String], pty: bool) -> i32 {
    use std::os::fd::AsFd;
    use std::os::unix::process::CommandExt;
    let Some((program, args)) = argv.split_first() else {
        eprintln!("task-shim: nothing to run");
        return 127;
    };
    set_umask(env.as_deref());
    let stdin = if pty {
        match std::io::stdout().as_fd().try_clone_to_owned() {
            Ok(fd) => std::process::Stdio::from(fd),
            Err(e) => {
                eprintln!("task-shim: the step's terminal: {e}");
                return 126;
            }
        }
    } else {
        std::process::Stdio::null()
    };
    let mut command = std::process::Command::new(program);
    command.args(args).stdin(stdin);
    if let Some(env) = env {
        command.env_clear().envs(env);
    }
    let e = command.exec();
    eprintln!("task-shim: cannot start {program}: {e}");
    127
}

/// The submitter's umask (`SLURM_UMASK`; the agent itself runs with 077).
fn set_umask(env: Option<&[(String, String)]>) {
    let var = match env {
        Some(env) => env.iter().find(|(k, _)| k == "SLURM_UMASK").map(|(_, v)| v.clone()),
        None => std::env::var("SLURM_UMASK").ok(),
    };
    let umask = var.and_then(|u| u32::from_str_radix(u.trim(), 8).ok()).filter(|u| *u <= 0o777).unwrap_or(0o022);
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(umask));
}

/// How the shim sets the task up (see [`run`]).
#[derive(Debug, Clone, Default)]
pub struct TaskSetup {
    /// Replace the shim with the command once set up (srun's step tasks: the
    /// agent supervises them directly) instead of waiting for it.
    pub exec: bool,
    /// Read the task's environment from standard input (before becoming the
    /// user; the command then gets /dev/null).
    pub env_stdin: bool,
    /// Standard output and error are FIFOs an agent reads (a kept step
    /// task, see `kept.rs`): after the command, wait until they are read.
    pub drain: bool,
    /// A terminal step (with `exec`): standard output is a pseudo-terminal;
    /// the shim starts a session whose controlling terminal it is, and the
    /// command reads from it too.
    pub pty: bool,
    /// Become this user (`UID:GID:GROUPS`) before anything else runs.
    pub user: Option<String>,
    /// The task's environment, `KEY=VALUE` entries each ended by a NUL byte;
    /// read (as root) and removed before the shim becomes the user.
    pub env_file: Option<std::path::PathBuf>,
    /// Entered after becoming the user.
    pub workdir: Option<std::path::PathBuf>,
    /// Cgroups to join (their `cgroup.procs`) before anything else: the
    /// task's CPU, memory and devices cgroups, so that nothing it runs ever
    /// ran outside them.
    pub cgroups: Vec<std::path::PathBuf>,
    /// The agent's lease (see [`crate::lease`]): when it runs out, the agent
    /// has been cut off or gone for half the node-down timeout, and the shim
    /// stops the task itself (killing it by three quarters), as the agent's
    /// own fence would have: a task outliving a crashed agent must not run on
    /// while the leader starts its job elsewhere.
    pub lease: Option<std::path::PathBuf>,
}

/// Largest environment file: the controller bounds a job's environment far
/// below this; the agent adds a few kilobytes.
const ENV_FILE_BYTES_MAX: u64 = 16 * 1024 * 1024;

/// Writes a task's environment for the shim: a new file readable only by its
/// owner (the root agent), never through a link.
pub fn write_env_file(path: &Path, env: &[(String, String)]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(&encode_env(env))
}

/// Reads and removes the task's environment file.
fn read_env_file(path: &Path) -> Result<Vec<(String, String)>, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("environment file {}: {e}", path.display()))?;
    let env = read_env(f);
    let _ = std::fs::remove_file(path);
    env
}

/// `KEY=VALUE` entries each ended by a NUL byte, as [`encode_env`] writes them.
pub fn encode_env(env: &[(String, String)]) -> Vec<u8> {
    let mut buf = Vec::new();
    for (k, v) in env {
        buf.extend_from_slice(k.as_bytes());
        buf.push(b'=');
        buf.extend_from_slice(v.as_bytes());
        buf.push(0);
    }
    buf
}

fn read_env(from: impl std::io::Read) -> Result<Vec<(String, String)>, String> {
    use std::io::Read;
    let mut buf = Vec::new();
    from.take(ENV_FILE_BYTES_MAX + 1).read_to_end(&mut buf).map_err(|e| format!("environment: {e}"))?;
    if buf.len() as u64 > ENV_FILE_BYTES_MAX {
        return Err(format!("environment file: larger than {ENV_FILE_BYTES_MAX} bytes"));
    }
    Ok(buf
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .filter_map(|e| {
            let s = String::from_utf8_lossy(e);
            let (k, v) = s.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect())
}

/// Writes the exit file in place: the agent created it (owned by the job's
/// user) because the shim, running as that user, may not create files in the
/// agent's state directory.
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::write(path, text)
}

/// How a task ended: (exit code, signal), one of them set.
pub type ExitRecord = (Option<i32>, Option<i32>);

/// A record as a real wait status could hold it, or None.
fn plausible(r: ExitRecord) -> Option<ExitRecord> {
    match r {
        (Some(c), None) if (0..=EXIT_CODE_MAX).contains(&c) => Some(r),
        (None, Some(s)) if (1..=SIGNAL_MAX).contains(&s) => Some(r),
        _ => None,
    }
}

/// What the agent reports for a task: the exit file is written by the task's
/// own user (the shim runs as them), so it is believed only where the real wait
/// status cannot tell, and only with values a wait status can hold.
///
/// - `status` is the wait status of the agent's own child (the shim, or the
///   command itself without one). A shim killed by a signal ends so; a shim
///   that exited with code `c` reports `c` unless its file says "signal S" with
///   `c == 128 + S` (the shim exits so for a command killed by S).
/// - Without a status (a task re-adopted after the agent restarted), the file
///   is all there is.
pub fn reconcile_exit(file: Option<ExitRecord>, status: Option<ExitRecord>) -> Option<ExitRecord> {
    let file = file.and_then(plausible);
    let Some(status) = status else { return file };
    let status = match status {
        (Some(c), _) => (Some(c.clamp(0, EXIT_CODE_MAX)), None),
        (None, Some(s)) => (None, Some(s.clamp(1, SIGNAL_MAX))),
        (None, None) => return file,
    };
    match (status, file) {
        ((Some(c), None), Some((None, Some(s)))) if c == 128_i32.saturating_add(s) => file,
        _ => Some(status),
    }
}

/// Bytes of an exit file read: the file is the job's user's, so no more than
/// an exit line needs.
const EXIT_FILE_BYTES_MAX: u64 = 64;

/// Reads a shim's exit file: (exit code, signal).
pub fn read_exit(path: &Path) -> Option<ExitRecord> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path).ok()?.take(EXIT_FILE_BYTES_MAX).read_to_string(&mut text).ok()?;
    let (kind, n) = text.trim().split_once(' ')?;
    let n: i32 = n.parse().ok()?;
    match kind {
        "exit" => Some((Some(n), None)),
        "signal" => Some((None, Some(n))),
        _ => None,
    }
}

#[cfg(test)]
mod task_user_tests {
    use super::*;

    #[test]
    fn task_users_round_trip_and_bad_ones_are_refused() {
        let u = TaskUser { uid: 1000, gid: 100, groups: vec![100, 27, 44] };
        assert_eq!(TaskUser::parse(&u.encode()).unwrap(), u);
        let bare = TaskUser { uid: 5, gid: 6, groups: vec![] };
        assert_eq!(TaskUser::parse(&bare.encode()).unwrap(), bare);
        for bad in ["", "x:1:", "1:y:", "1:2:a,b", "1"] {
            assert!(TaskUser::parse(bad).is_err(), "{bad}");
        }
        // NSS knows nobody, with its primary group among its groups.
        let nobody = TaskUser::lookup("nobody").unwrap();
        assert!(nobody.groups.contains(&nobody.gid));
    }

    /// A user with GROUPS_MAX supplementary groups is taken; one group more
    /// is refused with the limit named.
    #[test]
    fn task_users_have_at_most_groups_max_groups() {
        let user = |groups: usize| format!("1000:100:{}", vec!["7"; groups].join(","));
        assert_eq!(TaskUser::parse(&user(GROUPS_MAX)).unwrap().groups.len(), GROUPS_MAX);
        let err = TaskUser::parse(&user(GROUPS_MAX + 1)).unwrap_err();
        assert!(err.contains(&format!("more than {GROUPS_MAX} groups")), "{err}");
    }
}

#[cfg(test)]
mod exit_tests {
    use super::*;

    #[test]
    fn the_wait_status_decides_and_the_exit_file_only_refines_it() {
        // A command killed by SIGINT: the shim exits 130 and writes "signal 2".
        assert_eq!(reconcile_exit(Some((None, Some(2))), Some((Some(130), None))), Some((None, Some(2))));
        // A command that exited 130 itself.
        assert_eq!(reconcile_exit(Some((Some(130), None)), Some((Some(130), None))), Some((Some(130), None)));
        // A job that overwrote its exit file: the real status wins.
        for forged in [(None, Some(i32::MAX)), (None, Some(5)), (Some(0), None), (Some(-7), None)] {
            assert_eq!(reconcile_exit(Some(forged), Some((Some(1), None))), Some((Some(1), None)), "{forged:?}");
        }
        // A shim killed by a signal (the job killed it) ends so, whatever the file says.
        assert_eq!(reconcile_exit(Some((Some(0), None)), Some((None, Some(9)))), Some((None, Some(9))));
        // A re-adopted task has only its file, and only plausible values count.
        assert_eq!(reconcile_exit(Some((None, Some(15))), None), Some((None, Some(15))));
        assert_eq!(reconcile_exit(Some((None, Some(i32::MAX))), None), None);
        assert_eq!(reconcile_exit(Some((Some(256), None)), None), None);
        assert_eq!(reconcile_exit(Some((None, Some(0))), None), None);
        assert_eq!(reconcile_exit(None, None), None);
    }

    /// A re-adopted task's exit file is believed up to EXIT_CODE_MAX and
    /// SIGNAL_MAX, what a wait status holds; one past either is not.
    #[test]
    fn exit_files_are_believed_up_to_what_a_wait_status_holds() {
        assert_eq!(reconcile_exit(Some((Some(EXIT_CODE_MAX), None)), None), Some((Some(EXIT_CODE_MAX), None)));
        assert_eq!(reconcile_exit(Some((Some(EXIT_CODE_MAX + 1), None)), None), None);
        assert_eq!(reconcile_exit(Some((None, Some(SIGNAL_MAX))), None), Some((None, Some(SIGNAL_MAX))));
        assert_eq!(reconcile_exit(Some((None, Some(SIGNAL_MAX + 1))), None), None);
        // A wait status past them (none can be) is clamped to them.
        assert_eq!(reconcile_exit(None, Some((Some(EXIT_CODE_MAX + 1), None))), Some((Some(EXIT_CODE_MAX), None)));
        assert_eq!(reconcile_exit(None, Some((None, Some(SIGNAL_MAX + 1)))), Some((None, Some(SIGNAL_MAX))));
    }

    /// An exit file is read up to EXIT_FILE_BYTES_MAX bytes: a record ending
    /// at the cap is read; one pushed a byte past it is not.
    #[test]
    fn exit_files_are_read_up_to_their_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exit");
        // Padding, then "exit 3" ending at byte `len`.
        let read = |len: usize| {
            std::fs::write(&path, format!("{}exit 3", " ".repeat(len - 6))).unwrap();
            read_exit(&path)
        };
        assert_eq!(read(EXIT_FILE_BYTES_MAX as usize), Some((Some(3), None)));
        assert_eq!(read(EXIT_FILE_BYTES_MAX as usize + 1), None, "a byte past the cap was read");
    }

    /// An environment file of ENV_FILE_BYTES_MAX bytes is read (and removed);
    /// one byte larger is refused with the limit named.
    #[test]
    fn environment_files_hold_at_most_env_file_bytes_max() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("env");
        // BIG=... and its NUL: `len` bytes in all.
        let write = |len: usize| {
            let value = "v".repeat(len - 5);
            write_env_file(&path, &[("BIG".to_string(), value.clone())]).unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), len as u64);
            value
        };
        let value = write(ENV_FILE_BYTES_MAX as usize);
        assert_eq!(read_env_file(&path).unwrap(), vec![("BIG".to_string(), value)]);
        assert!(!path.exists(), "the environment file was left behind");
        write(ENV_FILE_BYTES_MAX as usize + 1);
        let err = read_env_file(&path).unwrap_err();
        assert!(err.contains(&format!("larger than {ENV_FILE_BYTES_MAX} bytes")), "{err}");
    }
}
