//! `squeue`: jobs in the queue, Slurm's columns and format strings.

use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use super::format;
use super::{duration, identity_user, job_cpus, job_elapsed_s, job_gres, job_nodelist, job_nodes, timestamp, JobSel};
use crate::output::Output;

/// squeue's default and `-l` formats.
const DEFAULT_FORMAT: &str = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R";
const LONG_FORMAT: &str = "%.18i %.9P %.8j %.8u %.8T %.10M %.9l %.6D %R";
/// `-O` columns without a width are this wide, as in Slurm.
const NAMED_WIDTH: usize = 20;
/// Finished jobs named with `-j` (or asked for with `-t`) show for this long
/// after they end, like Slurm's MinJobAge: driver scripts that poll
/// `squeue -j ID` until it prints nothing keep working.
const FINISHED_SHOWN_MS: u64 = 300_000;

#[derive(Args, Debug, Default)]
#[command(disable_help_flag = true)]
pub struct SqueueArgs {
    #[arg(long, action = clap::ArgAction::Help)]
    help: Option<bool>,
    /// Job ids: 12, 12_3 (an array element), 12 for a whole array.
    #[arg(short = 'j', long = "jobs", value_delimiter = ',')]
    jobs: Vec<String>,
    #[arg(short = 'u', long = "user", value_delimiter = ',')]
    users: Vec<String>,
    /// Only your own jobs.
    #[arg(long)]
    me: bool,
    #[arg(short = 'p', long = "partition", value_delimiter = ',')]
    partitions: Vec<String>,
    /// States: PD, R, CD, F, CA, TO, NF (or their names), or all.
    #[arg(short = 't', long = "states", value_delimiter = ',')]
    states: Vec<String>,
    #[arg(short = 'n', long = "name", value_delimiter = ',')]
    names: Vec<String>,
    #[arg(short = 'A', long = "account", value_delimiter = ',')]
    accounts: Vec<String>,
    #[arg(short = 'q', long = "qos", value_delimiter = ',')]
    qos: Vec<String>,
    /// Only jobs in these advance reservations.
    #[arg(short = 'R', long = "reservation", value_delimiter = ',')]
    reservations: Vec<String>,
    /// No header line.
    #[arg(short = 'h', long = "noheader")]
    noheader: bool,
    /// Long format (state names, time limits).
    #[arg(short = 'l', long)]
    long: bool,
    /// Output format, Slurm's % codes (e.g. "%.18i %j %T %R").
    #[arg(short = 'o', long = "format")]
    format: Option<String>,
    /// Output format by field name (e.g. "JobID:10,Name:30,State").
    #[arg(short = 'O', long = "Format")]
    named_format: Option<String>,
    /// Accepted for compatibility: every partition is shown.
    #[arg(short = 'a', long)]
    all: bool,
    /// Accepted for compatibility: array elements are always one per line.
    #[arg(short = 'r', long)]
    array: bool,
}

/// Field keys (named as squeue -O names them) and their headers.
const FIELDS: &[(&str, &str)] = &[
    ("JobID", "JOBID"),
    ("JobIDRaw", "JOBID"),
    ("ArrayJobID", "ARRAY_JOB_ID"),
    ("ArrayTaskID", "ARRAY_TASK_ID"),
    ("Name", "NAME"),
    ("UserName", "USER"),
    ("StateCompact", "ST"),
    ("State", "STATE"),
    ("TimeUsed", "TIME"),
    ("TimeLimit", "TIME_LIMIT"),
    ("TimeLeft", "TIME_LEFT"),
    ("NumNodes", "NODES"),
    ("NumCPUs", "CPUS"),
    ("ReasonList", "NODELIST(REASON)"),
    ("Reason", "REASON"),
    ("NodeList", "NODELIST"),
    ("Partition", "PARTITION"),
    ("Account", "ACCOUNT"),
    ("QOS", "QOS"),
    ("StartTime", "START_TIME"),
    ("SubmitTime", "SUBMIT_TIME"),
    ("EndTime", "END_TIME"),
    ("WorkDir", "WORK_DIR"),
    ("Command", "COMMAND"),
    ("tres-per-node", "TRES_PER_NODE"),
    ("MinMemory", "MIN_MEMORY"),
    ("Dependency", "DEPENDENCY"),
    ("Nice", "NICE"),
    ("Comment", "COMMENT"),
    ("EligibleTime", "ELIGIBLE_TIME"),
    ("Reservation", "RESERVATION"),
    ("Licenses", "LICENSES"),
];

fn code(c: char) -> Option<&'static str> {
    Some(match c {
        'i' => "JobID",
        'A' => "JobIDRaw",
        'F' => "ArrayJobID",
        'K' => "ArrayTaskID",
        'j' => "Name",
        'u' => "UserName",
        't' => "StateCompact",
        'T' => "State",
        'M' => "TimeUsed",
        'l' => "TimeLimit",
        'L' => "TimeLeft",
        'D' => "NumNodes",
        'C' => "NumCPUs",
        'R' => "ReasonList",
        'r' => "Reason",
        'N' => "NodeList",
        'P' => "Partition",
        'a' => "Account",
        'q' => "QOS",
        'S' => "StartTime",
        'V' => "SubmitTime",
        'e' => "EndTime",
        'Z' => "WorkDir",
        'o' => "Command",
        'b' => "tres-per-node",
        'm' => "MinMemory",
        'E' => "Dependency",
        'y' => "Nice",
        'k' => "Comment",
        'v' => "Reservation",
        'W' => "Licenses",
        _ => return None,
    })
}

fn header(key: &str) -> String {
    FIELDS.iter().find(|(k, _)| *k == key).map_or(key, |(_, h)| h).to_string()
}

/// One field of one job, as squeue prints it.
pub fn field(j: &pb::Job, key: &str, now: u64) -> String {
    let spec = super::spec(j);
    let pending = j.state == pb::JobState::Pending as i32;
    let running = super::allocated(j.state);
    let limit = spec.time_limit_s.filter(|t| *t > 0).map(|t| t as u64);
    let reason = if pending && !j.reason.is_empty() { j.reason.clone() } else { "None".into() };
    let time = |t: Option<u64>| t.map_or("N/A".to_string(), timestamp);
    match key {
        "JobID" => {
            if j.display_id.is_empty() {
                j.id.to_string()
            } else {
                j.display_id.clone()
            }
        }
        "JobIDRaw" => j.id.to_string(),
        "ArrayJobID" => j.array_job_id.unwrap_or(j.id).to_string(),
        "ArrayTaskID" => j.array_index.map_or("N/A".into(), |i| i.to_string()),
        "Name" => spec.name.clone(),
        "UserName" => spec.user.clone(),
        "StateCompact" => super::state_code(j.state).into(),
        "State" => super::state_name(j.state).into(),
        "TimeUsed" => duration(job_elapsed_s(j, now)),
        "TimeLimit" => limit.map_or("UNLIMITED".into(), duration),
        "TimeLeft" => match limit {
            None => "UNLIMITED".into(),
            Some(l) if running || pending => duration(l.saturating_sub(job_elapsed_s(j, now))),
            Some(_) => "0:00".into(),
        },
        "NumNodes" => job_nodes(j).to_string(),
        "NumCPUs" => job_cpus(j).to_string(),
        "ReasonList" if pending => format!("({reason})"),
        "ReasonList" | "NodeList" => job_nodelist(j),
        "Reason" => reason,
        "Partition" => spec.partition.clone(),
        "Account" => spec.account.clone(),
        "QOS" => spec.qos.clone(),
        "StartTime" => time(j.start_time_ms),
        "SubmitTime" => timestamp(j.submit_time_ms),
        "EndTime" => match (j.end_time_ms, j.start_time_ms, limit) {
            (Some(e), _, _) => timestamp(e),
            (None, Some(s), Some(l)) => timestamp(s + l * 1000),
            _ => "N/A".into(),
        },
        "WorkDir" => spec.workdir.clone(),
        "Command" if spec.script.is_empty() => spec.command.join(" "),
        "Command" => format!("(batch script) {}", spec.command.join(" ")).trim_end().to_string(),
        "tres-per-node" => {
            let g = job_gres(j);
            if g.is_empty() {
                "N/A".into()
            } else {
                g
            }
        }
        "MinMemory" => match (spec.mem_per_node_mb.unwrap_or(0), spec.mem_per_cpu_mb) {
            (0, 0) => "0".into(),
            (0, c) => format!("{c}M"),
            (n, _) => format!("{n}M"),
        },
        "Dependency" if j.pending_dependencies.is_empty() => "(null)".into(),
        "Dependency" => j.pending_dependencies.join(","),
        "Nice" => spec.nice.to_string(),
        "Comment" if spec.comment.is_empty() => "(null)".into(),
        "Comment" => spec.comment.clone(),
        "EligibleTime" => timestamp(spec.begin_time_ms.max(j.submit_time_ms)),
        "Reservation" if spec.reservation.is_empty() => "(null)".into(),
        "Reservation" => spec.reservation.clone(),
        "Licenses" if spec.licenses.is_empty() => "(null)".into(),
        "Licenses" => {
            let mut l: Vec<String> = spec.licenses.iter().map(|(n, c)| format!("{n}:{c}")).collect();
            l.sort();
            l.join(",")
        }
        _ => String::new(),
    }
}

fn matches_any(filter: &[String], value: &str) -> bool {
    filter.is_empty() || filter.iter().any(|f| f == value)
}

pub async fn run(client: &Client, out: &Output, identity: &str, a: SqueueArgs) -> anyhow::Result<()> {
    let sels: Vec<JobSel> =
        a.jobs.iter().map(|s| JobSel::parse("--jobs", s)).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let items = match (&a.format, &a.named_format) {
        (Some(_), Some(_)) => anyhow::bail!("--format: give -o or -O, not both"),
        (Some(f), None) => format::parse_percent(f, "--format", code),
        (None, Some(f)) => {
            let keys: Vec<&'static str> = FIELDS.iter().map(|(k, _)| *k).collect();
            format::parse_names(f, "--Format", &keys, Some(NAMED_WIDTH))
        }
        (None, None) => format::parse_percent(if a.long { LONG_FORMAT } else { DEFAULT_FORMAT }, "--format", code),
    }
    .map_err(anyhow::Error::msg)?;
    let states = if !a.states.is_empty() {
        super::parse_states("--states", &a.states).map_err(anyhow::Error::msg)?
    } else if !sels.is_empty() {
        Vec::new() // named jobs show in any state
    } else {
        super::LIVE_STATES.to_vec()
    };
    let mut users = a.users.clone();
    if a.me {
        users.push(identity_user(identity));
    }
    let one = |v: &[String]| if v.len() == 1 { v[0].clone() } else { String::new() };
    let listing = super::Listing {
        states,
        user: one(&users),
        partition: one(&a.partitions),
        account: one(&a.accounts),
        explain: true,
    };
    let now = super::now_ms();
    let jobs: Vec<pb::Job> = super::list_jobs(client, &listing)
        .await?
        .into_iter()
        .flat_map(super::het_components)
        .filter(|j| sels.is_empty() || sels.iter().any(|s| s.matches(j)))
        .filter(|j| j.end_time_ms.is_none_or(|e| now.saturating_sub(e) <= FINISHED_SHOWN_MS))
        .filter(|j| {
            let s = super::spec(j);
            matches_any(&users, &s.user)
                && matches_any(&a.partitions, &s.partition)
                && matches_any(&a.names, &s.name)
                && matches_any(&a.accounts, &s.account)
                && matches_any(&a.qos, &s.qos)
                && matches_any(&a.reservations, &s.reservation)
        })
        .collect();
    if out.json {
        let v: Vec<serde_json::Value> = jobs.iter().map(crate::output::job_json).collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "jobs": v }))?);
        return Ok(());
    }
    let named = a.named_format.is_some();
    let line = |value: &dyn Fn(&str) -> String| {
        if named {
            format::render_columns(&items, value, false, false)
        } else {
            format::render(&items, value)
        }
    };
    if !a.noheader {
        println!("{}", line(&|k: &str| header(k)));
    }
    for j in &jobs {
        println!("{}", line(&|k: &str| field(j, k, now)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> pb::Job {
        pb::Job {
            id: 14,
            display_id: "12_2".into(),
            array_job_id: Some(12),
            array_index: Some(2),
            state: pb::JobState::Running as i32,
            start_time_ms: Some(1_000_000),
            allocation: vec![
                pb::NodeAllocation { node: "gpu01".into(), cpus: 4, ..Default::default() },
                pb::NodeAllocation { node: "gpu02".into(), cpus: 4, ..Default::default() },
            ],
            spec: Some(pb::JobSpec {
                name: "train".into(),
                user: "alice".into(),
                partition: "gpu".into(),
                time_limit_s: Some(3600),
                gpus_per_node: Some(8),
                gpu_type: "h100".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn default_columns_match_slurm() {
        let items = format::parse_percent(DEFAULT_FORMAT, "-o", code).unwrap();
        let j = job();
        let now = 1_000_000 + 65_000;
        assert_eq!(
            format::render(&items, header),
            "             JOBID PARTITION     NAME     USER ST       TIME  NODES NODELIST(REASON)"
        );
        assert_eq!(
            format::render(&items, |k| field(&j, k, now)),
            "              12_2       gpu    train    alice  R       1:05      2 gpu[01-02]"
        );
        let pending = pb::Job {
            state: pb::JobState::Pending as i32,
            reason: "Priority".into(),
            allocation: vec![],
            start_time_ms: None,
            ..job()
        };
        assert_eq!(field(&pending, "ReasonList", now), "(Priority)");
        assert_eq!(field(&j, "TimeLeft", now), "58:55");
        assert_eq!(field(&j, "tres-per-node", now), "gres/gpu:h100=8");
        assert_eq!(field(&j, "ArrayJobID", now), "12");
    }
}
