//! `gangway sbatch` (also `sbatch` through a link): Slurm's batch submission,
//! reading `#SBATCH` directives the way sbatch does.
//!
//! Directives come from the lines after the `#!` line up to the first command
//! (blank and other comment lines may come between them); a line may hold
//! several options, with a space or `=` before values, quotes as in the shell
//! and a trailing `# comment`. Options on the command line override them.
//! Long options may be shortened to any unambiguous prefix (`--err=`,
//! `--tasks=`). Every option is either applied, accepted with a notice saying
//! it has no effect here, or refused with a message that names the option, the
//! line and what to do instead; an unknown one gets the closest known name.

mod directives;
mod xlate;
#[cfg(test)]
use directives::words;
pub use directives::{directives, Origin, WORDS_MAX};

use std::path::PathBuf;

use anyhow::bail;
use clap::{CommandFactory, Parser};

use crate::jobspec::SubmitArgs;

/// Bytes of a batch script read from disk (the controller's own cap is lower
/// and gives the precise error; this one stops reading a huge wrong file).
const SCRIPT_FILE_BYTES_MAX: u64 = 16 << 20;
/// Environment variables `--export=ALL` may carry (the controller's limit).
const EXPORT_VARS_MAX: usize = 1024;

/// Slurm's sbatch options that Gangway applies. Long names are Slurm's;
/// `--tasks-per-node` is Slurm's alias of `--ntasks-per-node`.
#[derive(Parser, Debug, Default, Clone)]
#[command(
    name = "sbatch",
    about = "Submit a batch script (Slurm's sbatch: #SBATCH directives, then command-line options)",
    args_override_self = true,
    disable_version_flag = true
)]
pub struct SbatchOpts {
    #[command(flatten)]
    res: crate::jobspec::ResourceArgs,
    /// Not before: now+1hour, 16:00, 2026-12-24T08:00, midnight, tomorrow (local time).
    #[arg(short = 'b', long)]
    begin: Option<String>,
    /// Free text kept with the job.
    #[arg(long)]
    comment: Option<String>,
    /// Do not translate the script's #PBS and #BSUB directives.
    #[arg(long = "ignore-pbs")]
    ignore_pbs: bool,
    /// Admins: the job's priority, replacing the computed one (TOP: the highest).
    #[arg(long, value_parser = |v: &str| crate::parse::priority("--priority", v))]
    priority: Option<u32>,
    /// %j job id, %x name, %A array job, %a array index, %N node, %u user, %t rank.
    #[arg(short = 'o', long)]
    output: Option<String>,
    #[arg(short = 'e', long)]
    error: Option<String>,
    /// append (what Gangway does) or truncate.
    #[arg(long = "open-mode")]
    open_mode: Option<String>,
    /// INDEXES[:STEP][%LIMIT], e.g. 0-99:2%8.
    #[arg(short = 'a', long)]
    array: Option<String>,
    /// after:ID, afterok:ID[:ID], afternotok, afterany, aftercorr, singleton; `,` = all, `?` = any.
    #[arg(short = 'd', long)]
    dependency: Option<String>,
    /// [B:]SIG[@SECONDS] before the time limit, e.g. B:USR1@120.
    #[arg(long)]
    signal: Option<String>,
    /// Requeue when a node fails (the default); `=expedite`: first in the
    /// queue, back on its other nodes plus a spare.
    #[arg(long, overrides_with = "no_requeue", num_args = 0..=1, require_equals = true, default_missing_value = "yes")]
    requeue: Option<String>,
    #[arg(long = "no-requeue", overrides_with = "requeue")]
    no_requeue: bool,
    #[arg(short = 'D', long)]
    chdir: Option<String>,
    /// ALL (the default), NONE, or VAR[=VALUE],... (with ALL, added to it).
    #[arg(long)]
    export: Option<String>,
    #[arg(short = 'H', long)]
    hold: bool,
    /// Lower the priority by N (100 when no N).
    #[arg(long, num_args = 0..=1, default_missing_value = "100", allow_hyphen_values = true, require_equals = true)]
    nice: Option<String>,
    /// COUNT[@WAIT]: within one lowest-level topology domain.
    #[arg(long)]
    switches: Option<String>,
    /// yes or no.
    #[arg(long = "kill-on-invalid-dep")]
    kill_on_invalid_dep: Option<String>,
    /// Print only the job id.
    #[arg(long)]
    parsable: bool,
    /// Wait until the job (every element of an array) ends, then exit with
    /// its exit code (the highest of an array's).
    #[arg(short = 'W', long)]
    wait: bool,
    /// Check the script and options and say where and when the job would
    /// start, without submitting it.
    #[arg(long = "test-only")]
    test_only: bool,
    /// Run this command line as the job's script.
    #[arg(long)]
    wrap: Option<String>,
    /// The batch script (or `-`, or none with --wrap).
    script: Option<String>,
    /// Arguments for the script ($1, $2, ...).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// What happens to a Slurm option Gangway does not apply.
enum Treatment {
    /// Accepted; the note says what happens instead.
    Ignored(&'static str),
    /// Refused with this reason and what to do instead.
    Refused(&'static str),
}

/// sbatch's check of an option's value: the error without the option's name.
type ValueCheck = fn(&str) -> Result<(), String>;

/// A Slurm option Gangway does not apply: long name, short name, whether it
/// takes a value, its treatment, and the check sbatch makes of its value
/// (an ignored option's bad value is still refused, as sbatch refuses it).
struct Other {
    long: &'static str,
    short: Option<char>,
    takes_value: bool,
    treatment: Treatment,
    check: Option<ValueCheck>,
}

const fn ignored(long: &'static str, short: Option<char>, takes_value: bool, note: &'static str) -> Other {
    Other { long, short, takes_value, treatment: Treatment::Ignored(note), check: None }
}

const fn refused(long: &'static str, short: Option<char>, takes_value: bool, why: &'static str) -> Other {
    Other { long, short, takes_value, treatment: Treatment::Refused(why), check: None }
}

/// Slurm's `--mail-type` (`parse_mail_type`): a list with at least one of
/// its words, any case.
fn check_mail_type(v: &str) -> Result<(), String> {
    const TYPES: &[&str] = &[
        "NONE",
        "BEGIN",
        "END",
        "FAIL",
        "REQUEUE",
        "ALL",
        "INVALID_DEPEND",
        "STAGE_OUT",
        "TIME_LIMIT",
        "TIME_LIMIT_90",
        "TIME_LIMIT_80",
        "TIME_LIMIT_50",
        "ARRAY_TASKS",
    ];
    if v.split(',').any(|t| TYPES.iter().any(|k| k.eq_ignore_ascii_case(t.trim()))) {
        Ok(())
    } else {
        Err(format!("Invalid --mail-type specification: '{v}'"))
    }
}

/// Slurm's `--wait-all-nodes`: 0 or 1.
fn check_wait_all_nodes(v: &str) -> Result<(), String> {
    match v.trim() {
        "0" | "1" => Ok(()),
        _ => Err(format!("Invalid --wait-all-nodes specification: '{v}' (0 or 1)")),
    }
}

pub(crate) const PYXIS: &str =
    "belongs to the pyxis container plugin (SPANK), which Gangway lacks; start the container \
                     from the script instead (enroot start, apptainer exec, ...)";

/// Every sbatch option Gangway knows but does not apply.
const OTHERS: &[Other] = &[
    Other {
        check: Some(check_mail_type),
        ..ignored(
            "mail-type",
            None,
            true,
            "no mail is sent: Gangway has no mail delivery; follow jobs with `squeue`/`gangway queue`",
        )
    },
    ignored(
        "mail-user",
        None,
        true,
        "no mail is sent: Gangway has no mail delivery; follow jobs with `squeue`/`gangway queue`",
    ),
    ignored("hint", None, true, "tasks are not pinned to cores, so CPU placement hints change nothing"),
    ignored(
        "gpu-bind",
        None,
        true,
        "every task sees all of its node's allocated GPUs (CUDA_VISIBLE_DEVICES); per-task GPU binding is not applied",
    ),
    Other {
        check: Some(check_wait_all_nodes),
        ..ignored(
            "wait-all-nodes",
            None,
            true,
            "a job always starts once all of its nodes are allocated and launched together",
        )
    },
    ignored("overcommit", Some('O'), false, "tasks are not pinned to CPUs, so oversubscribing them needs no flag"),
    ignored("quiet", Some('Q'), false, ""),
    ignored("verbose", Some('v'), false, ""),
    ignored("acctg-freq", None, true, "accounting sampling is not configurable; peak memory is recorded per task"),
    ignored("profile", None, true, "job profiling (HDF5) is not supported; scrape the agents' Prometheus metrics"),
    ignored("propagate", None, true, "resource limits are not propagated from the submit host"),
    ignored("get-user-env", None, false, "jobs get the submitting environment through --export (ALL by default)"),
    ignored("wckey", None, true, "workload characterization keys are not supported; use --account"),
    refused("nodefile", Some('F'), true, "choosing nodes by name is not supported yet; use --constraint"),
    refused("clusters", Some('M'), true, "multi-cluster operation is not supported"),
    refused("distribution", Some('m'), true, "task distribution patterns are not supported yet"),
    refused("mincpus", None, true, "give --cpus-per-task"),
    refused("tmp", None, true, "temporary disk requests are not supported yet"),
    refused("ntasks-per-gpu", None, true, "give --ntasks-per-node and --gpus-per-node"),
    refused("sockets-per-node", None, true, "socket and core layout requests are not supported yet"),
    refused("cores-per-socket", None, true, "socket and core layout requests are not supported yet"),
    refused("threads-per-core", None, true, "socket and core layout requests are not supported yet"),
    refused("core-spec", Some('S'), true, "core specialization is not supported"),
    refused("thread-spec", None, true, "core specialization is not supported"),
    refused("gres-flags", None, true, "GRES binding flags are not supported"),
    refused("network", None, true, "network (switch window) requests are not supported"),
    refused("input", Some('i'), true, "jobs read no standard input; read the file from the script"),
    refused(
        "oversubscribe",
        Some('s'),
        false,
        "sharing nodes is the default for non-exclusive jobs; this flag is not needed",
    ),
    refused("uid", None, true, "jobs run as the submitting user"),
    refused("gid", None, true, "jobs run with the submitting user's group"),
    refused(
        "container",
        None,
        true,
        "OCI containers need a container runtime plugin, which Gangway lacks; start the container from the script",
    ),
    refused(
        "container-id",
        None,
        true,
        "OCI containers need a container runtime plugin, which Gangway lacks; start the container from the script",
    ),
    refused("container-image", None, true, PYXIS),
    refused("container-mounts", None, true, PYXIS),
    refused("container-workdir", None, true, PYXIS),
    refused("container-name", None, true, PYXIS),
    refused("container-save", None, true, PYXIS),
    refused("container-env", None, true, PYXIS),
    refused("container-mount-home", None, false, PYXIS),
    refused("no-container-mount-home", None, false, PYXIS),
    refused("container-remap-root", None, false, PYXIS),
    refused("no-container-remap-root", None, false, PYXIS),
    refused("container-writable", None, false, PYXIS),
    refused("container-readonly", None, false, PYXIS),
];

/// The options clap applies for [`SbatchOpts`]: long names (with aliases),
/// short name, and whether a value must follow (as the next word if not attached).
struct Applied {
    longs: Vec<String>,
    short: Option<char>,
    needs_value: bool,
}

fn applied() -> Vec<Applied> {
    let mut cmd = SbatchOpts::command();
    cmd.build();
    let mut v: Vec<Applied> = cmd
        .get_arguments()
        .filter(|a| !a.is_positional())
        .map(|a| Applied {
            longs: a
                .get_long()
                .into_iter()
                .chain(a.get_all_aliases().unwrap_or_default())
                .map(str::to_string)
                .collect(),
            short: a.get_short(),
            needs_value: a.get_action().takes_values() && a.get_num_args().is_some_and(|n| n.min_values() > 0),
        })
        .collect();
    v.push(Applied { longs: vec!["help".into()], short: Some('h'), needs_value: false });
    v
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Resolves a long option name (maybe an unambiguous prefix) to its full name.
fn resolve_long(name: &str, known: &[String], at: Origin) -> Result<String, String> {
    if known.iter().any(|k| k == name) {
        return Ok(name.to_string());
    }
    let matches: Vec<&String> = known.iter().filter(|k| k.starts_with(name)).collect();
    match matches.as_slice() {
        [one] => Ok((*one).clone()),
        [] => {
            let best = known.iter().min_by_key(|k| edit_distance(name, k));
            let hint = best
                .filter(|b| edit_distance(name, b) <= 3)
                .map(|b| format!("; did you mean --{b}?"))
                .unwrap_or_else(|| "; `gangway sbatch --help` lists the options".into());
            Err(format!("{at}: unknown option --{name}{hint}"))
        }
        many => {
            let names: Vec<String> = many.iter().map(|m| format!("--{m}")).collect();
            Err(format!("{at}: --{name} is ambiguous: it could be {}", names.join(", ")))
        }
    }
}

/// Options parsed from every source, with the notices for accepted-but-ignored ones.
#[derive(Debug, Default)]
pub struct Parsed {
    pub opts: SbatchOpts,
    pub notices: Vec<String>,
    /// A heterogeneous job's further components' options, in order.
    pub components: Vec<SbatchOpts>,
}

/// Normalizes one source's words: long options to their full names, options
/// Gangway does not apply dropped (with a notice) or refused.
fn normalize(
    words: &[String],
    at: Origin,
    known: &[Applied],
    notices: &mut Vec<String>,
) -> Result<Vec<String>, String> {
    let mut all_longs: Vec<String> = known.iter().flat_map(|a| a.longs.iter().cloned()).collect();
    all_longs.extend(OTHERS.iter().map(|o| o.long.to_string()));
    let needs_value = |long: &str| known.iter().any(|a| a.needs_value && a.longs.iter().any(|l| l == long));
    let mut out = Vec::new();
    let mut i = 0;
    let mut positional = false;
    while i < words.len() {
        let w = &words[i];
        i += 1;
        if at == Origin::CommandLine && !positional && w == directives::HET_SEPARATOR {
            // `OPTIONS0 : OPTIONS1 script`: the next component's options.
            out.push(CMDLINE_SEPARATOR.to_string());
            continue;
        }
        if positional || w == "-" || !w.starts_with('-') {
            // The script and its arguments end option parsing (on the command line).
            positional = at == Origin::CommandLine;
            out.push(w.clone());
            continue;
        }
        if w == "--" {
            out.push(w.clone());
            positional = true;
            continue;
        }
        let other = if let Some(body) = w.strip_prefix("--") {
            let (name, value) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (body, None),
            };
            let full = resolve_long(name, &all_longs, at)?;
            match OTHERS.iter().find(|o| o.long == full) {
                Some(o) => Some((o, value, value.is_none())),
                None => {
                    out.push(match value {
                        Some(v) => format!("--{full}={v}"),
                        None => format!("--{full}"),
                    });
                    if value.is_none() && needs_value(&full) && i < words.len() {
                        out.push(words[i].clone());
                        i += 1;
                    }
                    None
                }
            }
        } else {
            let c = w.chars().nth(1).unwrap_or('-');
            match OTHERS.iter().find(|o| o.short == Some(c)) {
                Some(o) => Some((o, None, w.len() == 2)),
                None => {
                    out.push(w.clone());
                    // `-N 2`: the value is the next word.
                    let short_needs_value = known.iter().any(|a| a.short == Some(c) && a.needs_value);
                    if w.len() == 2 && short_needs_value && i < words.len() {
                        out.push(words[i].clone());
                        i += 1;
                    }
                    None
                }
            }
        };
        if let Some((o, inline, value_is_next)) = other {
            match o.treatment {
                Treatment::Refused(why) => return Err(format!("{at}: --{} is not supported: {why}", o.long)),
                Treatment::Ignored(note) => {
                    let value = if o.takes_value && value_is_next {
                        i += 1; // its value
                        words.get(i - 1).map(String::as_str)
                    } else {
                        inline
                    };
                    if let (Some(check), Some(v)) = (o.check, value) {
                        check(v).map_err(|e| format!("{at}: --{}: {e}", o.long))?;
                    }
                    if !note.is_empty() {
                        notices.push(format!("{at}: --{} has no effect: {note}", o.long));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Turns clap's error into one line naming where the words came from.
fn clap_error(e: &clap::Error, at: Origin) -> String {
    let text = e.to_string();
    let mut parts: Vec<&str> = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(m) = line.strip_prefix("error: ") {
            parts.push(m);
        } else if let Some(t) = line.strip_prefix("tip: ") {
            parts.push(t);
        }
    }
    if parts.is_empty() {
        parts.push(text.lines().next().unwrap_or("invalid option"));
    }
    format!("{at}: {}", parts.join("; "))
}

fn parse_words(words: Vec<String>, at: Origin) -> Result<SbatchOpts, String> {
    SbatchOpts::try_parse_from(std::iter::once("sbatch".to_string()).chain(words)).map_err(|e| clap_error(&e, at))
}

/// Why the command line did not parse.
pub enum CommandLineError {
    /// `--help`: the text to print.
    Help(String),
    Bad(String),
}

/// Parses the command line's words (without the program name): the options,
/// the normalized words (applied over the directives later) and notices.
pub fn parse_command_line(argv: &[String]) -> Result<(SbatchOpts, Vec<String>, Vec<String>), CommandLineError> {
    let known = applied();
    let mut notices = Vec::new();
    let words = normalize(argv, Origin::CommandLine, &known, &mut notices).map_err(CommandLineError::Bad)?;
    // Component 0's options and the script; a heterogeneous job's later
    // components are read with the script's directives.
    let (first, _) = split_command_line(&words).map_err(CommandLineError::Bad)?;
    match SbatchOpts::try_parse_from(std::iter::once("sbatch".to_string()).chain(first)) {
        Ok(opts) => Ok((opts, words, notices)),
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => Err(CommandLineError::Help(e.to_string())),
        Err(e) => Err(CommandLineError::Bad(clap_error(&e, Origin::CommandLine))),
    }
}

/// The `SBATCH_*` environment variables sbatch reads as options (its
/// `env_vars[]`): the variable, the option, and whether the option takes
/// the variable's value (a flag ignores it; `--exclusive` and `--requeue`
/// take it when there is one).
const ENV_OPTIONS: &[(&str, &str, EnvValue)] = &[
    ("SBATCH_ACCOUNT", "account", EnvValue::Always),
    ("SBATCH_ARRAY_INX", "array", EnvValue::Always),
    ("SBATCH_ACCTG_FREQ", "acctg-freq", EnvValue::Always),
    ("SBATCH_CLUSTERS", "clusters", EnvValue::Always),
    ("SLURM_CLUSTERS", "clusters", EnvValue::Always),
    ("SBATCH_CONSTRAINT", "constraint", EnvValue::Always),
    ("SBATCH_CORE_SPEC", "core-spec", EnvValue::Always),
    ("SBATCH_CPUS_PER_GPU", "cpus-per-gpu", EnvValue::Always),
    ("SBATCH_DISTRIBUTION", "distribution", EnvValue::Always),
    ("SBATCH_EXCLUSIVE", "exclusive", EnvValue::IfGiven),
    ("SBATCH_EXPORT", "export", EnvValue::Always),
    ("SBATCH_GET_USER_ENV", "get-user-env", EnvValue::Never),
    ("SBATCH_GRES", "gres", EnvValue::Always),
    ("SBATCH_GRES_FLAGS", "gres-flags", EnvValue::Always),
    ("SBATCH_GPUS", "gpus", EnvValue::Always),
    ("SBATCH_GPU_BIND", "gpu-bind", EnvValue::Always),
    ("SBATCH_GPUS_PER_NODE", "gpus-per-node", EnvValue::Always),
    ("SBATCH_GPUS_PER_TASK", "gpus-per-task", EnvValue::Always),
    ("SLURM_HINT", "hint", EnvValue::Always),
    ("SBATCH_HINT", "hint", EnvValue::Always),
    ("SBATCH_JOB_NAME", "job-name", EnvValue::Always),
    ("SBATCH_MEM_PER_CPU", "mem-per-cpu", EnvValue::Always),
    ("SBATCH_MEM_PER_GPU", "mem-per-gpu", EnvValue::Always),
    ("SBATCH_MEM_PER_NODE", "mem", EnvValue::Always),
    ("SBATCH_NETWORK", "network", EnvValue::Always),
    ("SBATCH_NO_REQUEUE", "no-requeue", EnvValue::Never),
    ("SBATCH_OPEN_MODE", "open-mode", EnvValue::Always),
    ("SBATCH_OVERCOMMIT", "overcommit", EnvValue::Never),
    ("SBATCH_PARTITION", "partition", EnvValue::Always),
    ("SBATCH_PROFILE", "profile", EnvValue::Always),
    ("SBATCH_QOS", "qos", EnvValue::Always),
    ("SBATCH_REQ_SWITCH", "switches", EnvValue::Always),
    ("SBATCH_REQUEUE", "requeue", EnvValue::IfGiven),
    ("SBATCH_RESERVATION", "reservation", EnvValue::Always),
    ("SBATCH_SIGNAL", "signal", EnvValue::Always),
    ("SBATCH_THREAD_SPEC", "thread-spec", EnvValue::Always),
    ("SBATCH_THREADS_PER_CORE", "threads-per-core", EnvValue::Always),
    ("SBATCH_TIMELIMIT", "time", EnvValue::Always),
    ("SBATCH_WAIT", "wait", EnvValue::Never),
    ("SBATCH_WAIT_ALL_NODES", "wait-all-nodes", EnvValue::Always),
    ("SBATCH_WCKEY", "wckey", EnvValue::Always),
    ("SBATCH_ERROR", "error", EnvValue::Always),
    ("SBATCH_INPUT", "input", EnvValue::Always),
    ("SBATCH_OUTPUT", "output", EnvValue::Always),
];

/// Whether an `SBATCH_*` variable's value is the option's.
#[derive(Clone, Copy)]
enum EnvValue {
    Always,
    /// A flag: the value is ignored.
    Never,
    /// A flag with an optional value (`--exclusive[=user]`).
    IfGiven,
}

/// The options `environment`'s `SBATCH_*` variables set, as words per
/// variable. sbatch applies them over the directives and under the command
/// line.
/// A variable that names an option Gangway refuses is left out with a
/// notice (a site's environment should not fail every submission).
pub fn env_options(
    environment: impl Iterator<Item = (String, String)>,
    notices: &mut Vec<String>,
) -> Vec<(Origin, Vec<String>)> {
    let env: std::collections::BTreeMap<String, String> = environment.collect();
    ENV_OPTIONS
        .iter()
        .filter_map(|(var, long, value)| {
            let v = env.get(*var)?;
            if let Some(Treatment::Refused(why)) = OTHERS.iter().find(|o| o.long == *long).map(|o| &o.treatment) {
                notices.push(format!("environment variable {var} is ignored: --{long} is not supported: {why}"));
                return None;
            }
            let word = match value {
                EnvValue::Always => format!("--{long}={v}"),
                EnvValue::IfGiven if !v.is_empty() => format!("--{long}={v}"),
                _ => format!("--{long}"),
            };
            Some((Origin::Env(var), vec![word]))
        })
        .collect()
}

/// Applies a script's directives, then the `SBATCH_*` variables' options
/// (`env`), under the command line's options (already normalized
/// `cmdline_words`), as sbatch orders them: each directive line and
/// variable is checked on its own, for where it came from, then all are
/// parsed together, the command line last. The script is checked first as
/// sbatch checks it ([`check_script`]).
pub fn parse_with_script(
    script: &str,
    env: &[(Origin, Vec<String>)],
    cmdline_words: &[String],
    mut notices: Vec<String>,
) -> Result<Parsed, String> {
    check_script(script)?;
    let mut groups = split_components(directives(script, &mut notices)?);
    let mut sources = groups.remove(0);
    // sbatch's own reading of PBS and LSF directives, after its own, unless
    // told not to (anywhere: the command line, a directive).
    let ignore = |w: &String| w == "--ignore-pbs";
    if !cmdline_words.iter().any(ignore) && !sources.iter().any(|(_, w)| w.iter().any(ignore)) {
        sources.extend(xlate::translated(script, &mut notices)?);
    }
    sources.extend(env.iter().cloned());
    let (first, later) = split_command_line(cmdline_words)?;
    let mut parsed = apply_sources(sources, &first, notices)?;
    // Component k: its directives, then its part of the command line.
    let count = groups.len().max(later.len());
    for k in 0..count {
        let words = later.get(k).cloned().unwrap_or_default();
        let mine = groups.get(k).cloned().unwrap_or_default();
        let part = apply_sources(mine, &words, Vec::new())?;
        parsed.notices.extend(part.notices);
        parsed.components.push(part.opts);
    }
    Ok(parsed)
}

/// Directive sources split at `#SBATCH hetjob` lines: component 0's first.
fn split_components(sources: Vec<(Origin, Vec<String>)>) -> Vec<Vec<(Origin, Vec<String>)>> {
    let mut groups = vec![Vec::new()];
    for (at, words) in sources {
        if words.len() == 1 && words[0] == directives::HET_SEPARATOR {
            groups.push(Vec::new());
        } else if let Some(g) = groups.last_mut() {
            g.push((at, words));
        }
    }
    groups
}

/// How the normalized command line marks a `:` between option sets (a NUL
/// cannot be in an argument, so a script argument `:` stays itself).
const CMDLINE_SEPARATOR: &str = "\0:";

/// The normalized command line's words split at `:` between option sets
/// (sbatch's `OPTIONS0 : OPTIONS1 script`): component 0's words with the
/// script and its arguments, and each later component's options.
fn split_command_line(words: &[String]) -> Result<(Vec<String>, Vec<Vec<String>>), String> {
    let groups: Vec<Vec<String>> = words.split(|w| w == CMDLINE_SEPARATOR).map(<[String]>::to_vec).collect();
    if groups.len() > gangway_core::limits::HET_COMPONENTS_MAX.saturating_add(1) {
        return Err(format!(
            "command line: a heterogeneous job has at most {} components",
            gangway_core::limits::HET_COMPONENTS_MAX.saturating_add(1)
        ));
    }
    let mut groups = groups.into_iter();
    let mut first = groups.next().unwrap_or_default();
    let mut later: Vec<Vec<String>> = groups.collect();
    // The script and its arguments end the last component's words: they are the job's.
    if let Some(last) = later.last_mut() {
        let parsed = SbatchOpts::try_parse_from(std::iter::once("sbatch".to_string()).chain(last.iter().cloned()));
        if let Ok(SbatchOpts { script: Some(script), args, .. }) = parsed {
            let at = last.len().saturating_sub(args.len()).saturating_sub(1);
            if last.get(at) == Some(&script) {
                first.extend(last.drain(at..));
            }
        }
    }
    Ok((first, later))
}

/// [`parse_with_script`] without a script (`--wrap`): the `SBATCH_*`
/// variables' options under the command line's.
pub fn parse_env_options(
    cmdline: SbatchOpts,
    env: &[(Origin, Vec<String>)],
    cmdline_words: &[String],
    notices: Vec<String>,
) -> Result<Parsed, String> {
    if env.is_empty() {
        return Ok(Parsed { opts: cmdline, notices, components: Vec::new() });
    }
    apply_sources(env.to_vec(), cmdline_words, notices)
}

/// Options from `sources` (directive lines, variables), each checked on its
/// own, then the command line's over them.
fn apply_sources(
    sources: Vec<(Origin, Vec<String>)>,
    cmdline_words: &[String],
    mut notices: Vec<String>,
) -> Result<Parsed, String> {
    let known = applied();
    let mut all = Vec::new();
    for (at, words) in sources {
        let words = normalize(&words, at, &known, &mut notices)?;
        let line = parse_words(words.clone(), at)?;
        if let Some(stray) = &line.script {
            return Err(format!(
                "{at}: Invalid directive found in batch script: '{stray}' is not an option (directives hold options \
                 only)"
            ));
        }
        all.extend(words);
        if all.len() > WORDS_MAX {
            return Err(format!("the script's directives hold more than {WORDS_MAX} words"));
        }
    }
    all.extend(cmdline_words.iter().cloned());
    let opts = parse_words(all, Origin::CommandLine)?;
    Ok(Parsed { opts, notices, components: Vec::new() })
}

/// The environment `--export` gives the job: `ALL` (the default) is the
/// submitting environment, `NONE` nothing, otherwise the listed variables
/// (`VAR` from the environment, `VAR=VALUE` as given), added to it with `ALL,`.
pub fn export_env(
    spec: Option<&str>,
    environment: impl Iterator<Item = (String, String)>,
) -> Result<Vec<(String, String)>, String> {
    let spec = spec.unwrap_or("ALL");
    let env: Vec<(String, String)> = environment.collect();
    let mut out: Vec<(String, String)> = Vec::new();
    let mut items = export_items(spec);
    if items.is_empty() {
        return Err("--export: give ALL, NONE or VAR[=VALUE],...".into());
    }
    // ALL, NONE and NIL may stand anywhere in the list (any case).
    let keyword = |i: &String, k: &str| i.eq_ignore_ascii_case(k);
    if items.iter().any(|i| keyword(i, "ALL")) {
        out.extend(env.iter().filter(|(k, _)| exportable(k)).cloned());
    }
    items.retain(|i| !["ALL", "NONE", "NIL"].iter().any(|k| keyword(i, k)));
    for item in &items {
        let item = item.as_str();
        match item.split_once('=') {
            Some((k, v)) => {
                out.retain(|(o, _)| o != k);
                out.push((k.to_string(), v.to_string()));
            }
            // An unset variable stays unset, as in Slurm.
            None => {
                if let Some(kv) = env.iter().find(|(k, _)| k == item) {
                    out.retain(|(o, _)| o != item);
                    out.push(kv.clone());
                }
            }
        }
    }
    if out.len() > EXPORT_VARS_MAX {
        return Err(format!(
            "--export: {} environment variables exceed the limit of {EXPORT_VARS_MAX}; use --export=NONE,VAR,...",
            out.len()
        ));
    }
    Ok(out)
}

/// `--export`'s items: split at commas outside '...' and "..." (the quotes
/// removed, so `FOO="a,b"` is one item), blanks around each dropped.
fn export_items(spec: &str) -> Vec<String> {
    let mut items = Vec::new();
    let (mut cur, mut quote) = (String::new(), None);
    for c in spec.chars() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, ',') => items.push(std::mem::take(&mut cur)),
            (_, c) => cur.push(c),
        }
    }
    items.push(cur);
    items.into_iter().map(|i| i.trim().to_string()).filter(|i| !i.is_empty()).collect()
}

/// Variables never carried into a job: the shell's own per-process ones and
/// the submitter's Slurm/Gangway job context, which the job gets anew.
fn exportable(k: &str) -> bool {
    !matches!(k, "_" | "PWD" | "OLDPWD" | "SHLVL")
        && !k.starts_with("SLURM_")
        && !k.starts_with("GANGWAY_")
        && !k.starts_with("BASH_FUNC_")
}

/// Converts sbatch options to Gangway's submit options. `script` is the
/// script's path and text (None with --wrap); `cwd` the submit directory.
pub fn to_submit_args(
    o: SbatchOpts,
    script: Option<(PathBuf, String)>,
    environment: impl Iterator<Item = (String, String)>,
    notices: &mut Vec<String>,
) -> Result<SubmitArgs, String> {
    let exclusive = o.res.exclusive().map_err(|e| e.to_string())?;
    o.res.constraints().map_err(|e| e.to_string())?;
    // Slurm truncates the output files when the job starts unless told to
    // append (its JobFileAppend default).
    let open_mode = match o.open_mode.as_deref() {
        Some(mode) if crate::jobspec::open_mode_truncates(mode)? => "truncate",
        Some(_) => "append",
        None => "truncate",
    };
    if let Some(t) = o.res.time_min.as_deref() {
        let min = crate::parse::job_time_s("--time-min", t)?;
        let limit = o.res.time.as_deref().map(|t| crate::parse::job_time_s("--time", t)).transpose()?;
        if limit.is_some_and(|l| min > l) {
            return Err(format!("--time-min: {t} is longer than --time"));
        }
    }
    if let Some(p) = o.res.partition.as_deref().filter(|p| p.contains(',')) {
        return Err(format!(
            "--partition: '{p}': a job is submitted to one partition here (Slurm's list of partitions, the first \
             that can start it, is not supported yet)"
        ));
    }
    let dependency = o.dependency.as_deref().map(slurm_dependency).transpose()?;
    let array = o.array.as_deref().map(slurm_array);
    // Slurm's "all of each node's memory": Gangway reserves none and sets no
    // limit (`jobspec::job_spec`), so the job may use all of it.
    if crate::jobspec::no_memory_reserved(o.res.mem.as_deref()) && !exclusive {
        notices.push(
            "--mem=0: no memory is asked for per node, so none is reserved or limited (unless the partition sets a \
             default per CPU or GPU) and the job may use all of each node's memory; add --exclusive to keep other \
             jobs off its nodes"
                .into(),
        );
    }
    let nice =
        o.nice.map(|n| n.parse::<i32>().map_err(|_| format!("--nice: '{n}' is not a whole number"))).transpose()?;
    let env = export_env(o.export.as_deref(), environment)?.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    let (script_path, script_text, command) = match (script, &o.wrap) {
        (Some((path, text)), None) => (Some(path), Some(text), o.args.clone()),
        (None, Some(_)) if o.script.is_some() || !o.args.is_empty() => {
            return Err("--wrap: Script arguments not permitted with --wrap option".into())
        }
        (None, Some(_)) => (None, None, Vec::new()),
        (Some(_), Some(_)) => return Err("--wrap: Script arguments not permitted with --wrap option".into()),
        (None, None) => return Err("script: give a batch script (a file, or - for standard input) or --wrap".into()),
    };
    Ok(SubmitArgs {
        res: o.res,
        // Slurm's sbatch has no such option: an admin forces with `gangway submit`.
        force_reservation: false,
        begin: o.begin,
        comment: o.comment,
        priority: o.priority,
        topology: None,
        switches: o.switches,
        dependency,
        array,
        nice,
        hold: o.hold,
        kill_on_invalid_dep: o.kill_on_invalid_dep,
        chdir: o.chdir,
        wrap: o.wrap,
        env,
        idempotency_key: None,
        parsable: o.parsable,
        // Slurm's default output file: slurm-%j.out (slurm-%A_%a.out for arrays)
        // in the submit directory; the agent applies the same default.
        output: o.output,
        error: o.error,
        signal: o.signal,
        requeue: o.requeue,
        no_requeue: o.no_requeue,
        script: script_path,
        script_text,
        command,
        batch: true,
        open_mode: Some(open_mode.to_string()),
        components: Vec::new(),
    })
}

/// The submission `parsed` options make: [`to_submit_args`] for the job
/// (component 0), with a heterogeneous job's further components. `notices`
/// gets the parser's notices first.
pub fn submit_args(
    parsed: Parsed,
    script: Option<(PathBuf, String)>,
    environment: impl Iterator<Item = (String, String)>,
    notices: &mut Vec<String>,
) -> Result<SubmitArgs, String> {
    notices.extend(parsed.notices);
    let components = het_components(&parsed.opts, parsed.components)?;
    let mut args = to_submit_args(parsed.opts, script, environment, notices)?;
    args.components = components;
    Ok(args)
}

/// A heterogeneous job's further components, each one's shape read from
/// its options. The options that are the job's (account, QOS, time limit,
/// ...) are component 0's: a later component may repeat them, not change
/// them. `--partition` and `--exclude` carry over from the component
/// before unless given, as Slurm propagates them.
fn het_components(first: &SbatchOpts, rest: Vec<SbatchOpts>) -> Result<Vec<gangway_proto::v1::JobComponent>, String> {
    let mut carried = (first.res.partition.clone(), first.res.exclude.clone());
    let mut out = Vec::with_capacity(rest.len());
    for (i, mut o) in rest.into_iter().enumerate() {
        let k = i.saturating_add(1);
        crate::jobspec::component_res(k, &mut o.res, &first.res, &mut carried)?;
        let job_wide = [
            ("--dependency", &o.dependency, &first.dependency),
            ("--begin", &o.begin, &first.begin),
            ("--comment", &o.comment, &first.comment),
            ("--output", &o.output, &first.output),
            ("--error", &o.error, &first.error),
            ("--open-mode", &o.open_mode, &first.open_mode),
            ("--signal", &o.signal, &first.signal),
            ("--requeue", &o.requeue, &first.requeue),
            ("--chdir", &o.chdir, &first.chdir),
            ("--export", &o.export, &first.export),
            ("--nice", &o.nice, &first.nice),
            ("--switches", &o.switches, &first.switches),
            ("--kill-on-invalid-dep", &o.kill_on_invalid_dep, &first.kill_on_invalid_dep),
            ("--wrap", &o.wrap, &first.wrap),
        ];
        for (name, mine, theirs) in job_wide {
            crate::jobspec::same_as_first(k, name, mine, theirs)?;
        }
        if o.array.is_some() {
            return Err(format!("hetjob component {k}: --array: a job array cannot be heterogeneous"));
        }
        if o.priority.is_some() && o.priority != first.priority {
            return Err(format!("hetjob component {k}: --priority differs from component 0's"));
        }
        let switches = [
            ("--hold", o.hold, first.hold),
            ("--no-requeue", o.no_requeue, first.no_requeue),
            ("--parsable", o.parsable, first.parsable),
            ("--wait", o.wait, first.wait),
            ("--test-only", o.test_only, first.test_only),
        ];
        if let Some((name, _, _)) = switches.iter().find(|(_, mine, theirs)| *mine && !theirs) {
            return Err(format!("hetjob component {k}: {name} is the whole job's: give it with component 0's options"));
        }
        out.push(crate::jobspec::component(o.res).map_err(|e| format!("hetjob component {k}: {e:#}"))?);
    }
    Ok(out)
}

/// Slurm's `--dependency` in the words the controller reads: types in any
/// case (`afterOK`), a bare job id meaning `afterany` (Slurm's old form).
fn slurm_dependency(d: &str) -> Result<String, String> {
    let mut out = String::with_capacity(d.len());
    let mut item = String::new();
    let flush = |item: &mut String, out: &mut String| -> Result<(), String> {
        let t = std::mem::take(item);
        let t = t.trim();
        if t.is_empty() {
            return Ok(());
        }
        if t.chars().all(|c| c.is_ascii_digit() || c == '_') {
            out.push_str("afterany:");
            out.push_str(t);
            return Ok(());
        }
        let (kind, ids) = t.split_once(':').unwrap_or((t, ""));
        if ids.contains('+') {
            return Err(format!("--dependency: '{t}': a delay after the dependency (+MINUTES) is not supported yet"));
        }
        out.push_str(&kind.to_ascii_lowercase());
        if !ids.is_empty() || t.contains(':') {
            out.push(':');
            out.push_str(ids);
        }
        Ok(())
    };
    for c in d.chars() {
        if matches!(c, ',' | '?') {
            flush(&mut item, &mut out)?;
            out.push(c);
        } else {
            item.push(c);
        }
    }
    flush(&mut item, &mut out)?;
    Ok(out)
}

/// Slurm's `--array` in the words the controller reads: `[0-9]` brackets
/// dropped, and `%0` (no throttle) left out.
fn slurm_array(a: &str) -> String {
    let (inx, throttle) = match a.trim().rsplit_once('%') {
        Some((inx, t)) => (inx, Some(t)),
        None => (a.trim(), None),
    };
    let inx = inx.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(inx);
    match throttle {
        Some(t) if t.trim() != "0" => format!("{inx}%{t}"),
        _ => inx.to_string(),
    }
}

/// Reads the script named on the command line (`-` or none without --wrap:
/// standard input). A script that is not UTF-8 is refused, saying where
/// (Slurm takes any bytes but NUL; Gangway carries scripts as text).
fn read_script(name: Option<&str>, wrap: bool) -> anyhow::Result<Option<(PathBuf, String)>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    let path = match name {
        _ if wrap => return Ok(None),
        None | Some("-") => {
            std::io::stdin().take(SCRIPT_FILE_BYTES_MAX + 1).read_to_end(&mut bytes)?;
            PathBuf::from("sbatch")
        }
        Some(p) => {
            let path = PathBuf::from(p);
            let f = std::fs::File::open(&path).map_err(|e| anyhow::anyhow!("script: cannot read {p}: {e}"))?;
            f.take(SCRIPT_FILE_BYTES_MAX + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| anyhow::anyhow!("script: cannot read {p}: {e}"))?;
            path
        }
    };
    // Refused, never cut short (a script cut short would run another program).
    if bytes.len() as u64 > SCRIPT_FILE_BYTES_MAX {
        anyhow::bail!("script: {} is larger than {SCRIPT_FILE_BYTES_MAX} bytes", path.display());
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "script: {} is not UTF-8 text (byte {} is not): Gangway carries scripts as UTF-8; convert it, e.g. \
             with iconv -f latin1 -t utf-8",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    Ok(Some((path, text)))
}

/// What sbatch checks of a script's text before reading its directives
/// (`_get_script_buffer`), with its words.
pub fn check_script(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err("Batch script is empty!".into());
    }
    if text.trim().is_empty() {
        return Err("Batch script contains only whitespace!".into());
    }
    if !text.starts_with("#!") {
        return Err("This does not look like a batch script.  The first line must start with #! followed by the \
                    path to an interpreter.  For instance: #!/bin/sh"
            .into());
    }
    if text.contains('\0') {
        return Err("The Slurm controller does not allow scripts that contain a NULL character '\\0'.".into());
    }
    if text.contains("\r\n") {
        return Err("Batch script contains DOS line breaks (\\r\\n) instead of expected UNIX line breaks (\\n).".into());
    }
    Ok(())
}

/// `gangway sbatch ARGS...`: parse, then submit (or with --test-only, print).
/// `--help`'s text when the command line asks for it: printed before any
/// controller or certificate is needed.
pub fn help(argv: &[String]) -> Option<String> {
    match parse_command_line(argv) {
        Err(CommandLineError::Help(text)) => Some(text),
        _ => None,
    }
}

pub async fn run(
    client: &gangway_proto::client::Client,
    out: &crate::output::Output,
    argv: &[String],
) -> anyhow::Result<()> {
    let (cmdline, words, notices) = match parse_command_line(argv) {
        Ok(p) => p,
        Err(CommandLineError::Help(text)) => {
            print!("{text}");
            return Ok(());
        }
        Err(CommandLineError::Bad(m)) => bail!("{m}"),
    };
    let script = read_script(cmdline.script.as_deref(), cmdline.wrap.is_some())?;
    let mut notices = notices;
    let env = env_options(std::env::vars(), &mut notices);
    let parsed = match &script {
        Some((_, text)) => parse_with_script(text, &env, &words, notices),
        None => parse_env_options(cmdline, &env, &words, notices),
    }
    .map_err(anyhow::Error::msg)?;
    if script.is_none() && words.iter().any(|w| w == CMDLINE_SEPARATOR) {
        bail!("a heterogeneous job (OPTIONS : OPTIONS) needs a batch script, not --wrap");
    }
    let mut notices = Vec::new();
    let (test_only, wait) = (parsed.opts.test_only, parsed.opts.wait);
    let args = submit_args(parsed, script, std::env::vars(), &mut notices).map_err(anyhow::Error::msg)?;
    for n in &notices {
        eprintln!("sbatch: note: {n}");
    }
    if test_only {
        return crate::submit::test_submit(client, out, args).await;
    }
    let (id, count) = crate::submit::submit(client, out, args).await?;
    if wait {
        let code = wait_for(client, id, count).await?;
        if code != 0 {
            std::process::exit(code);
        }
    }
    Ok(())
}

/// Polls of the submitted jobs while `--wait`ing (every WAIT_POLL): for
/// twice the longest time limit, so a job that waits in the queue as long as
/// it may run is still waited for (the controller ends jobs at their limit).
const WAIT_POLLS_MAX: u64 = 2 * gangway_core::limits::TIME_LIMIT_S_MAX * 1000 / WAIT_POLL_MS;
const WAIT_POLL_MS: u64 = 500;
const WAIT: gangway_proto::retry::Retry =
    gangway_proto::retry::Retry::new(WAIT_POLLS_MAX, std::time::Duration::from_millis(WAIT_POLL_MS));

/// Waits for jobs `id..id+count` to end; the highest exit code.
async fn wait_for(client: &gangway_proto::client::Client, id: u64, count: u32) -> anyhow::Result<i32> {
    use gangway_proto::v1 as pb;
    let mut open: Vec<u64> = (id..id + u64::from(count)).collect();
    let mut worst = 0;
    let mut polls = WAIT.tries();
    while polls.next().await {
        let mut still = Vec::new();
        for job_id in open {
            let job = client.job_get(pb::GetJobRequest { job_id, stale: false }).await?.into_inner();
            if crate::slurm::ended(job.state) {
                worst = worst.max(crate::slurm::job_exit_code(&job));
            } else {
                still.push(job_id);
            }
        }
        open = still;
        if open.is_empty() {
            return Ok(worst);
        }
    }
    bail!("--wait: gave up waiting for job {id} after {:?}", WAIT.span())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--wait` outlasts a job that waits in the queue as long as the
    /// longest time limit and then runs it: WAIT_POLLS_MAX polls, no fewer.
    #[test]
    fn wait_polls_outlast_the_longest_time_limit_twice() {
        let limit = std::time::Duration::from_secs(gangway_core::limits::TIME_LIMIT_S_MAX);
        assert_eq!(WAIT.attempts, WAIT_POLLS_MAX);
        assert!(WAIT.span() >= limit * 2 - WAIT.pause, "{:?}", WAIT.span());
    }
    use gangway_proto::v1 as pb;

    /// A script file of SCRIPT_FILE_BYTES_MAX bytes is read whole; one byte
    /// more is refused, never cut short. A directive line of WORDS_MAX
    /// words is split; one word more is refused, the last word too.
    #[test]
    fn scripts_and_directive_words_stop_at_their_limits() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("job.sh");
        let path = file.to_str().unwrap();
        std::fs::write(&file, "#".repeat(SCRIPT_FILE_BYTES_MAX as usize)).unwrap();
        let (_, text) = read_script(Some(path), false).unwrap().unwrap();
        assert_eq!(text.len() as u64, SCRIPT_FILE_BYTES_MAX);
        std::fs::write(&file, "#".repeat(SCRIPT_FILE_BYTES_MAX as usize + 1)).unwrap();
        let e = read_script(Some(path), false).unwrap_err().to_string();
        assert!(e.starts_with("script:") && e.contains(&SCRIPT_FILE_BYTES_MAX.to_string()), "{e}");
        assert_eq!(directives::words(&"a ".repeat(WORDS_MAX)).unwrap().len(), WORDS_MAX);
        for past in ["a ".repeat(WORDS_MAX + 1), format!("{}a", "a ".repeat(WORDS_MAX))] {
            let e = directives::words(&past).unwrap_err();
            assert!(e.contains(&WORDS_MAX.to_string()), "{e}");
        }
    }

    #[test]
    fn help_needs_no_cluster() {
        let text = help(&["--help".into()]).expect("--help is help");
        assert!(text.contains("--wrap"), "{text}");
        assert!(help(&["-N".into(), "2".into(), "-h".into()]).is_some());
        assert_eq!(help(&["--wrap=true".into()]), None);
    }

    /// The submitting environment the corpus sees.
    const ENV: &[(&str, &str)] =
        &[("HOME", "/home/alice"), ("PATH", "/usr/bin:/bin"), ("PWD", "/home/alice"), ("SLURM_JOB_ID", "77")];

    /// A spec's non-default fields, one per line (env and licenses sorted, script summarized).
    fn render_spec(spec: &pb::JobSpec) -> String {
        let mut s = spec.clone();
        let env: std::collections::BTreeMap<String, String> = s.env.drain().collect();
        let licenses: std::collections::BTreeMap<String, u32> = s.licenses.drain().collect();
        s.script = format!("<{} lines>", spec.script.lines().count());
        if let Ok(d) = std::env::current_dir() {
            if let Some(under) = s.workdir.strip_prefix(&d.display().to_string()) {
                s.workdir = format!("<submit dir>{under}");
            }
        }
        let defaults = [": None,", ": \"\",", ": [],", ": 0,", ": false,", ": {},"];
        let mut out: String = format!("{s:#?}")
            .lines()
            .filter(|l| !defaults.iter().any(|d| l.ends_with(d)))
            .map(|l| format!("{l}\n"))
            .collect();
        for (k, v) in env {
            out.push_str(&format!("env {k}={v}\n"));
        }
        for (k, v) in licenses {
            out.push_str(&format!("license {k}:{v}\n"));
        }
        out
    }

    /// What submitting `script` with `argv` (SCRIPT stands for its path) gives:
    /// notices and the spec, or the error. A `# test-env: VAR=VALUE ...` line
    /// adds to the submitting environment.
    fn render(script: &str, argv: &[String]) -> String {
        let extra: Vec<(String, String)> = script
            .lines()
            .filter_map(|l| l.strip_prefix("# test-env:"))
            .flat_map(str::split_whitespace)
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        let env = || ENV.iter().map(|(k, v)| (k.to_string(), v.to_string())).chain(extra.iter().cloned());
        let (cmdline, words, notices) = match parse_command_line(argv) {
            Ok(p) => p,
            Err(CommandLineError::Bad(m)) => return format!("error: {m}\n"),
            Err(CommandLineError::Help(_)) => return "help\n".into(),
        };
        let path = PathBuf::from(cmdline.script.clone().unwrap_or_default());
        let mut notices = notices;
        let env_words = env_options(env(), &mut notices);
        let parsed = match parse_with_script(script, &env_words, &words, notices) {
            Ok(p) => p,
            Err(m) => return format!("error: {m}\n"),
        };
        let mut notices = Vec::new();
        let args = match submit_args(parsed, Some((path, script.to_string())), env(), &mut notices) {
            Ok(a) => a,
            Err(m) => return format!("error: {m}\n"),
        };
        let mut out: String = notices.iter().map(|n| format!("note: {n}\n")).collect();
        // Set after the submission (an admin's change), so not in the spec.
        let priority = args.priority;
        match crate::jobspec::job_spec(args, Some("rack")) {
            Ok(spec) => out.push_str(&render_spec(&spec)),
            Err(e) => out.push_str(&format!("error: {e:#}\n")),
        }
        if let Some(p) = priority {
            out.push_str(&format!("priority {p}\n"));
        }
        out
    }

    fn corpus_dir() -> PathBuf {
        let dir = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
        PathBuf::from(dir).join("tests/sbatch")
    }

    /// Every script in tests/sbatch/ gives exactly its `.expected` rendering
    /// (`GANGWAY_BLESS=1` rewrites them; review the diff). A script's
    /// `# test-args:` line is its command line, SCRIPT standing for its path.
    #[test]
    fn sbatch_corpus_matches_golden_files() {
        let dir = corpus_dir();
        let mut scripts: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "sh"))
            .collect();
        scripts.sort();
        assert!(scripts.len() >= 10, "expected the corpus in {}", dir.display());
        let bless = std::env::var_os("GANGWAY_BLESS").is_some();
        let mut mismatches = Vec::new();
        for path in scripts {
            let text = std::fs::read_to_string(&path).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let argv: Vec<String> = match text.lines().find_map(|l| l.strip_prefix("# test-args:")) {
                Some(a) => {
                    a.split_whitespace().map(|w| if w == "SCRIPT" { name.clone() } else { w.to_string() }).collect()
                }
                None => vec![name.clone()],
            };
            let got = render(&text, &argv);
            let expected_path = path.with_extension("expected");
            if bless {
                std::fs::write(&expected_path, &got).unwrap();
                continue;
            }
            let want = std::fs::read_to_string(&expected_path).unwrap_or_default();
            if got != want {
                mismatches.push(format!("{name}:\n--- expected\n{want}--- got\n{got}"));
            }
        }
        assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    }

    #[test]
    fn words_split_like_the_shell() {
        assert_eq!(words(r#" -N 2 --job-name="a b" 'c d'  # trailing"#).unwrap(), ["-N", "2", "--job-name=a b", "c d"]);
        assert_eq!(words(r"--x=a\ b\#c#d").unwrap(), ["--x=a b#c"]);
        assert_eq!(words(r"--job-name=run#3").unwrap(), ["--job-name=run"]);
        assert_eq!(words(r"'a\b' 'c#d'").unwrap(), ["ab", "c#d"]);
        assert!(words("--name='x").is_err());
    }

    #[test]
    fn export_picks_the_environment() {
        let env = || ENV.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        let all = export_env(None, env()).unwrap();
        assert!(all.contains(&("HOME".into(), "/home/alice".into())));
        assert!(!all.iter().any(|(k, _)| k == "SLURM_JOB_ID" || k == "PWD"), "{all:?}");
        let some = export_env(Some("ALL,HOME=/x,EXTRA=1"), env()).unwrap();
        assert!(some.contains(&("HOME".into(), "/x".into())) && some.contains(&("EXTRA".into(), "1".into())));
        assert_eq!(export_env(Some("NONE"), env()).unwrap(), vec![]);
        assert_eq!(export_env(Some("PATH,UNSET"), env()).unwrap(), vec![("PATH".into(), "/usr/bin:/bin".into())]);
        // ALL anywhere; a quoted value keeps its commas.
        let late = export_env(Some("FOO=\"a,b\",all"), env()).unwrap();
        assert!(late.contains(&("FOO".into(), "a,b".into())) && late.contains(&("HOME".into(), "/home/alice".into())));
        assert_eq!(export_env(Some("NIL"), env()).unwrap(), vec![]);
        let many = (0..EXPORT_VARS_MAX + 1).map(|i| (format!("V{i}"), "x".to_string()));
        assert!(export_env(None, many).unwrap_err().contains("--export"));
    }
}
