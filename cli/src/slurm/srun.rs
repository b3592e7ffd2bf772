//! `srun` inside a job: runs a step's tasks with Slurm's per-task environment.
//!
//! In a batch job (sbatch) the script runs on the first node of the
//! allocation only, as in Slurm, and `srun` there starts the whole step: this
//! node's tasks as its own children, the other nodes' through their agents'
//! step service (their output and exit codes come back here). `srun torchrun
//! ...` runs one torchrun per node, `srun -n 16 python train.py` on 2 nodes
//! runs `SLURM_PROCID` 0-7 on the first and 8-15 on the second, and `srun -N1
//! -n1 -w NODE cmd` runs on NODE only.
//!
//! A job submitted with `gangway submit` (no --batch) runs its command on
//! every node; `srun` there starts only this node's share of the step (and
//! returns at once on nodes that are not in it).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::Stdio;

use anyhow::{bail, Context};
use clap::Args;

use super::hostlist;

/// Tasks one `srun` may start on a node: far above the CPUs of any node.
const TASKS_PER_NODE_MAX: u32 = 1024;

#[derive(Args, Debug, Default)]
#[command(disable_help_flag = true)]
pub struct SrunArgs {
    #[arg(long, action = clap::ArgAction::Help)]
    help: Option<bool>,
    /// What the step uses (-N, -n, --ntasks-per-node, -w, -c, --gpus-per-task
    /// shape it inside a job) and, outside a job, what the job srun submits
    /// and waits for asks for: the same options as submit, sbatch and salloc.
    #[command(flatten)]
    res: crate::jobspec::ResourceArgs,
    /// Run in this job's allocation (only the current job is supported).
    #[arg(long)]
    jobid: Option<String>,
    /// In a heterogeneous job: the components to run in (`0`, `1`, `0,1`,
    /// `0-2`, `all`); default 0.
    #[arg(long = "het-group")]
    het_group: Option<String>,
    /// Accepted: steps may always share the allocation's resources.
    #[arg(long)]
    overlap: bool,
    /// Kill the step's other tasks when one exits non-zero (`-K` alone: 1).
    #[arg(short = 'K', long = "kill-on-bad-exit", num_args = 0..=1, default_missing_value = "1", require_equals = true)]
    kill_on_bad_exit: Option<u32>,
    /// Accepted: tasks are waited for until they all end.
    #[arg(short = 'W', long)]
    wait: Option<u32>,
    /// Prefix each output line with the task's rank.
    #[arg(short = 'l', long)]
    label: bool,
    /// Accepted: output is passed through as it comes.
    #[arg(short = 'u', long)]
    unbuffered: bool,
    /// ALL (default), NONE, or VAR[=VALUE],... for the tasks' environment.
    #[arg(long)]
    export: Option<String>,
    /// Accepted without effect (tasks are not pinned).
    #[arg(long = "cpu-bind")]
    cpu_bind: Option<String>,
    #[arg(long = "gpu-bind")]
    gpu_bind: Option<String>,
    /// Accepted: PMI/PMIx is not provided; launchers that rendezvous over TCP
    /// (torchrun, NCCL's env:// init) work, MPI needs mpirun.
    #[arg(long)]
    mpi: Option<String>,
    /// Run the task on a pseudo-terminal relayed to this one (an interactive
    /// shell: `srun --pty bash`): one task, on the step's first node.
    #[arg(long)]
    pty: bool,
    #[arg(long = "container-image", hide = true)]
    container_image: Option<String>,
    #[arg(long = "container-mounts", hide = true)]
    container_mounts: Option<String>,
    #[arg(long = "container-name", hide = true)]
    container_name: Option<String>,
    #[arg(long = "container-workdir", hide = true)]
    container_workdir: Option<String>,
    /// The command and its arguments (options after the command are its own).
    #[arg(trailing_var_arg = true, required = true)]
    command: Vec<String>,
}

/// A step's shape inside a job: the shared resource options read as a step
/// of the allocation (counts, not a request to the scheduler).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepShape {
    pub nodes: Option<String>,
    pub nodelist: Option<String>,
    /// Nodes of the allocation the step leaves out (a hostlist).
    pub exclude: Option<String>,
    pub ntasks: Option<u32>,
    pub ntasks_per_node: Option<u32>,
    pub cpus_per_task: Option<u32>,
    pub gpus_per_task: Option<u32>,
}

impl StepShape {
    pub fn of(r: &crate::jobspec::ResourceArgs) -> Result<StepShape, String> {
        let count = |v: Option<i64>, opt: &str| {
            v.map(|n| u32::try_from(n).map_err(|_| format!("{opt}: must be a count from 0 to {}, got {n}", u32::MAX)))
                .transpose()
        };
        let gpus_per_task = match r.gpus_per_task.as_deref() {
            None => None,
            Some(g) => {
                let (_, n) = crate::parse::gpus(g).map_err(|e| e.replace("--gpus-per-node", "--gpus-per-task"))?;
                count(Some(n), "--gpus-per-task")?
            }
        };
        Ok(StepShape {
            nodes: r.nodes.clone(),
            nodelist: r.nodelist.clone(),
            exclude: r.exclude.clone(),
            ntasks: count(r.ntasks, "--ntasks")?,
            ntasks_per_node: count(r.ntasks_per_node, "--ntasks-per-node")?,
            cpus_per_task: count(r.cpus_per_task, "--cpus-per-task")?,
            gpus_per_task,
        })
    }
}

/// The resource options given that shape a job, not a step: inside a job
/// srun does not apply them.
fn job_only_options(r: &crate::jobspec::ResourceArgs) -> Vec<&'static str> {
    [
        (r.partition.is_some(), "-p"),
        (r.time.is_some(), "-t"),
        (r.account.is_some(), "-A"),
        (r.qos.is_some(), "-q"),
        (r.gpus.is_some(), "-G"),
        (r.gpus_per_node.is_some(), "--gpus-per-node"),
        (r.gres.is_some(), "--gres"),
        (r.mem.is_some(), "--mem"),
        (r.mem_per_cpu.is_some(), "--mem-per-cpu"),
        (r.mem_per_gpu.is_some(), "--mem-per-gpu"),
        (r.cpus_per_gpu.is_some(), "--cpus-per-gpu"),
        (r.constraint.is_some(), "-C"),
        (r.exclusive.is_some(), "--exclusive"),
        (r.licenses.is_some(), "-L"),
        (r.reservation.is_some(), "--reservation"),
        (r.time_min.is_some(), "--time-min"),
        (r.deadline.is_some(), "--deadline"),
    ]
    .into_iter()
    .filter(|(given, _)| *given)
    .map(|(_, name)| name)
    .collect()
}

/// This node's part of a step: which tasks run here and with what ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The step's nodes, in allocation order.
    pub nodes: Vec<String>,
    /// Tasks per step node.
    pub per_node: Vec<u32>,
    /// This node's index among the step's nodes (None: not in the step).
    pub here: Option<usize>,
}

impl Share {
    pub fn ntasks(&self) -> u32 {
        self.per_node.iter().sum()
    }

    /// The global rank of the first task on the step's `node_index`th node.
    pub fn first_rank(&self, node_index: usize) -> u32 {
        self.per_node[..node_index].iter().sum()
    }
}

/// Works out the step's layout from the allocation and the options.
pub fn plan(alloc: &[String], me: &str, alloc_tasks_per_node: u32, a: &StepShape) -> Result<Share, String> {
    let mut nodes: Vec<String> = match &a.nodelist {
        Some(list) => {
            let want = hostlist::expand(list)?;
            for w in &want {
                if !alloc.contains(w) {
                    return Err(format!(
                        "--nodelist: {w} is not in this job's allocation ({})",
                        hostlist::compress(alloc)
                    ));
                }
            }
            alloc.iter().filter(|n| want.contains(n)).cloned().collect()
        }
        None => alloc.to_vec(),
    };
    if let Some(list) = &a.exclude {
        let leave = hostlist::expand(list).map_err(|e| format!("--exclude: {e}"))?;
        nodes.retain(|n| !leave.contains(n));
    }
    if let Some(n) = &a.nodes {
        let (lo, _) = crate::parse::node_range(n)?;
        let count = lo as usize;
        if count > nodes.len() {
            return Err(format!(
                "--nodes: {count} nodes, but the step has only {} ({})",
                nodes.len(),
                hostlist::compress(&nodes)
            ));
        }
        nodes.truncate(count);
    }
    if nodes.is_empty() {
        return Err("--nodes: the step has no nodes".into());
    }
    let n = nodes.len() as u32;
    let per_node: Vec<u32> = match (a.ntasks, a.ntasks_per_node) {
        (Some(0), _) | (_, Some(0)) => return Err("--ntasks: must be at least 1".into()),
        (Some(total), _) if total < n => {
            // Fewer tasks than nodes: one each on the first `total` nodes.
            nodes.truncate(total as usize);
            vec![1; total as usize]
        }
        // Slurm's block distribution: the first nodes take the remainder.
        (Some(total), _) => (0..n).map(|i| total / n + u32::from(i < total % n)).collect(),
        (None, Some(k)) => vec![k; n as usize],
        (None, None) if a.nodes.is_none() && a.nodelist.is_none() => vec![alloc_tasks_per_node.max(1); n as usize],
        (None, None) => vec![1; n as usize],
    };
    if per_node.iter().any(|&k| k > TASKS_PER_NODE_MAX) {
        return Err(format!("--ntasks: at most {TASKS_PER_NODE_MAX} tasks per node"));
    }
    let here = nodes.iter().position(|x| x == me);
    Ok(Share { nodes, per_node, here })
}

fn env_or(name: &str) -> anyhow::Result<String> {
    std::env::var(name).map_err(|_| {
        anyhow::anyhow!(
            "srun: {name} is not set: srun runs inside a job (sbatch or gangway submit); \
             interactive allocations are not supported yet"
        )
    })
}

/// Whether srun runs inside a job (else it submits one and waits for it).
pub fn inside_job() -> bool {
    std::env::var_os("SLURM_JOB_ID").is_some()
}

/// What srun outside a job submits, and the srun it runs inside the job
/// (`exe`: this binary): the job takes the resource options as submit would;
/// the inner srun gets the task options that shape the step.
pub fn outside_job(
    a: &SrunArgs,
    exe: &str,
    environment: impl Iterator<Item = (String, String)>,
) -> anyhow::Result<(crate::jobspec::SubmitArgs, Vec<String>)> {
    // Inside the job: the same srun with the task options, fanning out per node.
    let shape = StepShape::of(&a.res).map_err(anyhow::Error::msg)?;
    // The job's nodes and tasks per node, by the rule submit, sbatch and
    // salloc use.
    let listed = match &a.res.nodelist {
        Some(list) => Some(hostlist::expand(list).map_err(|e| anyhow::anyhow!("--nodelist: {e}"))?.len() as i64),
        None => None,
    };
    let asked = match &shape.nodes {
        Some(n) => Some(i64::from(crate::parse::node_range(n).map_err(anyhow::Error::msg)?.0)),
        None => listed,
    };
    let (nodes, per_node) = crate::jobspec::task_layout(asked, a.res.ntasks, a.res.ntasks_per_node)?;
    let mut inner: Vec<String> = vec![exe.to_string(), "srun".into()];
    if let Some(k) = per_node {
        inner.push(format!("--ntasks-per-node={k}"));
    }
    if let Some(c) = shape.cpus_per_task {
        inner.push(format!("--cpus-per-task={c}"));
    }
    if let Some(g) = shape.gpus_per_task {
        inner.push(format!("--gpus-per-task={g}"));
    }
    if let Some(k) = a.kill_on_bad_exit {
        inner.push(format!("--kill-on-bad-exit={k}"));
    }
    if a.label {
        inner.push("--label".into());
    }
    if a.pty {
        inner.push("--pty".into());
    }
    if let Some(e) = &a.export {
        inner.push(format!("--export={e}"));
    }
    inner.push("--".into());
    inner.extend(a.command.iter().cloned());
    let mut res = a.res.clone();
    res.job_name = res.job_name.or_else(|| a.command.first().map(|c| c.rsplit('/').next().unwrap_or(c).to_string()));
    if res.nodes.is_none() && res.nodelist.is_none() {
        res.nodes = nodes.map(|n| n.to_string());
    }
    res.ntasks = None;
    res.ntasks_per_node = per_node;
    // The job's GPUs: what was asked per node or in all, else per task (the
    // srun inside splits them among the tasks either way).
    if res.gpus.is_some() || res.gpus_per_node.is_some() || res.gres.is_some() {
        res.gpus_per_task = None;
    }
    let args = crate::jobspec::SubmitArgs {
        res,
        env: crate::sbatch::export_env(None, environment)
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
        ..Default::default()
    };
    Ok((args, inner))
}

/// srun outside a job: allocates the nodes (as salloc does), runs the same
/// srun here inside that allocation, so the step's tasks start on the nodes
/// through their agents and their output streams back to this terminal (no
/// shared file system needed), gives the nodes back, and exits with the
/// step's exit code. Ctrl-C while waiting cancels the request; during the
/// step it ends the tasks.
pub async fn submit_and_wait(
    client: &gangway_proto::client::Client,
    out: &crate::output::Output,
    a: SrunArgs,
) -> anyhow::Result<i32> {
    if let Some(job) = a.jobid.as_deref() {
        return in_running_job(client, job).await;
    }
    let exe = std::env::current_exe().context("srun: cannot find the gangway binary")?;
    let (args, inner) = outside_job(&a, &exe.display().to_string(), std::env::vars())?;
    super::salloc::allocate_and_run(client, out, args, &inner, super::salloc::Who::Srun).await
}

/// srun --jobid outside a job: a step in that running job, by this same
/// srun run again with the job's variables (as salloc's command gets them),
/// so `srun --jobid 42 --pty bash` opens a shell on job 42's first node.
/// Only the job's owner gets the step credential a secured cluster's agents
/// ask for (on an insecure cluster the agents trust the network).
async fn in_running_job(client: &gangway_proto::client::Client, job: &str) -> anyhow::Result<i32> {
    let id: u64 = job.parse().map_err(|_| anyhow::anyhow!("srun: --jobid: '{job}' is not a job id"))?;
    let found = client.job_get(gangway_proto::v1::GetJobRequest { job_id: id, stale: false }).await?.into_inner();
    if !super::allocated(found.state) {
        bail!("srun: --jobid: job {id} is {}: steps run only in a running job", super::state_name(found.state));
    }
    let env = super::salloc::allocation_env(client, &found).await?;
    let exe = std::env::current_exe().context("srun: cannot find the gangway binary")?;
    // SIGINT reaches the step's srun as well (the same process group): this
    // one only waits for it.
    let _interrupts = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let status = tokio::process::Command::new(exe)
        .args(crate::shim_argv().into_iter().skip(1))
        .envs(env)
        .status()
        .await
        .context("srun: cannot run the step")?;
    Ok(status_code(status))
}

pub fn run(a: SrunArgs) -> anyhow::Result<i32> {
    for (set, opt) in [
        (a.container_image.is_some(), "--container-image"),
        (a.container_mounts.is_some(), "--container-mounts"),
        (a.container_name.is_some(), "--container-name"),
        (a.container_workdir.is_some(), "--container-workdir"),
    ] {
        if set {
            bail!("{opt}: {}", crate::sbatch::PYXIS);
        }
    }
    let job = env_or("SLURM_JOB_ID")?;
    if let Some(other) = a.jobid.as_deref().filter(|j| *j != job) {
        bail!("--jobid: only this job ({job}) can run steps here, not {other}");
    }
    let (alloc, tpn) = step_allocation(a.het_group.as_deref())?;
    let me = env_or("SLURMD_NODENAME")?;
    let mut shape = StepShape::of(&a.res).map_err(|e| anyhow::anyhow!("srun: {e}"))?;
    if a.pty && shape.nodes.is_none() && shape.nodelist.is_none() && shape.ntasks.is_none() {
        // A terminal step is one task, on the first node unless -w says.
        shape.nodes = Some("1".into());
        shape.ntasks = Some(1);
    }
    let ignored = job_only_options(&a.res);
    if !ignored.is_empty() {
        eprintln!(
            "srun: {} ask for the job srun submits outside a job; inside one, steps share its allocation (ignored)",
            ignored.join(", ")
        );
    }
    let share = plan(&alloc, &me, tpn, &shape).map_err(|e| anyhow::anyhow!("srun: {e}"))?;
    // A batch job (sbatch) runs its script on the first node only: srun starts
    // the whole step from here, the other nodes' tasks through their agents.
    // Otherwise every node runs the script and starts its own share.
    let step_addrs = match (std::env::var("GANGWAY_STEP_ADDRS"), std::env::var("GANGWAY_STEP_ADDRS_FILE")) {
        (Ok(v), _) => Some(parse_step_addrs(&v)),
        // A big gang's addresses, too long for one environment variable.
        (Err(_), Ok(file)) => Some(parse_step_addrs(&read_step_addrs_file(&file)?)),
        _ => None,
    };
    if a.pty {
        if share.ntasks() != 1 {
            bail!("srun: --pty: a terminal step runs one task, and this one has {} (use -n1)", share.ntasks());
        }
        if step_addrs.is_none() {
            bail!(
                "srun: --pty: terminal steps run from a login node (srun --pty, salloc, srun --jobid) \
                 or an sbatch script, not from a job that runs its command on every node"
            );
        }
    }
    let targets: Vec<usize> = match (&step_addrs, share.here) {
        (Some(_), _) => (0..share.nodes.len()).collect(),
        (None, Some(here)) => vec![here],
        (None, None) => return Ok(0), // this node is not in the step: its tasks run elsewhere
    };
    // The whole step starts here (a batch job): it is recorded in the job's
    // history, on its nodes (none listed: all of the job's).
    let record = step_addrs.is_some() && std::env::var_os(STEP_UNRECORDED_ENV).is_none();
    let mut step = Step {
        args: a,
        shape,
        share,
        me,
        job,
        attempt: std::env::var("GANGWAY_ATTEMPT").ok().and_then(|v| v.parse().ok()).unwrap_or(1),
        addrs: step_addrs.unwrap_or_default(),
        step_id: None,
        key: uuid::Uuid::new_v4().simple().to_string(),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("srun: tokio runtime")?;
    rt.block_on(async move {
        let job_id: Option<u64> = step.job.parse().ok();
        if let Some(job_id) = job_id.filter(|_| record) {
            let name = step_name(step.args.command.first().map(String::as_str).unwrap_or("srun"));
            let nodes = if step.share.nodes == alloc { Vec::new() } else { step.share.nodes.clone() };
            step.step_id = begin_step(job_id, step.attempt, &name, &nodes, step.share.ntasks()).await;
        }
        let code = if step.args.pty { step.attach().await } else { step.execute(&targets).await };
        if let (Some(job_id), Some(step_id)) = (job_id, step.step_id) {
            end_step(job_id, step.attempt, step_id, *code.as_ref().unwrap_or(&1)).await;
        }
        code
    })
}

/// The nodes a step may use, in order, and their tasks per node: the job's
/// allocation, or in a heterogeneous job the chosen components' (`--het-group`,
/// Slurm's default 0), with the first one's tasks per node.
fn step_allocation(het_group: Option<&str>) -> anyhow::Result<(Vec<String>, u32)> {
    let tpn_of = |var: &str| std::env::var(var).ok().and_then(|v| v.parse::<u32>().ok()).unwrap_or(1);
    let size = std::env::var("SLURM_HET_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
    if size == 0 {
        if let Some(g) = het_group.filter(|g| *g != "0") {
            bail!("srun: --het-group={g}: this job is not heterogeneous (its only component is 0)");
        }
        let alloc = hostlist::expand(&env_or("SLURM_JOB_NODELIST")?).map_err(anyhow::Error::msg)?;
        return Ok((alloc, tpn_of("SLURM_NTASKS_PER_NODE")));
    }
    let groups = het_groups(het_group.unwrap_or("0"), size).map_err(|e| anyhow::anyhow!("srun: --het-group: {e}"))?;
    let mut nodes = Vec::new();
    for g in &groups {
        let list = env_or(&format!("SLURM_JOB_NODELIST_HET_GROUP_{g}"))?;
        nodes.extend(hostlist::expand(&list).map_err(anyhow::Error::msg)?);
    }
    Ok((nodes, tpn_of(&format!("SLURM_NTASKS_PER_NODE_HET_GROUP_{}", groups[0]))))
}

/// Slurm's `--het-group` list: `all`, or components and ranges (`0,2-3`),
/// each below `size`; in order, each once.
fn het_groups(spec: &str, size: usize) -> Result<Vec<usize>, String> {
    if spec.eq_ignore_ascii_case("all") {
        return Ok((0..size).collect());
    }
    let mut out = std::collections::BTreeSet::new();
    for item in spec.split(',') {
        let (lo, hi) = item.split_once('-').unwrap_or((item, item));
        let parse = |v: &str| v.trim().parse::<usize>().map_err(|_| format!("'{item}' is not a component number"));
        let (lo, hi) = (parse(lo)?, parse(hi)?);
        if lo > hi || hi >= size {
            return Err(format!("'{item}': this job's components are 0 to {}", size.saturating_sub(1)));
        }
        out.extend(lo..=hi);
    }
    Ok(out.into_iter().collect())
}

/// Set (to anything) for a step of Gangway's own that is not the user's
/// (salloc's release of the allocation): it is not recorded in the job's history.
pub const STEP_UNRECORDED_ENV: &str = "GANGWAY_STEP_UNRECORDED";

/// Characters of a step's recorded name (the controllers' limit is 64 bytes).
const STEP_NAME_CHARS_MAX: usize = 16;
const _: () = assert!(STEP_NAME_CHARS_MAX * 4 <= gangway_core::limits::STEP_NAME_BYTES_MAX);

/// The name a step is recorded under: its program's file name, its first
/// STEP_NAME_CHARS_MAX characters, control characters shown as `?`.
fn step_name(program: &str) -> String {
    let name = program.rsplit('/').next().unwrap_or(program);
    name.chars().take(STEP_NAME_CHARS_MAX).map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// Longest step-address file srun reads: every node of the largest gang
/// with a long name and address.
const STEP_ADDRS_FILE_BYTES_MAX: u64 = 16 * 1024 * 1024;

fn read_step_addrs_file(file: &str) -> anyhow::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(file)
        .and_then(|f| f.take(STEP_ADDRS_FILE_BYTES_MAX + 1).read_to_string(&mut text))
        .with_context(|| format!("srun: GANGWAY_STEP_ADDRS_FILE {file}"))?;
    if text.len() as u64 > STEP_ADDRS_FILE_BYTES_MAX {
        bail!("srun: GANGWAY_STEP_ADDRS_FILE {file}: more than {STEP_ADDRS_FILE_BYTES_MAX} bytes");
    }
    Ok(text)
}

/// `node=HOST:PORT,...` (the agent's GANGWAY_STEP_ADDRS) as a map.
fn parse_step_addrs(v: &str) -> BTreeMap<String, String> {
    v.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, a)| (k.to_string(), a.to_string())).collect()
}

/// Events from a step's tasks, local or remote, buffered before srun writes
/// them (past it, the tasks' readers wait and their pipes fill).
const STEP_EVENTS_QUEUE_MAX: usize = 1024;

/// The queue of a step's events: [`STEP_EVENTS_QUEUE_MAX`].
fn step_events() -> (tokio::sync::mpsc::Sender<Ev>, tokio::sync::mpsc::Receiver<Ev>) {
    tokio::sync::mpsc::channel(STEP_EVENTS_QUEUE_MAX)
}
/// How long srun waits to reach another node's agent.
const STEP_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Bytes read from a local task's pipe at a time.
const PIPE_CHUNK_BYTES: usize = 64 * 1024;

enum Ev {
    Out {
        rank: u32,
        stderr: bool,
        data: Vec<u8>,
    },
    /// A task ended with this exit code (128+signal when killed); `error`
    /// says why it could not start or was lost.
    End {
        rank: u32,
        code: i32,
        error: String,
    },
}

/// One srun invocation inside a job.
struct Step {
    args: SrunArgs,
    shape: StepShape,
    share: Share,
    me: String,
    job: String,
    attempt: u32,
    /// Each node's step service (batch jobs).
    addrs: BTreeMap<String, String>,
    /// The step's id in the job's history (SLURM_STEP_ID), when recorded.
    step_id: Option<u32>,
    /// This call's name at the agents (`StepRequest.step_key`): with it, a
    /// restarted agent keeps the tasks for srun to resume.
    key: String,
}

impl Step {
    /// Every task's environment on top of the inherited one: Slurm's per-task
    /// variables and the rendezvous variables training launchers read.
    fn task_vars(&self, node_index: usize, local: u32) -> BTreeMap<String, String> {
        let share = &self.share;
        let rank = share.first_rank(node_index) + local;
        let ntasks = share.ntasks().to_string();
        let per_node: Vec<String> = share.per_node.iter().map(u32::to_string).collect();
        let mut v = BTreeMap::new();
        let mut set = |k: &str, val: String| {
            v.insert(k.to_string(), val);
        };
        set("SLURM_PROCID", rank.to_string());
        set("SLURM_LOCALID", local.to_string());
        set("SLURM_NODEID", node_index.to_string());
        set("SLURM_NTASKS", ntasks.clone());
        set("SLURM_NPROCS", ntasks.clone());
        set("SLURM_STEP_NUM_TASKS", ntasks.clone());
        set("SLURM_STEP_NUM_NODES", share.nodes.len().to_string());
        set("SLURM_STEP_NODELIST", hostlist::compress(&share.nodes));
        set("SLURM_STEP_TASKS_PER_NODE", per_node.join(","));
        set("SLURM_TASKS_PER_NODE", per_node.join(","));
        set("SLURM_JOB_ID", self.job.clone());
        if let Some(id) = self.step_id {
            set("SLURM_STEP_ID", id.to_string());
            set("SLURM_STEPID", id.to_string());
        }
        set("SLURMD_NODENAME", share.nodes[node_index].clone());
        set("RANK", rank.to_string());
        set("LOCAL_RANK", local.to_string());
        set("WORLD_SIZE", ntasks);
        set("LOCAL_WORLD_SIZE", share.per_node[node_index].to_string());
        set("NODE_RANK", node_index.to_string());
        if let Some(c) = self.shape.cpus_per_task {
            set("SLURM_CPUS_PER_TASK", c.to_string());
        }
        v
    }

    /// The node that runs task `rank`.
    fn node_of(&self, rank: u32) -> &str {
        let i = (0..self.share.nodes.len()).rfind(|&i| self.share.first_rank(i) <= rank).unwrap_or(0);
        &self.share.nodes[i]
    }

    /// The environment every task starts from: srun's own, or what --export
    /// keeps of it (the job's SLURM_*/GANGWAY_* variables always pass).
    fn base_env(&self) -> anyhow::Result<Option<Vec<(String, String)>>> {
        let Some(spec) = self.args.export.as_deref() else { return Ok(None) };
        let mut env = crate::sbatch::export_env(Some(spec), std::env::vars()).map_err(anyhow::Error::msg)?;
        env.extend(std::env::vars().filter(|(k, _)| k.starts_with("SLURM_") || k.starts_with("GANGWAY_")));
        Ok(Some(env))
    }

    /// Starts the step's tasks on `targets` (indexes of its nodes), writes
    /// their output, and returns the worst exit code.
    async fn execute(&self, targets: &[usize]) -> anyhow::Result<i32> {
        // Slurm's --signal warnings reach the tasks through the job's process
        // group (and the step hosts' on other nodes); srun must outlive them.
        use tokio::signal::unix::{signal, SignalKind};
        let _outlive: Vec<_> = [SignalKind::user_defined1(), SignalKind::user_defined2(), SignalKind::alarm()]
            .into_iter()
            .filter_map(|k| signal(k).ok())
            .collect();
        let (tx, mut rx) = step_events();
        let base = self.base_env()?;
        let mut total = 0usize;
        // The other nodes' tasks first, all at once: a node that cannot start
        // its share fails the step before any task runs (dropping the calls
        // that did start kills their tasks).
        let mut calls = Vec::new();
        for &ni in targets {
            total += self.share.per_node[ni] as usize;
            let node = &self.share.nodes[ni];
            if *node == self.me {
                continue;
            }
            let req = self.remote_request(ni, base.as_deref())?;
            let addr = self.step_addr(node)?;
            let node = node.clone();
            calls.push(async move { start_remote(&node, &addr, req).await.map(|s| (ni, node, s)) });
        }
        let streams = futures::future::try_join_all(calls).await?;
        let mut local_pids: Vec<u32> = Vec::new();
        for &ni in targets.iter().filter(|&&ni| self.share.nodes[ni] == self.me) {
            for l in 0..self.share.per_node[ni] {
                match self.spawn_local(ni, l, base.as_deref(), &tx) {
                    Ok(pid) => local_pids.push(pid),
                    Err(e) => {
                        kill_pids(&local_pids);
                        return Err(e);
                    }
                }
            }
        }
        let mut remotes: Vec<tokio::task::JoinHandle<()>> = Vec::new();
        for (ni, node, mut stream) in streams {
            let tx = tx.clone();
            let count = self.share.per_node[ni];
            let mut open: std::collections::BTreeSet<u32> = (0..count).map(|l| self.share.first_rank(ni) + l).collect();
            let addr = self.addrs.get(&node).cloned().unwrap_or_default();
            let id = (self.job.parse().unwrap_or(0), self.attempt, self.key.clone());
            remotes.push(tokio::spawn(async move {
                use gangway_proto::v1::step_event::Kind;
                let mut resumed = 0;
                // Bounded by the remote tasks' lives (the stream ends with
                // them) and by RESUMES_MAX agent restarts.
                loop {
                    let ev = match stream.message().await {
                        Ok(Some(gangway_proto::v1::StepEvent { kind: Some(k) })) => k,
                        Ok(Some(_)) => continue,
                        Ok(None) | Err(_) if !may_resume(open.len(), resumed) => break,
                        // The agent went away with tasks running: a restarted
                        // one kept them.
                        Ok(None) | Err(_) => match resume(&node, &addr, &id).await {
                            Some(s) => {
                                stream = s;
                                resumed += 1;
                                continue;
                            }
                            None => break,
                        },
                    };
                    // Only this node's tasks, each ended once.
                    let ev = match ev {
                        Kind::Output(o) if open.contains(&o.rank) => {
                            Ev::Out { rank: o.rank, stderr: o.stderr, data: o.data }
                        }
                        Kind::End(e) if open.remove(&e.rank) => {
                            let code = e.exit_code.unwrap_or_else(|| e.signal.map_or(1, |s| 128 + s));
                            Ev::End { rank: e.rank, code, error: e.error }
                        }
                        Kind::Output(_) | Kind::End(_) => continue,
                    };
                    if tx.send(ev).await.is_err() {
                        return;
                    }
                }
                for rank in open {
                    let error = format!("lost contact with {node}'s agent");
                    let _ = tx.send(Ev::End { rank, code: 1, error }).await;
                }
            }));
        }
        drop(tx);
        let kill_on_bad = self.args.kill_on_bad_exit.unwrap_or(0) != 0;
        let mut out = Writer { label: self.args.label, carry: BTreeMap::new() };
        let mut worst = 0;
        // Bounded by the tasks: each ends once (remote ones are ended by srun
        // when their agent goes away).
        while total > 0 {
            let Some(ev) = rx.recv().await else { break };
            match ev {
                Ev::Out { rank, stderr, data } => out.write(rank, stderr, &data),
                Ev::End { rank, code, error } => {
                    total -= 1;
                    out.flush(rank);
                    // Slurm's wording, which log scrapers look for.
                    let node = self.node_of(rank);
                    if !error.is_empty() {
                        eprintln!("srun: error: {node}: task {rank}: {error}");
                    } else if code > 128 {
                        eprintln!("srun: error: {node}: task {rank}: Killed by signal {}", code - 128);
                    } else if code != 0 {
                        eprintln!("srun: error: {node}: task {rank}: Exited with exit code {code}");
                    }
                    worst = worst.max(code);
                    if code != 0 && kill_on_bad && total > 0 {
                        eprintln!("srun: killing the step's other tasks (--kill-on-bad-exit)");
                        kill_pids(&local_pids);
                        // Dropping a remote call kills its tasks there.
                        for r in &remotes {
                            r.abort();
                        }
                        break;
                    }
                }
            }
        }
        Ok(worst)
    }

    /// `node`'s step service, as the job's start gave it.
    fn step_addr(&self, node: &str) -> anyhow::Result<String> {
        self.addrs
            .get(node)
            .filter(|a| !a.is_empty())
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("srun: {node}'s agent serves no steps (it runs with --step-listen none)"))
    }

    /// A terminal step (`--pty`): its one task on its node's terminal,
    /// relayed to this one.
    async fn attach(&self) -> anyhow::Result<i32> {
        let node = &self.share.nodes[0];
        let base = self.base_env()?;
        let req = self.remote_request(0, base.as_deref())?;
        let channel = step_channel(node, &self.step_addr(node)?).await?;
        let ended = super::pty::attach(node, channel, req, credential()?).await?;
        if !ended.error.is_empty() {
            eprintln!("srun: error: {node}: task 0: {}", ended.error);
        }
        Ok(ended.code)
    }

    /// Starts one task here; its output is passed through, or labelled.
    fn spawn_local(
        &self,
        ni: usize,
        l: u32,
        base: Option<&[(String, String)]>,
        tx: &tokio::sync::mpsc::Sender<Ev>,
    ) -> anyhow::Result<u32> {
        let a = &self.args;
        let vars = self.task_vars(ni, l);
        let rank: u32 = vars["SLURM_PROCID"].parse().expect("rank");
        let mut cmd = tokio::process::Command::new(&a.command[0]);
        cmd.args(&a.command[1..]);
        if let Some(base) = base {
            cmd.env_clear().envs(base.iter().cloned());
        }
        cmd.envs(&vars);
        if let Some(g) = self.shape.gpus_per_task {
            let gpus: Vec<String> = std::env::var("CUDA_VISIBLE_DEVICES")
                .ok()
                .map(|v| v.split(',').filter(|g| !g.is_empty()).map(str::to_string).collect())
                .unwrap_or_default();
            let local = self.share.per_node[ni];
            // In u64: a huge --gpus-per-task is refused, never an overflow.
            let (g64, local64, l64) = (u64::from(g), u64::from(local), u64::from(l));
            if g64 * local64 > gpus.len() as u64 {
                bail!("--gpus-per-task: {local} tasks x {g} GPUs, but this node has {} for the job", gpus.len());
            }
            // l < local, so (l + 1) * g <= local * g <= the GPUs listed.
            let (from, to) = ((l64 * g64) as usize, ((l64 + 1) * g64) as usize);
            cmd.env("CUDA_VISIBLE_DEVICES", gpus[from..to].join(","));
        }
        if a.label {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = cmd.spawn().with_context(|| format!("srun: cannot start {}", a.command[0]))?;
        let pid = child.id().unwrap_or(0);
        let pipes = [
            child.stdout.take().map(|p| (Box::new(p) as Box<dyn tokio::io::AsyncRead + Send + Unpin>, false)),
            child.stderr.take().map(|p| (Box::new(p) as Box<dyn tokio::io::AsyncRead + Send + Unpin>, true)),
        ];
        let tx = tx.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let pumps = pipes.into_iter().flatten().map(|(mut pipe, stderr)| {
                let tx = tx.clone();
                async move {
                    let mut buf = vec![0u8; PIPE_CHUNK_BYTES];
                    // Bounded by the pipe: it ends when the task closes it.
                    while let Ok(n) = pipe.read(&mut buf).await {
                        if n == 0 || tx.send(Ev::Out { rank, stderr, data: buf[..n].to_vec() }).await.is_err() {
                            break;
                        }
                    }
                }
            });
            futures::future::join_all(pumps).await;
            let (code, error) = match child.wait().await {
                Ok(s) => (status_code(s), String::new()),
                Err(e) => (1, format!("lost track of the task: {e}")),
            };
            let _ = tx.send(Ev::End { rank, code, error }).await;
        });
        Ok(pid)
    }

    /// The request that starts node `ni`'s tasks through its agent.
    fn remote_request(
        &self,
        ni: usize,
        base: Option<&[(String, String)]>,
    ) -> anyhow::Result<gangway_proto::v1::StepRequest> {
        let a = &self.args;
        let env = match base {
            Some(b) => b.iter().cloned().collect(),
            None => std::env::vars().collect(),
        };
        let tasks = (0..self.share.per_node[ni])
            .map(|l| {
                let env = self.task_vars(ni, l);
                let rank = env["SLURM_PROCID"].parse().expect("rank");
                gangway_proto::v1::StepTask { rank, env: env.into_iter().collect() }
            })
            .collect();
        Ok(gangway_proto::v1::StepRequest {
            job_id: self.job.parse().with_context(|| format!("srun: SLURM_JOB_ID {} is not a job id", self.job))?,
            attempt: self.attempt,
            argv: a.command.clone(),
            env,
            tasks,
            workdir: std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default(),
            gpus_per_task: self.shape.gpus_per_task.unwrap_or(0),
            window: None,
            step_key: self.key.clone(),
        })
    }
}

/// A channel to `node`'s step service, at `addr` (from the job's start) or,
/// when that does not answer, wherever the controllers say the node's agent
/// serves steps now (it may have restarted on another port).
async fn step_channel(node: &str, addr: &str) -> anyhow::Result<tonic::transport::Channel> {
    match connect(node, addr).await {
        Ok(c) => Ok(c),
        Err(first) => match current_step_addr(node).await.filter(|now| now != addr) {
            Some(now) => connect(node, &now).await,
            None => Err(first),
        },
    }
}

/// The job's step credential for the agents' calls; it travels only over
/// TLS, to the agent of the node asked for.
fn credential() -> anyhow::Result<Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>> {
    let secured = !step_security()?.is_insecure();
    let Some(token) = std::env::var(gangway_proto::step_cred::STEP_CREDENTIAL_ENV).ok().filter(|_| secured) else {
        return Ok(None);
    };
    let v = token.parse().map_err(|_| anyhow::anyhow!("srun: the step credential is not printable ASCII"))?;
    Ok(Some(v))
}

/// Starts a step's tasks on `node` through its agent (see [`step_channel`]).
async fn start_remote(
    node: &str,
    addr: &str,
    req: gangway_proto::v1::StepRequest,
) -> anyhow::Result<tonic::Streaming<gangway_proto::v1::StepEvent>> {
    use gangway_proto::v1::step_service_client::StepServiceClient;
    let channel = step_channel(node, addr).await?;
    let mut req = tonic::Request::new(req);
    if let Some(v) = credential()? {
        req.metadata_mut().insert(gangway_proto::step_cred::STEP_CREDENTIAL_METADATA_KEY, v);
    }
    let resp = StepServiceClient::new(channel)
        .run(req)
        .await
        .map_err(|s| anyhow::anyhow!("srun: {node} refused the step: {}", s.message()))?;
    Ok(resp.into_inner())
}

/// Agent restarts one step survives on one node.
const RESUMES_MAX: u32 = 16;

/// Whether a node's step stream that ended is resumed: while its tasks run
/// (`open` of them not ended), after `resumed` agent restarts.
fn may_resume(open: usize, resumed: u32) -> bool {
    open > 0 && resumed < RESUMES_MAX
}
/// How long srun tries to resume a step whose agent went away: a restart
/// takes seconds, and the restarted agent keeps the tasks for a minute
/// (`kept::RESUME_WAIT`).
const RESUME_WAIT: std::time::Duration = std::time::Duration::from_secs(60);
const RESUME_RETRY: std::time::Duration = std::time::Duration::from_secs(1);
/// Tries within RESUME_WAIT (each at least RESUME_RETRY apart).
const RESUME_TRIES: u32 = 60;

/// Resumes the step `id` (job, attempt, key) on `node` once its agent is
/// back (where the controllers say it serves steps now, else at `addr`).
/// None: the agent has nothing to resume (the step's tasks ended with the
/// agent, or it was not restarted), or it never came back.
async fn resume(
    node: &str,
    addr: &str,
    id: &(u64, u32, String),
) -> Option<tonic::Streaming<gangway_proto::v1::StepEvent>> {
    use gangway_proto::v1::step_service_client::StepServiceClient;
    let (job_id, attempt, key) = id;
    eprintln!("srun: lost contact with {node}'s agent; waiting for it to resume the step");
    let deadline = tokio::time::Instant::now() + RESUME_WAIT;
    for _ in 0..RESUME_TRIES {
        tokio::time::sleep(RESUME_RETRY).await;
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        let now = current_step_addr(node).await.unwrap_or_else(|| addr.to_string());
        let Ok(channel) = connect(node, &now).await else { continue };
        let req = gangway_proto::v1::StepResumeRequest { job_id: *job_id, attempt: *attempt, step_key: key.clone() };
        let mut req = tonic::Request::new(req);
        if let Ok(Some(v)) = credential() {
            req.metadata_mut().insert(gangway_proto::step_cred::STEP_CREDENTIAL_METADATA_KEY, v);
        }
        match StepServiceClient::new(channel).resume(req).await {
            Ok(r) => {
                eprintln!("srun: {node}'s agent is back: step resumed");
                return Some(r.into_inner());
            }
            // The agent answered: retrying would not change its answer.
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::FailedPrecondition
                        | tonic::Code::Unimplemented
                        | tonic::Code::PermissionDenied
                        | tonic::Code::Unauthenticated
                        | tonic::Code::InvalidArgument
                ) =>
            {
                eprintln!("srun: {node}: {}", s.message());
                return None;
            }
            Err(_) => continue,
        }
    }
    None
}

/// How srun reaches the agents: over TLS, checking each is the agent of the
/// node it asked for, when the job's environment carries the cluster's CA
/// (a secured cluster); plaintext otherwise.
fn step_security() -> anyhow::Result<gangway_proto::tls::Security> {
    use gangway_proto::tls::{Credentials, Security};
    match std::env::var(gangway_proto::step_cred::STEP_CA_ENV) {
        Ok(pem) if !pem.is_empty() => Ok(Security::Tls(
            Credentials::from_ca_pem(
                pem.as_bytes(),
                std::env::var(gangway_proto::step_cred::STEP_CLUSTER_ENV).ok().as_deref().filter(|c| !c.is_empty()),
            )
            .map_err(|e| anyhow::anyhow!("srun: {e}"))?,
        )),
        _ => Ok(Security::Insecure),
    }
}

async fn connect(node: &str, addr: &str) -> anyhow::Result<tonic::transport::Channel> {
    let expect = gangway_proto::tls::Expect::Agent(node.to_string());
    step_security()?
        .connect(addr, expect, STEP_CONNECT_TIMEOUT)
        .await
        .map_err(|e| anyhow::anyhow!("srun: cannot reach {node}'s agent at {addr}: {e}"))
}

/// `node`'s step service as the controllers know it now (GANGWAY_ENDPOINTS
/// is in every job's environment), if they answer.
async fn current_step_addr(node: &str) -> Option<String> {
    let client = job_client()?;
    let req = gangway_proto::v1::GetNodeRequest { name: node.to_string(), stale: true };
    let n = client.node_get(req.clone()).await.ok()?.into_inner();
    gangway_proto::step_addr(node, &n.addr)
}

/// A client of the controllers from inside a job (GANGWAY_ENDPOINTS is in
/// every job's environment), vouched for by the job's step credential.
fn job_client() -> Option<gangway_proto::client::Client> {
    let endpoints: Vec<String> = std::env::var("GANGWAY_ENDPOINTS").ok()?.split(',').map(str::to_string).collect();
    let identity = std::env::var("GANGWAY_IDENTITY").unwrap_or_else(|_| "dev:srun".into());
    // The job's step credential vouches for srun (its user may have no
    // certificate here); otherwise whatever the user's CLI would use.
    let step_credential = std::env::var(gangway_proto::step_cred::STEP_CREDENTIAL_ENV).ok();
    let security = match &step_credential {
        Some(_) => step_security().ok()?,
        None => crate::tls::TlsArgs::from_env().for_client(&endpoints).ok()?,
    };
    let mut client = gangway_proto::client::Client::new(&endpoints, &identity, &security).ok()?;
    if let Some(c) = &step_credential {
        client = client.with_step_credential(c).ok()?;
    } else if let Ok(t) = std::env::var("GANGWAY_TOKEN") {
        client = client.with_bearer(&t).ok()?;
    }
    Some(client)
}

/// How long srun waits for the controllers to record a step's start or end:
/// the step itself never waits on accounting longer than this.
const STEP_RECORD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Records the step's start in the job's history (sacct's `ID.N`); its id,
/// or None when it could not be recorded (an older cluster, the controllers
/// unreachable): the step runs all the same.
async fn begin_step(job_id: u64, attempt: u32, name: &str, nodes: &[String], tasks: u32) -> Option<u32> {
    let client = job_client()?;
    let req =
        gangway_proto::v1::BeginStepRequest { job_id, attempt, name: name.to_string(), nodes: nodes.to_vec(), tasks };
    let call = client.job_begin_step(req.clone());
    match tokio::time::timeout(STEP_RECORD_TIMEOUT, call).await {
        Ok(Ok(resp)) => Some(resp.into_inner().step_id),
        Ok(Err(e)) => {
            // A step the controllers refuse to record (too many nodes
            // listed) is said; an older cluster's refusal is not.
            if e.code() == tonic::Code::InvalidArgument {
                eprintln!("srun: the step is not recorded: {}", e.message());
            }
            None
        }
        Err(_) => None,
    }
}

/// Records the step's end: its worst exit code (128+N: killed by signal N).
async fn end_step(job_id: u64, attempt: u32, step_id: u32, code: i32) {
    let Some(client) = job_client() else { return };
    let (exit_code, signal) = match code {
        c if (129..=192).contains(&c) => (None, Some(c - 128)),
        c => (Some(c.clamp(0, 255)), None),
    };
    let req = gangway_proto::v1::EndStepRequest { job_id, attempt, step_id, exit_code, signal };
    let call = client.job_end_step(req);
    let _ = tokio::time::timeout(STEP_RECORD_TIMEOUT, call).await;
}

/// Writes tasks' output to srun's stdout and stderr, whole lines prefixed
/// with the task's rank under --label.
struct Writer {
    label: bool,
    /// Partial lines per (rank, stderr) under --label.
    carry: BTreeMap<(u32, bool), Vec<u8>>,
}

impl Writer {
    fn write(&mut self, rank: u32, stderr: bool, data: &[u8]) {
        if !self.label {
            emit(stderr, data);
            return;
        }
        let carry = self.carry.entry((rank, stderr)).or_default();
        carry.extend_from_slice(data);
        let Some(last) = carry.iter().rposition(|b| *b == b'\n') else { return };
        let rest = carry.split_off(last + 1);
        let lines = std::mem::replace(carry, rest);
        let mut text = Vec::with_capacity(lines.len() + 16);
        for line in lines.split_inclusive(|b| *b == b'\n') {
            text.extend_from_slice(format!("{rank}: ").as_bytes());
            text.extend_from_slice(line);
        }
        emit(stderr, &text);
    }

    /// A task ended: its unterminated last lines are written.
    fn flush(&mut self, rank: u32) {
        for stderr in [false, true] {
            if let Some(rest) = self.carry.remove(&(rank, stderr)).filter(|r| !r.is_empty()) {
                emit(stderr, format!("{rank}: {}\n", String::from_utf8_lossy(&rest)).as_bytes());
            }
        }
    }
}

/// Ends tasks srun started here (SIGKILL, as Slurm ends a failed step).
fn kill_pids(pids: &[u32]) {
    for pid in pids {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid as i32), nix::sys::signal::Signal::SIGKILL);
    }
}

fn emit(stderr: bool, data: &[u8]) {
    if stderr {
        let _ = std::io::stderr().write_all(data);
    } else {
        let mut o = std::io::stdout();
        let _ = o.write_all(data);
        let _ = o.flush();
    }
}

fn status_code(s: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's events wait for srun's writer up to STEP_EVENTS_QUEUE_MAX;
    /// one more waits for room. A node's stream is resumed RESUMES_MAX
    /// times, and only while its tasks run.
    #[test]
    fn step_events_and_resumes_are_bounded() {
        let (tx, mut rx) = step_events();
        let end = || Ev::End { rank: 0, code: 0, error: String::new() };
        for _ in 0..STEP_EVENTS_QUEUE_MAX {
            assert!(tx.try_send(end()).is_ok());
        }
        assert!(matches!(tx.try_send(end()), Err(tokio::sync::mpsc::error::TrySendError::Full(_))));
        assert!(rx.try_recv().is_ok());
        assert!(tx.try_send(end()).is_ok());
        assert!(may_resume(1, RESUMES_MAX - 1));
        assert!(!may_resume(1, RESUMES_MAX), "one resume past the limit");
        assert!(!may_resume(0, 0), "no task left to resume");
    }

    /// A step's name keeps STEP_NAME_CHARS_MAX characters of its program's
    /// name (four-byte characters still within the controllers' limit), and
    /// the step-address file is read up to STEP_ADDRS_FILE_BYTES_MAX bytes:
    /// one byte more is refused, naming the variable and the limit.
    #[test]
    fn step_names_and_address_files_stop_at_their_limits() {
        let at = "p".repeat(STEP_NAME_CHARS_MAX);
        assert_eq!(step_name(&format!("/usr/bin/{at}")), at);
        assert_eq!(step_name(&format!("{at}q")), at, "one character past");
        assert_eq!(step_name(&"\u{1F600}".repeat(STEP_NAME_CHARS_MAX + 1)).len(), 4 * STEP_NAME_CHARS_MAX);
        assert_eq!(step_name("a\nb"), "a?b");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("addrs");
        let path = file.to_str().unwrap();
        std::fs::write(&file, "x".repeat(STEP_ADDRS_FILE_BYTES_MAX as usize)).unwrap();
        assert_eq!(read_step_addrs_file(path).unwrap().len() as u64, STEP_ADDRS_FILE_BYTES_MAX);
        std::fs::write(&file, "x".repeat(STEP_ADDRS_FILE_BYTES_MAX as usize + 1)).unwrap();
        let e = read_step_addrs_file(path).unwrap_err().to_string();
        assert!(e.contains("GANGWAY_STEP_ADDRS_FILE") && e.contains(&STEP_ADDRS_FILE_BYTES_MAX.to_string()), "{e}");
    }
    use clap::Parser;

    #[derive(Parser)]
    #[command(disable_help_flag = true)]
    struct Cli {
        #[command(flatten)]
        a: SrunArgs,
    }

    fn args(argv: &[&str]) -> SrunArgs {
        Cli::try_parse_from(std::iter::once("srun").chain(argv.iter().copied())).unwrap().a
    }

    fn shape(argv: &[&str]) -> StepShape {
        StepShape::of(&args(argv).res).unwrap()
    }

    /// A step of TASKS_PER_NODE_MAX tasks on a node is planned; one task
    /// more on any node is refused, naming the option and the limit.
    #[test]
    fn steps_have_at_most_tasks_per_node_max_tasks_on_a_node() {
        let alloc: Vec<String> = ["n1", "n2"].iter().map(|s| s.to_string()).collect();
        let per = TASKS_PER_NODE_MAX.to_string();
        let s = plan(&alloc, "n1", 1, &shape(&["--ntasks-per-node", &per, "x"])).unwrap();
        assert_eq!(s.per_node, vec![TASKS_PER_NODE_MAX; 2]);
        let past = (TASKS_PER_NODE_MAX + 1).to_string();
        let err = plan(&alloc, "n1", 1, &shape(&["--ntasks-per-node", &past, "x"])).unwrap_err();
        assert_eq!(err, format!("--ntasks: at most {TASKS_PER_NODE_MAX} tasks per node"));
        // Block distribution: the first node takes the odd task.
        let total = (2 * TASKS_PER_NODE_MAX + 1).to_string();
        assert!(plan(&alloc, "n1", 1, &shape(&["-n", &total, "x"])).is_err());
        assert!(plan(&alloc, "n1", TASKS_PER_NODE_MAX + 1, &shape(&["x"])).is_err(), "the allocation's own");
    }

    #[test]
    fn steps_spread_over_the_allocation_as_slurm_does() {
        let alloc: Vec<String> = ["n1", "n2", "n3"].iter().map(|s| s.to_string()).collect();
        // One task per node by default; this node's rank follows the node order.
        let s = plan(&alloc, "n2", 1, &shape(&["torchrun", "--nproc-per-node=8", "train.py"])).unwrap();
        assert_eq!((s.per_node.clone(), s.here, s.first_rank(1), s.ntasks()), (vec![1, 1, 1], Some(1), 1, 3));
        // Block distribution of 8 tasks over 3 nodes: 3, 3, 2.
        let s = plan(&alloc, "n3", 1, &shape(&["-n", "8", "python", "x.py"])).unwrap();
        assert_eq!((s.per_node.clone(), s.first_rank(2)), (vec![3, 3, 2], 6));
        // A helper step on one named node: the others are not in it.
        let s = plan(&alloc, "n1", 1, &shape(&["-N1", "-n1", "-w", "n3", "hostname"])).unwrap();
        assert_eq!((s.nodes.clone(), s.here), (vec!["n3".to_string()], None));
        let s = plan(&alloc, "n1", 4, &shape(&["--nodes=1", "--ntasks=1", "nvidia-smi"])).unwrap();
        assert_eq!((s.per_node.clone(), s.here), (vec![1], Some(0)));
        // The allocation's tasks per node when nothing is said.
        assert_eq!(plan(&alloc, "n1", 4, &shape(&["bash", "-c", "x"])).unwrap().per_node, vec![4, 4, 4]);
        assert!(plan(&alloc, "n1", 1, &shape(&["-w", "n9", "x"])).unwrap_err().contains("n9"));
        // Options after the command are the command's own.
        assert_eq!(args(&["-l", "torchrun", "--nnodes", "2", "-x"]).command, ["torchrun", "--nnodes", "2", "-x"]);
        assert!(plan(&alloc, "n1", 1, &shape(&["-N", "4", "x"])).unwrap_err().contains("--nodes"));
        // -x leaves nodes out of the step.
        let s = plan(&alloc, "n1", 1, &shape(&["-x", "n2", "hostname"])).unwrap();
        assert_eq!(s.nodes, vec!["n1".to_string(), "n3".to_string()]);
        // Options that shape a job, not a step, are named as ignored inside one.
        assert_eq!(job_only_options(&args(&["--mem=4G", "-p", "gpu", "-n", "2", "x"]).res), vec!["-p", "--mem"]);
    }
}
