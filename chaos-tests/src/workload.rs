//! Concurrent clients submitting short real jobs (some of them 2-node gangs)
//! with idempotency keys while faults happen; every call goes to the history.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use gangway_proto::v1::job_service_client::JobServiceClient;

use crate::history::{History, Outcome, Submit};

/// Pause between one client's submits: three clients then offer about as many
/// jobs as two 4-GPU agents run (so the queue drains after the faults); the
/// throughput benchmark is elsewhere.
const SUBMIT_PAUSE: Duration = Duration::from_millis(150);

/// The job a chaos submit runs: a short real process that leaves an execution
/// record (node, job, attempt) in `records`.
pub fn job_spec(key: &str, records: &str, gang: bool) -> pb::JobSpec {
    // A stopped task (SIGTERM first) still records its end, so that attempts
    // and GPU use can be told apart in time.
    let script = format!(
        "#!/bin/sh\nrec() {{ echo \"$1 $SLURMD_NODENAME $SLURM_JOB_ID $GANGWAY_ATTEMPT $CUDA_VISIBLE_DEVICES $(date +%s%N)\" >> {records}/$SLURMD_NODENAME.log; }}\ntrap 'rec end; exit 143' TERM\nrec start\nsleep 0.2\nrec end\n"
    );
    pb::JobSpec {
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

/// Runs `clients` submitters until `until`; each 5th job is a 2-node gang.
pub async fn run(client: Arc<Client>, history: Arc<History>, clients: usize, until: Instant, records: String) {
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (client, history, records) = (client.clone(), history.clone(), records.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < until {
                n += 1;
                let key = format!("{c}-{n}-{}", uuid::Uuid::new_v4().simple());
                let req = pb::SubmitRequest {
                    spec: Some(job_spec(&key, &records, n.is_multiple_of(5))),
                    idempotency_key: key.clone(),
                };
                let invoked = Instant::now();
                let r = client
                    .call(|ch| {
                        let r = client.request(req.clone());
                        async move { JobServiceClient::new(ch).submit(r).await }
                    })
                    .await;
                let outcome = match r {
                    Ok(resp) => Outcome::Ok(resp.into_inner().job_id),
                    Err(s) if matches!(s.code(), tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted) => {
                        Outcome::Fail(s.message().to_string())
                    }
                    Err(s) => Outcome::Unknown(format!("{:?}: {}", s.code(), s.message())),
                };
                history.record(Submit { key, invoked, completed: Instant::now(), outcome });
                tokio::time::sleep(SUBMIT_PAUSE).await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}
