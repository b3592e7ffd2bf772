//! Concurrent clients submitting short real jobs (some of them 2-node gangs)
//! with idempotency keys, cancelling and querying some of them, while faults
//! happen; every call goes to the history.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use crate::history::{Cancel, CancelOutcome, History, Outcome, Query, QueryOutcome, Submit};
use crate::Rng;

/// Pause between one client's submits: three clients then offer about as many
/// jobs as two 4-GPU agents run (so the queue drains after the faults); the
/// throughput benchmark is elsewhere.
const SUBMIT_PAUSE: Duration = Duration::from_millis(150);

/// The job a chaos submit runs: a short real process that leaves an execution
/// record (node, job, attempt) in `records`. A gang is a batch job, as sbatch
/// submits it: its script runs on the first node and `srun` starts the
/// recording task on both nodes (the second through its agent's step service).
pub fn job_spec(key: &str, records: &str, gang: bool) -> pb::JobSpec {
    // A stopped task (SIGTERM first) still records its end, so that attempts
    // and GPU use can be told apart in time.
    let task = format!(
        "rec() {{ echo \"$1 $SLURMD_NODENAME $SLURM_JOB_ID $GANGWAY_ATTEMPT $CUDA_VISIBLE_DEVICES $(date +%s%N)\" >> {records}/$SLURMD_NODENAME.log; }}; trap \"rec end; exit 143\" TERM; rec start; sleep 0.2; rec end"
    );
    let script = if gang { format!("#!/bin/sh\nexec srun sh -c '{task}'\n") } else { format!("#!/bin/sh\n{task}\n") };
    pb::JobSpec {
        batch: gang,
        name: format!("chaos-{key}"),
        user: "root".into(),
        script,
        workdir: records.to_string(),
        nodes: Some(if gang { 2 } else { 1 }),
        gpus_per_node: Some(1),
        time_limit_s: Some(600),
        output: "/dev/null".into(),
        ..Default::default()
    }
}

/// Jobs a client remembers for its cancels and queries: the most recent ones
/// (the likeliest to be still pending or running).
const RECENT_JOBS_KEPT: usize = 16;
/// One operation in this many, after a submit, is a cancel of a recent job; one
/// in `QUERY_EVERY` a query of one.
const CANCEL_EVERY: u64 = 8;
const QUERY_EVERY: u64 = 3;

/// Runs `clients` clients until `until`. Each submits (every 5th job is a
/// 2-node gang), and now and then cancels or queries one of its recent jobs;
/// `seed` makes the choices repeatable.
pub async fn run(
    client: Arc<Client>,
    history: Arc<History>,
    clients: usize,
    until: Instant,
    records: String,
    seed: u64,
) {
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (client, history, records) = (client.clone(), history.clone(), records.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(seed.wrapping_mul(31).wrapping_add(c as u64 + 1));
            let mut recent: VecDeque<u64> = VecDeque::new();
            let mut n = 0u64;
            while Instant::now() < until {
                n += 1;
                let key = format!("{c}-{n}-{}", uuid::Uuid::new_v4().simple());
                if let Some(id) = submit(&client, &history, key, &records, n.is_multiple_of(5)).await {
                    if recent.len() >= RECENT_JOBS_KEPT {
                        recent.pop_front();
                    }
                    recent.push_back(id);
                }
                if !recent.is_empty() && rng.below(CANCEL_EVERY) == 0 {
                    let job = recent[rng.below(recent.len() as u64) as usize];
                    cancel(&client, &history, job).await;
                } else if !recent.is_empty() && rng.below(QUERY_EVERY) == 0 {
                    let job = recent[rng.below(recent.len() as u64) as usize];
                    query(&client, &history, job).await;
                }
                tokio::time::sleep(SUBMIT_PAUSE).await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// Submits one job; the acknowledged id, if any.
async fn submit(client: &Client, history: &History, key: String, records: &str, gang: bool) -> Option<u64> {
    let req = pb::SubmitRequest { spec: Some(job_spec(&key, records, gang)), idempotency_key: key.clone() };
    let invoked = Instant::now();
    let r = client.job_submit(req.clone()).await;
    let outcome = match r {
        Ok(resp) => Outcome::Ok(resp.into_inner().job_id),
        Err(s) if matches!(s.code(), tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted) => {
            Outcome::Fail(s.message().to_string())
        }
        Err(s) => Outcome::Unknown(format!("{:?}: {}", s.code(), s.message())),
    };
    let id = match outcome {
        Outcome::Ok(id) => Some(id),
        _ => None,
    };
    history.record(Submit { key, invoked, completed: Instant::now(), outcome });
    id
}

async fn cancel(client: &Client, history: &History, job: u64) {
    let invoked = Instant::now();
    let r = client.job_cancel(pb::CancelRequest { job_id: job }).await;
    let outcome = match r {
        Ok(resp) => CancelOutcome::Ok { attempt: resp.into_inner().job.map_or(0, |j| j.attempt) },
        Err(s) if s.code() == tonic::Code::FailedPrecondition => CancelOutcome::AlreadyFinished,
        Err(s) => CancelOutcome::Unknown(format!("{:?}: {}", s.code(), s.message())),
    };
    let completed = Instant::now();
    history.record_cancel(Cancel { job, invoked, completed, outcome });
}

async fn query(client: &Client, history: &History, job: u64) {
    let invoked = Instant::now();
    let r = client.job_get(pb::GetJobRequest { job_id: job, stale: false }).await;
    let outcome = match r {
        Ok(j) => {
            let j = j.into_inner();
            QueryOutcome::Found { state: j.state, attempt: j.attempt }
        }
        Err(s) if s.code() == tonic::Code::NotFound => QueryOutcome::NotFound(s.message().to_string()),
        Err(s) => QueryOutcome::Unknown(format!("{:?}: {}", s.code(), s.message())),
    };
    history.record_query(Query { job, invoked, completed: Instant::now(), outcome });
}
