//! GPU health as the agent sees it. The simulated provider reads a fault file
//! (one `INDEX REASON` line per failing GPU, e.g. `3 xid 79: GPU has fallen off
//! the bus`), so tests and demos can inject and clear faults at run time. A
//! failure is reported at once; a recovery only after the GPU has stayed healthy
//! for the hold-down period, so a flapping GPU does not bounce in and out of the
//! schedule.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use gangway_proto::v1::GpuHealthReport;

/// Bytes of a fault file read (a few lines per GPU; guards against a runaway file).
const FAULT_FILE_BYTES_MAX: u64 = 64 * 1024;

pub struct GpuHealthMonitor {
    fault_file: Option<PathBuf>,
    /// Real GPUs' checks, when the inventory came from NVML.
    nvml: Option<std::sync::Arc<crate::nvml::NvmlProvider>>,
    hold_down: Duration,
    /// Per GPU: the reported health, its reason, and since when it looks healthy.
    gpus: Vec<(bool, String, Option<Instant>)>,
}

impl GpuHealthMonitor {
    pub fn new(
        gpu_count: usize,
        fault_file: Option<PathBuf>,
        nvml: Option<std::sync::Arc<crate::nvml::NvmlProvider>>,
        hold_down: Duration,
    ) -> GpuHealthMonitor {
        GpuHealthMonitor { fault_file, nvml, hold_down, gpus: vec![(true, String::new(), None); gpu_count] }
    }

    fn faults(&self) -> BTreeMap<u32, String> {
        let mut faults = BTreeMap::new();
        if let Some(nvml) = &self.nvml {
            for i in 0..u32::try_from(self.gpus.len()).unwrap_or(u32::MAX) {
                if let Some(why) = nvml.fault(i) {
                    faults.insert(i, why);
                }
            }
        }
        let Some(path) = &self.fault_file else { return faults };
        let Ok(f) = std::fs::File::open(path) else { return faults };
        let mut text = String::new();
        use std::io::Read;
        let _ = f.take(FAULT_FILE_BYTES_MAX).read_to_string(&mut text);
        faults.extend(text.lines().filter_map(|l| {
            let l = l.trim();
            let (idx, reason) = l.split_once(char::is_whitespace).unwrap_or((l, "injected fault"));
            Some((idx.parse().ok()?, reason.trim().to_string()))
        }));
        faults
    }

    /// The health of every GPU now.
    pub fn poll(&mut self) -> Vec<GpuHealthReport> {
        let faults = self.faults();
        let now = Instant::now();
        let hold_down = self.hold_down;
        (0..=u32::MAX)
            .zip(self.gpus.iter_mut())
            .map(|(i, (healthy, reason, since))| {
                match faults.get(&i) {
                    Some(r) => {
                        *healthy = false;
                        *reason = r.clone();
                        *since = None;
                    }
                    None if !*healthy => {
                        let t = *since.get_or_insert(now);
                        if now.duration_since(t) >= hold_down {
                            *healthy = true;
                            reason.clear();
                            *since = None;
                        }
                    }
                    None => {}
                }
                GpuHealthReport { index: i, healthy: *healthy, reason: reason.clone() }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_report_at_once_and_recover_after_hold_down() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("faults");
        let mut m = GpuHealthMonitor::new(2, Some(file.clone()), None, Duration::from_millis(200));
        assert!(m.poll().iter().all(|g| g.healthy));
        std::fs::write(&file, "1 xid 79: fallen off the bus\n").unwrap();
        let r = m.poll();
        assert!(r[0].healthy && !r[1].healthy);
        assert_eq!(r[1].reason, "xid 79: fallen off the bus");
        std::fs::write(&file, "").unwrap();
        assert!(!m.poll()[1].healthy, "recovered before the hold-down");
        std::thread::sleep(Duration::from_millis(250));
        assert!(m.poll()[1].healthy);
    }

    /// A fault file is read up to FAULT_FILE_BYTES_MAX bytes: a fault line
    /// ending at the cap counts; one pushed a byte past it is not read.
    #[test]
    fn fault_files_are_read_up_to_their_cap() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("faults");
        let cap = FAULT_FILE_BYTES_MAX as usize;
        // Filler that is no fault line, then GPU 1's fault ending at byte `len`.
        let gpu1_healthy = |len: usize| {
            std::fs::write(&file, format!("{}\n1", "x".repeat(len - 2))).unwrap();
            GpuHealthMonitor::new(2, Some(file.clone()), None, Duration::from_secs(60)).poll()[1].healthy
        };
        assert!(!gpu1_healthy(cap), "a fault at the cap was not read");
        assert!(gpu1_healthy(cap + 1), "a byte past the cap was read");
    }
}
