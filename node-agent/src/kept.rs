//! Kept step tasks: step tasks that outlive a restart of their agent, so
//! that upgrading or restarting an agent does not end the training steps
//! running on its node.
//!
//! A kept task runs under the task shim in its waiting mode (the shim is its
//! process group's leader and parent, and records how it ended in its exit
//! file, see `shim.rs`). Its output goes into two named pipes (FIFOs) in the
//! agent's state directory, opened read-write for the task, so that it never
//! sees a broken pipe while no agent reads: with no agent, it blocks once the
//! pipe's buffer is full and goes on when the next agent reads. A record
//! file names the task, so a restarted agent finds it ([`KeptSteps::load`]),
//! and srun, whose `Run` call broke with the old agent, picks it up with
//! `Resume` (its `step_key`). What the old agent had read but not yet sent
//! is lost; nothing else is. A kept task nobody resumes within
//! [`RESUME_WAIT`] of the agent's start is stopped, as a step whose srun
//! went away is.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::unistd::Pid;

/// How long a restarted agent keeps its predecessor's steps for their srun
/// to resume them: srun retries for as long ([`crate::steps`]' callers), and
/// an agent restart takes seconds.
pub const RESUME_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
/// Longest step key (srun's call name): letters, digits and dashes.
pub const STEP_KEY_BYTES_MAX: usize = 64;
/// Kept task records a restarted agent reads: far above the tasks of every
/// step of every job one node runs at once.
const RECORDS_MAX: usize = 65_536;
/// How often a task that is not the agent's child is checked for its end.
const ADOPTED_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Checks a step key (it names files in the agent's state directory).
pub fn check_key(key: &str) -> Result<(), String> {
    if key.len() > STEP_KEY_BYTES_MAX || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(format!("step_key: at most {STEP_KEY_BYTES_MAX} letters, digits and dashes"));
    }
    Ok(())
}

/// One kept task: who it is and where its files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    pub job: u64,
    pub attempt: u32,
    pub key: String,
    pub rank: u32,
    /// Its shim's pid (its process group); 0 until started.
    pub pid: i32,
    /// DIR/JOB-ATTEMPT-KEY-RANK: the files are this plus `.out`, `.err`
    /// (the FIFOs), `.exit` and `.rec`.
    base: PathBuf,
}

impl Kept {
    pub fn new(dir: &Path, job: u64, attempt: u32, key: &str, rank: u32) -> Kept {
        let base = dir.join(format!("{job}-{attempt}-{key}-{rank}"));
        Kept { job, attempt, key: key.to_string(), rank, pid: 0, base }
    }

    fn file(&self, ext: &str) -> PathBuf {
        let mut p = self.base.clone().into_os_string();
        p.push(".");
        p.push(ext);
        PathBuf::from(p)
    }

    pub fn exit_file(&self) -> PathBuf {
        self.file("exit")
    }

    /// The record line: `JOB ATTEMPT KEY RANK PID`.
    fn encode(&self) -> String {
        format!("{} {} {} {} {}\n", self.job, self.attempt, self.key, self.rank, self.pid)
    }

    fn parse(dir: &Path, text: &str) -> Option<Kept> {
        let mut f = text.split_whitespace();
        let (job, attempt) = (f.next()?.parse().ok()?, f.next()?.parse().ok()?);
        let key = f.next()?;
        check_key(key).ok()?;
        let (rank, pid) = (f.next()?.parse().ok()?, f.next()?.parse::<i32>().ok().filter(|p| *p > 0)?);
        Some(Kept { pid, ..Kept::new(dir, job, attempt, key, rank) })
    }

    /// Makes the task's FIFOs and exit file (the exit file owned by the
    /// job's user, whom the shim becomes before writing it); the task's ends
    /// of the FIFOs, opened read-write (see the module's notes).
    pub fn prepare(&self, owner: Option<(u32, u32)>) -> std::io::Result<(std::fs::File, std::fs::File)> {
        use nix::sys::stat::Mode;
        let mut ends = Vec::new();
        for ext in ["out", "err"] {
            let path = self.file(ext);
            let _ = std::fs::remove_file(&path);
            nix::unistd::mkfifo(&path, Mode::from_bits_truncate(0o600)).map_err(std::io::Error::from)?;
            ends.push(std::fs::OpenOptions::new().read(true).write(true).open(&path)?);
        }
        std::fs::write(self.exit_file(), "")?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(self.exit_file(), Some(uid), Some(gid))?;
        }
        let err = ends.pop().expect("two ends");
        let out = ends.pop().expect("two ends");
        Ok((out, err))
    }

    /// Notes the started task (its shim's pid) for a restarted agent.
    pub fn record(&mut self, pid: u32) -> std::io::Result<()> {
        self.pid = pid as i32;
        let tmp = self.file("rec.new");
        std::fs::write(&tmp, self.encode())?;
        std::fs::rename(tmp, self.file("rec"))
    }

    pub fn remove_files(&self) {
        for ext in ["out", "err", "exit", "rec", "rec.new"] {
            let _ = std::fs::remove_file(self.file(ext));
        }
    }

    /// Whether its shim still runs (a reused pid is not taken for it: the
    /// shim's command line names this task's exit file).
    pub fn running(&self) -> bool {
        let exit = self.exit_file().display().to_string();
        std::fs::read(format!("/proc/{}/cmdline", self.pid)).is_ok_and(|c| {
            let c = String::from_utf8_lossy(&c);
            c.contains("task-shim") && c.split('\0').any(|arg| arg == exit)
        }) && !zombie(self.pid)
    }

    /// Reads the task to its end: its output from the FIFOs to `tx`, then how
    /// it ended (`child`: the shim, when this agent started it; else it is
    /// polled). None: srun went away first, and the task was stopped.
    pub async fn follow(
        &self,
        child: Option<tokio::process::Child>,
        tx: &crate::steps::EventSender,
        grace: std::time::Duration,
    ) -> Option<gangway_proto::v1::StepTaskEnd> {
        use tokio::net::unix::pipe::OpenOptions;
        // Found ended (a restart): its group may be another's by now.
        let ours = child.is_some() || self.running();
        use std::os::unix::fs::OpenOptionsExt;
        let open = |ext: &str| {
            let path = self.file(ext);
            let reader = OpenOptions::new().open_receiver(&path).ok()?;
            // A reader that opened a FIFO after its last writer left never
            // sees its end on Linux: a writer that comes and goes makes
            // sure it does.
            let _ = std::fs::OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(&path);
            Some(reader)
        };
        let (out, err) = (open("out"), open("err"));
        let mut gone = crate::steps::pump(out, err, self.rank, tx).await;
        let status = match child {
            Some(mut child) if !gone => tokio::select! {
                s = child.wait() => s.ok().map(|s| {
                    use std::os::unix::process::ExitStatusExt;
                    (s.code(), s.signal())
                }),
                _ = tx.closed() => { gone = true; None }
            },
            Some(_) => None,
            None if !gone => {
                // Bounded by the task's life.
                loop {
                    if !self.running() {
                        break;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(ADOPTED_POLL) => {}
                        _ = tx.closed() => { gone = true; break; }
                    }
                }
                None
            }
            None => None,
        };
        let group = Pid::from_raw(self.pid);
        let stopping = std::sync::atomic::AtomicBool::new(false);
        let groups = || if ours { vec![group] } else { Vec::new() };
        if gone {
            // srun went away: the task goes too (SIGTERM, the grace, SIGKILL).
            crate::supervisor::end_leftovers(groups, &stopping, grace).await;
            self.remove_files();
            return None;
        }
        let found = crate::shim::reconcile_exit(crate::shim::read_exit(&self.exit_file()), status);
        // What it left in its group ends with it.
        crate::supervisor::end_leftovers(groups, &stopping, grace).await;
        self.remove_files();
        let (exit_code, signal) = found.unwrap_or((None, None));
        let error = if found.is_none() { "the task ended without a record of how".to_string() } else { String::new() };
        Some(gangway_proto::v1::StepTaskEnd { rank: self.rank, exit_code, signal, error })
    }
}

/// Makes the kept tasks' directory: the agent's own, which the jobs' users
/// may pass through (their shims write their exit files there) but not list.
fn prepare_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    std::fs::create_dir_all(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(std::io::Error::other("not a directory owned by the agent's user"));
    }
    crate::supervisor::reachable_not_listable(dir)
}

/// A process that ended and that nobody reaped (this agent is not its
/// parent after a restart).
fn zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])))
}

/// The first [`RECORDS_MAX`] entries of the kept tasks' directory: those a
/// restarted agent looks at (the rest are left as they are).
fn first_records(entries: impl Iterator<Item = PathBuf>) -> Vec<PathBuf> {
    entries.take(RECORDS_MAX).collect()
}

type StepId = (u64, u32, String);

/// The kept tasks a previous agent process left, waiting for their srun.
#[derive(Clone, Default)]
pub struct KeptSteps {
    orphans: Arc<Mutex<BTreeMap<StepId, Vec<Kept>>>>,
}

impl KeptSteps {
    /// Reads the records in `dir` (made if missing): running tasks, and
    /// ended ones whose end srun has not had, wait for a `Resume`; the rest
    /// of a lost task's files are removed. After `wait`, whatever nobody
    /// resumed is stopped (with `grace`) and forgotten.
    pub fn load(dir: &Path, wait: std::time::Duration, grace: std::time::Duration) -> KeptSteps {
        let kept = KeptSteps::default();
        if let Err(e) = prepare_dir(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot keep step tasks across restarts");
            return kept;
        }
        let mut found = 0usize;
        let entries = first_records(std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()));
        // Files of a task whose record was never written (the agent stopped
        // in between) have nothing to wait for.
        for path in entries.iter().filter(|p| p.extension().is_none_or(|x| x != "rec")) {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let base = name.split_once('.').map_or(name.as_str(), |(b, _)| b);
            if !dir.join(format!("{base}.rec")).exists() {
                let _ = std::fs::remove_file(path);
            }
        }
        for path in entries.iter().filter(|p| p.extension().is_some_and(|x| x == "rec")) {
            let Some(k) = std::fs::read_to_string(path).ok().and_then(|t| Kept::parse(dir, &t)) else {
                let _ = std::fs::remove_file(path);
                continue;
            };
            if !k.running() && crate::shim::read_exit(&k.exit_file()).is_none() {
                k.remove_files();
                continue;
            }
            found = found.saturating_add(1);
            kept.orphans.lock().expect("kept steps lock").entry((k.job, k.attempt, k.key.clone())).or_default().push(k);
        }
        if found > 0 {
            tracing::info!(tasks = found, "kept step tasks from before the restart wait for their srun");
            let orphans = kept.orphans.clone();
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                let left: Vec<Kept> =
                    std::mem::take(&mut *orphans.lock().expect("kept steps lock")).into_values().flatten().collect();
                if !left.is_empty() {
                    tracing::warn!(tasks = left.len(), "ending kept step tasks no srun resumed");
                }
                let stopping = std::sync::atomic::AtomicBool::new(false);
                // Only those still running: an ended one's pid may be reused.
                let groups: Vec<Pid> = left.iter().filter(|k| k.running()).map(|k| Pid::from_raw(k.pid)).collect();
                crate::supervisor::end_leftovers(|| groups.clone(), &stopping, grace).await;
                for k in left {
                    k.remove_files();
                }
            });
        }
        kept
    }

    /// The kept tasks of a step, taken (only one srun resumes them).
    pub fn claim(&self, job: u64, attempt: u32, key: &str) -> Vec<Kept> {
        self.orphans.lock().expect("kept steps lock").remove(&(job, attempt, key.to_string())).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept task's output and end come through its FIFOs and exit file
    /// whether this process started it or found it (a restart): here the
    /// task's first reader goes away mid-output, as a killed agent does,
    /// and a second one, which is not its parent, reads the rest.
    #[tokio::test]
    async fn a_kept_task_is_followed_across_a_change_of_reader() {
        use gangway_proto::v1::step_event::Kind;
        let dir = tempfile::tempdir().unwrap();
        let mut k = Kept::new(dir.path(), 7, 1, "k1", 0);
        let (out, err) = k.prepare(None).unwrap();
        let exit = k.exit_file();
        // What the shim does in its waiting mode: run the command, record its end.
        let script = format!(
            "sh -c 'echo first; while [ ! -e {go} ]; do sleep 0.05; done; echo second; echo oops >&2; exit 7'; \
             echo \"exit $?\" > $1",
            go = dir.path().join("go").display(),
        );
        // Named as a shim is, with its exit file (how a restarted agent
        // tells it from a process that reused its pid).
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c").arg(script).arg("task-shim").arg(&exit).stdout(out).stderr(err).process_group(0);
        let child = cmd.spawn().unwrap();
        drop(cmd);
        k.record(child.id().unwrap()).unwrap();
        // The first reader takes the first line, then goes away.
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let first = tokio::spawn({
            let k = k.clone();
            async move { k.follow(None, &tx, std::time::Duration::from_secs(1)).await }
        });
        let Some(Ok(gangway_proto::v1::StepEvent { kind: Some(Kind::Output(o)) })) = rx.recv().await else {
            panic!("no first line")
        };
        assert_eq!(o.data, b"first\n");
        first.abort();
        let _ = first.await;
        drop(rx);
        // A new reader finds the task from its record, and gets the rest.
        let kept = KeptSteps::load(dir.path(), std::time::Duration::from_secs(60), std::time::Duration::from_secs(1));
        let mut found = kept.claim(7, 1, "k1");
        assert_eq!(found.len(), 1, "the record was not found");
        let k2 = found.pop().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let follower = tokio::spawn(async move { k2.follow(None, &tx, std::time::Duration::from_secs(1)).await });
        std::fs::write(dir.path().join("go"), "").unwrap();
        let mut said = Vec::new();
        while let Some(Ok(e)) = rx.recv().await {
            if let Some(Kind::Output(o)) = e.kind {
                said.push((o.stderr, String::from_utf8_lossy(&o.data).into_owned()));
            }
        }
        let end = follower.await.unwrap().expect("the follower saw no end");
        assert_eq!((end.exit_code, end.signal, end.error.as_str()), (Some(7), None, ""));
        assert!(said.contains(&(false, "second\n".into())) && said.contains(&(true, "oops\n".into())), "{said:?}");
        assert!(!exit.exists(), "the task's files were left behind");
        drop(child);
    }

    /// A kept task no srun resumes within the wait is stopped (SIGTERM) and
    /// its files removed; one found already ended without a record is
    /// forgotten at once.
    #[tokio::test]
    async fn kept_tasks_nobody_resumes_are_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let mut k = Kept::new(dir.path(), 9, 1, "gone", 0);
        let (out, err) = k.prepare(None).unwrap();
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c").arg("sleep 30; true").arg("task-shim").arg(k.exit_file());
        cmd.stdout(out).stderr(err).process_group(0);
        let mut child = cmd.spawn().unwrap();
        drop(cmd);
        k.record(child.id().unwrap()).unwrap();
        let lost = Kept { pid: 999_999, ..Kept::new(dir.path(), 9, 1, "lost", 0) };
        std::fs::write(lost.file("rec"), lost.encode()).unwrap();
        // Spawning returns while the kernel is still setting up the new
        // program (its command line empty): a restarted agent finds shims
        // long past that.
        for _ in 0..500 {
            if k.running() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let stray = dir.path().join("9-1-norecord-0.out");
        std::fs::write(&stray, "").unwrap();
        let kept =
            KeptSteps::load(dir.path(), std::time::Duration::from_millis(300), std::time::Duration::from_secs(1));
        assert!(!lost.file("rec").exists(), "a lost task's record was kept");
        assert!(!stray.exists(), "a file without a record was kept");
        // The jobs' users pass through (to their exit files), never list it.
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.path()).unwrap().permissions().mode() & 0o777, 0o711);
        assert_eq!(kept.orphans.lock().unwrap().len(), 1, "the running task was not found");
        assert!(child.try_wait().unwrap().is_none(), "stopped before the wait");
        let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait()).await.unwrap().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(15), "{status:?}");
        // The reaper removes the files once the group is gone.
        for _ in 0..50 {
            if !k.file("rec").exists() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(!k.file("rec").exists() && !k.file("out").exists(), "the stopped task's files remain");
        assert!(kept.claim(9, 1, "gone").is_empty(), "a stopped task can still be resumed");
    }

    #[test]
    fn keys_and_records_are_checked() {
        assert!(check_key("0f3a-77").is_ok());
        assert!(check_key("").is_ok());
        assert!(check_key("../etc").is_err());
        assert!(check_key(&"a".repeat(65)).is_err());
        let dir = Path::new("/state/steps");
        let mut k = Kept::new(dir, 7, 2, "abc", 3);
        k.pid = 42;
        assert_eq!(Kept::parse(dir, &k.encode()), Some(k.clone()));
        assert_eq!(k.exit_file(), Path::new("/state/steps/7-2-abc-3.exit"));
        assert_eq!(Kept::parse(dir, "7 2 ../x 3 42"), None);
        assert_eq!(Kept::parse(dir, "7 2 abc 3 0"), None);
        assert_eq!(Kept::parse(dir, "7 2 abc"), None);
    }

    /// A step key of STEP_KEY_BYTES_MAX bytes is taken, in a request and in
    /// a record; one byte longer is refused with the limit named.
    #[test]
    fn step_keys_hold_at_most_step_key_bytes_max() {
        let at = "k".repeat(STEP_KEY_BYTES_MAX);
        let past = "k".repeat(STEP_KEY_BYTES_MAX + 1);
        assert!(check_key(&at).is_ok());
        let err = check_key(&past).unwrap_err();
        assert!(err.contains(&format!("at most {STEP_KEY_BYTES_MAX}")), "{err}");
        let dir = Path::new("/state/steps");
        assert_eq!(Kept::parse(dir, &format!("7 2 {at} 3 42")).map(|k| k.key), Some(at));
        assert_eq!(Kept::parse(dir, &format!("7 2 {past} 3 42")), None);
    }

    /// A restarted agent looks at RECORDS_MAX entries of its directory, the
    /// last of them included, and not at one more.
    #[test]
    fn a_restart_reads_at_most_records_max_entries() {
        let names = |n: usize| (0..n).map(|i| PathBuf::from(format!("{i}.rec")));
        let at = first_records(names(RECORDS_MAX));
        assert_eq!(at.len(), RECORDS_MAX);
        assert_eq!(at.last(), Some(&PathBuf::from(format!("{}.rec", RECORDS_MAX - 1))));
        let past = first_records(names(RECORDS_MAX + 1));
        assert_eq!(past.len(), RECORDS_MAX);
        assert!(!past.contains(&PathBuf::from(format!("{RECORDS_MAX}.rec"))), "an entry past the cap was read");
    }
}
