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
pub struct JobSpec {
    pub name: String,
    /// The submitting user (who the job runs as).
    pub user: String,
    /// argv of the command to run; empty when `script` is set.
    pub command: Vec<String>,
    /// A batch script's full text; empty when `command` is set.
    pub script: String,
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
    pub env: BTreeMap<String, String>,
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
}

impl Default for JobSpec {
    fn default() -> Self {
        JobSpec {
            name: String::new(),
            user: String::new(),
            command: Vec::new(),
            script: String::new(),
            workdir: String::new(),
            partition: String::new(),
            nodes: 1,
            tasks_per_node: 1,
            cpus_per_task: 1,
            mem_per_node_mb: 0,
            gpus_per_node: 0,
            gpu_type: String::new(),
            time_limit_s: TIME_LIMIT_S_DEFAULT,
            env: BTreeMap::new(),
            requeue: true,
            output: String::new(),
            error: String::new(),
            warn_signal: 0,
            warn_before_s: 0,
        }
    }
}

fn check_name(field: &str, value: &str, required: bool) -> Result<(), SpecError> {
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
    /// Checks every field against its rule and the limits in [`crate::limits`].
    pub fn validate(&self) -> Result<(), SpecError> {
        check_name("name", &self.name, false)?;
        check_name("user", &self.user, true)?;
        check_name("partition", &self.partition, false)?;
        match (self.command.is_empty(), self.script.is_empty()) {
            (true, true) => return Err(SpecError::new("command", "must not be empty: give a command or a script")),
            (false, false) => return Err(SpecError::new("command", "give either a command or a script, not both")),
            _ => {}
        }
        if !self.command.is_empty() {
            if self.command[0].trim().is_empty() {
                return Err(SpecError::new("command", "the program name (first argument) must not be empty"));
            }
            if self.command.len() > ARGS_MAX {
                return Err(SpecError::new("command", format!("must have at most {ARGS_MAX} arguments")));
            }
            let bytes: usize = self.command.iter().map(|a| a.len() + 1).sum();
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
        check_range("time_limit_s", self.time_limit_s, 1, TIME_LIMIT_S_MAX)?;
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
        let cpus = u64::from(self.tasks_per_node) * u64::from(self.cpus_per_task);
        if cpus > u64::from(CPUS_PER_TASK_MAX) * 4 {
            return Err(SpecError::new(
                "cpus_per_task",
                format!("tasks_per_node × cpus_per_task must be at most {}, got {cpus}", CPUS_PER_TASK_MAX * 4),
            ));
        }
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
            (JobSpec { time_limit_s: 0, ..ok_spec() }, "time_limit_s"),
            (JobSpec { time_limit_s: TIME_LIMIT_S_MAX + 1, ..ok_spec() }, "time_limit_s"),
            (JobSpec { script: "x".repeat(SCRIPT_BYTES_MAX + 1), command: vec![], ..ok_spec() }, "script"),
            (JobSpec { workdir: "relative/dir".into(), ..ok_spec() }, "workdir"),
            (JobSpec { user: String::new(), ..ok_spec() }, "user"),
        ];
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
