//! Sending a job: `gangway submit` (and what `sbatch` sends), `--test-only`,
//! and what is printed back.

use anyhow::bail;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use serde_json::json;

use crate::jobspec::{job_spec, umask_env, SubmitArgs};
use crate::output::Output;
use crate::{jobctl, policy};

/// Submits; the job id and how many jobs (an array's elements) it made.
pub async fn submit(client: &Client, out: &Output, a: SubmitArgs) -> anyhow::Result<(u64, u32)> {
    // --switches names the lowest topology level, which the policy defines.
    let leaf_level = match (&a.topology, &a.switches) {
        (None, Some(_)) => {
            let policy = policy::fetch_policy(client, true).await?.0;
            let Some(level) = policy.topology_levels.last() else {
                bail!("switches: this cluster defines no topology levels (gangway admin set --topology-levels ...)")
            };
            Some(level.clone())
        }
        _ => None,
    };
    let (key, parsable, priority, held) = (a.idempotency_key.clone(), a.parsable, a.priority, a.hold);
    let mut spec = job_spec(a, leaf_level.as_deref())?;
    let Some(priority) = priority else {
        return send_submit(client, out, spec, key, parsable).await;
    };
    // --priority: admins only, checked before anything is submitted; the job is
    // submitted held, given its priority, then released (unless -H).
    let policy = policy::fetch_policy(client, false).await?.0;
    let me = client.identity();
    if !(policy.lists(&policy.admins, me) || policy.is_operator(me)) {
        let user = gangway_core::policy::identity_name(me);
        bail!("--priority: only operators and admins may set a job's priority ({user} is neither)");
    }
    spec.hold = true;
    let id = send_submit_quiet(client, spec, key).await?;
    use pb::update_job_request::Change;
    let set = jobctl::change_jobs_quiet(client, id, Change::SetPriority, i64::from(priority)).await;
    if let Err(e) = set {
        let _ = jobctl::cancel_quiet(client, id).await;
        return Err(e.context("--priority"));
    }
    if !held {
        jobctl::change_jobs_quiet(client, id, Change::Release, 0).await?;
    }
    if out.json {
        out.print_json(&json!({"job_id": id, "priority": priority}));
    } else if parsable {
        println!("{id}");
    } else {
        println!("Submitted batch job {id}");
    }
    Ok((id, 1))
}

/// Submits `spec` and returns the job id, printing nothing.
async fn send_submit_quiet(client: &Client, mut spec: pb::JobSpec, key: Option<String>) -> anyhow::Result<u64> {
    umask_env(&mut spec);
    let key = key.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: key };
    Ok(client.job_submit(req.clone()).await?.into_inner().job_id)
}

/// `sbatch --test-only`: where and when the job would start, submitting nothing.
pub(crate) async fn test_submit(client: &Client, out: &Output, a: SubmitArgs) -> anyhow::Result<()> {
    let leaf_level = match (&a.topology, &a.switches) {
        (None, Some(_)) => policy::fetch_policy(client, true).await?.0.topology_levels.last().cloned(),
        _ => None,
    };
    let spec = job_spec(a, leaf_level.as_deref())?;
    let req = pb::SubmitRequest { spec: Some(spec.clone()), idempotency_key: String::new() };
    let e = client.job_test_submit(req.clone()).await?.into_inner();
    let cpus = spec.nodes.unwrap_or(1).max(1)
        * spec.tasks_per_node.unwrap_or(1).max(1)
        * spec.cpus_per_task.unwrap_or(1).max(1);
    if out.json {
        out.print_json(&json!({
            "job_id": e.job_id, "reason": e.reason, "detail": e.detail,
            "estimated_start_ms": e.estimated_start_ms, "nodes": e.start_nodes, "cpus": cpus,
        }));
        return Ok(());
    }
    match e.estimated_start_ms {
        Some(t) => {
            let nodes = if e.start_nodes.is_empty() {
                String::new()
            } else {
                format!(" on nodes {}", crate::slurm::hostlist::compress(&e.start_nodes))
            };
            let partition =
                if spec.partition.is_empty() { String::new() } else { format!(" in partition {}", spec.partition) };
            eprintln!(
                "sbatch: Job {} to start at {} using {cpus} processors{nodes}{partition}",
                e.job_id,
                crate::slurm::timestamp(t)
            );
            Ok(())
        }
        None if e.reason == "BadConstraints" => bail!("test-only: the job could never run: {}", e.detail),
        None => {
            let (reason, detail) = (crate::output::printable(&e.reason), crate::output::printable(&e.detail));
            eprintln!("sbatch: Job {} would wait ({reason}): {detail}; no start time is known yet", e.job_id);
            Ok(())
        }
    }
}

/// Submits `spec` and prints what sbatch would: `Submitted batch job N`, or the
/// id alone with `parsable`.
pub(crate) async fn send_submit(
    client: &Client,
    out: &Output,
    mut spec: pb::JobSpec,
    key: Option<String>,
    parsable: bool,
) -> anyhow::Result<(u64, u32)> {
    umask_env(&mut spec);
    let key = key.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: key };
    let resp = client.job_submit(req.clone()).await?.into_inner();
    if out.json {
        out.print_json(&json!({"job_id": resp.job_id, "duplicate": resp.duplicate, "count": resp.count}));
    } else if parsable {
        println!("{}", resp.job_id);
    } else if resp.count > 1 {
        println!(
            "Submitted batch job {} (array of {} jobs: {}..{})",
            resp.job_id,
            resp.count,
            resp.job_id,
            resp.job_id + u64::from(resp.count) - 1
        );
    } else {
        println!("Submitted batch job {}", resp.job_id);
    }
    Ok((resp.job_id, resp.count.max(1)))
}
