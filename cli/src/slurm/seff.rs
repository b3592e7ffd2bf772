//! `seff JOBID`: how efficiently a job used what it held, as Slurm's seff
//! prints it (CPU and memory), plus its GPUs' mean utilization and peak
//! memory. The figures are what the job's agents measured (see the node
//! agent's `usage.rs`); a job the state no longer holds is read from the
//! accounting database.

use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use super::{elapsed, job_exit_code, spec};

/// What the rows name the cluster (as sacct and sreport do).
const CLUSTER: &str = "gangway";

#[derive(Args, Debug)]
pub struct SeffArgs {
    /// The job's id (an array element as `12_3`, or its own id).
    job: String,
}

/// A memory size as seff prints it: `512.00 MB`, `1.20 GB`.
fn size_mb(mb: f64) -> String {
    if mb >= 1024.0 {
        format!("{:.2} GB", mb / 1024.0)
    } else {
        format!("{mb:.2} MB")
    }
}

fn percent(used: f64, of: f64) -> String {
    if of <= 0.0 {
        return "0.00%".into();
    }
    format!("{:.2}%", 100.0 * used / of)
}

/// The report for `j` at `now_ms` (its user's group given). Pure.
pub fn report(j: &pb::Job, group: &str, now_ms: u64) -> String {
    let s = spec(j);
    let u = gangway_controller::accounting::store::usage(j, now_ms);
    let state = pb::JobState::try_from(j.state).unwrap_or(pb::JobState::Unspecified);
    let state_name = gangway_proto::job_state_name(j.state);
    let mut out = Vec::new();
    match (j.array_job_id, j.array_index) {
        (Some(a), Some(i)) => {
            out.push(format!("Job ID: {}", j.id));
            out.push(format!("Array Job ID: {a}_{i}"));
        }
        _ => out.push(format!("Job ID: {}", j.id)),
    }
    out.push(format!("Cluster: {CLUSTER}"));
    out.push(format!("User/Group: {}/{group}", s.user));
    let ended = super::ended(j.state);
    match ended {
        true => out.push(format!("State: {state_name} (exit code {})", job_exit_code(j))),
        false => out.push(format!("State: {state_name}")),
    }
    let nodes = if j.allocation.is_empty() { j.ran_on.len() } else { j.allocation.len() }.max(1);
    out.push(format!("Nodes: {nodes}"));
    out.push(format!("Cores per node: {}", u.cpus.max(0) as usize / nodes));
    let measured = j.usage.as_ref().filter(|_| state != pb::JobState::Pending);
    let core_walltime = u.cpus.max(0).saturating_mul(u.elapsed_s.max(0)) as f64;
    match measured {
        Some(m) => {
            let cpu_s = m.cpu_ms / 1000;
            out.push(format!("CPU Utilized: {}", elapsed(cpu_s)));
            out.push(format!(
                "CPU Efficiency: {} of {} core-walltime",
                percent(m.cpu_ms as f64 / 1000.0, core_walltime),
                elapsed(core_walltime as u64)
            ));
        }
        None => out.push("CPU Utilized: not measured (no agent reported this job's use)".into()),
    }
    out.push(format!("Job Wall-clock time: {}", elapsed(u.elapsed_s.max(0) as u64)));
    if let Some(m) = measured {
        let held = u.mem_mb.max(0) as f64;
        out.push(format!("Memory Utilized: {}", size_mb(m.mem_peak_mb as f64)));
        match held > 0.0 {
            true => out.push(format!(
                "Memory Efficiency: {} of {} ({}/node)",
                percent(m.mem_peak_mb as f64, held),
                size_mb(held),
                size_mb(held / nodes as f64)
            )),
            false => out.push("Memory Efficiency: no memory was requested".into()),
        }
    }
    if u.gpus > 0 {
        out.push(format!("GPUs: {} ({} per node)", u.gpus, u.gpus.max(0) as usize / nodes));
        match measured.and_then(|m| m.gpu_util_pct) {
            Some(pct) => {
                let m = measured.expect("measured");
                out.push(format!("GPU Utilized: {pct:.2}% (mean over the job's GPUs while it ran)"));
                out.push(format!("GPU Memory Utilized: {} (the most on one GPU)", size_mb(m.gpu_mem_peak_mb as f64)));
            }
            None => out.push("GPU Utilized: not measured (no GPU readings: NVML or a load file)".into()),
        }
    }
    if !ended {
        out.push(format!("WARNING: Efficiency statistics may be misleading for {state_name} jobs."));
    }
    out.join("\n") + "\n"
}

/// The job's user's primary group, as the passwd database says.
fn group_of(user: &str) -> String {
    let Ok(Some(u)) = nix::unistd::User::from_name(user) else { return user.to_string() };
    match nix::unistd::Group::from_gid(u.gid) {
        Ok(Some(g)) => g.name,
        _ => u.gid.to_string(),
    }
}

pub async fn run(client: &Client, a: SeffArgs) -> anyhow::Result<()> {
    let sel = super::JobSel::parse("job", &a.job).map_err(anyhow::Error::msg)?;
    if sel.indexes.as_ref().is_some_and(|ix| ix.len() != 1) {
        anyhow::bail!("seff: name one job, not a range: {}", a.job);
    }
    let job = match find_job(client, &sel).await? {
        Some(j) => j,
        None => anyhow::bail!("seff: job {} does not exist (nor in the history)", a.job),
    };
    print!("{}", report(&job, &group_of(&spec(&job).user), super::now_ms()));
    Ok(())
}

/// The job `sel` names: from the state, else from the accounting database.
async fn find_job(client: &Client, sel: &super::JobSel) -> anyhow::Result<Option<pb::Job>> {
    let exact = |j: &pb::Job| match &sel.indexes {
        None => j.id == sel.id,
        Some(_) => sel.matches(j),
    };
    if sel.indexes.is_none() {
        let got = client.job_get(pb::GetJobRequest { job_id: sel.id, stale: false }).await;
        match got {
            Ok(j) => return Ok(Some(j.into_inner())),
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => anyhow::bail!("seff: job {}: {}", sel.id, s.message()),
        }
    } else if let Some(j) = super::list_jobs(client, &super::Listing::default()).await?.into_iter().find(exact) {
        return Ok(Some(j));
    }
    // Gone from the state: the accounting database may have it.
    // One job: the id itself comes first below id + 1 (an array's elements,
    // which the id also matches, have larger ids); an element: every row.
    let req = match sel.indexes {
        None => {
            let before_id = sel.id.saturating_add(1);
            pb::HistoryRequest { job_ids: vec![sel.id], limit: 1, before_id, ..Default::default() }
        }
        Some(_) => pb::HistoryRequest { job_ids: vec![sel.id], limit: HISTORY_ROWS, ..Default::default() },
    };
    let resp = client.job_history(req.clone()).await;
    match resp {
        Ok(r) => Ok(r.into_inner().jobs.into_iter().find(exact)),
        Err(s) if s.code() == tonic::Code::FailedPrecondition => Ok(None),
        Err(s) => anyhow::bail!("seff: the job history: {}", s.message()),
    }
}

/// Rows asked of the history for one job (an array's elements come with it).
const HISTORY_ROWS: u32 = 10_000;

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> pb::Job {
        pb::Job {
            id: 42,
            spec: Some(pb::JobSpec {
                user: "alice".into(),
                nodes: Some(2),
                tasks_per_node: Some(1),
                cpus_per_task: Some(4),
                gpus_per_node: Some(2),
                mem_per_node_mb: Some(2048),
                ..Default::default()
            }),
            state: pb::JobState::Completed as i32,
            exit_code: Some(0),
            start_time_ms: Some(1_000),
            end_time_ms: Some(101_000),
            ran_on: vec!["a".into(), "b".into()],
            usage: Some(pb::JobUsage {
                nodes: 2,
                cpu_ms: 400_000,
                mem_peak_mb: 1024,
                gpu_util_pct: Some(37.5),
                gpu_mem_peak_mb: 40_960,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_finished_jobs_efficiency_reads_like_slurms_seff() {
        let r = report(&job(), "staff", 0);
        let want = "Job ID: 42\nCluster: gangway\nUser/Group: alice/staff\nState: COMPLETED (exit code 0)\n\
            Nodes: 2\nCores per node: 4\nCPU Utilized: 00:06:40\n\
            CPU Efficiency: 50.00% of 00:13:20 core-walltime\nJob Wall-clock time: 00:01:40\n\
            Memory Utilized: 1.00 GB\nMemory Efficiency: 25.00% of 4.00 GB (2.00 GB/node)\n\
            GPUs: 4 (2 per node)\nGPU Utilized: 37.50% (mean over the job's GPUs while it ran)\n\
            GPU Memory Utilized: 40.00 GB (the most on one GPU)\n";
        assert_eq!(r, want);
    }

    #[test]
    fn unmeasured_and_running_jobs_say_so() {
        let unmeasured = pb::Job { usage: None, ..job() };
        let r = report(&unmeasured, "staff", 0);
        assert!(r.contains("CPU Utilized: not measured") && r.contains("GPU Utilized: not measured"), "{r}");
        assert!(!r.contains("Memory Utilized"), "{r}");
        let running = pb::Job { state: pb::JobState::Running as i32, end_time_ms: None, ..job() };
        let r = report(&running, "staff", 201_000);
        assert!(r.contains("State: RUNNING\n") && r.ends_with("misleading for RUNNING jobs.\n"), "{r}");
        assert!(r.contains("Job Wall-clock time: 00:03:20"), "{r}");
    }
}
