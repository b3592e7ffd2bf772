//! Job control after submit: hold, release, requeue, suspend, resume, update
//! (priority, nice, time limit) and `why` (why a job is pending).

use anyhow::bail;
use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use pb::update_job_request::Change;
use serde_json::json;

use crate::output::{printable, Output};
use crate::parse;

/// Applies one change to one job, printing nothing.
pub async fn change_jobs_quiet(client: &Client, job_id: u64, change: Change, value: i64) -> anyhow::Result<()> {
    update_quiet(client, pb::UpdateJobRequest { job_id, change: change as i32, value, ..Default::default() }).await
}

/// Sends one job a signal (`scancel --signal`), printing nothing.
pub async fn signal_quiet(client: &Client, job_id: u64, signal: i32, target: pb::SignalTarget) -> anyhow::Result<()> {
    let value = i64::from(signal);
    let change = Change::Signal as i32;
    update_quiet(client, pb::UpdateJobRequest { job_id, change, value, signal_target: target as i32 }).await
}

async fn update_quiet(client: &Client, req: pb::UpdateJobRequest) -> anyhow::Result<()> {
    client.job_update(req).await?;
    Ok(())
}

/// Cancels one job, printing nothing.
pub async fn cancel_quiet(client: &Client, job_id: u64) -> anyhow::Result<()> {
    client.job_cancel(pb::CancelRequest { job_id }).await?;
    Ok(())
}

/// Applies one change to each job, reporting each; fails if any failed.
pub async fn change_jobs(client: &Client, out: &Output, ids: &[u64], change: Change, value: i64) -> anyhow::Result<()> {
    let mut results = Vec::new();
    let mut failed = None;
    for &job_id in ids {
        let req = pb::UpdateJobRequest { job_id, change: change as i32, value, ..Default::default() };
        let r = client.job_update(req).await;
        match r {
            Ok(_) => {
                if !out.json {
                    let done = match change {
                        Change::Hold | Change::AdminHold => "held",
                        Change::Release => "released",
                        Change::Requeue => "requeued",
                        Change::RequeueHold => "requeued and held",
                        Change::SetPriority => "priority set",
                        Change::ClearPriority => "priority back to computed",
                        Change::SetNice => "nice set",
                        Change::SetTimeLimit => "time limit set",
                        Change::Suspend => "suspended",
                        Change::Signal => "signalled",
                        Change::Resume => "resumed",
                        Change::Unspecified => "unchanged",
                    };
                    println!("job {job_id}: {done}");
                }
                results.push(json!({"job_id": job_id, "ok": true}));
            }
            Err(s) => {
                results.push(json!({"job_id": job_id, "ok": false, "error": s.message()}));
                if !out.json {
                    eprintln!("job {job_id}: {}", crate::output::one_line(&anyhow::Error::new(s.clone())));
                }
                failed = Some(anyhow::Error::new(s));
            }
        }
    }
    if out.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    match failed {
        Some(e) if ids.len() == 1 => Err(e),
        Some(_) => bail!("some jobs were not changed (see above)"),
        None => Ok(()),
    }
}

#[derive(Args)]
pub struct UpdateArgs {
    pub job_id: u64,
    /// Set an absolute priority (admins); `--priority clear` returns to the computed one.
    #[arg(long)]
    priority: Option<String>,
    /// Nice value (negative: admins only).
    #[arg(long, allow_hyphen_values = true)]
    nice: Option<i64>,
    /// New time limit (only admins may raise it).
    #[arg(short = 't', long)]
    time: Option<String>,
}

pub async fn update(client: &Client, out: &Output, a: UpdateArgs) -> anyhow::Result<()> {
    let mut changes = Vec::new();
    if let Some(p) = &a.priority {
        if p == "clear" {
            changes.push((Change::ClearPriority, 0));
        } else {
            let v: i64 = p.parse().map_err(|_| anyhow::anyhow!("priority: '{p}' must be a number or 'clear'"))?;
            changes.push((Change::SetPriority, v));
        }
    }
    if let Some(n) = a.nice {
        changes.push((Change::SetNice, n));
    }
    if let Some(t) = &a.time {
        changes.push((Change::SetTimeLimit, parse::job_time_s("--time", t).map_err(anyhow::Error::msg)? as i64));
    }
    if changes.is_empty() {
        bail!("update: nothing to change; give --priority, --nice or --time");
    }
    for (c, v) in changes {
        change_jobs(client, out, &[a.job_id], c, v).await?;
    }
    Ok(())
}

pub async fn why(client: &Client, out: &Output, job_id: u64, stale: bool) -> anyhow::Result<()> {
    let e = client.job_explain(pb::ExplainRequest { job_id, stale }).await?.into_inner();
    if out.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "job_id": e.job_id, "reason": e.reason, "detail": e.detail, "priority": e.priority,
                "priority_factors": e.priority_factors, "eligible_nodes": e.eligible_nodes,
                "rejections": e.rejections, "queue_position": e.queue_position,
            }))?
        );
        return Ok(());
    }
    if e.reason.is_empty() {
        println!("job {job_id}: {}", printable(&e.detail));
        return Ok(());
    }
    println!("job {job_id} is pending: {} — {}", printable(&e.reason), printable(&e.detail));
    let f = &e.priority_factors;
    let get = |k: &str| f.get(k).copied().unwrap_or(0.0);
    println!(
        "priority {:.1} (age {:.3}, fairshare {:.3}, size {:.3}, qos {:.3}, partition {:.3}, nice {}), position {} in the queue",
        e.priority,
        get("age"),
        get("fairshare"),
        get("job_size"),
        get("qos"),
        get("partition"),
        get("nice"),
        e.queue_position
    );
    println!("nodes that could take it now: {}", e.eligible_nodes);
    let mut rej: Vec<_> = e.rejections.iter().collect();
    rej.sort_by(|a, b| b.1.cmp(a.1));
    for (why, n) in rej {
        println!("  {n:>6} node(s): {}", printable(why));
    }
    Ok(())
}
