//! `gangway events`: job and node events as they happen (or from a past log
//! index), as lines or JSON, surviving controller failovers.

use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use crate::output::Output;

#[derive(Args, Debug)]
pub struct EventsArgs {
    /// Start at this log index (each line shows its index; after a
    /// disconnect, pass the last one seen). Default: from now.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Only these kinds (submitted, started, finished, preempted, requeued,
    /// pending, suspended, resumed, step_started, step_ended, node_registered, node_up, node_drain, node_down,
    /// gpu_quarantined, gpu_healthy).
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// Only this job's events.
    #[arg(long)]
    job: Option<u64>,
    /// Stop after this many events.
    #[arg(long)]
    count: Option<u64>,
    /// The audit trail instead (admins): every call a replica refused and
    /// every admin action it allowed, merged from all replicas.
    #[arg(long, conflicts_with_all = ["from", "kinds", "job"])]
    audit: bool,
}

const KINDS: &[&str] = &[
    "submitted",
    "started",
    "finished",
    "preempted",
    "requeued",
    "pending",
    "suspended",
    "resumed",
    "step_started",
    "step_ended",
    "usage",
    "node_registered",
    "node_up",
    "node_drain",
    "node_down",
    "gpu_quarantined",
    "gpu_healthy",
];

fn line(e: &pb::ClusterEvent) -> String {
    let state = crate::slurm::state_name(e.state);
    let what = if let Some(step) = e.step {
        let step_state = crate::slurm::state_name(e.step_state);
        format!("job {}.{step} {step_state} attempt {}", e.job_id, e.attempt)
    } else if e.job_id != 0 {
        format!("job {} {state} attempt {}", e.job_id, e.attempt)
    } else if let Some(g) = e.gpu {
        format!("node {} GPU {g}", e.node)
    } else {
        format!("node {}", e.node)
    };
    let reason = if e.reason.is_empty() { String::new() } else { format!(": {}", e.reason) };
    format!("{:>8} {:<16} {what}{reason}", e.index, e.kind)
}

pub async fn run(client: &Client, out: &Output, a: EventsArgs) -> anyhow::Result<()> {
    for k in &a.kinds {
        if !KINDS.contains(&k.as_str()) {
            anyhow::bail!("--kinds: '{k}' is not an event kind ({})", KINDS.join(", "));
        }
    }
    if a.count == Some(0) {
        anyhow::bail!("--count: must be at least 1");
    }
    if a.audit {
        return audit(client, out, a.count).await;
    }
    let mut left = a.count;
    gangway_proto::events::follow(client, a.from, |e| {
        if !a.kinds.is_empty() && !a.kinds.contains(&e.kind) {
            return true;
        }
        if a.job.is_some_and(|j| j != e.job_id) {
            return true;
        }
        if out.json {
            let v = serde_json::json!({
                "index": e.index, "kind": e.kind, "job_id": (e.job_id != 0).then_some(e.job_id),
                "state": (e.job_id != 0).then(|| crate::slurm::state_name(e.state)),
                "attempt": (e.job_id != 0).then_some(e.attempt),
                "node": (!e.node.is_empty()).then_some(&e.node), "gpu": e.gpu, "reason": e.reason,
                "step": e.step, "step_state": e.step.map(|_| crate::slurm::state_name(e.step_state)),
            });
            println!("{v}");
        } else {
            println!("{}", crate::output::printable(&line(e)));
        }
        match left.as_mut() {
            Some(n) => {
                *n -= 1;
                *n > 0
            }
            None => true,
        }
    })
    .await?;
    Ok(())
}

/// Every replica's audit trail, merged as entries arrive (each replica keeps
/// its own: a call is refused where it arrives). A replica that cannot be
/// reached is said once on stderr; the others go on.
async fn audit(client: &Client, out: &Output, count: Option<u64>) -> anyhow::Result<()> {
    use futures::StreamExt;
    use gangway_proto::v1::admin_service_client::AdminServiceClient;
    let mut streams = Vec::new();
    for (ep, ch) in client.endpoints().iter().zip(client.channels()) {
        let req = client.stream_request(pb::AuditRequest { from_seq: 0 });
        match AdminServiceClient::new(ch.clone()).audit(req).await {
            Ok(s) => streams.push(s.into_inner()),
            Err(s) if s.code() == tonic::Code::PermissionDenied || s.code() == tonic::Code::Unauthenticated => {
                return Err(s.into())
            }
            Err(s) => eprintln!("gangway: {ep}: {}", gangway_proto::client::describe(&s)),
        }
    }
    if streams.is_empty() {
        anyhow::bail!("no replica's audit trail could be read");
    }
    let mut merged = futures::stream::select_all(streams);
    let mut left = count;
    while let Some(e) = merged.next().await {
        let e = e?;
        if out.json {
            println!(
                "{}",
                serde_json::json!({"replica": e.replica_id, "seq": e.seq, "time_ms": e.time_ms, "caller": e.caller,
                    "action": e.action, "target": e.target, "outcome": e.outcome, "reason": e.reason})
            );
        } else {
            let target = if e.target.is_empty() { String::new() } else { format!(" {}", e.target) };
            let text = format!("{} {}{target}: {}", e.caller, e.action, e.reason);
            println!(
                "{} replica {} #{:<5} {:<15} {}",
                crate::slurm::timestamp(e.time_ms),
                e.replica_id,
                e.seq,
                e.outcome,
                crate::output::printable(&text)
            );
        }
        if let Some(n) = left.as_mut() {
            *n -= 1;
            if *n == 0 {
                break;
            }
        }
    }
    Ok(())
}
