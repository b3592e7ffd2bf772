//! `gangway events`: job and node events as they happen (or from a past log
//! index), as lines or JSON, surviving controller failovers.

use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use crate::commands::Output;

#[derive(Args, Debug)]
pub struct EventsArgs {
    /// Start at this log index (each line shows its index; after a
    /// disconnect, pass the last one seen). Default: from now.
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// Only these kinds (submitted, started, finished, preempted, requeued,
    /// pending, node_registered, node_up, node_drain, node_down,
    /// gpu_quarantined, gpu_healthy).
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// Only this job's events.
    #[arg(long)]
    job: Option<u64>,
    /// Stop after this many events.
    #[arg(long)]
    count: Option<u64>,
}

const KINDS: &[&str] = &[
    "submitted",
    "started",
    "finished",
    "preempted",
    "requeued",
    "pending",
    "node_registered",
    "node_up",
    "node_drain",
    "node_down",
    "gpu_quarantined",
    "gpu_healthy",
];

fn line(e: &pb::ClusterEvent) -> String {
    let state = crate::slurm::state_name(e.state);
    let what = if e.job_id != 0 {
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
            });
            println!("{v}");
        } else {
            println!("{}", line(e));
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
