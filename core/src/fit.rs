//! Whether a node can hold one member of a gang: the one definition the
//! scheduler's view (`sched/view.rs`, which plans) and `State::apply` (which
//! re-checks every placement a plan proposes) share, so a plan the scheduler
//! makes is never refused for a rule only apply knows, and apply never
//! accepts what the scheduler would not have proposed.
//!
//! What changes with use (free CPUs, memory, GPUs) is checked by each side in
//! its own representation (bitmasks in the view, the allocation in apply);
//! what a node is (its partition, features, size, healthy GPUs of a type) is
//! decided here.

use crate::model::{Gpu, GpuHealth, Node};
use crate::spec::JobSpec;

/// Why a node can never hold one member of a job, even idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    NotInPartition,
    LacksFeature,
    NotInNodeList,
    Excluded,
    TooFewCpus,
    TooLittleMemory,
    TooFewGpus,
    TooFewGpusOfType,
}

impl Mismatch {
    /// The reason as `squeue --explain` and a refused placement say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Mismatch::NotInPartition => "not in the job's partition",
            Mismatch::LacksFeature => "lacks a required feature",
            Mismatch::NotInNodeList => "not in the job's node list",
            Mismatch::Excluded => "excluded by the job",
            Mismatch::TooFewCpus => "too few CPUs",
            Mismatch::TooLittleMemory => "too little memory",
            Mismatch::TooFewGpus => "too few GPUs",
            Mismatch::TooFewGpusOfType => "too few GPUs of the type",
        }
    }
}

/// Whether `gpu` is of the type a job asks for (`a100` matches `a100-80gb`;
/// no type asked: any).
pub fn gpu_is_type(gpu: &Gpu, gpu_type: &str) -> bool {
    gpu_type.is_empty() || gpu.model.starts_with(gpu_type)
}

/// Whether `node` has `feature`: a label (`ib`), a label's value (`arch=zen4`),
/// or any of several alternatives (`a100|h100`, Slurm's OR).
pub fn node_has_feature(node: &Node, feature: &str) -> bool {
    feature.split('|').map(str::trim).filter(|f| !f.is_empty()).any(|f| match f.split_once('=') {
        Some((k, v)) => node.labels.get(k).is_some_and(|x| x == v),
        None => node.labels.contains_key(f),
    })
}

/// Why `node` could never hold one member of a job with `spec`, whatever runs
/// on it and whatever its state; None when it could. `in_partition` is the
/// caller's answer to whether the node is in the job's partition (the view
/// keeps it as a bitmask, apply asks the policy).
pub fn mismatch(spec: &JobSpec, node: &Node, in_partition: bool) -> Option<Mismatch> {
    if !in_partition {
        return Some(Mismatch::NotInPartition);
    }
    if !spec.constraints.iter().all(|c| node_has_feature(node, c)) {
        return Some(Mismatch::LacksFeature);
    }
    // A list as long as the gang names all of it; a shorter one is completed
    // with any other nodes (the placement must hold every listed node).
    if !spec.nodelist.is_empty() && spec.nodelist.len() >= spec.nodes as usize && !spec.nodelist.contains(&node.name) {
        return Some(Mismatch::NotInNodeList);
    }
    if spec.exclude.contains(&node.name) {
        return Some(Mismatch::Excluded);
    }
    if node.cpus < spec.cpus_per_node() {
        return Some(Mismatch::TooFewCpus);
    }
    if node.mem_mb < spec.mem_per_node_mb {
        return Some(Mismatch::TooLittleMemory);
    }
    if spec.gpus_per_node > 0 {
        let usable =
            node.gpus.iter().filter(|g| g.health == GpuHealth::Healthy && gpu_is_type(g, &spec.gpu_type)).count();
        if usable < spec.gpus_per_node as usize {
            return Some(if spec.gpu_type.is_empty() { Mismatch::TooFewGpus } else { Mismatch::TooFewGpusOfType });
        }
    }
    None
}
