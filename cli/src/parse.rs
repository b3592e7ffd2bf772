//! Parsing of the Slurm-style values users type: time limits, memory sizes, GPU
//! requests. Errors name the option and show a valid example.
//!
//! Whatever a user types must end in a value or an error, never a panic: the
//! arithmetic here is checked (and the fuzz target `text_parsers` tries it).
#![deny(clippy::arithmetic_side_effects)]

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
    // (hours, minutes, seconds)
    let (h, m, sec) = match (s.contains('-'), parts.as_slice()) {
        (false, [m]) => (0, num(m)?, 0),
        (false, [m, sec]) => (0, num(m)?, num(sec)?),
        (false, [h, m, sec]) | (true, [h, m, sec]) => (num(h)?, num(m)?, num(sec)?),
        (true, [h]) => (num(h)?, 0, 0),
        (true, [h, m]) => (num(h)?, num(m)?, 0),
        _ => return Err(bad()),
    };
    // Checked: a number this large is a typo, not a time limit.
    [(days, 86_400), (h, 3_600), (m, 60), (sec, 1)]
        .into_iter()
        .try_fold(0u64, |total, (n, unit)| n.checked_mul(unit).and_then(|v| total.checked_add(v)))
        .ok_or_else(bad)
}

/// Slurm's `--begin` times, in local time: `now`, `now+N[seconds|minutes|hours|days|weeks]`
/// (bare N: seconds), `HH:MM[:SS]` (today, or tomorrow once past),
/// `YYYY-MM-DD[THH:MM[:SS]]`, `midnight`, `noon`, `teatime` (16:00), `tomorrow`.
pub fn begin_ms(s: &str, now_ms: u64) -> Result<u64, String> {
    begin_ms_in(s, now_ms, &local_offset_s)
}

/// The local time zone's offset from UTC, in seconds east, at `utc_ms`
/// (`TZ`, else `/etc/localtime`): Slurm's commands read and print times in
/// local time.
pub fn local_offset_s(utc_ms: i64) -> i64 {
    use chrono::{Offset, TimeZone};
    chrono::Local.timestamp_millis_opt(utc_ms).single().map_or(0, |t| i64::from(t.offset().fix().local_minus_utc()))
}

/// A local wall-clock time (ms since the epoch, counted as if local time
/// were UTC) as UTC ms, with `offset_s` the zone's offset at an instant.
/// Near a daylight-saving change both offsets are tried: a time that exists
/// twice (clocks back) is its first instant; one that does not exist
/// (clocks forward) moves forward, as Slurm moves it.
pub fn local_to_utc(local_ms: i64, offset_s: &dyn Fn(i64) -> i64) -> i64 {
    let at = |off: i64| local_ms.saturating_sub(off.saturating_mul(1000));
    let first = at(offset_s(local_ms));
    let second = at(offset_s(first));
    let round_trips = |utc: i64| utc.saturating_add(offset_s(utc).saturating_mul(1000)) == local_ms;
    match (round_trips(first), round_trips(second)) {
        (true, true) => first.min(second),
        (true, false) => first,
        (false, true) => second,
        // In the gap: the later reading, an hour on.
        (false, false) => first.max(second),
    }
}

/// [`begin_ms`] in the zone `offset_s` describes.
fn begin_ms_in(s: &str, now_ms: u64, offset_s: &dyn Fn(i64) -> i64) -> Result<u64, String> {
    let bad =
        || format!("--begin: '{s}' is not a time (examples: now+1hour, 16:00, 2026-12-24T08:00, midnight, tomorrow)");
    let t = s.trim().to_ascii_lowercase();
    let day_ms: i64 = 86_400_000;
    let now = i64::try_from(now_ms).map_err(|_| bad())?;
    // Local midnight today, on the local clock.
    let local_now = now.saturating_add(offset_s(now).saturating_mul(1000));
    let today = local_now.saturating_sub(local_now.rem_euclid(day_ms));
    let utc = |local: i64| u64::try_from(local_to_utc(local, offset_s)).unwrap_or(0);
    let next_at = |secs_of_day: i64| {
        let at = utc(today.saturating_add(secs_of_day.saturating_mul(1000)));
        if at <= now_ms {
            utc(today.saturating_add(day_ms).saturating_add(secs_of_day.saturating_mul(1000)))
        } else {
            at
        }
    };
    match t.as_str() {
        "now" => return Ok(now_ms),
        "midnight" | "tomorrow" => return Ok(utc(today.saturating_add(day_ms))),
        "noon" => return Ok(next_at(12 * 3600)),
        "teatime" => return Ok(next_at(16 * 3600)),
        _ => {}
    }
    if let Some(rest) = t.strip_prefix("now+") {
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let n: u64 = digits.parse().map_err(|_| bad())?;
        let unit: u64 = match &rest[digits.len()..] {
            "" | "s" | "sec" | "secs" | "second" | "seconds" => 1,
            "m" | "min" | "mins" | "minute" | "minutes" => 60,
            "h" | "hour" | "hours" => 3600,
            "d" | "day" | "days" => 86_400,
            "w" | "week" | "weeks" => 7 * 86_400,
            _ => return Err(bad()),
        };
        return n
            .checked_mul(unit)
            .and_then(|n| n.checked_mul(1000))
            .and_then(|d| now_ms.checked_add(d))
            .ok_or_else(bad);
    }
    if !t.contains('-') {
        let parts: Vec<i64> = t.split(':').map(|p| p.parse().map_err(|_| bad())).collect::<Result<_, _>>()?;
        return match parts.as_slice() {
            // Bounded by the guards: no overflow.
            #[allow(clippy::arithmetic_side_effects)]
            [h, m] if (0..24).contains(h) && (0..60).contains(m) => Ok(next_at(h * 3600 + m * 60)),
            #[allow(clippy::arithmetic_side_effects)]
            [h, m, sec] if (0..24).contains(h) && (0..60).contains(m) && (0..60).contains(sec) => {
                Ok(next_at(h * 3600 + m * 60 + sec))
            }
            _ => Err(bad()),
        };
    }
    parse_time_in("--begin", &t.replace('t', "T"), now_ms, offset_s).map_err(|_| bad())
}

/// Slurm's `--licenses`: `NAME[:COUNT]` or `NAME[*COUNT]`, joined with `,`
/// (COUNT defaults to 1; a name given twice adds up). Slurm's `|` (any one
/// of) is refused.
pub fn licenses(s: &str) -> Result<std::collections::HashMap<String, u32>, String> {
    let mut out: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    if s.contains('|') {
        return Err(format!("--licenses: '{s}': '|' (any one of) is not supported; list the licenses with ','"));
    }
    for item in s.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(format!("--licenses: '{s}' has an empty entry (NAME[:COUNT],...)"));
        }
        let (name, count) = match item.split_once([':', '*']) {
            Some((n, c)) => (
                n,
                c.parse::<u32>()
                    .ok()
                    .filter(|c| *c > 0)
                    .ok_or_else(|| format!("--licenses: '{item}': the count must be a whole number of at least 1"))?,
            ),
            None => (item, 1),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
            return Err(format!("--licenses: '{item}': a license name is letters, digits, '-', '_' or '.'"));
        }
        let e = out.entry(name.to_string()).or_default();
        *e = e.checked_add(count).ok_or_else(|| format!("--licenses: '{s}': too many of {name}"))?;
    }
    Ok(out)
}

/// Memory sizes: a number of MiB, or with a K/M/G/T suffix (`512M`, `64G`).
pub fn mem_mb(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || format!("--mem: '{s}' is not a memory size (examples: 4096, 512M, 64G)");
    let (digits, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        // The suffixes are ASCII: cutting one byte stays on a character boundary.
        Some(c @ ('K' | 'M' | 'G' | 'T')) => (
            &t[..t.len().saturating_sub(1)],
            [('K', 0), ('M', 1), ('G', 1024)].iter().find(|(k, _)| *k == c).map_or(1024 * 1024, |(_, m)| *m),
        ),
        _ => (t, 1),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    if mult == 0 {
        return Ok(n.div_ceil(1024));
    }
    n.checked_mul(mult).ok_or_else(bad)
}

/// GPU requests: `N` or `TYPE:N` (`8`, `h100:8`).
pub fn gpus(s: &str) -> Result<(String, i64), String> {
    let bad = || format!("--gpus-per-node: '{s}' must be COUNT or TYPE:COUNT, e.g. 8 or h100:8");
    match s.rsplit_once(':') {
        Some((ty, n)) => Ok((ty.to_string(), n.parse().map_err(|_| bad())?)),
        None => Ok((String::new(), s.parse().map_err(|_| bad())?)),
    }
}

/// `-N`: `N` or `MIN-MAX`. Returns (min, max), max 0 when not a range.
pub fn node_range(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("--nodes: '{s}' must be N or MIN-MAX with N >= 1, e.g. 4 or 2-8");
    let num =
        |p: &str| p.trim().parse::<u32>().map_err(|_| bad()).and_then(|n| if n == 0 { Err(bad()) } else { Ok(n) });
    match s.split_once('-') {
        Some((lo, hi)) => {
            let (lo, hi) = (num(lo)?, num(hi)?);
            if hi < lo {
                return Err(format!("--nodes: '{s}': the maximum is below the minimum"));
            }
            Ok((lo, if hi == lo { 0 } else { hi }))
        }
        None => Ok((num(s)?, 0)),
    }
}

/// Turns the GPU options (`--gpus-per-node`, `--gpus`, `--gpus-per-task`,
/// `--gres gpu[:TYPE]:N`) into (type, GPUs per node); at most one may be given.
pub fn gpu_request(
    per_node: Option<&str>,
    total: Option<&str>,
    per_task: Option<&str>,
    gres: Option<&str>,
    nodes: i64,
    tasks_per_node: i64,
) -> Result<(String, Option<i64>), String> {
    let given =
        [per_node.is_some(), total.is_some(), per_task.is_some(), gres.is_some()].iter().filter(|g| **g).count();
    if given > 1 {
        return Err("gpus: give only one of --gpus-per-node, --gpus, --gpus-per-task and --gres".into());
    }
    if let Some(g) = per_node {
        let (t, n) = gpus(g)?;
        return Ok((t, Some(n)));
    }
    if let Some(g) = total {
        let (t, n) = gpus(g).map_err(|e| e.replace("--gpus-per-node", "--gpus"))?;
        if nodes <= 0 || n.checked_rem(nodes) != Some(0) {
            return Err(format!("--gpus: {n} GPUs do not spread evenly over {nodes} nodes; use --gpus-per-node"));
        }
        return Ok((t, n.checked_div(nodes)));
    }
    if let Some(g) = per_task {
        let (t, n) = gpus(g).map_err(|e| e.replace("--gpus-per-node", "--gpus-per-task"))?;
        let per_node = n.checked_mul(tasks_per_node).ok_or_else(|| format!("--gpus-per-task: {n} is too many"))?;
        return Ok((t, Some(per_node)));
    }
    if let Some(g) = gres {
        let bad = || format!("--gres: '{g}' must be gpu:COUNT or gpu:TYPE:COUNT");
        let rest = g.strip_prefix("gpu:").ok_or_else(bad)?;
        let (t, n) = gpus(rest).map_err(|_| bad())?;
        return Ok((t, Some(n)));
    }
    Ok((String::new(), None))
}

/// `--topology LEVEL[:required|:preferred[@WAIT]]` (default required).
pub fn topology(s: &str) -> Result<gangway_proto::v1::TopologyConstraint, String> {
    let (level, mode) = s.split_once(':').unwrap_or((s, "required"));
    if level.is_empty() {
        return Err(format!("--topology: '{s}' names no level (e.g. rack:required or block:preferred@10:00)"));
    }
    let (required, wait_s) = match mode.split_once('@') {
        Some(("preferred", w)) => (false, time_limit_s(w).map_err(|e| e.replace("--time", "--topology wait"))?),
        None if mode == "preferred" => (false, 0),
        None if mode == "required" => (true, 0),
        _ => return Err(format!("--topology: '{s}': mode must be required or preferred[@WAIT]")),
    };
    Ok(gangway_proto::v1::TopologyConstraint { level: level.to_string(), required, wait_s })
}

/// Slurm's `--switches=COUNT[@WAIT]`; only a count of 1 is supported. Returns
/// (required, wait seconds).
pub fn switches(s: &str) -> Result<(bool, u64), String> {
    let (count, wait) = match s.split_once('@') {
        Some((c, w)) => (c, Some(time_limit_s(w).map_err(|e| e.replace("--time", "--switches wait"))?)),
        None => (s, None),
    };
    if count.trim() != "1" {
        return Err(format!("--switches: '{s}': only 1 (one leaf domain) is supported"));
    }
    Ok(match wait {
        Some(w) => (false, w),
        None => (true, 0),
    })
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

/// Epoch ms for sacct's time options: `YYYY-MM-DD[THH:MM[:SS]]` (local time), `now`,
/// `now-N{seconds,minutes,hours,days}`.
pub fn parse_time(option: &str, s: &str, now: u64) -> Result<u64, String> {
    parse_time_in(option, s, now, &local_offset_s)
}

/// [`parse_time`] in the zone `offset_s` describes.
fn parse_time_in(option: &str, s: &str, now: u64, offset_s: &dyn Fn(i64) -> i64) -> Result<u64, String> {
    let bad = || format!("{option}: '{s}' is not a time (YYYY-MM-DD[THH:MM[:SS]], now, now-2hours)");
    if let Some(rest) = s.strip_prefix("now") {
        if rest.is_empty() {
            return Ok(now);
        }
        let rest = rest.strip_prefix('-').ok_or_else(bad)?;
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let n: u64 = digits.parse().map_err(|_| bad())?;
        let unit = match &rest[digits.len()..] {
            "" | "s" | "second" | "seconds" => 1,
            "m" | "minute" | "minutes" => 60,
            "h" | "hour" | "hours" => 3600,
            "d" | "day" | "days" => 86_400,
            _ => return Err(bad()),
        };
        return Ok(now.saturating_sub(n.saturating_mul(unit).saturating_mul(1000)));
    }
    let (date, time) = s.split_once('T').unwrap_or((s, "00:00:00"));
    let d: Vec<i64> = date.split('-').map(|p| p.parse().map_err(|_| bad())).collect::<Result<_, _>>()?;
    let t: Vec<i64> = time.split(':').map(|p| p.parse().map_err(|_| bad())).collect::<Result<_, _>>()?;
    let ([y, mo, day], [h, mi, sec @ ..]) = (d.as_slice(), t.as_slice()) else { return Err(bad()) };
    let sec = sec.first().copied().unwrap_or(0);
    if !(1..=12).contains(mo) || !(1..=31).contains(day) || !(0..=23).contains(h) || !(0..=59).contains(mi) {
        return Err(bad());
    }
    if !(0..=59).contains(&sec) || !(1970..=9999).contains(y) {
        return Err(bad());
    }
    let local = days_from_civil(*y, *mo, *day, *h, *mi, sec).ok_or_else(bad)?;
    u64::try_from(local_to_utc(local, offset_s)).map_err(|_| bad())
}

/// Unix ms of a UTC date and time already range-checked (years 1970..=9999).
#[allow(clippy::arithmetic_side_effects)] // bounded by the checks above: no overflow
fn days_from_civil(y: i64, mo: i64, day: i64, h: i64, mi: i64, sec: i64) -> Option<i64> {
    let (y, mo, day, h, mi) = (&y, &mo, &day, h, mi);
    // Days since 1970-01-01 (Howard Hinnant's days_from_civil).
    let y2 = if *mo <= 2 { y - 1 } else { *y };
    let era = y2.div_euclid(400);
    let yoe = y2.rem_euclid(400);
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + mi * 60 + sec) * 1000)
}

#[cfg(test)]
mod begin_tests {
    use super::*;

    #[test]
    fn begin_times_read_as_slurm_does() {
        let now = 1_796_084_311_000; // 2026-12-01T00:18:31
        assert_eq!(begin_ms("now", now).unwrap(), now);
        assert_eq!(begin_ms("now+1hour", now).unwrap(), now + 3_600_000);
        assert_eq!(begin_ms("now+60", now).unwrap(), now + 60_000);
        assert_eq!(begin_ms("2026-12-24T08:00", now).unwrap(), 1_798_099_200_000);
        // 00:10 has passed today: tomorrow; 16:00 has not.
        assert_eq!(begin_ms("00:10", now).unwrap(), 1_796_084_311_000 - 511_000 + 86_400_000);
        assert_eq!(begin_ms("teatime", now).unwrap(), begin_ms("16:00", now).unwrap());
        assert_eq!(begin_ms("tomorrow", now).unwrap(), begin_ms("midnight", now).unwrap());
        assert!(begin_ms("later", now).unwrap_err().contains("--begin"));
        assert!(begin_ms("25:00", now).is_err());
    }

    /// Local times, as Slurm reads them: in a zone two hours east of UTC,
    /// 16:00 is 14:00 UTC and a date names local midnight.
    #[test]
    fn begin_times_are_local() {
        let east = |_: i64| 7200;
        let now = 1_796_084_311_000; // 2026-12-01T00:18:31 UTC, 02:18:31 local
        let local_midnight = 1_796_084_311_000 - 1_111_000 - 7_200_000; // 2026-12-01T00:00 local
        assert_eq!(begin_ms_in("16:00", now, &east).unwrap(), local_midnight + 16 * 3_600_000);
        // 01:00 local has passed (it is 02:18 there): tomorrow's.
        assert_eq!(begin_ms_in("01:00", now, &east).unwrap(), local_midnight + 86_400_000 + 3_600_000);
        assert_eq!(begin_ms_in("midnight", now, &east).unwrap(), local_midnight + 86_400_000);
        assert_eq!(begin_ms_in("2026-12-24T08:00", now, &east).unwrap(), 1_798_099_200_000 - 7_200_000);
        assert_eq!(parse_time_in("-S", "2026-12-01", 0, &east).unwrap(), local_midnight);
        // A zone west of UTC at the same instant: still 2026-11-30 there.
        let west = |_: i64| -5 * 3600;
        assert_eq!(begin_ms_in("midnight", now, &west).unwrap(), 1_796_083_200_000 + 5 * 3_600_000);
        // Clocks forward at 07:00 UTC (02:00 at -5 becomes 03:00 at -4): 02:30
        // does not exist and moves forward to 03:30 (07:30 UTC); 01:30 and
        // 03:30 are themselves.
        let change = 1_796_083_200_000 + 7 * 3_600_000;
        let spring = move |utc: i64| if utc < change { -5 * 3600 } else { -4 * 3600 };
        let local = |h: i64, m: i64| 1_796_083_200_000 + h * 3_600_000 + m * 60_000;
        assert_eq!(local_to_utc(local(2, 30), &spring), change + 30 * 60_000);
        assert_eq!(local_to_utc(local(1, 30), &spring), local(1, 30) + 5 * 3_600_000);
        assert_eq!(local_to_utc(local(3, 30), &spring), local(3, 30) + 4 * 3_600_000);
        // Clocks back at 06:00 UTC (02:00 at -4 becomes 01:00 at -5): 01:30
        // happens twice; the first is taken.
        let back = 1_796_083_200_000 + 6 * 3_600_000;
        let autumn = move |utc: i64| if utc < back { -4 * 3600 } else { -5 * 3600 };
        assert_eq!(local_to_utc(local(1, 30), &autumn), local(1, 30) + 4 * 3_600_000);
    }
}

#[cfg(test)]
mod tests {

    /// What the fuzz target `text_parsers` found: multi-byte text before a
    /// suffix, and numbers that overflow, are errors rather than panics.
    #[test]
    fn odd_and_huge_input_is_an_error_not_a_panic() {
        assert!(mem_mb("Γ").is_err());
        assert!(mem_mb("ΓG").is_err());
        assert!(mem_mb("99999999999999999T").is_err());
        assert!(time_limit_s("99999999999999999:00:00").is_err());
        assert!(time_limit_s("999999999999999-00").is_err());
        assert!(parse_time("-S", "99999999999999-01-01", 0).is_err());
        assert!(gpu_request(None, Some("8"), None, None, 0, 1).is_err());
        assert_eq!(mem_mb("64g").unwrap(), 65_536);
        assert_eq!(time_limit_s("1-00:00:01").unwrap(), 86_401);
    }

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

    #[test]
    fn scheduler_options() {
        assert_eq!(node_range("4").unwrap(), (4, 0));
        assert_eq!(node_range("2-8").unwrap(), (2, 8));
        assert!(node_range("0").is_err());
        assert!(node_range("8-2").is_err());
        assert_eq!(gpu_request(None, Some("h100:16"), None, None, 2, 1).unwrap(), ("h100".into(), Some(8)));
        assert!(gpu_request(None, Some("3"), None, None, 2, 1).unwrap_err().contains("evenly"));
        assert_eq!(gpu_request(None, None, Some("1"), None, 1, 4).unwrap(), (String::new(), Some(4)));
        assert_eq!(gpu_request(None, None, None, Some("gpu:a100:4"), 1, 1).unwrap(), ("a100".into(), Some(4)));
        assert!(gpu_request(Some("1"), Some("1"), None, None, 1, 1).is_err());
        let t = topology("block:preferred@10:00").unwrap();
        assert_eq!((t.level.as_str(), t.required, t.wait_s), ("block", false, 600));
        assert!(topology("rack").unwrap().required);
        assert!(topology("rack:sometimes").is_err());
        assert_eq!(switches("1@5").unwrap(), (false, 300));
        assert!(switches("2").is_err());
    }

    #[test]
    fn licenses_as_slurm_writes_them() {
        let l = licenses("wandb:2,matlab,ansys*3,wandb").unwrap();
        let l: std::collections::BTreeMap<_, _> = l.into_iter().collect();
        assert_eq!(l, [("ansys".into(), 3), ("matlab".into(), 1), ("wandb".into(), 3)].into());
        for bad in ["", "a,,b", "wandb:0", "wandb:x", "a|b", "x y", ":2", "w:4294967295,w:1"] {
            assert!(licenses(bad).unwrap_err().starts_with("--licenses:"), "{bad}");
        }
    }
}

/// `KEY=VALUE` items (labels, environment variables) as a map.
pub fn parse_labels(items: &[String]) -> Result<std::collections::BTreeMap<String, String>, String> {
    items
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| format!("'{s}' must be KEY=VALUE"))
        })
        .collect()
}
