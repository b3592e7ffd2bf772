//! Per-task cgroups on hosts with the unified cgroup v2 hierarchy: CPU and
//! memory limits from the allocation, killing the whole tree at once
//! (`cgroup.kill`), and the task's peak memory. Hosts without it (cgroup v1 or
//! hybrid, as on our CI machines) fall back to plain process groups.

use std::path::{Path, PathBuf};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// cpu.max period: the kernel's default, 100 ms.
const CPU_PERIOD_US: u64 = 100_000;

#[derive(Debug, Clone)]
pub struct Cgroups {
    root: PathBuf,
}

impl Cgroups {
    /// The gangway subtree, if this host has cgroup v2 with the cpu and memory
    /// controllers and lets us delegate them; `None` means process groups only.
    pub fn detect() -> Option<Cgroups> {
        let controllers = std::fs::read_to_string(Path::new(CGROUP_ROOT).join("cgroup.controllers")).ok()?;
        let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
        if !has("memory") || !has("cpu") {
            return None;
        }
        let root = Path::new(CGROUP_ROOT).join("gangway");
        std::fs::create_dir_all(&root).ok()?;
        std::fs::write(Path::new(CGROUP_ROOT).join("cgroup.subtree_control"), "+cpu +memory").ok()?;
        std::fs::write(root.join("cgroup.subtree_control"), "+cpu +memory").ok()?;
        Some(Cgroups { root })
    }

    /// Creates the task's cgroup with its limits.
    pub fn create(&self, job: u64, attempt: u32, cpus: u32, mem_mb: u64) -> std::io::Result<PathBuf> {
        let dir = self.root.join(format!("job-{job}-{attempt}"));
        std::fs::create_dir_all(&dir)?;
        if mem_mb > 0 {
            std::fs::write(dir.join("memory.max"), mem_mb.saturating_mul(1024 * 1024).to_string())?;
        }
        if cpus > 0 {
            std::fs::write(dir.join("cpu.max"), format!("{} {CPU_PERIOD_US}", u64::from(cpus) * CPU_PERIOD_US))?;
        }
        Ok(dir)
    }

    pub fn add(dir: &Path, pid: u32) -> std::io::Result<()> {
        std::fs::write(dir.join("cgroup.procs"), pid.to_string())
    }

    /// The processes in the cgroup `dir` (none without one).
    pub fn procs(dir: Option<&Path>) -> Vec<i32> {
        let Some(dir) = dir else { return Vec::new() };
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Kills every process in the cgroup (Linux 5.14+).
    pub fn kill(dir: &Path) {
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    }

    /// Peak memory of the cgroup in MiB (memory.peak, Linux 5.19+).
    pub fn peak_mb(dir: &Path) -> Option<u64> {
        let s = std::fs::read_to_string(dir.join("memory.peak")).ok()?;
        s.trim().parse::<u64>().ok().map(|b| b / (1024 * 1024))
    }

    pub fn remove(dir: &Path) {
        let _ = std::fs::remove_dir(dir);
    }
}
