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

/// `s` as it may be printed on a terminal: each control character (C0,
/// DEL, C1: escape sequences, carriage returns and backspaces that could
/// rewrite what other fields or lines show) as a visible `\xHH`, and each
/// bidirectional override as `\u{HHHH}`. A job's fields are its submitter's
/// words, and a node's reasons its agent's, shown to everyone else.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    escaped(s, |_| false)
}

/// [`printable`], keeping line breaks and tabs (a script shown whole).
pub fn printable_text(s: &str) -> std::borrow::Cow<'_, str> {
    escaped(s, |c| c == '\n' || c == '\t')
}

fn escaped(s: &str, keep: impl Fn(char) -> bool) -> std::borrow::Cow<'_, str> {
    // Embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069),
    // the marks (U+200E, U+200F, U+061C) and the line and paragraph
    // separators (U+2028, U+2029).
    let bidi = |c: char| {
        matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
            || matches!(c, '\u{2028}' | '\u{2029}')
    };
    let hidden = |c: char| (c.is_control() || bidi(c)) && !keep(c);
    if !s.chars().any(hidden) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len().saturating_add(16));
    for c in s.chars() {
        match c {
            c if !hidden(c) => out.push(c),
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", u32::from(c))),
            c => out.push_str(&format!("\\u{{{:04x}}}", u32::from(c))),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Prints rows under a header, columns padded to their widest cell (each
/// cell [`printable`]).
pub(crate) fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let rows: Vec<Vec<String>> = rows.iter().map(|r| r.iter().map(|c| printable(c).into_owned()).collect()).collect();
    let rows = rows.as_slice();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What another user put in a job's fields cannot move the cursor,
    /// recolour, retitle or rewrite a terminal: every control character and
    /// bidirectional override is shown, escaped; plain text is untouched.
    #[test]
    fn fields_are_printed_with_control_characters_escaped() {
        assert!(matches!(printable("train résumé 🚀"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(printable("a\x1b]0;owned\x07b"), "a\\x1b]0;owned\\x07b");
        assert_eq!(printable("ok\r\x1b[2Kfake"), "ok\\x0d\\x1b[2Kfake");
        assert_eq!(printable("x\u{9b}31m\u{7f}"), "x\\x9b31m\\x7f");
        assert_eq!(printable("a\u{202e}gnp.exe"), "a\\u{202e}gnp.exe");
        assert_eq!(printable("x\u{200f}\u{2028}y"), "x\\u{200f}\\u{2028}y");
        assert_eq!(printable("l1\nl2\tx"), "l1\\x0al2\\x09x");
        assert_eq!(printable_text("#!/bin/sh\n\techo\x1b[31m"), "#!/bin/sh\n\techo\\x1b[31m");
    }
}
