//! `sacct`: the job history (finished jobs too), from the replicated state, so
//! it survives a controller failover. Gangway keeps the last 100,000 finished
//! jobs. A batch job that started also gets its batch step's line
//! (`12.batch`: the script, on the first node; it ends with the job), then
//! its srun steps (`12.0`, `12.1`, ...: recorded by srun in the replicated
//! history). `-X` shows allocations only.

use anyhow::bail;
use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use super::format::{self, Item};
use super::{elapsed, identity_user, job_cpus, job_elapsed_s, job_nodelist, job_nodes, timestamp, JobSel};
use crate::output::Output;

/// Jobs per page read from the accounting database.
const HISTORY_PAGE_ROWS: u32 = 10_000;
/// Pages one sacct reads at most (the newest 200,000 matching jobs; narrow
/// the query with -S, -u or -A for older ones).
const HISTORY_PAGES_MAX: usize = 20;

/// Finished jobs from the accounting database; none when the replicas have
/// no database (`--accounting-database`), with a notice when it fails.
async fn stored_history(client: &Client, req: pb::HistoryRequest) -> anyhow::Result<Vec<pb::Job>> {
    let jobs =
        history_pages(req, |req| async move { client.job_history(req.clone()).await.map(tonic::Response::into_inner) })
            .await;
    Ok(jobs)
}

/// The history's pages (`fetch(req)`, newest first), [`HISTORY_PAGES_MAX`]
/// at most, saying on stderr when more match or the database fails.
async fn history_pages<F, Fut>(mut req: pb::HistoryRequest, mut fetch: F) -> Vec<pb::Job>
where
    F: FnMut(pb::HistoryRequest) -> Fut,
    Fut: std::future::Future<Output = Result<pb::ListJobsResponse, tonic::Status>>,
{
    let mut jobs = Vec::new();
    for page in 0..HISTORY_PAGES_MAX {
        let resp = match fetch(req.clone()).await {
            Ok(resp) => resp,
            Err(s) if s.code() == tonic::Code::FailedPrecondition || s.code() == tonic::Code::Unimplemented => {
                return jobs
            }
            Err(s) => {
                eprintln!("sacct: the job history before what the cluster keeps is not shown: {}", s.message());
                return jobs;
            }
        };
        let full = resp.jobs.len() == req.limit as usize;
        let next = match resp.next_after_id {
            0 => resp.jobs.last().map_or(0, |j| j.id),
            n => n + 1,
        };
        jobs.extend(resp.jobs);
        if (!full && resp.next_after_id == 0) || next == 0 {
            return jobs;
        }
        if page + 1 == HISTORY_PAGES_MAX {
            eprintln!("sacct: more than {} jobs match in the history; narrow it with -S, -u or -A", jobs.len());
        }
        req.before_id = next;
    }
    jobs
}

const DEFAULT_FIELDS: &str = "JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode";
const BRIEF_FIELDS: &str = "JobID,State,ExitCode";
const LONG_FIELDS: &str = "JobID,JobIDRaw,JobName,Partition,Account,User,AllocCPUS,AllocNodes,AllocTRES,\
                           State,ExitCode,Submit,Start,End,Elapsed,Timelimit,NodeList,Restarts";

#[derive(Args, Debug, Default)]
pub struct SacctArgs {
    /// Jobs: 12, 12_3, 12 for a whole array.
    #[arg(short = 'j', long = "jobs", value_delimiter = ',')]
    jobs: Vec<String>,
    #[arg(short = 'u', long = "user", value_delimiter = ',')]
    users: Vec<String>,
    /// Every user's jobs (the default for root).
    #[arg(short = 'a', long = "allusers")]
    all_users: bool,
    #[arg(short = 'A', long = "accounts", value_delimiter = ',')]
    accounts: Vec<String>,
    #[arg(short = 'r', long = "partition", value_delimiter = ',')]
    partitions: Vec<String>,
    #[arg(long = "name", value_delimiter = ',')]
    names: Vec<String>,
    /// States: CD, F, CA, TO, NF, R, PD (or names).
    #[arg(short = 's', long = "state", value_delimiter = ',')]
    states: Vec<String>,
    /// Jobs that ended (or run) at or after: YYYY-MM-DD[THH:MM[:SS]], now, now-2hours.
    #[arg(short = 'S', long = "starttime")]
    start: Option<String>,
    /// Jobs that started at or before this time.
    #[arg(short = 'E', long = "endtime")]
    end: Option<String>,
    /// Fields, e.g. JobID,JobName%30,State,Elapsed,AllocTRES.
    #[arg(short = 'o', long = "format")]
    format: Option<String>,
    #[arg(short = 'b', long)]
    brief: bool,
    #[arg(short = 'l', long)]
    long: bool,
    #[arg(short = 'n', long = "noheader")]
    noheader: bool,
    /// `|` between fields, none after the last.
    #[arg(short = 'P', long = "parsable2")]
    parsable2: bool,
    /// `|` between fields and after the last.
    #[arg(short = 'p', long = "parsable")]
    parsable: bool,
    /// Allocations only: no `.batch` step lines.
    #[arg(short = 'X', long = "allocations")]
    allocations: bool,
}

const FIELDS: &[&str] = &[
    "JobID",
    "JobIDRaw",
    "JobName",
    "Partition",
    "Account",
    "User",
    "AllocCPUS",
    "NCPUS",
    "AllocNodes",
    "NNodes",
    "AllocTRES",
    "ReqCPUS",
    "ReqMem",
    "State",
    "ExitCode",
    "Submit",
    "Start",
    "End",
    "Elapsed",
    "ElapsedRaw",
    "Timelimit",
    "NodeList",
    "QOS",
    "WorkDir",
    "Restarts",
    "Reason",
    "Comment",
    "Eligible",
    "Reservation",
    "Suspended",
];

/// sacct's column widths (JobID and NodeList left-justified, the rest right).
fn width(key: &str) -> (usize, bool) {
    match key {
        "JobID" | "JobIDRaw" => (12, false),
        "NodeList" | "WorkDir" | "AllocTRES" => (15, false),
        "ExitCode" => (8, true),
        "Submit" | "Start" | "End" => (19, true),
        _ => (10, true),
    }
}

pub fn field(j: &pb::Job, key: &str, now: u64) -> String {
    let s = super::spec(j);
    let ran = j.start_time_ms.is_some();
    match key {
        "JobID" => {
            if j.display_id.is_empty() {
                j.id.to_string()
            } else {
                j.display_id.clone()
            }
        }
        // A step line: the job's raw id with the step's suffix.
        "JobIDRaw" if j.display_id.contains('.') => {
            format!("{}.{}", j.id, j.display_id.rsplit('.').next().unwrap_or_default())
        }
        "JobIDRaw" => j.id.to_string(),
        "JobName" => s.name.clone(),
        "Partition" => s.partition.clone(),
        "Account" => s.account.clone(),
        "User" => s.user.clone(),
        "AllocCPUS" | "NCPUS" if !ran => "0".into(),
        "AllocCPUS" | "NCPUS" | "ReqCPUS" => job_cpus(j).to_string(),
        "AllocNodes" if !ran => "0".into(),
        "AllocNodes" | "NNodes" => job_nodes(j).to_string(),
        "AllocTRES" if !ran => String::new(),
        "AllocTRES" => {
            let gpus = s.gpus_per_node.unwrap_or(0) as u64 * job_nodes(j);
            let mem = s.mem_per_node_mb.unwrap_or(0) as u64 * job_nodes(j);
            let mut t = format!("cpu={}", job_cpus(j));
            if gpus > 0 {
                t.push_str(&format!(",gres/gpu={gpus}"));
            }
            if mem > 0 {
                t.push_str(&format!(",mem={mem}M"));
            }
            t.push_str(&format!(",node={}", job_nodes(j)));
            t
        }
        "ReqMem" => match (s.mem_per_node_mb.unwrap_or(0), s.mem_per_cpu_mb) {
            (0, 0) => "0".into(),
            (0, c) => format!("{c}Mc"),
            (n, _) => format!("{n}M"),
        },
        "State" => super::state_name(j.state).into(),
        "ExitCode" => format!("{}:{}", j.exit_code.unwrap_or(0), j.exit_signal.unwrap_or(0)),
        "Submit" => timestamp(j.submit_time_ms),
        "Start" => j.start_time_ms.map_or("Unknown".into(), timestamp),
        "End" => j.end_time_ms.map_or("Unknown".into(), timestamp),
        "Elapsed" => elapsed(job_elapsed_s(j, now)),
        "ElapsedRaw" => job_elapsed_s(j, now).to_string(),
        "Timelimit" => s.time_limit_s.filter(|t| *t > 0).map_or("UNLIMITED".into(), |t| super::duration(t as u64)),
        "NodeList" if !ran => "None assigned".into(),
        "NodeList" => job_nodelist(j),
        "QOS" => s.qos.clone(),
        "WorkDir" => s.workdir.clone(),
        "Restarts" => j.attempt.saturating_sub(1).to_string(),
        "Comment" => s.comment.clone(),
        "Reservation" => s.reservation.clone(),
        "Suspended" => elapsed(super::job_suspended_s(j, now)),
        "Eligible" => timestamp(s.begin_time_ms.max(j.submit_time_ms)),
        "Reason" if j.reason.is_empty() => "None".into(),
        "Reason" => j.reason.clone(),
        _ => String::new(),
    }
}

pub async fn run(client: &Client, out: &Output, identity: &str, a: SacctArgs) -> anyhow::Result<()> {
    let sels: Vec<JobSel> =
        a.jobs.iter().map(|s| JobSel::parse("--jobs", s)).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let fields = match (&a.format, a.brief, a.long) {
        (Some(f), _, _) => f.as_str(),
        (None, true, _) => BRIEF_FIELDS,
        (None, false, true) => LONG_FIELDS,
        (None, false, false) => DEFAULT_FIELDS,
    };
    let mut items = format::parse_names(fields, "--format", FIELDS, None).map_err(anyhow::Error::msg)?;
    for i in &mut items {
        if let Item::Field { key, width: w @ None, right } = i {
            let (dw, dr) = width(key);
            *w = Some(dw);
            *right = dr;
        }
    }
    let states = super::parse_states("--state", &a.states).map_err(anyhow::Error::msg)?;
    let now = super::now_ms();
    let since = a
        .start
        .as_deref()
        .map(|s| crate::parse::parse_time("--starttime", s, now))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let until = a
        .end
        .as_deref()
        .map(|s| crate::parse::parse_time("--endtime", s, now))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    // Your own jobs unless you ask for others' (root sees everyone's, as in Slurm).
    let me = identity_user(identity);
    let users: Vec<String> = if !a.users.is_empty() {
        a.users.clone()
    } else if a.all_users || me == "root" || !sels.is_empty() {
        Vec::new()
    } else {
        vec![me]
    };
    let one = |v: &[String]| if v.len() == 1 { v[0].clone() } else { String::new() };
    let listing = super::Listing {
        states: states.clone(),
        user: one(&users),
        partition: one(&a.partitions),
        account: one(&a.accounts),
        explain: false,
    };
    let any = |f: &[String], v: &str| f.is_empty() || f.iter().any(|x| x == v);
    let mut found = super::list_jobs(client, &listing).await?;
    // What the state no longer holds, from the accounting database (where
    // the replicas have one); the state's copy wins where both have a job.
    let history = pb::HistoryRequest {
        job_ids: sels.iter().map(|s| s.id).collect(),
        users: users.clone(),
        accounts: a.accounts.clone(),
        partitions: a.partitions.clone(),
        names: a.names.clone(),
        states: states.clone(),
        ended_after_ms: since.unwrap_or(0),
        started_before_ms: until.unwrap_or(0),
        limit: HISTORY_PAGE_ROWS,
        before_id: 0,
    };
    let known: std::collections::BTreeSet<u64> = found.iter().map(|j| j.id).collect();
    found.extend(stored_history(client, history).await?.into_iter().filter(|j| !known.contains(&j.id)));
    found.sort_by_key(|j| j.id);
    let jobs: Vec<pb::Job> = found
        .into_iter()
        .flat_map(super::het_components)
        .filter(|j| sels.is_empty() || sels.iter().any(|s| s.matches(j)))
        .filter(|j| {
            let s = super::spec(j);
            any(&users, &s.user)
                && any(&a.partitions, &s.partition)
                && any(&a.accounts, &s.account)
                && any(&a.names, &s.name)
        })
        .filter(|j| since.is_none_or(|t| j.end_time_ms.is_none_or(|e| e >= t)))
        .filter(|j| until.is_none_or(|t| j.start_time_ms.or(Some(j.submit_time_ms)).is_some_and(|s| s <= t)))
        .collect();
    if out.json {
        let v: Vec<serde_json::Value> = jobs
            .iter()
            .map(|j| {
                let m: serde_json::Map<String, serde_json::Value> =
                    FIELDS.iter().map(|k| (k.to_string(), serde_json::Value::String(field(j, k, now)))).collect();
                serde_json::Value::Object(m)
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "jobs": v }))?);
        return Ok(());
    }
    if a.parsable && a.parsable2 {
        bail!("--parsable: give -p or -P, not both");
    }
    let parsable = a.parsable || a.parsable2;
    if !a.noheader {
        println!("{}", format::render_columns(&items, |k| k.to_string(), parsable, a.parsable));
        if !parsable {
            let dashes: Vec<Item> = items
                .iter()
                .map(|i| match i {
                    Item::Field { width, .. } => Item::Text("-".repeat(width.unwrap_or(10))),
                    t => t.clone(),
                })
                .collect();
            println!("{}", format::render_columns(&dashes, |_| String::new(), false, false));
        }
    }
    for j in &jobs {
        println!("{}", format::render_columns(&items, |k| field(j, k, now), parsable, a.parsable));
        if a.allocations {
            continue;
        }
        for step in batch_step(j).into_iter().chain(srun_steps(j)) {
            println!("{}", format::render_columns(&items, |k| field(&step, k, now), parsable, a.parsable));
        }
    }
    Ok(())
}

/// A started batch job's batch step, as sacct shows it: `ID.batch`, named
/// `batch`, on the first node, with the job's state, times and exit code.
fn batch_step(j: &pb::Job) -> Option<pb::Job> {
    let s = j.spec.as_ref().filter(|s| s.batch)?;
    j.start_time_ms?;
    // A heterogeneous job's script runs in component 0.
    if j.display_id.rsplit_once('+').is_some_and(|(_, k)| k != "0") {
        return None;
    }
    let id = if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() };
    let spec = pb::JobSpec { name: "batch".into(), partition: String::new(), nodes: Some(1), ..s.clone() };
    Some(pb::Job {
        display_id: format!("{id}.batch"),
        spec: Some(spec),
        allocation: j.allocation.iter().take(1).cloned().collect(),
        ran_on: j.ran_on.iter().take(1).cloned().collect(),
        ..j.clone()
    })
}

/// The job's srun steps as sacct shows them: `ID.N`, named after their
/// program, on their nodes, with their own state, times and exit code.
fn srun_steps(j: &pb::Job) -> Vec<pb::Job> {
    let id = if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() };
    let job_nodes: Vec<String> =
        if j.allocation.is_empty() { j.ran_on.clone() } else { j.allocation.iter().map(|a| a.node.clone()).collect() };
    j.steps
        .iter()
        .map(|s| {
            let nodes = if s.nodes.is_empty() { job_nodes.clone() } else { s.nodes.clone() };
            let spec = j.spec.clone().unwrap_or_default();
            let spec = pb::JobSpec {
                name: s.name.clone(),
                partition: String::new(),
                nodes: Some(nodes.len() as i64),
                tasks_per_node: Some(i64::from(s.tasks) / (nodes.len().max(1) as i64)),
                ..spec
            };
            pb::Job {
                display_id: format!("{id}.{}", s.id),
                spec: Some(spec),
                state: s.state,
                start_time_ms: Some(s.start_ms),
                end_time_ms: s.end_ms,
                exit_code: Some(s.exit_code.unwrap_or(0)),
                exit_signal: s.signal,
                allocation: j.allocation.iter().filter(|a| nodes.contains(&a.node)).cloned().collect(),
                ran_on: nodes,
                suspended_at_ms: None,
                suspended_ms: 0,
                steps: Vec::new(),
                ..j.clone()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::parse_time;

    /// sacct reads HISTORY_PAGES_MAX full pages of the history, newest
    /// first, and asks for no page past them.
    #[tokio::test]
    async fn sacct_reads_history_pages_max_pages() {
        let asked = std::cell::Cell::new(0usize);
        let fetch = |req: pb::HistoryRequest| {
            asked.set(asked.get() + 1);
            // Full pages of ids below the cursor, down to 1.
            let top = if req.before_id == 0 { 1_000 } else { req.before_id - 1 };
            let jobs: Vec<pb::Job> =
                (0..u64::from(req.limit)).map(|i| pb::Job { id: top - i, ..Default::default() }).collect();
            std::future::ready(Ok(pb::ListJobsResponse { jobs, ..Default::default() }))
        };
        let req = pb::HistoryRequest { limit: 3, ..Default::default() };
        let jobs = history_pages(req, fetch).await;
        assert_eq!(asked.get(), HISTORY_PAGES_MAX, "no page past the limit");
        assert_eq!(jobs.len(), 3 * HISTORY_PAGES_MAX);
        assert!(jobs.windows(2).all(|w| w[0].id == w[1].id + 1), "each page goes on below the last");
    }

    #[test]
    fn times_and_fields_read_as_sacct_does() {
        assert_eq!(parse_time("-S", "2026-12-01T00:18:31", 0).unwrap(), 1_796_084_311_000);
        assert_eq!(parse_time("-S", "2000-02-29", 0).unwrap(), 951_782_400_000);
        assert_eq!(parse_time("-S", "now-2hours", 10_000_000).unwrap(), 10_000_000 - 7_200_000);
        assert!(parse_time("-S", "yesterday", 0).unwrap_err().contains("-S"));
        assert!(parse_time("-S", "2026-13-01", 0).is_err());
        let j = pb::Job {
            id: 7,
            state: pb::JobState::Completed as i32,
            exit_code: Some(0),
            start_time_ms: Some(1_000),
            end_time_ms: Some(66_000),
            allocation: vec![],
            ran_on: vec!["n1".into(), "n2".into()],
            spec: Some(pb::JobSpec { nodes: Some(2), gpus_per_node: Some(4), ..Default::default() }),
            ..Default::default()
        };
        assert_eq!(field(&j, "Elapsed", 0), "00:01:05");
        assert_eq!(field(&j, "ExitCode", 0), "0:0");
        assert_eq!(field(&j, "NodeList", 0), "n[1-2]");
        assert_eq!(field(&j, "AllocTRES", 0), "cpu=2,gres/gpu=8,node=2");
        assert_eq!(field(&j, "State", 0), "COMPLETED");
        assert!(batch_step(&j).is_none(), "only batch jobs have a batch step");
        let batch = pb::Job { spec: Some(pb::JobSpec { batch: true, ..j.spec.clone().unwrap() }), ..j.clone() };
        let b = batch_step(&batch).unwrap();
        let f = |k: &str| field(&b, k, 0);
        assert_eq!((f("JobID"), f("JobIDRaw"), f("JobName")), ("7.batch".into(), "7.batch".into(), "batch".into()));
        assert_eq!(
            (f("NodeList"), f("NNodes"), f("State"), f("Elapsed")),
            ("n1".into(), "1".into(), "COMPLETED".into(), "00:01:05".into())
        );
        let killed = pb::Job { exit_code: None, exit_signal: Some(9), state: pb::JobState::Failed as i32, ..j };
        assert_eq!(field(&killed, "ExitCode", 0), "0:9");
    }
}
