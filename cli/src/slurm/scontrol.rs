//! `scontrol`: `show hostnames|hostlist|job|node|partition|reservation|licenses`,
//! `hold`, `release`, `requeue`, `requeuehold`, `suspend`, `resume`, `update JobId=.. TimeLimit=..
//! Nice=.. Priority=..`, `update NodeName=.. State=DRAIN|RESUME Reason=..`,
//! `create|update|delete reservation`, in Slurm's words.

use anyhow::{bail, Context};
use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use pb::update_job_request::Change;

use super::{duration, hostlist, job_cpus, job_elapsed_s, job_nodelist, job_nodes, timestamp, JobSel};
use crate::output::Output;

#[derive(Args, Debug, Default)]
pub struct ScontrolArgs {
    /// `show job` and `show node` on one line each.
    #[arg(short = 'o', long)]
    oneliner: bool,
    /// Accepted for compatibility.
    #[arg(short = 'd', long)]
    details: bool,
    /// COMMAND [ARGS]: show hostnames [LIST] | show hostlist LIST | show job [ID] |
    /// show node [NAME] | show partition [NAME] | show reservation [NAME] | show licenses |
    /// hold ID | release ID | requeue ID | suspend ID | resume ID | update JobId=ID KEY=VALUE... |
    /// update NodeName=NAME State=DRAIN|RESUME Reason=... |
    /// create reservation ReservationName=N StartTime=T Duration=D Nodes=L Users=U Flags=F |
    /// update ReservationName=N KEY=VALUE... | delete reservation NAME
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    words: Vec<String>,
}

/// Whether the subcommand is answered here without a controller (and so
/// without credentials: scripts call `show hostnames` inside jobs).
pub fn is_local(a: &ScontrolArgs) -> bool {
    let lower: Vec<String> = a.words.iter().take(2).map(|s| s.to_ascii_lowercase()).collect();
    matches!(
        (lower.first().map(String::as_str), lower.get(1).map(String::as_str)),
        (Some("show"), Some("hostnames" | "hostname" | "hostlist" | "hostlistsorted"))
    )
}

/// Runs a subcommand for which [`is_local`] holds.
pub fn run_local(a: &ScontrolArgs) -> anyhow::Result<()> {
    let w: Vec<&str> = a.words.iter().map(String::as_str).collect();
    match w.get(1).map(|s| s.to_ascii_lowercase()).as_deref() {
        Some("hostnames" | "hostname") => {
            let list = match w.get(2) {
                Some(l) => l.to_string(),
                None => std::env::var("SLURM_JOB_NODELIST")
                    .context("show hostnames: give a hostlist, or run inside a job (SLURM_JOB_NODELIST)")?,
            };
            for h in hostlist::expand(&list).map_err(anyhow::Error::msg)? {
                println!("{h}");
            }
            Ok(())
        }
        _ => {
            let list = w.get(2).context("show hostlist: give host names, comma-separated")?;
            let names = hostlist::expand(list).map_err(anyhow::Error::msg)?;
            println!("{}", hostlist::compress(&names));
            Ok(())
        }
    }
}

pub async fn run(client: &Client, out: &Output, a: ScontrolArgs) -> anyhow::Result<()> {
    if is_local(&a) {
        return run_local(&a);
    }
    let w: Vec<&str> = a.words.iter().map(String::as_str).collect();
    let lower: Vec<String> = w.iter().map(|s| s.to_ascii_lowercase()).collect();
    let verb = lower[0].as_str();
    match (verb, lower.get(1).map(String::as_str)) {
        ("show", Some("job" | "jobs" | "jobid")) => show_jobs(client, out, w.get(2).copied(), a.oneliner).await,
        ("show", Some("node" | "nodes")) => show_nodes(client, out, w.get(2).copied(), a.oneliner).await,
        ("show", Some("partition" | "partitions")) => show_partitions(client, out, w.get(2).copied()).await,
        ("show", Some("reservation" | "reservations" | "res")) => {
            let rs = crate::reservations::list(client, w.get(2).copied().unwrap_or(""), false).await?;
            crate::reservations::print_reservations(out, &rs, super::now_ms())
        }
        ("show", Some("lic" | "license" | "licenses")) => {
            crate::reservations::show_licenses(client, out, w.get(2).copied()).await
        }
        ("show", other) => bail!(
            "show: '{}' is not something scontrol shows here (hostnames, hostlist, job, node, partition, \
             reservation, licenses)",
            other.unwrap_or("")
        ),
        ("create", Some("reservation" | "res")) => {
            crate::reservations::scontrol_change(client, out, false, &w[2..]).await
        }
        ("update", _) if lower.iter().any(|x| x.starts_with("reservationname=") || x.starts_with("reservation=")) => {
            crate::reservations::scontrol_change(client, out, true, &w[1..]).await
        }
        ("delete", Some("reservation" | "res")) => crate::reservations::scontrol_delete(client, &w[2..]).await,
        ("delete", Some(x)) if x.starts_with("reservationname=") || x.starts_with("reservation=") => {
            crate::reservations::scontrol_delete(client, &w[1..]).await
        }
        ("hold" | "uhold" | "release" | "requeue" | "requeuehold" | "suspend" | "resume", _) => {
            let change = match verb {
                "hold" | "uhold" => Change::Hold,
                "release" => Change::Release,
                "requeue" => Change::Requeue,
                "suspend" => Change::Suspend,
                "resume" => Change::Resume,
                _ => Change::RequeueHold,
            };
            let ids = job_ids(client, &w[1..]).await?;
            crate::jobctl::change_jobs(client, out, &ids, change, 0).await
        }
        ("update", _) => update(client, out, &w[1..]).await,
        _ => bail!(
            "command: '{}' is not an scontrol command Gangway has (show, hold, release, requeue, requeuehold, suspend, \
             resume, update, create reservation, delete reservation)",
            w[0]
        ),
    }
}

/// Job ids from `12 13`, `12,13`, `12_3` or a whole array's id (its live elements).
async fn job_ids(client: &Client, words: &[&str]) -> anyhow::Result<Vec<u64>> {
    let mut sels = Vec::new();
    for w in words.iter().flat_map(|w| w.split(',')).filter(|w| !w.is_empty()) {
        let w = w.strip_prefix("jobid=").or_else(|| w.strip_prefix("JobId=")).unwrap_or(w);
        sels.push(JobSel::parse("job id", w).map_err(anyhow::Error::msg)?);
    }
    if sels.is_empty() {
        bail!("job id: give at least one");
    }
    if sels.iter().all(|s| s.indexes.is_none()) {
        // Plain ids name jobs; an array's id also names its other elements.
        let jobs = super::list_jobs(client, &super::Listing::default()).await?;
        let mut ids: Vec<u64> = jobs.iter().filter(|j| sels.iter().any(|s| s.matches(j))).map(|j| j.id).collect();
        for s in &sels {
            if !ids.contains(&s.id) && !jobs.iter().any(|j| s.matches(j)) {
                ids.push(s.id); // let the controller say it does not exist
            }
        }
        ids.sort_unstable();
        ids.dedup();
        return Ok(ids);
    }
    let jobs = super::list_jobs(client, &super::Listing::default()).await?;
    let ids: Vec<u64> = jobs.iter().filter(|j| sels.iter().any(|s| s.matches(j))).map(|j| j.id).collect();
    if ids.is_empty() {
        bail!("job id: no such job or array element");
    }
    Ok(ids)
}

async fn update(client: &Client, out: &Output, words: &[&str]) -> anyhow::Result<()> {
    let mut kv: Vec<(String, String)> = Vec::new();
    for w in words {
        let (k, v) = w.split_once('=').with_context(|| format!("update: '{w}' must be KEY=VALUE"))?;
        kv.push((k.to_ascii_lowercase(), v.to_string()));
    }
    let get = |k: &str| kv.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    if let Some(node) = get("nodename") {
        let state = get("state").context("update NodeName: give State=DRAIN or State=RESUME")?;
        let reason = get("reason").unwrap_or_default();
        let cmd = match state.to_ascii_uppercase().as_str() {
            "DRAIN" => {
                if reason.is_empty() {
                    bail!("update NodeName: State=DRAIN needs a Reason=... (as in Slurm)");
                }
                crate::commands::NodeCmd::Drain { name: node, reason }
            }
            "RESUME" | "UNDRAIN" | "IDLE" => crate::commands::NodeCmd::Resume { name: node },
            "POWER_DOWN" | "POWER_DOWN_FORCE" | "POWER_DOWN_ASAP" => {
                crate::commands::NodeCmd::Power { name: node, to: "down".into(), reason }
            }
            "POWER_UP" => crate::commands::NodeCmd::Power { name: node, to: "up".into(), reason },
            other => bail!("update NodeName: State={other}: only DRAIN, RESUME, POWER_DOWN and POWER_UP are supported"),
        };
        return crate::commands::node(client, out, cmd).await;
    }
    let id = get("jobid").context("update: give JobId=ID (or NodeName=NAME)")?;
    let ids = job_ids(client, &[id.as_str()]).await?;
    let mut done = false;
    for (k, v) in &kv {
        let (change, value) = match k.as_str() {
            "jobid" => continue,
            "timelimit" => {
                let secs = crate::parse::job_time_s("TimeLimit", v).map_err(anyhow::Error::msg)?;
                (Change::SetTimeLimit, secs as i64)
            }
            "nice" => (Change::SetNice, v.parse::<i64>().with_context(|| format!("Nice: '{v}' is not a number"))?),
            "priority" => {
                (Change::SetPriority, i64::from(crate::parse::priority("Priority", v).map_err(anyhow::Error::msg)?))
            }
            other => bail!(
                "update: {other} cannot be changed here (TimeLimit, Nice, Priority; hold/release/requeue are commands)"
            ),
        };
        crate::jobctl::change_jobs(client, out, &ids, change, value).await?;
        done = true;
    }
    if !done {
        bail!("update: nothing to change (TimeLimit=, Nice=, Priority=)");
    }
    Ok(())
}

async fn explain(client: &Client, job_id: u64) -> Option<pb::Explanation> {
    let r = client.job_explain(pb::ExplainRequest { job_id, stale: false }).await;
    r.ok().map(|r| r.into_inner())
}

/// `scontrol show job`'s key=value fields for one job.
pub fn job_fields(j: &pb::Job, e: Option<&pb::Explanation>, now: u64) -> Vec<(String, String)> {
    let s = super::spec(j);
    let id = if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() };
    let none = |v: &str| if v.is_empty() { "(null)".to_string() } else { v.to_string() };
    let t = |ms: Option<u64>| ms.map_or("Unknown".to_string(), timestamp);
    let pending = j.state == pb::JobState::Pending as i32;
    let mut f: Vec<(String, String)> = vec![("JobId".into(), id), ("JobName".into(), s.name.clone())];
    if let (Some(a), Some(i)) = (j.array_job_id, j.array_index) {
        f.push(("ArrayJobId".into(), a.to_string()));
        f.push(("ArrayTaskId".into(), i.to_string()));
    }
    // A heterogeneous job's component (`super::het_components`): `ID+K`.
    if let Some((het, offset)) = j.display_id.rsplit_once('+') {
        f.push(("HetJobId".into(), het.to_string()));
        f.push(("HetJobOffset".into(), offset.to_string()));
    }
    let tasks = s.tasks_per_node.unwrap_or(1).max(1) as u64 * job_nodes(j);
    let gpus = s.gpus_per_node.unwrap_or(0) as u64 * job_nodes(j);
    let mut tres = format!("cpu={},node={}", job_cpus(j), job_nodes(j));
    if gpus > 0 {
        tres.push_str(&format!(",gres/gpu={gpus}"));
    }
    // A pending job's reason, or why a suspended one is (preempted by a job).
    let suspended = j.state == pb::JobState::Suspended as i32;
    let reason = if (pending || suspended) && !j.reason.is_empty() { j.reason.clone() } else { "None".into() };
    f.extend([
        ("UserId".into(), s.user.clone()),
        ("Account".into(), none(&s.account)),
        ("QOS".into(), none(&s.qos)),
        ("Priority".into(), e.map_or("N/A".into(), |e| format!("{:.0}", e.priority))),
        ("Nice".into(), s.nice.to_string()),
        ("JobState".into(), super::state_name(j.state).into()),
        ("Reason".into(), reason),
        (
            "Dependency".into(),
            if j.pending_dependencies.is_empty() { "(null)".into() } else { j.pending_dependencies.join(",") },
        ),
        ("Requeue".into(), if s.requeue.unwrap_or(true) { "1" } else { "0" }.into()),
        ("Restarts".into(), j.attempt.saturating_sub(1).to_string()),
        ("ExitCode".into(), format!("{}:{}", j.exit_code.unwrap_or(0), j.exit_signal.unwrap_or(0))),
        ("RunTime".into(), super::elapsed(job_elapsed_s(j, now))),
        ("TimeLimit".into(), s.time_limit_s.filter(|t| *t > 0).map_or("UNLIMITED".into(), |t| duration(t as u64))),
        ("SubmitTime".into(), timestamp(j.submit_time_ms)),
        ("EligibleTime".into(), timestamp(s.begin_time_ms.max(j.submit_time_ms))),
        ("StartTime".into(), t(j.start_time_ms.or(e.and_then(|e| e.estimated_start_ms)))),
        ("EndTime".into(), t(j.end_time_ms)),
        ("SuspendTime".into(), j.suspended_at_ms.map_or("None".to_string(), timestamp)),
        ("Partition".into(), none(&s.partition)),
        ("NodeList".into(), none(&job_nodelist(j))),
        (
            "BatchHost".into(),
            none(
                // A heterogeneous job's script runs in component 0.
                &(s.batch && j.display_id.rsplit_once('+').is_none_or(|(_, k)| k == "0"))
                    .then(|| j.allocation.first().map(|a| a.node.clone()).or_else(|| j.ran_on.first().cloned()))
                    .flatten()
                    .unwrap_or_default(),
            ),
        ),
        ("ReqNodeList".into(), none(&super::hostlist::compress(&s.nodelist))),
        ("ExcNodeList".into(), none(&super::hostlist::compress(&s.exclude))),
        ("NumNodes".into(), job_nodes(j).to_string()),
        ("NumCPUs".into(), job_cpus(j).to_string()),
        ("NumTasks".into(), tasks.to_string()),
        ("CPUs/Task".into(), s.cpus_per_task.unwrap_or(1).max(1).to_string()),
        ("TRES".into(), tres),
        ("Features".into(), if s.constraints.is_empty() { "(null)".into() } else { s.constraints.join("&") }),
        ("Reservation".into(), none(&s.reservation)),
        ("Licenses".into(), {
            let mut l: Vec<String> = s.licenses.iter().map(|(n, c)| format!("{n}:{c}")).collect();
            l.sort();
            none(&l.join(","))
        }),
        ("TimeMin".into(), if s.time_min_s == 0 { "N/A".into() } else { duration(s.time_min_s) }),
        ("Deadline".into(), if s.deadline_ms == 0 { "N/A".into() } else { timestamp(s.deadline_ms) }),
        ("Command".into(), if s.script.is_empty() { s.command.join(" ") } else { "(batch script)".into() }),
        ("WorkDir".into(), s.workdir.clone()),
        ("Comment".into(), none(&s.comment)),
        ("StdOut".into(), if s.output.is_empty() { "slurm-%j.out".into() } else { s.output.clone() }),
        ("StdErr".into(), if s.error.is_empty() { "(with StdOut)".into() } else { s.error.clone() }),
    ]);
    if let Some(e) = e.filter(|_| pending) {
        // Gangway's detail: why, in a sentence; which nodes turned it down and why.
        let mut rej: Vec<(&String, &u32)> = e.rejections.iter().collect();
        rej.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let rej: Vec<String> = rej.iter().map(|(why, n)| format!("{n} {why}")).collect();
        f.push(("PendingDetail".into(), format!("\"{}\"", e.detail)));
        f.push(("EligibleNodes".into(), e.eligible_nodes.to_string()));
        f.push((
            "RejectedNodes".into(),
            if rej.is_empty() { "(null)".into() } else { format!("\"{}\"", rej.join(", ")) },
        ));
        f.push(("QueuePosition".into(), e.queue_position.to_string()));
    }
    f
}

/// Slurm's layout: a few fields per line, indented; or all on one line.
pub(crate) fn print_fields(f: &[(String, String)], oneliner: bool, per_line: usize) {
    let cells: Vec<String> = f.iter().map(|(k, v)| format!("{k}={}", crate::output::printable(v))).collect();
    if oneliner {
        println!("{}", cells.join(" "));
        return;
    }
    for (i, chunk) in cells.chunks(per_line).enumerate() {
        println!("{}{}", if i == 0 { "" } else { "   " }, chunk.join(" "));
    }
    println!();
}

async fn show_jobs(client: &Client, out: &Output, id: Option<&str>, oneliner: bool) -> anyhow::Result<()> {
    let jobs = super::list_jobs(client, &super::Listing { explain: true, ..Default::default() }).await?;
    let jobs: Vec<&pb::Job> = match id {
        None => jobs.iter().collect(),
        Some(id) => {
            let sel = JobSel::parse("job id", id).map_err(anyhow::Error::msg)?;
            let found: Vec<&pb::Job> = jobs.iter().filter(|j| sel.matches(j)).collect();
            if found.is_empty() {
                bail!("job {id}: Invalid job id specified");
            }
            found
        }
    };
    if out.json {
        let v: Vec<serde_json::Value> = jobs.iter().map(|j| crate::output::job_json(j)).collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "jobs": v }))?);
        return Ok(());
    }
    let now = super::now_ms();
    for j in jobs {
        let e = if j.state == pb::JobState::Pending as i32 { explain(client, j.id).await } else { None };
        for part in super::het_components(j.clone()) {
            print_fields(&job_fields(&part, e.as_ref(), now), oneliner, 4);
        }
    }
    Ok(())
}

async fn show_nodes(client: &Client, out: &Output, name: Option<&str>, oneliner: bool) -> anyhow::Result<()> {
    let nodes = client.list_nodes(false).await?;
    let nodes: Vec<&pb::Node> = match name {
        None => nodes.iter().collect(),
        Some(list) => {
            let names = hostlist::expand(list).map_err(anyhow::Error::msg)?;
            let found: Vec<&pb::Node> = nodes.iter().filter(|n| names.contains(&n.name)).collect();
            if found.is_empty() {
                bail!("node {list}: Invalid node name specified");
            }
            found
        }
    };
    if out.json {
        let v: Vec<serde_json::Value> = nodes.iter().map(|n| crate::commands::node_json(n)).collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "nodes": v }))?);
        return Ok(());
    }
    for n in nodes {
        let gpus_used = n.gpus.iter().filter(|g| g.allocated || g.allocated_to.is_some()).count();
        let gres = n
            .gpus
            .first()
            .map_or("(null)".into(), |g| format!("gpu:{}:{}", g.model.to_ascii_lowercase(), n.gpus.len()));
        let mut labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        let f: Vec<(String, String)> = vec![
            ("NodeName".into(), n.name.clone()),
            ("Arch".into(), std::env::consts::ARCH.into()),
            ("CPUAlloc".into(), n.cpus_alloc.to_string()),
            ("CPUTot".into(), n.cpus.to_string()),
            ("AvailableFeatures".into(), if labels.is_empty() { "(null)".into() } else { labels.join(",") }),
            ("Gres".into(), gres),
            ("GresUsed".into(), format!("gpu:{gpus_used}")),
            ("NodeAddr".into(), n.addr.clone()),
            ("RealMemory".into(), n.mem_mb.to_string()),
            ("AllocMem".into(), n.mem_alloc_mb.to_string()),
            ("State".into(), super::sinfo::node_state(n).to_ascii_uppercase()),
            ("Topology".into(), if n.topology.is_empty() { "(null)".into() } else { n.topology.join("/") }),
            (
                "Reason".into(),
                if n.state_reason.is_empty() { "(null)".into() } else { format!("\"{}\"", n.state_reason) },
            ),
        ];
        print_fields(&f, oneliner, 4);
    }
    Ok(())
}

async fn show_partitions(client: &Client, out: &Output, name: Option<&str>) -> anyhow::Result<()> {
    let policy = crate::policy::fetch_policy(client, false).await?.0;
    let mut parts: Vec<(String, gangway_core::policy::Partition)> = policy.partitions.into_iter().collect();
    if parts.is_empty() {
        let p = gangway_core::policy::Partition { default: true, ..Default::default() };
        parts.push((gangway_core::policy::DEFAULT_PARTITION.into(), p));
    }
    if let Some(n) = name {
        parts.retain(|(p, _)| p == n);
        if parts.is_empty() {
            bail!("partition {n}: Invalid partition name specified");
        }
    }
    if out.json {
        let v: Vec<serde_json::Value> = parts
            .iter()
            .map(|(n, p)| serde_json::json!({"name": n, "default": p.default, "nodes": p.nodes, "max_time_s": p.max_time_s}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "partitions": v }))?);
        return Ok(());
    }
    for (n, p) in parts {
        let f: Vec<(String, String)> = vec![
            ("PartitionName".into(), n),
            ("Default".into(), if p.default { "YES" } else { "NO" }.into()),
            (
                "AllowAccounts".into(),
                if p.allow_accounts.is_empty() { "ALL".into() } else { p.allow_accounts.join(",") },
            ),
            ("QoS".into(), if p.default_qos.is_empty() { "N/A".into() } else { p.default_qos.clone() }),
            ("MaxNodes".into(), if p.max_nodes == 0 { "UNLIMITED".into() } else { p.max_nodes.to_string() }),
            ("MaxTime".into(), if p.max_time_s == 0 { "UNLIMITED".into() } else { duration(p.max_time_s) }),
            ("DefaultTime".into(), if p.default_time_s == 0 { "NONE".into() } else { duration(p.default_time_s) }),
            ("PriorityTier".into(), p.priority_tier.to_string()),
            ("Nodes".into(), if p.nodes.is_empty() { "ALL".into() } else { p.nodes.join(",") }),
            ("DefMemPerCPU".into(), p.default_mem_per_cpu_mb.to_string()),
            ("DefMemPerGPU".into(), p.default_mem_per_gpu_mb.to_string()),
        ];
        print_fields(&f, false, 4);
    }
    Ok(())
}
