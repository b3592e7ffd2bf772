//! The agent's fence store on local disk: for every job, the highest attempt it
//! ever launched, and the highest leader term it ever obeyed, written and synced
//! before a launch. The decisions that use them are the core's
//! (`gangway_core::agent`): an order for an attempt at or below a recorded one
//! is refused, so a deposed or lagging leader can never start a job twice, even
//! across agent restarts; answers from an older term than one already obeyed
//! are ignored.

use std::io::Write;
use std::path::{Path, PathBuf};

use gangway_core::agent::Fences;

pub struct FenceStore {
    path: PathBuf,
}

impl FenceStore {
    /// Opens the store in `dir` (created if missing) and reads its fences.
    pub fn open(dir: &Path) -> std::io::Result<(FenceStore, Fences)> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("fences");
        let mut fences = Fences::default();
        if let Ok(text) = std::fs::read_to_string(&path) {
            for line in text.lines() {
                let parts: Vec<&str> = line.split_whitespace().collect();
                match parts.as_slice() {
                    ["term", t] => fences.max_term = t.parse().unwrap_or(0),
                    // (A file from before histories has none: the first, 0.)
                    ["history", h] => fences.history = h.parse().unwrap_or(0),
                    [job, attempt] => {
                        if let (Ok(j), Ok(a)) = (job.parse(), attempt.parse()) {
                            fences.attempts.insert(j, a);
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok((FenceStore { path }, fences))
    }

    /// Writes `fences` whole (a new file, synced, renamed over the old one).
    pub fn save(&self, fences: &Fences) -> std::io::Result<()> {
        let tmp = self.path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        let mut text = format!("history {}\nterm {}\n", fences.history, fences.max_term);
        for (j, a) in &fences.attempts {
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
    fn fences_survive_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (store, mut fences) = FenceStore::open(dir.path()).unwrap();
        assert_eq!(fences, Fences::default());
        fences.max_term = 5;
        fences.attempts.insert(7, 1);
        fences.attempts.insert(9, 3);
        store.save(&fences).unwrap();
        let (_, read) = FenceStore::open(dir.path()).unwrap();
        assert_eq!(read, fences);
    }
}
