//! What users and agents ask for: [`JobSpec`] (a submission) and [`NodeSpec`] (a
//! node registration), with the validation that runs at the API edge before
//! anything reaches the Raft log, and again inside `apply` so that a bad command can
//! never change state even if an edge forgot to check.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::limits::*;

/// A refused field: which one, and the rule it broke. Rendered as `field: rule`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{field}: {rule}")]
pub struct SpecError {
    pub field: String,
    pub rule: String,
}

impl SpecError {
    pub fn new(field: &str, rule: impl Into<String>) -> Self {
        SpecError { field: field.to_string(), rule: rule.into() }
    }
}

/// A job submission, as replicated. Defaults have been filled in by the edge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct JobSpec {
    pub name: String,
    /// The submitting user (who the job runs as).
    pub user: String,
    /// argv of the command to run; with a `script`, the script's arguments.
    pub command: Vec<String>,
    /// A batch script's full text (run with `command` as its arguments);
    /// shared by every copy of the state that holds the job (`share.rs`).
    pub script: crate::Share<String>,
    pub workdir: String,
    pub partition: String,
    pub nodes: u32,
    pub tasks_per_node: u32,
    pub cpus_per_task: u32,
    pub mem_per_node_mb: u64,
    pub gpus_per_node: u32,
    /// Required GPU model (lower-case, e.g. `h100`); empty means any.
    pub gpu_type: String,
    pub time_limit_s: u64,
    /// Shared like the script.
    pub env: crate::Share<BTreeMap<String, String>>,
    /// Put the job back in the queue when a node it runs on fails (Slurm's
    /// default for batch jobs); otherwise it ends NODE_FAIL.
    pub requeue: bool,
    /// stdout path pattern (Slurm's `%j %x %A %a %N %u %t`); empty: `slurm-%j.out`
    /// in the working directory.
    pub output: String,
    /// stderr path pattern; empty: the same file as stdout.
    pub error: String,
    /// Signal number sent `warn_before_s` seconds before the time limit, so the
    /// job can checkpoint (Slurm's `--signal=SIG@SECONDS`); 0: none.
    pub warn_signal: u8,
    pub warn_before_s: u32,
    /// The warning goes to the batch shell only (Slurm's `--signal=B:`);
    /// otherwise to the tasks (batch jobs: all but the batch shell).
    pub warn_batch_shell: bool,
    /// The account charged; empty: the user's default account (resolved at submit).
    pub account: String,
    /// Quality of service; empty: the partition's or the cluster's default.
    pub qos: String,
    /// Upper end of a node-count range (`-N 2-4`); 0: exactly `nodes`.
    pub nodes_max: u32,
    /// Memory per allocated CPU (MiB); resolved into `mem_per_node_mb` at submit.
    pub mem_per_cpu_mb: u64,
    /// Node features every node must have: `name` matches a label key, `key=value`
    /// a label value (Slurm's `--constraint`, joined with `&`).
    pub constraints: Vec<String>,
    /// Whole nodes: no other job shares them.
    pub exclusive: bool,
    /// Co-location of a gang's nodes within one topology domain.
    pub topology: TopologyConstraint,
    /// Jobs this one waits for.
    pub dependencies: Vec<Dependency>,
    /// Start only when no other job with the same name and user is running.
    pub singleton: bool,
    /// A dependency that can never be met fails the job (otherwise it stays
    /// pending, held with reason DependencyNeverSatisfied).
    pub kill_on_invalid_dep: bool,
    /// Job array indexes (`0-99:2%8`); empty: a single job.
    pub array: String,
    /// Lowers (positive) or raises (negative, admins only) the priority.
    pub nice: i32,
    /// Submit held: the job does not start until released.
    pub hold: bool,
    /// Not before this time (epoch ms; 0: as soon as it can). Slurm's --begin.
    pub begin_ms: u64,
    /// Free text kept with the job (Slurm's --comment).
    pub comment: String,
    /// Slurm's batch-host semantics (sbatch): the script runs on the first node
    /// only; the other nodes hold the allocation for the steps `srun` starts
    /// there. Otherwise the command runs once on every node.
    pub batch: bool,
    /// Truncate the output files at each start (Slurm's --open-mode=truncate);
    /// otherwise append.
    pub truncate_output: bool,
    /// These nodes (Slurm's --nodelist): every one of them is in the job;
    /// when the list is shorter than `nodes` (from data format 9), others
    /// are added. Empty: any.
    pub nodelist: Vec<String>,
    /// Never these nodes (Slurm's --exclude).
    pub exclude: Vec<String>,
    // ---- From data format 9 (`format::SLURM_FEATURES_FORMAT`); empty before. ----
    /// Cluster-wide counted resources the job holds while it runs (Slurm's
    /// `--licenses=wandb:1,matlab:2`): name → count.
    pub licenses: BTreeMap<String, u32>,
    /// The advance reservation the job runs in (Slurm's `--reservation`);
    /// empty: none, and the job stays off every reservation's nodes while
    /// that reservation holds them.
    pub reservation: String,
    /// The shortest time limit the job accepts (Slurm's `--time-min`, in
    /// seconds; 0: only its full limit). The scheduler may start it with a
    /// limit between the two to fit a hole before a reservation.
    pub time_min_s: u64,
    /// The job must end by this time (epoch ms; Slurm's `--deadline`); one
    /// that cannot any more ends DEADLINE. 0: none.
    pub deadline_ms: u64,
    /// Slurm's `--requeue=expedite`: requeued because a node failed, the
    /// job goes to the head of the queue and back onto its other nodes plus
    /// a spare.
    pub requeue_expedite: bool,
    // ---- From data format 11 (`format::HET_JOBS_FORMAT`); empty before. ----
    /// A heterogeneous job's further components (Slurm's `hetjob`): the job's
    /// own shape is component 0, these are 1, 2, ...; all are placed at once,
    /// each on nodes of its own, or none is. Empty: an ordinary job.
    pub components: Vec<HetComponent>,
}

/// One further component of a heterogeneous job: the shape it asks for.
/// Everything else (script, time limit, account, QOS, dependencies) is the
/// job's.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(default)]
pub struct HetComponent {
    pub partition: String,
    pub nodes: u32,
    pub tasks_per_node: u32,
    pub cpus_per_task: u32,
    pub mem_per_node_mb: u64,
    pub mem_per_cpu_mb: u64,
    pub gpus_per_node: u32,
    pub gpu_type: String,
    pub constraints: Vec<String>,
    pub exclusive: bool,
    pub nodelist: Vec<String>,
    pub exclude: Vec<String>,
}

impl Default for HetComponent {
    fn default() -> Self {
        HetComponent::of(&JobSpec::default())
    }
}

impl HetComponent {
    /// The shape of `spec` (its component 0).
    pub fn of(spec: &JobSpec) -> HetComponent {
        HetComponent {
            partition: spec.partition.clone(),
            nodes: spec.nodes,
            tasks_per_node: spec.tasks_per_node,
            cpus_per_task: spec.cpus_per_task,
            mem_per_node_mb: spec.mem_per_node_mb,
            mem_per_cpu_mb: spec.mem_per_cpu_mb,
            gpus_per_node: spec.gpus_per_node,
            gpu_type: spec.gpu_type.clone(),
            constraints: spec.constraints.clone(),
            exclusive: spec.exclusive,
            nodelist: spec.nodelist.clone(),
            exclude: spec.exclude.clone(),
        }
    }

    /// Gives `spec` this shape.
    pub fn apply_to(&self, spec: &mut JobSpec) {
        spec.partition.clone_from(&self.partition);
        spec.nodes = self.nodes;
        spec.nodes_max = 0;
        spec.tasks_per_node = self.tasks_per_node;
        spec.cpus_per_task = self.cpus_per_task;
        spec.mem_per_node_mb = self.mem_per_node_mb;
        spec.mem_per_cpu_mb = self.mem_per_cpu_mb;
        spec.gpus_per_node = self.gpus_per_node;
        spec.gpu_type.clone_from(&self.gpu_type);
        spec.constraints.clone_from(&self.constraints);
        spec.exclusive = self.exclusive;
        spec.nodelist.clone_from(&self.nodelist);
        spec.exclude.clone_from(&self.exclude);
    }
}

/// Required or preferred co-location of a gang within one domain of a topology
/// level (Kueue's required/preferred topology, Slurm's `--switches=N@wait`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TopologyConstraint {
    /// A level name from the policy's topology levels; empty: no constraint.
    pub level: String,
    /// Never place across domains of the level (otherwise: preferred).
    pub required: bool,
    /// How long a preferred constraint holds before the job may spread (seconds).
    pub wait_s: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DependencyKind {
    /// The other job started (or ended without starting).
    After,
    AfterOk,
    AfterNotOk,
    AfterAny,
    /// Array element i waits for element i of the other array to succeed.
    AfterCorr,
}

impl DependencyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DependencyKind::After => "after",
            DependencyKind::AfterOk => "afterok",
            DependencyKind::AfterNotOk => "afternotok",
            DependencyKind::AfterAny => "afterany",
            DependencyKind::AfterCorr => "aftercorr",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Dependency {
    pub kind: DependencyKind,
    pub job_id: u64,
    /// One element of an array job (`afterok:12_3`); None: the whole job/array.
    pub array_index: Option<u32>,
}

/// Parses Slurm's `--dependency`: `afterok:12:13,afterany:14_2` (`,` = all of;
/// `?` any-of is not supported) or `singleton`. Returns the list and the
/// singleton flag.
pub fn parse_dependencies(s: &str) -> Result<(Vec<Dependency>, bool), SpecError> {
    let mut deps = Vec::new();
    let mut singleton = false;
    if s.contains('?') {
        return Err(SpecError::new("dependency", "'?' (any of) is not supported; use ',' (all of)"));
    }
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part == "singleton" {
            singleton = true;
            continue;
        }
        let mut it = part.split(':');
        let kind = match it.next().unwrap_or("") {
            "after" => DependencyKind::After,
            "afterok" => DependencyKind::AfterOk,
            "afternotok" => DependencyKind::AfterNotOk,
            "afterany" => DependencyKind::AfterAny,
            "aftercorr" => DependencyKind::AfterCorr,
            other => {
                return Err(SpecError::new(
                    "dependency",
                    format!(
                    "'{other}' is not a dependency type (after, afterok, afternotok, afterany, aftercorr, singleton)"
                ),
                ))
            }
        };
        let mut any = false;
        for id in it {
            any = true;
            let (job, index) = match id.split_once('_') {
                Some((j, i)) => (j, Some(i)),
                None => (id, None),
            };
            let job_id = job
                .parse::<u64>()
                .map_err(|_| SpecError::new("dependency", format!("'{id}' is not a job id (N or N_INDEX)")))?;
            let array_index = match index {
                Some(i) => Some(
                    i.parse::<u32>().map_err(|_| SpecError::new("dependency", format!("'{id}': bad array index")))?,
                ),
                None => None,
            };
            deps.push(Dependency { kind, job_id, array_index });
        }
        if !any {
            return Err(SpecError::new("dependency", format!("'{part}' names no job: use TYPE:JOBID[:JOBID...]")));
        }
    }
    if deps.len() > DEPENDENCIES_MAX {
        return Err(SpecError::new("dependency", format!("at most {DEPENDENCIES_MAX} jobs")));
    }
    Ok((deps, singleton))
}

/// A parsed array specification: the indexes and the concurrency throttle (0: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayIndexes {
    pub indexes: Vec<u32>,
    pub throttle: u32,
}

/// Parses Slurm's `--array`: `0-15`, `1,3,5-9`, `0-99:2` (step), with an optional
/// `%N` throttle.
pub fn parse_array(s: &str) -> Result<ArrayIndexes, SpecError> {
    let bad = |rule: String| SpecError::new("array", rule);
    let (list, throttle) = match s.split_once('%') {
        Some((l, t)) => {
            let t = t.parse::<u32>().map_err(|_| bad(format!("throttle '%{t}' must be a number")))?;
            if t == 0 {
                return Err(bad("throttle '%0' would never run anything; use %1 or more".into()));
            }
            (l, t)
        }
        None => (s, 0),
    };
    let mut set = std::collections::BTreeSet::new();
    for part in list.split(',') {
        let (range, step) = match part.split_once(':') {
            Some((r, st)) => (r, st.parse::<u32>().map_err(|_| bad(format!("step in '{part}' must be a number")))?),
            None => (part, 1),
        };
        if step == 0 {
            return Err(bad(format!("step in '{part}' must be at least 1")));
        }
        let (a, b) = match range.split_once('-') {
            Some((a, b)) => (a, b),
            None => (range, range),
        };
        let num = |x: &str| x.trim().parse::<u32>().map_err(|_| bad(format!("'{part}' is not START[-END[:STEP]]")));
        let (a, b) = (num(a)?, num(b)?);
        if a > b {
            return Err(bad(format!("'{part}': start is after end")));
        }
        if b > ARRAY_INDEX_MAX {
            return Err(bad(format!("indexes must be at most {ARRAY_INDEX_MAX}")));
        }
        let mut i = a;
        while i <= b {
            set.insert(i);
            if set.len() > ARRAY_TASKS_MAX {
                return Err(bad(format!("at most {ARRAY_TASKS_MAX} elements")));
            }
            i = match i.checked_add(step) {
                Some(n) => n,
                None => break,
            };
        }
    }
    Ok(ArrayIndexes { indexes: set.into_iter().collect(), throttle })
}

impl Default for JobSpec {
    fn default() -> Self {
        JobSpec {
            name: String::new(),
            user: String::new(),
            command: Vec::new(),
            script: String::new().into(),
            workdir: String::new(),
            partition: String::new(),
            nodes: 1,
            tasks_per_node: 1,
            cpus_per_task: 1,
            mem_per_node_mb: 0,
            gpus_per_node: 0,
            gpu_type: String::new(),
            time_limit_s: 0,
            env: BTreeMap::new().into(),
            requeue: true,
            output: String::new(),
            error: String::new(),
            warn_signal: 0,
            warn_before_s: 0,
            account: String::new(),
            qos: String::new(),
            nodes_max: 0,
            mem_per_cpu_mb: 0,
            constraints: Vec::new(),
            exclusive: false,
            topology: TopologyConstraint::default(),
            dependencies: Vec::new(),
            singleton: false,
            kill_on_invalid_dep: true,
            array: String::new(),
            nice: 0,
            hold: false,
            begin_ms: 0,
            comment: String::new(),
            batch: false,
            warn_batch_shell: false,
            truncate_output: false,
            nodelist: Vec::new(),
            exclude: Vec::new(),
            licenses: BTreeMap::new(),
            reservation: String::new(),
            time_min_s: 0,
            deadline_ms: 0,
            requeue_expedite: false,
            components: Vec::new(),
        }
    }
}

pub(crate) fn check_name(field: &str, value: &str, required: bool) -> Result<(), SpecError> {
    if value.is_empty() {
        if required {
            return Err(SpecError::new(field, "must not be empty"));
        }
        return Ok(());
    }
    if value.len() > NAME_BYTES_MAX {
        return Err(SpecError::new(field, format!("must be at most {NAME_BYTES_MAX} bytes")));
    }
    if value.chars().any(|c| c.is_control()) {
        return Err(SpecError::new(field, "must not contain control characters"));
    }
    Ok(())
}

fn check_range<T: PartialOrd + std::fmt::Display>(field: &str, value: T, min: T, max: T) -> Result<(), SpecError> {
    if value < min || value > max {
        return Err(SpecError::new(field, format!("must be between {min} and {max}, got {value}")));
    }
    Ok(())
}

/// GPU type names: lower-case letters, digits, `-`, `_` and `.`, starting with a
/// letter or digit (`h100`, `a100-80gb`, `mi300x`).
pub fn check_gpu_type(field: &str, value: &str) -> Result<(), SpecError> {
    if value.is_empty() {
        return Ok(());
    }
    if value.len() > GPU_TYPE_BYTES_MAX {
        return Err(SpecError::new(field, format!("must be at most {GPU_TYPE_BYTES_MAX} bytes")));
    }
    let ok_first = value.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok_rest = value.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'));
    if !ok_first || !ok_rest {
        return Err(SpecError::new(
            field,
            format!(
                "'{value}' is not a GPU type: use lower-case letters, digits, '-', '_' or '.', e.g. 'h100' or 'a100-80gb'"
            ),
        ));
    }
    Ok(())
}

impl JobSpec {
    /// [`JobSpec::validate`] as a cluster on data `format` applies it: before
    /// format 8 a job spans at most 1,024 nodes.
    pub fn validate_in(&self, format: u32) -> Result<(), SpecError> {
        self.validate()?;
        if format < crate::format::HET_JOBS_FORMAT && !self.components.is_empty() {
            return Err(SpecError::new(
                "components",
                format!(
                    "a heterogeneous job needs data format {}: every replica must run a build that reads it first \
                     (the cluster then moves to it by itself)",
                    crate::format::HET_JOBS_FORMAT
                ),
            ));
        }
        if format < crate::format::SLURM_FEATURES_FORMAT {
            if !self.nodelist.is_empty() && self.nodelist.len() != self.nodes as usize {
                return Err(SpecError::new(
                    "nodelist",
                    format!(
                        "names {} nodes but the job asks for {}: a shorter list needs data format {}; until every \
                         replica runs a build that reads it, the job runs on exactly the listed nodes",
                        self.nodelist.len(),
                        self.nodes,
                        crate::format::SLURM_FEATURES_FORMAT
                    ),
                ));
            }
            if let Some(field) = self.format_9_field() {
                return Err(SpecError::new(
                    field,
                    format!(
                        "needs data format {}: every replica must run a build that reads it first (the cluster \
                         then moves to it by itself)",
                        crate::format::SLURM_FEATURES_FORMAT
                    ),
                ));
            }
        }
        if format < crate::format::BIG_GANGS_FORMAT {
            let max = crate::limits::NODES_PER_JOB_MAX_BEFORE_FORMAT_8;
            for (field, n) in [("nodes", self.nodes), ("nodes_max", self.nodes_max)] {
                if n > max {
                    return Err(SpecError::new(
                        field,
                        format!(
                            "must be at most {max} until every replica runs a build that reads data format {} \
                             (the cluster then moves to it by itself)",
                            crate::format::BIG_GANGS_FORMAT
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The free-text fields other users see printed (squeue, `scontrol
    /// show job`, sacct) hold no control characters: no escape sequence,
    /// carriage return or line break that would rewrite what their
    /// terminals show. (The names are checked by [`JobSpec::validate`].)
    /// Checked where specs enter, at the API, and not in apply, so that log
    /// entries written before it apply as they always did.
    pub fn check_printable(&self) -> Result<(), SpecError> {
        let fields =
            [("comment", &self.comment), ("workdir", &self.workdir), ("output", &self.output), ("error", &self.error)];
        for (field, value) in fields {
            if let Some(c) = value.chars().find(|c| c.is_control()) {
                return Err(SpecError::new(
                    field,
                    format!("must not contain control characters (it holds U+{:04X})", u32::from(c)),
                ));
            }
        }
        Ok(())
    }

    /// Checks every field against its rule and the limits in [`crate::limits`].
    pub fn validate(&self) -> Result<(), SpecError> {
        check_name("name", &self.name, false)?;
        check_name("user", &self.user, true)?;
        check_name("partition", &self.partition, false)?;
        if self.command.is_empty() && self.script.is_empty() {
            return Err(SpecError::new("command", "must not be empty: give a command or a script"));
        }
        if !self.command.is_empty() {
            if self.script.is_empty() && self.command.first().is_some_and(|c| c.trim().is_empty()) {
                return Err(SpecError::new("command", "the program name (first argument) must not be empty"));
            }
            if self.command.len() > ARGS_MAX {
                return Err(SpecError::new("command", format!("must have at most {ARGS_MAX} arguments")));
            }
            let bytes = self.command.iter().map(|a| a.len().saturating_add(1)).fold(0, usize::saturating_add);
            if bytes > SCRIPT_BYTES_MAX {
                return Err(SpecError::new("command", format!("must be at most {SCRIPT_BYTES_MAX} bytes in all")));
            }
            if self.command.iter().any(|a| a.contains('\0')) {
                return Err(SpecError::new("command", "arguments must not contain NUL bytes"));
            }
        }
        if self.script.len() > SCRIPT_BYTES_MAX {
            return Err(SpecError::new("script", format!("must be at most {SCRIPT_BYTES_MAX} bytes")));
        }
        if self.script.contains('\0') {
            return Err(SpecError::new("script", "must not contain NUL bytes"));
        }
        if self.workdir.len() > PATH_BYTES_MAX {
            return Err(SpecError::new("workdir", format!("must be at most {PATH_BYTES_MAX} bytes")));
        }
        if !self.workdir.is_empty() && !self.workdir.starts_with('/') {
            return Err(SpecError::new("workdir", "must be an absolute path"));
        }
        check_range("nodes", self.nodes, 1, NODES_PER_JOB_MAX)?;
        check_range("tasks_per_node", self.tasks_per_node, 1, TASKS_PER_NODE_MAX)?;
        check_range("cpus_per_task", self.cpus_per_task, 1, CPUS_PER_TASK_MAX)?;
        check_range("mem_per_node_mb", self.mem_per_node_mb, 0, MEM_PER_NODE_MB_MAX)?;
        check_range("gpus_per_node", self.gpus_per_node, 0, GPUS_PER_NODE_MAX)?;
        check_gpu_type("gpu_type", &self.gpu_type)?;
        if !self.gpu_type.is_empty() && self.gpus_per_node == 0 {
            return Err(SpecError::new("gpu_type", "a GPU type needs gpus_per_node of at least 1"));
        }
        // 0: the partition's default, filled in at submit.
        check_range("time_limit_s", self.time_limit_s, 0, TIME_LIMIT_S_MAX)?;
        for (field, v) in [("output", &self.output), ("error", &self.error)] {
            if v.len() > PATH_BYTES_MAX || v.contains('\0') {
                return Err(SpecError::new(field, format!("must be a path of at most {PATH_BYTES_MAX} bytes")));
            }
        }
        if self.warn_signal > 31 {
            return Err(SpecError::new("warn_signal", format!("{} is not a signal number (1-31)", self.warn_signal)));
        }
        if self.warn_signal > 0 && (self.warn_before_s == 0 || self.warn_before_s > WARN_BEFORE_S_MAX) {
            return Err(SpecError::new("warn_before_s", format!("must be between 1 and {WARN_BEFORE_S_MAX} seconds")));
        }
        check_name("account", &self.account, false)?;
        check_name("qos", &self.qos, false)?;
        if self.nodes_max != 0 {
            check_range("nodes_max", self.nodes_max, self.nodes, NODES_PER_JOB_MAX)?;
        }
        check_range("mem_per_cpu_mb", self.mem_per_cpu_mb, 0, MEM_PER_NODE_MB_MAX)?;
        if self.mem_per_cpu_mb > 0 && self.mem_per_node_mb > 0 {
            return Err(SpecError::new("mem_per_cpu_mb", "give memory per node or per CPU, not both"));
        }
        if self.comment.len() > COMMENT_BYTES_MAX {
            return Err(SpecError::new("comment", format!("must be at most {COMMENT_BYTES_MAX} bytes")));
        }
        if self.constraints.len() > CONSTRAINTS_MAX {
            return Err(SpecError::new("constraints", format!("at most {CONSTRAINTS_MAX} features")));
        }
        for c in &self.constraints {
            check_name("constraints", c, true)?;
        }
        // Every listed node is in the job; a shorter list than --nodes gets
        // nodes added, as Slurm adds them (from data format 9).
        if !self.nodelist.is_empty()
            && (self.nodelist.len() > self.nodes as usize || (self.nodes_max != 0 && self.nodes_max != self.nodes))
        {
            return Err(SpecError::new(
                "nodelist",
                format!(
                    "names {} nodes but the job asks for {}: the job runs on every listed node (give -N at least \
                     as large as the list, and no range)",
                    self.nodelist.len(),
                    self.nodes
                ),
            ));
        }
        if self.exclude.len() > EXCLUDED_NODES_MAX {
            return Err(SpecError::new("exclude", format!("at most {EXCLUDED_NODES_MAX} nodes")));
        }
        // Sets, not scans: a list of 20,000 nodes checked against the names
        // before each would take 200 million comparisons on every replica.
        let mut excluded = std::collections::BTreeSet::new();
        for (field, names) in [("nodelist", &self.nodelist), ("exclude", &self.exclude)] {
            let mut seen = std::collections::BTreeSet::new();
            for n in names {
                check_name(field, n, true)?;
                if !seen.insert(n.as_str()) {
                    return Err(SpecError::new(field, format!("{n} is named twice")));
                }
            }
            excluded = seen;
        }
        if let Some(n) = self.nodelist.iter().find(|n| excluded.contains(n.as_str())) {
            return Err(SpecError::new("exclude", format!("{n} is also in the node list")));
        }
        check_name("topology.level", &self.topology.level, false)?;
        if self.topology.level.is_empty() && (self.topology.required || self.topology.wait_s > 0) {
            return Err(SpecError::new("topology.level", "name a level to require or prefer"));
        }
        check_range("topology.wait_s", self.topology.wait_s, 0, TIME_LIMIT_S_MAX)?;
        if self.dependencies.len() > DEPENDENCIES_MAX {
            return Err(SpecError::new("dependencies", format!("at most {DEPENDENCIES_MAX} jobs")));
        }
        if !self.array.is_empty() {
            parse_array(&self.array)?;
        }
        check_range("nice", self.nice, -NICE_MAX, NICE_MAX)?;
        if self.licenses.len() > LICENSES_PER_JOB_MAX {
            return Err(SpecError::new("licenses", format!("at most {LICENSES_PER_JOB_MAX} different licenses")));
        }
        for (name, &count) in &self.licenses {
            check_name("licenses", name, true)?;
            check_range("licenses", count, 1, LICENSE_COUNT_MAX)?;
        }
        check_name("reservation", &self.reservation, false)?;
        check_range("time_min_s", self.time_min_s, 0, TIME_LIMIT_S_MAX)?;
        if self.time_min_s > 0 && self.time_limit_s > 0 && self.time_min_s > self.time_limit_s {
            return Err(SpecError::new("time_min_s", "must not exceed the time limit"));
        }
        let cpus = u64::from(self.tasks_per_node).saturating_mul(u64::from(self.cpus_per_task));
        if cpus > u64::from(CPUS_PER_TASK_MAX) * 4 {
            return Err(SpecError::new(
                "cpus_per_task",
                format!("tasks_per_node × cpus_per_task must be at most {}, got {cpus}", CPUS_PER_TASK_MAX * 4),
            ));
        }
        self.validate_components()?;
        if self.env.len() > ENV_VARS_MAX {
            return Err(SpecError::new("env", format!("must have at most {ENV_VARS_MAX} variables")));
        }
        for (k, v) in &self.env {
            let valid_key = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid_key {
                return Err(SpecError::new("env", format!("'{k}' is not a variable name (letters, digits, '_')")));
            }
            if v.len() > ENV_VALUE_BYTES_MAX || v.contains('\0') {
                return Err(SpecError::new(
                    "env",
                    format!("value of {k} must be at most {ENV_VALUE_BYTES_MAX} bytes with no NUL"),
                ));
            }
        }
        Ok(())
    }

    /// A heterogeneous job's own rules, and each component's shape checked
    /// as a job of that shape (errors name `components[K].field`).
    fn validate_components(&self) -> Result<(), SpecError> {
        if self.components.is_empty() {
            return Ok(());
        }
        if self.components.len() > HET_COMPONENTS_MAX {
            return Err(SpecError::new(
                "components",
                format!("a heterogeneous job has at most {} components", HET_COMPONENTS_MAX.saturating_add(1)),
            ));
        }
        if !self.batch {
            return Err(SpecError::new(
                "components",
                "a heterogeneous job runs a batch script on its first node (sbatch, salloc), not a command on every node",
            ));
        }
        if !self.array.is_empty() {
            return Err(SpecError::new("components", "a job array cannot be heterogeneous (as in Slurm)"));
        }
        if self.nodes_max != 0 && self.nodes_max != self.nodes {
            return Err(SpecError::new("nodes_max", "a heterogeneous job's components have fixed node counts"));
        }
        if self.total_nodes() > NODES_PER_JOB_MAX {
            return Err(SpecError::new("components", format!("at most {NODES_PER_JOB_MAX} nodes in all components")));
        }
        let mut listed: BTreeMap<&str, usize> = self.nodelist.iter().map(|n| (n.as_str(), 0)).collect();
        for (i, c) in self.components.iter().enumerate() {
            let k = i.saturating_add(1);
            // The component's shape (the rest is the job's, checked above),
            // without a copy of the script per component.
            let shape = JobSpec { command: vec!["true".into()], ..self.component_shape(k) };
            shape.validate().map_err(|e| SpecError::new(&format!("components[{k}].{}", e.field), e.rule))?;
            for n in &c.nodelist {
                if let Some(other) = listed.insert(n, k) {
                    return Err(SpecError::new(
                        &format!("components[{k}].nodelist"),
                        format!("{n} is also in component {other}'s node list: each component gets nodes of its own"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Components in all: 1 for an ordinary job.
    pub fn het_size(&self) -> usize {
        self.components.len().saturating_add(1)
    }

    /// Component `k`'s shape (0: the job's own) as a spec of its own, with
    /// the job's user, account, QOS, time limits, deadline, reservation and
    /// topology, and nothing else (no script, environment or further
    /// components): what placing, checking or resolving one component reads.
    pub fn component_shape(&self, k: usize) -> JobSpec {
        let mut spec = JobSpec {
            user: self.user.clone(),
            account: self.account.clone(),
            qos: self.qos.clone(),
            time_limit_s: self.time_limit_s,
            time_min_s: self.time_min_s,
            deadline_ms: self.deadline_ms,
            reservation: self.reservation.clone(),
            topology: self.topology.clone(),
            batch: self.batch,
            ..JobSpec::default()
        };
        match k.checked_sub(1).and_then(|i| self.components.get(i)) {
            Some(c) => c.apply_to(&mut spec),
            None => HetComponent::of(self).apply_to(&mut spec),
        }
        spec
    }

    /// Every component's shape, component 0 (the job's own) first.
    pub fn shapes(&self) -> impl Iterator<Item = HetComponent> + '_ {
        std::iter::once(HetComponent::of(self)).chain(self.components.iter().cloned())
    }

    /// The node counts of the components, in order: a placement lists
    /// component 0's nodes first, then component 1's, and so on.
    pub fn component_nodes(&self) -> Vec<u32> {
        std::iter::once(self.nodes).chain(self.components.iter().map(|c| c.nodes)).collect()
    }

    /// The component whose node sits at `position` in a placement (which
    /// lists component 0's nodes first); 0 for an ordinary job.
    pub fn component_of(&self, position: usize) -> usize {
        if self.components.is_empty() {
            return 0;
        }
        let mut end = 0usize;
        for (k, n) in self.component_nodes().into_iter().enumerate() {
            end = end.saturating_add(n as usize);
            if position < end {
                return k;
            }
        }
        self.components.len()
    }

    /// Nodes at the job's smallest size, every component counted.
    pub fn total_nodes(&self) -> u32 {
        self.components.iter().map(|c| c.nodes).fold(self.nodes, u32::saturating_add)
    }

    /// CPUs at the job's smallest size, every component counted.
    pub fn total_cpus(&self) -> u64 {
        let own = u64::from(self.nodes).saturating_mul(u64::from(self.cpus_per_node()));
        self.components
            .iter()
            .map(|c| {
                u64::from(c.nodes)
                    .saturating_mul(u64::from(c.tasks_per_node).saturating_mul(u64::from(c.cpus_per_task)))
            })
            .fold(own, u64::saturating_add)
    }

    /// GPUs at the job's smallest size, every component counted.
    pub fn total_gpus(&self) -> u64 {
        let own = u64::from(self.nodes).saturating_mul(u64::from(self.gpus_per_node));
        self.components
            .iter()
            .map(|c| u64::from(c.nodes).saturating_mul(u64::from(c.gpus_per_node)))
            .fold(own, u64::saturating_add)
    }

    /// The estimate data format 4 used for array budgets: it leaves out several
    /// fields. Kept because `apply` must decide old log entries as the build
    /// that wrote them did; new budgets use [`JobSpec::size_bytes`].
    pub fn approx_bytes(&self) -> usize {
        let strings = [&self.script, &self.workdir, &self.name, &self.output, &self.error];
        let list =
            |v: &[String], each: usize| v.iter().map(|a| a.len().saturating_add(each)).fold(0, usize::saturating_add);
        let env = self.env.iter().map(|(k, v)| k.len().saturating_add(v.len()).saturating_add(64));
        strings.iter().map(|s| s.len()).chain([list(&self.command, 24)]).chain(env).fold(512, usize::saturating_add)
    }

    /// An upper estimate of the spec's size in memory, counting every field:
    /// each string with its heap and header overhead, each list and map entry.
    /// Budgets (array copies, pending bytes per user and per cluster) use it.
    pub fn size_bytes(&self) -> usize {
        /// A `String`'s header plus allocator rounding, roughly.
        const STRING: usize = 32;
        /// A map entry's share of a B-tree node, roughly.
        const ENTRY: usize = 48;
        /// The fixed-size part of a spec and of one dependency. Constants, not
        /// `size_of`: this decides replicated outcomes (budgets), which must not
        /// change with a struct's layout from one build to the next.
        const FIXED: usize = 1024;
        const DEPENDENCY: usize = 32;
        const COMPONENT: usize = 128;
        let text = |s: &String| s.len().saturating_add(STRING);
        let list = |v: &[String]| v.iter().map(text).fold(0, usize::saturating_add);
        let strings = [
            &self.name,
            &self.user,
            &self.script,
            &self.workdir,
            &self.partition,
            &self.gpu_type,
            &self.output,
            &self.error,
            &self.account,
            &self.qos,
            &self.topology.level,
            &self.array,
            &self.comment,
            &self.reservation,
        ];
        let env = self.env.iter().map(|(k, v)| text(k).saturating_add(text(v)).saturating_add(ENTRY));
        strings
            .into_iter()
            .map(text)
            .chain([list(&self.command), list(&self.constraints), list(&self.nodelist), list(&self.exclude)])
            .chain(env)
            .chain(self.licenses.keys().map(|k| text(k).saturating_add(ENTRY)))
            .chain([self.dependencies.len().saturating_mul(DEPENDENCY)])
            .chain(self.components.iter().map(|c| {
                [text(&c.partition), text(&c.gpu_type), list(&c.constraints), list(&c.nodelist), list(&c.exclude)]
                    .into_iter()
                    .fold(COMPONENT, usize::saturating_add)
            }))
            .fold(FIXED, usize::saturating_add)
    }

    /// The first field set that data formats before 9 cannot carry.
    pub fn format_9_field(&self) -> Option<&'static str> {
        [
            ("licenses", !self.licenses.is_empty()),
            ("reservation", !self.reservation.is_empty()),
            ("time_min_s", self.time_min_s != 0),
            ("deadline_ms", self.deadline_ms != 0),
            ("requeue_expedite", self.requeue_expedite),
        ]
        .into_iter()
        .find_map(|(f, set)| set.then_some(f))
    }

    /// The most nodes the job can use (`nodes` unless a range was given).
    pub fn nodes_max(&self) -> u32 {
        self.nodes_max.max(self.nodes)
    }

    /// CPUs the job needs on each of its nodes.
    pub fn cpus_per_node(&self) -> u32 {
        self.tasks_per_node.saturating_mul(self.cpus_per_task)
    }
}

/// One GPU as an agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSpec {
    pub uuid: String,
    /// Lower-case model name, e.g. `h100-80gb`.
    pub model: String,
    pub mem_mb: u64,
    /// GPUs sharing an island id are joined by NVLink (a fast intra-node domain).
    pub nvlink_island: u32,
}

/// A node registration: what an agent found on its host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: String,
    /// The agent's address, for the leader to reach it (empty for simulated nodes).
    pub addr: String,
    pub cpus: u32,
    pub mem_mb: u64,
    pub gpus: Vec<GpuSpec>,
    /// Topology path from the top level down, e.g. `["zone-a", "block-1", "rack-3"]`.
    pub topology: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

impl NodeSpec {
    pub fn validate(&self) -> Result<(), SpecError> {
        check_name("name", &self.name, true)?;
        if !self.name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
            return Err(SpecError::new("name", "use letters, digits, '-', '_' or '.'"));
        }
        check_range("cpus", self.cpus, 1, CPUS_PER_TASK_MAX * 4)?;
        check_range("mem_mb", self.mem_mb, 1, MEM_PER_NODE_MB_MAX)?;
        if self.gpus.len() > GPUS_PER_NODE_MAX as usize {
            return Err(SpecError::new("gpus", format!("must be at most {GPUS_PER_NODE_MAX}")));
        }
        for (i, g) in self.gpus.iter().enumerate() {
            check_gpu_type(&format!("gpus[{i}].model"), &g.model)?;
            if g.model.is_empty() {
                return Err(SpecError::new(&format!("gpus[{i}].model"), "must not be empty"));
            }
            check_name(&format!("gpus[{i}].uuid"), &g.uuid, true)?;
        }
        if self.topology.len() > TOPOLOGY_LEVELS_MAX {
            return Err(SpecError::new("topology", format!("must have at most {TOPOLOGY_LEVELS_MAX} levels")));
        }
        for t in &self.topology {
            check_name("topology", t, true)?;
        }
        if self.labels.len() > LABELS_PER_NODE_MAX {
            return Err(SpecError::new("labels", format!("must have at most {LABELS_PER_NODE_MAX} labels")));
        }
        for (k, v) in &self.labels {
            check_name("labels", k, true)?;
            check_name("labels", v, false)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_spec() -> JobSpec {
        JobSpec { user: "alice".into(), command: vec!["true".into()], ..JobSpec::default() }
    }

    #[test]
    fn valid_spec_passes() {
        ok_spec().validate().unwrap();
    }

    #[test]
    fn errors_name_field_and_rule() {
        let cases: Vec<(JobSpec, &str)> = vec![
            (JobSpec { command: vec![], ..ok_spec() }, "command"),
            (JobSpec { command: vec!["".into()], ..ok_spec() }, "command"),
            (JobSpec { nodes: 0, ..ok_spec() }, "nodes"),
            (JobSpec { nodes: NODES_PER_JOB_MAX + 1, ..ok_spec() }, "nodes"),
            (JobSpec { cpus_per_task: 0, ..ok_spec() }, "cpus_per_task"),
            (JobSpec { gpus_per_node: 17, ..ok_spec() }, "gpus_per_node"),
            (JobSpec { gpus_per_node: 1, gpu_type: "H100:8".into(), ..ok_spec() }, "gpu_type"),
            (JobSpec { time_limit_s: TIME_LIMIT_S_MAX + 1, ..ok_spec() }, "time_limit_s"),
            (JobSpec { script: "x".repeat(SCRIPT_BYTES_MAX + 1).into(), command: vec![], ..ok_spec() }, "script"),
            (JobSpec { workdir: "relative/dir".into(), ..ok_spec() }, "workdir"),
            (JobSpec { user: String::new(), ..ok_spec() }, "user"),
        ];
        // Free text others see printed: no control characters.
        for field in ["comment", "workdir", "output", "error"] {
            let mut spec = ok_spec();
            let value = if field == "comment" { "ok\x1b[2K".to_string() } else { "/tmp/x\ry".to_string() };
            match field {
                "comment" => spec.comment = value,
                "workdir" => spec.workdir = value,
                "output" => spec.output = value,
                _ => spec.error = value,
            }
            spec.validate().expect("valid but for the control character");
            let err = spec.check_printable().expect_err(field);
            assert_eq!(err.field, field, "{err}");
            assert!(err.rule.contains("control characters"), "{err}");
        }
        let mut fine = ok_spec();
        (fine.comment, fine.workdir) = ("Größe: 8×H100 — ok".into(), "/home/ünï".into());
        fine.check_printable().unwrap();
        for (spec, field) in cases {
            let err = spec.validate().expect_err(field);
            assert_eq!(err.field, field, "{err}");
            assert!(!err.rule.is_empty());
        }
    }

    #[test]
    fn gpu_type_syntax() {
        for good in ["h100", "a100-80gb", "mi300x", "l4"] {
            check_gpu_type("gpu_type", good).unwrap();
        }
        for bad in ["H100", "h100:8", "-x", "a b", "h100!"] {
            assert!(check_gpu_type("gpu_type", bad).is_err(), "{bad}");
        }
    }
}
