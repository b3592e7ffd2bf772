//! Slurm hostlists: `gpu[001-003,7],login1` ⇄ the names one per entry. The
//! leader sends a big gang's nodes in this form (`LaunchOrder.nodelist`),
//! agents put it in `SLURM_JOB_NODELIST`, and the Slurm commands read it.

/// Compresses host names into Slurm's hostlist form: `n1,n2,n3,x` → `n[1-3],x`.
pub fn compress(names: &[String]) -> String {
    // Split each name into a prefix and a numeric suffix (kept with its width).
    let mut groups: Vec<(String, Vec<(u64, usize)>)> = Vec::new();
    // Prefix → its group, so a list of many prefixes stays O(n log n).
    let mut index: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    let mut out: Vec<String> = Vec::new();
    for name in names {
        let digits = name.chars().rev().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 || digits > 18 {
            out.push(name.clone());
            continue;
        }
        // ASCII digits are one byte each, so `digits` <= `name.len()`.
        let (prefix, num) = name.split_at(name.len().saturating_sub(digits));
        let n: u64 = num.parse().expect("digits");
        match index.get(prefix) {
            Some(&g) => groups[g].1.push((n, digits)),
            None => {
                index.insert(prefix, groups.len());
                groups.push((prefix.to_string(), vec![(n, digits)]));
            }
        }
    }
    for (prefix, mut nums) in groups {
        nums.sort_unstable();
        nums.dedup();
        if nums.len() == 1 {
            out.push(format!("{prefix}{:0w$}", nums[0].0, w = nums[0].1));
            continue;
        }
        // Runs of consecutive numbers of one width: (start, end, width).
        let mut runs: Vec<(u64, u64, usize)> = Vec::new();
        for &(n, w) in &nums {
            match runs.last_mut() {
                Some((_, end, rw)) if *rw == w && end.checked_add(1) == Some(n) => *end = n,
                _ => runs.push((n, n, w)),
            }
        }
        let ranges: Vec<String> = runs
            .into_iter()
            .map(|(start, end, w)| if start == end { format!("{start:0w$}") } else { format!("{start:0w$}-{end:0w$}") })
            .collect();
        out.push(format!("{prefix}[{}]", ranges.join(",")));
    }
    out.join(",")
}

/// Names one hostlist may expand to: bounded so a typo like `n[1-999999999]`
/// fails instead of filling memory.
pub const EXPAND_MAX: usize = 1_000_000;

/// Expands a hostlist: comma-separated entries, each with any number of
/// `[a-b,c]` groups (zero padding kept).
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut bytes = 0usize;
    for entry in split_top(list)? {
        if entry.is_empty() {
            continue;
        }
        expand_entry(&entry, &mut out, &mut bytes)?;
    }
    Ok(out)
}

/// Splits at commas outside brackets.
fn split_top(list: &str) -> Result<Vec<String>, String> {
    let mut parts = vec![String::new()];
    let mut depth = 0usize;
    for c in list.chars() {
        match c {
            '[' => depth = depth.saturating_add(1),
            ']' => depth = depth.checked_sub(1).ok_or_else(|| format!("hostlist '{list}': unbalanced ]"))?,
            ',' if depth == 0 => {
                parts.push(String::new());
                continue;
            }
            _ => {}
        }
        parts.last_mut().expect("one part").push(c);
    }
    if depth != 0 {
        return Err(format!("hostlist '{list}': unbalanced ["));
    }
    Ok(parts.into_iter().map(|p| p.trim().to_string()).collect())
}

/// Fills in what a big gang's launch order sends compactly: its nodes from
/// the hostlist (`nodelist`, kept), and one empty step address per node
/// where none were sent. Refuses a hostlist that does not expand or names
/// more than `max` nodes.
pub fn name_every_node(order: &mut crate::v1::LaunchOrder, max: usize) -> Result<(), String> {
    if order.nodes.is_empty() && !order.nodelist.is_empty() {
        let nodes = expand(&order.nodelist).map_err(|e| format!("job {}: nodelist: {e}", order.job_id))?;
        if nodes.len() > max {
            return Err(format!(
                "job {}: nodelist: {} nodes, more than a job may have ({max})",
                order.job_id,
                nodes.len()
            ));
        }
        order.nodes = nodes;
    }
    if order.step_addrs.is_empty() {
        order.step_addrs = vec![String::new(); order.nodes.len()];
    }
    Ok(())
}

/// Bracket groups in one entry (`r[1-2]n[1-4]` has two): real names have
/// one or two; each group is a level of recursion.
pub const GROUPS_PER_ENTRY_MAX: usize = 8;
/// Bytes of names one hostlist may expand to.
pub const EXPAND_BYTES_MAX: usize = 64 * 1024 * 1024;

fn expand_entry(entry: &str, out: &mut Vec<String>, bytes: &mut usize) -> Result<(), String> {
    if entry.matches('[').count() > GROUPS_PER_ENTRY_MAX {
        return Err(format!("hostlist: an entry may have at most {GROUPS_PER_ENTRY_MAX} [..] groups"));
    }
    expand_groups(entry, out, bytes)
}

fn expand_groups(entry: &str, out: &mut Vec<String>, bytes: &mut usize) -> Result<(), String> {
    let Some(open) = entry.find('[') else {
        if out.len() >= EXPAND_MAX {
            return Err(format!("hostlist: more than {EXPAND_MAX} names"));
        }
        *bytes = bytes.saturating_add(entry.len());
        if *bytes > EXPAND_BYTES_MAX {
            return Err(format!("hostlist: more than {EXPAND_BYTES_MAX} bytes of names"));
        }
        out.push(entry.to_string());
        return Ok(());
    };
    let (prefix, bracketed) = entry.split_at(open);
    let (body, rest) = bracketed
        .strip_prefix('[')
        .and_then(|b| b.split_once(']'))
        .ok_or_else(|| format!("hostlist '{entry}': unbalanced ["))?;
    let bad = || format!("hostlist '{entry}': '[{body}]' must hold numbers and ranges like 1-4,7");
    for part in body.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (u64, u64) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
        let span = hi.checked_sub(lo).ok_or_else(bad)?;
        if !usize::try_from(span).is_ok_and(|d| d < EXPAND_MAX) {
            return Err(format!("hostlist '{entry}': '{part}' is more than {EXPAND_MAX} names"));
        }
        let width = a.trim().len();
        for n in lo..=hi {
            expand_groups(&format!("{prefix}{n:0width$}{rest}"), out, bytes)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists_expand_and_compress() {
        assert_eq!(expand("gpu[001-003,7],login1").unwrap(), ["gpu001", "gpu002", "gpu003", "gpu7", "login1"]);
        assert_eq!(expand("r[1-2]n[1-2]").unwrap(), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(expand("a,,b").unwrap(), ["a", "b"]);
        assert!(expand("n[1-").is_err());
        assert!(expand("n[3-1]").is_err());
        assert!(expand("n[0-99999999]").is_err());
        // Hostile shapes fail with a reason, without deep recursion or a huge allocation.
        assert!(expand(&format!("n{}", "[1]".repeat(40_000))).unwrap_err().contains("groups"));
        let long = format!("{}[0-999999]", "x".repeat(1_000));
        assert!(expand(&long).unwrap_err().contains("bytes"));
        let names: Vec<String> = expand("node[1-4,6]").unwrap();
        assert_eq!(compress(&names), "node[1-4,6]");
        // Runs break at a gap or a change of width; duplicates count once.
        let names: Vec<String> = ["n5", "n05", "n6", "n6", "n7", "x"].map(String::from).to_vec();
        assert_eq!(compress(&names), "x,n[5,05,6-7]");
    }

    /// A hostlist of exactly EXPAND_MAX names expands; one more name, or a
    /// range one longer, is refused.
    #[test]
    fn expansion_stops_one_name_past_expand_max() {
        assert_eq!(expand(&format!("n[1-{EXPAND_MAX}]")).unwrap().len(), EXPAND_MAX);
        let err = expand(&format!("n[1-{EXPAND_MAX}],x")).unwrap_err();
        assert!(err.contains(&format!("more than {EXPAND_MAX} names")), "{err}");
        let err = expand(&format!("n[0-{EXPAND_MAX}]")).unwrap_err();
        assert!(err.contains(&format!("more than {EXPAND_MAX} names")), "{err}");
    }

    /// An entry with GROUPS_PER_ENTRY_MAX bracket groups expands; one more is refused.
    #[test]
    fn an_entry_may_have_groups_per_entry_max_groups() {
        let at = format!("n{}", "[1-2]".repeat(GROUPS_PER_ENTRY_MAX));
        assert_eq!(expand(&at).unwrap().len(), 1 << GROUPS_PER_ENTRY_MAX);
        let err = expand(&format!("{at}[1]")).unwrap_err();
        assert!(err.contains(&format!("at most {GROUPS_PER_ENTRY_MAX} [..] groups")), "{err}");
    }

    /// Names of exactly EXPAND_BYTES_MAX bytes in all expand; one byte more is refused.
    #[test]
    fn expansion_stops_one_byte_past_expand_bytes_max() {
        const NAMES: usize = 1024;
        assert_eq!(EXPAND_BYTES_MAX % NAMES, 0);
        let list = format!("{}[0000-{}]", "x".repeat(EXPAND_BYTES_MAX / NAMES - 4), NAMES - 1);
        let names = expand(&list).unwrap();
        assert_eq!(names.len(), NAMES);
        assert_eq!(names.iter().map(String::len).sum::<usize>(), EXPAND_BYTES_MAX);
        drop(names);
        let err = expand(&format!("{list},y")).unwrap_err();
        assert!(err.contains(&format!("more than {EXPAND_BYTES_MAX} bytes")), "{err}");
    }
}
