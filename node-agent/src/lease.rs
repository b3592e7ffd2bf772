//! The agent's lease: a small root-owned file in the task records directory
//! that says until when the node's tasks may run without the agent hearing
//! from a leader (the deadlines of its self-fence, `gangway_core::agent`).
//! The agent rewrites it at every contact, before any launch; each task's
//! shim reads it, so a task that outlives a crashed or hung agent still stops
//! in time, before the leader declares the node down and starts its job
//! elsewhere. Times are CLOCK_MONOTONIC milliseconds, the same in every
//! process of one boot.

use std::path::Path;

/// The deadlines (see `AgentCore::lease`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    pub stop_at_ms: u64,
    pub kill_at_ms: u64,
}

/// CLOCK_MONOTONIC in milliseconds.
pub fn now_ms() -> Option<u64> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
    let secs = u64::try_from(t.tv_sec()).ok()?;
    let ms = u64::try_from(t.tv_nsec() / 1_000_000).ok()?;
    secs.checked_mul(1000)?.checked_add(ms)
}

/// Writes the lease (a new file, world-readable: the shims run as the jobs'
/// users; renamed over the old one).
pub fn write(path: &Path, lease: Lease) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(format!("{} {}\n", lease.stop_at_ms, lease.kill_at_ms).as_bytes())?;
    std::fs::rename(&tmp, path)
}

/// The lease in `path`, if there is a readable one.
pub fn read(path: &Path) -> Option<Lease> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut it = text.split_whitespace().map(str::parse::<u64>);
    let (Some(Ok(stop_at_ms)), Some(Ok(kill_at_ms))) = (it.next(), it.next()) else { return None };
    Some(Lease { stop_at_ms, kill_at_ms })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_reads_back_and_garbage_is_no_lease() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lease");
        assert_eq!(read(&path), None);
        let l = Lease { stop_at_ms: 5, kill_at_ms: 7 };
        write(&path, l).unwrap();
        write(&path, l).unwrap();
        assert_eq!(read(&path), Some(l));
        std::fs::write(&path, "soon").unwrap();
        assert_eq!(read(&path), None);
        assert!(now_ms().is_some_and(|t| t > 0));
    }
}
