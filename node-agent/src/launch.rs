//! Starting one task: its environment (Slurm's variables and the rendezvous
//! variables training launchers read), output files, user and process group.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gangway_proto::v1::LaunchOrder;

pub use gangway_proto::hostlist::compress as compress_hostlist;

/// Fills in what a big gang's order sends compactly (see
/// `gangway_proto::hostlist::name_every_node`), at most a job's node limit.
pub fn complete_order(order: &mut LaunchOrder) -> Result<(), String> {
    gangway_proto::hostlist::name_every_node(order, gangway_core::limits::NODES_PER_JOB_MAX as usize)
}

/// The variables a task sees, on top of the job's own `env`.
pub fn task_env(order: &LaunchOrder, node: &str) -> BTreeMap<String, String> {
    let nnodes = u32::try_from(order.nodes.len()).unwrap_or(u32::MAX);
    let tpn = order.tasks_per_node.max(1);
    // A heterogeneous job's components differ: tasks are counted over them.
    let (ntasks, first_rank) = if order.het_groups.is_empty() {
        (nnodes.saturating_mul(tpn), order.node_rank.saturating_mul(tpn))
    } else {
        het_ranks(order)
    };
    let nodelist = compress_hostlist(&order.nodes);
    let gpus: Vec<String> = order.gpus.iter().map(|g| g.to_string()).collect();
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_string(), v);
    };
    set("CUDA_VISIBLE_DEVICES", gpus.join(","));
    set("SLURM_JOB_ID", order.job_id.to_string());
    set("SLURM_JOBID", order.job_id.to_string());
    set("SLURM_JOB_NAME", order.name.clone());
    set("SLURM_JOB_USER", order.user.clone());
    set("SLURM_JOB_NODELIST", nodelist.clone());
    set("SLURM_NODELIST", nodelist);
    set("SLURM_JOB_NUM_NODES", nnodes.to_string());
    set("SLURM_NNODES", nnodes.to_string());
    set("SLURM_NODEID", order.node_rank.to_string());
    set("SLURMD_NODENAME", node.to_string());
    set("SLURM_PROCID", first_rank.to_string());
    set("SLURM_LOCALID", "0".into());
    set("SLURM_NTASKS", ntasks.to_string());
    set("SLURM_NPROCS", ntasks.to_string());
    set("SLURM_NTASKS_PER_NODE", tpn.to_string());
    set("SLURM_CPUS_PER_TASK", order.cpus_per_task.to_string());
    // What the allocation holds on each node (Gangway's allocations are alike
    // on every node of a job): scripts size thread pools from these.
    let cpus_on_node = tpn.saturating_mul(order.cpus_per_task.max(1)).to_string();
    set("SLURM_CPUS_ON_NODE", cpus_on_node.clone());
    set("SLURM_JOB_CPUS_PER_NODE", cpus_on_node);
    if order.mem_per_node_mb > 0 {
        set("SLURM_MEM_PER_NODE", order.mem_per_node_mb.to_string());
    }
    set("SLURM_GPUS_ON_NODE", order.gpus.len().to_string());
    if !order.gpus.is_empty() {
        set("SLURM_GPUS_PER_NODE", order.gpus.len().to_string());
        set("SLURM_JOB_GPUS", gpus.join(","));
    }
    set("SLURM_SUBMIT_DIR", order.workdir.clone());
    set("SLURM_RESTART_COUNT", order.attempt.saturating_sub(1).to_string());
    set("SLURM_CLUSTER_NAME", "gangway".into());
    set("MASTER_ADDR", order.master_addr.clone());
    set("MASTER_PORT", order.master_port.to_string());
    set("WORLD_SIZE", ntasks.to_string());
    set("RANK", first_rank.to_string());
    set("LOCAL_RANK", "0".into());
    set("LOCAL_WORLD_SIZE", tpn.to_string());
    set("NODE_RANK", order.node_rank.to_string());
    if let (Some(a), Some(i)) = (order.array_job_id, order.array_index) {
        set("SLURM_ARRAY_JOB_ID", a.to_string());
        set("SLURM_ARRAY_TASK_ID", i.to_string());
        set("SLURM_ARRAY_TASK_COUNT", order.array_count.to_string());
    }
    for (k, v) in [
        ("SLURM_JOB_ACCOUNT", &order.account),
        ("SLURM_JOB_PARTITION", &order.partition),
        ("SLURM_JOB_QOS", &order.qos),
    ] {
        if !v.is_empty() {
            set(k, v.clone());
        }
    }
    set("GANGWAY_JOB_ID", order.job_id.to_string());
    set("GANGWAY_ATTEMPT", order.attempt.to_string());
    het_env(order, &mut set);
    if order.batch {
        // srun in the batch script starts steps on the other nodes here.
        let addrs: Vec<String> = order.nodes.iter().zip(&order.step_addrs).map(|(n, a)| format!("{n}={a}")).collect();
        set("GANGWAY_STEP_ADDRS", addrs.join(","));
    }
    env
}

/// A heterogeneous job's task count and this node's first rank: component
/// by component, each node with its component's tasks.
fn het_ranks(order: &LaunchOrder) -> (u32, u32) {
    // No more nodes than the order names, whatever the groups say.
    let per_node = order
        .het_groups
        .iter()
        .flat_map(|g| std::iter::repeat_n(g.tasks_per_node.max(1), g.nodes as usize))
        .take(order.nodes.len());
    let (mut total, mut first_rank) = (0u32, 0u32);
    for (node, tpn) in per_node.enumerate() {
        if node == order.node_rank as usize {
            first_rank = total;
        }
        total = total.saturating_add(tpn);
    }
    (total, first_rank)
}

/// Slurm's variables for a heterogeneous job's components ("het groups"):
/// `SLURM_HET_SIZE`, and per component N `SLURM_JOB_NODELIST_HET_GROUP_N`
/// and the others; srun reads them for `--het-group`. The variables without
/// a suffix describe the whole allocation.
fn het_env(order: &LaunchOrder, set: &mut impl FnMut(&str, String)) {
    if order.het_groups.is_empty() {
        return;
    }
    set("SLURM_HET_SIZE", order.het_groups.len().to_string());
    let mut first = 0usize;
    for (k, g) in order.het_groups.iter().enumerate() {
        let end = first.saturating_add(g.nodes as usize).min(order.nodes.len());
        let nodes = compress_hostlist(order.nodes.get(first..end).unwrap_or_default());
        first = end;
        let tpn = g.tasks_per_node.max(1);
        let cpus = tpn.saturating_mul(g.cpus_per_task.max(1)).to_string();
        for (name, value) in [
            ("SLURM_JOB_ID", order.job_id.to_string()),
            ("SLURM_JOB_NODELIST", nodes.clone()),
            ("SLURM_NODELIST", nodes),
            ("SLURM_JOB_NUM_NODES", g.nodes.to_string()),
            ("SLURM_NNODES", g.nodes.to_string()),
            ("SLURM_NTASKS", g.nodes.saturating_mul(tpn).to_string()),
            ("SLURM_NTASKS_PER_NODE", tpn.to_string()),
            ("SLURM_CPUS_PER_TASK", g.cpus_per_task.to_string()),
            ("SLURM_JOB_CPUS_PER_NODE", cpus),
            ("SLURM_JOB_PARTITION", g.partition.clone()),
        ] {
            set(&format!("{name}_HET_GROUP_{k}"), value);
        }
        if g.gpus_per_node > 0 {
            set(&format!("SLURM_GPUS_PER_NODE_HET_GROUP_{k}"), g.gpus_per_node.to_string());
        }
        if g.mem_per_node_mb > 0 {
            set(&format!("SLURM_MEM_PER_NODE_HET_GROUP_{k}"), g.mem_per_node_mb.to_string());
        }
    }
}

/// Expands Slurm's filename patterns: `%j` job id, `%x` job name, `%A` array
/// master id (the job id for plain jobs), `%a` array index (0 for plain jobs),
/// `%N` node name, `%u` user, `%t` / `%n` this node's rank, `%%` a percent sign.
/// Unknown patterns are kept as written.
pub fn expand_pattern(pattern: &str, order: &LaunchOrder, node: &str) -> String {
    let mut out = String::with_capacity(pattern.len().saturating_add(16));
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('j') => out.push_str(&order.job_id.to_string()),
            Some('A') => out.push_str(&order.array_job_id.unwrap_or(order.job_id).to_string()),
            Some('x') => out.push_str(&order.name),
            Some('a') => out.push_str(&order.array_index.unwrap_or(0).to_string()),
            Some('N') => out.push_str(node),
            Some('u') => out.push_str(&order.user),
            Some('t') | Some('n') => out.push_str(&order.node_rank.to_string()),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Where a task's stdout and stderr go. Default: Slurm's `slurm-<jobid>.out` in
/// the working directory for the first node; other nodes of a gang add their
/// rank (`slurm-<jobid>.<rank>.out`) so ranks on a shared file system do not
/// overwrite each other. `--output`/`--error` patterns are expanded per node;
/// relative paths are under the working directory. stderr shares stdout's file
/// unless `--error` is given.
pub fn output_paths(order: &LaunchOrder, node: &str) -> (PathBuf, Option<PathBuf>) {
    let under_workdir = |p: String| {
        let p = PathBuf::from(p);
        if p.is_absolute() {
            p
        } else {
            Path::new(&order.workdir).join(p)
        }
    };
    let out = if order.output.is_empty() {
        // Slurm's defaults: slurm-%j.out, and slurm-%A_%a.out for array elements.
        let id = match (order.array_job_id, order.array_index) {
            (Some(a), Some(i)) => format!("{a}_{i}"),
            _ => order.job_id.to_string(),
        };
        let name = if order.node_rank == 0 {
            format!("slurm-{id}.out")
        } else {
            format!("slurm-{id}.{}.out", order.node_rank)
        };
        Path::new(&order.workdir).join(name)
    } else {
        under_workdir(expand_pattern(&order.output, order, node))
    };
    let err = (!order.error.is_empty()).then(|| under_workdir(expand_pattern(&order.error, order, node)));
    (out, err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_patterns_expand_like_slurm() {
        let order = LaunchOrder {
            job_id: 42,
            name: "train".into(),
            user: "alice".into(),
            node_rank: 1,
            workdir: "/work".into(),
            output: "logs/%x-%j.%N.%t.out".into(),
            ..Default::default()
        };
        assert_eq!(expand_pattern("%x-%j-%A_%a.%N.%u.%t.%%.%q", &order, "n7"), "train-42-42_0.n7.alice.1.%.%q");
        let (out, err) = output_paths(&order, "n7");
        assert_eq!(out, PathBuf::from("/work/logs/train-42.n7.1.out"));
        assert_eq!(err, None);
    }

    #[test]
    fn hostlists_compress_like_slurm() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(compress_hostlist(&v(&["n1", "n2", "n3"])), "n[1-3]");
        assert_eq!(compress_hostlist(&v(&["gpu01", "gpu02", "gpu04"])), "gpu[01-02,04]");
        assert_eq!(compress_hostlist(&v(&["a", "n5"])), "a,n5");
        assert_eq!(compress_hostlist(&v(&["dev-node-1", "dev-node-2"])), "dev-node-[1-2]");
    }
}
