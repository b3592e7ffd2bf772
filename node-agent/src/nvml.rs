//! Real GPUs through NVML, loaded at run time (`libnvidia-ml.so`): a host without
//! NVIDIA drivers simply has no NVML and reports no GPUs.
//!
//! Discovery: model, UUID, memory, and NVLink islands (GPUs joined by active
//! NVLink links, found by following each link to its peer's PCI bus id).
//! Health, polled every heartbeat: a lost device, uncorrectable ECC errors,
//! memory pages pending retirement, hardware slowdown (thermal, power brake),
//! and critical XID errors caught by a watcher thread on NVML's event set.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gangway_proto::v1::GpuInventory;
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

/// NVLink links per GPU that NVML can report (NVML_NVLINK_MAX_LINKS, 18 on
/// Hopper and Blackwell).
const NVLINK_LINKS_MAX: u32 = 18;
/// GPUs examined on one host (the core's per-node limit).
const GPUS_MAX: u32 = 16;
/// XIDs that mean a GPU needs attention (NVIDIA's XID catalog): 48 double-bit
/// ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 high
/// single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors.
const CRITICAL_XIDS: &[u64] = &[48, 63, 64, 74, 79, 92, 94, 95, 119, 120];
/// A critical XID keeps its GPU quarantined this long (then the hold-down runs).
const XID_FAULT_HOLD: Duration = Duration::from_secs(600);
/// One wait on the event set: also how soon the watcher notices the agent stopped.
const XID_WAIT_MS: u32 = 1000;

/// One GPU's readings (NaN where NVML cannot tell).
#[derive(Debug, Clone, Copy)]
pub struct Readings {
    pub utilization: f64,
    pub memory_used_bytes: f64,
    pub temperature_celsius: f64,
    pub power_watts: f64,
}

pub struct NvmlProvider {
    nvml: Nvml,
    count: u32,
    /// The last critical XID seen per GPU index, and when.
    xids: Mutex<BTreeMap<u32, (Instant, u64)>>,
}

impl std::fmt::Debug for NvmlProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NvmlProvider({} GPUs)", self.count)
    }
}

/// `NVIDIA H200` with 141 GB → `h200-141gb`: lower-case, vendor dropped, memory appended.
pub fn model_name(name: &str, mem_mb: u64) -> String {
    let base = name.trim().to_ascii_lowercase();
    let base = base.strip_prefix("nvidia").unwrap_or(&base).trim();
    let mut slug: String = base.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '-' }).collect();
    while slug.contains("--") {
        slug = slug.replace("--", "-");
    }
    let slug = slug.trim_matches('-');
    // Rounded to the nearest GiB, halves up.
    let gb = mem_mb.saturating_add(512) / 1024;
    let names_memory = slug
        .rsplit('-')
        .next()
        .and_then(|last| last.strip_suffix("gb"))
        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
    if slug.is_empty() {
        format!("gpu-{gb}gb")
    } else if names_memory {
        slug.to_string()
    } else {
        format!("{slug}-{gb}gb")
    }
}

/// The GPUs examined of the `device_count` NVML reports: [`GPUS_MAX`] at most.
fn gpus_examined(device_count: u32) -> u32 {
    device_count.min(GPUS_MAX)
}

impl NvmlProvider {
    /// Loads NVML and lists the GPUs; `Err` says why there are none.
    pub fn probe() -> Result<(NvmlProvider, Vec<GpuInventory>), String> {
        let nvml = Nvml::init().map_err(|e| format!("NVML is not available ({e}); reporting no GPUs"))?;
        let count = gpus_examined(nvml.device_count().map_err(|e| format!("NVML device count: {e}"))?);
        let mut gpus = Vec::new();
        let mut bus_ids = BTreeMap::new();
        let mut links: Vec<(u32, String)> = Vec::new();
        for i in 0..count {
            let dev = nvml.device_by_index(i).map_err(|e| format!("NVML device {i}: {e}"))?;
            let mem_mb = dev.memory_info().map(|m| m.total / (1024 * 1024)).unwrap_or(0);
            let name = dev.name().unwrap_or_else(|_| "gpu".into());
            if let Ok(pci) = dev.pci_info() {
                bus_ids.insert(pci.bus_id.to_ascii_lowercase(), i);
            }
            for l in 0..NVLINK_LINKS_MAX {
                let link = dev.link_wrapper_for(l);
                if link.is_active().unwrap_or(false) {
                    if let Ok(remote) = link.remote_pci_info() {
                        links.push((i, remote.bus_id.to_ascii_lowercase()));
                    }
                }
            }
            gpus.push(GpuInventory {
                uuid: dev.uuid().unwrap_or_else(|_| format!("GPU-unknown-{i}")),
                model: model_name(&name, mem_mb),
                mem_mb,
                nvlink_island: i,
            });
        }
        // Union GPUs joined by an active link; links to NVSwitches (whose bus ids
        // are not GPUs) join every GPU on the same switch fabric.
        let mut parent: Vec<u32> = (0..count).collect();
        fn find(p: &mut [u32], x: u32) -> u32 {
            let mut r = x;
            while p[r as usize] != r {
                r = p[r as usize];
            }
            p[x as usize] = r;
            r
        }
        let mut switch_members: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (a, remote) in &links {
            match bus_ids.get(remote) {
                Some(&b) => {
                    let (ra, rb) = (find(&mut parent, *a), find(&mut parent, b));
                    parent[ra.max(rb) as usize] = ra.min(rb);
                }
                None => switch_members.entry(remote.clone()).or_default().push(*a),
            }
        }
        for members in switch_members.values() {
            for w in members.windows(2) {
                let (ra, rb) = (find(&mut parent, w[0]), find(&mut parent, w[1]));
                parent[ra.max(rb) as usize] = ra.min(rb);
            }
        }
        let mut island_of_root = BTreeMap::new();
        for i in 0..count {
            let root = find(&mut parent, i);
            let next = u32::try_from(island_of_root.len()).unwrap_or(u32::MAX);
            gpus[i as usize].nvlink_island = *island_of_root.entry(root).or_insert(next);
        }
        Ok((NvmlProvider { nvml, count, xids: Mutex::new(BTreeMap::new()) }, gpus))
    }

    /// Watches NVML's event set for critical XID errors on a thread of its own
    /// (NVML's wait blocks); ends when the agent drops its last handle.
    pub fn start_xid_watch(self: &Arc<Self>) {
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("gangway-xid-watch".into()).spawn(move || {
            use nvml_wrapper::bitmasks::event::EventTypes;
            use nvml_wrapper::enums::event::XidError;
            let Ok(mut set) = me.nvml.create_event_set() else { return };
            for i in 0..me.count {
                let Ok(dev) = me.nvml.device_by_index(i) else { return };
                set = match dev.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(gpu = i, error = %e.error, "XID events unavailable; other health checks continue");
                        return;
                    }
                };
            }
            while Arc::strong_count(&me) > 1 {
                match set.wait(XID_WAIT_MS) {
                    Ok(ev) => {
                        if let (Some(XidError::Value(xid)), Ok(idx)) = (ev.event_data, ev.device.index()) {
                            if CRITICAL_XIDS.contains(&xid) {
                                tracing::warn!(gpu = idx, xid, "critical XID error");
                                me.xids.lock().expect("xid lock").insert(idx, (Instant::now(), xid));
                            }
                        }
                    }
                    Err(NvmlError::Timeout) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "waiting for XID events failed");
                        std::thread::sleep(Duration::from_millis(u64::from(XID_WAIT_MS)));
                    }
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the XID watcher");
        }
    }

    /// GPU `index`'s utilization, memory, temperature and power now, for metrics.
    pub fn readings(&self, index: u32) -> Option<Readings> {
        if index >= self.count {
            return None;
        }
        let dev = self.nvml.device_by_index(index).ok()?;
        Some(Readings {
            utilization: dev.utilization_rates().map_or(f64::NAN, |u| f64::from(u.gpu) / 100.0),
            memory_used_bytes: dev.memory_info().map_or(f64::NAN, |m| m.used as f64),
            temperature_celsius: dev
                .temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
                .map_or(f64::NAN, f64::from),
            power_watts: dev.power_usage().map_or(f64::NAN, |mw| f64::from(mw) / 1000.0),
        })
    }

    /// What is wrong with GPU `index` now, if anything.
    pub fn fault(&self, index: u32) -> Option<String> {
        if index >= self.count {
            return None;
        }
        let dev = match self.nvml.device_by_index(index) {
            Ok(d) => d,
            Err(NvmlError::GpuLost) => return Some("GPU lost: it fell off the bus".into()),
            Err(e) => return Some(format!("NVML cannot reach the GPU: {e}")),
        };
        if let Some((seen, xid)) = self.xids.lock().expect("xid lock").get(&index) {
            if seen.elapsed() < XID_FAULT_HOLD {
                return Some(format!("XID {xid} error"));
            }
        }
        if dev.are_pages_pending_retired().unwrap_or(false) {
            return Some("memory pages pending retirement: the GPU needs a reset".into());
        }
        match dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
            Ok(n) if n > 0 => return Some(format!("{n} uncorrectable ECC errors")),
            Err(NvmlError::GpuLost) => return Some("GPU lost: it fell off the bus".into()),
            _ => {}
        }
        if let Ok(reasons) = dev.current_throttle_reasons() {
            let bad = ThrottleReasons::HW_SLOWDOWN
                | ThrottleReasons::HW_THERMAL_SLOWDOWN
                | ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN;
            if reasons.intersects(bad) {
                return Some(format!("hardware slowdown: {:?}", reasons & bad));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inventory asks NVML about each link it can report, and none
    /// past them (NVML refuses a link index of NVML_NVLINK_MAX_LINKS).
    #[test]
    fn the_nvlink_scan_covers_the_links_nvml_reports() {
        assert_eq!(NVLINK_LINKS_MAX, nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS);
    }

    #[test]
    fn model_names_are_scheduler_friendly() {
        assert_eq!(model_name("NVIDIA H200", 143_771), "h200-140gb");
        assert_eq!(model_name("NVIDIA A100-SXM4-80GB", 81_920), "a100-sxm4-80gb");
        assert_eq!(model_name("", 1024), "gpu-1gb");
        // Rounded to the nearest GiB, halves up.
        assert_eq!(model_name("", 1535), "gpu-1gb");
        assert_eq!(model_name("", 1536), "gpu-2gb");
        crate::inventory::parse_fake_gpus("1xh200-140gb", "n").unwrap();
    }

    #[test]
    fn probing_lists_real_gpus_or_says_why_there_are_none() {
        match NvmlProvider::probe() {
            Ok((provider, gpus)) => {
                for (i, g) in gpus.iter().enumerate() {
                    assert!(!g.uuid.is_empty() && g.mem_mb > 0, "{g:?}");
                    crate::inventory::parse_fake_gpus(&format!("1x{}", g.model), "n").expect("model name is valid");
                    let _ = provider.fault(i as u32);
                }
            }
            // A host without NVIDIA drivers (CI): a clear reason, no panic.
            Err(why) => assert!(why.contains("NVML"), "{why}"),
        }
    }

    /// A host with GPUS_MAX GPUs has all of them examined; one with more,
    /// only the first GPUS_MAX.
    #[test]
    fn at_most_gpus_max_gpus_are_examined() {
        assert_eq!(gpus_examined(GPUS_MAX - 1), GPUS_MAX - 1);
        assert_eq!(gpus_examined(GPUS_MAX), GPUS_MAX);
        assert_eq!(gpus_examined(GPUS_MAX + 1), GPUS_MAX);
    }
}
