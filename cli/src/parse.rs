//! Parsing of the Slurm-style values users type: time limits, memory sizes, GPU
//! requests. Errors name the option and show a valid example.

/// Slurm's `--time` formats: `MINUTES`, `MINUTES:SECONDS`, `HOURS:MINUTES:SECONDS`,
/// `DAYS-HOURS`, `DAYS-HOURS:MINUTES`, `DAYS-HOURS:MINUTES:SECONDS`.
pub fn time_limit_s(s: &str) -> Result<u64, String> {
    let bad = || format!("--time: '{s}' is not a time limit (examples: 30, 1:30:00, 2-00:00:00)");
    let num = |p: &str| p.trim().parse::<u64>().map_err(|_| bad());
    let (days, rest) = match s.split_once('-') {
        Some((d, r)) => (num(d)?, r),
        None => (0, s),
    };
    let parts: Vec<&str> = rest.split(':').collect();
    let secs = match (s.contains('-'), parts.as_slice()) {
        (false, [m]) => num(m)? * 60,
        (false, [m, sec]) => num(m)? * 60 + num(sec)?,
        (false, [h, m, sec]) => num(h)? * 3600 + num(m)? * 60 + num(sec)?,
        (true, [h]) => num(h)? * 3600,
        (true, [h, m]) => num(h)? * 3600 + num(m)? * 60,
        (true, [h, m, sec]) => num(h)? * 3600 + num(m)? * 60 + num(sec)?,
        _ => return Err(bad()),
    };
    Ok(days * 86400 + secs)
}

/// Memory sizes: a number of MiB, or with a K/M/G/T suffix (`512M`, `64G`).
pub fn mem_mb(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || format!("--mem: '{s}' is not a memory size (examples: 4096, 512M, 64G)");
    let (digits, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 0),
        Some('M' | 'm') => (&t[..t.len() - 1], 1),
        Some('G' | 'g') => (&t[..t.len() - 1], 1024),
        Some('T' | 't') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    Ok(if mult == 0 { n.div_ceil(1024) } else { n * mult })
}

/// GPU requests: `N` or `TYPE:N` (`8`, `h100:8`).
pub fn gpus(s: &str) -> Result<(String, i64), String> {
    let bad = || format!("--gpus-per-node: '{s}' must be COUNT or TYPE:COUNT, e.g. 8 or h100:8");
    match s.rsplit_once(':') {
        Some((ty, n)) => Ok((ty.to_string(), n.parse().map_err(|_| bad())?)),
        None => Ok((String::new(), s.parse().map_err(|_| bad())?)),
    }
}

/// Slurm's `--signal=[B:]SIG[@SECONDS]`: a signal name (`USR1`, `SIGTERM`) or
/// number, sent SECONDS (default 60) before the time limit.
pub fn warn_signal(s: &str) -> Result<(u32, u32), String> {
    let bad = |why: &str| format!("--signal: '{s}' {why} (example: USR1@120)");
    let spec = s.strip_prefix("B:").or_else(|| s.strip_prefix("R:")).unwrap_or(s);
    let (sig, secs) = match spec.split_once('@') {
        Some((sig, secs)) => (sig, secs.parse::<u32>().map_err(|_| bad("has a bad number of seconds"))?),
        None => (spec, 60),
    };
    let num = match sig.parse::<u32>() {
        Ok(n) => n,
        Err(_) => {
            let name = if sig.starts_with("SIG") { sig.to_string() } else { format!("SIG{sig}") };
            name.parse::<nix::sys::signal::Signal>().map_err(|_| bad("names no signal"))? as u32
        }
    };
    if num == 0 || num > 31 {
        return Err(bad("names no signal"));
    }
    Ok((num, secs))
}

/// Formats seconds the way squeue does: `D-HH:MM:SS` or `H:MM:SS` or `M:SS`.
pub fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_time_formats() {
        assert_eq!(time_limit_s("30").unwrap(), 1800);
        assert_eq!(time_limit_s("1:30").unwrap(), 90);
        assert_eq!(time_limit_s("1:00:00").unwrap(), 3600);
        assert_eq!(time_limit_s("2-00").unwrap(), 2 * 86400);
        assert_eq!(time_limit_s("1-02:03").unwrap(), 86400 + 7200 + 180);
        assert_eq!(time_limit_s("1-00:00:05").unwrap(), 86405);
        assert!(time_limit_s("abc").is_err());
        assert!(time_limit_s("1:2:3:4").is_err());
    }

    #[test]
    fn memory_and_gpus() {
        assert_eq!(mem_mb("512M").unwrap(), 512);
        assert_eq!(mem_mb("64G").unwrap(), 65536);
        assert_eq!(mem_mb("100").unwrap(), 100);
        assert!(mem_mb("lots").is_err());
        assert_eq!(gpus("h100:8").unwrap(), ("h100".into(), 8));
        assert_eq!(gpus("4").unwrap(), (String::new(), 4));
        assert!(gpus("h100:x").is_err());
        assert_eq!(duration(3725), "1:02:05");
        assert_eq!(warn_signal("USR1@120").unwrap(), (10, 120));
        assert_eq!(warn_signal("B:SIGTERM").unwrap(), (15, 60));
        assert_eq!(warn_signal("12@5").unwrap(), (12, 5));
        assert!(warn_signal("NOPE@5").is_err());
    }
}
