//! How the CLI prints: JSON (`--json`) or tables, a job as JSON, and errors
//! as one line.

use gangway_proto::v1 as pb;
use serde_json::{json, Value};

pub struct Output {
    pub json: bool,
}

impl Output {
    pub(crate) fn print_json(&self, v: &Value) {
        println!("{}", serde_json::to_string_pretty(v).expect("json"));
    }
}

/// Renders an error chain as one line; gRPC statuses as `code: message`.
pub fn one_line(e: &anyhow::Error) -> String {
    if let Some(s) = e.downcast_ref::<tonic::Status>() {
        let code = match s.code() {
            tonic::Code::InvalidArgument => "invalid argument",
            tonic::Code::NotFound => "not found",
            tonic::Code::FailedPrecondition => "refused",
            tonic::Code::Unavailable => "unavailable",
            tonic::Code::ResourceExhausted => "limit reached",
            tonic::Code::DeadlineExceeded => "timed out",
            tonic::Code::Aborted => "aborted",
            tonic::Code::PermissionDenied => "permission denied",
            _ => "error",
        };
        return format!("{code}: {}", s.message()).replace('\n', " ");
    }
    format!("{e:#}").replace('\n', " ")
}

/// A job as `--json` prints it.
pub(crate) fn job_json(j: &pb::Job) -> Value {
    let spec = j.spec.clone().unwrap_or_default();
    let mut v = json!({
        "id": j.id,
        "name": spec.name,
        "user": spec.user,
        "state": crate::slurm::state_name(j.state),
        "attempt": j.attempt,
        "submitted_by": j.submitted_by,
        "submit_time_ms": j.submit_time_ms,
        "start_time_ms": j.start_time_ms,
        "end_time_ms": j.end_time_ms,
        "exit_code": j.exit_code,
        "reason": j.reason,
        "ran_on": j.ran_on,
        "command": spec.command,
        "script": spec.script,
        "workdir": spec.workdir,
        "partition": spec.partition,
        "nodes": spec.nodes,
        "tasks_per_node": spec.tasks_per_node,
        "cpus_per_task": spec.cpus_per_task,
        "mem_per_node_mb": spec.mem_per_node_mb,
        "gpus_per_node": spec.gpus_per_node,
        "gpu_type": spec.gpu_type,
        "time_limit_s": spec.time_limit_s,
        "allocation": j.allocation.iter().map(|a| json!({"node": a.node, "cpus": a.cpus, "mem_mb": a.mem_mb, "gpus": a.gpus})).collect::<Vec<_>>(),
    });
    let extra = json!({
        "display_id": j.display_id,
        "array_job_id": j.array_job_id,
        "array_index": j.array_index,
        "account": spec.account,
        "qos": spec.qos,
        "held": j.held,
        "pending_dependencies": j.pending_dependencies,
        "priority_override": j.priority_override,
        "preempted": j.preempted,
        "constraints": spec.constraints,
        "exclusive": spec.exclusive,
        "nodes_max": spec.nodes_max,
        "dependency": spec.dependency,
        "array": spec.array,
        "nice": spec.nice,
        "usage": j.usage.as_ref().map(|u| json!({
            "nodes": u.nodes, "cpu_ms": u.cpu_ms, "mem_peak_mb": u.mem_peak_mb,
            "gpu_util_pct": u.gpu_util_pct, "gpu_mem_peak_mb": u.gpu_mem_peak_mb,
        })),
    });
    if let (Value::Object(m), Value::Object(x)) = (&mut v, extra) {
        m.extend(x);
    }
    v
}

/// Milliseconds since the Unix epoch (for ages and waits shown).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Prints rows under a header, columns padded to their widest cell.
pub(crate) fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{:<w$}  ", c, w = widths[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}
