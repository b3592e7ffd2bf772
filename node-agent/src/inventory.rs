//! What a node has: CPUs and memory from the OS, GPUs from a simulated inventory
//! (`--fake-gpus 8xh100-80gb`). NVML discovery is part of the agent issue; a
//! host without it reports no GPUs.

use gangway_proto::v1::GpuInventory;

/// GPUs one fake inventory may declare (the core's per-node limit).
const FAKE_GPUS_MAX: u32 = 16;
/// GPUs per simulated NVLink island (an HGX board joins 8 with NVSwitch).
const FAKE_NVLINK_ISLAND_SIZE: u32 = 8;

/// Parses `COUNTxMODEL`, e.g. `8xh100-80gb`; memory comes from a `-NNgb` suffix.
pub fn parse_fake_gpus(spec: &str, node: &str) -> Result<Vec<GpuInventory>, String> {
    let (count, model) = spec
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("fake-gpus: '{spec}' must look like COUNTxMODEL, e.g. 8xh100-80gb"))?;
    let count: u32 = count.trim().parse().map_err(|_| format!("fake-gpus: '{count}' is not a GPU count"))?;
    if count == 0 || count > FAKE_GPUS_MAX {
        return Err(format!("fake-gpus: count must be between 1 and {FAKE_GPUS_MAX}, got {count}"));
    }
    let model = model.trim().to_ascii_lowercase();
    if model.is_empty() || !model.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
        return Err(format!("fake-gpus: '{model}' is not a GPU model name (letters, digits, '-', '_', '.')"));
    }
    let mem_mb = model
        .rsplit('-')
        .next()
        .and_then(|s| s.strip_suffix("gb"))
        .and_then(|n| n.parse::<u64>().ok())
        .map(|gb| gb * 1024)
        .unwrap_or(0);
    Ok((0..count)
        .map(|i| GpuInventory {
            uuid: format!("GPU-fake-{node}-{i}"),
            model: model.clone(),
            mem_mb,
            nvlink_island: i / FAKE_NVLINK_ISLAND_SIZE,
        })
        .collect())
}

/// CPUs this host offers.
pub fn host_cpus() -> u32 {
    std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1)
}

/// Memory of this host in MiB, from /proc/meminfo (Linux); 1 MiB if unknown so
/// registration still works.
pub fn host_mem_mb() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| (kb / 1024).max(1))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_gpus_parse() {
        let g = parse_fake_gpus("8xH100-80GB", "n1").unwrap();
        assert_eq!(g.len(), 8);
        assert_eq!((g[0].model.as_str(), g[0].mem_mb), ("h100-80gb", 80 * 1024));
        assert!(parse_fake_gpus("0xh100", "n").is_err());
        assert!(parse_fake_gpus("h100", "n").is_err());
        assert!(parse_fake_gpus("17xh100", "n").is_err());
    }
}
