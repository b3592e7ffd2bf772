//! `sinfo`: partitions and nodes, in Slurm's states (idle, mix, alloc, drain,
//! drng, down) and columns. Nodes whose printed fields are all equal share a
//! line (with their count and hostlist), as in Slurm; `-N` prints one per node.

use clap::Args;
use gangway_core::policy::{ClusterPolicy, DEFAULT_PARTITION};
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use super::format::{self, Item};
use super::hostlist;
use crate::output::Output;

const DEFAULT_FORMAT: &str = "%9P %.5a %.10l %.6D %.6t %N";
const LONG_FORMAT: &str = "%9P %.5a %.10l %.6D %.11T %N";
const SUMMARIZE_FORMAT: &str = "%9P %.5a %.10l %.16F %N";
const NODE_FORMAT: &str = "%-16N %.5D %-9P %.6t";
const NODE_LONG_FORMAT: &str = "%-16N %.5D %-9P %.11T %.4c %.8m %-20G %-20f %E";

#[derive(Args, Debug, Default)]
#[command(disable_help_flag = true)]
pub struct SinfoArgs {
    #[arg(long, action = clap::ArgAction::Help)]
    help: Option<bool>,
    /// One line per node.
    #[arg(short = 'N', long = "Node")]
    node: bool,
    /// More columns.
    #[arg(short = 'l', long)]
    long: bool,
    /// Node counts per partition as allocated/idle/other/total.
    #[arg(short = 's', long)]
    summarize: bool,
    #[arg(short = 'p', long = "partition", value_delimiter = ',')]
    partitions: Vec<String>,
    /// Only nodes in these states (idle, mix, alloc, drain, drng, down).
    #[arg(short = 't', long = "states", value_delimiter = ',')]
    states: Vec<String>,
    /// Only these nodes (a hostlist).
    #[arg(short = 'n', long = "nodes")]
    nodes: Option<String>,
    #[arg(short = 'h', long = "noheader")]
    noheader: bool,
    /// Output format, Slurm's % codes (e.g. "%P %D %t %N").
    #[arg(short = 'o', long = "format")]
    format: Option<String>,
    /// Accepted for compatibility: every partition is shown.
    #[arg(short = 'a', long)]
    all: bool,
}

fn code(c: char) -> Option<&'static str> {
    Some(match c {
        'P' => "Partition",
        'R' => "PartitionName",
        'a' => "Avail",
        'l' => "TimeLimit",
        'D' => "Nodes",
        't' => "StateCompact",
        'T' => "State",
        'N' => "NodeList",
        'c' => "CPUs",
        'm' => "Memory",
        'G' => "Gres",
        'f' => "Features",
        'E' => "Reason",
        'C' => "CPUsState",
        'F' => "NodesState",
        'O' => "CPULoad",
        _ => return None,
    })
}

fn header(key: &str) -> &'static str {
    match key {
        "Partition" | "PartitionName" => "PARTITION",
        "Avail" => "AVAIL",
        "TimeLimit" => "TIMELIMIT",
        "Nodes" => "NODES",
        "StateCompact" | "State" => "STATE",
        "NodeList" => "NODELIST",
        "CPUs" => "CPUS",
        "Memory" => "MEMORY",
        "Gres" => "GRES",
        "Features" => "AVAIL_FEATURES",
        "Reason" => "REASON",
        "CPUsState" => "CPUS(A/I/O/T)",
        "NodesState" => "NODES(A/I/O/T)",
        _ => "CPU_LOAD",
    }
}

/// Slurm's name for a node's state.
pub fn node_state(n: &pb::Node) -> &'static str {
    let gpus_used = n.gpus.iter().filter(|g| g.allocated || g.allocated_to.is_some()).count();
    let busy = n.cpus_alloc > 0 || gpus_used > 0 || !n.jobs.is_empty();
    let full = n.cpus_alloc >= n.cpus || (!n.gpus.is_empty() && gpus_used == n.gpus.len());
    match pb::NodeState::try_from(n.state).unwrap_or(pb::NodeState::Unspecified) {
        pb::NodeState::Down | pb::NodeState::Unspecified => "down",
        pb::NodeState::Drain if busy => "draining",
        pb::NodeState::Drain => "drained",
        pb::NodeState::Up if !busy && n.maint => "maint",
        pb::NodeState::Up if !busy && !n.reservation.is_empty() => "reserved",
        pb::NodeState::Up if !busy => "idle",
        pb::NodeState::Up if full => "allocated",
        pb::NodeState::Up => "mixed",
        // Slurm's power saving marks: `~` powered down, `#` powering up.
        pb::NodeState::PoweredDown => "idle~",
        pb::NodeState::PoweringUp if !busy => "idle#",
        pb::NodeState::PoweringUp if full => "allocated#",
        pb::NodeState::PoweringUp => "mixed#",
    }
}

fn compact(state: &str) -> &'static str {
    match state {
        "draining" => "drng",
        "drained" => "drain",
        "allocated" => "alloc",
        "mixed" => "mix",
        "idle" => "idle",
        "maint" => "maint",
        "reserved" => "resv",
        "idle~" => "idle~",
        "idle#" => "idle#",
        "allocated#" => "alloc#",
        "mixed#" => "mix#",
        _ => "down",
    }
}

/// One node in one partition.
struct Row<'a> {
    partition: &'a str,
    default: bool,
    max_time_s: u64,
    node: &'a pb::Node,
}

fn field(r: &Row, key: &str) -> String {
    let n = r.node;
    match key {
        "Partition" => format!("{}{}", r.partition, if r.default { "*" } else { "" }),
        "PartitionName" => r.partition.to_string(),
        "Avail" => "up".into(),
        "TimeLimit" if r.max_time_s == 0 => "infinite".into(),
        "TimeLimit" => super::duration(r.max_time_s),
        "StateCompact" => compact(node_state(n)).into(),
        "State" => node_state(n).into(),
        "CPUs" => n.cpus.to_string(),
        "Memory" => n.mem_mb.to_string(),
        "Gres" => match n.gpus.first() {
            None => "(null)".into(),
            Some(g) => format!("gpu:{}:{}", g.model.to_ascii_lowercase(), n.gpus.len()),
        },
        "Features" => {
            let mut f: Vec<String> = n
                .labels
                .iter()
                .map(|(k, v)| if v.is_empty() || v == "true" { k.clone() } else { format!("{k}={v}") })
                .collect();
            f.sort();
            if f.is_empty() {
                "(null)".into()
            } else {
                f.join(",")
            }
        }
        "Reason" if n.state_reason.is_empty() => "none".into(),
        "Reason" => n.state_reason.clone(),
        "CPULoad" => "N/A".into(),
        _ => String::new(),
    }
}

/// Fields that sum or list over the nodes of a line rather than split it.
const AGGREGATES: [&str; 4] = ["Nodes", "NodeList", "CPUsState", "NodesState"];

fn aggregate(rows: &[&Row], key: &str) -> String {
    match key {
        "Nodes" => rows.len().to_string(),
        "NodeList" => hostlist::compress(&rows.iter().map(|r| r.node.name.clone()).collect::<Vec<_>>()),
        "CPUsState" => {
            let (mut a, mut i, mut o, mut t) = (0, 0, 0, 0);
            for r in rows {
                let n = r.node;
                t += n.cpus;
                if n.state == pb::NodeState::Up as i32 {
                    a += n.cpus_alloc;
                    i += n.cpus.saturating_sub(n.cpus_alloc);
                } else {
                    o += n.cpus;
                }
            }
            format!("{a}/{i}/{o}/{t}")
        }
        _ => {
            let (mut a, mut i, mut o) = (0, 0, 0);
            for r in rows {
                match node_state(r.node) {
                    "allocated" | "mixed" | "allocated#" | "mixed#" => a += 1,
                    "idle" | "reserved" | "maint" | "idle~" | "idle#" => i += 1,
                    _ => o += 1,
                }
            }
            format!("{a}/{i}/{o}/{}", rows.len())
        }
    }
}

/// The partitions to show: the policy's, or the implicit one holding every node.
fn partitions(policy: &ClusterPolicy) -> Vec<(String, bool, u64, gangway_core::policy::Partition)> {
    if policy.partitions.is_empty() {
        let p = gangway_core::policy::Partition { default: true, ..Default::default() };
        return vec![(DEFAULT_PARTITION.to_string(), true, 0, p)];
    }
    policy.partitions.iter().map(|(name, p)| (name.clone(), p.default, p.max_time_s, p.clone())).collect()
}

pub async fn run(client: &Client, out: &Output, a: SinfoArgs) -> anyhow::Result<()> {
    let items = match &a.format {
        Some(f) => format::parse_percent(f, "--format", code),
        None => format::parse_percent(
            match (a.node, a.long, a.summarize) {
                (true, true, _) => NODE_LONG_FORMAT,
                (true, false, _) => NODE_FORMAT,
                (false, _, true) => SUMMARIZE_FORMAT,
                (false, true, false) => LONG_FORMAT,
                (false, false, false) => DEFAULT_FORMAT,
            },
            "--format",
            code,
        ),
    }
    .map_err(anyhow::Error::msg)?;
    let only_nodes = a.nodes.as_deref().map(hostlist::expand).transpose().map_err(anyhow::Error::msg)?;
    for s in &a.states {
        let known = [
            "idle",
            "mix",
            "mixed",
            "alloc",
            "allocated",
            "drain",
            "drained",
            "drng",
            "draining",
            "down",
            "maint",
            "resv",
            "reserved",
        ];
        if !known.contains(&s.to_ascii_lowercase().as_str()) {
            anyhow::bail!("--states: '{s}' is not a node state (idle, mix, alloc, drain, drng, down, maint, resv)");
        }
    }
    let policy = crate::policy::fetch_policy(client, false).await?.0;
    let mut nodes = client.list_nodes(false).await?;
    nodes.sort_by(|x, y| x.name.cmp(&y.name));
    let parts = partitions(&policy);
    for p in &a.partitions {
        if !parts.iter().any(|(n, ..)| n == p) {
            let names: Vec<&str> = parts.iter().map(|(n, ..)| n.as_str()).collect();
            anyhow::bail!("--partition: '{p}' does not exist (partitions: {})", names.join(", "));
        }
    }
    let mut rows = Vec::new();
    for (name, default, max_time_s, p) in &parts {
        if !a.partitions.is_empty() && !a.partitions.contains(name) {
            continue;
        }
        for n in nodes.iter().filter(|n| p.contains(&n.name)) {
            let state = node_state(n);
            let state_ok = a.states.is_empty()
                || a.states.iter().any(|s| {
                    let s = s.to_ascii_lowercase();
                    s == state || s == compact(state)
                });
            let node_ok = only_nodes.as_ref().is_none_or(|only| only.contains(&n.name));
            if state_ok && node_ok {
                rows.push(Row { partition: name, default: *default, max_time_s: *max_time_s, node: n });
            }
        }
    }
    if out.json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"partition": r.partition, "default": r.default, "node": r.node.name,
                    "state": node_state(r.node), "cpus": r.node.cpus, "memory_mb": r.node.mem_mb,
                    "gres": field(r, "Gres"), "reason": r.node.state_reason})
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if !a.noheader {
        println!("{}", format::render(&items, |k| header(k).to_string()));
    }
    // Lines: nodes whose non-aggregate fields print the same, in first-seen order.
    let split_keys: Vec<&str> = items
        .iter()
        .filter_map(|i| match i {
            Item::Field { key, .. } if !AGGREGATES.contains(key) => Some(*key),
            _ => None,
        })
        .collect();
    let mut groups: Vec<(Vec<String>, Vec<&Row>)> = Vec::new();
    for r in &rows {
        let mut k: Vec<String> = split_keys.iter().map(|key| field(r, key)).collect();
        if a.node {
            k.push(r.node.name.clone());
        }
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, members)) => members.push(r),
            None => groups.push((k, vec![r])),
        }
    }
    for (_, members) in &groups {
        let first = members[0];
        println!(
            "{}",
            format::render(&items, |k| {
                if AGGREGATES.contains(&k) {
                    aggregate(members, k)
                } else {
                    field(first, k)
                }
            })
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, state: pb::NodeState, cpus_alloc: u32) -> pb::Node {
        pb::Node { name: name.into(), state: state as i32, cpus: 8, cpus_alloc, ..Default::default() }
    }

    #[test]
    fn node_states_and_lines_group_as_in_slurm() {
        assert_eq!(node_state(&node("a", pb::NodeState::Up, 0)), "idle");
        assert_eq!(node_state(&node("a", pb::NodeState::Up, 4)), "mixed");
        assert_eq!(node_state(&node("a", pb::NodeState::Up, 8)), "allocated");
        assert_eq!(node_state(&node("a", pb::NodeState::Drain, 4)), "draining");
        assert_eq!(node_state(&node("a", pb::NodeState::Drain, 0)), "drained");
        assert_eq!(node_state(&node("a", pb::NodeState::Down, 0)), "down");
        let (n1, n2) = (node("gpu1", pb::NodeState::Up, 0), node("gpu2", pb::NodeState::Up, 2));
        let rows = [
            Row { partition: "gpu", default: true, max_time_s: 0, node: &n1 },
            Row { partition: "gpu", default: true, max_time_s: 0, node: &n2 },
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        assert_eq!(aggregate(&refs, "NodeList"), "gpu[1-2]");
        assert_eq!(aggregate(&refs, "CPUsState"), "2/14/0/16");
        assert_eq!(aggregate(&refs, "NodesState"), "1/1/0/2");
        assert_eq!(field(&rows[0], "Partition"), "gpu*");
        assert_eq!(field(&rows[0], "TimeLimit"), "infinite");
    }
}
