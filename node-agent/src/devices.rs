//! Device isolation: a task may open only its own GPUs. On hosts with the
//! cgroup v1 devices controller (hybrid hierarchies, as on our CI machines
//! and most HPC distributions), each task gets a devices cgroup that denies
//! every device but the few every process needs (`/dev/null`, `/dev/zero`,
//! the terminals, ...), its own GPUs' `/dev/nvidiaN`, and the NVIDIA control
//! devices every CUDA process opens (`/dev/nvidiactl`, `/dev/nvidia-uvm`,
//! `/dev/nvidia-modeset`, the `nvidia-caps` read nodes), as the NVIDIA
//! container toolkit allows them. A job that clears `CUDA_VISIBLE_DEVICES`
//! then still cannot reach its neighbours' GPUs: opening one is refused
//! (EPERM) before the driver sees it.
//!
//! The task shim joins the cgroup first thing ([`shim_options`]), before
//! it runs anything of the job's, so nothing the task runs ever ran outside it. Hosts with only the unified
//! (v2) hierarchy filter devices with an eBPF program instead: not yet
//! (docs/security.md, "Not yet"); there the agent warns once at start.

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
/// Bytes of /proc/devices read: a few hundred on any host.
const PROC_DEVICES_BYTES_MAX: u64 = 64 * 1024;

/// What every process needs, as container runtimes allow it: creating
/// device nodes (not opening them), null, zero, full, random, urandom,
/// the controlling terminal, ptmx and the pseudo-terminals.
const BASE_RULES: &[&str] = &[
    "c *:* m",
    "b *:* m",
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
];

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

/// The devices cgroup rules of a task holding `gpus` (their minors): the
/// base set; with any GPU, the control devices and each of its own.
pub fn allow_rules(gpus: &[u32], majors: NvidiaMajors) -> Vec<String> {
    let mut rules: Vec<String> = BASE_RULES.iter().map(|r| r.to_string()).collect();
    let own: Vec<u32> = gpus.iter().copied().filter(|g| *g < GPU_MINOR_MAX).collect();
    if own.is_empty() {
        return rules;
    }
    rules.push(format!("c {NVIDIA_MAJOR}:{NVIDIACTL_MINOR} rwm"));
    rules.push(format!("c {NVIDIA_MAJOR}:{NVIDIA_MODESET_MINOR} rwm"));
    if let Some(uvm) = majors.uvm {
        rules.push(format!("c {uvm}:* rwm"));
    }
    if let Some(caps) = majors.caps {
        // The capability nodes are read to prove a right (MIG's config and
        // monitor); reading them is what the toolkit grants.
        rules.push(format!("c {caps}:* r"));
    }
    rules.extend(own.iter().map(|g| format!("c {NVIDIA_MAJOR}:{g} rwm")));
    rules
}

/// The agent's subtree of the devices hierarchy.
#[derive(Debug, Clone)]
pub struct DeviceCgroups {
    root: PathBuf,
    majors: NvidiaMajors,
}

impl DeviceCgroups {
    /// The subtree of agent `node` keeping its state in `state_dir`, on a
    /// host with the v1 devices controller; None elsewhere.
    pub fn detect(node: &str, state_dir: &Path) -> Option<DeviceCgroups> {
        DeviceCgroups::at(Path::new(DEVICES_ROOT), node, state_dir)
    }

    /// The subtree under a mounted devices hierarchy `mount`: one per agent
    /// (several may share a host: a test's, a simulated fleet's), named by
    /// its node and its state directory, which a restarted agent keeps and
    /// so finds its running tasks' cgroups again. Cgroups left empty by an
    /// agent before this one go.
    pub fn at(mount: &Path, node: &str, state_dir: &Path) -> Option<DeviceCgroups> {
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
        let majors = read_limited(Path::new("/proc/devices")).map(|t| NvidiaMajors::parse(&t)).unwrap_or_default();
        Some(DeviceCgroups { root, majors })
    }

    /// The agent's subtree.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cgroup of task `name` (a job's attempt, a step's tasks), allowing
    /// only the devices of [`allow_rules`]. An existing one is set again.
    pub fn create(&self, name: &str, gpus: &[u32]) -> std::io::Result<PathBuf> {
        let dir = self.root.join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("devices.deny"), "a")?;
        for rule in allow_rules(gpus, self.majors) {
            std::fs::write(dir.join("devices.allow"), rule)?;
        }
        Ok(dir)
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

    /// Removes a task's cgroup once nothing runs in it (the kernel refuses
    /// before that; its processes are ended by then).
    pub fn remove(dir: &Path) {
        let _ = std::fs::remove_dir(dir);
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
    for dir in dirs {
        std::fs::write(dir.join("cgroup.procs"), pid.to_string())?;
    }
    Ok(())
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

    #[test]
    fn nvidia_majors_come_from_proc_devices() {
        let text = "Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n234 nvidia-uvm\n\
                    237 nvidia-caps\n\nBlock devices:\n  8 sd\n 240 nvidia-uvm\n";
        assert_eq!(NvidiaMajors::parse(text), NvidiaMajors { uvm: Some(234), caps: Some(237) });
        assert_eq!(NvidiaMajors::parse("Character devices:\n  1 mem\n"), NvidiaMajors::default());
    }

    /// A task without GPUs gets no NVIDIA device; one with GPUs 1 and 3 gets
    /// those two, the control devices, and no other GPU (GPU_MINOR_MAX
    /// bounds the minors: one past is never allowed).
    #[test]
    fn a_task_is_allowed_only_its_own_gpus() {
        let majors = NvidiaMajors { uvm: Some(234), caps: Some(237) };
        let none = allow_rules(&[], majors);
        assert!(none.iter().all(|r| !r.contains("195:") && !r.contains("234:")), "{none:?}");
        assert!(none.contains(&"c 1:3 rwm".to_string()));
        let two = allow_rules(&[1, 3], majors);
        let gpus: Vec<&String> = two.iter().filter(|r| r.starts_with("c 195:") && !r.contains(":25")).collect();
        assert_eq!(gpus, ["c 195:1 rwm", "c 195:3 rwm"]);
        for needed in ["c 195:255 rwm", "c 195:254 rwm", "c 234:* rwm", "c 237:* r"] {
            assert!(two.contains(&needed.to_string()), "{needed}: {two:?}");
        }
        assert!(!two.iter().any(|r| r == "a" || r.starts_with("c 195:*")), "no wildcard over GPUs");
        let edge = allow_rules(&[GPU_MINOR_MAX - 1, GPU_MINOR_MAX], majors);
        assert!(edge.contains(&format!("c 195:{} rwm", GPU_MINOR_MAX - 1)));
        assert!(!edge.contains(&format!("c 195:{GPU_MINOR_MAX} rwm")), "a minor past GPU_MINOR_MAX");
    }
}
