//! Parsing of the Slurm-style values users type: time limits, memory sizes, GPU
//! requests. Errors name the option and show a valid example.
//!
//! Whatever a user types must end in a value or an error, never a panic: the
//! arithmetic here is checked (and the fuzz target `text_parsers` tries it).
#![deny(clippy::arithmetic_side_effects)]

/// Slurm's `--time` formats: `MINUTES`, `MINUTES:SECONDS`, `HOURS:MINUTES:SECONDS`,
/// `DAYS-HOURS`, `DAYS-HOURS:MINUTES`, `DAYS-HOURS:MINUTES:SECONDS` (and
/// `DAYS-`, days alone), to the second.
pub fn time_limit_s(s: &str) -> Result<u64, String> {
    let bad = || format!("--time: '{s}' is not a time limit (examples: 30, 1:30:00, 2-00:00:00)");
    let num = |p: &str| p.trim().parse::<u64>().map_err(|_| bad());
    let (days, rest) = match s.split_once('-') {
        Some((d, "")) => (num(d)?, "0"),
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

/// The limit a job asking for no time limit gets: Gangway's longest (a
/// partition or QOS maximum below it refuses the job, naming its maximum).
pub const UNLIMITED_S: u64 = 365 * 24 * 3600;

/// A job's `--time` or `--time-min` as Slurm reads it (`time_str2mins`):
/// [`time_limit_s`]'s forms rounded up to whole minutes; `UNLIMITED`,
/// `INFINITE` (any case), `-1` and a time of 0 mean no limit
/// ([`UNLIMITED_S`]). The error is sbatch's, naming `option`.
pub fn job_time_s(option: &str, s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("unlimited") || t.eq_ignore_ascii_case("infinite") || t == "-1" {
        return Ok(UNLIMITED_S);
    }
    let secs = time_limit_s(t).map_err(|_| {
        format!("{option}: Invalid {option} specification: '{s}' (examples: 30, 1:30:00, 2-00:00:00, UNLIMITED)")
    })?;
    if secs == 0 {
        return Ok(UNLIMITED_S);
    }
    Ok(secs.div_ceil(60).saturating_mul(60))
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

/// [`begin_ms`] in the zone `offset_s` describes: Slurm's `parse_time`
/// (looking forward), read piece by piece. Pieces may come in any order,
/// separated by blanks, `-` or `T`: `today`, `tomorrow`, `midnight`, `noon`,
/// `elevenses` (11:00), `fika` (15:00), `teatime` (16:00),
/// `now[+|-COUNT[seconds|minutes|hours|days|weeks]]`, `HH:MM[:SS] [AM|PM]`,
/// `YYYY-MM-DD`, `MMDD[YY]`, `MM/DD[/YY]`, `MM.DD[.YY]`; and `utsEPOCH`. A
/// time without a date is the next one (today if its hour and minute are
/// still ahead, else tomorrow); a date without a time is its midnight; a
/// date without a year the next one.
fn begin_ms_in(s: &str, now_ms: u64, offset_s: &dyn Fn(i64) -> i64) -> Result<u64, String> {
    let bad = || {
        format!(
            "--begin: Invalid time specification: '{s}' (examples: now+1hour, 16:00, 4:00pm, 2026-12-24T08:00, \
             12/24, tomorrow)"
        )
    };
    let b = s.as_bytes();
    if b.len() >= 3 && b[..3].eq_ignore_ascii_case(b"uts") {
        let uts: u64 = s[3..].parse().map_err(|_| bad())?;
        return if uts < 1_000_000 { Err(bad()) } else { uts.checked_mul(1000).ok_or_else(bad) };
    }
    let now = i64::try_from(now_ms).map_err(|_| bad())?;
    let day_ms: i64 = 86_400_000;
    let local_now = now.saturating_add(offset_s(now).saturating_mul(1000));
    let today = civil(local_now);
    let tomorrow = civil(local_now.saturating_add(day_ms));
    // (year if given, month, day) and (hour, minute, second) as given so far.
    let (mut date, mut time): (Option<Date>, Option<Clock>) = (None, None);
    let at = |i: usize| b.get(i).copied().unwrap_or(0);
    let word =
        |i: usize, w: &str| b.get(i..i.saturating_add(w.len())).is_some_and(|x| x.eq_ignore_ascii_case(w.as_bytes()));
    let mut pos = 0usize;
    while pos < b.len() {
        let c = b[pos];
        if c == b' ' || c == b'\t' || c == b'-' || c == b'T' {
            pos = pos.saturating_add(1);
            continue;
        }
        let named = [
            ("today", None),
            ("tomorrow", None),
            ("midnight", Some(0)),
            ("noon", Some(12)),
            ("elevenses", Some(11)),
            ("fika", Some(15)),
            ("teatime", Some(16)),
        ];
        if let Some((w, hour)) = named.iter().find(|(w, _)| word(pos, w)) {
            match (*w, hour) {
                ("today", _) => date = Some((Some(today.0), today.1, today.2)),
                ("tomorrow", _) => date = Some((Some(tomorrow.0), tomorrow.1, tomorrow.2)),
                (_, Some(h)) => time = Some((*h, 0, 0)),
                _ => {}
            }
            pos = pos.saturating_add(w.len());
            continue;
        }
        if word(pos, "now") {
            pos = pos.saturating_add(3);
            while matches!(at(pos), b' ' | b'\t') {
                pos = pos.saturating_add(1);
            }
            let mut delta_s: i64 = 0;
            if matches!(at(pos), b'+' | b'-') {
                let sign: i64 = if at(pos) == b'-' { -1 } else { 1 };
                let (n, next) = slurm_delta(b, pos.saturating_add(1)).ok_or_else(bad)?;
                delta_s = n.checked_mul(sign).ok_or_else(bad)?;
                pos = next;
            } else if pos < b.len() {
                // `now` ends the text or takes an offset, nothing else.
                return Err(bad());
            }
            let later = civil(local_now.saturating_add(delta_s.saturating_mul(1000)));
            date = Some((Some(later.0), later.1, later.2));
            time = Some((later.3, later.4, later.5));
            continue;
        }
        if !c.is_ascii_digit() {
            return Err(bad());
        }
        if at(pos.saturating_add(1)) == b':' || at(pos.saturating_add(2)) == b':' {
            let (t, next) = slurm_clock(b, pos).ok_or_else(bad)?;
            time = Some(t);
            pos = next;
        } else {
            let (d, next) = slurm_date(b, pos).ok_or_else(bad)?;
            date = Some(d);
            pos = next;
        }
    }
    let ((year, mo, day), (h, mi, sec)) = match (date, time) {
        (None, None) => return Err(bad()),
        (Some(d), None) => (d, (0, 0, 0)),
        (None, Some(t)) => {
            let ahead = t.0 > today.3 || (t.0 == today.3 && t.1 > today.4);
            let day = if ahead { today } else { tomorrow };
            ((Some(day.0), day.1, day.2), t)
        }
        (Some(d), Some(t)) => (d, t),
    };
    // A date without a year: this year's if still ahead, else next year's.
    let year = year.unwrap_or_else(|| {
        if (mo, day, h, mi) > (today.1, today.2, today.3, today.4) {
            today.0
        } else {
            today.0.saturating_add(1)
        }
    });
    if !(1970..=9999).contains(&year) {
        return Err(bad());
    }
    let local = days_from_civil(year, mo, day, h, mi, sec).ok_or_else(bad)?;
    u64::try_from(local_to_utc(local, offset_s)).map_err(|_| bad())
}

/// A date as `--begin` gives it: (year if given, month, day).
type Date = (Option<i64>, i64, i64);
/// A time of day: (hour, minute, second).
type Clock = (i64, i64, i64);

/// Local calendar fields of `local_ms` (ms since the epoch, counted as if
/// local time were UTC): (year, month, day, hour, minute, second).
#[allow(clippy::arithmetic_side_effects)] // Euclidean division of an i64 by constants: no overflow
pub fn civil(local_ms: i64) -> (i64, i64, i64, i64, i64, i64) {
    let secs = local_ms.div_euclid(1000);
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, sod / 3600, sod / 60 % 60, sod % 60)
}

/// The digits of `b` at `pos`, at least `min` and at most `max` of them:
/// their value and the position after them.
fn digits(b: &[u8], pos: usize, min: usize, max: usize) -> Option<(i64, usize)> {
    let mut n: i64 = 0;
    let mut i = pos;
    while i < pos.saturating_add(max) && b.get(i).is_some_and(u8::is_ascii_digit) {
        n = n.checked_mul(10)?.checked_add(i64::from(b[i].checked_sub(b'0')?))?;
        i = i.saturating_add(1);
    }
    (i.saturating_sub(pos) >= min).then_some((n, i))
}

/// Slurm's `HH:MM[:SS] [AM|PM]` at `pos` (`_get_time`): ((hour, minute,
/// second), the position after it).
fn slurm_clock(b: &[u8], pos: usize) -> Option<(Clock, usize)> {
    let (mut h, i) = digits(b, pos, 1, 2).filter(|(h, _)| *h <= 23)?;
    let i = (b.get(i) == Some(&b':')).then_some(i.saturating_add(1))?;
    let (m, mut i) = digits(b, i, 2, 2).filter(|(m, _)| *m <= 59)?;
    let mut sec = 0;
    if b.get(i) == Some(&b':') {
        let (s, next) = digits(b, i.saturating_add(1), 2, 2).filter(|(s, _)| *s <= 59)?;
        (sec, i) = (s, next);
    }
    let mut j = i;
    while b.get(j).is_some_and(|c| *c == b' ' || *c == b'\t') {
        j = j.saturating_add(1);
    }
    let suffix = |w: &[u8]| b.get(j..j.saturating_add(2)).is_some_and(|x| x.eq_ignore_ascii_case(w));
    if suffix(b"pm") {
        h = match h.saturating_add(12) {
            24 => 12,
            h if h > 23 => return None,
            h => h,
        };
        i = j.saturating_add(2);
    } else if suffix(b"am") {
        h = match h {
            12 => 0,
            h if h > 11 => return None,
            h => h,
        };
        i = j.saturating_add(2);
    }
    Some(((h, m, sec), i))
}

/// Slurm's dates at `pos` (`_get_date`): `YYYY-MM-DD`, or `MMDD[YY]`,
/// `MM/DD[/YY]`, `MM.DD[.YY]` (YY: 20YY). ((year if given, month, day),
/// the position after it).
fn slurm_date(b: &[u8], pos: usize) -> Option<(Date, usize)> {
    let sep = |i: usize| matches!(b.get(i), Some(b'.' | b'/'));
    if b.get(pos.saturating_add(4)) == Some(&b'-') && b.get(pos.saturating_add(7)) == Some(&b'-') {
        let (y, i) = digits(b, pos, 4, 4)?;
        let (m, i) = digits(b, i.saturating_add(1), 2, 2).filter(|(m, _)| (1..=12).contains(m))?;
        let (d, i) = digits(b, i.saturating_add(1), 1, 2).filter(|(d, _)| (1..=31).contains(d))?;
        return Some(((Some(y), m, d), i));
    }
    let (m, mut i) = digits(b, pos, 1, 2).filter(|(m, _)| (1..=12).contains(m))?;
    if sep(i) {
        i = i.saturating_add(1);
    }
    let (d, mut i) = digits(b, i, 1, 2).filter(|(d, _)| (1..=31).contains(d))?;
    if sep(i) {
        i = i.saturating_add(1);
    }
    let year = match digits(b, i, 1, 2) {
        Some((yy, next)) if next.saturating_sub(i) == 2 => {
            i = next;
            Some(yy.saturating_add(2000))
        }
        Some(_) => return None,
        None => None,
    };
    Some(((year, m, d), i))
}

/// Slurm's offset after `now+` or `now-` (`_get_delta`): digits and then
/// one unit name (seconds, minutes, hours, days, weeks, singular or plural,
/// any case; none: seconds), blanks allowed between. (seconds, the position
/// after it).
fn slurm_delta(b: &[u8], pos: usize) -> Option<(i64, usize)> {
    const UNITS: [(&str, i64); 10] = [
        ("seconds", 1),
        ("second", 1),
        ("minutes", 60),
        ("minute", 60),
        ("hours", 3600),
        ("hour", 3600),
        ("days", 86_400),
        ("day", 86_400),
        ("weeks", 604_800),
        ("week", 604_800),
    ];
    let (mut n, mut any, mut i) = (0i64, false, pos);
    while let Some(&c) = b.get(i) {
        if c == b' ' || c == b'\t' {
            i = i.saturating_add(1);
            continue;
        }
        let unit = UNITS
            .iter()
            .find(|(w, _)| b.get(i..i.saturating_add(w.len())).is_some_and(|x| x.eq_ignore_ascii_case(w.as_bytes())));
        if let Some((w, mult)) = unit {
            n = n.checked_mul(*mult)?;
            i = i.saturating_add(w.len());
            break;
        }
        if !c.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(i64::from(c.checked_sub(b'0')?))?;
        any = true;
        i = i.saturating_add(1);
    }
    any.then_some((n, i))
}

/// Slurm's `--licenses` (`_build_license_list`): `NAME[:COUNT]` or
/// `NAME[=COUNT]`, separated by `,` or `;` (COUNT defaults to 1; an entry
/// of 0 is dropped; a name given twice adds up). Slurm's `|` (any one of)
/// is refused.
pub fn licenses(s: &str) -> Result<std::collections::HashMap<String, u32>, String> {
    let mut out: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    if s.contains('|') {
        return Err(format!("--licenses: '{s}': '|' (any one of) is not supported; list the licenses with ','"));
    }
    for item in s.split([',', ';']).map(str::trim) {
        if item.is_empty() {
            return Err(format!("--licenses: '{s}' has an empty entry (NAME[:COUNT],...)"));
        }
        let (name, count) = match item.split_once([':', '=']) {
            Some((n, c)) => {
                (n, c.parse::<u32>().map_err(|_| format!("--licenses: '{item}': the count must be a whole number"))?)
            }
            None => (item, 1),
        };
        let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@');
        if name.is_empty() || !name.chars().all(name_ok) {
            return Err(format!("--licenses: '{item}': a license name is letters, digits, '-', '_', '.' or '@'"));
        }
        if count == 0 {
            continue;
        }
        let e = out.entry(name.to_string()).or_default();
        *e = e.checked_add(count).ok_or_else(|| format!("--licenses: '{s}': too many of {name}"))?;
    }
    Ok(out)
}

/// Memory sizes as Slurm reads them (`str_to_mbytes`): a number of MiB, or
/// with a K/M/G/T suffix in either case, optionally followed by B (`512M`,
/// `64G`, `32GB`, `4gb`; all binary units; K rounds up to a whole MiB).
pub fn mem_mb(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || format!("--mem: '{s}' is not a memory size (examples: 4096, 512M, 64G, 32GB)");
    // One B after a unit letter: `32GB` is `32G`. (ASCII: one byte.)
    let t = match t.strip_suffix(['B', 'b']) {
        Some(u) if u.ends_with(['K', 'M', 'G', 'T', 'k', 'm', 'g', 't']) => u,
        _ => t,
    };
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

/// GPU requests: `N` or `TYPE:N` (`8`, `h100:8`); one type per job.
pub fn gpus(s: &str) -> Result<(String, i64), String> {
    let bad = || format!("--gpus-per-node: '{s}' must be COUNT or TYPE:COUNT, e.g. 8 or h100:8");
    if s.contains(',') {
        return Err(format!("--gpus-per-node: '{s}': a job asks for one GPU type (give TYPE:COUNT once)"));
    }
    match s.rsplit_once(':') {
        Some((ty, n)) => Ok((ty.to_string(), n.parse().map_err(|_| bad())?)),
        None => Ok((String::new(), s.parse().map_err(|_| bad())?)),
    }
}

/// The priority `TOP` gives: Slurm's highest settable priority (its
/// INFINITE, u32::MAX, less one).
pub const PRIORITY_TOP: u32 = u32::MAX - 1;

/// `--priority` / `Priority=`: a number up to [`PRIORITY_TOP`], or `TOP`
/// (any case) for that highest one, as Slurm takes them.
pub fn priority(opt: &str, s: &str) -> Result<u32, String> {
    let v = s.trim();
    if v.eq_ignore_ascii_case("top") {
        return Ok(PRIORITY_TOP);
    }
    v.parse::<u32>()
        .ok()
        .filter(|p| *p <= PRIORITY_TOP)
        .ok_or_else(|| format!("{opt}: '{s}' must be a number from 0 to {PRIORITY_TOP}, or TOP"))
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
        let (t, n) = gres_gpus(g)?;
        return Ok((t, Some(n)));
    }
    Ok((String::new(), None))
}

/// Slurm's `--gres` (per node): `NAME[:TYPE][:COUNT]` items joined with `,`,
/// `gres/` before a name allowed, a missing count meaning 1. GPUs are the
/// one generic resource here: (type, GPUs per node).
pub fn gres_gpus(g: &str) -> Result<(String, i64), String> {
    let mut found: Option<(String, i64)> = None;
    for item in g.split(',').map(str::trim) {
        let item = item.strip_prefix("gres/").unwrap_or(item);
        let mut parts = item.splitn(3, ':');
        let name = parts.next().unwrap_or_default();
        if name != "gpu" {
            return Err(format!(
                "--gres: '{item}': GPUs (gpu[:TYPE][:COUNT]) are the only generic resource Gangway schedules; \
                 ask for licenses with --licenses"
            ));
        }
        let count = |c: &str| {
            c.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| format!("--gres: '{item}': '{c}' is not a count"))
        };
        let got = match (parts.next(), parts.next()) {
            (None, _) => (String::new(), 1),
            (Some(c), None) if c.chars().all(|ch| ch.is_ascii_digit()) => (String::new(), count(c)?),
            (Some(t), None) => (t.to_string(), 1),
            (Some(t), Some(c)) => (t.to_string(), count(c)?),
        };
        if found.replace(got).is_some() {
            return Err(format!("--gres: '{g}': give gpu once, as gpu[:TYPE][:COUNT] (one GPU type per job)"));
        }
    }
    found.ok_or_else(|| format!("--gres: '{g}' names no generic resource"))
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

/// The signal names Slurm's `--signal` knows (`sig_name2num`), any case,
/// with or without `SIG`.
const SIGNAL_NAMES: &[(&str, u32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ABRT", 6),
    ("KILL", 9),
    ("ALRM", 14),
    ("TERM", 15),
    ("CHLD", 17),
    ("USR1", 10),
    ("USR2", 12),
    ("PIPE", 13),
    ("URG", 23),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("TTIN", 21),
    ("TTOU", 22),
    ("XCPU", 24),
];
/// The highest signal number (Linux's SIGRTMAX).
const SIGNAL_MAX: u32 = 64;

/// Slurm's `--signal=[R|B|RB|BR][:]SIG[@SECONDS]` (`get_signal_opts`): a
/// signal name of Slurm's (`USR1`, `sigterm`) or number, sent SECONDS
/// (0 to 65535, default 60) before the time limit; `B` sends it to the
/// batch shell only. Returns (signal, seconds, batch shell). `R` (before a
/// reservation ends) is read and warns before the time limit, which ends a
/// job in a reservation by the reservation's end.
pub fn warn_signal(s: &str) -> Result<(u32, u32, bool), String> {
    let bad = |why: &str| format!("--signal: Invalid --signal specification: '{s}' {why} (example: B:USR1@120)");
    let mut rest = s;
    let mut batch = false;
    let flag = |r: &str, c: char| r.chars().next().is_some_and(|f| f.eq_ignore_ascii_case(&c));
    if flag(rest, 'R') {
        rest = &rest[1..];
    }
    if flag(rest, 'B') {
        batch = true;
        rest = &rest[1..];
    }
    if flag(rest, 'R') {
        rest = &rest[1..];
    }
    let rest = rest.strip_prefix(':').unwrap_or(rest);
    let (sig, secs) = match rest.split_once('@') {
        Some((sig, secs)) => {
            (sig, secs.parse::<u32>().ok().filter(|t| *t <= 65_535).ok_or_else(|| bad("has a bad number of seconds"))?)
        }
        None => (rest, 60),
    };
    let num = signal_number(sig)
        .ok_or_else(|| bad("names no signal of Slurm's (HUP INT QUIT ABRT KILL ALRM TERM CHLD USR1 USR2 ...)"))?;
    Ok((num, secs, batch))
}

/// A signal as Slurm's commands name it (`sig_name2num`): a number from 1
/// to 64, or one of Slurm's names in any case, with or without `SIG`.
pub fn signal_number(sig: &str) -> Option<u32> {
    let t = sig.trim();
    let num = match t.parse::<u32>() {
        Ok(n) => n,
        Err(_) => {
            let name = match t.get(..3) {
                Some(p) if p.eq_ignore_ascii_case("SIG") => &t[3..],
                _ => t,
            };
            SIGNAL_NAMES.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| *v)?
        }
    };
    (1..=SIGNAL_MAX).contains(&num).then_some(num)
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
    let bad = || format!("{option}: '{s}' is not a time (YYYY-MM-DD[THH:MM[:SS]], now, now-2hours, now+1days)");
    if let Some(rest) = s.strip_prefix("now") {
        if rest.is_empty() {
            return Ok(now);
        }
        // now-N or now+N units, as Slurm's times.
        let (later, rest) = match (rest.strip_prefix('-'), rest.strip_prefix('+')) {
            (Some(r), _) => (false, r),
            (None, Some(r)) => (true, r),
            (None, None) => return Err(bad()),
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let n: u64 = digits.parse().map_err(|_| bad())?;
        let unit = match &rest[digits.len()..] {
            "" | "s" | "second" | "seconds" => 1,
            "m" | "minute" | "minutes" => 60,
            "h" | "hour" | "hours" => 3600,
            "d" | "day" | "days" => 86_400,
            _ => return Err(bad()),
        };
        let by = n.saturating_mul(unit).saturating_mul(1000);
        return Ok(if later { now.saturating_add(by) } else { now.saturating_sub(by) });
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

    /// A signal is a number from 1 to SIGNAL_MAX (or a name); one past is
    /// no signal.
    #[test]
    fn signal_numbers_stop_at_their_limit() {
        assert_eq!(signal_number(&SIGNAL_MAX.to_string()), Some(SIGNAL_MAX));
        assert_eq!(signal_number(&(SIGNAL_MAX + 1).to_string()), None);
        assert_eq!(signal_number("0"), None);
        assert_eq!(signal_number("sigusr1"), Some(10));
    }

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

    /// Slurm's other forms (`parse_time`), in UTC here (the tests' TZ).
    #[test]
    fn begin_times_take_every_form_slurm_takes() {
        let now = 1_796_084_311_000; // 2026-12-01T00:18:31 (a Tuesday)
        let day = 86_400_000;
        let midnight = now - 1_111_000;
        let ok = |s: &str| begin_ms(s, now).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(ok("today"), midnight, "today's midnight (already past: eligible at once)");
        assert_eq!(ok("fika"), midnight + 15 * 3_600_000);
        assert_eq!(ok("elevenses"), midnight + 11 * 3_600_000);
        assert_eq!(ok("4:00pm"), midnight + 16 * 3_600_000);
        assert_eq!(ok("10:30 AM"), midnight + 10 * 3_600_000 + 30 * 60_000);
        assert_eq!(ok("12:00am"), ok("midnight"));
        assert_eq!(ok("12:00pm"), ok("noon"));
        assert_eq!(ok("tomorrow 16:00"), midnight + day + 16 * 3_600_000);
        assert_eq!(ok("16:00 tomorrow"), ok("tomorrow 16:00"));
        assert_eq!(ok("12/24"), 1_798_070_400_000, "2026-12-24T00:00");
        assert_eq!(ok("12/24/26"), ok("12/24"));
        assert_eq!(ok("122426"), ok("12/24"));
        assert_eq!(ok("12.24.26"), ok("12/24"));
        assert_eq!(ok("12/24-08:00"), 1_798_099_200_000);
        assert_eq!(ok("2026-12-24 08:00"), 1_798_099_200_000);
        assert_eq!(ok("11/30"), 1_827_532_800_000, "a day past this year: next year's");
        assert_eq!(ok("now-1hour"), now - 3_600_000);
        assert_eq!(ok("now+2days"), now + 2 * 86_400_000);
        assert_eq!(ok("now + 2 days"), now + 2 * day);
        assert_eq!(ok("NOW+1WEEK"), now + 7 * day);
        assert_eq!(ok("uts1798099200"), 1_798_099_200_000);
        // What Slurm refuses.
        for bad in ["now+1h", "now+30m", "16:5", "2026-1-5", "13/01", "uts12", "4:00xm", "Teatime", "now+", "now 16:00"]
        {
            assert!(begin_ms(bad, now).unwrap_err().contains("Invalid time specification"), "{bad}");
        }
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
        assert_eq!(warn_signal("USR1@120").unwrap(), (10, 120, false));
        assert_eq!(warn_signal("B:SIGTERM").unwrap(), (15, 60, true));
        assert_eq!(warn_signal("b:usr1@30").unwrap(), (10, 30, true));
        assert_eq!(warn_signal("RB:USR2").unwrap(), (12, 60, true));
        assert_eq!(warn_signal("BUSR1").unwrap(), (10, 60, true));
        assert_eq!(warn_signal("12@5").unwrap(), (12, 5, false));
        for bad in ["NOPE@5", "WINCH", "USR1@70000", "0", "65", "USR1@x"] {
            assert!(warn_signal(bad).unwrap_err().starts_with("--signal"), "{bad}");
        }
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
        assert_eq!(gres_gpus("gpu").unwrap(), (String::new(), 1));
        assert_eq!(gres_gpus("gres/gpu:2").unwrap(), (String::new(), 2));
        assert_eq!(gres_gpus("gpu:a100").unwrap(), ("a100".into(), 1));
        for bad in ["gpu:2,shard:1", "shard:1", "gpu:a100:x", "gpu:1,gpu:2", "gpu:", ""] {
            assert!(gres_gpus(bad).unwrap_err().starts_with("--gres:"), "{bad}");
        }
        assert!(gpus("a100:2,v100:1").unwrap_err().contains("one GPU type"));
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
        let l = licenses("wandb:2,matlab;ansys=3,wandb,fluent:0").unwrap();
        let l: std::collections::BTreeMap<_, _> = l.into_iter().collect();
        assert_eq!(l, [("ansys".into(), 3), ("matlab".into(), 1), ("wandb".into(), 3)].into());
        for bad in ["", "a,,b", "ansys*3", "wandb:x", "a|b", "x y", ":2", "w:4294967295,w:1"] {
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
