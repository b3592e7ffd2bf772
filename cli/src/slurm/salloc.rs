//! `salloc`: an interactive allocation. It submits a batch job whose nodes
//! only hold the allocation (every node a step host), waits until it runs,
//! then runs a command here (default: the user's shell on the first node, on
//! a terminal relayed here, Slurm's interactive step) with the job's
//! variables, so that `srun` there starts steps on the allocated nodes
//! through their agents and streams their output back to this terminal. When
//! the command ends, the allocation is given back: the job ends with the
//! command's exit code (COMPLETED when 0), as Slurm's does.

use anyhow::{bail, Context};
use clap::Args;
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;

use crate::output::Output;
use gangway_proto::retry::Retry;

/// Polls of the job's state while waiting for the allocation (every
/// WAIT_POLL): three weeks, far above any wait worth holding a terminal for.
const ALLOCATION_WAIT_POLLS_MAX: u64 = 10_000_000;
const WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(200);
const WAIT: Retry = Retry::new(ALLOCATION_WAIT_POLLS_MAX, WAIT_POLL);

#[derive(Args, Debug, Default)]
pub struct SallocArgs {
    #[command(flatten)]
    res: crate::jobspec::ResourceArgs,
    /// Exit once the allocation is granted, leaving it held (until its time
    /// limit or `scancel`): steps run in it with `srun --jobid=ID`.
    #[arg(long = "no-shell")]
    no_shell: bool,
    /// The command to run here in the allocation (default: $SHELL on the
    /// allocation's first node, through `srun --pty`).
    #[arg(trailing_var_arg = true)]
    command: Vec<String>,
}

pub async fn run(client: &Client, out: &Output, mut a: SallocArgs) -> anyhow::Result<i32> {
    let (components, command) = het_components(&a.res, &a.command)?;
    a.command = command;
    let args = || crate::jobspec::SubmitArgs { components: components.clone(), ..submit_args(&a) };
    if a.no_shell {
        if !a.command.is_empty() {
            bail!("--no-shell: no command runs in the allocation; leave out '{}'", a.command.join(" "));
        }
        let token = uuid::Uuid::new_v4().simple().to_string();
        return Ok(match allocate(client, out, allocation(args(), &token), Who::Salloc).await? {
            Some(job) => {
                eprintln!("salloc: Granted job allocation {}", job.id);
                eprintln!("salloc: the allocation is held until its time limit or `scancel {}`", job.id);
                0
            }
            None => 130,
        });
    }
    let command = if a.command.is_empty() {
        // Slurm's interactive step: the user's shell on the allocation's
        // first node, on a terminal relayed to this one.
        let exe = std::env::current_exe().context("salloc: cannot find the gangway binary")?;
        let shell = std::env::var("SHELL").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "/bin/sh".into());
        vec![exe.display().to_string(), "srun".into(), "--pty".into(), shell]
    } else {
        a.command.clone()
    };
    allocate_and_run(client, out, args(), &command, Who::Salloc).await
}

/// A later component's options on salloc's command line.
#[derive(clap::Parser)]
#[command(no_binary_name = true)]
struct ComponentArgs {
    #[command(flatten)]
    res: crate::jobspec::ResourceArgs,
    /// What follows: the next `:`, or the command.
    #[arg(trailing_var_arg = true)]
    rest: Vec<String>,
}

/// A heterogeneous allocation (`salloc OPTIONS0 : OPTIONS1 [command]`):
/// the further components' shapes, and the command after them. `-p` and
/// `-x` carry over from the component before unless given, as in sbatch.
fn het_components(
    first: &crate::jobspec::ResourceArgs,
    words: &[String],
) -> anyhow::Result<(Vec<pb::JobComponent>, Vec<String>)> {
    use clap::Parser;
    let mut carried = (first.partition.clone(), first.exclude.clone());
    let mut rest = words.to_vec();
    let mut out = Vec::new();
    while rest.first().is_some_and(|w| w == ":") && rest.get(1).is_some_and(|w| w.starts_with('-')) {
        let k = out.len().saturating_add(1);
        if k > gangway_core::limits::HET_COMPONENTS_MAX {
            bail!(
                "salloc: a heterogeneous job has at most {} components",
                gangway_core::limits::HET_COMPONENTS_MAX.saturating_add(1)
            );
        }
        let mut c = ComponentArgs::try_parse_from(&rest[1..])
            .map_err(|e| anyhow::anyhow!("salloc: hetjob component {k}: {}", e.to_string().trim()))?;
        crate::jobspec::component_res(k, &mut c.res, first, &mut carried)
            .map_err(|e| anyhow::anyhow!("salloc: {e}"))?;
        out.push(crate::jobspec::component(c.res).map_err(|e| anyhow::anyhow!("salloc: hetjob component {k}: {e:#}"))?);
        rest = c.rest;
    }
    Ok((out, rest))
}

/// What salloc submits: the resources asked for, named `interactive` unless
/// named otherwise.
pub fn submit_args(a: &SallocArgs) -> crate::jobspec::SubmitArgs {
    let mut res = a.res.clone();
    res.job_name = res.job_name.or_else(|| Some("interactive".into()));
    crate::jobspec::SubmitArgs { res, ..Default::default() }
}

/// `args` as an allocation: every node, the first too, only holds it for
/// steps; the first ends it with the exit code the client gives back
/// through the release directory `token` names.
pub fn allocation(mut args: crate::jobspec::SubmitArgs, token: &str) -> crate::jobspec::SubmitArgs {
    args.wrap = Some(gangway_node_agent::steps::release_hold_script(token));
    args.command = Vec::new();
    args.batch = true;
    args.output = Some("/dev/null".into());
    args
}

/// Who asks for the allocation: their messages differ.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Who {
    Salloc,
    /// srun outside a job: allocates, runs its step, gives the nodes back.
    Srun,
}

/// Submits `args` as an allocation whose every node only holds it, waits for
/// it, runs `command` here with the job's variables, gives the allocation
/// back, and returns the command's exit code.
pub async fn allocate_and_run(
    client: &Client,
    out: &Output,
    args: crate::jobspec::SubmitArgs,
    command: &[String],
    who: Who,
) -> anyhow::Result<i32> {
    let token = uuid::Uuid::new_v4().simple().to_string();
    let Some(job) = allocate(client, out, allocation(args, &token), who).await? else { return Ok(130) };
    let id = job.id;
    match who {
        Who::Salloc => eprintln!("salloc: Granted job allocation {id}"),
        Who::Srun if !out.json => eprintln!("srun: job {id} has been allocated resources"),
        Who::Srun => {}
    }
    let env = allocation_env(client, &job).await;
    let code = match &env {
        Ok(env) => {
            let status = tokio::process::Command::new(&command[0])
                .args(&command[1..])
                .envs(env.iter().cloned())
                .status()
                .await
                .with_context(|| format!("salloc: cannot run {}", command[0]));
            status.map(|s| {
                use std::os::unix::process::ExitStatusExt;
                s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
            })
        }
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    };
    if who == Who::Salloc {
        eprintln!("salloc: Relinquishing job allocation {id}");
    }
    // The job ends with the command's exit code (COMPLETED when 0), as
    // Slurm's salloc jobs do; a job that does not end so is cancelled.
    let released = match (&code, &env) {
        (Ok(c), Ok(env)) => release(client, &job, *c, env, &token).await,
        _ => false,
    };
    if !released {
        cancel(client, id).await;
    }
    code
}

/// Submits the allocation `args` and waits until it runs; None when
/// interrupted (Ctrl-C: the request is cancelled).
async fn allocate(
    client: &Client,
    out: &Output,
    args: crate::jobspec::SubmitArgs,
    who: Who,
) -> anyhow::Result<Option<pb::Job>> {
    let spec = crate::jobspec::job_spec(args, None)?;
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: uuid::Uuid::new_v4().to_string() };
    let id = client.job_submit(req.clone()).await?.into_inner().job_id;
    if !out.json {
        match who {
            Who::Salloc => eprintln!("salloc: Pending job allocation {id}"),
            Who::Srun => eprintln!("srun: job {id} queued and waiting for resources"),
        }
    }
    match wait_running(client, id).await {
        Ok(Some(job)) => Ok(Some(job)),
        Ok(None) => {
            eprintln!("{}: interrupted: job allocation {id} cancelled", name(who));
            cancel(client, id).await;
            Ok(None)
        }
        Err(e) => {
            cancel(client, id).await;
            Err(e)
        }
    }
}

/// Polls while the released allocation ends (its first node notices the
/// exit code within a second).
const RELEASE_POLLS_MAX: u64 = 75;
const RELEASE_POLLS: Retry = Retry::new(RELEASE_POLLS_MAX, WAIT_POLL);
/// How long the release step may take (it starts one shell on a node the
/// job holds); past it the allocation is cancelled instead.
const RELEASE_STEP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);
/// Tries of the release step, RELEASE_STEP_RETRY apart: the first node's
/// agent starts the job's task within a heartbeat or two of the grant.
const RELEASE_STEP_TRIES: u64 = 5;
const RELEASE_STEP: Retry = Retry::new(RELEASE_STEP_TRIES, std::time::Duration::from_millis(500));

/// Gives the allocation back with `code`: a step on the first node puts the
/// code in the release directory its hold script waits on (written aside,
/// then renamed, so it is never read half-written). Whether the job ended.
async fn release(client: &Client, job: &pb::Job, code: i32, env: &[(String, String)], token: &str) -> bool {
    let Some(first) = job.allocation.first().map(|a| a.node.clone()) else { return false };
    let Ok(exe) = std::env::current_exe() else { return false };
    // Only while the attempt that was granted still runs.
    let now = client.job_get(pb::GetJobRequest { job_id: job.id, stale: false }).await;
    if !now.is_ok_and(|j| {
        let j = j.into_inner();
        super::allocated(j.state) && j.attempt == job.attempt
    }) {
        return false;
    }
    let dir = gangway_node_agent::steps::release_dir(token);
    let write = format!("printf %s {} > {dir}/code.new && mv {dir}/code.new {dir}/code", code.clamp(0, 255));
    // A command that ends at once may end before the first node's agent
    // has started the job's task there, which the step needs: try again.
    let mut written = false;
    let mut tries = RELEASE_STEP.tries();
    while tries.next().await {
        let step = tokio::process::Command::new(&exe)
            .args(["srun", "-N1", "-n1", "-w", &first, "/bin/sh", "-c", &write])
            .envs(env.iter().cloned())
            .env(super::srun::STEP_UNRECORDED_ENV, "1")
            // The step starts in this directory on the node: one that exists there.
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .status();
        let step = tokio::time::timeout(RELEASE_STEP_TIMEOUT, step).await;
        if step.is_ok_and(|s| s.is_ok_and(|s| s.success())) {
            written = true;
            break;
        }
    }
    if !written {
        return false;
    }
    let mut polls = RELEASE_POLLS.tries();
    while polls.next().await {
        let got = client.job_get(pb::GetJobRequest { job_id: job.id, stale: false }).await;
        if got.is_ok_and(|j| super::ended(j.into_inner().state)) {
            return true;
        }
    }
    false
}

fn name(who: Who) -> &'static str {
    match who {
        Who::Salloc => "salloc",
        Who::Srun => "srun",
    }
}

/// Waits until the job runs; None when interrupted (Ctrl-C).
async fn wait_running(client: &Client, id: u64) -> anyhow::Result<Option<pb::Job>> {
    let mut polls = WAIT.tries();
    while polls.next().await {
        let polled = tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(None),
            r = client.job_get(pb::GetJobRequest { job_id: id, stale: false }) => r?.into_inner(),
        };
        // Allocated, and started: an elastic pool's nodes have booted (the
        // clock starts once all of them registered, with their addresses).
        if super::allocated(polled.state) && polled.start_time_ms.is_some() {
            return Ok(Some(polled));
        }
        if super::ended(polled.state) {
            bail!("job {id} ended {} before it ran: {}", super::state_name(polled.state), polled.reason);
        }
    }
    bail!("gave up waiting for job {id}")
}

/// The job's variables for the command run in the allocation: enough for
/// srun (nodes, attempt, each node's step service) and for scripts.
pub async fn allocation_env(client: &Client, job: &pb::Job) -> anyhow::Result<Vec<(String, String)>> {
    let nodes: Vec<String> = job.allocation.iter().map(|a| a.node.clone()).collect();
    let mut addrs = Vec::new();
    for n in &nodes {
        let node = client.node_get(pb::GetNodeRequest { name: n.clone(), stale: false }).await?.into_inner();
        addrs.push(format!("{n}={}", gangway_proto::step_addr(n, &node.addr).unwrap_or_default()));
    }
    let spec = super::spec(job);
    let list = super::hostlist::compress(&nodes);
    let here = crate::daemons::hostname();
    let tpn = spec.tasks_per_node.unwrap_or(1).max(1);
    let mut env = vec![
        ("SLURM_JOB_ID", job.id.to_string()),
        ("SLURM_JOBID", job.id.to_string()),
        ("SLURM_JOB_NAME", spec.name.clone()),
        ("SLURM_JOB_NODELIST", list.clone()),
        ("SLURM_NODELIST", list),
        ("SLURM_JOB_NUM_NODES", nodes.len().to_string()),
        ("SLURM_NNODES", nodes.len().to_string()),
        ("SLURM_NTASKS_PER_NODE", tpn.to_string()),
        ("SLURM_NTASKS", (tpn as usize * nodes.len()).to_string()),
        ("SLURM_SUBMIT_DIR", spec.workdir.clone()),
        ("SLURMD_NODENAME", here),
        ("GANGWAY_JOB_ID", job.id.to_string()),
        ("GANGWAY_ATTEMPT", job.attempt.to_string()),
        ("GANGWAY_STEP_ADDRS", addrs.join(",")),
        // So that srun here records its steps in the job's history.
        ("GANGWAY_ENDPOINTS", client.endpoints().join(",")),
    ];
    if let Some(c) = spec.cpus_per_task {
        env.push(("SLURM_CPUS_PER_TASK", c.to_string()));
    }
    let mut env: Vec<(String, String)> = env.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    // A heterogeneous job's components, as its agents give them to the
    // script: srun here runs in component 0 unless --het-group says.
    if !spec.components.is_empty() {
        let parts = super::het_components(job.clone());
        env.push(("SLURM_HET_SIZE".into(), parts.len().to_string()));
        for (k, part) in parts.iter().enumerate() {
            let nodes: Vec<String> = part.allocation.iter().map(|a| a.node.clone()).collect();
            let tpn = super::spec(part).tasks_per_node.unwrap_or(1).max(1);
            env.push((format!("SLURM_JOB_NODELIST_HET_GROUP_{k}"), super::hostlist::compress(&nodes)));
            env.push((format!("SLURM_NNODES_HET_GROUP_{k}"), nodes.len().to_string()));
            env.push((format!("SLURM_NTASKS_PER_NODE_HET_GROUP_{k}"), tpn.to_string()));
        }
    }
    // On a secured cluster srun here needs the job's step credential and the
    // CA to check the agents by.
    if let Some(creds) = client.security().credentials() {
        let cred = client.job_step_credential(pb::StepCredentialRequest { job_id: job.id }).await?.into_inner();
        env.push((gangway_proto::step_cred::STEP_CREDENTIAL_ENV.to_string(), cred.credential));
        let ca = std::fs::read_to_string(&creds.files().ca)
            .with_context(|| format!("reading the CA certificate {}", creds.files().ca.display()))?;
        env.push((gangway_proto::step_cred::STEP_CA_ENV.to_string(), ca));
    }
    Ok(env)
}

async fn cancel(client: &Client, id: u64) {
    let _ = client.job_cancel(pb::CancelRequest { job_id: id }).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_proto::retry::count_tries;
    use std::time::Duration;

    /// Each wait makes its polls and no more, for the time its reason
    /// needs: an allocation is waited for weeks (ALLOCATION_WAIT_POLLS_MAX), a released
    /// one's end for seconds (RELEASE_POLLS_MAX: its first node notices
    /// within one), the release step for a few heartbeats (RELEASE_STEP_TRIES).
    #[tokio::test]
    async fn salloc_waits_are_bounded_by_their_reasons() {
        assert_eq!(WAIT.attempts, ALLOCATION_WAIT_POLLS_MAX);
        assert!(WAIT.span() >= Duration::from_secs(14 * 24 * 3600), "{:?}", WAIT.span());
        assert_eq!(count_tries(RELEASE_POLLS).await, RELEASE_POLLS_MAX);
        assert!(RELEASE_POLLS.span() >= Duration::from_secs(10), "{:?}", RELEASE_POLLS.span());
        assert_eq!(count_tries(RELEASE_STEP).await, RELEASE_STEP_TRIES);
        assert!(RELEASE_STEP.span() >= Duration::from_secs(2), "two heartbeats: {:?}", RELEASE_STEP.span());
    }
}
