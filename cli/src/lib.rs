//! `gangway`: the one binary for controllers, agents, the dev cluster, users and
//! benchmarks, as a library (`src/main.rs` only calls [`main`]). Errors print
//! as one line on stderr with a non-zero exit code.
//!
//! Modules: `daemons` (controller and agent start-up), `jobspec` (the shared
//! resource options and the job spec they build), `submit` (sending a job),
//! `output` (JSON, tables, one-line errors), `commands` (queue, show, cancel,
//! nodes, cluster), `sbatch` and `slurm/` (Slurm's commands), `policy`
//! (admin), `jobctl` (hold, release, update, why), `events`, `dev`, `bench`,
//! `simulate`, `tls`.

mod accounting;
mod bench;
mod bench_accounting;
mod bench_fleet;
mod bench_peers;
mod bench_sched;
mod bench_storm;
mod commands;
mod daemons;
mod dev;
mod doctor;
mod events;
mod inventory;
mod jobctl;
pub mod jobspec;
mod output;
pub mod parse;
mod policy;
mod reservations;
mod sbatch;
mod simulate;
mod slurm;
mod submit;
mod tls;

use clap::{Parser, Subcommand};

/// The dev cluster's endpoints: where `gangway dev` listens by default.
pub const DEFAULT_ENDPOINTS: &str = "127.0.0.1:50051,127.0.0.1:50052,127.0.0.1:50053";

#[derive(Parser)]
#[command(name = "gangway", version, about = "Gangway: a fault-tolerant workload manager for GPU and HPC clusters")]
struct Cli {
    /// Controller replicas to talk to (any one that answers will do).
    #[arg(long, global = true, env = "GANGWAY_ENDPOINTS", default_value = DEFAULT_ENDPOINTS, value_delimiter = ',')]
    endpoints: Vec<String>,
    /// Caller identity claimed with every request to an --insecure cluster (a
    /// secured cluster takes it from the client certificate).
    #[arg(long, global = true, env = "GANGWAY_IDENTITY")]
    identity: Option<String>,
    #[command(flatten)]
    tls: tls::TlsArgs,
    /// Print machine-readable JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Log lines (stderr) as text or as JSON objects, one per line.
    #[arg(long, global = true, env = "GANGWAY_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a controller replica.
    Controller(daemons::ControllerArgs),
    /// Run a node agent (registers the node and heartbeats).
    Agent(daemons::AgentArgs),
    /// Start a local 3-replica cluster with simulated GPU nodes (Ctrl-C stops it).
    Dev(dev::DevArgs),
    /// Keep the job history in PostgreSQL, fed from the cluster's events
    /// (like slurmdbd), as an operator; a second one stands by.
    Accounting(accounting::AccountingArgs),
    /// Check this host before it joins a cluster: the controllers' ports,
    /// the certificates in --tls-dir, cgroups, NVML, the disk's fsync
    /// latency; says what to fix (exit 1 when a check fails).
    Doctor(doctor::DoctorArgs),
    /// Submit a job: a command after `--`, `--wrap "cmd"`, or a batch script file.
    Submit(jobspec::SubmitArgs),
    /// Slurm's sbatch: submit a batch script with #SBATCH directives (`gangway sbatch --help`).
    #[command(disable_help_flag = true)]
    Sbatch {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Slurm's squeue: pending and running jobs, Slurm's columns and -o/-O formats.
    Squeue(slurm::squeue::SqueueArgs),
    /// Slurm's scancel: by id (12, 12_3, a whole array), name, user, state, partition.
    Scancel(slurm::scancel::ScancelArgs),
    /// Slurm's sinfo: partitions and node states.
    Sinfo(slurm::sinfo::SinfoArgs),
    /// Slurm's scontrol: show hostnames/job/node/partition, hold, release, requeue, update.
    Scontrol(slurm::scontrol::ScontrolArgs),
    /// Slurm's sacct: job history, including finished jobs.
    Sacct(slurm::sacct::SacctArgs),
    /// Slurm's sreport: CPU and GPU usage by account and user over a time range, from the
    /// accounting database (`cluster AccountUtilizationByUser`, `user TopUsage`, ...).
    Sreport(slurm::sreport::SreportArgs),
    /// Slurm's seff: a job's CPU, memory and GPU efficiency, from what its agents measured.
    Seff(slurm::seff::SeffArgs),
    /// Slurm's srun: a step's tasks with per-task SLURM_* variables (in a job), a job of its own
    /// (outside one), a step in a running job (--jobid), or a shell on a terminal (--pty).
    Srun(slurm::srun::SrunArgs),
    /// Slurm's salloc: an allocation held while a command runs here (default: your shell on its
    /// first node); srun in it starts steps on the allocated nodes.
    Salloc(slurm::salloc::SallocArgs),
    /// Slurm command names as links to this binary (sbatch, srun, salloc, squeue, scancel, sinfo, scontrol, sacct, sreport, seff).
    #[command(subcommand)]
    Shims(ShimsCmd),
    /// Certificates: a CA, and server, agent and client certificates signed by it.
    #[command(subcommand)]
    Tls(tls::TlsCmd),
    /// Bearer tokens for callers without a certificate.
    #[command(subcommand)]
    Token(tls::TokenCmd),
    /// List pending and running jobs (`--all` for finished ones too).
    Queue(commands::QueueArgs),
    /// Show one job in full.
    Show {
        job_id: u64,
        #[arg(long)]
        stale: bool,
    },
    /// Cancel jobs.
    Cancel {
        #[arg(required = true)]
        job_ids: Vec<u64>,
    },
    /// Keep pending jobs from starting (until `release`).
    Hold {
        #[arg(required = true)]
        job_ids: Vec<u64>,
        /// An admin hold: only admins can release it.
        #[arg(long)]
        admin: bool,
    },
    /// Let held jobs start.
    Release {
        #[arg(required = true)]
        job_ids: Vec<u64>,
    },
    /// Stop running jobs and put them back in the queue.
    Requeue {
        #[arg(required = true)]
        job_ids: Vec<u64>,
        /// Hold them once requeued.
        #[arg(long)]
        hold: bool,
    },
    /// Stop running jobs where they stand, keeping their nodes (operators
    /// and admins); their time limits pause until `resume`.
    Suspend {
        #[arg(required = true)]
        job_ids: Vec<u64>,
    },
    /// Continue suspended jobs.
    Resume {
        #[arg(required = true)]
        job_ids: Vec<u64>,
    },
    /// Change a job's priority, nice value or time limit.
    Update(jobctl::UpdateArgs),
    /// Job and node events as they happen, resumable from a log index (--from).
    Events(events::EventsArgs),
    /// Why a job is pending: reason, priority factors, node rejections.
    Why {
        job_id: u64,
        #[arg(long)]
        stale: bool,
    },
    /// Cluster policy: partitions, accounts, users, QOS, weights (TOML import/export).
    #[command(subcommand)]
    Admin(policy::AdminCmd),
    /// List nodes.
    Nodes {
        #[arg(long)]
        stale: bool,
    },
    /// Drain or resume a node.
    #[command(subcommand)]
    Node(commands::NodeCmd),
    /// The controller cluster: status and membership.
    #[command(subcommand)]
    Cluster(commands::ClusterCmd),
    /// Internal: runs one job task for an agent and records its exit status.
    #[command(hide = true)]
    TaskShim {
        /// Where to record how the command ended (not with --exec).
        #[arg(long, required_unless_present = "exec")]
        exit_file: Option<std::path::PathBuf>,
        /// Become the command (after the setup) instead of waiting for it.
        #[arg(long)]
        exec: bool,
        /// Read the command's environment from standard input.
        #[arg(long)]
        env_stdin: bool,
        /// Standard output is the step's terminal: a session of its own on it,
        /// and the command's standard input (with --exec).
        #[arg(long)]
        pty: bool,
        /// Standard output and error are FIFOs: after the command, wait until
        /// the agent read what is left in them.
        #[arg(long)]
        drain_output: bool,
        /// Become UID:GID:GROUPS before running the command.
        #[arg(long)]
        user: Option<String>,
        /// Read the task's environment from this file (and remove it).
        #[arg(long)]
        env_file: Option<std::path::PathBuf>,
        /// The agent's lease file: stop the task when it runs out (the agent
        /// is gone and may be declared down).
        #[arg(long)]
        lease: Option<std::path::PathBuf>,
        /// Enter this directory after becoming the user.
        #[arg(long)]
        workdir: Option<std::path::PathBuf>,
        /// Join this cgroup (a directory with a cgroup.procs) before anything
        /// else (repeatable).
        #[arg(long)]
        cgroup: Vec<std::path::PathBuf>,
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
    /// Replay a workload trace through the scheduler in virtual time.
    Simulate(simulate::SimulateArgs),
    /// Benchmarks against a local cluster of real controller processes.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

#[derive(Subcommand)]
enum ShimsCmd {
    /// Create links named like Slurm's commands, pointing at this binary.
    Install {
        /// The directory for the links (e.g. ~/.local/bin).
        #[arg(long)]
        prefix: std::path::PathBuf,
        /// Replace existing files of those names.
        #[arg(long)]
        force: bool,
    },
}

/// The Slurm commands this binary answers to when invoked by that name.
const SHIMS: &[&str] =
    &["sbatch", "srun", "salloc", "squeue", "scancel", "sinfo", "scontrol", "sacct", "sreport", "seff"];

fn install_shims(prefix: &std::path::Path, force: bool) -> anyhow::Result<()> {
    let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("cannot find this binary: {e}"))?;
    std::fs::create_dir_all(prefix).map_err(|e| anyhow::anyhow!("prefix: cannot create {}: {e}", prefix.display()))?;
    for name in SHIMS {
        let link = prefix.join(name);
        if link.symlink_metadata().is_ok() {
            if !force {
                anyhow::bail!("prefix: {} exists; use --force to replace it", link.display());
            }
            std::fs::remove_file(&link).map_err(|e| anyhow::anyhow!("cannot replace {}: {e}", link.display()))?;
        }
        std::os::unix::fs::symlink(&exe, &link)
            .map_err(|e| anyhow::anyhow!("cannot link {} to {}: {e}", link.display(), exe.display()))?;
        println!("{} -> {}", link.display(), exe.display());
    }
    Ok(())
}

/// `dev:<login name>`: from USER or LOGNAME, else the name of this process's uid.
fn default_identity() -> String {
    format!("dev:{}", tls::login_name())
}

/// A client of the cluster as the flags say, and who it is.
fn make_client(
    endpoints: &[String],
    claimed: Option<String>,
    tls: &tls::TlsArgs,
) -> anyhow::Result<(gangway_proto::client::Client, String)> {
    let explicit = tls.tls_ca.is_some() || tls.tls_cert.is_some() || tls.tls_dir.is_some() || tls.token.is_some();
    let (security, job_credential) = match tls.for_client(endpoints) {
        Ok(s) => (s, None),
        // Inside a job with no certificate or token of the user's own: the
        // job's step credential acts as its user while the job runs. (Given
        // ones that do not work are an error, not a reason to fall back.)
        Err(e) if explicit || tls.insecure => return Err(e),
        Err(e) => match tls::job_credential() {
            Some((security, credential)) => (security, Some(credential)),
            None => return Err(e),
        },
    };
    let mut identity = client_identity(claimed, &security);
    let mut client = gangway_proto::client::Client::new(endpoints, &identity, &security)?;
    if let Some(t) = &tls.token {
        client = client.with_bearer(t)?;
        // Who the token names, for `--me` filters; the controllers check it.
        identity = gangway_proto::token::peek_subject(t).map(|u| format!("client:{u}")).unwrap_or_default();
    } else if let Some(c) = job_credential {
        client = client.with_step_credential(&c)?;
        // The job's user (USER may be the submitter's environment).
        let me = std::env::var("SLURM_JOB_USER").ok().filter(|u| !u.is_empty());
        identity = format!("client:{}", me.unwrap_or_else(tls::login_name));
    }
    Ok((client, identity))
}

/// Who this client is: the principal of its certificate on a secured cluster
/// (what the controllers will see), else the claimed identity.
fn client_identity(claimed: Option<String>, security: &gangway_proto::tls::Security) -> String {
    match security.credentials().and_then(|c| c.principal()) {
        Some(p) => p.encode(),
        None => claimed.unwrap_or_else(default_identity),
    }
}

/// Invoked as `sbatch` (a link): the same as `gangway sbatch`.
pub(crate) fn shim_argv() -> Vec<std::ffi::OsString> {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let invoked = argv.first().and_then(|a| std::path::Path::new(a).file_name()).map(|n| n.to_os_string());
    if let Some(name) = invoked.filter(|n| SHIMS.iter().any(|s| n == *s)) {
        argv[0] = "gangway".into();
        argv.insert(1, name);
    }
    argv
}

/// Client commands end quietly when their reader goes away (`squeue | head`),
/// as Unix tools do. SIGPIPE itself stays ignored: a controller or agent that
/// closes a connection (a refused certificate, a plaintext client at a TLS
/// port) must be an error this command reports, not a silent death. A print to
/// a closed stdout then panics in std; this hook turns exactly that into the
/// exit status a tool killed by SIGPIPE has.
fn quiet_on_closed_stdout() {
    /// 128 + SIGPIPE, what a shell sees from a tool that died of it.
    const EXIT_CLOSED_PIPE: i32 = 141;
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied());
        if msg.is_some_and(|m| m.contains("failed printing to stdout") && m.contains("Broken pipe")) {
            std::process::exit(EXIT_CLOSED_PIPE);
        }
        default(info);
    }));
}

/// Runs the `gangway` command line (or the Slurm command this binary was
/// invoked as) and exits.
pub fn main() {
    let cli = Cli::parse_from(shim_argv());
    if !matches!(cli.command, Cmd::Controller(_) | Cmd::Agent(_) | Cmd::Dev(_) | Cmd::Bench(_) | Cmd::TaskShim { .. }) {
        quiet_on_closed_stdout();
    }
    if let Cmd::TaskShim {
        exit_file,
        exec,
        env_stdin,
        pty,
        drain_output,
        user,
        env_file,
        lease,
        workdir,
        cgroup,
        argv,
    } = &cli.command
    {
        // Before any runtime or logging: the shim is only a waiting parent.
        let setup = gangway_node_agent::shim::TaskSetup {
            exec: *exec,
            env_stdin: *env_stdin,
            pty: *pty,
            drain: *drain_output,
            user: user.clone(),
            env_file: env_file.clone(),
            workdir: workdir.clone(),
            cgroups: cgroup.clone(),
            lease: lease.clone(),
        };
        std::process::exit(gangway_node_agent::shim::run(exit_file.as_deref(), &setup, argv));
    }
    if let Cmd::Srun(a) = cli.command {
        // Inside a job srun needs no controller: the job's environment says
        // everything. Outside, it submits a job and waits for it.
        let code = if slurm::srun::inside_job() {
            slurm::srun::run(a)
        } else {
            let out = output::Output { json: cli.json };
            tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime").block_on(async {
                let (client, _) = make_client(&cli.endpoints, cli.identity.clone(), &cli.tls)?;
                slurm::srun::submit_and_wait(&client, &out, a).await
            })
        };
        std::process::exit(code.unwrap_or_else(|e| {
            eprintln!("{}", output::one_line(&e));
            1
        }));
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("GANGWAY_LOG").unwrap_or_else(|_| {
        // The dev cluster forms itself on every start; openraft's election chatter
        // (and its complaint that the other replicas initialized first) is noise there.
        tracing_subscriber::EnvFilter::new(match cli.command {
            Cmd::Dev(_) => "info,openraft=off",
            Cmd::Controller(_) | Cmd::Agent(_) => "info,openraft=warn",
            _ => "warn,openraft=error",
        })
    });
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if cli.log_format == "json" {
        logs.json().init();
    } else {
        logs.init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let identity = cli.identity.clone().unwrap_or_else(default_identity);
    let out = output::Output { json: cli.json };
    let result = runtime.block_on(async move {
        match cli.command {
            Cmd::Controller(a) => daemons::controller(a, &cli.tls).await,
            Cmd::Agent(a) => daemons::agent(a, &identity, &cli.tls).await,
            Cmd::Dev(a) => dev::run(a, &identity, &cli.tls).await,
            Cmd::Tls(t) => tls::run(t),
            Cmd::Token(t) => tls::run_token(t),
            Cmd::Doctor(d) => doctor::run(d, &cli.endpoints, &cli.tls).await,
            Cmd::Bench(b) => bench::run(b).await,
            Cmd::Simulate(s) => simulate::run(s),
            Cmd::Shims(ShimsCmd::Install { prefix, force }) => install_shims(&prefix, force),
            Cmd::Scontrol(a) if slurm::scontrol::is_local(&a) => slurm::scontrol::run_local(&a),
            Cmd::Sbatch { args } if sbatch::help(&args).is_some() => {
                print!("{}", sbatch::help(&args).unwrap_or_default());
                Ok(())
            }
            cmd => {
                let (client, identity) = make_client(&cli.endpoints, cli.identity.clone(), &cli.tls)?;
                match cmd {
                    Cmd::Submit(a) => submit::submit(&client, &out, a).await.map(|_| ()),
                    Cmd::Sbatch { args } => sbatch::run(&client, &out, &args).await,
                    Cmd::Salloc(a) => {
                        let code = slurm::salloc::run(&client, &out, a).await?;
                        std::process::exit(code)
                    }
                    Cmd::Squeue(a) => slurm::squeue::run(&client, &out, &identity, a).await,
                    Cmd::Scancel(a) => slurm::scancel::run(&client, &out, &identity, a).await,
                    Cmd::Sinfo(a) => slurm::sinfo::run(&client, &out, a).await,
                    Cmd::Scontrol(a) => slurm::scontrol::run(&client, &out, a).await,
                    Cmd::Sacct(a) => slurm::sacct::run(&client, &out, &identity, a).await,
                    Cmd::Sreport(a) => slurm::sreport::run(&client, a).await,
                    Cmd::Seff(a) => slurm::seff::run(&client, a).await,
                    Cmd::Queue(a) => commands::queue(&client, &out, a).await,
                    Cmd::Show { job_id, stale } => commands::show(&client, &out, job_id, stale).await,
                    Cmd::Cancel { job_ids } => commands::cancel(&client, &out, &job_ids).await,
                    Cmd::Hold { job_ids, admin } => {
                        use gangway_proto::v1::update_job_request::Change;
                        let c = if admin { Change::AdminHold } else { Change::Hold };
                        jobctl::change_jobs(&client, &out, &job_ids, c, 0).await
                    }
                    Cmd::Release { job_ids } => {
                        let c = gangway_proto::v1::update_job_request::Change::Release;
                        jobctl::change_jobs(&client, &out, &job_ids, c, 0).await
                    }
                    Cmd::Requeue { job_ids, hold } => {
                        use gangway_proto::v1::update_job_request::Change;
                        let c = if hold { Change::RequeueHold } else { Change::Requeue };
                        jobctl::change_jobs(&client, &out, &job_ids, c, 0).await
                    }
                    Cmd::Suspend { job_ids } => {
                        let c = gangway_proto::v1::update_job_request::Change::Suspend;
                        jobctl::change_jobs(&client, &out, &job_ids, c, 0).await
                    }
                    Cmd::Resume { job_ids } => {
                        let c = gangway_proto::v1::update_job_request::Change::Resume;
                        jobctl::change_jobs(&client, &out, &job_ids, c, 0).await
                    }
                    Cmd::Update(a) => jobctl::update(&client, &out, a).await,
                    Cmd::Why { job_id, stale } => jobctl::why(&client, &out, job_id, stale).await,
                    Cmd::Events(a) => events::run(&client, &out, a).await,
                    Cmd::Accounting(a) => accounting::run(client, a).await,
                    Cmd::Admin(a) => policy::run(&client, &out, a).await,
                    Cmd::Nodes { stale } => commands::nodes(&client, &out, stale).await,
                    Cmd::Node(n) => commands::node(&client, &out, n).await,
                    Cmd::Cluster(c) => commands::cluster(&client, &out, c).await,
                    _ => unreachable!("handled above"),
                }
            }
        }
    });
    if let Err(e) = result {
        eprintln!("gangway: {}", output::one_line(&e));
        std::process::exit(1);
    }
}
