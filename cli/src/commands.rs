//! The client commands that query and change jobs, nodes and the cluster
//! (`queue`, `show`, `cancel`, `nodes`, `node`, `cluster`); submitting is
//! `submit.rs`, the job spec `jobspec.rs`, printing `output.rs`, the daemons
//! `daemons.rs`.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use gangway_proto::v1::admin_service_client::AdminServiceClient;
use serde_json::{json, Value};

use crate::daemons::cert_expiry;
use crate::output::{job_json, now_ms, print_table, printable, Output};
use crate::parse;

// ---------------------------------------------------------------- queue / show / cancel

#[derive(Args)]
pub struct QueueArgs {
    /// Include finished jobs.
    #[arg(short, long)]
    all: bool,
    /// Only jobs in these states (PENDING, RUNNING, COMPLETED, ...).
    #[arg(short = 't', long = "state", value_delimiter = ',')]
    states: Vec<String>,
    #[arg(short, long)]
    user: Option<String>,
    #[arg(short = 'n', long)]
    name: Option<String>,
    /// Read from the answering replica without confirming with the leader.
    #[arg(long)]
    stale: bool,
    /// Jobs to show at most.
    #[arg(long, default_value_t = 1000)]
    limit: u32,
    #[arg(short = 'A', long)]
    account: Option<String>,
    #[arg(short = 'p', long)]
    partition: Option<String>,
}

pub async fn queue(client: &Client, out: &Output, a: QueueArgs) -> anyhow::Result<()> {
    let (mut states, mut suspended) = (Vec::new(), false);
    for s in &a.states {
        if s.eq_ignore_ascii_case("SUSPENDED") {
            suspended = true;
            continue;
        }
        let st = gangway_core::JobState::parse(s).ok_or_else(|| {
            anyhow::anyhow!(
                "state: '{s}' is not a job state (PENDING, RUNNING, SUSPENDED, COMPLETED, FAILED, CANCELLED, TIMEOUT, \
                 NODE_FAIL, DEADLINE)"
            )
        })?;
        states.push(st);
    }
    let states: Vec<i32> = if states.is_empty() && !suspended && !a.all {
        crate::slurm::LIVE_STATES.to_vec()
    } else {
        let named = states
            .iter()
            .map(|s| gangway_proto::job_state_named(s.as_str()).unwrap_or(pb::JobState::Unspecified) as i32);
        named.chain(suspended.then_some(pb::JobState::Suspended as i32)).collect()
    };
    let req = pb::ListJobsRequest {
        states,
        user: a.user.unwrap_or_default(),
        name: a.name.unwrap_or_default(),
        stale: a.stale,
        limit: a.limit,
        after_id: 0,
        account: a.account.unwrap_or_default(),
        partition: a.partition.unwrap_or_default(),
        explain: true,
    };
    let resp = client.job_list(req.clone()).await?.into_inner();
    if out.json {
        out.print_json(&Value::Array(resp.jobs.iter().map(job_json).collect()));
        return Ok(());
    }
    let now = now_ms();
    let rows: Vec<Vec<String>> = resp
        .jobs
        .iter()
        .map(|j| {
            let spec = j.spec.clone().unwrap_or_default();
            let elapsed = match (j.start_time_ms, j.end_time_ms) {
                (Some(s), Some(e)) => e.saturating_sub(s) / 1000,
                (Some(s), None) => now.saturating_sub(s) / 1000,
                _ => 0,
            };
            let where_ = if !j.allocation.is_empty() {
                j.allocation.iter().map(|a| a.node.as_str()).collect::<Vec<_>>().join(",")
            } else if !j.reason.is_empty() {
                format!("({})", j.reason)
            } else {
                j.ran_on.join(",")
            };
            vec![
                if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() },
                spec.partition,
                spec.name,
                spec.user,
                crate::slurm::state_name(j.state).to_string(),
                parse::duration(elapsed),
                spec.nodes.unwrap_or(1).to_string(),
                spec.gpus_per_node.unwrap_or(0).to_string(),
                where_,
            ]
        })
        .collect();
    print_table(
        &["JOBID", "PARTITION", "NAME", "USER", "STATE", "TIME", "NODES", "GPUS/NODE", "NODELIST(REASON)"],
        &rows,
    );
    if resp.next_after_id != 0 {
        eprintln!("(more jobs not shown; raise --limit)");
    }
    Ok(())
}

pub async fn show(client: &Client, out: &Output, job_id: u64, stale: bool) -> anyhow::Result<()> {
    let req = pb::GetJobRequest { job_id, stale };
    let got = client.job_get(req).await;
    // A job the state no longer holds: from the accounting database, if any.
    let (job, stored) = match got {
        Ok(j) => (j.into_inner(), false),
        Err(s) if s.code() == tonic::Code::NotFound => match stored_job(client, job_id).await {
            Some(j) => (j, true),
            None => return Err(s.into()),
        },
        Err(s) => return Err(s.into()),
    };
    let mut v = job_json(&job);
    if let (true, Value::Object(map)) = (stored, &mut v) {
        map.insert("source".into(), json!("accounting"));
    }
    // A pending job: why, in Slurm's words and Gangway's detail.
    let why = if job.state == pb::JobState::Pending as i32 {
        let r = client.job_explain(pb::ExplainRequest { job_id, stale }).await;
        r.ok().map(|r| r.into_inner())
    } else {
        None
    };
    if let (Some(e), Value::Object(map)) = (&why, &mut v) {
        let mut rej: Vec<(&String, &u32)> = e.rejections.iter().collect();
        rej.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        map.insert(
            "pending".into(),
            json!({
                "reason": e.reason, "detail": e.detail, "queue_position": e.queue_position,
                "eligible_nodes": e.eligible_nodes,
                "rejected_nodes": rej.iter().map(|(k, n)| json!({"why": k, "nodes": n})).collect::<Vec<_>>(),
                "estimated_start": e.estimated_start_ms.map(crate::slurm::timestamp),
            }),
        );
    }
    if out.json {
        out.print_json(&v);
        return Ok(());
    }
    if let Value::Object(map) = v {
        for (k, val) in map {
            if k == "pending" {
                continue;
            }
            let s = match val {
                Value::String(s) if k == "script" => crate::output::printable_text(&s).into_owned(),
                Value::String(s) => crate::output::printable(&s).into_owned(),
                Value::Null => "-".into(),
                other => crate::output::printable(&other.to_string()).into_owned(),
            };
            println!("{k:>16}: {s}");
        }
    }
    if let Some(e) = why {
        println!("{:>16}: {} ({})", "pending", printable(&e.reason), printable(&e.detail));
        if let Some(t) = e.estimated_start_ms {
            println!("{:>16}: {}", "expected start", crate::slurm::timestamp(t));
        }
        let mut rej: Vec<(String, u32)> = e.rejections.into_iter().collect();
        rej.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        for (why, n) in rej {
            println!("{:>16}: {n} node(s): {}", "rejected", printable(&why));
        }
    }
    Ok(())
}

/// Job `job_id` from the accounting database (None: no database, or not there).
async fn stored_job(client: &Client, job_id: u64) -> Option<pb::Job> {
    // Newest first below id + 1: the job itself comes first (an array's
    // elements, which the id also matches, have larger ids).
    let before_id = job_id.saturating_add(1);
    let req = pb::HistoryRequest { job_ids: vec![job_id], limit: 1, before_id, ..Default::default() };
    let resp = client.job_history(req.clone()).await.ok()?;
    resp.into_inner().jobs.into_iter().find(|j| j.id == job_id)
}

pub async fn cancel(client: &Client, out: &Output, job_ids: &[u64]) -> anyhow::Result<()> {
    let mut results = Vec::new();
    let mut failed = None;
    for &job_id in job_ids {
        let req = pb::CancelRequest { job_id };
        let r = client.job_cancel(req).await;
        match r {
            Ok(_) => {
                results.push(json!({"job_id": job_id, "cancelled": true}));
                if !out.json {
                    println!("Cancelled job {job_id}");
                }
            }
            Err(s) => {
                results.push(json!({"job_id": job_id, "cancelled": false, "error": s.message()}));
                failed = Some(anyhow::Error::new(s));
            }
        }
    }
    if out.json {
        out.print_json(&Value::Array(results));
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

// ---------------------------------------------------------------- nodes

#[derive(Subcommand)]
pub enum NodeCmd {
    /// Stop placing new work on a node; running work finishes.
    Drain {
        name: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Make a drained node available again.
    Resume { name: String },
    /// Power an elastic pool's node up (powered down) or down (idle, or a
    /// boot that failed), as `scontrol update State=POWER_UP|POWER_DOWN`.
    Power {
        name: String,
        /// `up` or `down`.
        #[arg(value_parser = ["up", "down"])]
        to: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
}

fn node_state_name(s: i32) -> &'static str {
    match pb::NodeState::try_from(s).unwrap_or(pb::NodeState::Unspecified) {
        pb::NodeState::Up => "UP",
        pb::NodeState::Drain => "DRAIN",
        pb::NodeState::Down => "DOWN",
        pb::NodeState::PoweredDown => "POWERED_DOWN",
        pb::NodeState::PoweringUp => "POWERING_UP",
        pb::NodeState::Unspecified => "UNKNOWN",
    }
}

pub(crate) fn node_json(n: &pb::Node) -> Value {
    json!({
        "name": n.name, "state": node_state_name(n.state), "reason": n.state_reason,
        "cpus": n.cpus, "cpus_alloc": n.cpus_alloc, "mem_mb": n.mem_mb, "mem_alloc_mb": n.mem_alloc_mb,
        "gpus": n.gpus.iter().map(|g| json!({"index": g.index, "uuid": g.uuid, "model": g.model, "mem_mb": g.mem_mb,
            "nvlink_island": g.nvlink_island, "healthy": g.healthy, "health_reason": g.health_reason, "allocated_to": g.allocated_to, "allocated": g.allocated || g.allocated_to.is_some()})).collect::<Vec<_>>(),
        "topology": n.topology, "labels": n.labels, "jobs": n.jobs, "last_heartbeat_age_ms": n.last_heartbeat_age_ms,
    })
}

pub async fn nodes(client: &Client, out: &Output, stale: bool) -> anyhow::Result<()> {
    let nodes = client.list_nodes(stale).await?;
    if out.json {
        out.print_json(&Value::Array(nodes.iter().map(node_json).collect()));
        return Ok(());
    }
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            let free = n.gpus.iter().filter(|g| g.healthy && !g.allocated && g.allocated_to.is_none()).count();
            let model = n.gpus.first().map(|g| g.model.clone()).unwrap_or_else(|| "-".into());
            let sick: Vec<String> = n
                .gpus
                .iter()
                .filter(|g| !g.healthy)
                .map(|g| format!("GPU {} quarantined: {}", g.index, g.health_reason))
                .collect();
            let reason = [n.state_reason.clone()]
                .into_iter()
                .chain(sick)
                .filter(|r| !r.is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            vec![
                n.name.clone(),
                node_state_name(n.state).to_string(),
                format!("{}/{}", n.cpus - n.cpus_alloc, n.cpus),
                format!("{}/{}", (n.mem_mb - n.mem_alloc_mb) / 1024, n.mem_mb / 1024),
                format!("{free}/{} {model}", n.gpus.len()),
                n.topology.join("/"),
                n.last_heartbeat_age_ms.map(|a| format!("{:.1}s ago", a as f64 / 1000.0)).unwrap_or_else(|| "-".into()),
                reason,
            ]
        })
        .collect();
    print_table(
        &["NODE", "STATE", "CPUS(free/all)", "MEM_GB(free/all)", "GPUS(free/all)", "TOPOLOGY", "HEARTBEAT", "REASON"],
        &rows,
    );
    Ok(())
}

pub async fn node(client: &Client, out: &Output, cmd: NodeCmd) -> anyhow::Result<()> {
    let node = match cmd {
        NodeCmd::Drain { name, reason } => {
            let req = pb::DrainRequest { name, reason };
            client.node_drain(req.clone()).await?
        }
        NodeCmd::Resume { name } => {
            let req = pb::ResumeRequest { name };
            client.node_resume(req.clone()).await?
        }
        NodeCmd::Power { name, to, reason } => {
            let req = pb::PowerRequest { name, up: to == "up", reason };
            client.node_power(req.clone()).await?
        }
    }
    .into_inner();
    if out.json {
        out.print_json(&node_json(&node));
    } else {
        println!("node {} is {}", node.name, node_state_name(node.state));
    }
    Ok(())
}

// ---------------------------------------------------------------- cluster

#[derive(Subcommand)]
pub enum ClusterCmd {
    /// Every replica's role, term and log positions.
    Status,
    /// Add a replica (started with `gangway controller --join`) as a learner:
    /// ADDR is HOST:PORT, or HOST:PORT/PEERPORT when it serves Raft on a peer port.
    Add { id: u64, addr: String },
    /// Make a learner a voting member.
    Promote { id: u64 },
    /// Remove a replica from the cluster.
    Remove { id: u64 },
    /// Move leadership to another voter.
    TransferLeader { id: u64 },
    /// Build a snapshot on the answering replica now.
    Snapshot,
    /// Write a consistent backup of the cluster's state to FILE (admins; the
    /// file is created 0600 and never overwritten). Restore with
    /// `gangway controller --restore FILE`.
    Backup { file: std::path::PathBuf },
}

/// The most a backup may be: far above any state a replica holds in memory
/// (a million jobs take ~1-2 GiB), so a confused server cannot fill the disk.
const BACKUP_BYTES_MAX: u64 = 64 * 1024 * 1024 * 1024;

/// A backup stream's progress: its first chunk announces the log index and
/// the size (at most [`BACKUP_BYTES_MAX`]); the chunks may not pass it.
#[derive(Debug, Default)]
struct Received {
    announced: Option<(u64, u64)>,
    written: u64,
}

impl Received {
    /// A chunk of `len` bytes, announcing `index` and `total_bytes` (the
    /// first chunk's announcement holds).
    fn chunk(&mut self, index: u64, total_bytes: u64, len: usize) -> anyhow::Result<()> {
        let (_, total) = *self.announced.get_or_insert((index, total_bytes));
        anyhow::ensure!(
            total <= BACKUP_BYTES_MAX,
            "backup: the replica announced {total} bytes, past the {BACKUP_BYTES_MAX} a backup may be"
        );
        self.written = self.written.saturating_add(len as u64);
        anyhow::ensure!(self.written <= total, "backup: the replica sent more than the {total} bytes it announced");
        Ok(())
    }

    /// The index and size of a backup received whole.
    fn whole(&self) -> anyhow::Result<(u64, u64)> {
        let (index, total) = self.announced.unwrap_or_default();
        anyhow::ensure!(self.written == total && total > 0, "backup: got {} of {total} bytes", self.written);
        Ok((index, total))
    }
}

/// Streams a backup from a replica into a new file, then checks it whole.
async fn backup(client: &Client, file: &std::path::Path) -> anyhow::Result<(u64, u64)> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut stream = client.admin_backup(pb::BackupRequest {}).await?.into_inner();
    if file.exists() {
        bail!("backup: {} exists; an existing file is never overwritten", file.display());
    }
    // Written beside the file, checked, synced, then linked into place: an
    // interrupted backup never leaves a partial file under the real name.
    let partial = file.with_file_name(format!(
        "{}.partial",
        file.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "backup".into())
    ));
    let _ = std::fs::remove_file(&partial);
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .with_context(|| format!("backup: creating {}", partial.display()))?;
    let mut received = Received::default();
    let result: anyhow::Result<(u64, u64)> = async {
        while let Some(chunk) = stream.message().await? {
            received.chunk(chunk.index, chunk.total_bytes, chunk.data.len())?;
            out.write_all(&chunk.data)?;
        }
        let whole = received.whole()?;
        out.sync_all()?;
        let bytes = std::fs::read(&partial)?;
        gangway_raft_store::backup::Backup::from_bytes(&bytes).map_err(|e| anyhow::anyhow!("backup: {e}"))?;
        // A hard link never replaces an existing file.
        std::fs::hard_link(&partial, file)
            .with_context(|| format!("backup: {} (an existing file is never overwritten)", file.display()))?;
        if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(whole)
    }
    .await;
    let _ = std::fs::remove_file(&partial);
    result
}

fn opt(v: Option<u64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

pub async fn cluster(client: &Client, out: &Output, cmd: ClusterCmd) -> anyhow::Result<()> {
    macro_rules! admin {
        ($method:ident, $req:expr) => {{
            let req = $req;
            client
                .call(|ch| {
                    let r = client.request(req.clone());
                    async move { AdminServiceClient::new(ch).$method(r).await }
                })
                .await?
                .into_inner()
        }};
    }
    let membership = |m: pb::MembershipResponse| {
        if out.json {
            out.print_json(&json!({"voters": m.voters, "learners": m.learners, "log_index": m.log_index}));
        } else {
            println!("voters: {:?}  learners: {:?}  (committed at log index {})", m.voters, m.learners, m.log_index);
        }
    };
    match cmd {
        ClusterCmd::Status => {
            let s = admin!(cluster_status, pb::ClusterStatusRequest {});
            if out.json {
                let replicas: Vec<Value> = s
                    .replicas
                    .iter()
                    .map(|r| {
                        json!({"id": r.id, "addr": r.addr, "role": r.role, "term": r.term, "leader_id": r.leader_id,
                        "voter": r.voter, "last_log_index": r.last_log_index, "commit_index": r.commit_index,
                        "applied_index": r.applied_index, "snapshot_index": r.snapshot_index,
                        "cert_not_after_unix": r.cert_not_after_unix, "error": r.error,
                        "newest_data_format": r.newest_data_format, "data_format": r.data_format,
                        "history": r.history, "history_since": r.history_since, "history_pending": r.history_pending})
                    })
                    .collect();
                out.print_json(
                    &json!({"leader_id": s.leader_id, "term": s.term, "data_format": s.data_format, "replicas": replicas}),
                );
                return Ok(());
            }
            println!("leader: {}   term: {}   format: {}", opt(s.leader_id), s.term, s.data_format);
            let rows: Vec<Vec<String>> = s
                .replicas
                .iter()
                .map(|r| {
                    vec![
                        r.id.to_string(),
                        r.addr.clone(),
                        r.role.clone(),
                        if r.voter { "voter" } else { "learner" }.to_string(),
                        r.term.to_string(),
                        opt(r.last_log_index),
                        opt(r.commit_index),
                        opt(r.applied_index),
                        opt(r.snapshot_index),
                        cert_expiry(r.cert_not_after_unix),
                        // The newest format the replica's build reads (4: a
                        // build from before formats were reported).
                        match (r.replica_role(), r.newest_data_format) {
                            (Some(gangway_proto::ReplicaRole::Unreachable), _) => "-".to_string(),
                            (_, 0) => "4".to_string(),
                            (_, n) => n.to_string(),
                        },
                        r.error.clone(),
                    ]
                })
                .collect();
            print_table(
                &[
                    "ID", "ADDR", "ROLE", "MEMBER", "TERM", "LAST_LOG", "COMMIT", "APPLIED", "SNAPSHOT", "CERT",
                    "READS", "ERROR",
                ],
                &rows,
            );
        }
        ClusterCmd::Add { id, addr } => membership(admin!(add_learner, pb::AddLearnerRequest { id, addr })),
        ClusterCmd::Promote { id } => membership(admin!(promote, pb::PromoteRequest { id })),
        ClusterCmd::Remove { id } => membership(admin!(remove_member, pb::RemoveMemberRequest { id })),
        ClusterCmd::TransferLeader { id } => {
            let r = admin!(transfer_leader, pb::TransferLeaderRequest { to: id });
            if out.json {
                out.print_json(&json!({"leader_id": r.leader_id, "term": r.term}));
            } else {
                println!("leader is now replica {} (term {})", r.leader_id, r.term);
            }
        }
        ClusterCmd::Backup { file } => {
            let (index, bytes) = backup(client, &file).await?;
            if out.json {
                out.print_json(&json!({"index": index, "bytes": bytes, "file": file}));
            } else {
                println!("backup of log index {index} ({bytes} bytes) written to {}", file.display());
            }
        }
        ClusterCmd::Snapshot => {
            let r = admin!(snapshot, pb::SnapshotRequest {});
            if out.json {
                out.print_json(&json!({"index": r.index}));
            } else {
                println!("snapshot at log index {}", r.index);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backup of BACKUP_BYTES_MAX bytes is taken; one announcing a byte
    /// more is refused at its first chunk, naming the limit. The chunks
    /// must add up to what was announced, no more and no less.
    #[test]
    fn a_backup_is_at_most_backup_bytes_max() {
        let mut r = Received::default();
        r.chunk(9, BACKUP_BYTES_MAX, 0).unwrap();
        r.chunk(0, 1, 4).unwrap();
        assert!(r.whole().unwrap_err().to_string().contains("got 4 of"), "short");
        let mut past = Received::default();
        let e = past.chunk(9, BACKUP_BYTES_MAX + 1, 10).unwrap_err().to_string();
        assert!(e.contains(&BACKUP_BYTES_MAX.to_string()), "{e}");
        let mut r = Received::default();
        r.chunk(9, 10, 6).unwrap();
        r.chunk(9, 10, 4).unwrap();
        assert_eq!(r.whole().unwrap(), (9, 10));
        assert!(r.chunk(9, 10, 1).unwrap_err().to_string().contains("more than the 10 bytes"));
        assert!(Received::default().whole().is_err(), "an empty backup");
    }
}
