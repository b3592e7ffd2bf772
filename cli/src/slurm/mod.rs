//! Slurm's user commands over Gangway's API, answering as Slurm does (state
//! codes, time formats, hostlists, format strings, exit codes) so that driver
//! scripts that parse them keep working: `squeue`, `scancel`, `sinfo`,
//! `scontrol`, `sacct`. The binary answers to those names through links
//! (`gangway shims install`); `sbatch` lives in `sbatch.rs`.
//!
//! Times print in local time (`YYYY-MM-DDTHH:MM:SS`; `TZ`, else /etc/localtime), as Slurm prints them.

pub mod format;
pub mod hostlist;
mod pty;
pub mod sacct;
pub mod salloc;
pub mod scancel;
pub mod scontrol;
pub mod seff;
pub mod sinfo;
pub mod squeue;
pub mod sreport;
pub mod srun;

use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

/// Pages read when listing jobs: what one command holds in memory (each
/// page at most `LIST_RESPONSE_BYTES_MAX`, 3 MiB: 300 MiB in all; a page
/// holds up to LIST_PAGE jobs, fewer when their scripts and environments
/// are large); past it the command says the list was cut.
const LIST_PAGES_MAX: usize = 100;
/// Jobs per page.
const LIST_PAGE: u32 = 10_000;

/// Slurm's compact state code.
pub fn state_code(s: i32) -> &'static str {
    match pb::JobState::try_from(s).unwrap_or(pb::JobState::Unspecified) {
        pb::JobState::Pending => "PD",
        pb::JobState::Running => "R",
        pb::JobState::Completed => "CD",
        pb::JobState::Failed => "F",
        pb::JobState::Cancelled => "CA",
        pb::JobState::Timeout => "TO",
        pb::JobState::NodeFail => "NF",
        pb::JobState::Deadline => "DL",
        pb::JobState::Suspended => "S",
        pb::JobState::Unspecified => "?",
    }
}

/// Slurm's state name.
pub use gangway_proto::job_state_name as state_name;

/// The states of jobs that have not ended, as the queue lists them by
/// default: pending, running and suspended.
pub const LIVE_STATES: [i32; 3] =
    [pb::JobState::Pending as i32, pb::JobState::Running as i32, pb::JobState::Suspended as i32];

/// Whether a job in state `s` has ended.
pub fn ended(s: i32) -> bool {
    s != pb::JobState::Unspecified as i32 && !LIVE_STATES.contains(&s)
}

/// Whether a job in state `s` holds its nodes: running or suspended.
pub fn allocated(s: i32) -> bool {
    s == pb::JobState::Running as i32 || s == pb::JobState::Suspended as i32
}

const ALL_STATES: [pb::JobState; 9] = [
    pb::JobState::Pending,
    pb::JobState::Running,
    pb::JobState::Completed,
    pb::JobState::Failed,
    pb::JobState::Cancelled,
    pb::JobState::Timeout,
    pb::JobState::NodeFail,
    pb::JobState::Deadline,
    pb::JobState::Suspended,
];

/// Parses state filters as Slurm takes them: codes or names, any case; `all`.
pub fn parse_states(option: &str, items: &[String]) -> Result<Vec<i32>, String> {
    let mut out = Vec::new();
    for item in items {
        let up = item.trim().to_ascii_uppercase();
        if up == "ALL" {
            return Ok(ALL_STATES.iter().map(|s| *s as i32).collect());
        }
        let found = ALL_STATES.iter().find(|s| state_code(**s as i32) == up || state_name(**s as i32) == up);
        match found {
            Some(s) => out.push(*s as i32),
            None => {
                return Err(format!(
                    "{option}: '{item}' is not a job state (PD/PENDING, R/RUNNING, CD/COMPLETED, F/FAILED, \
                     CA/CANCELLED, TO/TIMEOUT, NF/NODE_FAIL, DL/DEADLINE, S/SUSPENDED, all)"
                ))
            }
        }
    }
    Ok(out)
}

/// Slurm's elapsed-time form: `M:SS`, `H:MM:SS`, `D-HH:MM:SS`.
pub use crate::parse::duration;

/// sacct's elapsed form: `HH:MM:SS`, with `D-` for days.
pub fn elapsed(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

/// `YYYY-MM-DDTHH:MM:SS` in local time (as Slurm prints times) for epoch
/// milliseconds.
pub fn timestamp(ms: u64) -> String {
    let utc = i64::try_from(ms).unwrap_or(i64::MAX);
    timestamp_in(ms, crate::parse::local_offset_s(utc))
}

/// [`timestamp`] for a zone `offset_s` seconds east of UTC.
pub fn timestamp_in(ms: u64, offset_s: i64) -> String {
    let ms = ms.saturating_add_signed(offset_s.saturating_mul(1000));
    let (year, month, day, h, m, s) = crate::parse::civil(i64::try_from(ms).unwrap_or(i64::MAX));
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}")
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The user part of a caller identity (`dev:alice` → `alice`).
pub fn identity_user(identity: &str) -> String {
    gangway_core::policy::identity_name(identity).to_string()
}

/// A job selector as Slurm's commands take them: `12` (a job, or a whole
/// array by its id), `12_3`, `12_[1-3,5]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSel {
    pub id: u64,
    /// Array indexes; None: the job, or every element of the array `id`.
    pub indexes: Option<Vec<u32>>,
}

/// Array indexes one selector may name.
const SELECTOR_INDEXES_MAX: usize = 100_000;

impl JobSel {
    pub fn parse(option: &str, s: &str) -> Result<JobSel, String> {
        let bad = || format!("{option}: '{s}' is not a job id (examples: 12, 12_3, 12_[1-3,5])");
        let (id, idx) = match s.split_once('_') {
            Some((id, idx)) => (id, Some(idx)),
            None => (s, None),
        };
        let id: u64 = id.trim().parse().map_err(|_| bad())?;
        let indexes = match idx {
            None => None,
            Some(idx) => {
                let body = idx.strip_prefix('[').and_then(|b| b.strip_suffix(']')).unwrap_or(idx);
                let mut v = Vec::new();
                for part in body.split(',') {
                    let (a, b) = part.split_once('-').unwrap_or((part, part));
                    let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                    if b < a {
                        return Err(bad());
                    }
                    if v.len() + (b - a) as usize >= SELECTOR_INDEXES_MAX {
                        return Err(format!("{option}: '{s}' names more than {SELECTOR_INDEXES_MAX} array indexes"));
                    }
                    v.extend(a..=b);
                }
                Some(v)
            }
        };
        Ok(JobSel { id, indexes })
    }

    pub fn matches(&self, j: &pb::Job) -> bool {
        match &self.indexes {
            None => j.id == self.id || j.array_job_id == Some(self.id),
            Some(ix) => j.array_job_id == Some(self.id) && j.array_index.is_some_and(|i| ix.contains(&i)),
        }
    }
}

/// Filters a listing asks the controller for.
#[derive(Default, Clone)]
pub struct Listing {
    pub states: Vec<i32>,
    pub user: String,
    pub partition: String,
    pub account: String,
    pub explain: bool,
}

/// A job listing's pages (`fetch(after_id)`), [`LIST_PAGES_MAX`] at most:
/// the jobs, and whether the listing ended within them.
async fn list_pages<F, Fut>(fetch: F) -> anyhow::Result<(Vec<pb::Job>, bool)>
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(Vec<pb::Job>, Option<u64>)>>,
{
    gangway_proto::client::paged(LIST_PAGES_MAX, 0, fetch).await
}

/// Every job matching `l`, page by page (linearizable reads).
/// Past LIST_PAGES_MAX pages it answers what it read, and says so on stderr.
pub async fn list_jobs(client: &Client, l: &Listing) -> anyhow::Result<Vec<pb::Job>> {
    let (all, whole) = list_pages(|after_id| async move {
        let req = pb::ListJobsRequest {
            states: l.states.clone(),
            user: l.user.clone(),
            partition: l.partition.clone(),
            account: l.account.clone(),
            explain: l.explain,
            limit: LIST_PAGE,
            after_id,
            ..Default::default()
        };
        let resp = client.job_list(req.clone()).await?.into_inner();
        let next = Some(resp.next_after_id).filter(|n| *n != 0);
        anyhow::Ok((resp.jobs, next))
    })
    .await?;
    if !whole {
        eprintln!(
            "gangway: only the first {} matching jobs are shown ({LIST_PAGES_MAX} pages); narrow the query \
             (a user, a partition, states)",
            all.len()
        );
    }
    Ok(all)
}

/// A job's spec, borrowed (an empty one if absent): fields are read per job
/// and column, and a spec carries its whole script and environment.
/// A job as Slurm's listings show it: a heterogeneous job is one line per
/// component, `ID+0`, `ID+1`, ..., each with its component's shape and nodes
/// (the allocation lists component 0's nodes first); any other job is itself.
pub fn het_components(j: pb::Job) -> Vec<pb::Job> {
    let Some(spec) = j.spec.as_ref().filter(|s| !s.components.is_empty()) else { return vec![j] };
    let id = if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() };
    let own = crate::jobspec::shape_of(spec);
    let mut first = 0usize;
    std::iter::once(own)
        .chain(spec.components.iter().cloned())
        .enumerate()
        .map(|(k, c)| {
            let count = usize::try_from(c.nodes.unwrap_or(1)).unwrap_or(1);
            let slice = |v: &[String]| v.iter().skip(first).take(count).cloned().collect::<Vec<_>>();
            let ran_on = slice(&j.ran_on);
            let allocation = j.allocation.iter().skip(first).take(count).cloned().collect();
            first = first.saturating_add(count);
            let spec = pb::JobSpec {
                partition: c.partition,
                nodes: c.nodes,
                tasks_per_node: c.tasks_per_node,
                cpus_per_task: c.cpus_per_task,
                mem_per_node_mb: c.mem_per_node_mb,
                mem_per_cpu_mb: c.mem_per_cpu_mb,
                gpus_per_node: c.gpus_per_node,
                gpu_type: c.gpu_type,
                constraints: c.constraints,
                exclusive: c.exclusive,
                nodelist: c.nodelist,
                exclude: c.exclude,
                components: Vec::new(),
                ..spec.clone()
            };
            pb::Job {
                display_id: format!("{id}+{k}"),
                spec: Some(spec),
                allocation,
                ran_on,
                // Steps run in the allocation of component 0 (the batch script's).
                steps: if k == 0 { j.steps.clone() } else { Vec::new() },
                ..j.clone()
            }
        })
        .collect()
}

pub fn spec(j: &pb::Job) -> &pb::JobSpec {
    static EMPTY: std::sync::LazyLock<pb::JobSpec> = std::sync::LazyLock::new(pb::JobSpec::default);
    j.spec.as_ref().unwrap_or(&EMPTY)
}

/// The nodes a job holds (running) or last ran on, as a hostlist.
pub fn job_nodelist(j: &pb::Job) -> String {
    let names: Vec<String> =
        if j.allocation.is_empty() { j.ran_on.clone() } else { j.allocation.iter().map(|a| a.node.clone()).collect() };
    gangway_node_agent::launch::compress_hostlist(&names)
}

/// A finished job's exit code as a shell sees it: its own, 128 + a killing
/// signal, 0 when it completed without one, else 1 (cancelled, node failure).
pub fn job_exit_code(job: &pb::Job) -> i32 {
    match (job.exit_code, job.exit_signal) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        (None, None) if job.state == pb::JobState::Completed as i32 => 0,
        (None, None) => 1,
    }
}

/// The job's nodes: allocated, or requested while pending.
pub fn job_nodes(j: &pb::Job) -> u64 {
    if !j.allocation.is_empty() {
        return j.allocation.len() as u64;
    }
    j.spec.as_ref().and_then(|s| s.nodes).unwrap_or(1).max(1) as u64
}

/// The job's CPUs: allocated, or requested while pending.
pub fn job_cpus(j: &pb::Job) -> u64 {
    if !j.allocation.is_empty() {
        return j.allocation.iter().map(|a| u64::from(a.cpus)).sum();
    }
    let s = spec(j);
    let per_node = s.tasks_per_node.unwrap_or(1).max(1) * s.cpus_per_task.unwrap_or(1).max(1);
    job_nodes(j) * per_node as u64
}

/// GPUs per node as Slurm's TRES string (`gres/gpu:h100=8`), or empty.
pub fn job_gres(j: &pb::Job) -> String {
    let s = spec(j);
    match s.gpus_per_node.unwrap_or(0) {
        0 => String::new(),
        n if s.gpu_type.is_empty() => format!("gres/gpu={n}"),
        n => format!("gres/gpu:{}={n}", s.gpu_type),
    }
}

/// Seconds the job has run (so far, or in all), leaving out the time it
/// was suspended, as Slurm's elapsed time does.
pub fn job_elapsed_s(j: &pb::Job, now: u64) -> u64 {
    let Some(start) = j.start_time_ms else { return 0 };
    let end = j.end_time_ms.unwrap_or(now);
    let suspended = j.suspended_ms.saturating_add(j.suspended_at_ms.map_or(0, |at| end.saturating_sub(at)));
    end.saturating_sub(start).saturating_sub(suspended) / 1000
}

/// Seconds the job spent suspended (so far, or in all).
pub fn job_suspended_s(j: &pb::Job, now: u64) -> u64 {
    let end = j.end_time_ms.unwrap_or(now);
    j.suspended_ms.saturating_add(j.suspended_at_ms.map_or(0, |at| end.saturating_sub(at))) / 1000
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// One page of a job listing: its jobs and the cursor of the next.
    type Page = anyhow::Result<(Vec<pb::Job>, Option<u64>)>;

    /// `pages` pages of one job each: the `n`th job's id is `n`.
    pub(crate) fn pages_of(pages: u64) -> impl FnMut(u64) -> std::future::Ready<Page> {
        move |after| {
            let id = after + 1;
            std::future::ready(Ok((vec![pb::Job { id, ..Default::default() }], (id < pages).then_some(id))))
        }
    }

    /// A listing of LIST_PAGES_MAX pages is read whole; one page more is
    /// cut at the limit (and said to be).
    #[tokio::test]
    async fn a_job_listing_reads_list_pages_max_pages() {
        let n = LIST_PAGES_MAX as u64;
        let (jobs, whole) = list_pages(pages_of(n)).await.unwrap();
        assert_eq!((jobs.len(), whole), (LIST_PAGES_MAX, true));
        let (jobs, whole) = list_pages(pages_of(n + 1)).await.unwrap();
        assert_eq!((jobs.len(), whole), (LIST_PAGES_MAX, false));
        assert_eq!(jobs.last().map(|j| j.id), Some(n));
    }

    /// A job selector names at most SELECTOR_INDEXES_MAX array indexes, in
    /// one range or several: at the limit it parses, one more is refused.
    #[test]
    fn a_selector_names_at_most_its_limit_of_indexes() {
        let n = SELECTOR_INDEXES_MAX as u32;
        let sel = JobSel::parse("-j", &format!("12_[0-{}]", n - 1)).unwrap();
        assert_eq!((sel.id, sel.indexes.map(|v| v.len())), (12, Some(SELECTOR_INDEXES_MAX)));
        let e = JobSel::parse("-j", &format!("12_[0-{n}]")).unwrap_err();
        assert!(e.starts_with("-j:") && e.contains(&SELECTOR_INDEXES_MAX.to_string()), "{e}");
        let split = JobSel::parse("-j", &format!("12_[0-9,10-{}]", n - 1)).unwrap();
        assert_eq!(split.indexes.map(|v| v.len()), Some(SELECTOR_INDEXES_MAX));
        assert!(JobSel::parse("-j", &format!("12_[0-9,10-{n}]")).is_err());
    }

    #[test]
    fn times_print_as_slurm_does() {
        // In local time: two hours east of UTC, and five west (the day before).
        assert_eq!(timestamp_in(1_796_084_311_000, 7200), "2026-12-01T02:18:31");
        assert_eq!(timestamp_in(1_796_084_311_000, -5 * 3600), "2026-11-30T19:18:31");
        assert_eq!(duration(0), "0:00");
        assert_eq!(duration(65), "1:05");
        assert_eq!(duration(3 * 3600 + 5), "3:00:05");
        assert_eq!(duration(2 * 86_400 + 3600), "2-01:00:00");
        assert_eq!(elapsed(5), "00:00:05");
        assert_eq!(timestamp(0), "1970-01-01T00:00:00");
        assert_eq!(timestamp(1_796_084_311_000), "2026-12-01T00:18:31");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29T00:00:00");
    }

    #[test]
    fn job_selectors_and_states_parse() {
        assert_eq!(JobSel::parse("-j", "12").unwrap(), JobSel { id: 12, indexes: None });
        assert_eq!(JobSel::parse("-j", "12_3").unwrap().indexes, Some(vec![3]));
        assert_eq!(JobSel::parse("-j", "12_[1-3,5]").unwrap().indexes, Some(vec![1, 2, 3, 5]));
        assert!(JobSel::parse("-j", "x").is_err());
        assert!(JobSel::parse("-j", "12_[3-1]").is_err());
        let array_elem = pb::Job { id: 14, array_job_id: Some(12), array_index: Some(2), ..Default::default() };
        assert!(JobSel::parse("", "12").unwrap().matches(&array_elem));
        assert!(JobSel::parse("", "12_2").unwrap().matches(&array_elem));
        assert!(!JobSel::parse("", "12_1").unwrap().matches(&array_elem));
        assert_eq!(parse_states("-t", &["pd".into(), "RUNNING".into()]).unwrap().len(), 2);
        assert_eq!(parse_states("-t", &["all".into()]).unwrap().len(), 9);
        assert_eq!(parse_states("-t", &["DL".into()]).unwrap(), vec![pb::JobState::Deadline as i32]);
        assert!(parse_states("-t", &["sleeping".into()]).unwrap_err().contains("-t"));
        assert_eq!(identity_user("dev:alice"), "alice");
    }
}
