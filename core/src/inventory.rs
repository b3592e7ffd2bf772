//! Node admission: which nodes may register, and what each may claim.
//!
//! An agent's certificate binds its node's *name*; everything else a node
//! registers (CPUs, memory, GPUs, labels that `-C` matches, topology) is what
//! the agent says. With an inventory, an admin says it first: node classes
//! (like Nomad's node pools or a Slurm `NodeName=` line) bound what the nodes
//! they name may claim, and retired names never register again. An agent
//! that claims more is refused with the difference named; a node that an
//! edit leaves out (or claims more than its class now allows) goes down and
//! its jobs are requeued (`State::apply_set_node_inventory`).
//!
//! An empty inventory admits every node as it registers (a dev cluster, and
//! every cluster before data format 17): see docs/security.md.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::limits::{GPUS_PER_NODE_MAX, LABELS_PER_NODE_MAX, NODES_MAX, TOPOLOGY_LEVELS_MAX};
use crate::spec::SpecError;

/// Node classes an inventory may hold: a class per hardware kind and rack
/// or row is a few dozen on a large cluster; admission tries each in turn.
pub const NODE_CLASSES_MAX: usize = 256;
/// Names and patterns all classes together may list (`gpu[001-128]` is
/// one). Admitting a registration costs at most this many pattern checks,
/// and an inventory edit re-checks every node: with the most nodes a cluster
/// holds, 20 million checks of short names, a fraction of a second, once
/// per admin edit. Large fleets name their nodes by ranges.
pub const INVENTORY_PATTERNS_MAX: usize = 1024;
/// Retired names: every node the cluster may hold, and as many again that
/// were retired before.
pub const RETIRED_NODES_MAX: usize = 2 * NODES_MAX;
/// Bytes of names, patterns, labels and models in one inventory: what one
/// log entry carries comfortably (`command::BATCH_BYTES_MAX`), and within
/// a request's limit as JSON (at most four bytes of JSON per byte of name).
/// 20,000 retired node names of 32 bytes are 640 KiB.
pub const INVENTORY_BYTES_MAX: usize = 1024 * 1024;
/// The value of a class's label that admits any value of that label.
pub const ANY_VALUE: &str = "*";

/// What the nodes of one class may claim at registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeClass {
    /// Node names and hostlist patterns (`gpu[001-064]`, `cpu-*`).
    pub nodes: Vec<String>,
    /// At most this many CPUs.
    pub cpus: u32,
    /// At most this much memory (MiB).
    pub mem_mb: u64,
    /// At most this many GPUs.
    pub gpus: u32,
    /// Every GPU of the node is of this model (empty: any model).
    pub gpu_model: String,
    /// The labels a node may claim, with the value it may claim (`*`: any).
    pub labels: BTreeMap<String, String>,
    /// A node's topology path must begin with this one (empty: any path).
    pub topology: Vec<String>,
}

impl Default for NodeClass {
    fn default() -> Self {
        NodeClass {
            nodes: Vec::new(),
            cpus: 1,
            mem_mb: 1024,
            gpus: 0,
            gpu_model: String::new(),
            labels: BTreeMap::new(),
            topology: Vec::new(),
        }
    }
}

/// The node inventory: classes by name, and names retired for good.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeInventory {
    /// Bumped by every change (compare-and-set for edits, as the policy's).
    pub version: u64,
    pub classes: BTreeMap<String, NodeClass>,
    /// Decommissioned nodes: refused whatever class matches them (their
    /// certificates may outlive them).
    pub retired: BTreeSet<String>,
}

/// What a node claims, as registration or the state holds it.
#[derive(Debug, Clone)]
pub struct Claim<'a> {
    pub name: &'a str,
    pub cpus: u32,
    pub mem_mb: u64,
    pub gpu_models: Vec<&'a str>,
    pub labels: &'a BTreeMap<String, String>,
    pub topology: &'a [String],
}

impl<'a> Claim<'a> {
    /// What a registration claims.
    pub fn of_spec(spec: &'a crate::spec::NodeSpec) -> Claim<'a> {
        Claim {
            name: &spec.name,
            cpus: spec.cpus,
            mem_mb: spec.mem_mb,
            gpu_models: spec.gpus.iter().map(|g| g.model.as_str()).collect(),
            labels: &spec.labels,
            topology: &spec.topology,
        }
    }

    /// What a registered node claimed.
    pub fn of_node(node: &'a crate::model::Node) -> Claim<'a> {
        Claim {
            name: &node.name,
            cpus: node.cpus,
            mem_mb: node.mem_mb,
            gpu_models: node.gpus.iter().map(|g| g.model.as_str()).collect(),
            labels: &node.labels,
            topology: &node.topology,
        }
    }
}

impl NodeInventory {
    /// Whether admission is on: an empty inventory admits every node.
    pub fn enforced(&self) -> bool {
        !self.classes.is_empty() || !self.retired.is_empty()
    }

    pub fn validate(&self) -> Result<(), SpecError> {
        if self.classes.len() > NODE_CLASSES_MAX {
            return Err(SpecError::new("classes", format!("at most {NODE_CLASSES_MAX} node classes")));
        }
        if self.retired.len() > RETIRED_NODES_MAX {
            return Err(SpecError::new("retired", format!("at most {RETIRED_NODES_MAX} names")));
        }
        for name in &self.retired {
            crate::spec::check_name("retired", name, true)?;
        }
        let patterns = self.classes.values().map(|c| c.nodes.len()).fold(0, usize::saturating_add);
        if patterns > INVENTORY_PATTERNS_MAX {
            return Err(SpecError::new(
                "classes",
                format!("{patterns} node names and patterns in all; at most {INVENTORY_PATTERNS_MAX} (use ranges: gpu[001-512])"),
            ));
        }
        let bytes = self.bytes();
        if bytes > INVENTORY_BYTES_MAX {
            return Err(SpecError::new(
                "inventory",
                format!("{bytes} bytes of names, patterns and labels; at most {INVENTORY_BYTES_MAX}"),
            ));
        }
        for (name, class) in &self.classes {
            crate::policy::check_ident("classes", name)?;
            let field = |f: &str| format!("classes.{name}.{f}");
            if class.nodes.is_empty() {
                return Err(SpecError::new(&field("nodes"), "name at least one node or pattern"));
            }
            for n in &class.nodes {
                crate::spec::check_name(&field("nodes"), n, true)?;
            }
            if class.cpus == 0 {
                return Err(SpecError::new(&field("cpus"), "must be at least 1 (a node has a CPU)"));
            }
            if class.mem_mb == 0 {
                return Err(SpecError::new(&field("mem_mb"), "must be at least 1"));
            }
            if class.gpus > GPUS_PER_NODE_MAX {
                return Err(SpecError::new(&field("gpus"), format!("must be at most {GPUS_PER_NODE_MAX}")));
            }
            crate::spec::check_gpu_type(&field("gpu_model"), &class.gpu_model)?;
            if class.labels.len() > LABELS_PER_NODE_MAX {
                return Err(SpecError::new(&field("labels"), format!("at most {LABELS_PER_NODE_MAX} labels")));
            }
            for (k, v) in &class.labels {
                crate::spec::check_name(&field("labels"), k, true)?;
                crate::spec::check_name(&field("labels"), v, true)?;
            }
            if class.topology.len() > TOPOLOGY_LEVELS_MAX {
                return Err(SpecError::new(&field("topology"), format!("at most {TOPOLOGY_LEVELS_MAX} levels")));
            }
            for t in &class.topology {
                crate::spec::check_name(&field("topology"), t, true)?;
            }
        }
        Ok(())
    }

    /// Bytes of every name, pattern, label, model and topology level.
    pub fn bytes(&self) -> usize {
        let sum = |it: &mut dyn Iterator<Item = usize>| it.fold(0, usize::saturating_add);
        let classes = sum(&mut self.classes.iter().map(|(name, c)| {
            sum(&mut [name.len(), c.gpu_model.len()].into_iter())
                .saturating_add(sum(&mut c.nodes.iter().map(String::len)))
                .saturating_add(sum(&mut c.labels.iter().map(|(k, v)| k.len().saturating_add(v.len()))))
                .saturating_add(sum(&mut c.topology.iter().map(String::len)))
        }));
        classes.saturating_add(sum(&mut self.retired.iter().map(String::len)))
    }

    /// The class that admits `claim`, or why none does: a retired name, a
    /// name no class lists, or the first difference between the claim and
    /// the first class that names the node (later classes naming it too are
    /// tried in order; the first difference reported is the first class's).
    pub fn admit<'a>(&'a self, claim: &Claim) -> Result<Option<&'a str>, SpecError> {
        if !self.enforced() {
            return Ok(None);
        }
        if self.retired.contains(claim.name) {
            return Err(SpecError::new(
                "name",
                format!(
                    "node {} is retired from this cluster (`gangway admin inventory retire NAME --undo` admits it)",
                    claim.name
                ),
            ));
        }
        let mut first_refusal = None;
        for (class_name, class) in &self.classes {
            if !class.nodes.iter().any(|p| crate::policy::pattern_matches(p, claim.name)) {
                continue;
            }
            match class.difference(class_name, claim) {
                None => return Ok(Some(class_name)),
                Some(e) => {
                    first_refusal.get_or_insert(e);
                }
            }
        }
        Err(first_refusal.unwrap_or_else(|| {
            SpecError::new(
                "name",
                format!(
                    "node {} is in no node class of this cluster's inventory; an admin admits it with \
                     `gangway admin inventory class`",
                    claim.name
                ),
            )
        }))
    }
}

impl NodeClass {
    /// The first way `claim` exceeds this class, naming the field, what was
    /// claimed and what the class allows.
    fn difference(&self, class_name: &str, claim: &Claim) -> Option<SpecError> {
        let over = |field: &str, claimed: String, allowed: String| {
            Some(SpecError::new(
                field,
                format!("node {} claims {claimed}; its class {class_name} allows {allowed}", claim.name),
            ))
        };
        if claim.cpus > self.cpus {
            return over("cpus", claim.cpus.to_string(), format!("at most {}", self.cpus));
        }
        if claim.mem_mb > self.mem_mb {
            return over("mem_mb", format!("{} MiB", claim.mem_mb), format!("at most {} MiB", self.mem_mb));
        }
        let gpus = u32::try_from(claim.gpu_models.len()).unwrap_or(u32::MAX);
        if gpus > self.gpus {
            return over("gpus", format!("{gpus} GPUs"), format!("at most {}", self.gpus));
        }
        if !self.gpu_model.is_empty() {
            if let Some((i, m)) = claim.gpu_models.iter().enumerate().find(|(_, m)| **m != self.gpu_model) {
                return over(
                    &format!("gpus[{i}].model"),
                    format!("a GPU of model {m}"),
                    format!("only {}", self.gpu_model),
                );
            }
        }
        for (k, v) in claim.labels {
            match self.labels.get(k) {
                Some(allowed) if allowed == ANY_VALUE || allowed == v => {}
                Some(allowed) => return over(&format!("labels.{k}"), format!("{k}={v}"), format!("{k}={allowed}")),
                None => return over(&format!("labels.{k}"), format!("the label {k}"), "no such label".into()),
            }
        }
        if !claim.topology.starts_with(&self.topology) {
            return over(
                "topology",
                format!("the topology {}", claim.topology.join("/")),
                format!("paths under {}", self.topology.join("/")),
            );
        }
        None
    }
}
