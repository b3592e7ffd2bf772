//! The job spec a submission sends: the options of `submit` (and, through
//! them, of `sbatch`, `salloc` and `srun`) and how they become a
//! `pb::JobSpec`, with no network (the controller validates it again).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use gangway_proto::v1 as pb;

use crate::parse;

/// What a job asks for: declared once and flattened into `submit`, `sbatch`,
/// `salloc` and `srun` (which outside a job submits one), so the four take
/// the same options with the same meaning and cannot drift apart.
#[derive(Args, Debug, Default, Clone)]
pub struct ResourceArgs {
    /// Job name.
    #[arg(short = 'J', long = "job-name", alias = "name")]
    pub job_name: Option<String>,
    /// Nodes: N, or a range MIN-MAX (the whole gang starts together).
    #[arg(short = 'N', long, allow_hyphen_values = true)]
    pub nodes: Option<String>,
    /// Tasks in all: spread evenly over the nodes (with no -N, all on one node).
    #[arg(short = 'n', long = "ntasks", allow_negative_numbers = true)]
    pub ntasks: Option<i64>,
    /// Tasks on each node.
    #[arg(long = "ntasks-per-node", alias = "tasks-per-node", allow_negative_numbers = true)]
    pub ntasks_per_node: Option<i64>,
    #[arg(short = 'c', long = "cpus-per-task", allow_negative_numbers = true)]
    pub cpus_per_task: Option<i64>,
    /// CPUs per allocated GPU: each node gets this times its GPUs, split
    /// among its tasks (instead of --cpus-per-task).
    #[arg(long = "cpus-per-gpu", allow_negative_numbers = true)]
    pub cpus_per_gpu: Option<i64>,
    /// Memory per node: MiB, or with a unit (512M, 64G); 0 (Slurm's "all of
    /// it") asks for none per node: no limit, unless a partition default per
    /// CPU or GPU applies.
    #[arg(long)]
    pub mem: Option<String>,
    /// Memory per allocated CPU: MiB or with a unit (4G).
    #[arg(long = "mem-per-cpu")]
    pub mem_per_cpu: Option<String>,
    /// Memory per allocated GPU: MiB or with a unit (80G); per node it is this
    /// times the node's GPUs.
    #[arg(long = "mem-per-gpu")]
    pub mem_per_gpu: Option<String>,
    /// GPUs for the whole job: [TYPE:]COUNT, spread evenly over its nodes.
    #[arg(short = 'G', long = "gpus", allow_hyphen_values = true)]
    pub gpus: Option<String>,
    /// GPUs per node: COUNT or TYPE:COUNT (h100:8).
    #[arg(long = "gpus-per-node", allow_hyphen_values = true)]
    pub gpus_per_node: Option<String>,
    /// GPUs per task: [TYPE:]COUNT (times --ntasks-per-node per node).
    #[arg(long = "gpus-per-task", allow_hyphen_values = true)]
    pub gpus_per_task: Option<String>,
    /// Generic resources, Slurm style: gpu[:TYPE]:COUNT per node.
    #[arg(long)]
    pub gres: Option<String>,
    /// Run on these nodes, all of them (a hostlist: n[1-4],gpu7); with no
    /// --nodes the job takes as many nodes as listed, with more it gets
    /// others added.
    #[arg(short = 'w', long)]
    pub nodelist: Option<String>,
    /// Never run on these nodes (a hostlist).
    #[arg(short = 'x', long)]
    pub exclude: Option<String>,
    /// Node features joined with & (all of them) or | (any one of them), e.g.
    /// "ib&arch=zen4".
    #[arg(short = 'C', long)]
    pub constraint: Option<String>,
    /// Whole nodes, shared with no other job (Slurm's `--exclusive=user` and
    /// `=mcs` are not supported).
    #[arg(long, num_args = 0..=1, default_missing_value = "node", require_equals = true)]
    pub exclusive: Option<String>,
    /// Time limit: MINUTES, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
    #[arg(short = 't', long)]
    pub time: Option<String>,
    #[arg(short = 'p', long)]
    pub partition: Option<String>,
    /// Account to charge (default: your default account).
    #[arg(short = 'A', long)]
    pub account: Option<String>,
    /// Quality of service.
    #[arg(short = 'q', long)]
    pub qos: Option<String>,
    /// Cluster licenses held while the job runs: NAME[:COUNT],... (`scontrol
    /// show lic` lists them).
    #[arg(short = 'L', long)]
    pub licenses: Option<String>,
    /// Run in this advance reservation (`scontrol show res`).
    #[arg(long)]
    pub reservation: Option<String>,
    /// The shortest time limit the job accepts (same forms as --time): it may
    /// start with a limit down to this to end before a reservation or its
    /// deadline.
    #[arg(long = "time-min")]
    pub time_min: Option<String>,
    /// End by this time (same forms as --begin); a job that cannot any more
    /// ends DEADLINE.
    #[arg(long)]
    pub deadline: Option<String>,
}

impl ResourceArgs {
    /// `--exclusive`: whether the job wants whole nodes.
    pub fn exclusive(&self) -> anyhow::Result<bool> {
        let Some(v) = self.exclusive.as_deref() else { return Ok(false) };
        match v.to_ascii_lowercase().as_str() {
            // Slurm's bare flag, `=exclusive` and `=allocation` (`node`: Gangway's own spelling).
            "" | "node" | "exclusive" | "allocation" => Ok(true),
            "user" | "mcs" | "topo" | "oversubscribe" => {
                bail!("--exclusive={v}: only whole-node --exclusive is supported")
            }
            _ => bail!("--exclusive: Invalid --exclusive specification: '{v}'"),
        }
    }

    /// `--constraint` as the features the job needs: `&` joins features that
    /// must all be present, `|` alternatives of which one must be.
    pub fn constraints(&self) -> anyhow::Result<Vec<String>> {
        let Some(c) = self.constraint.as_deref() else { return Ok(Vec::new()) };
        if c.contains('[') || c.contains('*') || (c.contains('|') && c.contains('&')) {
            bail!(
                "--constraint: '{c}': features joined with & (all) or with | (any one) are supported, not both in \
                 one constraint, [..] groups or counts"
            );
        }
        Ok(c.split('&').map(|f| f.trim().to_string()).filter(|f| !f.is_empty()).collect())
    }
}

#[derive(Args, Default)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub res: ResourceArgs,
    /// Admins: run in --reservation though it lists neither your user nor
    /// your account (its lists hold for admins' jobs too; recorded in the
    /// audit trail).
    #[arg(long)]
    pub force_reservation: bool,
    /// Not before this time (local time): now+1hour, 16:00, 2026-12-24T08:00, midnight.
    #[arg(long, short = 'b')]
    pub begin: Option<String>,
    /// Free text kept with the job (shown by show/squeue %k/sacct).
    #[arg(long)]
    pub comment: Option<String>,
    /// Admins: the job's priority, replacing the computed one.
    #[arg(long)]
    pub priority: Option<u32>,
    /// Slurm's batch semantics (what sbatch does): the command runs on the
    /// first node only and `srun` inside it starts steps on the others.
    /// Without it the command runs once on every node.
    #[arg(long)]
    pub batch: bool,
    /// append (default: a requeued job's earlier output is kept) or truncate
    /// the output files when the job starts.
    #[arg(long = "open-mode")]
    pub open_mode: Option<String>,
    /// Keep the gang within one domain of a topology level: LEVEL[:required] or
    /// LEVEL:preferred[@WAIT] (e.g. rack:required, block:preferred@10:00).
    #[arg(long)]
    pub topology: Option<String>,
    /// Slurm's --switches=1[@WAIT]: within one leaf domain (the lowest topology level),
    /// preferred for WAIT (default: required).
    #[arg(long)]
    pub switches: Option<String>,
    /// Dependencies: afterok:ID[:ID..],afterany:ID,...,singleton.
    #[arg(short = 'd', long)]
    pub dependency: Option<String>,
    /// A job array: indexes like 0-99, 1,3,5-7 or 0-99:2, with an optional %LIMIT.
    #[arg(short = 'a', long)]
    pub array: Option<String>,
    /// Lower the priority by N (admins may raise it with a negative N).
    #[arg(long, allow_hyphen_values = true)]
    pub nice: Option<i32>,
    /// Submit held; start it with `gangway release`.
    #[arg(short = 'H', long)]
    pub hold: bool,
    /// What to do when a dependency can never be met: yes = cancel (default), no = keep it held.
    #[arg(long = "kill-on-invalid-dep")]
    pub kill_on_invalid_dep: Option<String>,
    /// Working directory (default: the current one).
    #[arg(short = 'D', long)]
    pub chdir: Option<String>,
    /// Run this shell command line as the job.
    #[arg(long)]
    pub wrap: Option<String>,
    /// Environment for the job, KEY=VALUE (repeatable).
    #[arg(long = "env")]
    pub env: Vec<String>,
    /// Deduplication key (default: a fresh one per invocation, so the client's own
    /// retries never create a second job).
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Print only the job id.
    #[arg(long)]
    pub parsable: bool,
    /// stdout file pattern (%j job id, %x name, %N node, %u user, %t rank, %A %a).
    #[arg(short = 'o', long)]
    pub output: Option<String>,
    /// stderr file pattern (default: with stdout).
    #[arg(short = 'e', long)]
    pub error: Option<String>,
    /// Warning signal before the time limit: [B:]SIG[@SECONDS], e.g. USR1@120.
    #[arg(long)]
    pub signal: Option<String>,
    /// Requeue the job when a node fails (the default); `--requeue=expedite`:
    /// then put it first in the queue, back on its other nodes plus a spare.
    #[arg(long, overrides_with = "no_requeue", num_args = 0..=1, require_equals = true, default_missing_value = "yes")]
    pub requeue: Option<String>,
    /// End the job NODE_FAIL instead of requeueing it when a node fails.
    #[arg(long)]
    pub no_requeue: bool,
    /// A batch script to run.
    pub script: Option<PathBuf>,
    /// The script's text when the caller has read it already (sbatch).
    #[arg(skip)]
    pub script_text: Option<String>,
    /// A command to run, after `--`.
    #[arg(last = true)]
    pub command: Vec<String>,
    /// A heterogeneous job's further components (sbatch's `hetjob`).
    #[arg(skip)]
    pub components: Vec<pb::JobComponent>,
}

/// The shape one component of a heterogeneous job asks for, read from its
/// options as a job's are (the same defaults and checks).
pub fn component(res: ResourceArgs) -> anyhow::Result<pb::JobComponent> {
    let args = SubmitArgs { res, command: vec!["true".into()], ..Default::default() };
    let s = job_spec(args, None)?;
    if s.nodes_max != 0 {
        bail!("--nodes: a component of a heterogeneous job has a fixed node count (no MIN-MAX range)");
    }
    Ok(shape_of(&s))
}

/// A spec's own shape (its component 0) as a component.
pub fn shape_of(s: &pb::JobSpec) -> pb::JobComponent {
    pb::JobComponent {
        partition: s.partition.clone(),
        nodes: s.nodes,
        tasks_per_node: s.tasks_per_node,
        cpus_per_task: s.cpus_per_task,
        mem_per_node_mb: s.mem_per_node_mb,
        mem_per_cpu_mb: s.mem_per_cpu_mb,
        gpus_per_node: s.gpus_per_node,
        gpu_type: s.gpu_type.clone(),
        constraints: s.constraints.clone(),
        exclusive: s.exclusive,
        nodelist: s.nodelist.clone(),
        exclude: s.exclude.clone(),
    }
}

/// The options of a heterogeneous job's component `k` that are the whole
/// job's must be component 0's (`first`) when given; `-p` and `-x` carry
/// over from the component before (`carried`, updated here), as Slurm
/// propagates them.
pub fn component_res(
    k: usize,
    res: &mut ResourceArgs,
    first: &ResourceArgs,
    carried: &mut (Option<String>, Option<String>),
) -> Result<(), String> {
    let job_wide = [
        ("--account", &res.account, &first.account),
        ("--qos", &res.qos, &first.qos),
        ("--time", &res.time, &first.time),
        ("--time-min", &res.time_min, &first.time_min),
        ("--reservation", &res.reservation, &first.reservation),
        ("--licenses", &res.licenses, &first.licenses),
        ("--deadline", &res.deadline, &first.deadline),
        ("--job-name", &res.job_name, &first.job_name),
    ];
    for (name, mine, theirs) in job_wide {
        same_as_first(k, name, mine, theirs)?;
    }
    for (mine, prev) in [(&mut res.partition, &mut carried.0), (&mut res.exclude, &mut carried.1)] {
        match mine {
            Some(v) => *prev = Some(v.clone()),
            None => mine.clone_from(prev),
        }
    }
    Ok(())
}

/// Component `k`'s value of a whole-job option `name`: none, or component 0's.
pub fn same_as_first(k: usize, name: &str, mine: &Option<String>, first: &Option<String>) -> Result<(), String> {
    match mine.as_ref().filter(|v| Some(*v) != first.as_ref()) {
        Some(v) => Err(format!(
            "hetjob component {k}: {name}={v} differs from component 0's ({}): a heterogeneous job has one {} here, \
             component 0's",
            first.as_deref().unwrap_or("not given"),
            name.trim_start_matches('-')
        )),
        None => Ok(()),
    }
}

/// Whether `--mem` asks for Slurm's "all of each node's memory" (`0`, with
/// or without one unit): Gangway then asks for no memory per node (a
/// partition's default per CPU or GPU still applies).
pub fn no_memory_reserved(mem: Option<&str>) -> bool {
    mem.is_some_and(|m| parse::mem_mb(m) == Ok(0))
}

/// Slurm's `--open-mode` (`arg_set_open_mode`): its first letter, in
/// either case, `a` (append) or `t` (truncate). Returns whether to truncate.
pub fn open_mode_truncates(mode: &str) -> Result<bool, String> {
    match mode.chars().next().map(|c| c.to_ascii_lowercase()) {
        Some('a') => Ok(false),
        Some('t') => Ok(true),
        _ => Err(format!("--open-mode: Invalid --open-mode specification: '{mode}' (append or truncate)")),
    }
}

/// An output file name as Slurm takes it: `none` (any case) is /dev/null.
fn output_path(o: Option<String>) -> String {
    match o {
        Some(p) if p.eq_ignore_ascii_case("none") => "/dev/null".into(),
        p => p.unwrap_or_default(),
    }
}

/// The nodes a job takes and the tasks on each, from the node count asked
/// (`-N`'s minimum, or the node list's length), `-n` and `--ntasks-per-node`,
/// as Slurm reads them, for a model that runs the same number of tasks on
/// every node: `-n` alone is spread evenly over the nodes (one node when
/// none is asked); with `--ntasks-per-node` and no node count, it takes as
/// many nodes as `-n` fills at that many each; with both, `-n` must spread
/// evenly with at most `--ntasks-per-node` on each.
pub fn task_layout(
    nodes: Option<i64>,
    ntasks: Option<i64>,
    per_node: Option<i64>,
) -> anyhow::Result<(Option<i64>, Option<i64>)> {
    let Some(n) = ntasks else { return Ok((nodes, per_node)) };
    if n < 1 {
        bail!("--ntasks: must be at least 1, got {n}");
    }
    match (nodes, per_node) {
        (_, Some(k)) if k < 1 => bail!("--ntasks-per-node: must be at least 1, got {k}"),
        (None, Some(k)) if n % k != 0 => bail!(
            "--ntasks: {n} tasks at --ntasks-per-node={k} do not fill whole nodes (Gangway runs the same number of \
             tasks on every node); give -N, or a multiple of {k}"
        ),
        (None, Some(k)) => Ok((Some(n / k), Some(k))),
        (Some(count), k) => {
            let count = count.max(1);
            if n % count != 0 {
                bail!("--ntasks: {n} tasks do not spread evenly over {count} nodes; use --ntasks-per-node");
            }
            if let Some(k) = k.filter(|&k| n / count > k) {
                bail!(
                    "--ntasks: {n} tasks over {count} nodes is {} per node, more than --ntasks-per-node={k}",
                    n / count
                );
            }
            Ok((Some(count), Some(n / count)))
        }
        (None, None) => Ok((None, Some(n))),
    }
}

/// This process's umask, as Slurm hands it to jobs (`SLURM_UMASK`, octal):
/// files the job creates get the modes they would get here.
pub fn umask_env(spec: &mut pb::JobSpec) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let umask = status.lines().find_map(|l| l.strip_prefix("Umask:")).map(str::trim);
    if let Some(u) = umask.filter(|u| u.len() <= 4 && u.chars().all(|c| c.is_digit(8))) {
        spec.env.entry("SLURM_UMASK".to_string()).or_insert_with(|| u.to_string());
    }
}

/// Builds the job spec from submit options (no network: `leaf_level` is the
/// policy's lowest topology level, needed only for `--switches`).
pub fn job_spec(a: SubmitArgs, leaf_level: Option<&str>) -> anyhow::Result<pb::JobSpec> {
    let (command, script) = match (&a.wrap, &a.script) {
        (None, None) if !a.command.is_empty() => (a.command.clone(), String::new()),
        (Some(w), None) if a.command.is_empty() => (Vec::new(), format!("#!/bin/sh\n{w}\n")),
        (None, Some(path)) => {
            let text = match &a.script_text {
                Some(t) => t.clone(),
                None => {
                    std::fs::read_to_string(path).with_context(|| format!("script: cannot read {}", path.display()))?
                }
            };
            // After a script, the command is the script's arguments.
            (a.command.clone(), text)
        }
        (None, None) => {
            bail!("command: nothing to run; give a command after `--`, --wrap \"...\", or a script file")
        }
        _ => bail!("command: give only one of a command after `--`, --wrap, or a script file"),
    };
    let (nodes, nodes_max) = match a.res.nodes.as_deref() {
        Some(n) => {
            let (lo, hi) = parse::node_range(n).map_err(anyhow::Error::msg)?;
            (Some(i64::from(lo)), hi)
        }
        None => (None, 0),
    };
    let names = |opt: &str, list: &Option<String>| -> anyhow::Result<Vec<String>> {
        let Some(list) = list else { return Ok(Vec::new()) };
        crate::slurm::hostlist::expand(list).map_err(|e| anyhow::anyhow!("--{opt}: {e}"))
    };
    let nodelist = names("nodelist", &a.res.nodelist)?;
    let exclude = names("exclude", &a.res.exclude)?;
    // A node list without --nodes: as many nodes as it names.
    let nodes = match nodes {
        None if !nodelist.is_empty() => Some(nodelist.len() as i64),
        n => n,
    };
    let (nodes, tasks_per_node) = task_layout(nodes, a.res.ntasks, a.res.ntasks_per_node)?;
    let node_count = nodes.unwrap_or(1).max(1);
    let tasks = tasks_per_node.unwrap_or(1).max(1);
    let (gpu_type, gpus) = parse::gpu_request(
        a.res.gpus_per_node.as_deref(),
        a.res.gpus.as_deref(),
        a.res.gpus_per_task.as_deref(),
        a.res.gres.as_deref(),
        node_count,
        tasks,
    )
    .map_err(anyhow::Error::msg)?;
    let warn =
        a.signal.as_deref().map(parse::warn_signal).transpose().map_err(anyhow::Error::msg)?.unwrap_or((0, 0, false));
    // A relative --chdir is under the submit directory, as Slurm makes it.
    let cwd = std::env::current_dir().unwrap_or_default();
    let workdir = match a.chdir {
        Some(d) if std::path::Path::new(&d).is_absolute() => d,
        Some(d) => cwd.join(d.trim_start_matches("./")).display().to_string(),
        None => cwd.display().to_string(),
    };
    let topology = match (&a.topology, &a.switches) {
        (Some(_), Some(_)) => bail!("topology: give --topology or --switches, not both"),
        (Some(t), None) => Some(parse::topology(t).map_err(anyhow::Error::msg)?),
        (None, Some(sw)) => {
            let (required, wait_s) = parse::switches(sw).map_err(anyhow::Error::msg)?;
            let level = leaf_level.context("switches: the cluster's topology levels are unknown")?;
            Some(pb::TopologyConstraint { level: level.to_string(), required, wait_s })
        }
        (None, None) => None,
    };
    let kill_on_invalid_dep = match a.kill_on_invalid_dep.as_deref() {
        None => None,
        Some(v) if v.eq_ignore_ascii_case("yes") => Some(true),
        Some(v) if v.eq_ignore_ascii_case("no") => Some(false),
        Some(other) => {
            bail!("--kill-on-invalid-dep: Invalid --kill-on-invalid-dep specification: '{other}' (yes or no)")
        }
    };
    let (constraints, exclusive) = (a.res.constraints()?, a.res.exclusive()?);
    let spec = pb::JobSpec {
        name: a.res.job_name.unwrap_or_else(|| default_job_name(&command, a.script.as_ref(), a.wrap.is_some())),
        user: String::new(),
        command,
        script,
        workdir,
        partition: a.res.partition.unwrap_or_default(),
        nodes,
        tasks_per_node,
        cpus_per_task: match (a.res.cpus_per_task, a.res.cpus_per_gpu) {
            (Some(_), Some(_)) => bail!("--cpus-per-gpu: give --cpus-per-task or --cpus-per-gpu, not both"),
            (None, Some(c)) if c < 1 => bail!("--cpus-per-gpu: must be at least 1, got {c}"),
            (None, Some(c)) => match gpus.unwrap_or(0) {
                0 => bail!("--cpus-per-gpu: the job asks for no GPUs (add --gpus-per-node, --gpus or --gres)"),
                // Each node's CPUs, split among its tasks (rounded up).
                g => {
                    let per_node = c.checked_mul(g).and_then(|x| x.checked_add(tasks - 1));
                    Some(per_node.context("--cpus-per-gpu: too large")? / tasks)
                }
            },
            (c, None) => c,
        },
        mem_per_node_mb: match (&a.res.mem, &a.res.mem_per_gpu) {
            _ if [a.res.mem.is_some(), a.res.mem_per_cpu.is_some(), a.res.mem_per_gpu.is_some()]
                .iter()
                .filter(|g| **g)
                .count()
                > 1 =>
            {
                bail!("--mem: --mem, --mem-per-cpu, and --mem-per-gpu are mutually exclusive")
            }
            (Some(_), Some(_)) => bail!("--mem: --mem, --mem-per-cpu, and --mem-per-gpu are mutually exclusive"),
            (None, Some(per_gpu)) => {
                let per_gpu =
                    parse::mem_mb(per_gpu).map_err(|e| anyhow::anyhow!(e.replace("--mem", "--mem-per-gpu")))?;
                match gpus.unwrap_or(0) {
                    0 => bail!("--mem-per-gpu: the job asks for no GPUs (add --gpus-per-node, --gpus or --gres)"),
                    g => Some(
                        i64::try_from(per_gpu)
                            .ok()
                            .and_then(|m| m.checked_mul(g))
                            .context("--mem-per-gpu: too large")?,
                    ),
                }
            }
            (m, None) if no_memory_reserved(m.as_deref()) => None,
            (m, None) => m.as_deref().map(parse::mem_mb).transpose().map_err(anyhow::Error::msg)?.map(|m| m as i64),
        },
        gpus_per_node: gpus,
        gpu_type,
        time_limit_s: a
            .res
            .time
            .as_deref()
            .map(|t| parse::job_time_s("--time", t))
            .transpose()
            .map_err(anyhow::Error::msg)?
            .map(|t| t as i64),
        env: parse::parse_labels(&a.env).map_err(|e| anyhow::anyhow!("env: {e}"))?.into_iter().collect(),
        requeue: (a.requeue.is_some() || a.no_requeue).then_some(!a.no_requeue),
        requeue_expedite: match a.requeue.as_deref() {
            None | Some("yes") => false,
            Some(e) if e.eq_ignore_ascii_case("expedite") => true,
            Some(other) => bail!("--requeue: '{other}' is not a requeue mode (give --requeue or --requeue=expedite)"),
        },
        output: output_path(a.output),
        error: output_path(a.error),
        warn_signal: warn.0,
        warn_before_s: warn.1,
        warn_batch_shell: warn.2,
        account: a.res.account.unwrap_or_default(),
        qos: a.res.qos.unwrap_or_default(),
        nodes_max,
        mem_per_cpu_mb: a
            .res
            .mem_per_cpu
            .as_deref()
            .map(parse::mem_mb)
            .transpose()
            .map_err(|e| anyhow::anyhow!(e.replace("--mem", "--mem-per-cpu")))?
            .unwrap_or(0),
        constraints,
        exclusive,
        topology,
        dependency: a.dependency.unwrap_or_default(),
        array: a.array.unwrap_or_default(),
        nice: a.nice.unwrap_or(0),
        hold: a.hold,
        kill_on_invalid_dep,
        begin_time_ms: match &a.begin {
            Some(b) => parse::begin_ms(b, crate::slurm::now_ms()).map_err(anyhow::Error::msg)?,
            None => 0,
        },
        comment: a.comment.clone().unwrap_or_default(),
        batch: a.batch,
        nodelist,
        exclude,
        truncate_output: match a.open_mode.as_deref() {
            None => false,
            Some(m) => open_mode_truncates(m).map_err(anyhow::Error::msg)?,
        },
        licenses: match a.res.licenses.as_deref() {
            Some(l) => parse::licenses(l).map_err(anyhow::Error::msg)?.into_iter().collect(),
            None => Default::default(),
        },
        reservation: a.res.reservation.clone().unwrap_or_default(),
        force_reservation: a.force_reservation,
        time_min_s: match a.res.time_min.as_deref() {
            Some(t) => parse::job_time_s("--time-min", t).map_err(anyhow::Error::msg)?,
            None => 0,
        },
        deadline_ms: match &a.res.deadline {
            Some(d) => parse::begin_ms(d, crate::slurm::now_ms())
                .map_err(|e| anyhow::anyhow!(e.replace("--begin", "--deadline")))?,
            None => 0,
        },
        components: a.components,
    };
    Ok(spec)
}

fn default_job_name(command: &[String], script: Option<&PathBuf>, wrap: bool) -> String {
    if wrap {
        return "wrap".into();
    }
    if let Some(p) = script {
        return p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| "script".into());
    }
    command.first().map(|c| c.rsplit('/').next().unwrap_or(c).to_string()).unwrap_or_else(|| "job".into())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// One command line through clap, for any of the commands' option sets.
    #[derive(Parser)]
    #[command(disable_help_flag = true)]
    struct Cmd<T: clap::Args> {
        #[command(flatten)]
        args: T,
    }

    fn parse<T: clap::Args>(argv: &[&str]) -> T {
        Cmd::<T>::try_parse_from(std::iter::once("x").chain(argv.iter().copied())).unwrap().args
    }

    /// What a job asks the scheduler for (not its command, name or output).
    fn request(s: &pb::JobSpec) -> String {
        format!(
            "nodes {:?}-{} tasks/node {:?} cpus/task {:?} mem {:?} mem/cpu {} gpus {:?} {} time {:?} partition {} \
             account {} qos {} features {:?} exclusive {} nodelist {:?} exclude {:?}",
            s.nodes,
            s.nodes_max,
            s.tasks_per_node,
            s.cpus_per_task,
            s.mem_per_node_mb,
            s.mem_per_cpu_mb,
            s.gpus_per_node,
            s.gpu_type,
            s.time_limit_s,
            s.partition,
            s.account,
            s.qos,
            s.constraints,
            s.exclusive,
            s.nodelist,
            s.exclude,
        )
    }

    /// The four commands that ask for resources take the same options with
    /// the same meaning: the same options give the same request, whichever
    /// of submit, sbatch, salloc and srun (outside a job) sends it.
    #[test]
    fn submit_sbatch_salloc_and_srun_ask_for_the_same_resources() {
        let cases: &[&[&str]] = &[
            &["-N", "2-4", "--ntasks-per-node=2", "-c", "4", "--gpus-per-node=h100:4", "--exclusive"],
            &["-N2", "-n", "8", "--mem=64G", "-t", "1:00:00", "-p", "gpu", "-A", "ml", "-q", "high"],
            &["--nodes=1", "-G", "2", "--mem-per-cpu=2G", "-C", "ib&arch=zen4", "-x", "n[7-9]"],
            &["-w", "n[1-2]", "--gres=gpu:a100:1", "--cpus-per-gpu=8", "--mem=0"],
            &["-N", "1", "--gpus-per-task=1", "--ntasks-per-node=4", "--mem-per-gpu=40G", "--exclusive=node"],
            &["-n", "8", "--ntasks-per-node=4", "-G", "8"],
            &["-N", "2", "-n", "6", "--ntasks-per-node=4"],
        ];
        for opts in cases {
            let with = |tail: &[&'static str]| opts.iter().chain(tail).copied().collect::<Vec<&'static str>>();
            let submit = job_spec(parse::<SubmitArgs>(&with(&["--", "train.sh"])), None).unwrap();
            let salloc = crate::slurm::salloc::submit_args(&parse(&with(&["bash"])));
            let salloc = job_spec(crate::slurm::salloc::allocation(salloc, "0123abcd"), None).unwrap();
            let srun_args = parse::<crate::slurm::srun::SrunArgs>(&with(&["python", "train.py"]));
            let (srun, _) = crate::slurm::srun::outside_job(&srun_args, "gangway", std::iter::empty()).unwrap();
            let srun = job_spec(crate::slurm::salloc::allocation(srun, "0123abcd"), None).unwrap();
            let sbatch = crate::sbatch::SbatchOpts::try_parse_from(std::iter::once("sbatch").chain(with(&[]))).unwrap();
            let script = Some((PathBuf::from("job.sh"), "#!/bin/sh\ntrue\n".to_string()));
            let sbatch = crate::sbatch::to_submit_args(sbatch, script, std::iter::empty(), &mut Vec::new()).unwrap();
            let sbatch = job_spec(sbatch, None).unwrap();
            let want = request(&submit);
            for (name, got) in [("sbatch", &sbatch), ("salloc", &salloc), ("srun", &srun)] {
                assert_eq!(request(got), want, "{name} {opts:?}");
            }
        }
    }

    /// The same bad option is refused alike, naming the option.
    #[test]
    fn a_bad_resource_option_is_refused_alike_by_every_command() {
        for (opts, names) in [
            (&["--exclusive=user"][..], "--exclusive"),
            (&["-C", "a|b&c"][..], "--constraint"),
            (&["-N", "2", "-n", "6", "--ntasks-per-node=2"][..], "--ntasks"),
            (&["-n", "7", "--ntasks-per-node=4"][..], "--ntasks"),
            (&["--cpus-per-gpu=9223372036854775807", "-G", "2"][..], "--cpus-per-gpu"),
        ] {
            let with = |tail: &[&'static str]| opts.iter().chain(tail).copied().collect::<Vec<&'static str>>();
            let submit = job_spec(parse::<SubmitArgs>(&with(&["--", "x"])), None).unwrap_err().to_string();
            let salloc = crate::slurm::salloc::submit_args(&parse(&with(&["bash"])));
            let salloc = job_spec(crate::slurm::salloc::allocation(salloc, "0123abcd"), None).unwrap_err().to_string();
            let sbatch = crate::sbatch::SbatchOpts::try_parse_from(std::iter::once("sbatch").chain(with(&[]))).unwrap();
            let script = Some((PathBuf::from("job.sh"), "#!/bin/sh\ntrue\n".to_string()));
            let sbatch = match crate::sbatch::to_submit_args(sbatch, script, std::iter::empty(), &mut Vec::new()) {
                Err(e) => e,
                Ok(args) => job_spec(args, None).unwrap_err().to_string(),
            };
            let srun_args = parse::<crate::slurm::srun::SrunArgs>(&with(&["python"]));
            let srun = match crate::slurm::srun::outside_job(&srun_args, "gangway", std::iter::empty()) {
                Err(e) => e.to_string(),
                Ok((args, _)) => {
                    job_spec(crate::slurm::salloc::allocation(args, "0123abcd"), None).unwrap_err().to_string()
                }
            };
            for (cmd, e) in [("submit", submit), ("salloc", salloc), ("sbatch", sbatch), ("srun", srun)] {
                assert!(e.contains(names), "{cmd} {opts:?}: {e}");
            }
        }
    }

    /// `-n` with `--ntasks-per-node` as Slurm reads them, for one task count
    /// on every node.
    #[test]
    fn tasks_and_tasks_per_node_lay_out_as_slurm_reads_them() {
        let ok = |nodes, n, k| task_layout(nodes, n, k).unwrap();
        assert_eq!(ok(None, Some(8), Some(4)), (Some(2), Some(4)), "as many nodes as -n fills");
        assert_eq!(ok(Some(2), Some(6), Some(4)), (Some(2), Some(3)), "--ntasks-per-node is the most per node");
        assert_eq!(ok(Some(2), Some(6), None), (Some(2), Some(3)));
        assert_eq!(ok(None, Some(6), None), (None, Some(6)), "one node when none is asked");
        assert_eq!(ok(Some(3), None, Some(2)), (Some(3), Some(2)));
        for (nodes, n, k) in [(None, Some(7), Some(4)), (Some(2), Some(6), Some(2)), (Some(4), Some(6), None)] {
            assert!(task_layout(nodes, n, k).unwrap_err().to_string().starts_with("--ntasks"), "{nodes:?} {n:?} {k:?}");
        }
        assert!(task_layout(None, Some(0), None).is_err());
        assert!(task_layout(None, Some(4), Some(0)).unwrap_err().to_string().contains("--ntasks-per-node"));
    }
}
