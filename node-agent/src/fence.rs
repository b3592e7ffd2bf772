//! The agent's fence store: for every job, the highest attempt it ever launched,
//! and the highest leader term it ever obeyed, kept on local disk (written and
//! synced before a launch). An order for an attempt at or below a recorded one is
//! refused, so a deposed or lagging leader can never start a job twice, even
//! across agent restarts; answers from an older term than one already obeyed are
//! ignored.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Jobs remembered. Beyond it the oldest (lowest) job ids are forgotten: job ids
/// only grow, and orders for such old jobs come only from long-deposed leaders.
const FENCES_MAX: usize = 100_000;

pub struct FenceStore {
    path: PathBuf,
    /// job id → highest attempt launched here.
    attempts: BTreeMap<u64, u32>,
    /// Highest leader term whose orders this agent followed.
    pub max_term: u64,
}

impl FenceStore {
    /// Loads the store from `dir` (created if missing).
    pub fn open(dir: &Path) -> std::io::Result<FenceStore> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("fences");
        let mut store = FenceStore { path, attempts: BTreeMap::new(), max_term: 0 };
        if let Ok(text) = std::fs::read_to_string(&store.path) {
            for line in text.lines() {
                let parts: Vec<&str> = line.split_whitespace().collect();
                match parts.as_slice() {
                    ["term", t] => store.max_term = t.parse().unwrap_or(0),
                    [job, attempt] => {
                        if let (Ok(j), Ok(a)) = (job.parse(), attempt.parse()) {
                            store.attempts.insert(j, a);
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(store)
    }

    /// Whether an answer from `term` may be acted on (records newer terms).
    pub fn accept_term(&mut self, term: u64) -> std::io::Result<bool> {
        if term < self.max_term {
            return Ok(false);
        }
        if term > self.max_term {
            self.max_term = term;
            self.persist()?;
        }
        Ok(true)
    }

    /// Records that `attempt` of `job` is about to launch here; refuses an
    /// attempt at or below one already launched.
    pub fn admit(&mut self, job: u64, attempt: u32) -> Result<(), String> {
        if let Some(&seen) = self.attempts.get(&job) {
            if seen >= attempt {
                return Err(format!(
                    "refused launch of job {job} attempt {attempt}: attempt {seen} was already launched on this node"
                ));
            }
        }
        self.attempts.insert(job, attempt);
        while self.attempts.len() > FENCES_MAX {
            self.attempts.pop_first();
        }
        self.persist().map_err(|e| format!("cannot record the launch fence: {e}"))
    }

    fn persist(&self) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        let mut text = format!("term {}\n", self.max_term);
        for (j, a) in &self.attempts {
            text.push_str(&format!("{j} {a}\n"));
        }
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fences_survive_restart_and_refuse_repeats() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = FenceStore::open(dir.path()).unwrap();
        f.admit(7, 1).unwrap();
        assert!(f.admit(7, 1).is_err(), "the same attempt twice");
        assert!(f.accept_term(5).unwrap());
        drop(f);
        let mut f = FenceStore::open(dir.path()).unwrap();
        assert!(f.admit(7, 1).is_err(), "forgotten after restart");
        f.admit(7, 2).unwrap();
        assert!(!f.accept_term(4).unwrap(), "an older term is ignored");
        assert!(f.accept_term(5).unwrap());
    }
}
