//! What a node has: CPUs and memory from the OS, GPUs from a simulated inventory
//! (`--fake-gpus 8xh100-80gb`). NVML discovery is part of the agent issue; a
//! host without it reports no GPUs.

use gangway_proto::v1::GpuInventory;

/// GPUs one fake inventory may declare (the core's per-node limit).
const FAKE_GPUS_MAX: u32 = 16;
/// Bytes of a GPU inventory file: sixteen lines and their comments fit many
/// times over; a larger file (a wrong path, a log) is refused, not read.
const INVENTORY_FILE_BYTES_MAX: u64 = 64 * 1024;
/// GPUs per simulated NVLink island (an HGX board joins 8 with NVSwitch).
const FAKE_NVLINK_ISLAND_SIZE: u32 = 8;

/// Parses `COUNTxMODEL[/ISLAND]`, e.g. `8xh100-80gb` (one NVLink island of 8)
/// or `8xa100-40gb/4` (two islands of 4); memory comes from a `-NNgb` suffix.
pub fn parse_fake_gpus(spec: &str, node: &str) -> Result<Vec<GpuInventory>, String> {
    let (spec, island) = match spec.split_once('/') {
        Some((s, n)) => {
            let n: u32 = n.trim().parse().map_err(|_| format!("fake-gpus: island size '{n}' is not a number"))?;
            if n == 0 {
                return Err("fake-gpus: island size must be at least 1".into());
            }
            (s, n)
        }
        None => (spec, FAKE_NVLINK_ISLAND_SIZE),
    };
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
        .and_then(|gb| gb.checked_mul(1024))
        .unwrap_or(0);
    Ok((0..count)
        .map(|i| GpuInventory {
            uuid: format!("GPU-fake-{node}-{i}"),
            model: model.clone(),
            mem_mb,
            nvlink_island: i.checked_div(island).unwrap_or(0),
        })
        .collect())
}

/// Reads a simulated inventory file: one GPU per line, `MODEL ISLAND [MEM_MB]`
/// (`#` starts a comment), so tests can describe any NVLink topology:
///
/// ```text
/// h100-80gb 0
/// h100-80gb 0
/// h100-80gb 1   # a second island
/// ```
pub fn read_inventory_file(path: &std::path::Path, node: &str) -> Result<Vec<GpuInventory>, String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(INVENTORY_FILE_BYTES_MAX + 1).read_to_string(&mut text))
        .map_err(|e| format!("gpu-inventory: cannot read {}: {e}", path.display()))?;
    if text.len() as u64 > INVENTORY_FILE_BYTES_MAX {
        return Err(format!("gpu-inventory: {} is larger than {INVENTORY_FILE_BYTES_MAX} bytes", path.display()));
    }
    let mut gpus = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad =
            |why: &str| format!("gpu-inventory line {}: {why} (expected MODEL ISLAND [MEM_MB])", n.saturating_add(1));
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 2 || f.len() > 3 {
            return Err(bad("wrong number of fields"));
        }
        let template = parse_fake_gpus(&format!("1x{}", f[0]), node).map_err(|e| bad(&e))?;
        let island = f[1].parse().map_err(|_| bad("ISLAND is not a number"))?;
        let mem_mb = match f.get(2) {
            Some(m) => m.parse().map_err(|_| bad("MEM_MB is not a number"))?,
            None => template[0].mem_mb,
        };
        if gpus.len() >= FAKE_GPUS_MAX as usize {
            return Err(bad(&format!("more than {FAKE_GPUS_MAX} GPUs")));
        }
        gpus.push(GpuInventory {
            uuid: format!("GPU-fake-{node}-{}", gpus.len()),
            model: template[0].model.clone(),
            mem_mb,
            nvlink_island: island,
        });
    }
    Ok(gpus)
}

/// CPUs this host offers.
pub fn host_cpus() -> u32 {
    std::thread::available_parallelism().map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX)).unwrap_or(1)
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
        let two = parse_fake_gpus("8xa100-40gb/4", "n").unwrap();
        assert_eq!(two.iter().map(|g| g.nvlink_island).collect::<Vec<_>>(), vec![0, 0, 0, 0, 1, 1, 1, 1]);
    }

    #[test]
    fn inventory_files_describe_islands_and_refuse_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("inv");
        std::fs::write(&p, "# two islands\nh100-80gb 0\nh100-80gb 0\nl4 1 24576\n").unwrap();
        let g = read_inventory_file(&p, "n").unwrap();
        assert_eq!(
            g.iter().map(|g| (g.nvlink_island, g.mem_mb)).collect::<Vec<_>>(),
            vec![(0, 81920), (0, 81920), (1, 24576)]
        );
        std::fs::write(&p, "h100 zero\n").unwrap();
        let err = read_inventory_file(&p, "n").unwrap_err();
        assert!(err.contains("line 1") && err.contains("ISLAND"), "{err}");
    }

    /// FAKE_GPUS_MAX GPUs may be declared, by count or in an inventory file;
    /// one more is refused with the limit named.
    #[test]
    fn fake_inventories_hold_at_most_fake_gpus_max() {
        assert_eq!(parse_fake_gpus(&format!("{FAKE_GPUS_MAX}xh100"), "n").unwrap().len(), FAKE_GPUS_MAX as usize);
        let err = parse_fake_gpus(&format!("{}xh100", FAKE_GPUS_MAX + 1), "n").unwrap_err();
        assert!(err.contains(&format!("between 1 and {FAKE_GPUS_MAX}")), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("inv");
        std::fs::write(&p, "h100 0\n".repeat(FAKE_GPUS_MAX as usize)).unwrap();
        assert_eq!(read_inventory_file(&p, "n").unwrap().len(), FAKE_GPUS_MAX as usize);
        std::fs::write(&p, "h100 0\n".repeat(FAKE_GPUS_MAX as usize + 1)).unwrap();
        let err = read_inventory_file(&p, "n").unwrap_err();
        assert!(err.contains(&format!("more than {FAKE_GPUS_MAX} GPUs")), "{err}");
    }

    /// An inventory file of INVENTORY_FILE_BYTES_MAX bytes (comments pad it)
    /// is read; one byte more is refused, naming the limit.
    #[test]
    fn inventory_files_are_read_up_to_their_byte_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("inv");
        let at = |bytes: u64| {
            let line = "h100 0\n#";
            format!("{line}{}", "x".repeat(bytes as usize - line.len()))
        };
        std::fs::write(&p, at(INVENTORY_FILE_BYTES_MAX)).unwrap();
        assert_eq!(read_inventory_file(&p, "n").unwrap().len(), 1);
        std::fs::write(&p, at(INVENTORY_FILE_BYTES_MAX + 1)).unwrap();
        let err = read_inventory_file(&p, "n").unwrap_err();
        assert!(err.contains(&format!("larger than {INVENTORY_FILE_BYTES_MAX} bytes")), "{err}");
    }
}
