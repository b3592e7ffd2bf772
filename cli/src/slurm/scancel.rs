//! `scancel`: cancel jobs by id (`12`, `12_3`, a whole array by its id), or
//! every pending/running job matching name, user, state, partition, account.

use anyhow::bail;
use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use super::{identity_user, JobSel};
use crate::output::Output;

#[derive(Args, Debug, Default)]
pub struct ScancelArgs {
    /// Job ids: 12, 12_3, 12_[1-3]; an array's id cancels all of it.
    ids: Vec<String>,
    #[arg(short = 'n', long = "name", alias = "jobname")]
    name: Option<String>,
    #[arg(short = 'u', long)]
    user: Option<String>,
    /// Only your own jobs.
    #[arg(long)]
    me: bool,
    /// PENDING/PD or RUNNING/R.
    #[arg(short = 't', long)]
    state: Option<String>,
    #[arg(short = 'p', long)]
    partition: Option<String>,
    #[arg(short = 'A', long)]
    account: Option<String>,
    #[arg(short = 'q', long)]
    qos: Option<String>,
    /// Send this signal (a name such as USR1, or a number) instead of
    /// cancelling: to the job's steps and commands, not its batch shell.
    #[arg(short = 's', long)]
    signal: Option<String>,
    /// With --signal: to the batch shell only.
    #[arg(short = 'b', long, requires = "signal")]
    batch: bool,
    /// With --signal: to every process of the job, the batch shell too.
    #[arg(short = 'f', long, requires = "signal", conflicts_with = "batch")]
    full: bool,
    /// Ask before each: not supported (scancel runs without a terminal here).
    #[arg(short = 'i', long)]
    interactive: bool,
    /// No error for jobs that already ended.
    #[arg(short = 'Q', long)]
    quiet: bool,
    /// Report each job cancelled.
    #[arg(short = 'v', long)]
    verbose: bool,
}

pub async fn run(client: &Client, out: &Output, identity: &str, a: ScancelArgs) -> anyhow::Result<()> {
    let signal = match a.signal.as_deref() {
        Some(s) => Some(crate::parse::signal_number(s).ok_or_else(|| {
            anyhow::anyhow!("--signal: Invalid --signal specification: '{s}' (a name such as USR1, or 1-64)")
        })? as i32),
        None => None,
    };
    let target = match (a.batch, a.full) {
        (true, _) => pb::SignalTarget::Batch,
        (_, true) => pb::SignalTarget::Full,
        _ => pb::SignalTarget::Steps,
    };
    if a.interactive {
        bail!("--interactive: not supported; list the jobs with squeue and cancel them by id");
    }
    let sels: Vec<JobSel> =
        a.ids.iter().map(|s| JobSel::parse("job id", s)).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?;
    let user = if a.me { Some(identity_user(identity)) } else { a.user.clone() };
    let filtered = a.name.is_some()
        || user.is_some()
        || a.state.is_some()
        || a.partition.is_some()
        || a.account.is_some()
        || a.qos.is_some();
    if sels.is_empty() && !filtered {
        bail!("job id: give job ids or a filter (--name, --user, --me, --state, --partition, --account, --qos)");
    }
    let states = match &a.state {
        Some(s) => {
            let st = super::parse_states("--state", std::slice::from_ref(s)).map_err(anyhow::Error::msg)?;
            if st.iter().any(|s| !super::LIVE_STATES.contains(s)) {
                bail!("--state: only PENDING, RUNNING and SUSPENDED jobs can be cancelled");
            }
            st
        }
        None => super::LIVE_STATES.to_vec(),
    };
    let listing = super::Listing {
        states,
        user: user.clone().unwrap_or_default(),
        partition: a.partition.clone().unwrap_or_default(),
        account: a.account.clone().unwrap_or_default(),
        explain: false,
    };
    let live = super::list_jobs(client, &listing).await?;
    let targets: Vec<&pb::Job> = live
        .iter()
        .filter(|j| sels.is_empty() || sels.iter().any(|s| s.matches(j)))
        .filter(|j| {
            let s = super::spec(j);
            a.name.as_ref().is_none_or(|n| *n == s.name) && a.qos.as_ref().is_none_or(|q| *q == s.qos)
        })
        .collect();
    let mut failed = 0;
    // Named ids that are not live: Slurm says so per id.
    // (-Q: no error for jobs that already ended.)
    for sel in sels.iter().filter(|_| !a.quiet) {
        if !targets.iter().any(|j| sel.matches(j)) {
            eprintln!(
                "scancel: error: Kill job error on job id {}: Job/step already completing or completed, or no such job",
                render_sel(sel)
            );
            failed += 1;
        }
    }
    let mut results = Vec::new();
    for j in targets {
        let shown = if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() };
        if let Some(sig) = signal {
            match crate::jobctl::signal_quiet(client, j.id, sig, target).await {
                Ok(()) => results.push(serde_json::json!({"job_id": j.id, "signalled": true})),
                Err(e) => {
                    let why = crate::output::one_line(&e);
                    results.push(serde_json::json!({"job_id": j.id, "signalled": false, "error": why}));
                    eprintln!("scancel: error: Signal job error on job id {shown}: {why}");
                    failed += 1;
                }
            }
            continue;
        }
        let req = pb::CancelRequest { job_id: j.id };
        let r = client.job_cancel(req).await;
        match r {
            Ok(_) => {
                results.push(serde_json::json!({"job_id": j.id, "cancelled": true}));
                if a.verbose {
                    eprintln!("scancel: Terminating job {shown}");
                }
            }
            Err(s) => {
                results.push(serde_json::json!({"job_id": j.id, "cancelled": false, "error": s.message()}));
                eprintln!("scancel: error: Kill job error on job id {shown}: {}", s.message());
                failed += 1;
            }
        }
    }
    if out.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    if failed > 0 {
        let what = if signal.is_some() { "signalled" } else { "cancelled" };
        bail!("{failed} job(s) not {what} (see above)");
    }
    Ok(())
}

fn render_sel(s: &JobSel) -> String {
    match &s.indexes {
        None => s.id.to_string(),
        Some(ix) if ix.len() == 1 => format!("{}_{}", s.id, ix[0]),
        Some(_) => format!("{}_[...]", s.id),
    }
}
