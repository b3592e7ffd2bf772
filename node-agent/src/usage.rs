//! What a task used, measured by the agent: CPU time, peak memory and GPU
//! load, reported with its exit (`TaskExitReport.usage`) so accounting can
//! tell a user their job used 3% of the GPUs it held (seff).
//!
//! The agent runs as root and reads the kernel's and NVML's figures, never
//! anything the job wrote (the shim runs as the job's user, so its files are
//! the job's word):
//!
//! - while the task runs, a sample every [`SAMPLE_INTERVAL`] (the first after
//!   [`FIRST_SAMPLE`]) reads `/proc/PID/stat` of the processes in the task's
//!   process groups: their CPU time, and the sum of their resident memory;
//!   and each of the task's GPUs' utilization and memory in use (NVML, or a
//!   simulated node's load file). This is Slurm's jobacct_gather/linux.
//! - when the task's main process ends, before it is reaped, its
//!   `/proc/PID/stat` still holds its CPU time and that of every descendant it
//!   waited for: exact where the samples miss short-lived processes.
//! - a cgroup v2 host's `memory.peak` is exact for the memory.
//!
//! The walk of `/proc` is shared: a snapshot younger than [`SNAPSHOT_REUSE`]
//! serves every task, so a node with many tasks walks it at most once a second.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gangway_core::model::TaskUsage;

/// How often a running task is sampled. Slurm's JobAcctGatherFrequency is
/// 30 s; 10 s catches shorter memory peaks for one walk of /proc per task.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(10);
/// The first sample, so that a job of a few seconds gets one too.
pub const FIRST_SAMPLE: Duration = Duration::from_secs(1);
/// A snapshot of /proc this young serves every task that asks.
const SNAPSHOT_REUSE: Duration = Duration::from_secs(1);
/// Processes read in one walk of /proc (a node runs thousands, not more;
/// past it the rest are not counted rather than the walk taking seconds).
const PROCS_MAX: usize = 65_536;
/// Bytes of one `/proc/PID/stat` read (a few hundred in practice).
const STAT_BYTES_MAX: u64 = 4096;
/// Bytes of a simulated load file read (a line per GPU).
const LOAD_FILE_BYTES_MAX: u64 = 64 * 1024;
/// Live processes one task's meter tracks (an ended one's time is folded
/// into a total and its entry dropped).
const PROCS_PER_TASK_MAX: usize = 65_536;

/// One process as `/proc/PID/stat` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    /// Its owner (the owner of `/proc/PID`: its effective user).
    pub uid: u32,
    pub pgid: i32,
    /// When it started (clock ticks after boot): with the pid, names the
    /// process even where pids are reused.
    pub start_ticks: u64,
    /// Its own user and system time (clock ticks).
    pub cpu_ticks: u64,
    /// Its waited-for descendants' user and system time (clock ticks).
    pub child_ticks: u64,
    pub rss_pages: u64,
}

/// Parses `/proc/PID/stat`; None for anything else. The command name is in
/// parentheses and may hold spaces and parentheses itself: the fields start
/// after the last `)`.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let (head, rest) = text.rsplit_once(')')?;
    let pid = head.split_once('(')?.0.trim().parse().ok()?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i)?.parse::<u64>().ok();
    Some(ProcStat {
        pid,
        uid: 0,
        pgid: f.get(2)?.parse().ok()?,
        cpu_ticks: num(11)?.saturating_add(num(12)?),
        child_ticks: num(13)?.saturating_add(num(14)?),
        start_ticks: num(19)?,
        rss_pages: num(21)?,
    })
}

/// One GPU's reading: utilization (percent) and memory in use (MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuReading {
    pub util_pct: u32,
    pub mem_mb: u64,
}

/// Parses a simulated node's load file: `INDEX UTIL_PCT [MEM_MB]` a line
/// (utilization clamped to 100); other lines are skipped.
pub fn parse_load(text: &str) -> BTreeMap<u32, GpuReading> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let index = f.next()?.parse().ok()?;
            let util_pct = f.next()?.parse::<u32>().ok()?.min(100);
            let mem_mb = f.next().and_then(|m| m.parse().ok()).unwrap_or(0);
            Some((index, GpuReading { util_pct, mem_mb }))
        })
        .collect()
}

/// Where GPU readings come from.
#[derive(Debug, Clone)]
pub enum GpuSource {
    None,
    Nvml(Arc<crate::nvml::NvmlProvider>),
    /// A simulated node's load file (see [`parse_load`]), which tests and
    /// demos write.
    File(PathBuf),
}

impl GpuSource {
    fn read(&self, gpus: usize) -> BTreeMap<u32, GpuReading> {
        match self {
            GpuSource::None => BTreeMap::new(),
            GpuSource::Nvml(nvml) => (0..u32::try_from(gpus).unwrap_or(u32::MAX))
                .filter_map(|i| {
                    let r = nvml.readings(i)?;
                    let util_pct =
                        if r.utilization.is_finite() { (r.utilization * 100.0).round() } else { return None };
                    let mem_mb = if r.memory_used_bytes.is_finite() { r.memory_used_bytes / 1048576.0 } else { 0.0 };
                    // Float to integer `as` saturates (NaN gives 0) and cannot
                    // panic: the percentage is clamped to 0..=100, and the
                    // megabytes lose only their (unwanted) fraction.
                    #[allow(clippy::cast_possible_truncation)]
                    let reading =
                        GpuReading { util_pct: util_pct.clamp(0.0, 100.0) as u32, mem_mb: mem_mb.max(0.0) as u64 };
                    Some((i, reading))
                })
                .collect(),
            GpuSource::File(path) => {
                use std::io::Read;
                let mut text = String::new();
                // Only a regular file: opening a FIFO would wait for a writer.
                let regular = std::fs::symlink_metadata(path).is_ok_and(|m| m.is_file());
                if let Some(f) = regular.then(|| std::fs::File::open(path).ok()).flatten() {
                    let _ = f.take(LOAD_FILE_BYTES_MAX).read_to_string(&mut text);
                }
                parse_load(&text)
            }
        }
    }
}

/// What one walk of /proc and one round of GPU readings saw.
#[derive(Debug)]
pub struct Snapshot {
    pub taken: Instant,
    pub procs: Vec<ProcStat>,
    pub gpus: BTreeMap<u32, GpuReading>,
}

/// Takes snapshots for every task of the node (see the module's note).
#[derive(Debug)]
pub struct Sampler {
    gpus: GpuSource,
    gpu_count: usize,
    last: Mutex<Option<Arc<Snapshot>>>,
    /// Held by the one walk under way.
    walking: Mutex<()>,
    /// Clock ticks per second and bytes per page (sysconf).
    ticks_per_s: u64,
    page_bytes: u64,
}

impl Sampler {
    pub fn new(gpus: GpuSource, gpu_count: usize) -> Sampler {
        Sampler {
            gpus,
            gpu_count,
            last: Mutex::new(None),
            walking: Mutex::new(()),
            ticks_per_s: rustix::param::clock_ticks_per_second().max(1),
            page_bytes: (rustix::param::page_size() as u64).max(1),
        }
    }

    /// A snapshot no older than [`SNAPSHOT_REUSE`] (blocking: reads /proc
    /// and the GPUs). While another task's walk is under way (or stuck: a
    /// GPU that stopped answering NVML), None: that sample is skipped, and
    /// no thread waits behind it.
    pub fn snapshot(&self) -> Option<Arc<Snapshot>> {
        if let Some(s) = self.last.lock().expect("usage snapshot lock").as_ref() {
            if s.taken.elapsed() < SNAPSHOT_REUSE {
                return Some(s.clone());
            }
        }
        let _walking = self.walking.try_lock().ok()?;
        let s = Arc::new(Snapshot { taken: Instant::now(), procs: walk_proc(), gpus: self.gpus.read(self.gpu_count) });
        *self.last.lock().expect("usage snapshot lock") = Some(s.clone());
        Some(s)
    }

    fn ms(&self, ticks: u64) -> u64 {
        ticks.saturating_mul(1000).checked_div(self.ticks_per_s).unwrap_or(0)
    }

    fn mb(&self, pages: u64) -> u64 {
        pages.saturating_mul(self.page_bytes) / (1024 * 1024)
    }
}

/// Reads `/proc/PID/stat` of up to [`PROCS_MAX`] processes, with their owners.
fn walk_proc() -> Vec<ProcStat> {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    first_procs(dir.filter_map(Result::ok), std::fs::DirEntry::file_name)
        .filter_map(|e| {
            let uid = e.metadata().ok()?.uid();
            Some(ProcStat { uid, ..read_stat(&e.path().join("stat"))? })
        })
        .collect()
}

/// The first [`PROCS_MAX`] of `/proc`'s entries that are processes (named by
/// their pid; `name` gives an entry's name).
fn first_procs<E>(
    entries: impl Iterator<Item = E>,
    name: impl Fn(&E) -> std::ffi::OsString,
) -> impl Iterator<Item = E> {
    entries.filter(move |e| name(e).to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))).take(PROCS_MAX)
}

/// A process's stat; its command name may be any bytes (a job sets it), so
/// the text is read lossily rather than the process skipped.
fn read_stat(path: &Path) -> Option<ProcStat> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path).ok()?.take(STAT_BYTES_MAX).read_to_end(&mut bytes).ok()?;
    parse_stat(&String::from_utf8_lossy(&bytes))
}

/// The CPU time (ticks) of an ended process not yet reaped, and of every
/// descendant it waited for; None if it cannot be read.
pub fn ended_tree_ticks(pid: i32) -> Option<u64> {
    let s = read_stat(&PathBuf::from(format!("/proc/{pid}/stat")))?;
    (s.pid == pid).then(|| s.cpu_ticks.saturating_add(s.child_ticks))
}

/// A task's use as its exit report carries it.
pub fn to_proto(u: TaskUsage) -> gangway_proto::v1::TaskUsage {
    gangway_proto::v1::TaskUsage {
        cpu_ms: u.cpu_ms,
        mem_peak_mb: u.mem_peak_mb,
        gpu_samples: u.gpu_samples,
        gpu_util_pct_sum: u.gpu_util_pct_sum,
        gpu_mem_peak_mb: u.gpu_mem_peak_mb,
    }
}

/// The other way (a report queued in the agent's core).
pub fn from_proto(u: &gangway_proto::v1::TaskUsage) -> TaskUsage {
    TaskUsage {
        cpu_ms: u.cpu_ms,
        mem_peak_mb: u.mem_peak_mb,
        gpu_samples: u.gpu_samples,
        gpu_util_pct_sum: u.gpu_util_pct_sum,
        gpu_mem_peak_mb: u.gpu_mem_peak_mb,
    }
}

/// One task's use so far, fed with snapshots.
#[derive(Debug, Default)]
pub struct Meter {
    gpus: Vec<u32>,
    /// The task's user: another user's process that joined one of its
    /// process groups is not counted as its use.
    uid: Option<u32>,
    /// Live processes' CPU ticks at their last sample, by (pid, start).
    live: BTreeMap<(i32, u64), u64>,
    /// Ticks of processes seen before that have ended since.
    ended_ticks: u64,
    mem_peak_pages: u64,
    gpu_samples: u32,
    gpu_util_pct_sum: u64,
    gpu_mem_peak_mb: u64,
    last: Option<Instant>,
}

impl Meter {
    pub fn new(gpus: &[u32], uid: Option<u32>) -> Meter {
        Meter { gpus: gpus.to_vec(), uid, ..Meter::default() }
    }

    /// Takes in a snapshot for a task whose processes are in `groups`
    /// (process group ids). A snapshot seen before is not counted again.
    pub fn observe(&mut self, snap: &Snapshot, groups: &[i32]) {
        if self.last == Some(snap.taken) {
            return;
        }
        self.last = Some(snap.taken);
        let mut seen = BTreeMap::new();
        let mut rss = 0u64;
        let own = |p: &&ProcStat| groups.contains(&p.pgid) && self.uid.is_none_or(|u| u == p.uid);
        for p in snap.procs.iter().filter(own).take(PROCS_PER_TASK_MAX) {
            rss = rss.saturating_add(p.rss_pages);
            seen.insert((p.pid, p.start_ticks), p.cpu_ticks);
        }
        for (key, ticks) in std::mem::take(&mut self.live) {
            if !seen.contains_key(&key) {
                self.ended_ticks = self.ended_ticks.saturating_add(ticks);
            }
        }
        self.live = seen;
        self.mem_peak_pages = self.mem_peak_pages.max(rss);
        for g in &self.gpus {
            if let Some(r) = snap.gpus.get(g) {
                self.gpu_samples = self.gpu_samples.saturating_add(1);
                self.gpu_util_pct_sum = self.gpu_util_pct_sum.saturating_add(u64::from(r.util_pct.min(100)));
                self.gpu_mem_peak_mb = self.gpu_mem_peak_mb.max(r.mem_mb);
            }
        }
    }

    /// The task's use: CPU time the larger of the samples' and the ended
    /// main process's tree (`tree_ticks`); memory the cgroup's peak where
    /// there is one (exact: a sum of resident sets counts shared pages once
    /// per process), else the samples'. None when nothing was measured (no
    /// sample, no tree, no cgroup), so that it reads "not measured", not 0.
    pub fn finish(&self, sampler: &Sampler, tree_ticks: Option<u64>, cgroup_peak_mb: Option<u64>) -> Option<TaskUsage> {
        if self.last.is_none() && tree_ticks.is_none() && cgroup_peak_mb.is_none() {
            return None;
        }
        let sampled = self.live.values().fold(self.ended_ticks, |a, t| a.saturating_add(*t));
        Some(TaskUsage {
            cpu_ms: sampler.ms(sampled.max(tree_ticks.unwrap_or(0))),
            mem_peak_mb: cgroup_peak_mb.unwrap_or_else(|| sampler.mb(self.mem_peak_pages)),
            gpu_samples: self.gpu_samples,
            gpu_util_pct_sum: self.gpu_util_pct_sum,
            gpu_mem_peak_mb: self.gpu_mem_peak_mb,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(pid: i32, pgid: i32, cpu: u64, rss: u64) -> ProcStat {
        ProcStat { pid, uid: 1000, pgid, start_ticks: 7, cpu_ticks: cpu, child_ticks: 0, rss_pages: rss }
    }

    #[test]
    fn a_stat_line_with_a_hostile_command_name_parses() {
        let line = "4242 (evil) 1 2 (x) R 1 4242 4242 0 -1 4194304 10 0 0 0 150 50 7 3 20 0 1 0 98765 1000000 256 18446744073709551615";
        let s = parse_stat(line).expect("parses");
        let want = ProcStat {
            pid: 4242,
            uid: 0,
            pgid: 4242,
            start_ticks: 98765,
            cpu_ticks: 200,
            child_ticks: 10,
            rss_pages: 256,
        };
        assert_eq!(s, want);
        // A command name that is not UTF-8 still parses.
        let mut bytes = line.as_bytes().to_vec();
        bytes[6] = 0xff;
        assert_eq!(parse_stat(&String::from_utf8_lossy(&bytes)).map(|s| s.pid), Some(4242));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("12 (x) R 1"), None);
    }

    #[test]
    fn this_process_can_be_read() {
        let me = std::process::id() as i32;
        let s = read_stat(Path::new("/proc/self/stat")).expect("own stat");
        assert_eq!(s.pid, me);
        assert!(s.rss_pages > 0);
    }

    #[test]
    fn load_files_are_clamped_and_bad_lines_skipped() {
        let l = parse_load("0 95 40000\n1 250\nx 3\n2\n");
        assert_eq!(l.get(&0), Some(&GpuReading { util_pct: 95, mem_mb: 40000 }));
        assert_eq!(l.get(&1), Some(&GpuReading { util_pct: 100, mem_mb: 0 }));
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn the_meter_counts_ended_processes_once_and_only_its_groups() {
        let sampler = Sampler { ticks_per_s: 100, page_bytes: 1024 * 1024, ..Sampler::new(GpuSource::None, 0) };
        let mut m = Meter::new(&[1], Some(1000));
        let t0 = Instant::now();
        let gpus = BTreeMap::from([
            (0, GpuReading { util_pct: 100, mem_mb: 9 }),
            (1, GpuReading { util_pct: 40, mem_mb: 500 }),
        ]);
        let snap = |taken, procs| Snapshot { taken, procs, gpus: gpus.clone() };
        // Another user's process that joined the task's group is not its use.
        let intruder = ProcStat { uid: 0, ..stat(12, 10, 7000, 700) };
        let first = snap(t0, vec![stat(10, 10, 100, 30), stat(11, 10, 50, 20), stat(99, 99, 5000, 900), intruder]);
        m.observe(&first, &[10]);
        m.observe(&first, &[10]); // the same snapshot: not counted twice
                                  // Process 11 ended; 10 ran on.
        m.observe(&snap(t0 + Duration::from_secs(10), vec![stat(10, 10, 300, 10)]), &[10]);
        assert_eq!(Meter::new(&[1], None).finish(&sampler, None, None), None, "nothing measured");
        let u = m.finish(&sampler, None, None).expect("measured");
        assert_eq!(u.cpu_ms, 3500, "50 ticks of the ended process and 300 of the live one");
        assert_eq!(u.mem_peak_mb, 50, "the most its processes held at once");
        assert_eq!((u.gpu_samples, u.gpu_util_pct_sum, u.gpu_mem_peak_mb), (2, 80, 500), "only its own GPU");
        // The ended main process's tree is exact where the samples missed some.
        let exact = m.finish(&sampler, Some(1000), Some(40)).expect("measured");
        assert_eq!(exact.cpu_ms, 10_000);
        assert_eq!(exact.mem_peak_mb, 40, "the cgroup's peak is exact, where there is one");
    }

    /// A stat file is read up to STAT_BYTES_MAX bytes: a line ending at the
    /// cap parses; one pushed a byte past it is cut short, and does not.
    #[test]
    fn stat_files_are_read_up_to_stat_bytes_max() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stat");
        // A long command name pads the line to `len` bytes; it ends with the
        // resident set (9 pages).
        let read = |len: usize| {
            let tail = ") R 1 4242 4242 0 -1 4194304 10 0 0 0 150 50 7 3 20 0 1 0 98765 1000000 9";
            std::fs::write(&path, format!("4242 ({}{tail}", "n".repeat(len - 6 - tail.len()))).unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), len as u64);
            read_stat(&path)
        };
        assert_eq!(read(STAT_BYTES_MAX as usize).map(|s| (s.pid, s.rss_pages)), Some((4242, 9)));
        assert_eq!(read(STAT_BYTES_MAX as usize + 1), None, "a byte past the cap was read");
    }

    /// A load file is read up to LOAD_FILE_BYTES_MAX bytes: a GPU's line
    /// ending at the cap counts; one pushed a byte past it is cut short.
    #[test]
    fn load_files_are_read_up_to_load_file_bytes_max() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("load");
        // Filler that is no GPU's line, then GPU 3's ending at byte `len`.
        let read = |len: usize| {
            std::fs::write(&path, format!("{}\n3 9", "x".repeat(len - 4))).unwrap();
            GpuSource::File(path.clone()).read(4)
        };
        assert_eq!(read(LOAD_FILE_BYTES_MAX as usize).get(&3), Some(&GpuReading { util_pct: 9, mem_mb: 0 }));
        assert_eq!(read(LOAD_FILE_BYTES_MAX as usize + 1).get(&3), None, "a byte past the cap was read");
    }

    /// A walk of /proc reads PROCS_MAX processes, the last of them included,
    /// and not one more; entries that are no process do not count.
    #[test]
    fn a_walk_reads_at_most_procs_max_processes() {
        let names = |n: usize| std::iter::once("self".to_string()).chain((1..=n).map(|i| i.to_string()));
        let name = |n: &String| std::ffi::OsString::from(n);
        let at: Vec<String> = first_procs(names(PROCS_MAX), name).collect();
        assert_eq!((at.len(), at.last()), (PROCS_MAX, Some(&PROCS_MAX.to_string())));
        let past: Vec<String> = first_procs(names(PROCS_MAX + 1), name).collect();
        assert_eq!((past.len(), past.last()), (PROCS_MAX, Some(&PROCS_MAX.to_string())));
    }

    /// A task's meter tracks PROCS_PER_TASK_MAX of its processes, the last
    /// of them included, and not one more.
    #[test]
    fn a_meter_tracks_at_most_procs_per_task_max_processes() {
        let sampler = Sampler { ticks_per_s: 100, page_bytes: 1024 * 1024, ..Sampler::new(GpuSource::None, 0) };
        let meter = |n: usize| {
            let procs = (1..=n as i32).map(|pid| stat(pid, 10, 1, 1)).collect();
            let mut m = Meter::new(&[], None);
            m.observe(&Snapshot { taken: Instant::now(), procs, gpus: BTreeMap::new() }, &[10]);
            m
        };
        let at = meter(PROCS_PER_TASK_MAX);
        assert_eq!(at.live.len(), PROCS_PER_TASK_MAX);
        assert!(at.live.contains_key(&(PROCS_PER_TASK_MAX as i32, 7)));
        let past = meter(PROCS_PER_TASK_MAX + 1);
        assert_eq!(past.live.len(), PROCS_PER_TASK_MAX);
        assert!(!past.live.contains_key(&(PROCS_PER_TASK_MAX as i32 + 1, 7)), "a process past the cap was tracked");
        let used = |m: &Meter| m.finish(&sampler, None, None).map(|u| (u.cpu_ms, u.mem_peak_mb));
        assert_eq!(used(&past), used(&at), "a process past the cap was counted");
    }
}
