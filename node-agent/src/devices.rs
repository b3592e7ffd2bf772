//! Device isolation (`gangway agent --constrain-devices`, Slurm's
//! ConstrainDevices): a task may open only its own GPUs. On hosts with the
//! cgroup v1 devices controller (hybrid hierarchies, as on our CI machines
//! and most HPC distributions), each task gets a devices cgroup that denies
//! the node's other GPUs' `/dev/nvidiaN` (and, to a task without GPUs, the
//! NVIDIA control devices too), leaving every other device (InfiniBand,
//! FUSE, ...) as it was, as Slurm does. A job that clears
//! `CUDA_VISIBLE_DEVICES` then still cannot reach its neighbours' GPUs:
//! opening one is refused (EPERM) before the driver sees it. CUDA then
//! numbers the GPUs a task can open from 0, so its `CUDA_VISIBLE_DEVICES`
//! holds job-local indexes ([`local_indexes`]), in PCI bus order.
//!
//! The task shim joins the cgroup first thing ([`shim_options`]), before
//! it runs anything of the job's, so nothing the task runs ever ran outside
//! it; at the task's end what is left in it is killed ([`DeviceCgroups::empty`]).
//! Hosts with only the unified (v2) hierarchy filter devices with an eBPF
//! program instead: not yet (docs/security.md, "Not yet"); there the flag is
//! refused at start.

use std::path::{Path, PathBuf};

const DEVICES_ROOT: &str = "/sys/fs/cgroup/devices";
/// The NVIDIA driver's character-device major: `/dev/nvidiaN` is minor N
/// (the GPU's NVML minor number, which the inventory's index follows),
/// `/dev/nvidiactl` 255, `/dev/nvidia-modeset` 254.
const NVIDIA_MAJOR: u32 = 195;
const NVIDIACTL_MINOR: u32 = 255;
const NVIDIA_MODESET_MINOR: u32 = 254;
/// Minors of `/dev/nvidiaN` a host may have: the core's GPUs per node.
const GPU_MINOR_MAX: u32 = gangway_core::limits::GPUS_PER_NODE_MAX;
/// Rounds of killing what is left in a task's devices cgroup (a process
/// forking as fast as it is killed): 10 ms apart, a second in all.
const EMPTY_ROUNDS_MAX: usize = 100;
/// Bytes of /proc/devices read: a few hundred on any host.
const PROC_DEVICES_BYTES_MAX: u64 = 64 * 1024;

/// The NVIDIA majors the kernel gave out at run time (`/proc/devices`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NvidiaMajors {
    pub uvm: Option<u32>,
    pub caps: Option<u32>,
}

impl NvidiaMajors {
    /// From /proc/devices' "Character devices:" section.
    pub fn parse(proc_devices: &str) -> NvidiaMajors {
        let mut m = NvidiaMajors::default();
        let chars = proc_devices.split("Block devices:").next().unwrap_or("");
        for line in chars.lines() {
            let mut words = line.split_whitespace();
            let (Some(major), Some(name)) = (words.next(), words.next()) else { continue };
            let Ok(major) = major.parse::<u32>() else { continue };
            match name {
                "nvidia-uvm" => m.uvm = Some(major),
                "nvidia-caps" => m.caps = Some(major),
                _ => {}
            }
        }
        m
    }
}

/// The devices a task holding `gpus` (their minors) of a node's
/// `node_gpus` may not open: the node's other GPUs; with none of its own,
/// the NVIDIA control devices too. (Minors at or past GPU_MINOR_MAX are
/// never a node's.)
pub fn deny_rules(gpus: &[u32], node_gpus: u32, majors: NvidiaMajors) -> Vec<String> {
    let mut rules: Vec<String> = (0..node_gpus.min(GPU_MINOR_MAX))
        .filter(|g| !gpus.contains(g))
        .map(|g| format!("c {NVIDIA_MAJOR}:{g} rwm"))
        .collect();
    if gpus.iter().all(|g| *g >= GPU_MINOR_MAX) {
        rules.push(format!("c {NVIDIA_MAJOR}:{NVIDIACTL_MINOR} rwm"));
        rules.push(format!("c {NVIDIA_MAJOR}:{NVIDIA_MODESET_MINOR} rwm"));
        rules.extend(majors.uvm.map(|m| format!("c {m}:* rwm")));
        rules.extend(majors.caps.map(|m| format!("c {m}:* rwm")));
    }
    rules
}

/// What a confined task's `CUDA_VISIBLE_DEVICES` says for `count` GPUs:
/// CUDA numbers the devices a process can open from 0 (Slurm does the same
/// under ConstrainDevices).
pub fn local_indexes(count: usize) -> String {
    (0..count).map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// The agent's subtree of the devices hierarchy.
#[derive(Debug, Clone)]
pub struct DeviceCgroups {
    root: PathBuf,
    /// GPUs on this node (minors 0..n).
    node_gpus: u32,
}

impl DeviceCgroups {
    /// The subtree of agent `node` keeping its state in `state_dir`, on a
    /// host with the v1 devices controller; None elsewhere.
    pub fn detect(node: &str, state_dir: &Path, node_gpus: u32) -> Option<DeviceCgroups> {
        DeviceCgroups::at(Path::new(DEVICES_ROOT), node, state_dir, node_gpus)
    }

    /// The subtree under a mounted devices hierarchy `mount`: one per agent
    /// (several may share a host: a test's, a simulated fleet's), named by
    /// its node and its state directory, which a restarted agent keeps and
    /// so finds its running tasks' cgroups again. Cgroups left empty by an
    /// agent before this one go.
    pub fn at(mount: &Path, node: &str, state_dir: &Path, node_gpus: u32) -> Option<DeviceCgroups> {
        if !mount.join("devices.allow").exists() {
            return None;
        }
        let all = mount.join("gangway");
        let root = all.join(agent_name(node, state_dir));
        std::fs::create_dir_all(&root).ok()?;
        for old in std::fs::read_dir(&root).ok()?.flatten() {
            // Refused (EBUSY) while anything runs in it.
            let _ = std::fs::remove_dir(old.path());
        }
        // Other agents' subtrees that hold no task (agents gone, tests
        // over); one in use is refused, and an agent remakes its own.
        for other in std::fs::read_dir(&all).ok()?.flatten().filter(|e| e.path() != root) {
            let _ = std::fs::remove_dir(other.path());
        }
        Some(DeviceCgroups { root, node_gpus })
    }

    /// The agent's subtree.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cgroup of task `name` (a job's attempt), refusing the devices
    /// of [`deny_rules`]. An existing one (left by an agent before) is set
    /// anew. The NVIDIA majors are read now: `nvidia-uvm` is loaded at the
    /// first CUDA call, and may have come since the agent started.
    pub fn create(&self, name: &str, gpus: &[u32]) -> std::io::Result<PathBuf> {
        let dir = self.root.join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("devices.allow"), "a")?;
        let majors = read_limited(Path::new("/proc/devices")).map(|t| NvidiaMajors::parse(&t)).unwrap_or_default();
        for rule in deny_rules(gpus, self.node_gpus, majors) {
            std::fs::write(dir.join("devices.deny"), rule)?;
        }
        Ok(dir)
    }

    /// Kills what is left in a task's cgroup (a daemon that left the task's
    /// process groups) and removes it, so the GPUs it was allowed go to the
    /// next job alone. Returns how many processes it had to kill.
    pub fn empty(dir: &Path) -> usize {
        let mut killed = 0usize;
        for _ in 0..EMPTY_ROUNDS_MAX {
            let pids = crate::cgroup::Cgroups::procs(Some(dir));
            if pids.is_empty() {
                break;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
                killed = killed.saturating_add(1);
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if let Err(e) = std::fs::remove_dir(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "a task's devices cgroup could not be removed");
        }
        killed
    }

    /// The cgroup of a running job's task (`key`: job and attempt) that a
    /// restarted agent re-adopted: the one it runs in, as it was set (never
    /// reset under a running task), or a new one for its next steps.
    pub fn of_running(&self, key: (u64, u32), gpus: &[u32]) -> Option<PathBuf> {
        let name = format!("job-{}-{}", key.0, key.1);
        let dir = self.root.join(&name);
        if dir.join("devices.list").exists() {
            return Some(dir);
        }
        self.create(&name, gpus)
            .map_err(|e| tracing::warn!(job = key.0, error = %e, "no devices cgroup for a re-adopted job's steps"))
            .ok()
    }
}

/// An agent's subtree's name: its node's name and a hash (FNV-1a, the same
/// in every build) of its state directory.
fn agent_name(node: &str, state_dir: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let hash = state_dir
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    format!("{node}-{hash:016x}")
}

/// A file's first [`PROC_DEVICES_BYTES_MAX`] bytes.
fn read_limited(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path).ok()?.take(PROC_DEVICES_BYTES_MAX).read_to_string(&mut text).ok()?;
    Some(text)
}

/// The task shim's options that make it join each cgroup of `dirs` first
/// thing, before it reads the task's environment or runs anything (a root
/// agent starts every task and step task through the shim): the task and
/// everything it forks run inside from their first instruction.
pub fn shim_options(dirs: &[PathBuf]) -> Vec<String> {
    dirs.iter().map(|d| format!("--cgroup={}", d.display())).collect()
}

/// Moves process `pid` into each cgroup of `dirs`: for a task started
/// without the shim (an agent that is not root, which cgroups rarely let
/// do this anyway), after it started.
pub fn join(dirs: &[PathBuf], pid: u32) -> std::io::Result<()> {
    dirs.iter().try_for_each(|dir| crate::cgroup::Cgroups::add(dir, pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// /proc/devices is read up to PROC_DEVICES_BYTES_MAX bytes; a byte
    /// more is left unread.
    #[test]
    fn proc_devices_is_read_to_proc_devices_bytes_max() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("devices");
        let max = PROC_DEVICES_BYTES_MAX as usize;
        std::fs::write(&file, "x".repeat(max)).unwrap();
        assert_eq!(read_limited(&file).map(|t| t.len()), Some(max));
        std::fs::write(&file, "x".repeat(max + 1)).unwrap();
        assert_eq!(read_limited(&file).map(|t| t.len()), Some(max), "one byte past is not read");
    }

    /// A cgroup that never empties (here a file that keeps naming a process
    /// past any pid the kernel gives) is given up after EMPTY_ROUNDS_MAX
    /// rounds of kills, not one more.
    #[test]
    fn emptying_a_cgroup_takes_at_most_empty_rounds_max_rounds() {
        let dir = tempfile::tempdir().unwrap();
        let stuck = dir.path().join("stuck");
        std::fs::create_dir(&stuck).unwrap();
        std::fs::write(stuck.join("cgroup.procs"), format!("{}\n", i32::MAX)).unwrap();
        assert_eq!(DeviceCgroups::empty(&stuck), EMPTY_ROUNDS_MAX);
        let gone = dir.path().join("gone");
        std::fs::create_dir(&gone).unwrap();
        assert_eq!(DeviceCgroups::empty(&gone), 0);
        assert!(!gone.exists(), "an empty cgroup is removed");
    }

    #[test]
    fn nvidia_majors_come_from_proc_devices() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n234 nvidia-uvm\n\
                    237 nvidia-caps\n\nBlock devices:\n  8 sd\n 240 nvidia-uvm\n";
        assert_eq!(NvidiaMajors::parse(text), NvidiaMajors { uvm: Some(234), caps: Some(237) });
        assert_eq!(NvidiaMajors::parse("Character devices:\n  1 mem\n"), NvidiaMajors::default());
    }

    /// A task holding GPUs 1 and 3 of a node's 4 is refused 0 and 2 and
    /// nothing else; one holding none is refused every GPU and the control
    /// devices. Minors past GPU_MINOR_MAX are never a node's.
    #[test]
    fn a_task_is_refused_every_gpu_but_its_own() {
        let majors = NvidiaMajors { uvm: Some(234), caps: Some(237) };
        assert_eq!(deny_rules(&[1, 3], 4, majors), ["c 195:0 rwm", "c 195:2 rwm"]);
        let none = deny_rules(&[], 2, majors);
        assert_eq!(
            none,
            ["c 195:0 rwm", "c 195:1 rwm", "c 195:255 rwm", "c 195:254 rwm", "c 234:* rwm", "c 237:* rwm"]
        );
        let all = deny_rules(&[], GPU_MINOR_MAX + 1, NvidiaMajors::default());
        assert!(all.contains(&format!("c 195:{} rwm", GPU_MINOR_MAX - 1)));
        assert!(!all.contains(&format!("c 195:{GPU_MINOR_MAX} rwm")), "a minor past GPU_MINOR_MAX");
        assert_eq!(local_indexes(3), "0,1,2");
        assert_eq!(local_indexes(0), "");
    }
}
