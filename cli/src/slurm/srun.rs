//! `srun` inside a job: runs a step's tasks with Slurm's per-task environment.
//!
//! Gangway runs a job's batch script once on every node of its allocation (as
//! if the whole script were one step), so `srun` in that script starts this
//! node's share of the step's tasks: `srun torchrun ...` runs one torchrun per
//! node, `srun -n 16 python train.py` on 2 nodes runs 8 per node with
//! `SLURM_PROCID` 0-7 here and 8-15 there, and `srun -N1 -n1 -w NODE cmd` runs
//! only on NODE (it returns at once everywhere else). Commands outside `srun`
//! run on every node too, which is the one difference from Slurm (where they
//! run on the first node only).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

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
    /// Tasks in the step (default: one per node, or --ntasks-per-node per node).
    #[arg(short = 'n', long = "ntasks")]
    ntasks: Option<u32>,
    #[arg(long = "ntasks-per-node", alias = "tasks-per-node")]
    ntasks_per_node: Option<u32>,
    /// Nodes of the allocation the step uses (the first N, or those of -w).
    #[arg(short = 'N', long = "nodes")]
    nodes: Option<String>,
    /// These nodes only (a hostlist).
    #[arg(short = 'w', long = "nodelist")]
    nodelist: Option<String>,
    #[arg(short = 'c', long = "cpus-per-task")]
    cpus_per_task: Option<u32>,
    /// GPUs per task: this node's GPUs are split among its tasks in order.
    #[arg(long = "gpus-per-task")]
    gpus_per_task: Option<u32>,
    /// Run in this job's allocation (only the current job is supported).
    #[arg(long)]
    jobid: Option<String>,
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
    /// Outside a job: the partition, time limit, account, QOS, name, GPUs,
    /// memory and features of the job srun submits and waits for.
    #[arg(short = 'p', long)]
    partition: Option<String>,
    #[arg(short = 't', long)]
    time: Option<String>,
    #[arg(short = 'A', long)]
    account: Option<String>,
    #[arg(short = 'q', long)]
    qos: Option<String>,
    #[arg(short = 'J', long = "job-name")]
    job_name: Option<String>,
    #[arg(short = 'G', long)]
    gpus: Option<String>,
    #[arg(long = "gpus-per-node")]
    gpus_per_node: Option<String>,
    #[arg(long)]
    gres: Option<String>,
    #[arg(long)]
    mem: Option<String>,
    #[arg(short = 'C', long)]
    constraint: Option<String>,
    /// A terminal for the task: not supported (srun runs batch-style here).
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

    /// The global rank of this node's first task.
    pub fn first_rank(&self) -> u32 {
        self.here.map_or(0, |h| self.per_node[..h].iter().sum())
    }
}

/// Works out the step's layout from the allocation and the options.
pub fn plan(alloc: &[String], me: &str, alloc_tasks_per_node: u32, a: &SrunArgs) -> Result<Share, String> {
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

/// Polls of a one-shot job's state while waiting (every WAIT_POLL): far above
/// any job's time limit (the controller ends the job at its limit).
const WAIT_POLLS_MAX: u64 = 10_000_000;
const WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(200);
/// Bytes of a job's output streamed per poll and file.
const STREAM_CHUNK_BYTES: u64 = 1 << 20;

/// srun outside a job: submits the step as a job of its own (the same srun
/// runs inside it, so tasks get their per-task variables), streams its output
/// files from the submit directory as they grow, and exits with its exit code.
/// Ctrl-C cancels the job. The output is read from the submit directory, so
/// it streams when that directory is shared with the nodes (as on most
/// clusters, and in the dev cluster); otherwise it is left in slurm-N.out there.
pub async fn submit_and_wait(
    client: &gangway_proto::client::Client,
    out: &crate::commands::Output,
    a: SrunArgs,
) -> anyhow::Result<i32> {
    use gangway_proto::v1 as pb;
    use gangway_proto::v1::job_service_client::JobServiceClient;
    if a.pty {
        bail!("--pty: interactive terminals are not supported yet; srun runs the command batch-style and streams its output");
    }
    let exe = std::env::current_exe().context("srun: cannot find the gangway binary")?;
    // Inside the job: the same srun with the task options, fanning out per node.
    let mut inner: Vec<String> = vec![exe.display().to_string(), "srun".into()];
    if let Some(k) = a.ntasks_per_node {
        inner.push(format!("--ntasks-per-node={k}"));
    }
    if let Some(c) = a.cpus_per_task {
        inner.push(format!("--cpus-per-task={c}"));
    }
    if let Some(g) = a.gpus_per_task {
        inner.push(format!("--gpus-per-task={g}"));
    }
    if let Some(k) = a.kill_on_bad_exit {
        inner.push(format!("--kill-on-bad-exit={k}"));
    }
    if a.label {
        inner.push("--label".into());
    }
    if let Some(e) = &a.export {
        inner.push(format!("--export={e}"));
    }
    inner.push("--".into());
    inner.extend(a.command.iter().cloned());
    let nodes: u32 = match &a.nodes {
        Some(n) => crate::parse::node_range(n).map_err(anyhow::Error::msg)?.0,
        None => 1,
    };
    let per_node = match (a.ntasks, a.ntasks_per_node) {
        (Some(n), None) if n % nodes != 0 => {
            bail!("--ntasks: {n} tasks do not spread evenly over {nodes} nodes here; give --ntasks-per-node")
        }
        (Some(n), None) => Some(i64::from(n / nodes)),
        (_, k) => k.map(i64::from),
    };
    if a.ntasks.is_some() && a.ntasks_per_node.is_none() {
        inner.insert(2, format!("--ntasks-per-node={}", per_node.unwrap_or(1)));
    }
    let args = crate::commands::SubmitArgs {
        name: a.job_name.clone().or_else(|| a.command.first().map(|c| c.rsplit('/').next().unwrap_or(c).to_string())),
        nodes: a.nodes.clone(),
        tasks_per_node: per_node,
        cpus_per_task: a.cpus_per_task.map(i64::from),
        gpus: a.gpus.clone(),
        gpus_per_node: a.gpus_per_node.clone(),
        // The job's GPUs: what was asked per node or in all, else per task
        // (the srun inside splits them among the tasks either way).
        gpus_per_task: a
            .gpus_per_task
            .filter(|_| a.gpus.is_none() && a.gpus_per_node.is_none() && a.gres.is_none())
            .map(|g| g.to_string()),
        gres: a.gres.clone(),
        mem: a.mem.clone(),
        constraint: a.constraint.clone(),
        partition: a.partition.clone(),
        time: a.time.clone(),
        account: a.account.clone(),
        qos: a.qos.clone(),
        env: crate::sbatch::export_env(None, std::env::vars())
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect(),
        command: inner,
        // Held until the output files' current ends are known (an earlier job
        // with the same id may have left files here: only new output streams).
        hold: true,
        ..Default::default()
    };
    let spec = crate::commands::job_spec(args, None)?;
    let workdir = std::path::PathBuf::from(&spec.workdir);
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: uuid::Uuid::new_v4().to_string() };
    let id = client
        .call(|ch| {
            let r = client.request(req.clone());
            async move { JobServiceClient::new(ch).submit(r).await }
        })
        .await?
        .into_inner()
        .job_id;
    // Node 0 writes slurm-ID.out, node N slurm-ID.N.out.
    let mut files = vec![workdir.join(format!("slurm-{id}.out"))];
    files.extend((1..nodes).map(|n| workdir.join(format!("slurm-{id}.{n}.out"))));
    let mut offsets: std::collections::BTreeMap<std::path::PathBuf, u64> =
        files.iter().map(|f| (f.clone(), std::fs::metadata(f).map_or(0, |m| m.len()))).collect();
    let release = pb::UpdateJobRequest { job_id: id, change: pb::update_job_request::Change::Release as i32, value: 0 };
    client
        .call(|ch| {
            let r = client.request(release);
            async move { JobServiceClient::new(ch).update(r).await }
        })
        .await?;
    if !out.json {
        eprintln!("srun: job {id} queued and waiting for resources");
    }
    let stream = |offsets: &mut std::collections::BTreeMap<std::path::PathBuf, u64>| {
        for f in &files {
            let Ok(mut file) = std::fs::File::open(f) else { continue };
            let at = offsets.entry(f.clone()).or_default();
            use std::io::{Read, Seek};
            if file.seek(std::io::SeekFrom::Start(*at)).is_err() {
                continue;
            }
            let mut buf = Vec::new();
            if let Ok(n) = file.take(STREAM_CHUNK_BYTES).read_to_end(&mut buf) {
                *at += n as u64;
                let _ = std::io::stdout().write_all(&buf);
                let _ = std::io::stdout().flush();
            }
        }
    };
    let mut started = false;
    for _ in 0..WAIT_POLLS_MAX {
        let polled = tokio::select! {
            _ = tokio::signal::ctrl_c() => None,
            r = client.call(|ch| {
                let r = client.request(pb::GetJobRequest { job_id: id, stale: false });
                async move { JobServiceClient::new(ch).get(r).await }
            }) => Some(r),
        };
        let Some(job) = polled else {
            eprintln!("srun: interrupted: cancelling job {id}");
            let _ = client
                .call(|ch| {
                    let r = client.request(pb::CancelRequest { job_id: id });
                    async move { JobServiceClient::new(ch).cancel(r).await }
                })
                .await;
            return Ok(130);
        };
        let job = job?.into_inner();
        if !started && job.state == pb::JobState::Running as i32 {
            started = true;
            if !out.json {
                eprintln!("srun: job {id} has been allocated resources");
            }
        }
        stream(&mut offsets);
        if job.state > pb::JobState::Running as i32 {
            stream(&mut offsets);
            if job.state != pb::JobState::Completed as i32 {
                eprintln!("srun: job {id} ended {}: {}", super::state_name(job.state), job.reason);
            }
            return Ok(match (job.exit_code, job.exit_signal) {
                (Some(c), _) => c,
                (None, Some(sig)) => 128 + sig,
                (None, None) if job.state == pb::JobState::Completed as i32 => 0,
                (None, None) => 1,
            });
        }
        tokio::time::sleep(WAIT_POLL).await;
    }
    bail!("srun: gave up waiting for job {id}")
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
    let alloc = hostlist::expand(&env_or("SLURM_JOB_NODELIST")?).map_err(anyhow::Error::msg)?;
    let me = env_or("SLURMD_NODENAME")?;
    let tpn: u32 = std::env::var("SLURM_NTASKS_PER_NODE").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let share = plan(&alloc, &me, tpn, &a).map_err(|e| anyhow::anyhow!("srun: {e}"))?;
    let Some(here) = share.here else {
        return Ok(0); // this node is not in the step: its tasks run elsewhere
    };
    let local = share.per_node[here];
    let first = share.first_rank();
    let ntasks = share.ntasks();
    let gpus: Vec<String> = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .map(|v| v.split(',').filter(|g| !g.is_empty()).map(str::to_string).collect())
        .unwrap_or_default();
    if let Some(g) = a.gpus_per_task {
        if (g * local) as usize > gpus.len() {
            bail!("--gpus-per-task: {local} tasks x {g} GPUs, but this node has {} for the job", gpus.len());
        }
    }
    let export = crate::sbatch::export_env(a.export.as_deref(), std::env::vars()).map_err(anyhow::Error::msg)?;
    let step_nodes = hostlist::compress(&share.nodes);
    let tasks_per_node: Vec<String> = share.per_node.iter().map(u32::to_string).collect();
    let mut children: Vec<(u32, Child)> = Vec::new();
    let out = Arc::new(Mutex::new(()));
    let mut pumps = Vec::new();
    for l in 0..local {
        let rank = first + l;
        let mut cmd = Command::new(&a.command[0]);
        cmd.args(&a.command[1..]);
        if a.export.is_some() {
            cmd.env_clear().envs(export.iter().cloned());
        }
        let mut set = |k: &str, v: String| {
            cmd.env(k, v);
        };
        set("SLURM_PROCID", rank.to_string());
        set("SLURM_LOCALID", l.to_string());
        set("SLURM_NODEID", here.to_string());
        set("SLURM_NTASKS", ntasks.to_string());
        set("SLURM_NPROCS", ntasks.to_string());
        set("SLURM_STEP_NUM_TASKS", ntasks.to_string());
        set("SLURM_STEP_NUM_NODES", share.nodes.len().to_string());
        set("SLURM_STEP_NODELIST", step_nodes.clone());
        set("SLURM_STEP_TASKS_PER_NODE", tasks_per_node.join(","));
        set("SLURM_TASKS_PER_NODE", tasks_per_node.join(","));
        set("SLURM_JOB_ID", job.clone());
        set("SLURMD_NODENAME", me.clone());
        set("RANK", rank.to_string());
        set("LOCAL_RANK", l.to_string());
        set("WORLD_SIZE", ntasks.to_string());
        set("LOCAL_WORLD_SIZE", local.to_string());
        if let Some(c) = a.cpus_per_task {
            set("SLURM_CPUS_PER_TASK", c.to_string());
        }
        if let Some(g) = a.gpus_per_task {
            let mine = &gpus[(l * g) as usize..((l + 1) * g) as usize];
            set("CUDA_VISIBLE_DEVICES", mine.join(","));
        }
        if a.label {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = cmd.spawn().with_context(|| format!("srun: cannot start {}", a.command[0]))?;
        if a.label {
            for (pipe, to_err) in [
                (child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>), false),
                (child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>), true),
            ] {
                let Some(pipe) = pipe else { continue };
                let out = out.clone();
                pumps.push(std::thread::spawn(move || {
                    for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                        let _guard = out.lock();
                        if to_err {
                            let _ = writeln!(std::io::stderr(), "{rank}: {line}");
                        } else {
                            let _ = writeln!(std::io::stdout(), "{rank}: {line}");
                        }
                    }
                }));
            }
        }
        children.push((rank, child));
    }
    let kill_on_bad = a.kill_on_bad_exit.unwrap_or(0) != 0;
    let mut worst = 0;
    let mut running: Vec<(u32, Child)> = children;
    // Poll until every task ended; bounded by the tasks' lives (the job's time
    // limit kills the whole process group).
    while !running.is_empty() {
        let mut still = Vec::new();
        for (rank, mut c) in running {
            match c.try_wait()? {
                Some(status) => {
                    let code = status_code(status);
                    if code != 0 {
                        eprintln!("srun: error: task {rank}: exited with {code}");
                        worst = worst.max(code);
                    }
                }
                None => still.push((rank, c)),
            }
        }
        if worst != 0 && kill_on_bad {
            for (rank, c) in &mut still {
                eprintln!("srun: killing task {rank} (--kill-on-bad-exit)");
                let _ = c.kill();
                let _ = c.wait();
            }
            still.clear();
        }
        running = still;
        if !running.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
    for p in pumps {
        let _ = p.join();
    }
    Ok(worst)
}

fn status_code(s: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn steps_spread_over_the_allocation_as_slurm_does() {
        let alloc: Vec<String> = ["n1", "n2", "n3"].iter().map(|s| s.to_string()).collect();
        // One task per node by default; this node's rank follows the node order.
        let s = plan(&alloc, "n2", 1, &args(&["torchrun", "--nproc-per-node=8", "train.py"])).unwrap();
        assert_eq!((s.per_node.clone(), s.here, s.first_rank(), s.ntasks()), (vec![1, 1, 1], Some(1), 1, 3));
        // Block distribution of 8 tasks over 3 nodes: 3, 3, 2.
        let s = plan(&alloc, "n3", 1, &args(&["-n", "8", "python", "x.py"])).unwrap();
        assert_eq!((s.per_node.clone(), s.first_rank()), (vec![3, 3, 2], 6));
        // A helper step on one named node: the others are not in it.
        let s = plan(&alloc, "n1", 1, &args(&["-N1", "-n1", "-w", "n3", "hostname"])).unwrap();
        assert_eq!((s.nodes.clone(), s.here), (vec!["n3".to_string()], None));
        let s = plan(&alloc, "n1", 4, &args(&["--nodes=1", "--ntasks=1", "nvidia-smi"])).unwrap();
        assert_eq!((s.per_node.clone(), s.here), (vec![1], Some(0)));
        // The allocation's tasks per node when nothing is said.
        assert_eq!(plan(&alloc, "n1", 4, &args(&["bash", "-c", "x"])).unwrap().per_node, vec![4, 4, 4]);
        assert!(plan(&alloc, "n1", 1, &args(&["-w", "n9", "x"])).unwrap_err().contains("n9"));
        // Options after the command are the command's own.
        assert_eq!(args(&["-l", "torchrun", "--nnodes", "2", "-x"]).command, ["torchrun", "--nnodes", "2", "-x"]);
        assert!(plan(&alloc, "n1", 1, &args(&["-N", "4", "x"])).unwrap_err().contains("--nodes"));
    }
}
